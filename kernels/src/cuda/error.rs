//! The error type of the CUDA kernels.

use cudarc::driver::DriverError;
use cudarc::nvrtc::result::NvrtcError;
use kvsan_ids::PageId;

use crate::error::KernelError;

/// What a CUDA operation refused or failed to do.
///
/// Batch arrays whose shapes do not fit each other are
/// [`CudaError::Kernel`] with the CPU kernels' [`KernelError::BatchShape`].
/// What a kernel refuses while it runs (a page outside the pool, a check
/// that fails) is not an error: it comes back as a per-row
/// [`super::CudaRefusal`], as the CPU kernels' guards keep it.
#[derive(Debug, thiserror::Error)]
#[non_exhaustive]
pub enum CudaError {
    /// The CUDA driver library could not be loaded: no NVIDIA driver here.
    #[error("CUDA driver library (libcuda.so) not found: this machine has no NVIDIA driver")]
    DriverNotFound,
    /// The NVRTC library could not be loaded.
    #[error(
        "NVRTC library (libnvrtc.so) not found: install the CUDA toolkit or the PyPI wheel \
         nvidia-cuda-nvrtc-cu12 and put the directory holding libnvrtc.so.* on LD_LIBRARY_PATH"
    )]
    NvrtcNotFound,
    /// The device ordinal asked for does not exist.
    #[error("CUDA device {ordinal} does not exist: the driver sees {count} device(s)")]
    NoSuchDevice {
        /// The ordinal asked for.
        ordinal: usize,
        /// Devices the driver sees.
        count: usize,
    },
    /// A CUDA driver call failed.
    #[error("CUDA driver call failed: {op}")]
    Driver {
        /// What was being done.
        op: &'static str,
        /// The driver's error.
        #[source]
        source: DriverError,
    },
    /// An NVRTC call other than compilation failed.
    #[error("NVRTC call failed: {op}")]
    Nvrtc {
        /// What was being done.
        op: &'static str,
        /// NVRTC's error.
        #[source]
        source: NvrtcError,
    },
    /// NVRTC refused to compile a kernel source.
    #[error("NVRTC could not compile {source_name} for {target}:\n{log}")]
    Compile {
        /// Name of the CUDA source.
        source_name: String,
        /// The architecture option, e.g. `sm_90`.
        target: String,
        /// NVRTC's error code.
        #[source]
        source: NvrtcError,
        /// The compiler's log.
        log: String,
    },
    /// The device is older than every architecture this NVRTC can target.
    #[error(
        "CUDA device has compute capability {major}.{minor}, older than the oldest architecture \
         this NVRTC supports (sm_{oldest})"
    )]
    UnsupportedDevice {
        /// Compute capability, major.
        major: u32,
        /// Compute capability, minor.
        minor: u32,
        /// Oldest architecture NVRTC supports, as `major * 10 + minor`.
        oldest: u32,
    },
    /// Batch arrays refused by the same rules as the CPU kernels
    /// ([`crate::KvBatch::validate`]), or a batch the decode kernel does not
    /// take (not one query per row).
    #[error(transparent)]
    Kernel(#[from] KernelError),
    /// A size beyond what a kernel supports.
    #[error("{what} is {value}, the CUDA kernels support at most {limit}")]
    TooLarge {
        /// The quantity.
        what: &'static str,
        /// Its value.
        value: usize,
        /// The largest value supported.
        limit: usize,
    },
    /// A host buffer whose length does not match the pool or the call.
    #[error("{what} has {len} elements, expected {expected}")]
    Length {
        /// The buffer.
        what: &'static str,
        /// Elements given.
        len: usize,
        /// Elements the geometry needs.
        expected: usize,
    },
    /// A geometry with a zero dimension.
    #[error("KV geometry has {what} = 0; every dimension must be at least 1")]
    ZeroDimension {
        /// The dimension.
        what: &'static str,
    },
    /// An argument outside its valid range.
    #[error("{what} is {value}, must be below {limit}")]
    OutOfRange {
        /// The argument.
        what: &'static str,
        /// Its value.
        value: usize,
        /// The exclusive upper bound.
        limit: usize,
    },
    /// `n_heads` is not a multiple of the pool's KV heads (grouped-query attention).
    #[error("{n_heads} query heads cannot be grouped over {n_kv_heads} KV heads")]
    HeadGrouping {
        /// Query heads asked for.
        n_heads: usize,
        /// KV heads of the pool.
        n_kv_heads: usize,
    },
    /// A page copy lists the same destination page twice.
    #[error("copy lists destination page {} twice", page.0)]
    DuplicateDestination {
        /// The page.
        page: PageId,
    },
    /// A page copy between pools whose pages differ in size.
    #[error("cannot copy pages of {src_elems} values into pages of {dst_elems} values")]
    PageSizeMismatch {
        /// Values per source page.
        src_elems: usize,
        /// Values per destination page.
        dst_elems: usize,
    },
    /// A pool used with kernels loaded on another device.
    #[error("pool lives on CUDA device {pool_device}, the kernels on device {kernels_device}")]
    WrongDevice {
        /// Device of the pool.
        pool_device: usize,
        /// Device of the kernels.
        kernels_device: usize,
    },
    /// A batch kernel wrote a refusal record this host code does not know.
    #[error("{kernel} wrote unknown refusal code {code} for row {row}")]
    CorruptRefusal {
        /// The kernel.
        kernel: &'static str,
        /// The batch row.
        row: usize,
        /// The code word.
        code: u32,
    },
    /// A device shadow whose geometry differs from the pool's or the host
    /// shadow's it is used with.
    #[error("device kernel shadow has {what} = {shadow}, but the {other} has {expected}")]
    ShadowGeometry {
        /// The dimension (pages, page slots, layers, words per page).
        what: &'static str,
        /// The device shadow's.
        shadow: usize,
        /// What it is used with: "pool" or "host shadow".
        other: &'static str,
        /// Theirs.
        expected: usize,
    },
    /// An engine's buffer given by device address lies in no allocation
    /// of the device.
    #[error("{what} at device address {address:#x} is not memory of CUDA device {ordinal}")]
    NotDeviceMemory {
        /// The buffer.
        what: &'static str,
        /// Its address.
        address: u64,
        /// The device it should be on.
        ordinal: usize,
        /// What the driver said of the address.
        #[source]
        source: DriverError,
    },
    /// An engine's buffer runs past the end of the allocation it starts in.
    #[error(
        "{what} at {address:#x}, {bytes} bytes, runs past its allocation ({size} bytes from {start:#x})"
    )]
    OutsideAllocation {
        /// The buffer.
        what: &'static str,
        /// Its address.
        address: u64,
        /// Its length in bytes.
        bytes: u64,
        /// The allocation's start.
        start: u64,
        /// The allocation's size in bytes.
        size: u64,
    },
    /// A plane of an NVTX pool description (`NvtxPool::new`, feature `nvtx`) that cannot describe pages.
    #[error("NVTX plane {plane} of the pool: {problem}")]
    NvtxPlane {
        /// Index of the plane in the list.
        plane: usize,
        /// What is wrong with it.
        problem: &'static str,
    },
    /// Two planes of an NVTX pool description put pages on the same bytes.
    #[error(
        "NVTX planes {first} and {second} of the pool overlap: a page's bytes would belong to two regions"
    )]
    NvtxPlanesOverlap {
        /// Index of the first plane.
        first: usize,
        /// Index of the second plane.
        second: usize,
    },
}

impl CudaError {
    /// Wraps a driver error with what was being done.
    pub(crate) fn driver(op: &'static str) -> impl FnOnce(DriverError) -> CudaError {
        move |source| CudaError::Driver { op, source }
    }

    /// Wraps an NVRTC error with what was being done.
    pub(crate) fn nvrtc(op: &'static str) -> impl FnOnce(NvrtcError) -> CudaError {
        move |source| CudaError::Nvrtc { op, source }
    }
}
