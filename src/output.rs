//! How the CLI reports errors: a line on stderr, or with `--json` one object
//! `{"error": {"kind": …, "message": …}}` on stdout.

use kvsan_engine::EngineError;
use kvsan_engine::error::{FetchError, GgufError, PoolError, TokenizerError, WireError};
use kvsan_engine::request::RequestError;
use serde_json::{Value, json};

/// The stable kind name of an error, for `--json` output.
fn kind(err: &anyhow::Error) -> &'static str {
    if let Some(e) = err.downcast_ref::<RequestError>() {
        return e.kind.name();
    }
    if let Some(e) = err.downcast_ref::<EngineError>() {
        return engine_kind(e);
    }
    // A subsystem's error that reached the CLI without passing through an
    // `EngineError` has the kind its `EngineError` variant would have.
    if err.is::<GgufError>() {
        "model"
    } else if err.is::<TokenizerError>() {
        "tokenizer"
    } else if err.is::<FetchError>() {
        "fetch"
    } else if err.is::<PoolError>() || err.is::<WireError>() {
        "engine"
    } else {
        "error"
    }
}

/// The stable kind name of an engine error.
fn engine_kind(err: &EngineError) -> &'static str {
    match err {
        EngineError::Io { .. } => "io",
        EngineError::Gguf(_)
        | EngineError::ModelUnsupported { .. }
        | EngineError::ModelInvalid { .. } => "model",
        EngineError::Tokenizer(_) => "tokenizer",
        EngineError::InvalidSamplingParam { .. } => "invalid-argument",
        EngineError::Fetch(_) => "fetch",
        EngineError::InvalidBatch { .. } => "invalid-request",
        EngineError::Config { .. } | EngineError::PoolSmallerThanContext { .. } => "config",
        _ => "engine",
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

#[cfg(test)]
mod tests {
    use std::path::PathBuf;

    use super::*;

    #[test]
    fn a_subsystem_error_has_the_same_kind_bare_wrapped_or_with_context() {
        let gguf = || GgufError::MissingTensor {
            path: PathBuf::from("m.gguf"),
            tensor: "output.weight".into(),
        };
        let tokenizer = || TokenizerError::Encode {
            text_len: 3,
            reason: "bad".into(),
        };
        let fetch = || FetchError::Failed {
            command: "pip".into(),
            outcome: "exited with 1".into(),
            manual: "by hand".into(),
        };
        let pool = || PoolError::TooLarge {
            pages: 1,
            page_bytes: 1,
        };
        let wire = || WireError::BadHeader {
            what: "checksum".into(),
        };
        let cases: [(anyhow::Error, EngineError, &str); 5] = [
            (gguf().into(), gguf().into(), "model"),
            (tokenizer().into(), tokenizer().into(), "tokenizer"),
            (fetch().into(), fetch().into(), "fetch"),
            (pool().into(), pool().into(), "engine"),
            (wire().into(), wire().into(), "engine"),
        ];
        for (bare, wrapped, want) in cases {
            assert_eq!(wrapped.to_string(), bare.to_string());
            let wrapped = anyhow::Error::from(wrapped);
            assert_eq!(kind(&bare), want, "{bare}");
            assert_eq!(kind(&wrapped), want, "{wrapped}");
            assert_eq!(kind(&wrapped.context("loading")), want);
            assert_eq!(kind(&bare.context("loading")), want);
        }
    }
}
