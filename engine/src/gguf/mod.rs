//! GGUF reader (versions 2 and 3), memory-mapped, and a small writer.
//!
//! | file | what lives there |
//! | --- | --- |
//! | `gguf/mod.rs` | the file as read: [`GgufFile`], [`TensorInfo`], typed metadata getters |
//! | `gguf/meta.rs` | metadata value types and values |
//! | `gguf/parse.rs` | the bounds-checked parser of the header, metadata and tensor table |
//! | `gguf/write.rs` | [`GgufBuilder`], the writer for synthetic models and tests |
//!
//! File layout (all integers little-endian):
//!
//! ```text
//!  offset 0   +-------------------------------+
//!             | magic "GGUF"   u32            |
//!             | version        u32  (2 or 3)  |
//!             | tensor_count   u64            |
//!             | kv_count       u64            |
//!             +-------------------------------+
//!             | kv_count × { key: string, type: u32, value }   metadata
//!             +-------------------------------+
//!             | tensor_count × { name: string, n_dims: u32,    tensor table
//!             |   dims: u64 × n_dims, type: u32, offset: u64 } |
//!             +-------------------------------+
//!             | padding to `general.alignment` (default 32)    |
//!  data_start +-------------------------------+
//!             | tensor data; each tensor at data_start+offset, |
//!             | offset a multiple of the alignment             |
//!             +-------------------------------+
//!  string = { len: u64, bytes: u8 × len }   (UTF-8, no terminator)
//!  array  = { elem_type: u32, count: u64, count × value }
//! ```
//!
//! Dimensions are in GGML order: `dims[0]` is the row length (the fastest
//! varying index), so a `[rows, cols]` matrix is stored with
//! `dims == [cols, rows]`.
//!
//! The reader never trusts a count or a length: each is bounded by the bytes
//! left in the file before anything is allocated, so a corrupt file gives a
//! [`GgufError`] naming the file and the offset, never a panic or a huge
//! allocation.

use std::collections::HashMap;
use std::fmt;
use std::path::{Path, PathBuf};

use kvsan_kernels::DType;

use crate::error::EngineError;

mod meta;
mod parse;
mod write;

pub use crate::error::GgufError;
pub use meta::{MetaArray, MetaType, MetaValue};
use parse::Parser;
pub use write::GgufBuilder;

/// The four bytes every GGUF file starts with.
pub const GGUF_MAGIC: [u8; 4] = *b"GGUF";
/// Tensor data alignment when the file has no `general.alignment` key.
pub const DEFAULT_ALIGNMENT: u64 = 32;
/// Most dimensions a GGML tensor can have.
pub const MAX_DIMS: usize = 4;
/// Deepest nesting of arrays inside arrays the reader accepts.
const MAX_ARRAY_DEPTH: usize = 4;

/// One entry of the tensor table.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct TensorInfo {
    name: String,
    dims: Vec<usize>,
    dtype: DType,
    offset: u64,
    size_bytes: usize,
}

impl TensorInfo {
    /// The tensor's name (`blk.0.attn_q.weight`).
    #[must_use]
    pub fn name(&self) -> &str {
        &self.name
    }

    /// Dimensions in GGML order: `dims()[0]` is the row length.
    #[must_use]
    pub fn dims(&self) -> &[usize] {
        &self.dims
    }

    /// The element type.
    #[must_use]
    pub fn dtype(&self) -> DType {
        self.dtype
    }

    /// Offset of the tensor's data from the start of the data section.
    #[must_use]
    pub fn offset(&self) -> u64 {
        self.offset
    }

    /// Size of the tensor's data in bytes.
    #[must_use]
    pub fn size_bytes(&self) -> usize {
        self.size_bytes
    }

    /// Number of elements (product of the dimensions).
    #[must_use]
    pub fn n_elements(&self) -> usize {
        self.dims.iter().product()
    }

    /// Row length (`dims()[0]`).
    #[must_use]
    pub fn row_len(&self) -> usize {
        self.dims[0]
    }

    /// Number of rows (product of `dims()[1..]`).
    #[must_use]
    pub fn n_rows(&self) -> usize {
        self.dims[1..].iter().product()
    }
}

