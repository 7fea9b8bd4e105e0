//! The GGUF reader on the real default model (fetched on first use).

use kvsan_engine::fetch::ensure_default_model;
use kvsan_engine::gguf::{GgufFile, MetaType, MetaValue};
use kvsan_kernels::DType;

fn open_default() -> GgufFile {
    let path = ensure_default_model(&mut |line| eprintln!("{line}")).expect("default model");
    GgufFile::open(&path).expect("the default model parses")
}

#[test]
fn header_counts_and_layout_match_the_file() {
    let f = open_default();
    assert_eq!(f.version(), 3);
    assert_eq!(f.tensors().len(), 272);
    assert_eq!(f.metadata().len(), 33);
    assert_eq!(f.alignment(), 32);
    assert_eq!(f.data_start() % 32, 0);
    assert_eq!(f.architecture().unwrap(), "llama");
}

#[test]
fn llama_hyperparameters_match_facts() {
    let f = open_default();
    assert_eq!(f.get_u32("llama.context_length").unwrap(), 8192);
    assert_eq!(f.get_u32("llama.embedding_length").unwrap(), 576);
    assert_eq!(f.get_u32("llama.feed_forward_length").unwrap(), 1536);
    assert_eq!(f.get_u32("llama.block_count").unwrap(), 30);
    assert_eq!(f.get_u32("llama.attention.head_count").unwrap(), 9);
    assert_eq!(f.get_u32("llama.attention.head_count_kv").unwrap(), 3);
    assert_eq!(f.get_u32("llama.rope.dimension_count").unwrap(), 64);
    assert_eq!(f.get_u32("llama.vocab_size").unwrap(), 49152);
    assert_eq!(f.get_f32("llama.rope.freq_base").unwrap(), 100_000.0);
    assert_eq!(
        f.get_f32("llama.attention.layer_norm_rms_epsilon").unwrap(),
        1e-5
    );
    assert!(f.get("llama.rope.scaling.type").is_none());
    assert_eq!(f.get_u32_opt("llama.rope.scaling.factor").unwrap(), None);
}

#[test]
fn tokenizer_metadata_matches_facts() {
    let f = open_default();
    assert_eq!(f.get_str("tokenizer.ggml.model").unwrap(), "gpt2");
    assert_eq!(f.get_str("tokenizer.ggml.pre").unwrap(), "smollm");
    let tokens = f.get_string_array("tokenizer.ggml.tokens").unwrap();
    assert_eq!(tokens.len(), 49152);
    assert_eq!(tokens[1], "<|im_start|>");
    assert_eq!(tokens[2], "<|im_end|>");
    assert_eq!(
        f.get_string_array("tokenizer.ggml.merges").unwrap().len(),
        48900
    );
    let types = f.get_i32_array("tokenizer.ggml.token_type").unwrap();
    assert_eq!(types.len(), 49152);
    assert_eq!(types.iter().filter(|&&t| t == 3).count(), 17);
    assert_eq!(f.get_u32("tokenizer.ggml.bos_token_id").unwrap(), 1);
    assert_eq!(f.get_u32("tokenizer.ggml.eos_token_id").unwrap(), 2);
    assert_eq!(f.get_u32("tokenizer.ggml.unknown_token_id").unwrap(), 0);
    assert_eq!(f.get_u32("tokenizer.ggml.padding_token_id").unwrap(), 2);
    assert!(!f.get_bool("tokenizer.ggml.add_bos_token").unwrap());
    assert!(!f.get_bool("tokenizer.ggml.add_space_prefix").unwrap());
    assert!(
        f.get_str("tokenizer.chat_template")
            .unwrap()
            .contains("<|im_start|>")
    );
}

#[test]
fn tensor_types_and_shapes_match_facts() {
    let f = open_default();
    let count = |d: DType| f.tensors().iter().filter(|t| t.dtype() == d).count();
    assert_eq!(count(DType::Q4_1), 210);
    assert_eq!(count(DType::Q8_0), 1);
    assert_eq!(count(DType::F32), 61);
    let embd = f.tensor("token_embd.weight").unwrap();
    assert_eq!(embd.dtype(), DType::Q8_0);
    assert_eq!(embd.dims(), &[576, 49152]);
    assert_eq!((embd.row_len(), embd.n_rows()), (576, 49152));
    assert_eq!(
        embd.size_bytes(),
        49152 * DType::Q8_0.row_bytes(576).unwrap()
    );
    assert_eq!(f.tensor_data(embd).len(), embd.size_bytes());
    let gate = f.tensor("blk.0.ffn_gate.weight").unwrap();
    assert_eq!((gate.dims(), gate.dtype()), (&[576, 1536][..], DType::Q4_1));
    let down = f.tensor("blk.29.ffn_down.weight").unwrap();
    assert_eq!(down.dims(), &[1536, 576]);
    let k = f.tensor("blk.0.attn_k.weight").unwrap();
    assert_eq!(k.dims(), &[576, 192], "3 KV heads × head dim 64");
    assert_eq!(f.tensor("output_norm.weight").unwrap().dims(), &[576]);
    // The output projection is tied to the token embedding.
    let err = f.tensor("output.weight").unwrap_err().to_string();
    assert!(err.contains("'output.weight' is missing"), "{err}");
}

#[test]
fn norm_weights_read_from_the_mapping_are_plausible_floats() {
    let f = open_default();
    let norm = f.tensor("output_norm.weight").unwrap();
    let values: Vec<f32> = f
        .tensor_data(norm)
        .chunks_exact(4)
        .map(|b| f32::from_le_bytes(b.try_into().unwrap()))
        .collect();
    assert_eq!(values.len(), 576);
    assert!(values.iter().all(|v| v.is_finite() && v.abs() < 100.0));
    assert!(values.iter().any(|&v| v != 0.0));
}

#[test]
fn typed_getters_name_the_file_key_and_expected_type() {
    let f = open_default();
    let path = f.path().display().to_string();
    let err = f.get_u32("tokenizer.ggml.model").unwrap_err().to_string();
    assert!(
        err.contains(&path) && err.contains("'tokenizer.ggml.model'") && err.contains("u32"),
        "{err}"
    );
    assert!(err.contains("string"), "{err}");
    let err = f.get_f32("no.such.key").unwrap_err().to_string();
    assert!(
        err.contains("'no.such.key' is missing") && err.contains("f32"),
        "{err}"
    );
    let err = f
        .get_string_array("tokenizer.ggml.token_type")
        .unwrap_err()
        .to_string();
    assert!(err.contains("array of 49152 i32"), "{err}");
    assert!(
        matches!(f.get("general.languages"), Some(MetaValue::Array(a)) if a.elem_type() == MetaType::String)
    );
}
