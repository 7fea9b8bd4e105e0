//! The ChatML template against llama.cpp's rendered prompts for the default
//! model (the `greedy` entries with `chat: true`).

use kvsan_engine::chat::{ChatMessage, ChatTemplate};
use kvsan_engine::fetch::ensure_default_model;
use kvsan_engine::gguf::GgufFile;
use kvsan_engine::tokenizer::Tokenizer;
use serde_json::Value;

fn model() -> GgufFile {
    let path = ensure_default_model(&mut |line| eprintln!("{line}")).expect("default model");
    GgufFile::open(&path).expect("model parses")
}

#[test]
fn rendered_chat_prompts_and_their_ids_equal_llamacpp() {
    let gguf = model();
    let template = ChatTemplate::from_gguf(&gguf).unwrap();
    assert_eq!(
        template.default_system(),
        Some("You are a helpful AI assistant named SmolLM, trained by Hugging Face")
    );
    let tok = Tokenizer::from_gguf(&gguf).unwrap();
    let json: Value =
        serde_json::from_str(include_str!("data/smollm2-q4_1-llamacpp.json")).expect("golden json");
    let mut checked = 0;
    for entry in json["greedy"].as_array().expect("greedy list") {
        if entry["chat"] != Value::Bool(true) {
            continue;
        }
        let prompt = entry["prompt"].as_str().unwrap();
        let rendered = template.render(&[ChatMessage::user(prompt)], true);
        assert_eq!(rendered, entry["prompt_text"].as_str().unwrap());
        let ids: Vec<u32> = entry["prompt_ids"]
            .as_array()
            .unwrap()
            .iter()
            .map(|i| i.as_u64().unwrap() as u32)
            .collect();
        assert_eq!(
            tok.encode(&rendered).unwrap(),
            ids,
            "prompt ids of {prompt:?}"
        );
        checked += 1;
    }
    assert_eq!(checked, 3);
}

#[test]
fn plain_prompts_encode_to_llamacpp_prompt_ids() {
    let tok = Tokenizer::from_gguf(&model()).unwrap();
    let json: Value =
        serde_json::from_str(include_str!("data/smollm2-q4_1-llamacpp.json")).expect("golden json");
    for entry in json["greedy"].as_array().unwrap() {
        let ids: Vec<u32> = entry["prompt_ids"]
            .as_array()
            .unwrap()
            .iter()
            .map(|i| i.as_u64().unwrap() as u32)
            .collect();
        assert_eq!(
            tok.encode(entry["prompt_text"].as_str().unwrap()).unwrap(),
            ids
        );
        let mut out: Vec<u32> = entry["ids"]
            .as_array()
            .unwrap()
            .iter()
            .map(|i| i.as_u64().unwrap() as u32)
            .collect();
        // llama.cpp's `text` stops before the end-of-generation token.
        if out.last().is_some_and(|&id| tok.is_end_of_generation(id)) {
            out.pop();
        }
        assert_eq!(
            tok.decode(&out),
            entry["text"].as_str().unwrap(),
            "decode of llama.cpp's output ids"
        );
    }
}
