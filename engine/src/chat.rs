//! Chat prompts in the ChatML format.
//!
//! ```text
//! <|im_start|>system
//! You are a helpful AI assistant named SmolLM, trained by Hugging Face<|im_end|>
//! <|im_start|>user
//! What is the boiling point of water?<|im_end|>
//! <|im_start|>assistant
//! ```
//!
//! When the first message is not a system message, the default system prompt
//! (if the model has one) comes first. Each message is
//! `<|im_start|>{role}\n{content}<|im_end|>\n`; the generation prompt is
//! `<|im_start|>assistant\n`.
//!
//! A model's `tokenizer.chat_template` is a Jinja template; this module does
//! not run Jinja. It recognises ChatML templates (they contain
//! `<|im_start|>`), takes the default system prompt out of the template's
//! literal `<|im_start|>system\n…<|im_end|>` text, and refuses other
//! templates with an error that says so.

use crate::error::EngineError;
use crate::gguf::GgufFile;
use crate::tokenizer::TokenizerError;

/// Start of a ChatML turn.
pub const IM_START: &str = "<|im_start|>";
/// End of a ChatML turn.
pub const IM_END: &str = "<|im_end|>";

/// One message of a conversation.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct ChatMessage {
    /// `system`, `user` or `assistant`.
    pub role: String,
    /// The message text.
    pub content: String,
}

impl ChatMessage {
    /// A message with any role.
    #[must_use]
    pub fn new(role: impl Into<String>, content: impl Into<String>) -> Self {
        ChatMessage {
            role: role.into(),
            content: content.into(),
        }
    }

    /// A `system` message.
    #[must_use]
    pub fn system(content: impl Into<String>) -> Self {
        Self::new("system", content)
    }

    /// A `user` message.
    #[must_use]
    pub fn user(content: impl Into<String>) -> Self {
        Self::new("user", content)
    }

    /// An `assistant` message.
    #[must_use]
    pub fn assistant(content: impl Into<String>) -> Self {
        Self::new("assistant", content)
    }
}

/// A ChatML chat template with an optional default system prompt.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct ChatTemplate {
    default_system: Option<String>,
}

impl ChatTemplate {
    /// ChatML with `default_system` put first when a conversation does not
    /// start with a system message.
    #[must_use]
    pub fn chatml(default_system: Option<String>) -> Self {
        ChatTemplate { default_system }
    }

    /// The template of `gguf`: its `tokenizer.chat_template` when that is
    /// ChatML (with its default system prompt, if it has one); plain ChatML
    /// when the file has no template but its vocabulary has `<|im_start|>`.
    ///
    /// # Errors
    /// [`TokenizerError::ChatTemplateUnsupported`] when the template is not
    /// ChatML, or there is no template and no ChatML tokens.
    pub fn from_gguf(gguf: &GgufFile) -> Result<ChatTemplate, EngineError> {
        let unsupported = |what: String| {
            EngineError::from(TokenizerError::ChatTemplateUnsupported {
                path: gguf.path().to_path_buf(),
                what,
            })
        };
        match gguf.get_str_opt("tokenizer.chat_template")? {
            Some(template) => {
                if !template.contains(IM_START) {
                    return Err(unsupported(format!(
                        "tokenizer.chat_template ({} bytes) is not ChatML (it has no '{IM_START}'); only ChatML templates are supported",
                        template.len()
                    )));
                }
                Ok(ChatTemplate::chatml(default_system_prompt(template)))
            }
            None => {
                let has_chatml = gguf
                    .get("tokenizer.ggml.tokens")
                    .is_some()
                    .then(|| gguf.get_string_array("tokenizer.ggml.tokens"))
                    .transpose()?
                    .is_some_and(|tokens| tokens.iter().any(|t| t == IM_START));
                if has_chatml {
                    Ok(ChatTemplate::chatml(None))
                } else {
                    Err(unsupported(format!(
                        "the file has no tokenizer.chat_template and no '{IM_START}' token"
                    )))
                }
            }
        }
    }

    /// The system prompt used when a conversation has none.
    #[must_use]
    pub fn default_system(&self) -> Option<&str> {
        self.default_system.as_deref()
    }

    /// The prompt text of `messages`, ending with the generation prompt
    /// `<|im_start|>assistant\n` when `add_generation_prompt`.
    #[must_use]
    pub fn render(&self, messages: &[ChatMessage], add_generation_prompt: bool) -> String {
        let mut out = String::new();
        let turn = |out: &mut String, role: &str, content: &str| {
            out.push_str(IM_START);
            out.push_str(role);
            out.push('\n');
            out.push_str(content);
            out.push_str(IM_END);
            out.push('\n');
        };
        let has_system = messages.first().is_some_and(|m| m.role == "system");
        if let (false, Some(system)) = (has_system, &self.default_system) {
            turn(&mut out, "system", system);
        }
        for m in messages {
            turn(&mut out, &m.role, &m.content);
        }
        if add_generation_prompt {
            out.push_str(IM_START);
            out.push_str("assistant\n");
        }
        out
    }
}

/// The literal default system prompt of a ChatML Jinja template: the text
/// between `<|im_start|>system` + newline and `<|im_end|>` inside one string
/// literal. `None` when the template writes no literal system turn (the
/// text there is an expression such as `message['content']`).
fn default_system_prompt(template: &str) -> Option<String> {
    let head = format!("{IM_START}system");
    let mut rest = template;
    while let Some(i) = rest.find(&head) {
        rest = &rest[i + head.len()..];
        // The newline is either a real one or a `\n` escape in the literal.
        let body = rest.strip_prefix('\n').or_else(|| rest.strip_prefix("\\n"));
        let Some(body) = body else { continue };
        let Some(end) = body.find(IM_END) else {
            continue;
        };
        let text = &body[..end];
        // A literal prompt has no quote (which would end the literal) and no
        // Jinja delimiter.
        if !text.is_empty() && !text.contains(['\'', '"', '{', '}']) {
            return Some(text.replace("\\n", "\n"));
        }
    }
    None
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn system_prompt_is_read_from_a_chatml_template_literal() {
        let t = "{% if loop.first and messages[0]['role'] != 'system' %}{{ '<|im_start|>system\nBe brief.<|im_end|>\n' }}{% endif %}{{'<|im_start|>' + message['role'] + '\n' + message['content'] + '<|im_end|>' + '\n'}}";
        assert_eq!(default_system_prompt(t).as_deref(), Some("Be brief."));
    }

    #[test]
    fn template_without_a_literal_system_turn_has_no_default() {
        let t = "{{'<|im_start|>' + message['role'] + '\n' + message['content'] + '<|im_end|>' + '\n'}}";
        assert_eq!(default_system_prompt(t), None);
        let t = "{{ '<|im_start|>system\n' + messages[0]['content'] + '<|im_end|>\n' }}";
        assert_eq!(default_system_prompt(t), None);
    }

    #[test]
    fn render_puts_the_default_system_prompt_first_only_when_none_is_given() {
        let t = ChatTemplate::chatml(Some("S".into()));
        assert_eq!(
            t.render(&[ChatMessage::user("hi")], true),
            "<|im_start|>system\nS<|im_end|>\n<|im_start|>user\nhi<|im_end|>\n<|im_start|>assistant\n"
        );
        assert_eq!(
            t.render(&[ChatMessage::system("X"), ChatMessage::user("hi")], false),
            "<|im_start|>system\nX<|im_end|>\n<|im_start|>user\nhi<|im_end|>\n"
        );
    }
}
