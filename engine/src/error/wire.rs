//! What can go wrong reading or writing a wire frame: framing lost (bad
//! magic, version or header, an oversize or truncated frame, the connection
//! failing) or one frame's payload damaged (checksum, message type,
//! malformed field). [`frame_fault_keeps_stream`](crate::transport::wire::frame_fault_keeps_stream)
//! tells the two apart.

/// A transport frame that cannot be written, read or decoded.
#[derive(Debug, thiserror::Error)]
#[non_exhaustive]
pub enum WireError {
    /// A transport frame does not start with the protocol's magic bytes
    /// (the peer does not speak the kvsan wire protocol, or framing was lost).
    #[error("transport frame: bad magic: expected \"KVSN\" (4b 56 53 4e), found {found:02x?}")]
    BadMagic {
        /// The first four bytes of the frame.
        found: [u8; 4],
    },

    /// A transport frame declares a protocol version this build does not speak.
    #[error(
        "transport frame: protocol version {version} is not supported (supported: {supported:?})"
    )]
    UnsupportedVersion {
        /// The version the frame declares.
        version: u16,
        /// The versions this build reads.
        supported: &'static [u16],
    },

    /// A transport frame's header is inconsistent (its own checksum, or
    /// flag bits that no version defines): framing can no longer be trusted.
    #[error("transport frame: corrupt header: {what}")]
    BadHeader {
        /// What is wrong, with the values found and expected.
        what: String,
    },

    /// A transport frame's payload is larger than the receiver accepts.
    #[error(
        "transport frame of type {msg_type}: payload of {len} bytes exceeds the frame limit of {limit} bytes"
    )]
    FrameTooLarge {
        /// The frame's message type.
        msg_type: u8,
        /// The payload length declared (or needed, when encoding).
        len: u64,
        /// The limit.
        limit: u64,
    },

    /// The stream ended inside a frame.
    #[error(
        "truncated transport frame: the stream ended in the {part} after {got} of {needed} bytes"
    )]
    Truncated {
        /// `header` or `payload`.
        part: &'static str,
        /// Bytes of that part received.
        got: u64,
        /// Bytes of that part the frame needs.
        needed: u64,
    },

    /// A well-delimited frame carries a message type the receiving side
    /// does not accept.
    #[error(
        "transport frame: message type {msg_type} is not accepted on the {direction} link (accepted: {accepted}){}",
        request.map(|r| format!(" (request {})", r.0)).unwrap_or_default()
    )]
    UnknownMessageType {
        /// The type found.
        msg_type: u8,
        /// The request the header names, if any.
        request: Option<kvsan_sanitizer::RequestId>,
        /// The link's direction (`decode → prefill`, `prefill → decode`).
        direction: &'static str,
        /// The types that direction accepts, with their names.
        accepted: &'static str,
    },

    /// A well-delimited frame's payload does not match its checksum.
    #[error(
        "transport frame of type {msg_type}{}: payload checksum mismatch: header says {expected:#018x}, payload hashes to {actual:#018x}",
        request.map(|r| format!(" for request {}", r.0)).unwrap_or_default()
    )]
    ChecksumMismatch {
        /// The frame's message type.
        msg_type: u8,
        /// The request the header names, if any.
        request: Option<kvsan_sanitizer::RequestId>,
        /// The XXH3-64 the header carries.
        expected: u64,
        /// The XXH3-64 of the payload received.
        actual: u64,
    },

    /// A well-delimited frame's payload cannot be decoded as its message.
    #[error(
        "transport frame of type {msg_type}{}: malformed payload: field {field}: {what}",
        request.map(|r| format!(" for request {}", r.0)).unwrap_or_default()
    )]
    Malformed {
        /// The frame's message type.
        msg_type: u8,
        /// The request the header names, if any.
        request: Option<kvsan_sanitizer::RequestId>,
        /// The field that could not be decoded (`manifest.dst_pages`, …).
        field: &'static str,
        /// What is wrong, with the values and the limit.
        what: String,
    },

    /// Reading or writing a transport connection failed.
    #[error("transport connection with {peer}: {op} failed: {source}")]
    Io {
        /// The peer (`prefill@127.0.0.1:7001`, or `peer` when unknown).
        peer: String,
        /// What was being done (`read`, `write`, `set TCP_NODELAY`, …).
        op: &'static str,
        /// The operating system's error.
        #[source]
        source: std::io::Error,
    },
}
