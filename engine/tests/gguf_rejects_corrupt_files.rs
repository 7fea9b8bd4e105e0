//! The GGUF reader on synthetic files: a round trip through the writer, and
//! corrupt files (truncated, wrong magic, unknown types, absurd lengths,
//! random byte flips) that must give a clear error, never a panic.

use std::path::{Path, PathBuf};

use kvsan_engine::EngineError;
use kvsan_engine::gguf::GgufError;
use kvsan_engine::gguf::{GgufBuilder, GgufFile, MetaArray, MetaValue};
use kvsan_kernels::DType;
use proptest::prelude::*;

fn f32_bytes(v: &[f32]) -> Vec<u8> {
    v.iter().flat_map(|x| x.to_le_bytes()).collect()
}

/// A small file with every metadata type and three tensors.
fn sample() -> GgufBuilder {
    GgufBuilder::new()
        .metadata("general.architecture", "llama")
        .metadata("u8", 7u8)
        .metadata("i8", -7i8)
        .metadata("u16", 700u16)
        .metadata("i16", -700i16)
        .metadata("u32", 70_000u32)
        .metadata("i32", -70_000i32)
        .metadata("f32", 1.5f32)
        .metadata("bool", true)
        .metadata("u64", 7_000_000_000u64)
        .metadata("i64", -7_000_000_000i64)
        .metadata("f64", 2.25f64)
        .metadata("strings", vec!["a", "ĠHello", ""])
        .metadata("ints", vec![1i32, -2, 3])
        .metadata("floats", vec![0.5f32, -1.0])
        .metadata(
            "nested",
            MetaValue::Array(MetaArray::Array(vec![
                MetaArray::U8(vec![1, 2]),
                MetaArray::String(vec!["x".into()]),
            ])),
        )
        .tensor(
            "a",
            &[4, 2],
            DType::F32,
            f32_bytes(&[1., 2., 3., 4., 5., 6., 7., 8.]),
        )
        .tensor(
            "b",
            &[32, 2],
            DType::Q8_0,
            (0..68).map(|i| i as u8).collect(),
        )
        .tensor("c", &[32], DType::Q4_1, vec![9u8; 20])
}

fn write(dir: &Path, name: &str, bytes: &[u8]) -> PathBuf {
    let p = dir.join(name);
    std::fs::write(&p, bytes).unwrap();
    p
}

fn open_err(dir: &Path, bytes: &[u8]) -> (String, EngineError) {
    let p = write(dir, "bad.gguf", bytes);
    let e = GgufFile::open(&p).expect_err("corrupt file must be refused");
    let msg = e.to_string();
    assert!(
        msg.contains(&p.display().to_string()),
        "error names the file: {msg}"
    );
    (msg, e)
}

/// Byte offset of the first metadata key's length field.
const FIRST_KEY_LEN: usize = 24;

#[test]
fn writer_output_reads_back_with_every_value_type() {
    let dir = tempfile::tempdir().unwrap();
    let p = write(dir.path(), "ok.gguf", &sample().to_bytes());
    let f = GgufFile::open(&p).unwrap();
    assert_eq!(f.metadata().len(), 16);
    assert_eq!(f.get("u8"), Some(&MetaValue::U8(7)));
    assert_eq!(f.get("i16"), Some(&MetaValue::I16(-700)));
    assert_eq!(f.get_u32("u8").unwrap(), 7);
    assert_eq!(f.get_u32("u16").unwrap(), 700);
    assert_eq!(f.get_i32("i32").unwrap(), -70_000);
    assert_eq!(f.get_u64("u64").unwrap(), 7_000_000_000);
    assert_eq!(f.get("i64"), Some(&MetaValue::I64(-7_000_000_000)));
    assert_eq!(f.get_f32("f32").unwrap(), 1.5);
    assert_eq!(f.get_f32("f64").unwrap(), 2.25);
    assert!(f.get_bool("bool").unwrap());
    assert_eq!(f.get_string_array("strings").unwrap(), ["a", "ĠHello", ""]);
    assert_eq!(f.get_i32_array("ints").unwrap(), [1, -2, 3]);
    assert_eq!(f.get_f32_array("floats").unwrap(), [0.5, -1.0]);
    assert!(matches!(f.get("nested"), Some(MetaValue::Array(MetaArray::Array(v))) if v.len() == 2));
    let a = f.tensor("a").unwrap();
    assert_eq!(
        (a.dims(), a.dtype(), a.n_elements()),
        (&[4, 2][..], DType::F32, 8)
    );
    assert_eq!(
        f.tensor_data(a),
        f32_bytes(&[1., 2., 3., 4., 5., 6., 7., 8.])
    );
    let b = f.tensor("b").unwrap();
    assert_eq!(
        f.tensor_data(b),
        (0..68).map(|i| i as u8).collect::<Vec<_>>()
    );
    assert_eq!(b.offset() % 32, 0);
    assert_eq!(f.tensor_data(f.tensor("c").unwrap()), vec![9u8; 20]);
}

