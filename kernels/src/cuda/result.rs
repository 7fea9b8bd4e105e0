//! The `result` layer: thin wrappers over NVRTC and the kernel launches, each
//! returning a `Result`. Raw NVRTC handles and the unsafe launches live here
//! and nowhere above.

use std::ffi::{CString, c_int};
use std::fmt;
use std::sync::{Mutex, OnceLock};

use cudarc::driver::{CudaFunction, CudaSlice, CudaStream, LaunchConfig, PushKernelArg};
use cudarc::nvrtc::result::NvrtcError;
use cudarc::nvrtc::sys;

use super::error::CudaError;
use super::source::{
    CudaSource, DECODE_THREADS, MODE_BOUNDS, MODE_GENERATIONS, MODE_SHADOW, STORE_THREADS,
};

/// The CUDA allocation that holds device address `ptr`: its start, its
/// size in bytes and the ordinal of its device. The caller has made a
/// context current on this thread.
///
/// # Errors
/// The driver's, e.g. `CUDA_ERROR_INVALID_VALUE` when `ptr` lies in no
/// allocation the driver knows (host memory, a freed buffer, a made-up
/// address).
pub fn allocation_of(ptr: u64) -> Result<(u64, u64, i32), cudarc::driver::DriverError> {
    use cudarc::driver::sys::{CUpointer_attribute, cuPointerGetAttribute};
    fn attribute<T: Default>(
        ptr: u64,
        attribute: CUpointer_attribute,
    ) -> Result<T, cudarc::driver::DriverError> {
        let mut value = T::default();
        // SAFETY: `value` is writable for the attribute's type (a
        // CUdeviceptr, a size_t or an int, matching `T` at each call below);
        // the driver reads only `ptr`'s value.
        unsafe { cuPointerGetAttribute((&raw mut value).cast(), attribute, ptr) }.result()?;
        Ok(value)
    }
    let start: u64 = attribute(
        ptr,
        CUpointer_attribute::CU_POINTER_ATTRIBUTE_RANGE_START_ADDR,
    )?;
    let size: usize = attribute(ptr, CUpointer_attribute::CU_POINTER_ATTRIBUTE_RANGE_SIZE)?;
    let ordinal: i32 = attribute(
        ptr,
        CUpointer_attribute::CU_POINTER_ATTRIBUTE_DEVICE_ORDINAL,
    )?;
    Ok((start, size as u64, ordinal))
}

/// Whether the CUDA driver library can be loaded. Never panics; cached.
pub fn driver_present() -> bool {
    static PRESENT: OnceLock<bool> = OnceLock::new();
    *PRESENT.get_or_init(|| {
        // SAFETY: this only dlopens libcuda by the names cudarc itself would
        // use and drops the handle; the driver library's initialisers are
        // written to run under dlopen, and no driver function is called.
        unsafe { cudarc::driver::sys::is_culib_present() }
    })
}

/// Whether the NVRTC library can be loaded. Never panics; cached.
pub fn nvrtc_present() -> bool {
    static PRESENT: OnceLock<bool> = OnceLock::new();
    *PRESENT.get_or_init(|| {
        // SAFETY: as in `driver_present`, for libnvrtc: a dlopen by cudarc's
        // candidate names, no NVRTC function called.
        unsafe { sys::is_culib_present() }
    })
}

/// Refuses, with an error, where NVRTC cannot be loaded — cudarc's lazy
/// loader would panic on the first NVRTC call instead.
fn ensure_nvrtc() -> Result<(), CudaError> {
    if nvrtc_present() {
        Ok(())
    } else {
        Err(CudaError::NvrtcNotFound)
    }
}

/// The version of the NVRTC library loaded, `(major, minor)`.
pub fn nvrtc_version() -> Result<(u32, u32), CudaError> {
    ensure_nvrtc()?;
    let (mut major, mut minor): (c_int, c_int) = (0, 0);
    // SAFETY: both pointers are to live local ints that nvrtcVersion writes;
    // the library is present (checked above).
    unsafe { sys::nvrtcVersion(&mut major, &mut minor) }
        .result()
        .map_err(CudaError::nvrtc("nvrtcVersion"))?;
    Ok((non_negative(major), non_negative(minor)))
}

