//! The GGUF v3 writer, for synthetic models and tests.

use std::path::Path;

use kvsan_kernels::DType;

use super::{DEFAULT_ALIGNMENT, GGUF_MAGIC, MetaArray, MetaValue};
use crate::error::EngineError;

/// A tensor queued in a [`GgufBuilder`].
#[derive(Debug, Clone)]
struct BuilderTensor {
    name: String,
    dims: Vec<u64>,
    type_id: u32,
    data: Vec<u8>,
}

/// Writes GGUF v3 files: for synthetic models and for tests.
///
/// Tensors are laid out in insertion order, each padded to the alignment
/// (`general.alignment` if set as a `u32` metadata value, else 32).
///
/// ```
/// use kvsan_engine::gguf::{GgufBuilder, GgufFile};
/// use kvsan_kernels::DType;
///
/// let dir = tempfile::tempdir().unwrap();
/// let path = dir.path().join("tiny.gguf");
/// GgufBuilder::new()
///     .metadata("general.architecture", "llama")
///     .tensor("w", &[4, 2], DType::F32, vec![0u8; 32])
///     .write(&path)
///     .unwrap();
/// let f = GgufFile::open(&path).unwrap();
/// assert_eq!(f.tensor("w").unwrap().dims(), &[4, 2]);
/// ```
#[derive(Debug, Clone, Default)]
pub struct GgufBuilder {
    metadata: Vec<(String, MetaValue)>,
    tensors: Vec<BuilderTensor>,
}

impl GgufBuilder {
    /// An empty file: no metadata, no tensors.
    #[must_use]
    pub fn new() -> Self {
        Self::default()
    }

    /// Adds a metadata entry (written in insertion order).
    #[must_use]
    pub fn metadata(mut self, key: impl Into<String>, value: impl Into<MetaValue>) -> Self {
        self.metadata.push((key.into(), value.into()));
        self
    }

    /// Adds a tensor with dimensions in GGML order (`dims[0]` = row length)
    /// and its raw bytes (already in `dtype`'s block encoding).
    #[must_use]
    pub fn tensor(
        self,
        name: impl Into<String>,
        dims: &[u64],
        dtype: DType,
        data: Vec<u8>,
    ) -> Self {
        self.tensor_with_type_id(name, dims, dtype.ggml_id(), data)
    }

    /// Adds a tensor with a raw GGML type id (which may be one the reader
    /// rejects — for tests of that path).
    #[must_use]
    pub fn tensor_with_type_id(
        mut self,
        name: impl Into<String>,
        dims: &[u64],
        type_id: u32,
        data: Vec<u8>,
    ) -> Self {
        self.tensors.push(BuilderTensor {
            name: name.into(),
            dims: dims.to_vec(),
            type_id,
            data,
        });
        self
    }

    fn alignment(&self) -> u64 {
        self.metadata
            .iter()
            .find_map(|(k, v)| match (k.as_str(), v) {
                ("general.alignment", MetaValue::U32(a)) if a.is_power_of_two() => {
                    Some(u64::from(*a))
                }
                _ => None,
            })
            .unwrap_or(DEFAULT_ALIGNMENT)
    }

    /// The encoded file.
    #[must_use]
    pub fn to_bytes(&self) -> Vec<u8> {
        let align = self.alignment() as usize;
        let pad = |out: &mut Vec<u8>| out.resize(out.len().div_ceil(align) * align, 0);
        let mut out = Vec::new();
        out.extend_from_slice(&GGUF_MAGIC);
        out.extend_from_slice(&3u32.to_le_bytes());
        out.extend_from_slice(&(self.tensors.len() as u64).to_le_bytes());
        out.extend_from_slice(&(self.metadata.len() as u64).to_le_bytes());
        for (k, v) in &self.metadata {
            write_string(&mut out, k);
            out.extend_from_slice(&(v.meta_type() as u32).to_le_bytes());
            write_value(&mut out, v);
        }
        let mut offset = 0usize;
        for t in &self.tensors {
            write_string(&mut out, &t.name);
            out.extend_from_slice(&(t.dims.len() as u32).to_le_bytes());
            for d in &t.dims {
                out.extend_from_slice(&d.to_le_bytes());
            }
            out.extend_from_slice(&t.type_id.to_le_bytes());
            out.extend_from_slice(&(offset as u64).to_le_bytes());
            offset = (offset + t.data.len()).div_ceil(align) * align;
        }
        pad(&mut out);
        for t in &self.tensors {
            out.extend_from_slice(&t.data);
            pad(&mut out);
        }
        out
    }

    /// Writes the encoded file to `path`.
    ///
    /// # Errors
    /// [`EngineError::Io`] when the file cannot be written.
    pub fn write(&self, path: impl AsRef<Path>) -> Result<(), EngineError> {
        let path = path.as_ref();
        std::fs::write(path, self.to_bytes()).map_err(|e| EngineError::io(path, "write", e))
    }
}

fn write_string(out: &mut Vec<u8>, s: &str) {
    out.extend_from_slice(&(s.len() as u64).to_le_bytes());
    out.extend_from_slice(s.as_bytes());
}

fn write_value(out: &mut Vec<u8>, v: &MetaValue) {
    match v {
        MetaValue::U8(x) => out.push(*x),
        MetaValue::I8(x) => out.extend_from_slice(&x.to_le_bytes()),
        MetaValue::U16(x) => out.extend_from_slice(&x.to_le_bytes()),
        MetaValue::I16(x) => out.extend_from_slice(&x.to_le_bytes()),
        MetaValue::U32(x) => out.extend_from_slice(&x.to_le_bytes()),
        MetaValue::I32(x) => out.extend_from_slice(&x.to_le_bytes()),
        MetaValue::F32(x) => out.extend_from_slice(&x.to_le_bytes()),
        MetaValue::Bool(x) => out.push(u8::from(*x)),
        MetaValue::String(s) => write_string(out, s),
        MetaValue::Array(a) => write_array(out, a),
        MetaValue::U64(x) => out.extend_from_slice(&x.to_le_bytes()),
        MetaValue::I64(x) => out.extend_from_slice(&x.to_le_bytes()),
        MetaValue::F64(x) => out.extend_from_slice(&x.to_le_bytes()),
    }
}

fn write_array(out: &mut Vec<u8>, a: &MetaArray) {
    out.extend_from_slice(&(a.elem_type() as u32).to_le_bytes());
    out.extend_from_slice(&(a.len() as u64).to_le_bytes());
    macro_rules! each {
        ($v:expr) => {
            for x in $v {
                out.extend_from_slice(&x.to_le_bytes());
            }
        };
    }
    match a {
        MetaArray::U8(v) => out.extend_from_slice(v),
        MetaArray::I8(v) => each!(v),
        MetaArray::U16(v) => each!(v),
        MetaArray::I16(v) => each!(v),
        MetaArray::U32(v) => each!(v),
        MetaArray::I32(v) => each!(v),
        MetaArray::F32(v) => each!(v),
        MetaArray::Bool(v) => out.extend(v.iter().map(|&b| u8::from(b))),
        MetaArray::String(v) => v.iter().for_each(|s| write_string(out, s)),
        MetaArray::Array(v) => v.iter().for_each(|x| write_array(out, x)),
        MetaArray::U64(v) => each!(v),
        MetaArray::I64(v) => each!(v),
        MetaArray::F64(v) => each!(v),
    }
}
