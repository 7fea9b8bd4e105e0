//! What can go wrong on an RDMA link: a verbs call, finding the device, the
//! connection protocol, or the TCP side channel.

/// An RDMA link or device that failed (feature `rdma`).
#[derive(Debug, thiserror::Error)]
#[non_exhaustive]
pub enum RdmaError {
    /// An RDMA verbs call failed, or the RDMA library is not installed.
    #[error("RDMA {op} on {device} failed: {detail}")]
    Verbs {
        /// The verbs operation (`open device`, `register memory`, `post send`, …).
        op: &'static str,
        /// The RDMA device (`-` before one is chosen).
        device: String,
        /// The library's error with its causes (`failed to get device list:
        /// Function not implemented (os error 38)`).
        detail: String,
        /// The library's error.
        #[source]
        source: Box<dyn std::error::Error + Send + Sync>,
    },

    /// No RDMA device, or not the one asked for.
    #[error("no RDMA device{}: found {found:?}", wanted.as_ref().map(|w| format!(" named '{w}'")).unwrap_or_default())]
    NoDevice {
        /// The device asked for (`None`: any).
        wanted: Option<String>,
        /// The devices present.
        found: Vec<String>,
    },

    /// The RDMA peer broke the connection protocol: a bad handshake, a
    /// malformed or oversize message, a transfer outside the remote pool.
    #[error("RDMA link with {peer}: {what}")]
    Protocol {
        /// The peer (an address, `prefill`, `decode`).
        peer: String,
        /// What is wrong, with the value and the limit.
        what: String,
    },

    /// The TCP side channel of an RDMA link failed.
    #[error("RDMA side channel with {peer}: {op} failed: {source}")]
    SideChannel {
        /// The peer's address.
        peer: String,
        /// What was being done (`send connection data`, `read message`, …).
        op: &'static str,
        /// The operating system's error.
        #[source]
        source: std::io::Error,
    },
}