/// The architectures the loaded NVRTC can compile for, as `major * 10 +
/// minor` (e.g. 90 for sm_90), ascending.
pub fn supported_archs() -> Result<Vec<u32>, CudaError> {
    ensure_nvrtc()?;
    let mut count: c_int = 0;
    // SAFETY: `count` is a live local int that the call writes; the library
    // is present (checked above).
    unsafe { sys::nvrtcGetNumSupportedArchs(&mut count) }
        .result()
        .map_err(CudaError::nvrtc("nvrtcGetNumSupportedArchs"))?;
    let mut archs: Vec<c_int> = vec![0; non_negative(count) as usize];
    // SAFETY: `archs` has room for the `count` ints NVRTC just said it writes.
    unsafe { sys::nvrtcGetSupportedArchs(archs.as_mut_ptr()) }
        .result()
        .map_err(CudaError::nvrtc("nvrtcGetSupportedArchs"))?;
    let mut archs: Vec<u32> = archs.into_iter().map(non_negative).collect();
    archs.sort_unstable();
    Ok(archs)
}

fn non_negative(value: c_int) -> u32 {
    u32::try_from(value).unwrap_or(0)
}

/// What NVRTC produces: machine code for one GPU, or PTX the driver compiles
/// when it loads the module.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum ImageKind {
    /// SASS for exactly this architecture (`sm_XY`). Preferred: a CUBIN from
    /// a newer NVRTC of the same major version loads on an older driver,
    /// which PTX does not.
    Cubin,
    /// PTX for a virtual architecture (`compute_XY`), JIT-compiled by the
    /// driver; used for a device newer than every architecture NVRTC knows.
    Ptx,
}

/// The architecture and image kind to compile for.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct CompileTarget {
    /// `major * 10 + minor`, e.g. 90.
    pub arch: u32,
    /// Machine code or PTX.
    pub kind: ImageKind,
}

impl CompileTarget {
    /// Machine code for `sm_{arch}`.
    pub const fn cubin(arch: u32) -> CompileTarget {
        CompileTarget {
            arch,
            kind: ImageKind::Cubin,
        }
    }

    /// PTX for `compute_{arch}`.
    pub const fn ptx(arch: u32) -> CompileTarget {
        CompileTarget {
            arch,
            kind: ImageKind::Ptx,
        }
    }

    /// Picks the target for a device of compute capability `major.minor`,
    /// given the architectures NVRTC supports: that exact architecture as a
    /// CUBIN when NVRTC knows it, else PTX for the newest older architecture
    /// it knows (the driver compiles PTX forward), else an error.
    pub fn for_device(major: u32, minor: u32, supported: &[u32]) -> Result<Self, CudaError> {
        let arch = major * 10 + minor;
        if supported.contains(&arch) {
            return Ok(CompileTarget::cubin(arch));
        }
        match supported.iter().copied().filter(|&a| a < arch).max() {
            Some(older) => Ok(CompileTarget::ptx(older)),
            None => Err(CudaError::UnsupportedDevice {
                major,
                minor,
                oldest: supported.iter().copied().min().unwrap_or(0),
            }),
        }
    }

    fn option(&self) -> String {
        format!("--gpu-architecture={self}")
    }
}

impl fmt::Display for CompileTarget {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self.kind {
            ImageKind::Cubin => write!(f, "sm_{}", self.arch),
            ImageKind::Ptx => write!(f, "compute_{}", self.arch),
        }
    }
}

/// A compiled CUDA source, ready for the driver to load.
#[derive(Debug, Clone)]
pub struct CompiledModule {
    /// What it was compiled for.
    pub target: CompileTarget,
    /// The CUBIN, or the PTX text with its terminating NUL (as
    /// `cuModuleLoadData` takes both).
    pub image: Vec<u8>,
    /// NVRTC's log (warnings), empty when there were none.
    pub log: String,
}

impl CompiledModule {
    /// The PTX text, for a PTX image.
    pub fn ptx_text(&self) -> Option<&str> {
        match self.target.kind {
            ImageKind::Ptx => {
                let text = self.image.strip_suffix(&[0]).unwrap_or(&self.image);
                std::str::from_utf8(text).ok()
            }
            ImageKind::Cubin => None,
        }
    }
}

/// Errors from destroying NVRTC programs, which happens in `Drop`: kept here
/// until the next [`compile`] returns them.
static CLEANUP_ERROR: Mutex<Option<NvrtcError>> = Mutex::new(None);

