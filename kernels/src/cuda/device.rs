//! [`CudaKernels`]: the kernels compiled and loaded on one device, and the
//! safe entry points that check every input before a launch.

use std::collections::HashSet;
use std::convert::Infallible;
use std::mem::ManuallyDrop;
use std::ops::Range;
use std::sync::Arc;
use std::sync::atomic::{AtomicBool, AtomicU32, Ordering};

use cudarc::driver::{CudaContext, CudaFunction, CudaModule, CudaSlice, CudaStream};
use cudarc::nvrtc::Ptx;
use half::f16;
use kvsan_ids::{Generation, PageId, RequestId};
use kvsan_sanitizer::KernelShadow;

use super::CudaRefusal;
use super::batch::{
    self, DecodeOutput, Op, ReadCheck, StoreCheck, decode_arrays, decode_refusals, owner_words,
    refuse_all, store_arrays,
};
use super::check::Borrowed;
use super::check::{
    CheckLaunch, EngineBatch, EngineRefusal, check_rows, decode_engine_refusals, launch_check,
    may_record,
};
use super::error::CudaError;
use super::pool::{CudaKvPool, page_elems};
use super::result::{
    self, CheckArgs, CompileTarget, DecodeLaunch, StoreLaunch, compile, driver_present,
    nvrtc_present, supported_archs,
};
use super::shadow::{CudaKernelShadow, host_words, shadow_words};
use super::source::{
    CHECK, CHECK_BLOCK_TABLE_KERNEL, CHECK_PAGED_CSR_KERNEL, CHECK_REQ_TO_TOKEN_KERNEL,
    CHECK_SLOT_MAPPING_KERNEL, COPY_KERNEL, CudaSource, DECODE_KERNEL, MAX_HEAD_DIM, MODE_BOUNDS,
    MODE_GENERATIONS, MODE_SHADOW, PAGED_ATTENTION, PAGES, POISON_KERNEL, REFUSAL_WORDS, SHADOW,
    SHADOW_GATHER_KERNEL, SHADOW_SCATTER_KERNEL, STORE_KERNEL,
};
use crate::attention::{KvBatch, KvGeometry};
use crate::guard::RowLedger;
use kvsan_sanitizer::BatchLayout;
use kvsan_sanitizer::layouts::{Addresses, Array, Batch, DeviceArray, MapBuffers, Owned};

/// Largest grid y dimension: query heads per decode launch.
const MAX_GRID_Y: usize = 65_535;

/// The kvsan CUDA kernels, compiled by NVRTC for one device and loaded there.
///
/// Every operation runs on the kernels' stream and waits for it before
/// returning, so a failed launch or a fault inside a kernel comes back from
/// the call that caused it. Errors recorded in `Drop` of device buffers
/// (cudarc's sticky slot) come back from the next operation.
#[derive(Debug)]
pub struct CudaKernels {
    stream: Arc<CudaStream>,
    target: CompileTarget,
    compute_capability: (u32, u32),
    decode: CudaFunction,
    store: CudaFunction,
    poison: CudaFunction,
    copy: CudaFunction,
    scatter: CudaFunction,
    gather: CudaFunction,
    check_block_table: CudaFunction,
    check_paged_csr: CudaFunction,
    check_req_to_token: CudaFunction,
    check_slot_mapping: CudaFunction,
    /// Kernel timing on ([`CudaKernels::set_kernel_timing`]).
    timing: AtomicBool,
    /// The last timed launch's milliseconds, as f32 bits (`u32::MAX`: none).
    last_ms: AtomicU32,
}

impl CudaKernels {
    /// Compiles the kernels for device `ordinal` and loads them there.
    ///
    /// Returns an error — never panics — where the driver or NVRTC cannot be
    /// loaded, the device does not exist, or compilation fails.
    pub fn new(ordinal: usize) -> Result<CudaKernels, CudaError> {
        if !driver_present() {
            return Err(CudaError::DriverNotFound);
        }
        if !nvrtc_present() {
            return Err(CudaError::NvrtcNotFound);
        }
        let count = CudaContext::device_count().map_err(CudaError::driver("count devices"))?;
        let count = usize::try_from(count).unwrap_or(0);
        if ordinal >= count {
            return Err(CudaError::NoSuchDevice { ordinal, count });
        }
        let ctx = CudaContext::new(ordinal).map_err(CudaError::driver("create a context"))?;
        let (major, minor) = ctx
            .compute_capability()
            .map_err(CudaError::driver("query the compute capability"))?;
        let (major, minor) = (
            u32::try_from(major).unwrap_or(0),
            u32::try_from(minor).unwrap_or(0),
        );
        let target = CompileTarget::for_device(major, minor, &supported_archs()?)?;
        let attention = load(&ctx, &PAGED_ATTENTION, target)?;
        let pages = load(&ctx, &PAGES, target)?;
        let shadow = load(&ctx, &SHADOW, target)?;
        let check = load(&ctx, &CHECK, target)?;
        let kernels = CudaKernels {
            stream: ctx.default_stream(),
            target,
            compute_capability: (major, minor),
            decode: function(&attention, DECODE_KERNEL)?,
            store: function(&attention, STORE_KERNEL)?,
            poison: function(&pages, POISON_KERNEL)?,
            copy: function(&pages, COPY_KERNEL)?,
            scatter: function(&shadow, SHADOW_SCATTER_KERNEL)?,
            gather: function(&shadow, SHADOW_GATHER_KERNEL)?,
            check_block_table: function(&check, CHECK_BLOCK_TABLE_KERNEL)?,
            check_paged_csr: function(&check, CHECK_PAGED_CSR_KERNEL)?,
            check_req_to_token: function(&check, CHECK_REQ_TO_TOKEN_KERNEL)?,
            check_slot_mapping: function(&check, CHECK_SLOT_MAPPING_KERNEL)?,
            timing: AtomicBool::new(false),
            last_ms: AtomicU32::new(u32::MAX),
        };
        kernels.finish("load the kernels")?;
        Ok(kernels)
    }