/// A GGUF file, memory-mapped: metadata and tensor table parsed, tensor
/// data borrowed from the mapping.
pub struct GgufFile {
    path: PathBuf,
    mmap: memmap2::Mmap,
    version: u32,
    metadata: Vec<(String, MetaValue)>,
    meta_index: HashMap<String, usize>,
    tensors: Vec<TensorInfo>,
    tensor_index: HashMap<String, usize>,
    alignment: u64,
    data_start: usize,
}

impl fmt::Debug for GgufFile {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("GgufFile")
            .field("path", &self.path)
            .field("version", &self.version)
            .field("metadata", &self.metadata.len())
            .field("tensors", &self.tensors.len())
            .field("alignment", &self.alignment)
            .field("data_start", &self.data_start)
            .finish()
    }
}

impl GgufFile {
    /// Opens, maps and parses `path`.
    ///
    /// # Errors
    /// [`EngineError::Io`] when the file cannot be opened or mapped;
    /// [`EngineError::Gguf`] naming the file and what is wrong when it is not
    /// a valid GGUF v2/v3 file with tensors of supported types.
    pub fn open(path: impl AsRef<Path>) -> Result<GgufFile, EngineError> {
        let path = path.as_ref().to_path_buf();
        let file = std::fs::File::open(&path).map_err(|e| EngineError::io(&path, "open", e))?;
        let len = file
            .metadata()
            .map_err(|e| EngineError::io(&path, "stat", e))?
            .len();
        if len < 4 {
            // Too short to map usefully (and an empty mapping is an error on
            // some systems): read what is there to report it.
            let found = std::fs::read(&path).map_err(|e| EngineError::io(&path, "read", e))?;
            return Err(GgufError::BadMagic { path, found }.into());
        }
        // SAFETY: the mapping is read-only and private to this process. The
        // file may be modified by another process while mapped; GGUF model
        // files are written once and treated as immutable by every tool that
        // uses them, as llama.cpp also assumes when it maps them.
        let mmap = unsafe { memmap2::Mmap::map(&file) }
            .map_err(|e| EngineError::io(&path, "memory-map", e))?;
        let parsed = Parser::new(&path, &mmap).parse()?;
        Ok(GgufFile {
            path,
            mmap,
            version: parsed.version,
            meta_index: parsed
                .metadata
                .iter()
                .enumerate()
                .map(|(i, (k, _))| (k.clone(), i))
                .collect(),
            metadata: parsed.metadata,
            tensor_index: parsed
                .tensors
                .iter()
                .enumerate()
                .map(|(i, t)| (t.name.clone(), i))
                .collect(),
            tensors: parsed.tensors,
            alignment: parsed.alignment,
            data_start: parsed.data_start,
        })
    }

    /// The file this was read from.
    #[must_use]
    pub fn path(&self) -> &Path {
        &self.path
    }

    /// The GGUF version (2 or 3).
    #[must_use]
    pub fn version(&self) -> u32 {
        self.version
    }

    /// Tensor data alignment in bytes.
    #[must_use]
    pub fn alignment(&self) -> u64 {
        self.alignment
    }

    /// Byte offset of the data section in the file.
    #[must_use]
    pub fn data_start(&self) -> usize {
        self.data_start
    }

    /// All metadata entries in file order.
    pub fn metadata(&self) -> impl ExactSizeIterator<Item = (&str, &MetaValue)> {
        self.metadata.iter().map(|(k, v)| (k.as_str(), v))
    }

    /// The value of `key`, if present.
    #[must_use]
    pub fn get(&self, key: &str) -> Option<&MetaValue> {
        self.meta_index.get(key).map(|&i| &self.metadata[i].1)
    }

    /// `general.architecture` (`llama`, …).
    ///
    /// # Errors
    /// When the key is missing or not a string.
    pub fn architecture(&self) -> Result<&str, GgufError> {
        self.get_str("general.architecture")
    }

    /// Every tensor in file order.
    #[must_use]
    pub fn tensors(&self) -> &[TensorInfo] {
        &self.tensors
    }