fn record_cleanup_error(err: NvrtcError) {
    let mut slot = CLEANUP_ERROR.lock().unwrap_or_else(|p| p.into_inner());
    slot.get_or_insert(err);
}

fn take_cleanup_error() -> Result<(), CudaError> {
    let mut slot = CLEANUP_ERROR.lock().unwrap_or_else(|p| p.into_inner());
    match slot.take() {
        Some(source) => Err(CudaError::Nvrtc {
            op: "nvrtcDestroyProgram",
            source,
        }),
        None => Ok(()),
    }
}

/// An NVRTC program; destroyed on drop.
struct Program {
    handle: sys::nvrtcProgram,
}

impl Program {
    fn create(source: &CudaSource) -> Result<Program, CudaError> {
        let mut handle: sys::nvrtcProgram = std::ptr::null_mut();
        // SAFETY: `handle` is a live out-pointer; `code` and `name` are
        // NUL-terminated 'static strings, so they outlive the program; with
        // zero headers the two null header arrays are not read. NVRTC is
        // present (callers check).
        unsafe {
            sys::nvrtcCreateProgram(
                &mut handle,
                source.code.as_ptr(),
                source.name.as_ptr(),
                0,
                std::ptr::null(),
                std::ptr::null(),
            )
        }
        .result()
        .map_err(CudaError::nvrtc("nvrtcCreateProgram"))?;
        Ok(Program { handle })
    }

    fn compile(&self, options: &[CString]) -> Result<(), NvrtcError> {
        let pointers: Vec<_> = options.iter().map(|o| o.as_ptr()).collect();
        let count = c_int::try_from(pointers.len()).unwrap_or(c_int::MAX);
        // SAFETY: `handle` is a live program (destroyed only in Drop);
        // `pointers` holds `count` NUL-terminated strings owned by `options`,
        // which outlives the call.
        unsafe { sys::nvrtcCompileProgram(self.handle, count, pointers.as_ptr()) }.result()
    }

    fn log(&self) -> Result<String, CudaError> {
        let mut size = 0usize;
        // SAFETY: live program, `size` a live local.
        unsafe { sys::nvrtcGetProgramLogSize(self.handle, &mut size) }
            .result()
            .map_err(CudaError::nvrtc("nvrtcGetProgramLogSize"))?;
        let mut log = vec![0u8; size.max(1)];
        // SAFETY: `log` has room for the `size` bytes (NUL included) NVRTC
        // just reported.
        unsafe { sys::nvrtcGetProgramLog(self.handle, log.as_mut_ptr().cast()) }
            .result()
            .map_err(CudaError::nvrtc("nvrtcGetProgramLog"))?;
        let text = log.split(|&b| b == 0).next().unwrap_or_default();
        Ok(String::from_utf8_lossy(text).trim_end().to_owned())
    }

    fn image(&self, kind: ImageKind) -> Result<Vec<u8>, CudaError> {
        let mut size = 0usize;
        let mut image;
        match kind {
            ImageKind::Cubin => {
                // SAFETY: live, compiled program; `size` a live local.
                unsafe { sys::nvrtcGetCUBINSize(self.handle, &mut size) }
                    .result()
                    .map_err(CudaError::nvrtc("nvrtcGetCUBINSize"))?;
                image = vec![0u8; size];
                // SAFETY: `image` has room for the `size` bytes just reported.
                unsafe { sys::nvrtcGetCUBIN(self.handle, image.as_mut_ptr().cast()) }
                    .result()
                    .map_err(CudaError::nvrtc("nvrtcGetCUBIN"))?;
            }
            ImageKind::Ptx => {
                // SAFETY: live, compiled program; `size` a live local.
                unsafe { sys::nvrtcGetPTXSize(self.handle, &mut size) }
                    .result()
                    .map_err(CudaError::nvrtc("nvrtcGetPTXSize"))?;
                image = vec![0u8; size];
                // SAFETY: `image` has room for the `size` bytes (NUL
                // included) just reported.
                unsafe { sys::nvrtcGetPTX(self.handle, image.as_mut_ptr().cast()) }
                    .result()
                    .map_err(CudaError::nvrtc("nvrtcGetPTX"))?;
            }
        }
        Ok(image)
    }
}

