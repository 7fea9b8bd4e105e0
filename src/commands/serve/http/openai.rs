//! The OpenAI request bodies this server takes and the answers it gives.
//!
//! Bodies are parsed with `deny_unknown_fields`: a field this server does not
//! know or does not support (`logprobs`, `tools`, …) is a 400 that names it,
//! never silently ignored. Fields (both endpoints unless said):
//!
//! ```text
//!  model            must be the served model (GET /v1/models)
//!  prompt           completions: "text" | [token ids] | ["text"] | [[token ids]]
//!  messages         chat: [{"role": "system"|"user"|"assistant",
//!                           "content": "text" | [{"type": "text", "text": …}]}]
//!  max_tokens       ≥ 1; completions default 16, chat default the rest of the context
//!  max_completion_tokens   chat: the same as max_tokens
//!  temperature      0 ..= 100 (default 1; 0 = greedy)   top_p  (0, 1] (default 1)
//!  top_k            ≥ 1, or 0 / -1 = off                seed   default: random
//!  stop             "text" | ["text", …] (at most 4, needs a tokenizer)
//!  n                1 only
//!  stream           SSE; stream_options {"include_usage": bool} only with it
//!  cache_salt       a non-empty string of at most 1024 bytes: the request shares
//!                   cached prompt pages only with requests of the same salt
//! ```
//!
//! `usage` (the whole answer; the stream's usage chunk when asked):
//!
//! ```text
//!  {"prompt_tokens", "completion_tokens", "total_tokens",
//!   "prompt_tokens_details": {"cached_tokens"}}    prompt tokens the prefix cache served;
//!                                                   left out when a stop string ended the
//!                                                   answer before the engine said
//! ```

use kvsan_engine::request::FinishReason;
use serde::Deserialize;
use serde_json::{Value, json};

use super::error::ApiError;

/// A body of `/v1/completions` or `/v1/chat/completions`; which of
/// `prompt` and `messages` it must have depends on the endpoint.
#[derive(Debug, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct GenerateBody {
    pub model: String,
    pub prompt: Option<Value>,
    pub messages: Option<Vec<Message>>,
    pub max_tokens: Option<u64>,
    pub max_completion_tokens: Option<u64>,
    pub temperature: Option<f64>,
    pub top_p: Option<f64>,
    pub top_k: Option<i64>,
    pub seed: Option<u64>,
    pub stop: Option<Stop>,
    pub n: Option<u64>,
    pub stream: Option<bool>,
    pub stream_options: Option<StreamOptions>,
    pub cache_salt: Option<String>,
}

/// `stream_options`.
#[derive(Debug, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct StreamOptions {
    pub include_usage: Option<bool>,
}

/// `stop`: one string or a list.
#[derive(Debug, Deserialize)]
#[serde(untagged)]
pub enum Stop {
    One(String),
    Many(Vec<String>),
}

/// One chat message.
#[derive(Debug, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct Message {
    pub role: String,
    pub content: Content,
}

/// A message's content: text, or a list of text parts.
#[derive(Debug, Deserialize)]
#[serde(untagged)]
pub enum Content {
    Text(String),
    Parts(Vec<Part>),
}

/// A content part; only `{"type": "text", "text": …}` is supported.
#[derive(Debug, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct Part {
    #[serde(rename = "type")]
    pub kind: String,
    pub text: Option<String>,
}

/// A `/tokenize` body: a prompt, or chat messages (rendered with the
/// template, as the chat endpoint would).
#[derive(Debug, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct TokenizeBody {
    pub model: Option<String>,
    pub prompt: Option<String>,
    pub messages: Option<Vec<Message>>,
}

/// A `/detokenize` body.
#[derive(Debug, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct DetokenizeBody {
    pub model: Option<String>,
    pub tokens: Vec<u32>,
}

/// Parses a JSON body; the error names the field at fault (an unknown one
/// by its name, a mistyped one by its path).
pub fn parse<T: serde::de::DeserializeOwned>(body: &[u8]) -> Result<T, ApiError> {
    let mut de = serde_json::Deserializer::from_slice(body);
    let value: T = serde_path_to_error::deserialize(&mut de).map_err(|e| field_error(&e))?;
    de.end().map_err(|e| {
        ApiError::invalid(
            "invalid_json",
            format!("the request body is not valid JSON: {e}"),
        )
    })?;
    Ok(value)
}

/// The 400 of a body that does not parse: bad JSON, or the field at fault.
fn field_error(e: &serde_path_to_error::Error<serde_json::Error>) -> ApiError {
    let path = e.path().to_string();
    let inner = e.inner();
    if !inner.is_data() {
        return ApiError::invalid(
            "invalid_json",
            format!("the request body is not valid JSON: {inner}"),
        );
    }
    let message = inner.to_string();
    // The path ends with the unknown field's name.
    if message.starts_with("unknown field `") {
        return ApiError::invalid_field(
            "unknown_field",
            path.clone(),
            format!("unknown or unsupported field \"{path}\": {message}"),
        );
    }
    if path == "." {
        ApiError::invalid("invalid_request", format!("the request body: {message}"))
    } else {
        ApiError::invalid_field(
            "invalid_value",
            path.clone(),
            format!("the field \"{path}\": {message}"),
        )
    }
}

/// Token counts of one request.
#[derive(Clone, Copy, Debug)]
pub struct Usage {
    pub prompt_tokens: usize,
    pub completion_tokens: usize,
    /// Prompt tokens the prefix cache served; `None` when the engine has
    /// not said (the front end ended the request at a stop string).
    pub cached_tokens: Option<usize>,
}

