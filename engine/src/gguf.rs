//! GGUF reader (versions 2 and 3), memory-mapped, and a small writer.
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
//! left in the file before anything is allocated, so a corrupt file gives an
//! [`EngineError`] naming the file and the offset, never a panic or a huge
//! allocation.

use std::collections::HashMap;
use std::fmt;
use std::path::{Path, PathBuf};

use kvsan_kernels::DType;

use crate::error::EngineError;

/// The four bytes every GGUF file starts with.
pub const GGUF_MAGIC: [u8; 4] = *b"GGUF";
/// Tensor data alignment when the file has no `general.alignment` key.
pub const DEFAULT_ALIGNMENT: u64 = 32;
/// Most dimensions a GGML tensor can have.
pub const MAX_DIMS: usize = 4;
/// Deepest nesting of arrays inside arrays the reader accepts.
const MAX_ARRAY_DEPTH: usize = 4;

/// A GGUF metadata value type id (`gguf_type`).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
#[repr(u32)]
pub enum MetaType {
    /// `u8`
    U8 = 0,
    /// `i8`
    I8 = 1,
    /// `u16`
    U16 = 2,
    /// `i16`
    I16 = 3,
    /// `u32`
    U32 = 4,
    /// `i32`
    I32 = 5,
    /// `f32`
    F32 = 6,
    /// `bool` (one byte, 0 or 1)
    Bool = 7,
    /// length-prefixed UTF-8 string
    String = 8,
    /// typed array
    Array = 9,
    /// `u64`
    U64 = 10,
    /// `i64`
    I64 = 11,
    /// `f64`
    F64 = 12,
}

impl MetaType {
    /// The type with id `id`, if it is one.
    #[must_use]
    pub fn from_id(id: u32) -> Option<MetaType> {
        use MetaType::*;
        Some(match id {
            0 => U8,
            1 => I8,
            2 => U16,
            3 => I16,
            4 => U32,
            5 => I32,
            6 => F32,
            7 => Bool,
            8 => String,
            9 => Array,
            10 => U64,
            11 => I64,
            12 => F64,
            _ => return None,
        })
    }

    /// Lowercase name, as used in error messages.
    #[must_use]
    pub const fn name(self) -> &'static str {
        match self {
            MetaType::U8 => "u8",
            MetaType::I8 => "i8",
            MetaType::U16 => "u16",
            MetaType::I16 => "i16",
            MetaType::U32 => "u32",
            MetaType::I32 => "i32",
            MetaType::F32 => "f32",
            MetaType::Bool => "bool",
            MetaType::String => "string",
            MetaType::Array => "array",
            MetaType::U64 => "u64",
            MetaType::I64 => "i64",
            MetaType::F64 => "f64",
        }
    }

    /// Smallest encoded size of one value of this type, in bytes.
    const fn min_size(self) -> u64 {
        match self {
            MetaType::U8 | MetaType::I8 | MetaType::Bool => 1,
            MetaType::U16 | MetaType::I16 => 2,
            MetaType::U32 | MetaType::I32 | MetaType::F32 => 4,
            MetaType::U64 | MetaType::I64 | MetaType::F64 | MetaType::String => 8,
            MetaType::Array => 12,
        }
    }
}

/// One metadata value.
#[derive(Debug, Clone, PartialEq)]
pub enum MetaValue {
    /// `u8`
    U8(u8),
    /// `i8`
    I8(i8),
    /// `u16`
    U16(u16),
    /// `i16`
    I16(i16),
    /// `u32`
    U32(u32),
    /// `i32`
    I32(i32),
    /// `f32`
    F32(f32),
    /// `bool`
    Bool(bool),
    /// string
    String(String),
    /// typed array
    Array(MetaArray),
    /// `u64`
    U64(u64),
    /// `i64`
    I64(i64),
    /// `f64`
    F64(f64),
}

