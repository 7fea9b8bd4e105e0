//! How the CLI reports errors: a line on stderr, or with `--json` one object
//! `{"error": {"kind": …, "message": …}}` on stdout.

use kvsan_engine::EngineError;
use serde_json::json;

/// The stable kind name of an error, for `--json` output.
fn kind(err: &anyhow::Error) -> &'static str {
    match err.downcast_ref::<EngineError>() {
        Some(EngineError::Io { .. }) => "io",
        Some(
            EngineError::GgufBadMagic { .. }
            | EngineError::GgufUnsupportedVersion { .. }
            | EngineError::GgufTruncated { .. }
            | EngineError::GgufCorrupt { .. }
            | EngineError::GgufUnknownTensorType { .. }
            | EngineError::GgufBadTensor { .. }
            | EngineError::GgufMissingKey { .. }
            | EngineError::GgufKeyType { .. }
            | EngineError::GgufMissingTensor { .. }
            | EngineError::ModelUnsupported { .. }
            | EngineError::ModelInvalid { .. },
        ) => "model",
        Some(
            EngineError::TokenizerUnsupported { .. }
            | EngineError::TokenizerInvalid { .. }
            | EngineError::TokenizerEncode { .. }
            | EngineError::ChatTemplateUnsupported { .. },
        ) => "tokenizer",
        Some(EngineError::InvalidSamplingParam { .. }) => "invalid-argument",
        Some(
            EngineError::FetchToolMissing { .. }
            | EngineError::FetchFailed { .. }
            | EngineError::ChecksumMismatch { .. },
        ) => "fetch",
        Some(EngineError::InvalidBatch { .. }) => "invalid-request",
        Some(_) => "engine",
        None => "error",
    }
}

/// Prints `err` for a person (stderr) or, with `json`, as one object on stdout.
pub fn print_error(err: &anyhow::Error, json: bool) {
    if json {
        let obj = json!({ "error": { "kind": kind(err), "message": format!("{err:#}") } });
        println!("{obj}");
    } else {
        eprintln!("kvsan: error: {err:#}");
    }
}