impl Drop for Program {
    fn drop(&mut self) {
        // SAFETY: `handle` came from nvrtcCreateProgram and is destroyed here
        // only, once; NVRTC nulls it.
        let destroyed = unsafe { sys::nvrtcDestroyProgram(&mut self.handle) }.result();
        if let Err(err) = destroyed {
            record_cleanup_error(err);
        }
    }
}

/// Compiles `source` for `target` with NVRTC.
pub fn compile(source: &CudaSource, target: CompileTarget) -> Result<CompiledModule, CudaError> {
    ensure_nvrtc()?;
    let compiled = {
        let program = Program::create(source)?;
        let options = [
            CString::from(c"--generate-line-info"),
            CString::new(target.option()).map_err(|_| CudaError::Compile {
                source_name: source.name.to_string_lossy().into_owned(),
                target: target.to_string(),
                source: NvrtcError(sys::nvrtcResult::NVRTC_ERROR_INVALID_OPTION),
                log: String::new(),
            })?,
        ];
        match program.compile(&options) {
            Ok(()) => Ok(CompiledModule {
                target,
                image: program.image(target.kind)?,
                log: program.log()?,
            }),
            Err(nvrtc) => Err(CudaError::Compile {
                source_name: source.name.to_string_lossy().into_owned(),
                target: target.to_string(),
                source: nvrtc,
                // The compile error is the one to report; a log that cannot
                // be read is said so inside it.
                log: program
                    .log()
                    .unwrap_or_else(|err| format!("(NVRTC log unavailable: {err})")),
            }),
        }
    };
    take_cleanup_error()?;
    compiled
}

/// The check buffers of a batch launch, by mode (`MODE_*` in
/// [`super::source`]). Buffers a mode does not read are passed as null
/// pointers, which the kernels do not dereference in that mode. `B` is how
/// the shadow's written words are passed: shared to the decode kernel,
/// exclusive to the store kernel (which sets bits).
pub(crate) enum CheckArgs<'a, B> {
    /// Bounds only.
    Bounds,
    /// The pool's generation array (one `u32` per page).
    Generations(&'a CudaSlice<u32>),
    /// The device shadow: records (2 words per page), written words
    /// (`stride` per page), each row's owner.
    Shadow {
        records: &'a CudaSlice<u64>,
        bits: B,
        stride: u32,
        owners: &'a CudaSlice<u64>,
    },
}

impl<B> CheckArgs<'_, B> {
    fn mode(&self) -> u32 {
        match self {
            CheckArgs::Bounds => MODE_BOUNDS,
            CheckArgs::Generations(_) => MODE_GENERATIONS,
            CheckArgs::Shadow { .. } => MODE_SHADOW,
        }
    }

    fn stride(&self) -> u32 {
        match self {
            CheckArgs::Shadow { stride, .. } => *stride,
            _ => 0,
        }
    }
}

/// The value a null device pointer argument is pushed as (kernel pointer
/// parameters are 8 bytes).
const NULL: u64 = 0;

/// Arguments of `kvsan_paged_attention_decode`, in its parameter order
/// (the refusal records and the output, which it writes, are passed apart).
pub(crate) struct DecodeLaunch<'a> {
    pub pool: &'a CudaSlice<u16>,
    pub n_pages: u32,
    pub page_slots: u32,
    pub n_layers: u32,
    pub n_kv_heads: u32,
    pub head_dim: u32,
    pub layer: u32,
    pub n_heads: u32,
    pub scale: f32,
    pub q: &'a CudaSlice<f32>,
    pub block_tables: &'a CudaSlice<u32>,
    pub n_entries: u64,
    pub width: u32,
    pub seq_lens: &'a CudaSlice<u32>,
    pub row_live: &'a CudaSlice<u32>,
    pub check: CheckArgs<'a, &'a CudaSlice<u64>>,
    pub rows: u32,
}

