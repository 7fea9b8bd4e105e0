//! A model's text side: how prompts are encoded, chats rendered and tokens
//! shown.

use kvsan_engine::chat::ChatTemplate;
use kvsan_engine::tokenizer::Tokenizer;

/// The tokenizer, the chat template when the model has a usable one, and
/// the tokens that end a generation.
pub struct TextSide {
    tokenizer: Tokenizer,
    template: Option<ChatTemplate>,
    stop_tokens: Vec<u32>,
}

impl TextSide {
    /// The tokenizer and, when the model has one, its chat template.
    pub fn new(tokenizer: Tokenizer, template: Option<ChatTemplate>) -> TextSide {
        let stop_tokens = tokenizer.eos_id().into_iter().collect();
        TextSide {
            tokenizer,
            template,
            stop_tokens,
        }
    }

    /// The model's tokenizer.
    pub fn tokenizer(&self) -> &Tokenizer {
        &self.tokenizer
    }

    /// The chat template, `None` when the model has no usable one.
    pub fn template(&self) -> Option<&ChatTemplate> {
        self.template.as_ref()
    }

    /// The tokens that end a generation (not emitted).
    pub fn stop_tokens(&self) -> &[u32] {
        &self.stop_tokens
    }
}
