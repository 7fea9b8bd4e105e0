//! CUDA kernels for the paged KV pool: the KV store and paged-attention
//! decode over a whole batch, each checking every page it is about to touch
//! in place (the CPU kernels' guard, on the device); page poison-fill; page
//! copy (KV transfer); the device copy of the sanitizer's kernel shadow; and
//! checks over an engine's own kernel arguments.
//! Compiled at run time with NVRTC for the device's compute capability;
//! cudarc loads the driver and NVRTC dynamically, so this builds and its
//! callers run (getting [`CudaError::DriverNotFound`]) on a machine without
//! CUDA.
//!
//! Three layers, as cudarc has:
//!
//! ```text
//!  safe    CudaKernels, CudaKvPool,      RAII device buffers, every input
//!          CudaKernelShadow              checked on the host before a launch
//!    |
//!  result  compile, launch_*             one Result per NVRTC call / launch;
//!    |                                   raw handles and unsafe launches here
//!  source  shadow_check.cuh (the page     CUDA C, compiled by NVRTC
//!          checks, prepended to the next
//!          two), paged_attention.cu,
//!          check.cu, pages.cu, shadow.cu
//! ```
//!
//! `check.cu` ([`CudaKernels::check_engine_batch`]) checks the buffers an
//! engine hands its own attention or store kernel — block table, paged
//! CSR, token table, store slots — against the device shadow, as the
//! sanitizer's host-side batch checks do (see [`EngineBatch`]).
//!
//! Device-side pool layout (the same as the CPU kernels'), f16 values:
//!
//! ```text
//!  pool = page 0 | page 1 | ... | page n_pages-1
//!  page = [layer][K=0 | V=1][slot][kv_head][head_dim]
//!  generations = [Generation; n_pages]   (u32, next to the pool)
//! ```
//!
//! The batch kernels take the CPU kernels' [`crate::KvBatch`], as words:
//!
//! ```text
//!  block_tables  [row 0: e0 e1 … e(width-1)][row 1: …]…   (page, generation) u32 pairs, row-major
//!  seq_lens      [row 0][row 1]…                          tokens row r attends over
//!  query_start   [0, n0, n0+n1, …]                        row r's tokens (store kernel)
//!  store_slots   [token 0][token 1]…                      (page, generation, slot) u32 triples;
//!                                                         all 0xffffffff: padding, skipped
//!  row_live      [row 0][row 1]…                          0: stopped earlier in the step (RowLedger)
//!  owners        [row 0][row 1]…                          u64 request of the row (shadow checks)
//!
//!  decode: one query per row, at position seq_lens[r] - 1; entry e of row r is
//!    block_tables[r·width + e] (the flat index: past the row's width is the
//!    next row's entry, as on the CPU); it reads slots 0 .. min(page_slots,
//!    seq_len - e·page_slots) of that page
//!  store: token t of row r goes to store_slots[t]; a row's tokens are stored
//!    up to its first refused one
//! ```
//!
//! What the kernels check before they touch a page ([`ReadCheck`],
//! [`StoreCheck`]): always the bounds (an entry outside the block-table
//! array, a page or slot outside the pool); then nothing more, the pool's
//! generation array, or the device kernel shadow — the sanitizer's records
//! and written bits, checked exactly as `KernelShadow::check_read` and
//! `KernelShadow::store` check them on the CPU:
//!
//! ```text
//!  CudaKernelShadow (device)
//!   records  [page 0: state word | owner][page 1: …]…   u64 pairs
//!            state word: 63…39 | 38 L | 37 S | 36 R | 35 T | 34…32 state | 31…0 generation
//!   bits     [page 0: stride words][page 1: …]…         u64, layer-major packed:
//!            bit layer·page_slots + slot of a page's stride = ceil(layers·page_slots / 64) words
//!
//!  read  (per entry a row reads, before any K/V byte of the row):
//!    generation ≠ PageRef's → generation-mismatch   free/quarantined/allocating → read-free-page
//!    receiving → read-during-transfer               not the holding owner → foreign-read,
//!    owner terminal → terminal-request-activity        or Arbitrate if shared (the host decides)
//!    a slot's bit missing → stale-read (first missing slot)
//!  store (per token): generation-mismatch, write-after-free, foreign-write
//!    (not the holding owner, or the page is shared read-only),
//!    terminal-request-activity; a store made sets its bit (atomicOr)
//! ```
//!
//! A refused row's first refusal is written to its refusal record by the
//! first block to claim it (atomicCAS) and comes back as a
//! [`CudaRefusal`]: the CPU guards' [`crate::guard::Refusal`] plus what the
//! device check said. A refused decode row reads nothing and gets zero
//! output. The host keeps the device shadow in step:
//!
//! ```text
//!  host hooks (alloc, free, share, transfer receipt/commit, request end)
//!        │ pages they touched
//!        ▼
//!  CudaKernelShadow::upload ──▶ store_kv / attend_decode launches ──▶ refusals (per row)
//!                                     │ bits the stores set
//!                                     ▼
//!  CudaKernelShadow::download_written ──▶ KernelShadow::merge_bits (host shadow)
//! ```