impl Usage {
    fn json(self) -> Value {
        let mut v = json!({
            "prompt_tokens": self.prompt_tokens,
            "completion_tokens": self.completion_tokens,
            "total_tokens": self.prompt_tokens + self.completion_tokens,
        });
        if let Some(cached) = self.cached_tokens {
            v["prompt_tokens_details"] = json!({ "cached_tokens": cached });
        }
        v
    }
}

/// Which endpoint a generation answers.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Endpoint {
    Completions,
    Chat,
}

/// Text and token ids to send in one answer or chunk.
#[derive(Debug, Default)]
pub struct Delta {
    pub text: String,
    pub ids: Vec<u32>,
}

impl Delta {
    /// Text without token ids (the tail a stream's end releases).
    pub fn text(text: String) -> Delta {
        Delta {
            text,
            ids: Vec::new(),
        }
    }

    pub fn is_empty(&self) -> bool {
        self.text.is_empty() && self.ids.is_empty()
    }
}

/// How the answers of one request are written.
pub struct Reply {
    pub endpoint: Endpoint,
    /// `cmpl-…` / `chatcmpl-…`, from the engine's request id.
    pub id: String,
    /// Unix seconds.
    pub created: u64,
    pub model: String,
    /// A model without a tokenizer sends `token_ids` (its text is empty).
    pub token_ids: bool,
    /// `stream_options.include_usage`: chunks carry `"usage": null`, and
    /// a usage chunk comes last.
    pub include_usage: bool,
}

fn finish_name(reason: Option<FinishReason>) -> Value {
    match reason {
        None => Value::Null,
        Some(FinishReason::Stop) => "stop".into(),
        Some(FinishReason::Length) => "length".into(),
    }
}

impl Reply {
    fn object(&self, chunk: bool) -> &'static str {
        match (self.endpoint, chunk) {
            (Endpoint::Completions, _) => "text_completion",
            (Endpoint::Chat, false) => "chat.completion",
            (Endpoint::Chat, true) => "chat.completion.chunk",
        }
    }

    fn envelope(&self, chunk: bool, choices: Value) -> Value {
        json!({
            "id": self.id,
            "object": self.object(chunk),
            "created": self.created,
            "model": self.model,
            "choices": choices,
        })
    }

    /// The answer of a request that is not streamed.
    pub fn whole(&self, delta: &Delta, reason: FinishReason, usage: Usage) -> Value {
        let mut choice = match self.endpoint {
            Endpoint::Completions => json!({ "index": 0, "text": delta.text, "logprobs": null }),
            Endpoint::Chat => json!({
                "index": 0,
                "message": { "role": "assistant", "content": delta.text },
                "logprobs": null,
            }),
        };
        choice["finish_reason"] = finish_name(Some(reason));
        if self.token_ids {
            choice["token_ids"] = json!(delta.ids);
        }
        let mut v = self.envelope(false, json!([choice]));
        v["usage"] = usage.json();
        v
    }

    /// The chat stream's first chunk: the assistant's role.
    pub fn role_chunk(&self) -> Value {
        let choice = json!({
            "index": 0,
            "delta": { "role": "assistant", "content": "" },
            "logprobs": null,
            "finish_reason": null,
        });
        self.with_usage_null(self.envelope(true, json!([choice])))
    }

    /// One streamed chunk; `reason` on the last.
    pub fn chunk(&self, delta: &Delta, reason: Option<FinishReason>) -> Value {
        let mut choice = match self.endpoint {
            Endpoint::Completions => json!({ "index": 0, "text": delta.text, "logprobs": null }),
            Endpoint::Chat if delta.text.is_empty() => {
                json!({ "index": 0, "delta": {}, "logprobs": null })
            }
            Endpoint::Chat => {
                json!({ "index": 0, "delta": { "content": delta.text }, "logprobs": null })
            }
        };
        choice["finish_reason"] = finish_name(reason);
        if self.token_ids {
            choice["token_ids"] = json!(delta.ids);
        }
        self.with_usage_null(self.envelope(true, json!([choice])))
    }

    /// The usage chunk sent before `[DONE]` when asked: empty `choices`.
    pub fn usage_chunk(&self, usage: Usage) -> Value {
        let mut v = self.envelope(true, json!([]));
        v["usage"] = usage.json();
        v
    }

    fn with_usage_null(&self, mut v: Value) -> Value {
        if self.include_usage {
            v["usage"] = Value::Null;
        }
        v
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn an_unknown_field_is_named() {
        let e =
            parse::<GenerateBody>(br#"{"model": "m", "prompt": "x", "logprobs": 2}"#).unwrap_err();
        assert_eq!(e.status, axum::http::StatusCode::BAD_REQUEST);
        assert_eq!(e.param.as_deref(), Some("logprobs"));
        assert!(e.message.contains("\"logprobs\""), "{}", e.message);
        let e = parse::<GenerateBody>(
            br#"{"model": "m", "prompt": "x", "stream_options": {"continuous_usage_stats": true}}"#,
        )
        .unwrap_err();
        assert_eq!(
            e.param.as_deref(),
            Some("stream_options.continuous_usage_stats")
        );
    }

    #[test]
    fn a_mistyped_field_is_named_and_bad_json_is_said() {
        let e =
            parse::<GenerateBody>(br#"{"model": "m", "prompt": "x", "top_k": "ten"}"#).unwrap_err();
        assert_eq!(e.param.as_deref(), Some("top_k"));
        let e = parse::<GenerateBody>(br#"{"model": "m", "#).unwrap_err();
        assert_eq!(e.code, "invalid_json");
        let e = parse::<GenerateBody>(br#"{"model": "m"} x"#).unwrap_err();
        assert_eq!(e.code, "invalid_json");
    }
}