#[test]
fn out_of_range_integers_are_refused_by_narrow_getters() {
    let dir = tempfile::tempdir().unwrap();
    let f = GgufFile::open(write(dir.path(), "ok.gguf", &sample().to_bytes())).unwrap();
    let err = f.get_u32("i8").unwrap_err().to_string();
    assert!(
        err.contains("'i8'") && err.contains("i8 (-7)") && err.contains("u32"),
        "{err}"
    );
    assert!(f.get_i32("u64").is_err());
    assert!(
        f.get_u32_array("ints")
            .unwrap_err()
            .to_string()
            .contains("-2 at index 1")
    );
    assert_eq!(f.get_u32_opt("absent").unwrap(), None);
    assert!(f.get_u32_opt("general.architecture").is_err());
}

#[test]
fn custom_alignment_is_honoured() {
    let dir = tempfile::tempdir().unwrap();
    let bytes = sample().metadata("general.alignment", 64u32).to_bytes();
    let f = GgufFile::open(write(dir.path(), "a64.gguf", &bytes)).unwrap();
    assert_eq!(f.alignment(), 64);
    assert_eq!(f.data_start() % 64, 0);
    assert!(f.tensors().iter().all(|t| t.offset() % 64 == 0));
    assert_eq!(f.tensor_data(f.tensor("c").unwrap()), vec![9u8; 20]);

    let bytes = sample().metadata("general.alignment", 48u32).to_bytes();
    let (msg, _) = open_err(dir.path(), &bytes);
    assert!(
        msg.contains("general.alignment") && msg.contains("power of two"),
        "{msg}"
    );
}

#[test]
fn truncation_at_every_offset_gives_an_error_not_a_panic() {
    let dir = tempfile::tempdir().unwrap();
    let bytes = sample().to_bytes();
    let full = GgufFile::open(write(dir.path(), "ok.gguf", &bytes)).unwrap();
    let data_end = full
        .tensors()
        .iter()
        .map(|t| full.data_start() + t.offset() as usize + t.size_bytes())
        .max()
        .unwrap();
    for cut in 0..bytes.len() {
        let p = write(dir.path(), "cut.gguf", &bytes[..cut]);
        match GgufFile::open(&p) {
            Ok(_) => assert!(cut >= data_end, "cut at {cut} < {data_end} was accepted"),
            Err(e) => {
                assert!(
                    cut < data_end,
                    "cut at {cut} only removes padding, yet: {e}"
                );
                let msg = e.to_string();
                assert!(msg.contains(&p.display().to_string()), "{msg}");
                assert!(
                    matches!(
                        e,
                        EngineError::Gguf(GgufError::Truncated { .. })
                            | EngineError::Gguf(GgufError::Corrupt { .. })
                            | EngineError::Gguf(GgufError::BadMagic { .. })
                            | EngineError::Gguf(GgufError::BadTensor { .. })
                    ),
                    "cut at {cut}: {msg}"
                );
            }
        }
    }
}

#[test]
fn wrong_magic_and_unsupported_versions_are_named() {
    let dir = tempfile::tempdir().unwrap();
    let mut bytes = sample().to_bytes();
    bytes[..4].copy_from_slice(b"GGML");
    let (msg, e) = open_err(dir.path(), &bytes);
    assert!(
        matches!(e, EngineError::Gguf(GgufError::BadMagic { .. })),
        "{msg}"
    );
    assert!(msg.contains("not a GGUF file"), "{msg}");
    for v in [1u32, 4, 0xFFFF_FFFF] {
        let mut bytes = sample().to_bytes();
        bytes[4..8].copy_from_slice(&v.to_le_bytes());
        let (msg, _) = open_err(dir.path(), &bytes);
        assert!(msg.contains(&format!("version {v}")), "{msg}");
    }
    let (msg, _) = open_err(dir.path(), b"");
    assert!(msg.contains("not a GGUF file"), "{msg}");
}