/// A metadata array: every element has the same type.
#[derive(Debug, Clone, PartialEq)]
pub enum MetaArray {
    /// `u8` elements
    U8(Vec<u8>),
    /// `i8` elements
    I8(Vec<i8>),
    /// `u16` elements
    U16(Vec<u16>),
    /// `i16` elements
    I16(Vec<i16>),
    /// `u32` elements
    U32(Vec<u32>),
    /// `i32` elements
    I32(Vec<i32>),
    /// `f32` elements
    F32(Vec<f32>),
    /// `bool` elements
    Bool(Vec<bool>),
    /// string elements
    String(Vec<String>),
    /// arrays (each with its own element type)
    Array(Vec<MetaArray>),
    /// `u64` elements
    U64(Vec<u64>),
    /// `i64` elements
    I64(Vec<i64>),
    /// `f64` elements
    F64(Vec<f64>),
}

impl MetaValue {
    /// The value's type.
    #[must_use]
    pub fn meta_type(&self) -> MetaType {
        match self {
            MetaValue::U8(_) => MetaType::U8,
            MetaValue::I8(_) => MetaType::I8,
            MetaValue::U16(_) => MetaType::U16,
            MetaValue::I16(_) => MetaType::I16,
            MetaValue::U32(_) => MetaType::U32,
            MetaValue::I32(_) => MetaType::I32,
            MetaValue::F32(_) => MetaType::F32,
            MetaValue::Bool(_) => MetaType::Bool,
            MetaValue::String(_) => MetaType::String,
            MetaValue::Array(_) => MetaType::Array,
            MetaValue::U64(_) => MetaType::U64,
            MetaValue::I64(_) => MetaType::I64,
            MetaValue::F64(_) => MetaType::F64,
        }
    }

    /// The value as a signed 128-bit integer, if it is an integer of any width.
    #[must_use]
    pub fn as_integer(&self) -> Option<i128> {
        Some(match *self {
            MetaValue::U8(v) => v.into(),
            MetaValue::I8(v) => v.into(),
            MetaValue::U16(v) => v.into(),
            MetaValue::I16(v) => v.into(),
            MetaValue::U32(v) => v.into(),
            MetaValue::I32(v) => v.into(),
            MetaValue::U64(v) => v.into(),
            MetaValue::I64(v) => v.into(),
            _ => return None,
        })
    }

    /// A short description for error messages: `u32 (7)`, `string`,
    /// `array of 49152 string`.
    #[must_use]
    pub fn describe(&self) -> String {
        match self {
            MetaValue::String(_) => "string".to_owned(),
            MetaValue::Array(a) => format!("array of {} {}", a.len(), a.elem_type().name()),
            MetaValue::F32(v) => format!("f32 ({v})"),
            MetaValue::F64(v) => format!("f64 ({v})"),
            MetaValue::Bool(v) => format!("bool ({v})"),
            other => format!(
                "{} ({})",
                other.meta_type().name(),
                other.as_integer().unwrap_or_default()
            ),
        }
    }
}

impl MetaArray {
    /// Number of elements.
    #[must_use]
    pub fn len(&self) -> usize {
        match self {
            MetaArray::U8(v) => v.len(),
            MetaArray::I8(v) => v.len(),
            MetaArray::U16(v) => v.len(),
            MetaArray::I16(v) => v.len(),
            MetaArray::U32(v) => v.len(),
            MetaArray::I32(v) => v.len(),
            MetaArray::F32(v) => v.len(),
            MetaArray::Bool(v) => v.len(),
            MetaArray::String(v) => v.len(),
            MetaArray::Array(v) => v.len(),
            MetaArray::U64(v) => v.len(),
            MetaArray::I64(v) => v.len(),
            MetaArray::F64(v) => v.len(),
        }
    }

    /// Whether the array has no elements.
    #[must_use]
    pub fn is_empty(&self) -> bool {
        self.len() == 0
    }

    /// The element type.
    #[must_use]
    pub fn elem_type(&self) -> MetaType {
        match self {
            MetaArray::U8(_) => MetaType::U8,
            MetaArray::I8(_) => MetaType::I8,
            MetaArray::U16(_) => MetaType::U16,
            MetaArray::I16(_) => MetaType::I16,
            MetaArray::U32(_) => MetaType::U32,
            MetaArray::I32(_) => MetaType::I32,
            MetaArray::F32(_) => MetaType::F32,
            MetaArray::Bool(_) => MetaType::Bool,
            MetaArray::String(_) => MetaType::String,
            MetaArray::Array(_) => MetaType::Array,
            MetaArray::U64(_) => MetaType::U64,
            MetaArray::I64(_) => MetaType::I64,
            MetaArray::F64(_) => MetaType::F64,
        }
    }

