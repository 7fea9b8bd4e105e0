//! The nodes: a unified node (prefill and decode on one pool), and the
//! prefill and decode nodes of a disaggregated deployment. Each runs on its
//! own thread and owns its pool; clients and peers talk to it by messages.

pub(crate) mod admission;
pub(crate) mod batch;
pub(crate) mod decode;
pub(crate) mod executor;
pub(crate) mod lifecycle;
pub(crate) mod prefill;
pub mod scheduler;
pub(crate) mod sequence;
pub(crate) mod step_loop;
pub(crate) mod unified;

use crossbeam_channel::{Receiver, Sender};
use kvsan_sanitizer::{Owner, RequestId};

pub use self::executor::NodeStats;
use crate::request::{Event, Request};
use crate::transport::{Inbound, LandingZone, Link, ToDecode, ToPrefill};

/// What a node's thread receives.
pub(crate) enum Command {
    /// A new request from a client.
    Submit {
        owner: Owner,
        request: Request,
        events: Sender<Event>,
    },
    /// The client cancels a request.
    Cancel(RequestId),
    /// Report the node's counters.
    Stats(Sender<NodeStats>),
    /// (Decode node) a link to a prefill node came up; `landing` is the
    /// registered pool range an RDMA link offered its peer (`None`: the
    /// link carries KV bytes in its messages).
    AttachPrefill {
        link: Box<dyn Link<ToPrefill>>,
        inbox: Receiver<Inbound<ToDecode>>,
        landing: Option<LandingZone>,
    },
    /// (Decode node) a message from the prefill link of epoch `epoch`.
    FromPrefill {
        epoch: u64,
        inbound: Inbound<ToDecode>,
    },
    /// Finish the current step, fail what is left, stop.
    Shutdown,
}