/// Launches the decode kernel on `stream`: grid `(rows, n_heads)`.
///
/// # Safety
///
/// - `func` is `kvsan_paged_attention_decode` from [`super::source::PAGED_ATTENTION`],
///   and every buffer belongs to `stream`'s context.
/// - `pool.len() == n_pages * page_elems` for the geometry given
///   (`page_elems = n_layers * 2 * page_slots * n_kv_heads * head_dim`).
/// - `page_slots`, `n_kv_heads`, `head_dim` are non-zero, `head_dim <=`
///   [`super::source::MAX_HEAD_DIM`], `layer < n_layers`, `n_heads` is a
///   non-zero multiple of `n_kv_heads` and `<= 65535`, `1 <= rows <= i32::MAX`.
/// - `q` and `out` hold `rows * n_heads * head_dim` values; `seq_lens` and
///   `row_live` hold `rows`; `refusals` holds `REFUSAL_WORDS * rows` words,
///   zero.
/// - `block_tables` holds `2 * n_entries` words (at least 1), and
///   `n_entries == rows * width`. (Pages named need not exist, nor entries
///   a sequence length reaches: the kernel refuses those outside.)
/// - With [`CheckArgs::Generations`], the array holds `n_pages` words; with
///   [`CheckArgs::Shadow`], `records` holds `2 * n_pages` words, `bits`
///   `n_pages * stride` with `stride >= ceil(n_layers * page_slots / 64)`,
///   and `owners` `rows`.
pub(crate) unsafe fn launch_decode(
    stream: &CudaStream,
    func: &CudaFunction,
    args: &DecodeLaunch<'_>,
    refusals: &mut CudaSlice<u32>,
    out: &mut CudaSlice<f32>,
) -> Result<(), CudaError> {
    let config = LaunchConfig {
        grid_dim: (args.rows, args.n_heads, 1),
        block_dim: (DECODE_THREADS, 1, 1),
        shared_mem_bytes: 0,
    };
    let mode = args.check.mode();
    let stride = args.check.stride();
    let mut launch = stream.launch_builder(func);
    launch
        .arg(args.pool)
        .arg(&args.n_pages)
        .arg(&args.page_slots)
        .arg(&args.n_layers)
        .arg(&args.n_kv_heads)
        .arg(&args.head_dim)
        .arg(&args.layer)
        .arg(&args.n_heads)
        .arg(&args.scale)
        .arg(args.q)
        .arg(args.block_tables)
        .arg(&args.n_entries)
        .arg(&args.width)
        .arg(args.seq_lens)
        .arg(args.row_live)
        .arg(&mode);
    match &args.check {
        CheckArgs::Bounds => launch
            .arg(&NULL)
            .arg(&NULL)
            .arg(&NULL)
            .arg(&stride)
            .arg(&NULL),
        CheckArgs::Generations(generations) => launch
            .arg(*generations)
            .arg(&NULL)
            .arg(&NULL)
            .arg(&stride)
            .arg(&NULL),
        CheckArgs::Shadow {
            records,
            bits,
            owners,
            ..
        } => launch
            .arg(&NULL)
            .arg(*records)
            .arg(*bits)
            .arg(&stride)
            .arg(*owners),
    };
    launch.arg(refusals).arg(out);
    // SAFETY: the argument list matches the kernel's parameters in order and
    // type (u16/u32/u64/f32 buffers as pointers, u32/u64/f32 scalars by
    // value, an 8-byte zero as the null pointer of a buffer the mode does
    // not read), and the caller guarantees every index the kernel forms is
    // inside its buffer.
    unsafe { launch.launch(config) }
        .map_err(CudaError::driver("launch kvsan_paged_attention_decode"))?;
    Ok(())
}

/// Arguments of `kvsan_store_kv`, in its parameter order (the pool and the
/// refusal records, which it writes, are passed apart).
pub(crate) struct StoreLaunch<'a> {
    pub n_pages: u32,
    pub page_slots: u32,
    pub n_layers: u32,
    pub n_kv_heads: u32,
    pub head_dim: u32,
    pub layer: u32,
    pub k: &'a CudaSlice<f32>,
    pub v: &'a CudaSlice<f32>,
    pub store_slots: &'a CudaSlice<u32>,
    pub query_start: &'a CudaSlice<u32>,
    pub row_live: &'a CudaSlice<u32>,
    pub check: CheckArgs<'a, &'a mut CudaSlice<u64>>,
    pub rows: u32,
    /// Blocks per row (grid y), each storing every `token_blocks`-th token.
    pub token_blocks: u32,
}

