//! Loading a model file that is not a runnable Llama model: errors that name
//! the file, the key or tensor, and what was expected.

use kvsan_engine::gguf::GgufBuilder;
use kvsan_engine::model::Model;
use kvsan_kernels::DType;

fn llama_metadata(b: GgufBuilder, arch: &str) -> GgufBuilder {
    llama_metadata_kv(b, arch, 1)
}

fn llama_metadata_kv(b: GgufBuilder, arch: &str, kv_heads: u32) -> GgufBuilder {
    b.metadata("general.architecture", arch)
        .metadata(format!("{arch}.block_count"), 1u32)
        .metadata(format!("{arch}.embedding_length"), 32u32)
        .metadata(format!("{arch}.feed_forward_length"), 32u32)
        .metadata(format!("{arch}.attention.head_count"), 2u32)
        .metadata(format!("{arch}.attention.head_count_kv"), kv_heads)
        .metadata(format!("{arch}.context_length"), 64u32)
        .metadata(format!("{arch}.attention.layer_norm_rms_epsilon"), 1e-5f32)
}

fn f32_tensor(b: GgufBuilder, name: &str, dims: &[u64]) -> GgufBuilder {
    let n: u64 = dims.iter().product();
    b.tensor(name, dims, DType::F32, vec![0u8; n as usize * 4])
}

fn load(b: GgufBuilder) -> String {
    let dir = tempfile::tempdir().expect("tempdir");
    let path = dir.path().join("model.gguf");
    b.write(&path).expect("write gguf");
    Model::load(&path).expect_err("must not load").to_string()
}

#[test]
fn another_architecture_is_refused_by_name() {
    let b = f32_tensor(
        llama_metadata(GgufBuilder::new(), "mamba"),
        "token_embd.weight",
        &[32, 16],
    );
    let msg = load(b);
    assert!(
        msg.contains("architecture 'mamba'") && msg.contains("llama"),
        "{msg}"
    );
}

#[test]
fn a_missing_tensor_is_named() {
    let b = f32_tensor(
        llama_metadata(GgufBuilder::new(), "llama"),
        "token_embd.weight",
        &[32, 16],
    );
    let b = f32_tensor(b, "output_norm.weight", &[32]);
    let msg = load(b);
    assert!(
        msg.contains("blk.0.attn_norm.weight") && msg.contains("missing"),
        "{msg}"
    );
}

#[test]
fn a_tensor_of_the_wrong_shape_is_named_with_the_expected_shape() {
    let b = f32_tensor(
        llama_metadata(GgufBuilder::new(), "llama"),
        "token_embd.weight",
        &[32, 16],
    );
    let b = f32_tensor(b, "output_norm.weight", &[31]);
    let msg = load(b);
    assert!(
        msg.contains("output_norm.weight") && msg.contains("expected [32]"),
        "{msg}"
    );
}

#[test]
fn a_missing_hyperparameter_is_named() {
    let b = GgufBuilder::new()
        .metadata("general.architecture", "llama")
        .metadata("llama.block_count", 1u32);
    let b = f32_tensor(b, "token_embd.weight", &[32, 16]);
    let msg = load(b);
    assert!(msg.contains("llama.embedding_length"), "{msg}");
}

#[test]
fn inconsistent_heads_are_refused_with_the_values() {
    let b = llama_metadata_kv(GgufBuilder::new(), "llama", 3);
    let b = f32_tensor(b, "token_embd.weight", &[32, 16]);
    let msg = load(b);
    assert!(
        msg.contains("head_count 2 is not a multiple of head_count_kv 3"),
        "{msg}"
    );
}
