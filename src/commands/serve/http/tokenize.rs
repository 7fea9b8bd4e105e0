//! `POST /tokenize` and `POST /detokenize` (vLLM's shapes):
//!
//! ```text
//!  /tokenize    {"prompt": "text"} | {"messages": [...]}   → {"count": N, "max_model_len": C, "tokens": [ids]}
//!  /detokenize  {"tokens": [ids]}                          → {"prompt": "text"}
//! ```
//!
//! `model`, when given, must be the served one. Messages are rendered with
//! the chat template, as `/v1/chat/completions` would.

use std::sync::Arc;

use axum::body::Body;
use axum::extract::State;
use axum::http::HeaderMap;
use axum::response::{IntoResponse, Response};
use serde_json::json;

use super::error::ApiError;
use super::openai::{self, DetokenizeBody, TokenizeBody};
use super::{Front, json_body, prompt, read_body};

/// `POST /tokenize`.
pub async fn tokenize(State(front): State<Arc<Front>>, headers: HeaderMap, body: Body) -> Response {
    tokenize_body(&front, &headers, body)
        .await
        .unwrap_or_else(IntoResponse::into_response)
}

/// `POST /detokenize`.
pub async fn detokenize(
    State(front): State<Arc<Front>>,
    headers: HeaderMap,
    body: Body,
) -> Response {
    detokenize_body(&front, &headers, body)
        .await
        .unwrap_or_else(IntoResponse::into_response)
}

fn check_model(front: &Front, model: Option<&str>) -> Result<(), ApiError> {
    match model {
        Some(m) if m != front.model_id => Err(ApiError::unknown_model(m, &front.model_id)),
        _ => Ok(()),
    }
}

async fn tokenize_body(
    front: &Front,
    headers: &HeaderMap,
    body: Body,
) -> Result<Response, ApiError> {
    front.authorize(headers)?;
    let body: TokenizeBody = openai::parse(&read_body(body).await?)?;
    check_model(front, body.model.as_deref())?;
    let tokens = match (&body.prompt, &body.messages) {
        (Some(text), None) => prompt::encode(front, text, "prompt")?,
        (None, Some(messages)) => {
            let text = prompt::render_chat(front, Some(messages))?;
            prompt::encode(front, &text, "messages")?
        }
        _ => {
            return Err(ApiError::invalid(
                "invalid_request",
                "give \"prompt\" (text) or \"messages\" (a chat), one of them",
            ));
        }
    };
    Ok(json_body(&json!({
        "count": tokens.len(),
        "max_model_len": front.context_length,
        "tokens": tokens,
    })))
}

async fn detokenize_body(
    front: &Front,
    headers: &HeaderMap,
    body: Body,
) -> Result<Response, ApiError> {
    front.authorize(headers)?;
    let body: DetokenizeBody = openai::parse(&read_body(body).await?)?;
    check_model(front, body.model.as_deref())?;
    let tokenizer = prompt::text_side(front, "detokenizing")?.tokenizer();
    let vocab = tokenizer.vocab_size();
    if let Some(i) = body.tokens.iter().position(|&t| t as usize >= vocab) {
        return Err(ApiError::invalid_field(
            "invalid_value",
            format!("tokens[{i}]"),
            format!(
                "\"tokens\"[{i}] is {}: the vocabulary has {vocab} tokens",
                body.tokens[i]
            ),
        ));
    }
    Ok(json_body(
        &json!({ "prompt": tokenizer.decode(&body.tokens) }),
    ))
}
