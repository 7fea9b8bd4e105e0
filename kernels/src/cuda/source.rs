//! The CUDA C sources of the kernels, compiled at run time by NVRTC.
//!
//! Each source is self-contained (no CUDA headers: f16 values travel as their
//! 16 bits and are converted with PTX `cvt`), so NVRTC alone can compile it,
//! without a CUDA toolkit.

use std::ffi::CStr;

/// One CUDA C translation unit and the kernels it defines.
#[derive(Debug, Clone, Copy)]
pub struct CudaSource {
    /// File name, given to NVRTC for its messages.
    pub name: &'static CStr,
    /// The source text, NUL-terminated for NVRTC.
    pub code: &'static CStr,
    /// The `extern "C"` kernels it defines.
    pub kernels: &'static [&'static str],
}

/// Turns a NUL-terminated source into a `CStr`; a NUL inside the source is a
/// build error, not a run-time one.
const fn c_source(with_nul: &'static str) -> &'static CStr {
    match CStr::from_bytes_with_nul(with_nul.as_bytes()) {
        Ok(code) => code,
        Err(_) => panic!("a CUDA source contains a NUL byte"),
    }
}

/// Name of the paged-attention decode kernel.
pub const DECODE_KERNEL: &str = "kvsan_paged_attention_decode";
/// Name of the page poison-fill kernel.
pub const POISON_KERNEL: &str = "kvsan_poison_pages";
/// Name of the page copy kernel.
pub const COPY_KERNEL: &str = "kvsan_copy_pages";

/// Paged-attention decode with the in-kernel generation check.
pub const PAGED_ATTENTION: CudaSource = CudaSource {
    name: c"paged_attention.cu",
    code: c_source(concat!(include_str!("paged_attention.cu"), "\0")),
    kernels: &[DECODE_KERNEL],
};

/// Whole-page poison-fill and copy.
pub const PAGES: CudaSource = CudaSource {
    name: c"pages.cu",
    code: c_source(concat!(include_str!("pages.cu"), "\0")),
    kernels: &[POISON_KERNEL, COPY_KERNEL],
};

/// Every CUDA source of the crate.
pub const SOURCES: &[CudaSource] = &[PAGED_ATTENTION, PAGES];

/// Threads per decode block (`KVSAN_DECODE_THREADS` in the source).
pub const DECODE_THREADS: u32 = 128;

/// Largest head dimension the decode kernel supports (`KVSAN_MAX_HEAD_DIM`).
pub const MAX_HEAD_DIM: usize = 256;

/// Words per sequence in the decode kernel's error records (`KVSAN_ERROR_WORDS`):
/// `status, table_index, page, expected generation, actual generation`.
pub const ERROR_WORDS: usize = 5;

/// Error-record status: the sequence was read.
pub const STATUS_OK: u32 = 0;
/// Error-record status: a block-table generation differs from the page's.
pub const STATUS_GENERATION: u32 = 1;
/// Error-record status: a block-table entry names a page outside the pool.
pub const STATUS_OUT_OF_RANGE: u32 = 2;

/// The f16 bit pattern the poison kernel fills pages with
/// (`KVSAN_POISON_F16`): a quiet NaN with payload `0x5A`, distinct from the
/// NaNs arithmetic produces (`0x7FFF` on GPUs, `0x7E00` on x86), so a dump
/// tells poison from a computed NaN. Any read of it makes attention output NaN.
pub const POISON_F16_BITS: u16 = 0x7E5A;

#[cfg(test)]
mod tests {
    use super::*;

    fn text(source: &CudaSource) -> &'static str {
        match source.code.to_str() {
            Ok(text) => text,
            Err(err) => panic!("{:?} is not UTF-8: {err}", source.name),
        }
    }

    #[test]
    fn rust_constants_match_the_cuda_defines() {
        let attention = text(&PAGED_ATTENTION);
        for define in [
            format!("#define KVSAN_DECODE_THREADS {DECODE_THREADS}\n"),
            format!("#define KVSAN_MAX_HEAD_DIM {MAX_HEAD_DIM}\n"),
            format!("#define KVSAN_ERROR_WORDS {ERROR_WORDS}u\n"),
            format!("#define KVSAN_STATUS_GENERATION {STATUS_GENERATION}u\n"),
            format!("#define KVSAN_STATUS_OUT_OF_RANGE {STATUS_OUT_OF_RANGE}u\n"),
        ] {
            assert!(attention.contains(&define), "missing `{}`", define.trim());
        }
        let pages = text(&PAGES);
        let poison = format!("#define KVSAN_POISON_F16 ((unsigned short)0x{POISON_F16_BITS:X}u)\n");
        assert!(pages.contains(&poison), "missing `{}`", poison.trim());
    }

    #[test]
    fn every_listed_kernel_is_defined_in_its_source() {
        for source in SOURCES {
            for kernel in source.kernels {
                let definition = format!("extern \"C\" __global__ void {kernel}(");
                assert!(
                    text(source).contains(&definition),
                    "{:?} lacks {kernel}",
                    source.name
                );
            }
        }
    }

    #[test]
    fn poison_pattern_is_a_nan_unlike_computed_nans() {
        let poison = half::f16::from_bits(POISON_F16_BITS);
        assert!(poison.is_nan());
        assert_ne!(POISON_F16_BITS, 0x7E00);
        assert_ne!(POISON_F16_BITS, 0x7FFF);
    }
}