    /// Ordinal of the device.
    pub fn ordinal(&self) -> usize {
        self.stream.context().ordinal()
    }

    /// The device's compute capability, `(major, minor)`.
    pub fn compute_capability(&self) -> (u32, u32) {
        self.compute_capability
    }

    /// Times each batch launch from now on (`on`), or stops: the decode, the
    /// store and the checks of an engine's buffers get a CUDA event before
    /// and after their kernel, and [`CudaKernels::last_kernel_ms`] says how
    /// long the device ran it, without the copies around it. For
    /// benchmarks; off by default (the events cost a little).
    pub fn set_kernel_timing(&self, on: bool) {
        self.timing.store(on, Ordering::Relaxed);
        self.last_ms.store(u32::MAX, Ordering::Relaxed);
    }

    /// Milliseconds of the last timed kernel (for a check of an engine's
    /// buffers that records: both passes); `None` before the first, or
    /// with timing off.
    pub fn last_kernel_ms(&self) -> Option<f32> {
        let bits = self.last_ms.load(Ordering::Relaxed);
        (bits != u32::MAX).then(|| f32::from_bits(bits))
    }

    /// Runs `launch` between two timing events when timing is on, adding
    /// the device time to the last kernel time (`fresh`: starting from 0).
    fn timed<R>(
        &self,
        fresh: bool,
        launch: impl FnOnce() -> Result<R, CudaError>,
    ) -> Result<R, CudaError> {
        if !self.timing.load(Ordering::Relaxed) {
            return launch();
        }
        let flags = Some(cudarc::driver::sys::CUevent_flags::CU_EVENT_DEFAULT);
        let start = self
            .stream
            .record_event(flags)
            .map_err(CudaError::driver("record a timing event"))?;
        let out = launch()?;
        let end = self
            .stream
            .record_event(flags)
            .map_err(CudaError::driver("record a timing event"))?;
        let ms = start
            .elapsed_ms(&end)
            .map_err(CudaError::driver("read a kernel's time"))?;
        let before = match self.last_kernel_ms() {
            Some(t) if !fresh => t,
            _ => 0.0,
        };
        self.last_ms
            .store((before + ms).to_bits(), Ordering::Relaxed);
        Ok(out)
    }

    /// What the kernels were compiled for (e.g. `sm_90`).
    pub fn target(&self) -> CompileTarget {
        self.target
    }

    /// Allocates a pool of `n_pages` pages on the device. The pages are not
    /// initialised (an engine never zeroes its pool: zero-filling would hide
    /// the stale reads kvsan exists to catch); every generation is 0 ("never
    /// allocated").
    pub fn alloc_pool(
        &self,
        geometry: KvGeometry,
        n_pages: usize,
    ) -> Result<CudaKvPool, CudaError> {
        self.finish("an earlier operation")?;
        let page_elems = check_geometry(&geometry)?;
        if n_pages == 0 {
            return Err(CudaError::ZeroDimension { what: "n_pages" });
        }
        if n_pages > u32::MAX as usize {
            return Err(CudaError::TooLarge {
                what: "pages in a pool",
                value: n_pages,
                limit: u32::MAX as usize,
            });
        }
        let total = page_elems.checked_mul(n_pages).ok_or(CudaError::TooLarge {
            what: "pages in a pool",
            value: n_pages,
            limit: usize::MAX / page_elems,
        })?;
        // A plain allocation (cuMemAlloc), not one of the stream-ordered
        // allocator's: a tool sees it as an allocation of its own, and
        // compute-sanitizer takes an NVTX heap only over such (it refused
        // one over a stream-ordered allocation on an H200, CUDA 13.0). A
        // pool lives as long as the engine: nothing is lost by not pooling.
        let bytes = total
            .checked_mul(std::mem::size_of::<u16>())
            .ok_or(CudaError::TooLarge {
                what: "pages in a pool",
                value: n_pages,
                limit: usize::MAX / 2 / page_elems,
            })?;
        self.stream
            .context()
            .bind_to_thread()
            .map_err(CudaError::driver("make the context current"))?;
        // SAFETY: a fresh allocation of `bytes` bytes in the current
        // context, owned from here on by the pool, which frees it with
        // cuMemFree (`CudaKvPool`'s `Drop`).
        let ptr = unsafe { cudarc::driver::result::malloc_sync(bytes) }
            .map_err(CudaError::driver("allocate the pool"))?;
        // SAFETY: `ptr` holds `total` u16 values on this stream's device.
        // The memory is left unset on purpose (see above): every bit
        // pattern is a valid f16, so copying any of it to the host is sound,
        // and the kernels read it only as f16 values. The slice is never
        // dropped as a cudarc slice (that would free it stream-ordered).
        let pages = ManuallyDrop::new(unsafe { self.stream.upgrade_device_ptr::<u16>(ptr, total) });
        let generations = self
            .stream
            .alloc_zeros::<u32>(n_pages)
            .map_err(CudaError::driver("allocate the generation array"))?;
        self.finish("allocate the pool")?;
        Ok(CudaKvPool {
            geometry,
            n_pages,
            page_elems,
            pages,
            #[cfg(feature = "nvtx")]
            nvtx: None,
            generations,
            stream: Arc::clone(&self.stream),
        })
    }

