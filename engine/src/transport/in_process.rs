//! Links between two nodes in one process: unbounded channels.

use crossbeam_channel::{Receiver, Sender, unbounded};

use super::{Inbound, Link, LinkDown, ToDecode, ToPrefill};

/// The sending half of an in-process link.
#[derive(Debug)]
pub struct ChannelLink<M> {
    peer: &'static str,
    tx: Sender<Inbound<M>>,
}

impl<M: Send> Link<M> for ChannelLink<M> {
    fn send(&self, msg: M) -> Result<(), LinkDown> {
        self.tx.send(Inbound::Message(msg)).map_err(|_| LinkDown {
            peer: self.peer.to_string(),
            reason: "the node has stopped".into(),
        })
    }
}

impl<M> ChannelLink<M> {
    /// Tells the receiver the link is gone (a node stopping, or a test
    /// simulating a crash).
    pub fn disconnect(&self, reason: &str) {
        let _ = self.tx.send(Inbound::Disconnected {
            reason: reason.to_string(),
        });
    }
}

/// Both directions between a decode and a prefill node in one process.
#[derive(Debug)]
pub struct InProcessPair {
    /// Decode's link to prefill.
    pub to_prefill: ChannelLink<ToPrefill>,
    /// Prefill's inbox.
    pub prefill_inbox: Receiver<Inbound<ToPrefill>>,
    /// Prefill's link to decode.
    pub to_decode: ChannelLink<ToDecode>,
    /// Decode's inbox.
    pub decode_inbox: Receiver<Inbound<ToDecode>>,
}

/// A connected pair of in-process links.
#[must_use]
pub fn pair() -> InProcessPair {
    let (ptx, prx) = unbounded();
    let (dtx, drx) = unbounded();
    InProcessPair {
        to_prefill: ChannelLink {
            peer: "prefill",
            tx: ptx,
        },
        prefill_inbox: prx,
        to_decode: ChannelLink {
            peer: "decode",
            tx: dtx,
        },
        decode_inbox: drx,
    }
}