    /// The elements as signed 128-bit integers, if the element type is an
    /// integer type of any width.
    #[must_use]
    pub fn as_integers(&self) -> Option<Vec<i128>> {
        fn widen<T: Copy + Into<i128>>(v: &[T]) -> Vec<i128> {
            v.iter().map(|&x| x.into()).collect()
        }
        Some(match self {
            MetaArray::U8(v) => widen(v),
            MetaArray::I8(v) => widen(v),
            MetaArray::U16(v) => widen(v),
            MetaArray::I16(v) => widen(v),
            MetaArray::U32(v) => widen(v),
            MetaArray::I32(v) => widen(v),
            MetaArray::U64(v) => widen(v),
            MetaArray::I64(v) => widen(v),
            _ => return None,
        })
    }
}

macro_rules! meta_from {
    ($($t:ty => $variant:ident),* $(,)?) => {$(
        impl From<$t> for MetaValue {
            fn from(v: $t) -> Self { MetaValue::$variant(v) }
        }
        impl From<Vec<$t>> for MetaValue {
            fn from(v: Vec<$t>) -> Self { MetaValue::Array(MetaArray::$variant(v)) }
        }
    )*};
}
meta_from!(u8 => U8, i8 => I8, u16 => U16, i16 => I16, u32 => U32, i32 => I32, f32 => F32,
    bool => Bool, String => String, u64 => U64, i64 => I64, f64 => F64);

impl From<&str> for MetaValue {
    fn from(v: &str) -> Self {
        MetaValue::String(v.to_owned())
    }
}

impl From<Vec<&str>> for MetaValue {
    fn from(v: Vec<&str>) -> Self {
        MetaValue::Array(MetaArray::String(
            v.into_iter().map(str::to_owned).collect(),
        ))
    }
}