    /// Creates a pool on the device holding `pages` (whole pages of
    /// `geometry`) and `generations` (one per page).
    pub fn upload_pool(
        &self,
        geometry: KvGeometry,
        pages: &[f16],
        generations: &[Generation],
    ) -> Result<CudaKvPool, CudaError> {
        let page_elems = check_geometry(&geometry)?;
        if pages.len() != generations.len() * page_elems {
            return Err(CudaError::Length {
                what: "pool data",
                len: pages.len(),
                expected: generations.len() * page_elems,
            });
        }
        let mut pool = self.alloc_pool(geometry, generations.len())?;
        pool.upload_pages(PageId(0), pages)?;
        pool.upload_generations(generations)?;
        Ok(pool)
    }

    /// Copies a pool's kernel shadow (the sanitizer's, for the pool this
    /// device pool mirrors: `Sanitizer::kernel_shadow`) to the device, for
    /// the batch kernels to check in place ([`ReadCheck::Shadow`],
    /// [`StoreCheck::Shadow`]).
    ///
    /// # Errors
    /// A shadow too large for the device, or a CUDA failure.
    pub fn upload_shadow(&self, host: &KernelShadow<'_>) -> Result<CudaKernelShadow, CudaError> {
        self.finish("an earlier operation")?;
        let layout = *host.layout();
        let pages = host.pages();
        if pages == 0 || layout.stride == 0 {
            return Err(CudaError::ZeroDimension {
                what: "pages or written words per page of the kernel shadow",
            });
        }
        to_u32("pages in a kernel shadow", pages)?;
        to_u32("written words per page", layout.stride)?;
        let (n_records, n_bits) = shadow_words(pages, &layout)?;
        let (records, bits) = host_words(host);
        if records.len() != n_records || bits.len() != n_bits {
            return Err(CudaError::Length {
                what: "host shadow words",
                len: records.len() + bits.len(),
                expected: n_records + n_bits,
            });
        }
        let records = self.upload(&records, "copy shadow records to the device")?;
        let bits = self.upload(&bits, "copy written bits to the device")?;
        self.finish("upload the shadow")?;
        Ok(CudaKernelShadow {
            pages,
            layout,
            records,
            bits,
            scatter: self.scatter.clone(),
            gather: self.gather.clone(),
            stream: Arc::clone(&self.stream),
        })
    }