/// Launches the store kernel on `stream`: grid `(rows, token_blocks)`.
///
/// # Safety
///
/// - `func` is `kvsan_store_kv` from [`super::source::PAGED_ATTENTION`], and
///   every buffer belongs to `stream`'s context.
/// - `pool.len() == n_pages * page_elems` for the geometry given, every
///   dimension non-zero, `layer < n_layers`, `1 <= rows <= i32::MAX`,
///   `1 <= token_blocks <= 65535`.
/// - `query_start` holds `rows + 1` non-decreasing offsets from 0 to
///   `tokens`; `store_slots` holds `3 * tokens` words (at least 1); `k` and
///   `v` hold `tokens * n_kv_heads * head_dim` values (at least 1);
///   `row_live` holds `rows` words and `refusals` `REFUSAL_WORDS * rows`,
///   zero. (Store slots need not name pages or slots inside the pool: the
///   kernel refuses those.)
/// - With [`CheckArgs::Generations`], the array holds `n_pages` words; with
///   [`CheckArgs::Shadow`], `records` holds `2 * n_pages` words, `bits`
///   `n_pages * stride` with `stride >= ceil(n_layers * page_slots / 64)`,
///   and `owners` `rows`.
pub(crate) unsafe fn launch_store(
    stream: &CudaStream,
    func: &CudaFunction,
    args: StoreLaunch<'_>,
    pool: &mut CudaSlice<u16>,
    refusals: &mut CudaSlice<u32>,
) -> Result<(), CudaError> {
    let config = LaunchConfig {
        grid_dim: (args.rows, args.token_blocks, 1),
        block_dim: (STORE_THREADS, 1, 1),
        shared_mem_bytes: 0,
    };
    let mode = args.check.mode();
    let stride = args.check.stride();
    let mut launch = stream.launch_builder(func);
    launch
        .arg(pool)
        .arg(&args.n_pages)
        .arg(&args.page_slots)
        .arg(&args.n_layers)
        .arg(&args.n_kv_heads)
        .arg(&args.head_dim)
        .arg(&args.layer)
        .arg(args.k)
        .arg(args.v)
        .arg(args.store_slots)
        .arg(args.query_start)
        .arg(args.row_live)
        .arg(&mode);
    match args.check {
        CheckArgs::Bounds => launch
            .arg(&NULL)
            .arg(&NULL)
            .arg(&NULL)
            .arg(&stride)
            .arg(&NULL),
        CheckArgs::Generations(generations) => launch
            .arg(generations)
            .arg(&NULL)
            .arg(&NULL)
            .arg(&stride)
            .arg(&NULL),
        CheckArgs::Shadow {
            records,
            bits,
            owners,
            ..
        } => launch
            .arg(&NULL)
            .arg(records)
            .arg(bits)
            .arg(&stride)
            .arg(owners),
    };
    launch.arg(refusals);
    // SAFETY: the argument list matches the kernel's parameters in order and
    // type (as for the decode launch), and the caller guarantees every index
    // the kernel forms is inside its buffer: the kernel writes the pool only
    // at pages below n_pages and slots below page_slots, and written words
    // only of those pages.
    unsafe { launch.launch(config) }.map_err(CudaError::driver("launch kvsan_store_kv"))?;
    Ok(())
}

/// Threads per block of the shadow kernels.
const SHADOW_THREADS: u32 = 256;
/// Most blocks of a shadow kernel (they stride over larger lists).
const SHADOW_BLOCKS: u64 = 1024;

fn shadow_grid(words: u64) -> LaunchConfig {
    let blocks = words
        .div_ceil(u64::from(SHADOW_THREADS))
        .clamp(1, SHADOW_BLOCKS);
    LaunchConfig {
        grid_dim: (u32::try_from(blocks).unwrap_or(1024), 1, 1),
        block_dim: (SHADOW_THREADS, 1, 1),
        shared_mem_bytes: 0,
    }
}