#[test]
fn unknown_tensor_type_names_the_tensor_and_the_type_id() {
    let dir = tempfile::tempdir().unwrap();
    let bytes = GgufBuilder::new()
        .tensor_with_type_id("blk.0.attn_q.weight", &[32, 1], 6, vec![0; 22])
        .to_bytes();
    let (msg, e) = open_err(dir.path(), &bytes);
    assert!(
        matches!(&e, EngineError::Gguf(GgufError::UnknownTensorType { tensor, type_id: 6, .. }) if tensor == "blk.0.attn_q.weight"),
        "{msg}"
    );
    assert!(
        msg.contains("'blk.0.attn_q.weight'") && msg.contains("type id 6"),
        "{msg}"
    );
}

#[test]
fn absurd_lengths_and_counts_are_refused_before_allocating() {
    let dir = tempfile::tempdir().unwrap();
    let base = sample().to_bytes();
    let patch = |at: usize, v: u64| {
        let mut b = base.clone();
        b[at..at + 8].copy_from_slice(&v.to_le_bytes());
        b
    };
    for huge in [u64::MAX, 1 << 62, 1 << 40, base.len() as u64] {
        let (msg, _) = open_err(dir.path(), &patch(FIRST_KEY_LEN, huge));
        assert!(
            msg.contains("length of key of metadata entry 0") && msg.contains("exceed"),
            "{msg}"
        );
        let (msg, _) = open_err(dir.path(), &patch(8, huge));
        assert!(
            msg.contains("tensor count") && msg.contains("exceed"),
            "{msg}"
        );
        let (msg, _) = open_err(dir.path(), &patch(16, huge));
        assert!(
            msg.contains("metadata entry count") && msg.contains("exceed"),
            "{msg}"
        );
    }
    // A string array whose count is absurd.
    let bytes = GgufBuilder::new()
        .metadata("tokens", vec!["a", "b"])
        .to_bytes();
    let count_at = FIRST_KEY_LEN + 8 + "tokens".len() + 4 + 4;
    let mut b = bytes.clone();
    b[count_at..count_at + 8].copy_from_slice(&(1u64 << 61).to_le_bytes());
    let (msg, _) = open_err(dir.path(), &b);
    assert!(
        msg.contains("element count of value of 'tokens'") && msg.contains("exceed"),
        "{msg}"
    );
    // An element string whose length is absurd.
    let mut b = bytes;
    b[count_at + 8..count_at + 16].copy_from_slice(&u64::MAX.to_le_bytes());
    let (msg, _) = open_err(dir.path(), &b);
    assert!(msg.contains("element 0 of value of 'tokens'"), "{msg}");
}