    /// Paged-attention decode of `layer` over `pool` for a batch of decode
    /// rows, as the CPU kernels' [`crate::attend`] computes it for one query
    /// per row: row `r`'s query (token `r`: `q` is `rows × n_heads ×
    /// head_dim`) at position `seq_lens[r] - 1` attends over positions
    /// `0..seq_lens[r]`, read through the row's entries of the block-table
    /// array (the flat index, as on the CPU). Query head `h` reads KV head
    /// `h / (n_heads / n_kv_heads)`; queries are rounded to f16 first.
    ///
    /// Before any K/V byte of a row is read, the kernel checks every entry
    /// the row reads — an entry outside the block-table array or a page
    /// outside the pool always, then what `check` says, for the slots the
    /// row reads of each page — and reads nothing of a row with a refused
    /// entry: its output is zero, and the first refused entry (lowest
    /// index) comes back as a [`CudaRefusal`], given to `ledger` too. Rows
    /// the ledger has stopped (an earlier refusal in the step) are skipped
    /// the same way, without a new refusal. `ledger` is the step's, made for
    /// the batch's rows (`RowLedger::new(rows)`; rows past it count as
    /// stopped).
    ///
    /// # Errors
    /// Batch arrays that do not fit each other ([`KvBatch::validate`]) or
    /// with a row of other than one query, a `q` of the wrong length, a
    /// layer or head count the pool cannot take, a shadow or owners that do
    /// not fit the pool and the batch, or a CUDA failure. A refused access
    /// is not an error.
    #[allow(clippy::too_many_arguments)]
    pub fn attend_decode(
        &self,
        pool: &CudaKvPool,
        layer: usize,
        n_heads: usize,
        scale: f32,
        batch: &KvBatch<'_>,
        q: &[f32],
        check: ReadCheck<'_>,
        ledger: &RowLedger,
    ) -> Result<DecodeOutput, CudaError> {
        self.check_pool(pool)?;
        self.finish("an earlier operation")?;
        let geometry = &pool.geometry;
        self.check_layer(geometry, layer)?;
        if n_heads == 0 || !n_heads.is_multiple_of(geometry.n_kv_heads) {
            return Err(CudaError::HeadGrouping {
                n_heads,
                n_kv_heads: geometry.n_kv_heads,
            });
        }
        if n_heads > MAX_GRID_Y {
            return Err(CudaError::TooLarge {
                what: "query heads",
                value: n_heads,
                limit: MAX_GRID_Y,
            });
        }
        let arrays = decode_arrays(batch, ledger)?;
        let rows = batch.rows();
        let q_len = n_heads * geometry.head_dim;
        let q_total = rows.checked_mul(q_len).ok_or(CudaError::TooLarge {
            what: "rows in one launch",
            value: rows,
            limit: usize::MAX / q_len,
        })?;
        if q.len() != q_total {
            return Err(CudaError::Length {
                what: "queries (rows × n_heads × head_dim)",
                len: q.len(),
                expected: q_total,
            });
        }
        let owners = match check {
            ReadCheck::Shadow { shadow, owners } => {
                self.check_shadow(shadow, pool)?;
                Some(owner_words(owners, rows)?)
            }
            ReadCheck::Bounds | ReadCheck::Generations => None,
        };
        if rows == 0 {
            return Ok(DecodeOutput::default());
        }

        let q = self.upload(q, "copy queries to the device")?;
        let tables = self.upload(&arrays.block_tables, "copy block tables to the device")?;
        let lens = self.upload(&arrays.seq_lens, "copy sequence lengths to the device")?;
        let live = self.upload(&arrays.row_live, "copy live rows to the device")?;
        let owners = owners
            .map(|o| self.upload(&o, "copy row owners to the device"))
            .transpose()?;
        let mut refusals = self
            .stream
            .alloc_zeros::<u32>(REFUSAL_WORDS * rows)
            .map_err(CudaError::driver("allocate the refusal records"))?;
        let mut out = self
            .stream
            .alloc_zeros::<f32>(q_total)
            .map_err(CudaError::driver("allocate the attention output"))?;
        let (check, mode) = match (check, &owners) {
            (ReadCheck::Shadow { shadow, .. }, Some(owners)) => (
                CheckArgs::Shadow {
                    records: &shadow.records,
                    bits: &shadow.bits,
                    stride: to_u32("written words per page", shadow.layout.stride)?,
                    owners,
                },
                MODE_SHADOW,
            ),
            (ReadCheck::Generations, _) => {
                (CheckArgs::Generations(&pool.generations), MODE_GENERATIONS)
            }
            _ => (CheckArgs::Bounds, MODE_BOUNDS),
        };
        let args = DecodeLaunch {
            pool: &pool.pages,
            n_pages: to_u32("pages in the pool", pool.n_pages)?,
            page_slots: to_u32("page slots", geometry.page_slots)?,
            n_layers: to_u32("layers", geometry.n_layers)?,
            n_kv_heads: to_u32("KV heads", geometry.n_kv_heads)?,
            head_dim: to_u32("head dimension", geometry.head_dim)?,
            layer: to_u32("layer", layer)?,
            n_heads: to_u32("query heads", n_heads)?,
            scale,
            q: &q,
            block_tables: &tables,
            n_entries: arrays.n_entries,
            width: arrays.width,
            seq_lens: &lens,
            row_live: &live,
            check,
            rows: to_u32("rows in one launch", rows)?,
        };
        // SAFETY: `check_pool` and `check_geometry` (at pool creation) hold
        // the pool to `n_pages * page_elems` values with non-zero dimensions
        // and head_dim <= MAX_HEAD_DIM; above, layer < n_layers, n_heads is a
        // non-zero multiple of n_kv_heads and <= 65535, 1 <= rows <=
        // i32::MAX (`decode_arrays`); `q` and `out` hold rows * n_heads *
        // head_dim values, `lens` and `live` one word per row, `refusals`
        // REFUSAL_WORDS zeroed words per row; `tables` holds two words for
        // each of the n_entries = rows * width entries (`KvBatch::validate`),
        // at least one word. The generation array holds one word per pool page;
        // a shadow has the pool's pages and layout (`check_shadow`: 2 record
        // words and `stride` written words per page) and `owners` one word
        // per row (`owner_words`). All buffers live on this stream.
        self.timed(true, || unsafe {
            result::launch_decode(&self.stream, &self.decode, &args, &mut refusals, &mut out)
        })?;
        let records = self.download(&refusals, "copy the refusal records to the host")?;
        let refusals = decode_refusals(&records, Op::Read, mode, pool.n_pages)?;
        refuse_all(ledger, &refusals);
        let out = self.download(&out, "copy the attention output to the host")?;
        Ok(DecodeOutput { out, refusals })
    }