    /// The tensor named `name`.
    ///
    /// # Errors
    /// [`GgufError::MissingTensor`] naming the file and the tensor.
    pub fn tensor(&self, name: &str) -> Result<&TensorInfo, GgufError> {
        self.tensor_index
            .get(name)
            .map(|&i| &self.tensors[i])
            .ok_or_else(|| GgufError::MissingTensor {
                path: self.path.clone(),
                tensor: name.to_owned(),
            })
    }

    /// The bytes of a tensor's data.
    ///
    /// `info` must come from this file's table (every such range was checked
    /// at open); for a `TensorInfo` of another file whose range lies outside
    /// this file's data section the result is empty.
    #[must_use]
    pub fn tensor_data(&self, info: &TensorInfo) -> &[u8] {
        usize::try_from(info.offset)
            .ok()
            .and_then(|o| o.checked_add(self.data_start))
            .and_then(|start| Some(start..start.checked_add(info.size_bytes)?))
            .and_then(|range| self.mmap.get(range))
            .unwrap_or(&[])
    }

    fn missing(&self, key: &str, expected: &'static str) -> GgufError {
        GgufError::MissingKey {
            path: self.path.clone(),
            key: key.to_owned(),
            expected,
        }
    }

    fn wrong(&self, key: &str, expected: &'static str, found: String) -> GgufError {
        GgufError::KeyType {
            path: self.path.clone(),
            key: key.to_owned(),
            expected,
            found,
        }
    }

    fn get_or_missing(&self, key: &str, expected: &'static str) -> Result<&MetaValue, GgufError> {
        self.get(key).ok_or_else(|| self.missing(key, expected))
    }

    fn get_int<T: TryFrom<i128>>(&self, key: &str, expected: &'static str) -> Result<T, GgufError> {
        let v = self.get_or_missing(key, expected)?;
        v.as_integer()
            .and_then(|i| T::try_from(i).ok())
            .ok_or_else(|| self.wrong(key, expected, v.describe()))
    }

    /// `key` as a `u32`; any integer type whose value fits is accepted.
    ///
    /// # Errors
    /// When the key is missing, not an integer, or out of range.
    pub fn get_u32(&self, key: &str) -> Result<u32, GgufError> {
        self.get_int(key, "an integer in 0..=4294967295 (u32)")
    }

    /// `key` as a `u64`; any integer type whose value fits is accepted.
    ///
    /// # Errors
    /// When the key is missing, not an integer, or negative.
    pub fn get_u64(&self, key: &str) -> Result<u64, GgufError> {
        self.get_int(key, "a non-negative integer (u64)")
    }

    /// `key` as an `i32`; any integer type whose value fits is accepted.
    ///
    /// # Errors
    /// When the key is missing, not an integer, or out of range.
    pub fn get_i32(&self, key: &str) -> Result<i32, GgufError> {
        self.get_int(key, "an integer in i32 range")
    }

    /// `key` as a `usize`; any integer type whose value fits is accepted.
    ///
    /// # Errors
    /// When the key is missing, not an integer, or out of range.
    pub fn get_usize(&self, key: &str) -> Result<usize, GgufError> {
        self.get_int(key, "a non-negative integer (usize)")
    }

    /// `key` as an `f32`; `f32` and `f64` values are accepted.
    ///
    /// # Errors
    /// When the key is missing or not a float.
    pub fn get_f32(&self, key: &str) -> Result<f32, GgufError> {
        const EXPECTED: &str = "a float (f32)";
        match self.get_or_missing(key, EXPECTED)? {
            MetaValue::F32(v) => Ok(*v),
            MetaValue::F64(v) => Ok(*v as f32),
            other => Err(self.wrong(key, EXPECTED, other.describe())),
        }
    }

    /// `key` as a `bool`.
    ///
    /// # Errors
    /// When the key is missing or not a bool.
    pub fn get_bool(&self, key: &str) -> Result<bool, GgufError> {
        const EXPECTED: &str = "a bool";
        match self.get_or_missing(key, EXPECTED)? {
            MetaValue::Bool(v) => Ok(*v),
            other => Err(self.wrong(key, EXPECTED, other.describe())),
        }
    }