impl fmt::Display for MetaValue {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            MetaValue::String(s) => write!(f, "{s:?}"),
            MetaValue::Array(a) => write!(f, "[{} × {}]", a.len(), a.elem_type().name()),
            MetaValue::F32(v) => write!(f, "{v}"),
            MetaValue::F64(v) => write!(f, "{v}"),
            MetaValue::Bool(v) => write!(f, "{v}"),
            other => write!(f, "{}", other.as_integer().unwrap_or_default()),
        }
    }
}

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
    /// [`EngineError::Io`] when the file cannot be opened or mapped; a
    /// `Gguf*` variant naming the file and what is wrong when it is not a
    /// valid GGUF v2/v3 file with tensors of supported types.
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
            return Err(EngineError::GgufBadMagic { path, found });
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
    pub fn architecture(&self) -> Result<&str, EngineError> {
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
    /// [`EngineError::GgufMissingTensor`] naming the file and the tensor.
    pub fn tensor(&self, name: &str) -> Result<&TensorInfo, EngineError> {
        self.tensor_index
            .get(name)
            .map(|&i| &self.tensors[i])
            .ok_or_else(|| EngineError::GgufMissingTensor {
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

    fn missing(&self, key: &str, expected: &'static str) -> EngineError {
        EngineError::GgufMissingKey {
            path: self.path.clone(),
            key: key.to_owned(),
            expected,
        }
    }

    fn wrong(&self, key: &str, expected: &'static str, found: String) -> EngineError {
        EngineError::GgufKeyType {
            path: self.path.clone(),
            key: key.to_owned(),
            expected,
            found,
        }
    }

    fn get_or_missing(&self, key: &str, expected: &'static str) -> Result<&MetaValue, EngineError> {
        self.get(key).ok_or_else(|| self.missing(key, expected))
    }

    fn get_int<T: TryFrom<i128>>(
        &self,
        key: &str,
        expected: &'static str,
    ) -> Result<T, EngineError> {
        let v = self.get_or_missing(key, expected)?;
        v.as_integer()
            .and_then(|i| T::try_from(i).ok())
            .ok_or_else(|| self.wrong(key, expected, v.describe()))
    }

    /// `key` as a `u32`; any integer type whose value fits is accepted.
    ///
    /// # Errors
    /// When the key is missing, not an integer, or out of range.
    pub fn get_u32(&self, key: &str) -> Result<u32, EngineError> {
        self.get_int(key, "an integer in 0..=4294967295 (u32)")
    }

    /// `key` as a `u64`; any integer type whose value fits is accepted.
    ///
    /// # Errors
    /// When the key is missing, not an integer, or negative.
    pub fn get_u64(&self, key: &str) -> Result<u64, EngineError> {
        self.get_int(key, "a non-negative integer (u64)")
    }

    /// `key` as an `i32`; any integer type whose value fits is accepted.
    ///
    /// # Errors
    /// When the key is missing, not an integer, or out of range.
    pub fn get_i32(&self, key: &str) -> Result<i32, EngineError> {
        self.get_int(key, "an integer in i32 range")
    }

    /// `key` as a `usize`; any integer type whose value fits is accepted.
    ///
    /// # Errors
    /// When the key is missing, not an integer, or out of range.
    pub fn get_usize(&self, key: &str) -> Result<usize, EngineError> {
        self.get_int(key, "a non-negative integer (usize)")
    }

    /// `key` as an `f32`; `f32` and `f64` values are accepted.
    ///
    /// # Errors
    /// When the key is missing or not a float.
    pub fn get_f32(&self, key: &str) -> Result<f32, EngineError> {
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
    pub fn get_bool(&self, key: &str) -> Result<bool, EngineError> {
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
    pub fn get_str(&self, key: &str) -> Result<&str, EngineError> {
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
    pub fn get_string_array(&self, key: &str) -> Result<&[String], EngineError> {
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
    ) -> Result<Vec<T>, EngineError> {
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
    pub fn get_i32_array(&self, key: &str) -> Result<Vec<i32>, EngineError> {
        self.get_int_array(key, "an array of integers in i32 range")
    }

    /// `key` as an array of `u32`; arrays of any integer type whose values
    /// fit are accepted.
    ///
    /// # Errors
    /// When the key is missing, not an integer array, or a value is out of range.
    pub fn get_u32_array(&self, key: &str) -> Result<Vec<u32>, EngineError> {
        self.get_int_array(key, "an array of integers in u32 range")
    }

    /// `key` as an array of `f32`; `f32` and `f64` arrays are accepted.
    ///
    /// # Errors
    /// When the key is missing or not a float array.
    pub fn get_f32_array(&self, key: &str) -> Result<Vec<f32>, EngineError> {
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
    pub fn get_u32_opt(&self, key: &str) -> Result<Option<u32>, EngineError> {
        self.get(key).map(|_| self.get_u32(key)).transpose()
    }

    /// [`GgufFile::get_f32`] for an optional key: `Ok(None)` when absent.
    ///
    /// # Errors
    /// When the key is present with the wrong type.
    pub fn get_f32_opt(&self, key: &str) -> Result<Option<f32>, EngineError> {
        self.get(key).map(|_| self.get_f32(key)).transpose()
    }

    /// [`GgufFile::get_bool`] for an optional key: `Ok(None)` when absent.
    ///
    /// # Errors
    /// When the key is present with the wrong type.
    pub fn get_bool_opt(&self, key: &str) -> Result<Option<bool>, EngineError> {
        self.get(key).map(|_| self.get_bool(key)).transpose()
    }

    /// [`GgufFile::get_str`] for an optional key: `Ok(None)` when absent.
    ///
    /// # Errors
    /// When the key is present with the wrong type.
    pub fn get_str_opt(&self, key: &str) -> Result<Option<&str>, EngineError> {
        self.get(key).map(|_| self.get_str(key)).transpose()
    }
}

/// What the parser extracts from the bytes.
struct Parsed {
    version: u32,
    metadata: Vec<(String, MetaValue)>,
    tensors: Vec<TensorInfo>,
    alignment: u64,
    data_start: usize,
}

/// A bounds-checked little-endian cursor over the file's bytes.
struct Parser<'a> {
    path: &'a Path,
    buf: &'a [u8],
    pos: usize,
}

impl<'a> Parser<'a> {
    fn new(path: &'a Path, buf: &'a [u8]) -> Self {
        Parser { path, buf, pos: 0 }
    }

    fn remaining(&self) -> u64 {
        (self.buf.len() - self.pos) as u64
    }

    fn corrupt(&self, offset: usize, what: String) -> EngineError {
        EngineError::GgufCorrupt {
            path: self.path.to_path_buf(),
            offset: offset as u64,
            what,
        }
    }

    fn take(&mut self, n: usize, what: &dyn Fn() -> String) -> Result<&'a [u8], EngineError> {
        if n as u64 > self.remaining() {
            return Err(EngineError::GgufTruncated {
                path: self.path.to_path_buf(),
                what: what(),
                offset: self.pos as u64,
                needed: n as u64,
                available: self.remaining(),
            });
        }
        let s = &self.buf[self.pos..self.pos + n];
        self.pos += n;
        Ok(s)
    }

    fn array<const N: usize>(&mut self, what: &dyn Fn() -> String) -> Result<[u8; N], EngineError> {
        let s = self.take(N, what)?;
        let mut a = [0u8; N];
        a.copy_from_slice(s);
        Ok(a)
    }

    fn u32(&mut self, what: &dyn Fn() -> String) -> Result<u32, EngineError> {
        Ok(u32::from_le_bytes(self.array(what)?))
    }

    fn u64(&mut self, what: &dyn Fn() -> String) -> Result<u64, EngineError> {
        Ok(u64::from_le_bytes(self.array(what)?))
    }

    /// Checks that `count` items of at least `min_size` bytes each can fit in
    /// what is left of the file, so that allocating `count` slots is bounded
    /// by the file size.
    fn check_count(
        &self,
        at: usize,
        count: u64,
        min_size: u64,
        what: &dyn Fn() -> String,
    ) -> Result<usize, EngineError> {
        let fits = count
            .checked_mul(min_size)
            .is_some_and(|b| b <= self.remaining());
        if !fits {
            return Err(self.corrupt(
                at,
                format!(
                    "{} is {count}, but {count} × {min_size} bytes exceed the {} bytes left in the file",
                    what(),
                    self.remaining()
                ),
            ));
        }
        Ok(count as usize)
    }

    fn string(&mut self, what: &dyn Fn() -> String) -> Result<String, EngineError> {
        let at = self.pos;
        let len = self.u64(&|| format!("length of {}", what()))?;
        let len = self.check_count(at, len, 1, &|| format!("length of {}", what()))?;
        let bytes = self.take(len, what)?;
        String::from_utf8(bytes.to_vec()).map_err(|e| {
            self.corrupt(
                at + 8 + e.utf8_error().valid_up_to(),
                format!("{} is not valid UTF-8", what()),
            )
        })
    }

    fn meta_type(&mut self, what: &dyn Fn() -> String) -> Result<MetaType, EngineError> {
        let at = self.pos;
        let id = self.u32(what)?;
        MetaType::from_id(id).ok_or_else(|| {
            self.corrupt(
                at,
                format!("{} is {id}, not a GGUF value type (0..=12)", what()),
            )
        })
    }

    fn value(&mut self, ty: MetaType, what: &dyn Fn() -> String) -> Result<MetaValue, EngineError> {
        Ok(match ty {
            MetaType::U8 => MetaValue::U8(self.array::<1>(what)?[0]),
            MetaType::I8 => MetaValue::I8(i8::from_le_bytes(self.array(what)?)),
            MetaType::U16 => MetaValue::U16(u16::from_le_bytes(self.array(what)?)),
            MetaType::I16 => MetaValue::I16(i16::from_le_bytes(self.array(what)?)),
            MetaType::U32 => MetaValue::U32(self.u32(what)?),
            MetaType::I32 => MetaValue::I32(i32::from_le_bytes(self.array(what)?)),
            MetaType::F32 => MetaValue::F32(f32::from_le_bytes(self.array(what)?)),
            MetaType::Bool => MetaValue::Bool(self.bool(what)?),
            MetaType::String => MetaValue::String(self.string(what)?),
            MetaType::Array => MetaValue::Array(self.meta_array(what, 1)?),
            MetaType::U64 => MetaValue::U64(self.u64(what)?),
            MetaType::I64 => MetaValue::I64(i64::from_le_bytes(self.array(what)?)),
            MetaType::F64 => MetaValue::F64(f64::from_le_bytes(self.array(what)?)),
        })
    }

    fn bool(&mut self, what: &dyn Fn() -> String) -> Result<bool, EngineError> {
        let at = self.pos;
        match self.array::<1>(what)?[0] {
            0 => Ok(false),
            1 => Ok(true),
            b => Err(self.corrupt(at, format!("{} is {b}, not a bool (0 or 1)", what()))),
        }
    }

    fn meta_array(
        &mut self,
        what: &dyn Fn() -> String,
        depth: usize,
    ) -> Result<MetaArray, EngineError> {
        let at = self.pos;
        let ty = self.meta_type(&|| format!("element type of {}", what()))?;
        let count = self.u64(&|| format!("element count of {}", what()))?;
        let n = self.check_count(at + 4, count, ty.min_size(), &|| {
            format!("element count of {}", what())
        })?;
        if ty == MetaType::Array && depth >= MAX_ARRAY_DEPTH {
            return Err(self.corrupt(
                at,
                format!(
                    "{} nests arrays deeper than {MAX_ARRAY_DEPTH} levels",
                    what()
                ),
            ));
        }
        macro_rules! fixed {
            ($variant:ident, $t:ty) => {{
                let mut v = Vec::with_capacity(n);
                for i in 0..n {
                    let item = || format!("element {i} of {}", what());
                    v.push(<$t>::from_le_bytes(self.array(&item)?));
                }
                MetaArray::$variant(v)
            }};
        }
        Ok(match ty {
            MetaType::U8 => fixed!(U8, u8),
            MetaType::I8 => fixed!(I8, i8),
            MetaType::U16 => fixed!(U16, u16),
            MetaType::I16 => fixed!(I16, i16),
            MetaType::U32 => fixed!(U32, u32),
            MetaType::I32 => fixed!(I32, i32),
            MetaType::F32 => fixed!(F32, f32),
            MetaType::U64 => fixed!(U64, u64),
            MetaType::I64 => fixed!(I64, i64),
            MetaType::F64 => fixed!(F64, f64),
            MetaType::Bool => {
                let mut v = Vec::with_capacity(n);
                for i in 0..n {
                    v.push(self.bool(&|| format!("element {i} of {}", what()))?);
                }
                MetaArray::Bool(v)
            }
            MetaType::String => {
                let mut v = Vec::with_capacity(n);
                for i in 0..n {
                    v.push(self.string(&|| format!("element {i} of {}", what()))?);
                }
                MetaArray::String(v)
            }
            MetaType::Array => {
                let mut v = Vec::with_capacity(n);
                for i in 0..n {
                    v.push(self.meta_array(&|| format!("element {i} of {}", what()), depth + 1)?);
                }
                MetaArray::Array(v)
            }
        })
    }

    fn parse(mut self) -> Result<Parsed, EngineError> {
        let magic = self.array::<4>(&|| "magic".to_owned())?;
        if magic != GGUF_MAGIC {
            return Err(EngineError::GgufBadMagic {
                path: self.path.to_path_buf(),
                found: magic.to_vec(),
            });
        }
        let version = self.u32(&|| "version".to_owned())?;
        if !(2..=3).contains(&version) {
            return Err(EngineError::GgufUnsupportedVersion {
                path: self.path.to_path_buf(),
                version,
            });
        }
        let at = self.pos;
        let tensor_count = self.u64(&|| "tensor count".to_owned())?;
        let kv_at = self.pos;
        let kv_count = self.u64(&|| "metadata entry count".to_owned())?;
        // Smallest metadata entry: empty key (8) + type (4) + u8 value (1).
        let kv_count =
            self.check_count(kv_at, kv_count, 13, &|| "metadata entry count".to_owned())?;
        // Smallest tensor entry: empty name (8) + n_dims (4) + type (4) + offset (8).
        let tensor_count = self.check_count(at, tensor_count, 24, &|| "tensor count".to_owned())?;

        let mut metadata: Vec<(String, MetaValue)> = Vec::with_capacity(kv_count);
        let mut seen = HashMap::with_capacity(kv_count);
        for i in 0..kv_count {
            let key_at = self.pos;
            let key = self.string(&|| format!("key of metadata entry {i}"))?;
            let ty = self.meta_type(&|| format!("value type of '{key}'"))?;
            let value = self.value(ty, &|| format!("value of '{key}'"))?;
            if seen.insert(key.clone(), i).is_some() {
                return Err(self.corrupt(key_at, format!("duplicate metadata key '{key}'")));
            }
            metadata.push((key, value));
        }

        let alignment = match seen.get("general.alignment").map(|&i| &metadata[i].1) {
            None => DEFAULT_ALIGNMENT,
            Some(MetaValue::U32(a)) if a.is_power_of_two() => u64::from(*a),
            Some(other) => {
                return Err(EngineError::GgufKeyType {
                    path: self.path.to_path_buf(),
                    key: "general.alignment".to_owned(),
                    expected: "a u32 power of two",
                    found: other.describe(),
                });
            }
        };

        struct RawTensor {
            name: String,
            at: usize,
            dims: Vec<u64>,
            type_id: u32,
            offset: u64,
        }
        let mut raw = Vec::with_capacity(tensor_count);
        for i in 0..tensor_count {
            let at = self.pos;
            let name = self.string(&|| format!("name of tensor {i}"))?;
            let nd_at = self.pos;
            let n_dims = self.u32(&|| format!("dimension count of tensor '{name}'"))?;
            if n_dims == 0 || n_dims as usize > MAX_DIMS {
                return Err(self.corrupt(
                    nd_at,
                    format!("tensor '{name}' has {n_dims} dimensions (allowed 1..={MAX_DIMS})"),
                ));
            }
            let mut dims = Vec::with_capacity(n_dims as usize);
            for d in 0..n_dims {
                dims.push(self.u64(&|| format!("dimension {d} of tensor '{name}'"))?);
            }
            let type_id = self.u32(&|| format!("type of tensor '{name}'"))?;
            let offset = self.u64(&|| format!("data offset of tensor '{name}'"))?;
            raw.push(RawTensor {
                name,
                at,
                dims,
                type_id,
                offset,
            });
        }

        let header_end = self.pos as u64;
        let data_start = header_end.div_ceil(alignment) * alignment;
        let file_len = self.buf.len() as u64;
        let data_len = file_len.saturating_sub(data_start);

        let mut tensors = Vec::with_capacity(raw.len());
        let mut names = HashMap::with_capacity(raw.len());
        for t in raw {
            let bad = |what: String| EngineError::GgufBadTensor {
                path: self.path.to_path_buf(),
                tensor: t.name.clone(),
                what,
            };
            if names.insert(t.name.clone(), ()).is_some() {
                return Err(self.corrupt(t.at, format!("duplicate tensor name '{}'", t.name)));
            }
            let dtype =
                DType::from_ggml(t.type_id).ok_or_else(|| EngineError::GgufUnknownTensorType {
                    path: self.path.to_path_buf(),
                    tensor: t.name.clone(),
                    type_id: t.type_id,
                })?;
            let n_elements = t
                .dims
                .iter()
                .try_fold(1u64, |acc, &d| acc.checked_mul(d))
                .filter(|&n| n <= file_len.saturating_mul(8))
                .ok_or_else(|| {
                    bad(format!(
                        "dimensions {:?} have more elements than a file of {file_len} bytes can hold",
                        t.dims
                    ))
                })?;
            let block = dtype.block_elems() as u64;
            if t.dims[0] % block != 0 {
                return Err(bad(format!(
                    "row length dims[0] = {} is not a multiple of the {dtype} block size {block}",
                    t.dims[0]
                )));
            }
            let size = n_elements / block * dtype.block_bytes() as u64;
            if t.offset % alignment != 0 {
                return Err(bad(format!(
                    "data offset {} is not a multiple of the alignment {alignment}",
                    t.offset
                )));
            }
            let end = t.offset.checked_add(size).filter(|&e| e <= data_len);
            if end.is_none() {
                return Err(bad(format!(
                    "data [{}, {}+{size}) ends past the data section ({data_len} bytes from byte {data_start} of a {file_len}-byte file)",
                    t.offset, t.offset
                )));
            }
            tensors.push(TensorInfo {
                dims: t.dims.iter().map(|&d| d as usize).collect(),
                name: t.name,
                dtype,
                offset: t.offset,
                size_bytes: size as usize,
            });
        }

        Ok(Parsed {
            version,
            metadata,
            tensors,
            alignment,
            data_start: data_start.min(file_len) as usize,
        })
    }
}

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