mod batch;
mod check;
mod device;
mod error;
#[cfg(feature = "nvtx")]
mod nvtx;
mod pool;
pub mod result;
mod shadow;
pub mod source;

pub use batch::{CudaRefusal, DecodeOutput, ReadCheck, StoreCheck};
pub use check::{
    Borrowed, EngineBatch, EngineFinding, EngineRefusal, Views, check_kernel,
    decode_engine_refusals, may_record, views,
};
pub use device::CudaKernels;
pub use error::CudaError;
pub use kvsan_sanitizer::{Batch, BatchLayout};
#[cfg(feature = "nvtx")]
pub use nvtx::{NvtxHolder, NvtxPlane, NvtxPool, NvtxSync, probe_heap};
pub use pool::CudaKvPool;
pub use result::{
    CompileTarget, CompiledModule, ImageKind, compile, nvrtc_version, supported_archs,
};
pub use shadow::CudaKernelShadow;
pub use source::{CudaSource, POISON_F16_BITS, SOURCES};

/// Whether CUDA kernels can run here: the driver and NVRTC libraries load
/// and the driver sees at least one device. Never panics.
pub fn cuda_available() -> bool {
    if !result::driver_present() || !result::nvrtc_present() {
        return false;
    }
    // The driver library is present, so cudarc's lazy loader does not panic.
    matches!(cudarc::driver::CudaContext::device_count(), Ok(n) if n > 0)
}

/// The CUDA allocation of device `ordinal` that holds device address
/// `address`: its start and size in bytes (for an engine's own buffers,
/// e.g. the tensors of its KV pool). Never panics.
///
/// # Errors
/// No driver, no such device, an address in no allocation of the device.
pub fn allocation_containing(ordinal: usize, address: u64) -> Result<(u64, u64), CudaError> {
    if !result::driver_present() {
        return Err(CudaError::DriverNotFound);
    }
    let count =
        cudarc::driver::CudaContext::device_count().map_err(CudaError::driver("count devices"))?;
    let count = usize::try_from(count).unwrap_or(0);
    if ordinal >= count {
        return Err(CudaError::NoSuchDevice { ordinal, count });
    }
    let ctx =
        cudarc::driver::CudaContext::new(ordinal).map_err(CudaError::driver("create a context"))?;
    ctx.bind_to_thread()
        .map_err(CudaError::driver("make the context current"))?;
    let (start, size, device) =
        result::allocation_of(address).map_err(|source| CudaError::NotDeviceMemory {
            what: "buffer",
            address,
            ordinal,
            source,
        })?;
    if usize::try_from(device).ok() != Some(ordinal) {
        return Err(CudaError::WrongDevice {
            pool_device: usize::try_from(device).unwrap_or(usize::MAX),
            kernels_device: ordinal,
        });
    }
    Ok((start, size))
}