#[test]
fn tensor_table_inconsistencies_name_the_tensor() {
    let dir = tempfile::tempdir().unwrap();
    // Data past the end of the file.
    let bytes = GgufBuilder::new()
        .tensor("big", &[4, 8], DType::F32, vec![0; 16])
        .to_bytes();
    let (msg, _) = open_err(dir.path(), &bytes);
    assert!(
        msg.contains("'big'") && msg.contains("past the data section"),
        "{msg}"
    );
    // A row length that is not a whole number of blocks.
    let bytes = GgufBuilder::new()
        .tensor("odd", &[33], DType::Q4_1, vec![0; 64])
        .to_bytes();
    let (msg, _) = open_err(dir.path(), &bytes);
    assert!(
        msg.contains("'odd'") && msg.contains("block size 32"),
        "{msg}"
    );
    // Element counts that overflow.
    let bytes = GgufBuilder::new()
        .tensor("huge", &[u64::MAX, u64::MAX], DType::F32, vec![0; 4])
        .to_bytes();
    let (msg, _) = open_err(dir.path(), &bytes);
    assert!(
        msg.contains("'huge'") && msg.contains("more elements"),
        "{msg}"
    );
    // Too many dimensions.
    let bytes = GgufBuilder::new()
        .tensor("5d", &[1, 1, 1, 1, 1], DType::F32, vec![0; 4])
        .to_bytes();
    let (msg, _) = open_err(dir.path(), &bytes);
    assert!(msg.contains("'5d' has 5 dimensions"), "{msg}");
    // A misaligned offset: patch the second tensor's offset by 4.
    let bytes = GgufBuilder::new()
        .tensor("t0", &[1], DType::F32, vec![0; 4])
        .tensor("t1", &[1], DType::F32, vec![0; 4])
        .to_bytes();
    // Header (24) + t0's entry (name 8+2, n_dims 4, dim 8, type 4, offset 8)
    // + t1's entry up to its offset field.
    let entry = 8 + 2 + 4 + 8 + 4 + 8;
    let off_at = 24 + 2 * entry - 8;
    let mut b = bytes.clone();
    let old = u64::from_le_bytes(b[off_at..off_at + 8].try_into().unwrap());
    assert_eq!(old, 32, "located t1's offset field");
    b[off_at..off_at + 8].copy_from_slice(&36u64.to_le_bytes());
    let (msg, _) = open_err(dir.path(), &b);
    assert!(
        msg.contains("'t1'") && msg.contains("not a multiple of the alignment 32"),
        "{msg}"
    );
    // Duplicate names.
    let bytes = GgufBuilder::new()
        .tensor("t", &[1], DType::F32, vec![0; 4])
        .tensor("t", &[1], DType::F32, vec![0; 4])
        .to_bytes();
    let (msg, _) = open_err(dir.path(), &bytes);
    assert!(msg.contains("duplicate tensor name 't'"), "{msg}");
    let bytes = GgufBuilder::new()
        .metadata("k", 1u8)
        .metadata("k", 2u8)
        .to_bytes();
    let (msg, _) = open_err(dir.path(), &bytes);
    assert!(msg.contains("duplicate metadata key 'k'"), "{msg}");
}

#[test]
fn bad_value_types_bools_and_utf8_are_refused() {
    let dir = tempfile::tempdir().unwrap();
    let bytes = GgufBuilder::new().metadata("k", true).to_bytes();
    let type_at = FIRST_KEY_LEN + 8 + 1;
    let mut b = bytes.clone();
    b[type_at..type_at + 4].copy_from_slice(&13u32.to_le_bytes());
    let (msg, _) = open_err(dir.path(), &b);
    assert!(msg.contains("value type of 'k' is 13"), "{msg}");
    let mut b = bytes;
    b[type_at + 4] = 2;
    let (msg, _) = open_err(dir.path(), &b);
    assert!(msg.contains("value of 'k' is 2, not a bool"), "{msg}");
    let mut b = GgufBuilder::new().metadata("k", 1u8).to_bytes();
    b[FIRST_KEY_LEN + 8] = 0xFF;
    let (msg, _) = open_err(dir.path(), &b);
    assert!(
        msg.contains("key of metadata entry 0 is not valid UTF-8"),
        "{msg}"
    );
}

#[test]
fn deeply_nested_arrays_are_refused() {
    let dir = tempfile::tempdir().unwrap();
    let mut v = MetaArray::U8(vec![1]);
    for _ in 0..6 {
        v = MetaArray::Array(vec![v]);
    }
    let bytes = GgufBuilder::new()
        .metadata("deep", MetaValue::Array(v))
        .to_bytes();
    let (msg, _) = open_err(dir.path(), &bytes);
    assert!(msg.contains("nests arrays deeper"), "{msg}");
}

proptest! {
    #![proptest_config(ProptestConfig { cases: 512, ..ProptestConfig::default() })]

    /// Random byte flips: either a clear error or a file whose every tensor
    /// slice has the size its table entry says.
    #[test]
    fn random_byte_flips_never_panic(flips in prop::collection::vec((any::<prop::sample::Index>(), 1u8..=255), 1..6)) {
        let mut bytes = sample().to_bytes();
        let len = bytes.len();
        for (at, x) in flips {
            bytes[at.index(len)] ^= x;
        }
        let dir = tempfile::tempdir().unwrap();
        let p = write(dir.path(), "flip.gguf", &bytes);
        match GgufFile::open(&p) {
            Ok(f) => {
                for t in f.tensors() {
                    prop_assert_eq!(f.tensor_data(t).len(), t.size_bytes());
                }
                for (k, _) in f.metadata() {
                    let _ = (f.get_u32(k), f.get_str(k), f.get_f32_array(k), f.get_i32_array(k));
                }
            }
            Err(e) => prop_assert!(e.to_string().contains(&p.display().to_string())),
        }
    }
}
