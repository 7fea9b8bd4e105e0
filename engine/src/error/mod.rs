//! The engine's error type, and where each subsystem's own type lives.
//!
//! Every variant names the input that was wrong (a file, a key, a tensor, a
//! parameter) and the limit or expectation it broke, so that a user who hands
//! the engine a corrupt model file or a bad option can see what to fix.
//!
//! A subsystem with failures of its own has its own type, in a file of this
//! module named after it (so the subsystems import their errors and this
//! module imports none of them), re-exported by the subsystem, and
//! [`EngineError`] wraps each one transparently (same message, `?` converts):
//!
//! | type | module | what fails |
//! | --- | --- | --- |
//! | [`GgufError`] | `error/gguf.rs` | a GGUF file's header, metadata or tensor table |
//! | [`TokenizerError`] | `error/tokenizer.rs` | the tokenizer, the chat template, encoding a text |
//! | [`FetchError`] | `error/fetch.rs` | fetching and verifying the default model |
//! | [`PoolError`] | `error/pool.rs` | allocating the KV pool, returning a page to it |
//! | [`WireError`] | `error/wire.rs` | writing, reading and decoding transport frames |
//! | [`PeerAuthError`] | `error/peer_auth.rs` | peer keys, the peer-link handshake, authenticated records |
//! | `RdmaError` | `error/rdma.rs` | RDMA devices and links (feature `rdma`) |
//!
//! What is left here is generic (I/O on a named file, configuration, the
//! sanitizer and hook table) or spans subsystems (the model, a forward
//! step's batch, a KV transfer's shape, setting up TCP links).

use std::path::PathBuf;

mod fetch;
mod gguf;
mod peer_auth;
mod pool;
#[cfg(feature = "rdma")]
mod rdma;
mod tokenizer;
mod wire;

pub use self::fetch::FetchError;
pub use self::gguf::GgufError;
pub use self::peer_auth::PeerAuthError;
pub use self::pool::PoolError;
#[cfg(feature = "rdma")]
pub use self::rdma::RdmaError;
pub use self::tokenizer::TokenizerError;
pub use self::wire::WireError;

/// Everything that can fail in `kvsan-engine`.
#[derive(Debug, thiserror::Error)]
#[non_exhaustive]
pub enum EngineError {
    /// A file could not be opened, read, mapped, written or renamed.
    #[error("{path}: {op} failed: {source}")]
    Io {
        /// The file or directory.
        path: PathBuf,
        /// What was being done (`open`, `memory-map`, `rename`, …).
        op: &'static str,
        /// The operating system's error.
        #[source]
        source: std::io::Error,
    },

    /// A GGUF file's contents are invalid.
    #[error(transparent)]
    Gguf(#[from] GgufError),

    /// A tokenizer or chat template cannot be used, or a text not encoded.
    #[error(transparent)]
    Tokenizer(#[from] TokenizerError),

    /// Fetching or verifying the default model failed.
    #[error(transparent)]
    Fetch(#[from] FetchError),

    /// A KV pool cannot be allocated, or a page not returned to it.
    #[error(transparent)]
    Pool(#[from] PoolError),

    /// A transport frame cannot be written, read or decoded.
    #[error(transparent)]
    Wire(#[from] WireError),

    /// A peer key cannot be used, or a peer failed authentication.
    #[error(transparent)]
    PeerAuth(#[from] PeerAuthError),

    /// An RDMA link or device failed.
    #[cfg(feature = "rdma")]
    #[error(transparent)]
    Rdma(#[from] RdmaError),

    /// A sampling parameter is outside its allowed range.
    #[error("sampling parameter {name} = {value} is out of range (allowed: {allowed})")]
    InvalidSamplingParam {
        /// The parameter (`temperature`, `top_p`, …).
        name: &'static str,
        /// The value given.
        value: String,
        /// The allowed range.
        allowed: &'static str,
    },

    /// The model file is of an architecture or variant this engine does not run.
    #[error("{path}: unsupported model: {what}")]
    ModelUnsupported {
        /// The model file.
        path: PathBuf,
        /// What is unsupported, and what is.
        what: String,
    },

    /// The model's hyper-parameters are inconsistent.
    #[error("{path}: invalid model: {what}")]
    ModelInvalid {
        /// The model file (`<synthetic>` for a synthetic model).
        path: PathBuf,
        /// The values that do not fit together.
        what: String,
    },

    /// A forward step was handed a chunk it cannot run.
    #[error("forward step: chunk {chunk}: {what}")]
    InvalidBatch {
        /// Index of the chunk in the step.
        chunk: usize,
        /// What is wrong, with the value and the limit.
        what: String,
    },

    /// A KV transfer's bytes do not fit what its manifest describes.
    #[error("KV transfer does not fit its manifest: {what}")]
    TransferShape {
        /// What is wrong, with the sizes.
        what: String,
    },

    /// An engine configuration value is out of range.
    #[error("invalid engine configuration: {what}")]
    Config {
        /// The value and its allowed range.
        what: String,
    },

    /// The in-process sanitizer could not be set up (debug-build mode): a
    /// bad `KVSAN_OPTIONS` key, value or item, or a log file that cannot be
    /// opened; the source names which.
    #[error("kvsan sanitizer: {source}")]
    Sanitizer {
        /// What the sanitizer refused.
        #[source]
        source: kvsan_sanitizer::SanitizerError,
    },

    /// A C hook table (exported by a preloaded library) was not attached.
    #[error("kvsan hook table rejected: {what}")]
    HookTable {
        /// What is wrong with it, with the value and what the engine needs.
        what: String,
    },

    /// A node's pool cannot hold one full-context request.
    #[error(
        "the {node} node's KV pool of {pool_tokens} tokens cannot hold one request of the full {context}-token context; give a larger pool or allow it (--allow-pool-smaller-than-context), and requests that do not fit are then rejected"
    )]
    PoolSmallerThanContext {
        /// The node.
        node: String,
        /// Tokens its pool holds.
        pool_tokens: usize,
        /// The context served.
        context: usize,
    },

    /// The KV kernels refused an access of a batch built outside a node
    /// (`Model::forward_chunks`): a stale tag, a page outside the pool.
    #[error("attention refused: {0}")]
    Attention(#[from] kvsan_kernels::error::KernelError),

    /// A TCP listener could not be bound.
    #[error("cannot listen on {addr}: {source}")]
    TcpListen {
        /// The address asked for.
        addr: String,
        /// The operating system's error.
        #[source]
        source: std::io::Error,
    },

    /// No TCP connection to a peer could be made within the retry window.
    #[error("cannot connect to {addr} (kept trying for {waited:?}): {source}")]
    TcpConnect {
        /// The address asked for.
        addr: String,
        /// How long connecting was retried.
        waited: std::time::Duration,
        /// The last attempt's error.
        #[source]
        source: std::io::Error,
    },
}

impl EngineError {
    /// An [`EngineError::Io`] for `op` on `path`.
    pub(crate) fn io(path: impl Into<PathBuf>, op: &'static str, source: std::io::Error) -> Self {
        EngineError::Io {
            path: path.into(),
            op,
            source,
        }
    }
}