/// Launches `kvsan_shadow_scatter`: listed page `k`'s state word, owner and
/// `stride` written words, from `packed[k * (2 + stride)..]`, into `records`
/// and `bits`.
///
/// # Safety
///
/// - `func` is `kvsan_shadow_scatter` from [`super::source::SHADOW`]; every
///   buffer belongs to `stream`'s context.
/// - `records.len() == 2 * n_pages`, `bits.len() == n_pages * stride`,
///   `stride >= 1`; `pages` holds at least one entry and `packed` holds
///   `pages.len() * (2 + stride)` words. (Pages need not be below
///   `n_pages`: the kernel skips those.)
#[allow(clippy::too_many_arguments)]
pub(crate) unsafe fn launch_shadow_scatter(
    stream: &CudaStream,
    func: &CudaFunction,
    records: &mut CudaSlice<u64>,
    bits: &mut CudaSlice<u64>,
    n_pages: u32,
    stride: u32,
    pages: &CudaSlice<u32>,
    packed: &CudaSlice<u64>,
) -> Result<(), CudaError> {
    let n_listed = u32::try_from(pages.len()).map_err(|_| CudaError::TooLarge {
        what: "pages to upload to the device shadow in one call",
        value: pages.len(),
        limit: u32::MAX as usize,
    })?;
    let config = shadow_grid(u64::from(n_listed) * (2 + u64::from(stride)));
    let mut launch = stream.launch_builder(func);
    launch
        .arg(records)
        .arg(bits)
        .arg(&n_pages)
        .arg(&stride)
        .arg(pages)
        .arg(&n_listed)
        .arg(packed);
    // SAFETY: arguments match the kernel's parameters in order and type; the
    // kernel reads `n_listed * (2 + stride)` packed words and writes only
    // the records and written words of listed pages below n_pages, inside
    // the buffers by the caller's guarantee.
    unsafe { launch.launch(config) }.map_err(CudaError::driver("launch kvsan_shadow_scatter"))?;
    Ok(())
}

/// Launches `kvsan_shadow_gather_bits`: listed page `k`'s `stride` written
/// words into `out[k * stride..]`.
///
/// # Safety
///
/// - `func` is `kvsan_shadow_gather_bits` from [`super::source::SHADOW`];
///   every buffer belongs to `stream`'s context.
/// - `bits.len() == n_pages * stride`, `stride >= 1`; `pages` holds at least
///   one entry and `out` holds `pages.len() * stride` words.
pub(crate) unsafe fn launch_shadow_gather(
    stream: &CudaStream,
    func: &CudaFunction,
    bits: &CudaSlice<u64>,
    n_pages: u32,
    stride: u32,
    pages: &CudaSlice<u32>,
    out: &mut CudaSlice<u64>,
) -> Result<(), CudaError> {
    let n_listed = u32::try_from(pages.len()).map_err(|_| CudaError::TooLarge {
        what: "pages to download from the device shadow in one call",
        value: pages.len(),
        limit: u32::MAX as usize,
    })?;
    let config = shadow_grid(u64::from(n_listed) * u64::from(stride));
    let mut launch = stream.launch_builder(func);
    launch
        .arg(bits)
        .arg(&n_pages)
        .arg(&stride)
        .arg(pages)
        .arg(&n_listed)
        .arg(out);
    // SAFETY: arguments match the kernel's parameters in order and type; the
    // kernel reads only written words of listed pages below n_pages and
    // writes `n_listed * stride` words of `out`, inside the buffers by the
    // caller's guarantee.
    unsafe { launch.launch(config) }
        .map_err(CudaError::driver("launch kvsan_shadow_gather_bits"))?;
    Ok(())
}

/// Threads per block of the page kernels.
const PAGE_THREADS: u32 = 256;
/// Most blocks per listed page (the kernels stride over larger pages).
const PAGE_BLOCKS: u64 = 1024;

fn page_grid(items: u32, units_per_page: u64) -> LaunchConfig {
    let blocks = units_per_page
        .div_ceil(u64::from(PAGE_THREADS))
        .clamp(1, PAGE_BLOCKS);
    LaunchConfig {
        grid_dim: (items, u32::try_from(blocks).unwrap_or(1024), 1),
        block_dim: (PAGE_THREADS, 1, 1),
        shared_mem_bytes: 0,
    }
}

