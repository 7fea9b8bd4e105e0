//! How a body's prompt becomes token ids: text through the model's
//! tokenizer, chat messages through its template, or token ids as given
//! (the only form a model without a tokenizer — the synthetic one — takes).

use kvsan_engine::chat::ChatMessage;
use serde_json::Value;

use super::Front;
use super::error::ApiError;
use super::openai::{Content, Message};
use crate::commands::serve::text::TextSide;

/// The model's text side, or the 400 of a server whose model has none.
pub fn text_side<'a>(front: &'a Front, what: &str) -> Result<&'a TextSide, ApiError> {
    front.text.as_deref().ok_or_else(|| {
        ApiError::invalid(
            "no_tokenizer",
            format!(
                "this server's model has no tokenizer (the synthetic model): {what} needs one; send prompts as arrays of token ids"
            ),
        )
    })
}

/// The token ids of `text`.
pub fn encode(front: &Front, text: &str, param: &str) -> Result<Vec<u32>, ApiError> {
    text_side(front, "a text prompt")?
        .tokenizer()
        .encode(text)
        .map_err(|e| {
            ApiError::invalid_field(
                "invalid_value",
                param,
                format!("\"{param}\" cannot be tokenized: {e}"),
            )
        })
}

/// A completions `prompt`: `"text"`, `[ids]`, or a list of one of those.
pub fn completion_prompt(front: &Front, prompt: Option<&Value>) -> Result<Vec<u32>, ApiError> {
    let prompt = prompt.ok_or_else(|| {
        ApiError::invalid_field(
            "missing_field",
            "prompt",
            "a completion needs \"prompt\": text or an array of token ids",
        )
    })?;
    let ids = match prompt {
        Value::String(text) => encode(front, text, "prompt")?,
        Value::Array(items) if items.iter().all(Value::is_number) => token_ids(items, "prompt")?,
        Value::Array(items) if items.len() == 1 => match &items[0] {
            Value::String(text) => encode(front, text, "prompt[0]")?,
            Value::Array(ids) => token_ids(ids, "prompt[0]")?,
            _ => return Err(prompt_form()),
        },
        Value::Array(items) if items.len() > 1 => {
            return Err(ApiError::invalid_field(
                "unsupported_value",
                "prompt",
                format!(
                    "\"prompt\" is a batch of {} prompts: this server takes one prompt per request",
                    items.len()
                ),
            ));
        }
        _ => return Err(prompt_form()),
    };
    non_empty(ids, "prompt")
}

fn prompt_form() -> ApiError {
    ApiError::invalid_field(
        "invalid_value",
        "prompt",
        "\"prompt\" must be text, an array of token ids, or a list of one of those",
    )
}

fn non_empty(ids: Vec<u32>, param: &str) -> Result<Vec<u32>, ApiError> {
    if ids.is_empty() {
        return Err(ApiError::invalid_field(
            "invalid_value",
            param,
            format!("\"{param}\" is empty: a prompt needs at least one token"),
        ));
    }
    Ok(ids)
}

/// Token ids from a JSON array.
fn token_ids(items: &[Value], param: &str) -> Result<Vec<u32>, ApiError> {
    items
        .iter()
        .enumerate()
        .map(|(i, v)| {
            v.as_u64()
                .and_then(|n| u32::try_from(n).ok())
                .ok_or_else(|| {
                    ApiError::invalid_field(
                        "invalid_value",
                        format!("{param}[{i}]"),
                        format!(
                            "\"{param}\"[{i}] is {v}: token ids are integers from 0 to {}",
                            u32::MAX
                        ),
                    )
                })
        })
        .collect()
}

/// The chat's text as the model's template renders it, ready for the
/// assistant's turn.
pub fn render_chat(front: &Front, messages: Option<&[Message]>) -> Result<String, ApiError> {
    let messages = messages.ok_or_else(|| {
        ApiError::invalid_field(
            "missing_field",
            "messages",
            "a chat completion needs \"messages\"",
        )
    })?;
    if messages.is_empty() {
        return Err(ApiError::invalid_field(
            "invalid_value",
            "messages",
            "\"messages\" is empty",
        ));
    }
    let template = text_side(front, "a chat")?.template().ok_or_else(|| {
        ApiError::invalid(
            "no_chat_template",
            "the model has no usable chat template: use /v1/completions",
        )
    })?;
    let chat = messages
        .iter()
        .enumerate()
        .map(|(i, m)| chat_message(i, m))
        .collect::<Result<Vec<_>, _>>()?;
    Ok(template.render(&chat, true))
}

/// The token ids of a chat.
pub fn chat_prompt(front: &Front, messages: Option<&[Message]>) -> Result<Vec<u32>, ApiError> {
    let text = render_chat(front, messages)?;
    non_empty(encode(front, &text, "messages")?, "messages")
}

fn chat_message(i: usize, m: &Message) -> Result<ChatMessage, ApiError> {
    if !matches!(m.role.as_str(), "system" | "user" | "assistant") {
        return Err(ApiError::invalid_field(
            "unsupported_value",
            format!("messages[{i}].role"),
            format!(
                "messages[{i}].role is {:?}: this server takes system, user and assistant messages",
                m.role
            ),
        ));
    }
    let content = match &m.content {
        Content::Text(text) => text.clone(),
        Content::Parts(parts) => {
            let mut texts = Vec::with_capacity(parts.len());
            for (j, part) in parts.iter().enumerate() {
                match (part.kind.as_str(), &part.text) {
                    ("text", Some(text)) => texts.push(text.as_str()),
                    _ => {
                        return Err(ApiError::invalid_field(
                            "unsupported_value",
                            format!("messages[{i}].content[{j}]"),
                            format!(
                                "messages[{i}].content[{j}] is not a text part: this server takes {{\"type\": \"text\", \"text\": …}} parts only"
                            ),
                        ));
                    }
                }
            }
            texts.join("\n")
        }
    };
    Ok(ChatMessage::new(m.role.clone(), content))
}
