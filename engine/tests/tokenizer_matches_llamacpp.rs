//! The tokenizer against llama.cpp's ids for the default model
//! (`tests/data/smollm2-q4_1-llamacpp.json`, the `tokenize` list).

use kvsan_engine::fetch::ensure_default_model;
use kvsan_engine::gguf::GgufFile;
use kvsan_engine::tokenizer::{StreamDecoder, TokenType, Tokenizer};
use serde_json::Value;

fn tokenizer() -> Tokenizer {
    let path = ensure_default_model(&mut |line| eprintln!("{line}")).expect("default model");
    Tokenizer::from_gguf(&GgufFile::open(&path).expect("model parses")).expect("tokenizer builds")
}

fn golden_tokenize() -> Vec<(String, Vec<u32>)> {
    let json: Value =
        serde_json::from_str(include_str!("data/smollm2-q4_1-llamacpp.json")).expect("golden json");
    json["tokenize"]
        .as_array()
        .expect("tokenize list")
        .iter()
        .map(|e| {
            let text = e["text"].as_str().expect("text").to_owned();
            let ids = e["ids"]
                .as_array()
                .expect("ids")
                .iter()
                .map(|i| u32::try_from(i.as_u64().expect("id")).expect("u32 id"))
                .collect();
            (text, ids)
        })
        .collect()
}

#[test]
fn ids_equal_llamacpp_for_every_golden_string() {
    let tok = tokenizer();
    let golden = golden_tokenize();
    assert_eq!(golden.len(), 18);
    let mut wrong = Vec::new();
    for (text, ids) in &golden {
        let got = tok.encode(text).unwrap();
        if &got != ids {
            wrong.push(format!(
                "{text:?}\n  llama.cpp {ids:?}\n  ours      {got:?}"
            ));
        }
    }
    assert!(
        wrong.is_empty(),
        "{} mismatches:\n{}",
        wrong.len(),
        wrong.join("\n")
    );
}

#[test]
fn decode_of_encode_gives_back_every_golden_string() {
    let tok = tokenizer();
    for (text, ids) in golden_tokenize() {
        assert_eq!(tok.decode(&ids), text, "decode of llama.cpp's ids");
        assert_eq!(tok.decode(&tok.encode(&text).unwrap()), text);
    }
}

#[test]
fn streaming_decode_one_token_at_a_time_equals_full_decode() {
    let tok = tokenizer();
    let mut split_sequences = 0;
    for (text, ids) in golden_tokenize() {
        let mut stream = tok.stream_decoder();
        let mut out = String::new();
        for &id in &ids {
            let piece = stream.push(&tok, id);
            // Nothing is emitted before it is complete: no U+FFFD in the middle.
            assert!(
                !piece.contains('\u{FFFD}'),
                "{text:?}: partial UTF-8 emitted"
            );
            if std::str::from_utf8(tok.decode_piece(id).unwrap()).is_err() {
                split_sequences += 1;
            }
            out.push_str(&piece);
        }
        out.push_str(&stream.finish());
        assert_eq!(out, text);
    }
    assert!(
        split_sequences > 0,
        "the golden strings include characters split across tokens"
    );
}

#[test]
fn streaming_decode_turns_a_dangling_sequence_into_one_replacement_char() {
    let mut s = StreamDecoder::default();
    assert_eq!(s.push_bytes(&[b'a', 0xE2, 0x82]), "a");
    assert_eq!(s.push_bytes(&[0xAC, 0xF0]), "€");
    assert_eq!(s.push_bytes(&[0xFF, b'b']), "\u{FFFD}\u{FFFD}b");
    let mut s = StreamDecoder::default();
    assert_eq!(s.push_bytes(&[0xE2, 0x82]), "");
    assert_eq!(s.finish(), String::from_utf8_lossy(&[0xE2, 0x82]));
}

#[test]
fn special_tokens_are_parsed_in_text_and_ids_match_the_file() {
    let tok = tokenizer();
    assert_eq!(tok.vocab_size(), 49152);
    assert_eq!((tok.bos_id(), tok.eos_id()), (Some(1), Some(2)));
    assert_eq!((tok.unk_id(), tok.pad_id()), (Some(0), Some(2)));
    assert!(!tok.add_bos());
    assert!(tok.is_end_of_generation(2) && !tok.is_end_of_generation(1));
    assert_eq!(tok.token_str(1), Some("<|im_start|>"));
    assert_eq!(tok.token_type(1), Some(TokenType::Control));
    assert_eq!(tok.token_id("<|im_end|>"), Some(2));
    assert_eq!(tok.encode("<|im_start|><|im_end|>").unwrap(), vec![1, 2]);
    // A near miss is ordinary text.
    assert!(!tok.encode("<|im_start|").unwrap().contains(&1));
    assert_eq!(tok.decode(&[1, 2]), "<|im_start|><|im_end|>");
}

#[test]
fn hello_uses_the_smollm_pretokenizer_without_a_prefix_space() {
    let tok = tokenizer();
    assert_eq!(tok.encode("Hello").unwrap(), vec![19556]);
    assert_eq!(tok.token_str(19556), Some("Hello"));
    // Each digit is its own pre-token.
    let ids = tok.encode("2026").unwrap();
    assert_eq!(ids.len(), 4, "{ids:?}");
}
