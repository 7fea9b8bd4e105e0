//! Tokenizer and chat-template construction on synthetic GGUF files: the
//! other byte-level pre-tokenizers, and clear errors for what is not
//! supported.

use std::path::PathBuf;

use kvsan_engine::EngineError;
use kvsan_engine::chat::{ChatMessage, ChatTemplate};
use kvsan_engine::gguf::{GgufBuilder, GgufFile};
use kvsan_engine::tokenizer::Tokenizer;
use kvsan_engine::tokenizer::TokenizerError;

/// GPT-2's byte-to-unicode table (the inverse of what the tokenizer decodes).
fn byte_char(b: u8) -> char {
    let mut next = 256u32;
    for x in 0..=255u8 {
        let printable = matches!(x, b'!'..=b'~' | 0xA1..=0xAC | 0xAE..=0xFF);
        if x == b {
            return if printable {
                char::from(x)
            } else {
                char::from_u32(next).unwrap()
            };
        }
        if !printable {
            next += 1;
        }
    }
    unreachable!()
}

/// A byte-level vocabulary: `<|end|>` (control), the 256 bytes, and the
/// merges `Ġ a`, `a b` and `Ġa b` (in rank order).
fn tiny(pre: &str, model: &str) -> GgufBuilder {
    let mut tokens = vec!["<|end|>".to_owned()];
    tokens.extend((0..=255u8).map(|b| byte_char(b).to_string()));
    tokens.extend(["ab", "Ġa", "Ġab"].map(String::from));
    let mut types = vec![3i32];
    types.extend(std::iter::repeat_n(1, tokens.len() - 1));
    GgufBuilder::new()
        .metadata("tokenizer.ggml.model", model)
        .metadata("tokenizer.ggml.pre", pre)
        .metadata("tokenizer.ggml.tokens", tokens)
        .metadata("tokenizer.ggml.token_type", types)
        .metadata("tokenizer.ggml.merges", vec!["Ġ a", "a b", "Ġa b"])
        .metadata("tokenizer.ggml.eos_token_id", 0u32)
}

fn open(dir: &tempfile::TempDir, b: GgufBuilder) -> (PathBuf, GgufFile) {
    let p = dir.path().join("t.gguf");
    b.write(&p).unwrap();
    let f = GgufFile::open(&p).unwrap();
    (p, f)
}

#[test]
fn gpt2_and_llama3_pretokenizers_merge_and_round_trip() {
    let dir = tempfile::tempdir().unwrap();
    for pre in ["gpt2", "llama-bpe", "smollm"] {
        let (_, f) = open(&dir, tiny(pre, "gpt2"));
        let tok = Tokenizer::from_gguf(&f).unwrap();
        let ab = tok.token_id("ab").unwrap();
        let space_ab = tok.token_id("Ġab").unwrap();
        let text = "ab ab<|end|>é";
        let ids = tok.encode(text).unwrap();
        assert_eq!(&ids[..3], &[ab, space_ab, 0], "{pre}: {ids:?}");
        assert_eq!(ids.len(), 5, "é is two byte tokens: {ids:?}");
        assert_eq!(tok.decode(&ids), text, "{pre}");
    }
}

#[test]
fn sentencepiece_and_unknown_pretokenizers_are_refused_by_name() {
    let dir = tempfile::tempdir().unwrap();
    let (p, f) = open(&dir, tiny("smollm", "llama"));
    let e = Tokenizer::from_gguf(&f).unwrap_err();
    assert!(matches!(
        e,
        EngineError::Tokenizer(TokenizerError::Unsupported { .. })
    ));
    let msg = e.to_string();
    assert!(
        msg.contains(&p.display().to_string())
            && msg.contains("'llama'")
            && msg.contains("SentencePiece"),
        "{msg}"
    );
    let (_, f) = open(&dir, tiny("deepseek-coder", "gpt2"));
    let msg = Tokenizer::from_gguf(&f).unwrap_err().to_string();
    assert!(
        msg.contains("'deepseek-coder'") && msg.contains("smollm, gpt2"),
        "{msg}"
    );
}

#[test]
fn inconsistent_tokenizer_data_is_refused() {
    let dir = tempfile::tempdir().unwrap();
    let (_, f) = open(
        &dir,
        tiny("gpt2", "gpt2").metadata("tokenizer.ggml.bos_token_id", 99_999u32),
    );
    let msg = Tokenizer::from_gguf(&f).unwrap_err().to_string();
    assert!(
        msg.contains("bos_token_id = 99999") && msg.contains("260 tokens"),
        "{msg}"
    );
    let b = GgufBuilder::new()
        .metadata("tokenizer.ggml.model", "gpt2")
        .metadata("tokenizer.ggml.pre", "gpt2")
        .metadata("tokenizer.ggml.tokens", vec!["a"])
        .metadata("tokenizer.ggml.merges", vec!["ab"]);
    let (_, f) = open(&dir, b);
    let msg = Tokenizer::from_gguf(&f).unwrap_err().to_string();
    assert!(msg.contains("merges[0] = \"ab\""), "{msg}");
    let (_, f) = open(
        &dir,
        GgufBuilder::new()
            .metadata("tokenizer.ggml.model", "gpt2")
            .metadata("tokenizer.ggml.pre", "gpt2"),
    );
    let msg = Tokenizer::from_gguf(&f).unwrap_err().to_string();
    assert!(msg.contains("'tokenizer.ggml.tokens' is missing"), "{msg}");
}

#[test]
fn chat_template_must_be_chatml() {
    let dir = tempfile::tempdir().unwrap();
    let llama2 = "{% for m in messages %}[INST] {{ m['content'] }} [/INST]{% endfor %}";
    let (_, f) = open(
        &dir,
        tiny("gpt2", "gpt2").metadata("tokenizer.chat_template", llama2),
    );
    let msg = ChatTemplate::from_gguf(&f).unwrap_err().to_string();
    assert!(msg.contains("not ChatML"), "{msg}");
    // No template and no ChatML tokens.
    let (_, f) = open(&dir, tiny("gpt2", "gpt2"));
    assert!(ChatTemplate::from_gguf(&f).is_err());
    // No template, but the vocabulary speaks ChatML: no default system prompt.
    let b =
        GgufBuilder::new().metadata("tokenizer.ggml.tokens", vec!["<|im_start|>", "<|im_end|>"]);
    let (_, f) = open(&dir, b);
    let t = ChatTemplate::from_gguf(&f).unwrap();
    assert_eq!(t.default_system(), None);
    assert_eq!(
        t.render(&[ChatMessage::user("hi")], true),
        "<|im_start|>user\nhi<|im_end|>\n<|im_start|>assistant\n"
    );
}

#[test]
fn model_file_tokenizer_and_template_can_be_shared_between_threads() {
    fn shareable<T: Send + Sync>() {}
    shareable::<GgufFile>();
    shareable::<Tokenizer>();
    shareable::<ChatTemplate>();
    shareable::<kvsan_engine::sampler::Sampler>();
}