    /// Stores each token's K and V of `layer` (`n_kv_heads × head_dim` f32
    /// each per token in `k` and `v`, converted to f16 rounding to nearest)
    /// into `pool` where the batch's store slot mapping says, as the CPU
    /// kernels' [`crate::store_kv`] does: padding tokens are skipped; a
    /// store slot whose page or slot is outside the pool is refused always,
    /// then what `check` says (with [`StoreCheck::Shadow`], each store made
    /// sets its written bit in the device shadow). A refused store writes
    /// nothing, and neither do the row's later tokens (its earlier ones are
    /// stored); the row's first refused token comes back as a
    /// [`CudaRefusal`], given to `ledger` too. Rows the ledger has stopped
    /// are skipped. `ledger` is the step's, made for the batch's rows.
    ///
    /// # Errors
    /// Batch arrays that do not fit each other, `k` or `v` of the wrong
    /// length, a layer outside the pool, a shadow or owners that do not fit
    /// the pool and the batch, or a CUDA failure. A refused store is not an
    /// error.
    #[allow(clippy::too_many_arguments)]
    pub fn store_kv(
        &self,
        pool: &mut CudaKvPool,
        layer: usize,
        batch: &KvBatch<'_>,
        k: &[f32],
        v: &[f32],
        check: StoreCheck<'_>,
        ledger: &RowLedger,
    ) -> Result<Vec<CudaRefusal>, CudaError> {
        self.check_pool(pool)?;
        self.finish("an earlier operation")?;
        let geometry = pool.geometry;
        self.check_layer(&geometry, layer)?;
        let arrays = store_arrays(batch, ledger)?;
        let (rows, tokens) = (batch.rows(), batch.tokens());
        let w = geometry.slot_width();
        let total = tokens.checked_mul(w).ok_or(CudaError::TooLarge {
            what: "tokens in one launch",
            value: tokens,
            limit: usize::MAX / w,
        })?;
        for (what, values) in [
            ("K values (tokens × slot width)", k),
            ("V values (tokens × slot width)", v),
        ] {
            if values.len() != total {
                return Err(CudaError::Length {
                    what,
                    len: values.len(),
                    expected: total,
                });
            }
        }
        let owners = match &check {
            StoreCheck::Shadow { shadow, owners } => {
                self.check_shadow(shadow, pool)?;
                Some(owner_words(owners, rows)?)
            }
            StoreCheck::Bounds | StoreCheck::Generations => None,
        };
        if tokens == 0 {
            return Ok(Vec::new());
        }

        let k = self.upload(k, "copy K to the device")?;
        let v = self.upload(v, "copy V to the device")?;
        let slots = self.upload(&arrays.store_slots, "copy the store slots to the device")?;
        let starts = self.upload(&arrays.query_start, "copy the row offsets to the device")?;
        let live = self.upload(&arrays.row_live, "copy live rows to the device")?;
        let owners = owners
            .map(|o| self.upload(&o, "copy row owners to the device"))
            .transpose()?;
        let mut refusals = self
            .stream
            .alloc_zeros::<u32>(REFUSAL_WORDS * rows)
            .map_err(CudaError::driver("allocate the refusal records"))?;
        let n_pages = pool.n_pages;
        let CudaKvPool {
            pages, generations, ..
        } = pool;
        let (check, mode) = match (check, &owners) {
            (StoreCheck::Shadow { shadow, .. }, Some(owners)) => {
                let stride = to_u32("written words per page", shadow.layout.stride)?;
                let CudaKernelShadow { records, bits, .. } = shadow;
                (
                    CheckArgs::Shadow {
                        records: &*records,
                        bits,
                        stride,
                        owners,
                    },
                    MODE_SHADOW,
                )
            }
            (StoreCheck::Generations, _) => {
                (CheckArgs::Generations(&*generations), MODE_GENERATIONS)
            }
            _ => (CheckArgs::Bounds, MODE_BOUNDS),
        };
        let args = StoreLaunch {
            n_pages: to_u32("pages in the pool", n_pages)?,
            page_slots: to_u32("page slots", geometry.page_slots)?,
            n_layers: to_u32("layers", geometry.n_layers)?,
            n_kv_heads: to_u32("KV heads", geometry.n_kv_heads)?,
            head_dim: to_u32("head dimension", geometry.head_dim)?,
            layer: to_u32("layer", layer)?,
            k: &k,
            v: &v,
            store_slots: &slots,
            query_start: &starts,
            row_live: &live,
            check,
            rows: to_u32("rows in one launch", rows)?,
            token_blocks: arrays.token_blocks,
        };
        // SAFETY: the pool holds n_pages * page_elems values with non-zero
        // dimensions (its constructor), layer < n_layers (above), 1 <= rows
        // <= i32::MAX and 1 <= token_blocks <= 256 (`store_arrays`);
        // `query_start` is rows + 1 offsets rising from 0 to `tokens`
        // (`KvBatch::validate`), `slots` three words per token, `k` and `v`
        // tokens * n_kv_heads * head_dim values (checked above, tokens >= 1),
        // `live` one word per row, `refusals` REFUSAL_WORDS zeroed words per
        // row. The generation array holds one word per pool page; a shadow
        // has the pool's pages and layout (`check_shadow`) and `owners` one
        // word per row. All buffers live on this stream.
        self.timed(true, || unsafe {
            result::launch_store(&self.stream, &self.store, args, pages, &mut refusals)
        })?;
        let records = self.download(&refusals, "copy the refusal records to the host")?;
        let refusals = decode_refusals(&records, Op::Store, mode, n_pages)?;
        refuse_all(ledger, &refusals);
        Ok(refusals)
    }

    /// Fills every value of each listed page with [`super::POISON_F16_BITS`]
    /// (a NaN), as a debug build does to freed pages. Other pages and the
    /// generation array are untouched.
    pub fn poison(&self, pool: &mut CudaKvPool, pages: &[PageId]) -> Result<(), CudaError> {
        self.check_pool(pool)?;
        self.finish("an earlier operation")?;
        for page in pages {
            check_page("page to poison", *page, pool.n_pages)?;
        }
        if pages.is_empty() {
            return Ok(());
        }
        let list: Vec<u32> = pages.iter().map(|p| p.0).collect();
        let list = self.upload(&list, "copy the page list to the device")?;
        let n_pages = to_u32("pages in the pool", pool.n_pages)?;
        // SAFETY: the pool holds n_pages * page_elems values (its
        // constructor), the list is non-empty, and all buffers live on this
        // stream's context.
        unsafe {
            result::launch_poison(
                &self.stream,
                &self.poison,
                &mut pool.pages,
                pool.page_elems as u64,
                n_pages,
                &list,
            )
        }?;
        self.finish("poison pages")
    }

