//! What can go wrong with a model's tokenizer or chat template, or encoding a text.

/// A model's tokenizer or chat template that this engine cannot use, or a
/// text it cannot encode.
#[derive(Debug, thiserror::Error)]
#[non_exhaustive]
pub enum TokenizerError {
    /// The GGUF's tokenizer is of a kind this engine does not implement.
    #[error("{path}: unsupported tokenizer: {what}")]
    Unsupported {
        /// The model file.
        path: std::path::PathBuf,
        /// Which model or pre-tokenizer, and what is supported.
        what: String,
    },

    /// The GGUF's tokenizer data is inconsistent.
    #[error("{path}: invalid tokenizer data: {what}")]
    Invalid {
        /// The model file.
        path: std::path::PathBuf,
        /// What is wrong.
        what: String,
    },

    /// Encoding a text failed inside the BPE implementation.
    #[error("tokenizer failed to encode a text of {text_len} bytes: {reason}")]
    Encode {
        /// Length of the text in bytes (the text itself is not repeated).
        text_len: usize,
        /// The tokenizer library's message.
        reason: String,
    },

    /// The GGUF's chat template is not one this engine can render.
    #[error("{path}: unsupported chat template: {what}")]
    ChatTemplateUnsupported {
        /// The model file.
        path: std::path::PathBuf,
        /// Why, and what is supported.
        what: String,
    },
}
