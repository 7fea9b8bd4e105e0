//! CUDA kernels for the paged KV pool: paged-attention decode with the
//! in-kernel generation (tag) check, page poison-fill, and page copy (KV
//! transfer). Compiled at run time with NVRTC for the device's compute
//! capability; cudarc loads the driver and NVRTC dynamically, so this builds
//! and its callers run (getting [`CudaError::DriverNotFound`]) on a machine
//! without CUDA.
//!
//! Three layers, as cudarc has:
//!
//! ```text
//!  safe    CudaKernels, CudaKvPool      RAII device buffers, checked inputs
//!    |
//!  result  compile, launch_*            one Result per NVRTC call / launch;
//!    |                                  raw handles and unsafe launches here
//!  source  paged_attention.cu, pages.cu CUDA C, compiled by NVRTC
//! ```
//!
//! Device-side pool layout (the same as the CPU kernels'), f16 values:
//!
//! ```text
//!  pool = page 0 | page 1 | ... | page n_pages-1
//!  page = [layer][K=0 | V=1][slot][kv_head][head_dim]
//!  generations = [Generation; n_pages]   (u32, next to the pool)
//! ```

mod device;
mod error;
mod pool;
pub mod result;
pub mod source;

pub use device::CudaKernels;
pub use error::CudaError;
pub use pool::CudaKvPool;
pub use result::{
    CompileTarget, CompiledModule, ImageKind, compile, nvrtc_version, supported_archs,
};
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