    /// Copies page `from` of `src` over page `to` of `dst` for every pair:
    /// the device side of a KV transfer. Both pools need the same page size;
    /// a destination page may appear once. Generations are not copied (the
    /// receiving pool's owner sets them).
    pub fn copy_pages(
        &self,
        src: &CudaKvPool,
        dst: &mut CudaKvPool,
        pairs: &[(PageId, PageId)],
    ) -> Result<(), CudaError> {
        self.check_pool(src)?;
        self.check_pool(dst)?;
        self.finish("an earlier operation")?;
        if src.page_elems != dst.page_elems {
            return Err(CudaError::PageSizeMismatch {
                src_elems: src.page_elems,
                dst_elems: dst.page_elems,
            });
        }
        let mut seen = HashSet::with_capacity(pairs.len());
        let mut words = Vec::with_capacity(pairs.len() * 2);
        for &(from, to) in pairs {
            check_page("source page to copy", from, src.n_pages)?;
            check_page("destination page to copy", to, dst.n_pages)?;
            if !seen.insert(to) {
                return Err(CudaError::DuplicateDestination { page: to });
            }
            words.push(from.0);
            words.push(to.0);
        }
        if pairs.is_empty() {
            return Ok(());
        }
        let list = self.upload(&words, "copy the page pairs to the device")?;
        let src_pages = to_u32("pages in the source pool", src.n_pages)?;
        let dst_pages = to_u32("pages in the destination pool", dst.n_pages)?;
        // SAFETY: each pool holds n_pages * page_elems values (its
        // constructor) with equal page_elems (checked above); `src` and `dst`
        // are different allocations (a shared and an exclusive borrow); the
        // list is non-empty, even, and names no destination twice; all
        // buffers live on this device.
        unsafe {
            result::launch_copy(
                &self.stream,
                &self.copy,
                result::CopyLaunch {
                    src: &src.pages,
                    src_pages,
                    dst: &mut dst.pages,
                    dst_pages,
                    page_elems: src.page_elems as u64,
                    pairs: &list,
                },
            )
        }?;
        self.finish("copy pages")
    }

    /// Checks an engine's own kernel arguments — the device buffers it is
    /// about to hand its attention or store kernel — against the device
    /// shadow, one row per entry of `owners` (the request of each row), for
    /// `layers` (see [`EngineBatch`] for the layouts and the rules). Launch
    /// it on the engine's device just before the engine's kernel, with the
    /// shadow uploaded after the last hook that changed it; it waits for
    /// the check to finish. Comes back
    /// with one [`EngineRefusal`] per refused row, by row (an empty list:
    /// every access may be made). With `record`, a store layout's slots it
    /// let through are marked written in the device shadow (for every
    /// checked layer), as the host's `check_slot_mapping` records the
    /// writes it checked; bring them back with
    /// [`CudaKernelShadow::download_written`].
    ///
    /// # Errors
    /// Per-row buffers without one entry per row (offsets: one more),
    /// layers empty or outside the shadow's, a shadow on another device,
    /// more rows than one launch takes, or a CUDA failure. A refused row is
    /// not an error.
    pub fn check_engine_batch(
        &self,
        shadow: &mut CudaKernelShadow,
        owners: &[RequestId],
        batch: &EngineBatch<'_>,
        layers: Range<u32>,
        record: bool,
    ) -> Result<Vec<EngineRefusal>, CudaError> {
        if shadow.ordinal() != self.ordinal() {
            return Err(CudaError::WrongDevice {
                pool_device: shadow.ordinal(),
                kernels_device: self.ordinal(),
            });
        }
        self.finish("an earlier operation")?;
        let rows = owners.len();
        check_rows(batch, rows)?;
        let shadow_layers = shadow.layout.layers;
        if layers.is_empty() || layers.end > shadow_layers {
            return Err(CudaError::OutOfRange {
                what: "end of the checked layers (and above their start)",
                value: layers.end as usize,
                limit: shadow_layers as usize + 1,
            });
        }
        if rows == 0 {
            return Ok(Vec::new());
        }
        let n_rows = u32::try_from(rows)
            .ok()
            .filter(|&r| r as usize <= batch::MAX_ROWS)
            .ok_or(CudaError::TooLarge {
                what: "rows in one launch",
                value: rows,
                limit: batch::MAX_ROWS,
            })?;
        let owners = self.upload(&owner_words(owners, rows)?, "copy row owners to the device")?;
        let mut refusals = self
            .stream
            .alloc_zeros::<u32>(REFUSAL_WORDS * rows)
            .map_err(CudaError::driver("allocate the refusal records"))?;
        let layout = batch.layout();
        let func = match layout {
            BatchLayout::BlockTable => &self.check_block_table,
            BatchLayout::PagedCsr => &self.check_paged_csr,
            BatchLayout::ReqToToken => &self.check_req_to_token,
            BatchLayout::SlotMapping => &self.check_slot_mapping,
        };
        let mut found = Vec::new();
        // A recording check looks first and records only if every row's
        // buffers were usable (`may_record`).
        for pass in [false, true] {
            if pass && !(record && may_record(&found)) {
                break;
            }
            if pass {
                self.stream
                    .memset_zeros(&mut refusals)
                    .map_err(CudaError::driver("clear the refusal records"))?;
            }
            let args = CheckLaunch {
                func,
                record: pass,
                shadow: &mut *shadow,
                owners: &owners,
                rows: n_rows,
                layers: layers.clone(),
                batch,
            };
            // SAFETY: rows >= 1; `check_rows` held every per-row buffer to
            // its rows; `owners` holds one word per row and `refusals`
            // REFUSAL_WORDS zeroed words per row; the layers are non-empty
            // and end within the shadow's layout; the shadow is on this
            // device, and the engine's buffers are views on it (the
            // caller's).
            self.timed(!pass, || unsafe {
                launch_check(&self.stream, args, &mut refusals)
            })?;
            self.finish("check an engine's kernel arguments")?;
            let records = self.download(&refusals, "copy the check records to the host")?;
            found = decode_engine_refusals(&records, layout)?;
        }
        Ok(found)
    }

