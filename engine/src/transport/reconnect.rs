//! The prefill node's side of a long-lived deployment: it dials the decode
//! node again after each link drop, until the decode node stays
//! unreachable.
//!
//! ```text
//!  serve_prefill ── connect() ──▶ DecodeDialer ── dial `peer`, retrying for `retry` ──▶ decode node
//!       ▲                            │ first call:  "connected to the decode node at PEER over TCP"
//!       │ link dropped               │ later calls: "reconnecting to the decode node over TCP"
//!       └────────── connect() ───────┘              "the link to the decode node dropped (why)"   (TCP)
//!                                                   "connected to the decode node at PEER over TCP"
//!  dial fails (unreachable for `retry`, or the peers did not authenticate each other):
//!       connect() returns None, the node stops, and the error is kept for DecodeDialer::into_failure
//! ```

use std::sync::Arc;
use std::time::Duration;

use crossbeam_channel::Receiver;

use super::tcp::{self, TcpLink, TcpOptions};
use super::{Inbound, Link, LinkDown, ToDecode, ToPrefill};
use crate::error::EngineError;

/// The link to the decode node a [`DecodeDialer`] made, and the inbox of
/// its orders.
pub type Dialed = (Box<dyn Link<ToDecode>>, Receiver<Inbound<ToPrefill>>);

/// How a [`DecodeDialer`] reaches the decode node.
#[derive(Debug)]
enum Dial {
    /// Wire frames over TCP; the last link is kept to say why it dropped.
    Tcp {
        opts: TcpOptions,
        previous: Option<Arc<TcpLink<ToDecode>>>,
    },
    /// RDMA WRITEs, with the TCP connection as the side channel.
    #[cfg(feature = "rdma")]
    Rdma {
        device: Arc<super::rdma::RdmaDevice>,
        auth: Option<super::peer_auth::PeerKey>,
    },
}

/// Makes the prefill node's links to the decode node at one address, one
/// per call of [`DecodeDialer::connect`], and says each on stderr.
#[derive(Debug)]
pub struct DecodeDialer {
    peer: String,
    retry: Duration,
    dial: Dial,
    connected: bool,
    failure: Option<EngineError>,
}

impl DecodeDialer {
    /// Dials `peer` over TCP with `opts`, retrying each connection for
    /// `retry`.
    #[must_use]
    pub fn tcp(peer: &str, retry: Duration, opts: TcpOptions) -> DecodeDialer {
        DecodeDialer::new(
            peer,
            retry,
            Dial::Tcp {
                opts,
                previous: None,
            },
        )
    }

    /// Dials `peer` over RDMA on `device` (proving it holds `auth` when
    /// set), retrying each connection for `retry`.
    #[cfg(feature = "rdma")]
    #[must_use]
    pub fn rdma(
        peer: &str,
        retry: Duration,
        device: Arc<super::rdma::RdmaDevice>,
        auth: Option<super::peer_auth::PeerKey>,
    ) -> DecodeDialer {
        DecodeDialer::new(peer, retry, Dial::Rdma { device, auth })
    }

    fn new(peer: &str, retry: Duration, dial: Dial) -> DecodeDialer {
        DecodeDialer {
            peer: peer.to_string(),
            retry,
            dial,
            connected: false,
            failure: None,
        }
    }

    /// What carries the KV (`TCP`, `RDMA`), as the log lines name it.
    #[must_use]
    pub fn transport(&self) -> &'static str {
        match self.dial {
            Dial::Tcp { .. } => "TCP",
            #[cfg(feature = "rdma")]
            Dial::Rdma { .. } => "RDMA",
        }
    }

    /// The next link to the decode node: the first, or after a drop a new
    /// one. `None` once dialing failed; the error is then
    /// [`DecodeDialer::into_failure`]'s.
    pub fn connect(&mut self) -> Option<Dialed> {
        let transport = self.transport();
        if self.connected {
            eprintln!("kvsan: reconnecting to the decode node over {transport}");
        }
        match self.dial() {
            Ok(dialed) => {
                eprintln!(
                    "kvsan: connected to the decode node at {} over {transport}",
                    self.peer
                );
                self.connected = true;
                Some(dialed)
            }
            Err(e) => {
                self.failure = Some(e);
                None
            }
        }
    }

    /// Why the last [`DecodeDialer::connect`] gave no link (`None` when it
    /// never failed).
    #[must_use]
    pub fn into_failure(self) -> Option<EngineError> {
        self.failure
    }

    fn dial(&mut self) -> Result<Dialed, EngineError> {
        let (peer, retry, reconnecting) = (self.peer.as_str(), self.retry, self.connected);
        match &mut self.dial {
            Dial::Tcp { opts, previous } => {
                if let Some(prev) = previous.take().filter(|_| reconnecting) {
                    let why = prev
                        .down_reason()
                        .unwrap_or_else(|| "the link closed".into());
                    eprintln!("kvsan: the link to the decode node dropped ({why})");
                }
                let (link, rx) = tcp::connect_prefill(peer, retry, opts)?;
                let link = Arc::new(link);
                *previous = Some(link.clone());
                Ok((Box::new(SharedLink(link)), rx))
            }
            #[cfg(feature = "rdma")]
            Dial::Rdma { device, auth } => {
                let (link, rx) = super::rdma::connect_prefill(peer, retry, device, auth.as_ref())?;
                Ok((Box::new(link), rx))
            }
        }
    }
}

/// A TCP link the dialer keeps a handle on, to say why it dropped.
struct SharedLink(Arc<TcpLink<ToDecode>>);

impl Link<ToDecode> for SharedLink {
    fn send(&self, msg: ToDecode) -> Result<(), LinkDown> {
        self.0.send(msg)
    }
}