/// Launches `kvsan_poison_pages` over the pages listed in `pages`.
///
/// # Safety
///
/// - `func` is `kvsan_poison_pages` from [`super::source::PAGES`]; both
///   buffers belong to `stream`'s context.
/// - `pool.len() == n_pages * page_elems`; `pages` holds at least one entry.
///   (Entries need not be below `n_pages`: the kernel skips those.)
pub(crate) unsafe fn launch_poison(
    stream: &CudaStream,
    func: &CudaFunction,
    pool: &mut CudaSlice<u16>,
    page_elems: u64,
    n_pages: u32,
    pages: &CudaSlice<u32>,
) -> Result<(), CudaError> {
    let items = u32::try_from(pages.len()).map_err(|_| CudaError::TooLarge {
        what: "pages to poison in one call",
        value: pages.len(),
        limit: u32::MAX as usize,
    })?;
    let config = page_grid(items, page_elems);
    let mut launch = stream.launch_builder(func);
    launch.arg(pool).arg(&page_elems).arg(&n_pages).arg(pages);
    // SAFETY: arguments match the kernel's parameters in order and type; the
    // kernel writes only `page_elems` values of pages below `n_pages`, inside
    // `pool` by the caller's guarantee.
    unsafe { launch.launch(config) }.map_err(CudaError::driver("launch kvsan_poison_pages"))?;
    Ok(())
}

/// Arguments of `kvsan_copy_pages`, in its parameter order.
pub(crate) struct CopyLaunch<'a> {
    pub src: &'a CudaSlice<u16>,
    pub src_pages: u32,
    pub dst: &'a mut CudaSlice<u16>,
    pub dst_pages: u32,
    pub page_elems: u64,
    pub pairs: &'a CudaSlice<u32>,
}

/// Launches `kvsan_copy_pages` for the `(src, dst)` page pairs in `pairs`.
///
/// # Safety
///
/// - `func` is `kvsan_copy_pages` from [`super::source::PAGES`]; every buffer
///   belongs to `stream`'s context.
/// - `src.len() == src_pages * page_elems`, `dst.len() == dst_pages *
///   page_elems`; `pairs` holds an even, non-zero number of words, and no
///   destination page appears twice (no two blocks write the same value).
///   (Pages need not be inside the pools: the kernel skips pairs outside.)
pub(crate) unsafe fn launch_copy(
    stream: &CudaStream,
    func: &CudaFunction,
    args: CopyLaunch<'_>,
) -> Result<(), CudaError> {
    let items = u32::try_from(args.pairs.len() / 2).map_err(|_| CudaError::TooLarge {
        what: "page pairs to copy in one call",
        value: args.pairs.len() / 2,
        limit: u32::MAX as usize,
    })?;
    let units = if args.page_elems.is_multiple_of(8) {
        args.page_elems / 8
    } else {
        args.page_elems
    };
    let config = page_grid(items, units);
    let mut launch = stream.launch_builder(func);
    launch
        .arg(args.src)
        .arg(&args.src_pages)
        .arg(args.dst)
        .arg(&args.dst_pages)
        .arg(&args.page_elems)
        .arg(args.pairs);
    // SAFETY: arguments match the kernel's parameters in order and type; the
    // kernel reads and writes only whole pages below `src_pages`/`dst_pages`,
    // inside the buffers by the caller's guarantee, and takes its 16-byte
    // path only when it has checked that both buffers start 16-byte aligned
    // and page_elems % 8 == 0, so every page start is aligned too.
    unsafe { launch.launch(config) }.map_err(CudaError::driver("launch kvsan_copy_pages"))?;
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_device_nvrtc_knows_gets_a_cubin_for_its_own_architecture() {
        let target = CompileTarget::for_device(9, 0, &[75, 80, 86, 89, 90, 100]);
        assert_eq!(target.ok(), Some(CompileTarget::cubin(90)));
    }

    #[test]
    fn a_device_newer_than_nvrtc_gets_ptx_for_the_newest_older_architecture() {
        let target = CompileTarget::for_device(12, 0, &[75, 80, 90, 100]);
        assert_eq!(target.ok(), Some(CompileTarget::ptx(100)));
    }

    #[test]
    fn a_device_older_than_nvrtc_is_refused_naming_the_oldest_supported() {
        match CompileTarget::for_device(6, 1, &[75, 80, 90]) {
            Err(CudaError::UnsupportedDevice {
                major: 6,
                minor: 1,
                oldest: 75,
            }) => {}
            other => panic!("expected UnsupportedDevice, got {other:?}"),
        }
    }

    #[test]
    fn targets_print_as_nvrtc_architecture_names() {
        assert_eq!(CompileTarget::cubin(90).to_string(), "sm_90");
        assert_eq!(
            CompileTarget::ptx(86).option(),
            "--gpu-architecture=compute_86"
        );
    }
}
