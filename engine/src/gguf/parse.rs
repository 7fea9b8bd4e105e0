//! The parser: a bounds-checked little-endian cursor over the file's bytes
//! that reads the header, the metadata and the tensor table.

use std::collections::HashMap;
use std::path::Path;

use kvsan_kernels::DType;

use super::GgufError;
use super::{
    DEFAULT_ALIGNMENT, GGUF_MAGIC, MAX_ARRAY_DEPTH, MAX_DIMS, MetaArray, MetaType, MetaValue,
    TensorInfo,
};

/// What the parser extracts from the bytes.
pub(super) struct Parsed {
    pub(super) version: u32,
    pub(super) metadata: Vec<(String, MetaValue)>,
    pub(super) tensors: Vec<TensorInfo>,
    pub(super) alignment: u64,
    pub(super) data_start: usize,
}

/// A bounds-checked little-endian cursor over the file's bytes.
pub(super) struct Parser<'a> {
    path: &'a Path,
    buf: &'a [u8],
    pos: usize,
}

impl<'a> Parser<'a> {
    pub(super) fn new(path: &'a Path, buf: &'a [u8]) -> Self {
        Parser { path, buf, pos: 0 }
    }

    fn remaining(&self) -> u64 {
        (self.buf.len() - self.pos) as u64
    }

    fn corrupt(&self, offset: usize, what: String) -> GgufError {
        GgufError::Corrupt {
            path: self.path.to_path_buf(),
            offset: offset as u64,
            what,
        }
    }

    fn take(&mut self, n: usize, what: &dyn Fn() -> String) -> Result<&'a [u8], GgufError> {
        if n as u64 > self.remaining() {
            return Err(GgufError::Truncated {
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

    fn array<const N: usize>(&mut self, what: &dyn Fn() -> String) -> Result<[u8; N], GgufError> {
        let s = self.take(N, what)?;
        let mut a = [0u8; N];
        a.copy_from_slice(s);
        Ok(a)
    }

    fn u32(&mut self, what: &dyn Fn() -> String) -> Result<u32, GgufError> {
        Ok(u32::from_le_bytes(self.array(what)?))
    }

    fn u64(&mut self, what: &dyn Fn() -> String) -> Result<u64, GgufError> {
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
    ) -> Result<usize, GgufError> {
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

    fn string(&mut self, what: &dyn Fn() -> String) -> Result<String, GgufError> {
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

    fn meta_type(&mut self, what: &dyn Fn() -> String) -> Result<MetaType, GgufError> {
        let at = self.pos;
        let id = self.u32(what)?;
        MetaType::from_id(id).ok_or_else(|| {
            self.corrupt(
                at,
                format!("{} is {id}, not a GGUF value type (0..=12)", what()),
            )
        })
    }

    fn value(&mut self, ty: MetaType, what: &dyn Fn() -> String) -> Result<MetaValue, GgufError> {
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

    fn bool(&mut self, what: &dyn Fn() -> String) -> Result<bool, GgufError> {
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
    ) -> Result<MetaArray, GgufError> {
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

    pub(super) fn parse(mut self) -> Result<Parsed, GgufError> {
        let magic = self.array::<4>(&|| "magic".to_owned())?;
        if magic != GGUF_MAGIC {
            return Err(GgufError::BadMagic {
                path: self.path.to_path_buf(),
                found: magic.to_vec(),
            });
        }
        let version = self.u32(&|| "version".to_owned())?;
        if !(2..=3).contains(&version) {
            return Err(GgufError::UnsupportedVersion {
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
                return Err(GgufError::KeyType {
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
            let bad = |what: String| GgufError::BadTensor {
                path: self.path.to_path_buf(),
                tensor: t.name.clone(),
                what,
            };
            if names.insert(t.name.clone(), ()).is_some() {
                return Err(self.corrupt(t.at, format!("duplicate tensor name '{}'", t.name)));
            }
            let dtype =
                DType::from_ggml(t.type_id).ok_or_else(|| GgufError::UnknownTensorType {
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