    /// Refuses, before any kernel reads it, an engine's buffer `what` of
    /// `bytes` bytes at device address `address` that is not wholly inside
    /// one allocation of this device (a host pointer, a freed or made-up
    /// address, a length past the allocation's end, another device's
    /// memory): a kernel reading it would fault and poison the context the
    /// engine shares.
    ///
    /// # Errors
    /// [`CudaError::NotDeviceMemory`], [`CudaError::OutsideAllocation`].
    pub fn check_device_buffer(
        &self,
        what: &'static str,
        address: u64,
        bytes: u64,
    ) -> Result<(), CudaError> {
        self.stream
            .context()
            .bind_to_thread()
            .map_err(CudaError::driver("make the context current"))?;
        let (start, size, ordinal) =
            result::allocation_of(address).map_err(|source| CudaError::NotDeviceMemory {
                what,
                address,
                ordinal: self.ordinal(),
                source,
            })?;
        let end = start.saturating_add(size);
        if usize::try_from(ordinal).ok() != Some(self.ordinal()) {
            return Err(CudaError::WrongDevice {
                pool_device: usize::try_from(ordinal).unwrap_or(usize::MAX),
                kernels_device: self.ordinal(),
            });
        }
        if address < start || address.saturating_add(bytes) > end {
            return Err(CudaError::OutsideAllocation {
                what,
                address,
                bytes,
                start,
                size,
            });
        }
        Ok(())
    }

    /// An engine's own device allocation, `len` values of `T` at device
    /// address `ptr` on this device, as a buffer of this stream — for
    /// [`EngineBatch`]'s views. It is never freed by kvsan: the
    /// `ManuallyDrop` must not be dropped into (the memory is the engine's).
    ///
    /// # Safety
    /// `ptr` is a live allocation of this device's primary context holding
    /// at least `len` values of `T`, and stays one while the buffer is used.
    pub unsafe fn borrow_device<T>(&self, ptr: u64, len: usize) -> ManuallyDrop<CudaSlice<T>> {
        // SAFETY: the caller's contract; never dropped, so never freed.
        ManuallyDrop::new(unsafe { self.stream.upgrade_device_ptr(ptr, len) })
    }

