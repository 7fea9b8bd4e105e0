//! What can go wrong authenticating a peer link: the key file, the
//! handshake, and an authenticated record that does not verify.

use std::path::PathBuf;

/// A peer key that cannot be used, a peer that fails the handshake, or a
/// record that fails authentication on an established link.
#[derive(Debug, thiserror::Error)]
#[non_exhaustive]
pub enum PeerAuthError {
    /// The key file cannot be read.
    #[error("peer key {path}: cannot read it: {source}")]
    KeyFile {
        /// The file.
        path: PathBuf,
        /// The operating system's error.
        #[source]
        source: std::io::Error,
    },

    /// The key file's contents cannot be used as a key.
    #[error("peer key {path}: {what}")]
    KeyMalformed {
        /// The file.
        path: PathBuf,
        /// What is wrong, with the value found and the limit.
        what: String,
    },

    /// Reading or writing the handshake failed, or the peer did not finish
    /// it before the deadline.
    #[error("peer {peer}: handshake {op} failed: {source}")]
    Io {
        /// The peer's address and role.
        peer: String,
        /// What was being done (`send hello`, `read proof`, …).
        op: &'static str,
        /// The operating system's error (`TimedOut` for a stalled peer).
        #[source]
        source: std::io::Error,
    },

    /// The peer does not speak the authenticated handshake: it runs without
    /// a key (`--insecure-peer-link`), or is not a kvsan node at all.
    #[error(
        "peer {peer}: refused: it did not open an authenticated handshake (expected \"KVSNAUTH\", found {found:02x?}); start it with the same --peer-key"
    )]
    NotAuthenticating {
        /// The peer's address and role.
        peer: String,
        /// The first bytes it sent.
        found: [u8; 8],
    },

    /// The peer's handshake is of another version or claims the wrong role.
    #[error("peer {peer}: refused: {what}")]
    Mismatch {
        /// The peer's address and role.
        peer: String,
        /// What differs, with the values found and expected.
        what: String,
    },

    /// The peer's proof does not verify: it does not hold this deployment's key.
    #[error(
        "peer {peer}: refused: its key proof does not verify (it holds another key, or replays an old handshake)"
    )]
    BadProof {
        /// The peer's address and role.
        peer: String,
    },

    /// A record on an authenticated link does not verify: it was altered,
    /// replayed, reordered or forged, or a record before it was dropped.
    #[error(
        "authenticated record {seq} refused: its tag does not verify (altered, replayed, reordered or forged bytes)"
    )]
    BadTag {
        /// The record's sequence number (the one the receiver expected).
        seq: u64,
    },

    /// A record on an authenticated link declares an impossible length.
    #[error("authenticated record {seq} refused: length {len} is outside 1..={limit} bytes")]
    RecordLength {
        /// The record's sequence number.
        seq: u64,
        /// The length declared.
        len: u64,
        /// The largest record.
        limit: u64,
    },
}
