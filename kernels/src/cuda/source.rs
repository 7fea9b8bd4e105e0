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
/// Name of the KV store kernel.
pub const STORE_KERNEL: &str = "kvsan_store_kv";
/// Name of the page poison-fill kernel.
pub const POISON_KERNEL: &str = "kvsan_poison_pages";
/// Name of the page copy kernel.
pub const COPY_KERNEL: &str = "kvsan_copy_pages";
/// Name of the kernel writing listed pages into the device shadow.
pub const SHADOW_SCATTER_KERNEL: &str = "kvsan_shadow_scatter";
/// Name of the kernel reading listed pages' written words out of the device shadow.
pub const SHADOW_GATHER_KERNEL: &str = "kvsan_shadow_gather_bits";

/// Name of the check over a padded block table and `seq_lens`.
pub const CHECK_BLOCK_TABLE_KERNEL: &str = "kvsan_check_block_table";
/// Name of the check over pages in CSR form.
pub const CHECK_PAGED_CSR_KERNEL: &str = "kvsan_check_paged_csr";
/// Name of the check over a token-level table.
pub const CHECK_REQ_TO_TOKEN_KERNEL: &str = "kvsan_check_req_to_token";
/// Name of the check over a store kernel's slot mapping.
pub const CHECK_SLOT_MAPPING_KERNEL: &str = "kvsan_check_slot_mapping";

/// The page checks every checking source shares (codes, record layout,
/// read and store checks), prepended to each.
pub const SHADOW_CHECK_HEADER: &str = include_str!("shadow_check.cuh");

/// The KV store and paged-attention decode over the batch arrays, each
/// page checked in place before it is touched.
pub const PAGED_ATTENTION: CudaSource = CudaSource {
    name: c"paged_attention.cu",
    code: c_source(concat!(
        include_str!("shadow_check.cuh"),
        include_str!("paged_attention.cu"),
        "\0"
    )),
    kernels: &[DECODE_KERNEL, STORE_KERNEL],
};

/// The standalone checks over an engine's own kernel arguments (block
/// table, paged CSR, token table, store slots) against the device shadow.
pub const CHECK: CudaSource = CudaSource {
    name: c"check.cu",
    code: c_source(concat!(
        include_str!("shadow_check.cuh"),
        include_str!("check.cu"),
        "\0"
    )),
    kernels: &[
        CHECK_BLOCK_TABLE_KERNEL,
        CHECK_PAGED_CSR_KERNEL,
        CHECK_REQ_TO_TOKEN_KERNEL,
        CHECK_SLOT_MAPPING_KERNEL,
    ],
};

/// Whole-page poison-fill and copy.
pub const PAGES: CudaSource = CudaSource {
    name: c"pages.cu",
    code: c_source(concat!(include_str!("pages.cu"), "\0")),
    kernels: &[POISON_KERNEL, COPY_KERNEL],
};

/// The device shadow's scatter (host to device) and gather (device to host).
pub const SHADOW: CudaSource = CudaSource {
    name: c"shadow.cu",
    code: c_source(concat!(include_str!("shadow.cu"), "\0")),
    kernels: &[SHADOW_SCATTER_KERNEL, SHADOW_GATHER_KERNEL],
};

/// Every CUDA source of the crate.
pub const SOURCES: &[CudaSource] = &[PAGED_ATTENTION, PAGES, SHADOW, CHECK];

/// Threads per decode block (`KVSAN_DECODE_THREADS` in the source).
pub const DECODE_THREADS: u32 = 128;

/// Threads per store block (`KVSAN_STORE_THREADS`).
pub const STORE_THREADS: u32 = 128;

/// Largest head dimension the decode kernel supports (`KVSAN_MAX_HEAD_DIM`).
pub const MAX_HEAD_DIM: usize = 256;

/// What the batch kernels check (`mode`; `KVSAN_MODE_*`).
pub const MODE_BOUNDS: u32 = 0;
/// ... and each `PageRef`'s generation against the pool's generation array.
pub const MODE_GENERATIONS: u32 = 1;
/// ... and the device copy of the sanitizer's kernel shadow.
pub const MODE_SHADOW: u32 = 2;

/// Words per row of the batch kernels' refusal records
/// (`KVSAN_REFUSAL_WORDS`): `code, index, page, generation, current, slot,
/// slots, layer` (see `paged_attention.cu`).
pub const REFUSAL_WORDS: usize = 8;

/// Refusal codes (`KVSAN_REFUSED_*`, word 0 of a record): the row was not refused.
pub const REFUSED_NONE: u32 = 0;
/// A block-table entry at or past the end of the array.
pub const REFUSED_OUTSIDE_TABLE: u32 = 1;
/// A page (or store slot) outside the pool.
pub const REFUSED_OUTSIDE_POOL: u32 = 2;
/// `generation-mismatch`.
pub const REFUSED_GENERATION_MISMATCH: u32 = 3;
/// `read-free-page`.
pub const REFUSED_READ_FREE_PAGE: u32 = 4;
/// `read-during-transfer`.
pub const REFUSED_READ_DURING_TRANSFER: u32 = 5;
/// `foreign-read`.
pub const REFUSED_FOREIGN_READ: u32 = 6;
/// A shared page read by a request that is not its holding owner: only the
/// host's sharer table can say (`Check::Arbitrate`).
pub const REFUSED_ARBITRATE: u32 = 7;
/// `terminal-request-activity`.
pub const REFUSED_TERMINAL: u32 = 8;
/// `stale-read`.
pub const REFUSED_STALE_READ: u32 = 9;
/// `write-after-free`.
pub const REFUSED_WRITE_AFTER_FREE: u32 = 10;
/// `foreign-write`.
pub const REFUSED_FOREIGN_WRITE: u32 = 11;
/// An engine's buffer the check kernels could not use at all: a negative
/// length or location, offsets that go backwards, a last page length
/// outside `1..=page_slots`.
pub const REFUSED_BAD_INPUT: u32 = 12;