    /// The engine's device buffers of `batch` as slices over its own
    /// allocations ([`Self::borrow_device`] each), for [`super::views`]
    /// and [`Self::copy_batch_to_host`].
    ///
    /// # Safety
    /// As [`Self::borrow_device`] for every buffer of `batch`.
    #[must_use]
    pub unsafe fn borrow_batch(&self, batch: &Batch<Addresses>) -> Batch<Borrowed> {
        struct Borrow<'k>(&'k CudaKernels);
        impl MapBuffers<'_, Addresses, Borrowed> for Borrow<'_> {
            type Error = Infallible;
            fn i32(
                &mut self,
                _: Array,
                from: &DeviceArray,
            ) -> Result<ManuallyDrop<CudaSlice<i32>>, Infallible> {
                // SAFETY: `borrow_batch`'s caller's contract.
                Ok(unsafe { self.0.borrow_device(from.address, from.len) })
            }
            fn i64(
                &mut self,
                _: Array,
                from: &DeviceArray,
            ) -> Result<ManuallyDrop<CudaSlice<i64>>, Infallible> {
                // SAFETY: `borrow_batch`'s caller's contract.
                Ok(unsafe { self.0.borrow_device(from.address, from.len) })
            }
        }
        let Ok(borrowed) = batch.try_map(&mut Borrow(self));
        borrowed
    }

    /// Host copies of a borrowed batch's buffers.
    ///
    /// # Errors
    /// A CUDA failure.
    pub fn copy_batch_to_host(&self, batch: &Batch<Borrowed>) -> Result<Batch<Owned>, CudaError> {
        struct ToHost<'k>(&'k CudaKernels);
        impl MapBuffers<'_, Borrowed, Owned> for ToHost<'_> {
            type Error = CudaError;
            fn i32(
                &mut self,
                _: Array,
                from: &ManuallyDrop<CudaSlice<i32>>,
            ) -> Result<Vec<i32>, CudaError> {
                self.0.copy_to_host(from)
            }
            fn i64(
                &mut self,
                _: Array,
                from: &ManuallyDrop<CudaSlice<i64>>,
            ) -> Result<Vec<i64>, CudaError> {
                self.0.copy_to_host(from)
            }
        }
        batch.try_map(&mut ToHost(self))
    }

    /// Waits until all work queued on the device by anyone in this process
    /// has finished (an engine's writes to the buffers it then hands
    /// [`CudaKernels::check_engine_batch`], on its own streams).
    ///
    /// # Errors
    /// A CUDA failure, of this work or of the work waited for.
    pub fn synchronize_device(&self) -> Result<(), CudaError> {
        self.stream
            .context()
            .synchronize()
            .map_err(CudaError::driver("wait for the device"))?;
        self.finish("wait for the device")
    }

    /// A device buffer's values, copied to the host.
    ///
    /// # Errors
    /// A CUDA failure.
    pub fn copy_to_host<T: cudarc::driver::DeviceRepr>(
        &self,
        device: &CudaSlice<T>,
    ) -> Result<Vec<T>, CudaError> {
        self.download(device, "copy a device buffer to the host")
    }

    fn check_layer(&self, geometry: &KvGeometry, layer: usize) -> Result<(), CudaError> {
        if layer < geometry.n_layers {
            Ok(())
        } else {
            Err(CudaError::OutOfRange {
                what: "layer",
                value: layer,
                limit: geometry.n_layers,
            })
        }
    }

    /// Refuses a device shadow of another device or another geometry than `pool`.
    fn check_shadow(&self, shadow: &CudaKernelShadow, pool: &CudaKvPool) -> Result<(), CudaError> {
        if shadow.ordinal() != self.ordinal() {
            return Err(CudaError::WrongDevice {
                pool_device: shadow.ordinal(),
                kernels_device: self.ordinal(),
            });
        }
        shadow.check_pool(pool)
    }

    fn check_pool(&self, pool: &CudaKvPool) -> Result<(), CudaError> {
        // Contexts are the devices' primary contexts: one per ordinal.
        if pool.ordinal() == self.ordinal() {
            Ok(())
        } else {
            Err(CudaError::WrongDevice {
                pool_device: pool.ordinal(),
                kernels_device: self.ordinal(),
            })
        }
    }

    fn upload<T: cudarc::driver::DeviceRepr>(
        &self,
        host: &[T],
        op: &'static str,
    ) -> Result<CudaSlice<T>, CudaError> {
        self.stream.clone_htod(host).map_err(CudaError::driver(op))
    }

    fn download<T: cudarc::driver::DeviceRepr>(
        &self,
        device: &CudaSlice<T>,
        op: &'static str,
    ) -> Result<Vec<T>, CudaError> {
        let host = self
            .stream
            .clone_dtoh(device)
            .map_err(CudaError::driver(op))?;
        self.finish(op)?;
        Ok(host)
    }

    /// Waits for the stream; returns its error or one recorded earlier in a
    /// `Drop` (cudarc's sticky slot).
    fn finish(&self, op: &'static str) -> Result<(), CudaError> {
        self.stream.synchronize().map_err(CudaError::driver(op))?;
        self.stream
            .context()
            .check_err()
            .map_err(CudaError::driver("an earlier CUDA call (recorded error)"))
    }
}

/// Compiles `source` for `target` and loads it into `ctx`.
fn load(
    ctx: &Arc<CudaContext>,
    source: &CudaSource,
    target: CompileTarget,
) -> Result<Arc<CudaModule>, CudaError> {
    let compiled = compile(source, target)?;
    ctx.load_module(Ptx::from_binary(compiled.image))
        .map_err(CudaError::driver("load a compiled module"))
}

fn function(module: &Arc<CudaModule>, name: &'static str) -> Result<CudaFunction, CudaError> {
    module
        .load_function(name)
        .map_err(CudaError::driver("find a kernel in its module"))
}

/// Checks the geometry the kernels support; returns values per page.
fn check_geometry(geometry: &KvGeometry) -> Result<usize, CudaError> {
    for (what, value) in [
        ("page_slots", geometry.page_slots),
        ("n_layers", geometry.n_layers),
        ("n_kv_heads", geometry.n_kv_heads),
        ("head_dim", geometry.head_dim),
    ] {
        if value == 0 {
            return Err(CudaError::ZeroDimension { what });
        }
        to_u32(what, value)?;
    }
    if geometry.head_dim > MAX_HEAD_DIM {
        return Err(CudaError::TooLarge {
            what: "head dimension",
            value: geometry.head_dim,
            limit: MAX_HEAD_DIM,
        });
    }
    page_elems(geometry)
}

fn check_page(what: &'static str, page: PageId, n_pages: usize) -> Result<(), CudaError> {
    if (page.0 as usize) < n_pages {
        Ok(())
    } else {
        Err(CudaError::OutOfRange {
            what,
            value: page.0 as usize,
            limit: n_pages,
        })
    }
}

fn to_u32(what: &'static str, value: usize) -> Result<u32, CudaError> {
    u32::try_from(value).map_err(|_| CudaError::TooLarge {
        what,
        value,
        limit: u32::MAX as usize,
    })
}
