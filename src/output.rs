//! How the CLI reports errors: a line on stderr, or with `--json` one object
//! `{"error": {"kind": …, "message": …}}` on stdout.

use kvsan_engine::EngineError;
use kvsan_engine::request::RequestError;
use serde_json::{Value, json};

/// The stable kind name of an error, for `--json` output.
fn kind(err: &anyhow::Error) -> &'static str {
    if let Some(e) = err.downcast_ref::<RequestError>() {
        return e.kind.name();
    }
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
        Some(EngineError::Config { .. } | EngineError::PoolSmallerThanContext { .. }) => "config",
        Some(_) => "engine",
        None => "error",
    }
}

/// Prints `err` for a person (stderr) or, with `json`, as one object on stdout.
pub fn print_error(err: &anyhow::Error, json: bool) {
    if json {
        let mut obj = json!({ "kind": kind(err), "message": format!("{err:#}") });
        if let Some(e) = err.downcast_ref::<RequestError>() {
            if let Some(r) = &e.rejection {
                obj["reason"] = Value::from(r.reason.as_str());
                obj["prompt_tokens"] = Value::from(r.prompt_tokens);
                obj["limit"] = Value::from(r.limit);
                obj["node"] = Value::from(r.node.as_str());
            }
            if let Some(v) = &e.violation {
                obj["violation"] = json!(v);
            }
        }
        println!("{}", json!({ "error": obj }));
    } else {
        eprintln!("kvsan: error: {err:#}");
    }
}