/// Threads per block of the check kernels (`KVSAN_CHECK_THREADS`).
pub const CHECK_THREADS: u32 = 128;

/// Threads ("lanes") per row of the read check kernels (`KVSAN_CHECK_LANES`).
pub const CHECK_LANES: u32 = 64;

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
        let mut defines = vec![
            format!("#define KVSAN_DECODE_THREADS {DECODE_THREADS}\n"),
            format!("#define KVSAN_STORE_THREADS {STORE_THREADS}\n"),
            format!("#define KVSAN_MAX_HEAD_DIM {MAX_HEAD_DIM}\n"),
            format!("#define KVSAN_REFUSAL_WORDS {REFUSAL_WORDS}u\n"),
            format!("#define KVSAN_MODE_BOUNDS {MODE_BOUNDS}u\n"),
            format!("#define KVSAN_MODE_GENERATIONS {MODE_GENERATIONS}u\n"),
            format!("#define KVSAN_MODE_SHADOW {MODE_SHADOW}u\n"),
        ];
        for (name, code) in [
            ("NONE", REFUSED_NONE),
            ("OUTSIDE_TABLE", REFUSED_OUTSIDE_TABLE),
            ("OUTSIDE_POOL", REFUSED_OUTSIDE_POOL),
            ("GENERATION_MISMATCH", REFUSED_GENERATION_MISMATCH),
            ("READ_FREE_PAGE", REFUSED_READ_FREE_PAGE),
            ("READ_DURING_TRANSFER", REFUSED_READ_DURING_TRANSFER),
            ("FOREIGN_READ", REFUSED_FOREIGN_READ),
            ("ARBITRATE", REFUSED_ARBITRATE),
            ("TERMINAL", REFUSED_TERMINAL),
            ("STALE_READ", REFUSED_STALE_READ),
            ("WRITE_AFTER_FREE", REFUSED_WRITE_AFTER_FREE),
            ("FOREIGN_WRITE", REFUSED_FOREIGN_WRITE),
            ("BAD_INPUT", REFUSED_BAD_INPUT),
        ] {
            defines.push(format!("#define KVSAN_REFUSED_{name} {code}u\n"));
        }
        for define in defines {
            assert!(attention.contains(&define), "missing `{}`", define.trim());
        }
        for source in [&PAGED_ATTENTION, &CHECK] {
            assert!(
                text(source).starts_with(SHADOW_CHECK_HEADER),
                "{:?} does not begin with the shared checks",
                source.name
            );
        }
        let check = format!("#define KVSAN_CHECK_THREADS {CHECK_THREADS}\n");
        assert!(text(&CHECK).contains(&check), "missing `{}`", check.trim());
        let lanes = format!("#define KVSAN_CHECK_LANES {CHECK_LANES}u\n");
        assert!(text(&CHECK).contains(&lanes), "missing `{}`", lanes.trim());
        let pages = text(&PAGES);
        let poison = format!("#define KVSAN_POISON_F16 ((unsigned short)0x{POISON_F16_BITS:X}u)\n");
        assert!(pages.contains(&poison), "missing `{}`", poison.trim());
    }

    /// The state word the device decodes is the sanitizer's.
    #[test]
    fn the_state_word_bits_the_kernels_decode_are_the_sanitizers() {
        use kvsan_sanitizer::shadow::{
            FLAG_OWNER_RELEASED, FLAG_SHARED, FLAG_TERMINAL_OWNER, PageState, StateWord,
        };
        let attention = text(&PAGED_ATTENTION);
        for (name, flag) in [
            ("TERMINAL_OWNER", FLAG_TERMINAL_OWNER),
            ("OWNER_RELEASED", FLAG_OWNER_RELEASED),
            ("SHARED", FLAG_SHARED),
        ] {
            let define = format!(
                "#define KVSAN_FLAG_{name} (1ull << {})\n",
                flag.trailing_zeros()
            );
            assert!(attention.contains(&define), "missing `{}`", define.trim());
        }
        for (name, state) in [
            ("OWNED", PageState::Owned),
            ("RECEIVING", PageState::Receiving),
        ] {
            let define = format!("#define KVSAN_STATE_{name} {}u\n", state as u8);
            assert!(attention.contains(&define), "missing `{}`", define.trim());
        }
        let word = StateWord::new(kvsan_sanitizer::Generation(7), PageState::Receiving, 0);
        assert!(attention.contains("#define KVSAN_STATE_SHIFT 32\n"));
        assert_eq!(word.0 >> 32, PageState::Receiving as u64);
        assert!(attention.contains("#define KVSAN_GENERATION_MASK 0xffffffffull\n"));
        assert_eq!(word.0 & 0xffff_ffff, 7);
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