    /// `key` as a string.
    ///
    /// # Errors
    /// When the key is missing or not a string.
    pub fn get_str(&self, key: &str) -> Result<&str, GgufError> {
        const EXPECTED: &str = "a string";
        match self.get_or_missing(key, EXPECTED)? {
            MetaValue::String(v) => Ok(v),
            other => Err(self.wrong(key, EXPECTED, other.describe())),
        }
    }

    /// `key` as an array of strings.
    ///
    /// # Errors
    /// When the key is missing or not an array of strings.
    pub fn get_string_array(&self, key: &str) -> Result<&[String], GgufError> {
        const EXPECTED: &str = "an array of strings";
        match self.get_or_missing(key, EXPECTED)? {
            MetaValue::Array(MetaArray::String(v)) => Ok(v),
            other => Err(self.wrong(key, EXPECTED, other.describe())),
        }
    }

    fn get_int_array<T: TryFrom<i128>>(
        &self,
        key: &str,
        expected: &'static str,
    ) -> Result<Vec<T>, GgufError> {
        let v = self.get_or_missing(key, expected)?;
        let MetaValue::Array(a) = v else {
            return Err(self.wrong(key, expected, v.describe()));
        };
        let ints = a
            .as_integers()
            .ok_or_else(|| self.wrong(key, expected, v.describe()))?;
        ints.into_iter()
            .enumerate()
            .map(|(i, x)| {
                T::try_from(x).map_err(|_| self.wrong(key, expected, format!("{x} at index {i}")))
            })
            .collect()
    }

    /// `key` as an array of `i32`; arrays of any integer type whose values
    /// fit are accepted.
    ///
    /// # Errors
    /// When the key is missing, not an integer array, or a value is out of range.
    pub fn get_i32_array(&self, key: &str) -> Result<Vec<i32>, GgufError> {
        self.get_int_array(key, "an array of integers in i32 range")
    }

    /// `key` as an array of `u32`; arrays of any integer type whose values
    /// fit are accepted.
    ///
    /// # Errors
    /// When the key is missing, not an integer array, or a value is out of range.
    pub fn get_u32_array(&self, key: &str) -> Result<Vec<u32>, GgufError> {
        self.get_int_array(key, "an array of integers in u32 range")
    }

    /// `key` as an array of `f32`; `f32` and `f64` arrays are accepted.
    ///
    /// # Errors
    /// When the key is missing or not a float array.
    pub fn get_f32_array(&self, key: &str) -> Result<Vec<f32>, GgufError> {
        const EXPECTED: &str = "an array of floats";
        match self.get_or_missing(key, EXPECTED)? {
            MetaValue::Array(MetaArray::F32(v)) => Ok(v.clone()),
            MetaValue::Array(MetaArray::F64(v)) => Ok(v.iter().map(|&x| x as f32).collect()),
            other => Err(self.wrong(key, EXPECTED, other.describe())),
        }
    }

    /// [`GgufFile::get_u32`] for an optional key: `Ok(None)` when absent.
    ///
    /// # Errors
    /// When the key is present with the wrong type.
    pub fn get_u32_opt(&self, key: &str) -> Result<Option<u32>, GgufError> {
        self.get(key).map(|_| self.get_u32(key)).transpose()
    }

    /// [`GgufFile::get_f32`] for an optional key: `Ok(None)` when absent.
    ///
    /// # Errors
    /// When the key is present with the wrong type.
    pub fn get_f32_opt(&self, key: &str) -> Result<Option<f32>, GgufError> {
        self.get(key).map(|_| self.get_f32(key)).transpose()
    }

    /// [`GgufFile::get_bool`] for an optional key: `Ok(None)` when absent.
    ///
    /// # Errors
    /// When the key is present with the wrong type.
    pub fn get_bool_opt(&self, key: &str) -> Result<Option<bool>, GgufError> {
        self.get(key).map(|_| self.get_bool(key)).transpose()
    }

    /// [`GgufFile::get_str`] for an optional key: `Ok(None)` when absent.
    ///
    /// # Errors
    /// When the key is present with the wrong type.
    pub fn get_str_opt(&self, key: &str) -> Result<Option<&str>, GgufError> {
        self.get(key).map(|_| self.get_str(key)).transpose()
    }
}
