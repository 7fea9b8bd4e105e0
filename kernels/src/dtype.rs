//! Element types of weight tensors, with their GGML ids and block geometry.
//!
//! Quantized types store a row as a sequence of blocks; each block packs
//! `block_elems` values into `block_bytes` bytes (GGML layout).

/// A tensor element type as stored in GGUF files.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
#[non_exhaustive]
pub enum DType {
    /// 32-bit float.
    F32,
    /// IEEE half.
    F16,
    /// 32 × 4-bit, one f16 scale.
    Q4_0,
    /// 32 × 4-bit, f16 scale and f16 min.
    Q4_1,
    /// 32 × 8-bit, one f16 scale.
    Q8_0,
    /// 256-value super-blocks of 4-bit values with 6-bit sub-block scales and mins.
    Q4K,
    /// 256-value super-blocks of 6-bit values with 8-bit sub-block scales.
    Q6K,
}

impl DType {
    /// Every supported type.
    pub const ALL: [DType; 7] = [
        DType::F32,
        DType::F16,
        DType::Q4_0,
        DType::Q4_1,
        DType::Q8_0,
        DType::Q4K,
        DType::Q6K,
    ];

    /// The type with GGML type id `id`, if supported.
    #[must_use]
    pub fn from_ggml(id: u32) -> Option<DType> {
        DType::ALL.into_iter().find(|d| d.ggml_id() == id)
    }

    /// GGML type id (`ggml_type`).
    #[must_use]
    pub const fn ggml_id(self) -> u32 {
        match self {
            DType::F32 => 0,
            DType::F16 => 1,
            DType::Q4_0 => 2,
            DType::Q4_1 => 3,
            DType::Q8_0 => 8,
            DType::Q4K => 12,
            DType::Q6K => 14,
        }
    }

    /// GGML's name for the type.
    #[must_use]
    pub const fn name(self) -> &'static str {
        match self {
            DType::F32 => "F32",
            DType::F16 => "F16",
            DType::Q4_0 => "Q4_0",
            DType::Q4_1 => "Q4_1",
            DType::Q8_0 => "Q8_0",
            DType::Q4K => "Q4_K",
            DType::Q6K => "Q6_K",
        }
    }

    /// Values per block (1 for float types).
    #[must_use]
    pub const fn block_elems(self) -> usize {
        match self {
            DType::F32 | DType::F16 => 1,
            DType::Q4_0 | DType::Q4_1 | DType::Q8_0 => 32,
            DType::Q4K | DType::Q6K => 256,
        }
    }

    /// Bytes per block.
    #[must_use]
    pub const fn block_bytes(self) -> usize {
        match self {
            DType::F32 => 4,
            DType::F16 => 2,
            DType::Q4_0 => 18,
            DType::Q4_1 => 20,
            DType::Q8_0 => 34,
            DType::Q4K => 144,
            DType::Q6K => 210,
        }
    }

    /// Bytes of one row of `cols` values, or `None` when `cols` is not a
    /// whole number of blocks.
    #[must_use]
    pub const fn row_bytes(self, cols: usize) -> Option<usize> {
        if !cols.is_multiple_of(self.block_elems()) {
            return None;
        }
        Some(cols / self.block_elems() * self.block_bytes())
    }
}

impl std::fmt::Display for DType {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(self.name())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn ggml_ids_round_trip() {
        for d in DType::ALL {
            assert_eq!(DType::from_ggml(d.ggml_id()), Some(d));
        }
        assert_eq!(DType::from_ggml(6), None, "Q5_0 is not supported");
    }

    #[test]
    fn row_bytes_needs_whole_blocks() {
        assert_eq!(DType::Q4_1.row_bytes(576), Some(18 * 20));
        assert_eq!(DType::Q4K.row_bytes(576), None);
        assert_eq!(DType::F16.row_bytes(3), Some(6));
    }
}
