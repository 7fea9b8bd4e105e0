//! [`CudaKernels`]: the kernels compiled and loaded on one device, and the
//! safe entry points that check every input before a launch.

use std::collections::HashSet;
use std::sync::Arc;

use cudarc::driver::{CudaContext, CudaFunction, CudaModule, CudaSlice, CudaStream};
use cudarc::nvrtc::Ptx;
use half::f16;
use kvsan_sanitizer::{Generation, PageId};

use super::error::CudaError;
use super::pool::{CudaKvPool, page_elems};
use super::result::{
    self, CompileTarget, DecodeLaunch, compile, driver_present, nvrtc_present, supported_archs,
};
use super::source::{
    COPY_KERNEL, CudaSource, DECODE_KERNEL, ERROR_WORDS, MAX_HEAD_DIM, PAGED_ATTENTION, PAGES,
    POISON_KERNEL, STATUS_GENERATION, STATUS_OK, STATUS_OUT_OF_RANGE,
};
use crate::attention::{DecodeSeq, KvGeometry};
use crate::error::KernelError;

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
    poison: CudaFunction,
    copy: CudaFunction,
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
        let kernels = CudaKernels {
            stream: ctx.default_stream(),
            target,
            compute_capability: (major, minor),
            decode: function(&attention, DECODE_KERNEL)?,
            poison: function(&pages, POISON_KERNEL)?,
            copy: function(&pages, COPY_KERNEL)?,
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
        // SAFETY: the memory is left unset on purpose (see above). Every bit
        // pattern is a valid f16, so copying any of it to the host is sound;
        // the kernels read it only as f16 values.
        let pages = unsafe { self.stream.alloc::<u16>(total) }
            .map_err(CudaError::driver("allocate the pool"))?;
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

    /// Batched paged-attention decode of `layer` over `pool`: for each
    /// sequence, each of `n_heads` query heads attends over the sequence's
    /// `seq_len` tokens, read through its block table. Returns
    /// `seqs.len() × n_heads × head_dim` values, sequence-major.
    ///
    /// With `checked`, the kernel compares every block-table generation with
    /// the pool's generation array before reading a page, reads nothing of a
    /// sequence with a stale entry, and this returns
    /// [`KernelError::GenerationMismatch`] for the first such sequence
    /// (lowest index) and its first stale entry, as the CPU kernels'
    /// `paged_attention_decode_checked` does. A page outside the pool is
    /// refused ([`KernelError::PageOutOfRange`]) whether checked or not;
    /// a block table too short for its sequence is refused before launch.
    /// Queries are rounded to f16 before the dot products, as on the CPU.
    pub fn decode_attention(
        &self,
        pool: &CudaKvPool,
        layer: usize,
        n_heads: usize,
        scale: f32,
        seqs: &[DecodeSeq<'_>],
        checked: bool,
    ) -> Result<Vec<f32>, CudaError> {
        self.check_pool(pool)?;
        self.finish("an earlier operation")?;
        let geometry = &pool.geometry;
        let head_dim = geometry.head_dim;
        if layer >= geometry.n_layers {
            return Err(CudaError::OutOfRange {
                what: "layer",
                value: layer,
                limit: geometry.n_layers,
            });
        }
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
        if seqs.is_empty() {
            return Ok(Vec::new());
        }
        let n_seqs = to_u32("sequences in one decode call", seqs.len())?;

        let q_len = n_heads * head_dim;
        let mut q = Vec::with_capacity(seqs.len() * q_len);
        let mut tables = Vec::new();
        let mut offsets = Vec::with_capacity(seqs.len());
        let mut lens = Vec::with_capacity(seqs.len());
        for (seq, s) in seqs.iter().enumerate() {
            if s.q.len() != q_len {
                return Err(CudaError::Length {
                    what: "a sequence's query (n_heads * head_dim)",
                    len: s.q.len(),
                    expected: q_len,
                });
            }
            let pages_needed = s.seq_len.div_ceil(geometry.page_slots);
            if s.block_table.len() < pages_needed {
                return Err(KernelError::BlockTableTooShort {
                    seq,
                    seq_len: s.seq_len,
                    pages_needed,
                    block_table_len: s.block_table.len(),
                }
                .into());
            }
            offsets.push(to_u32(
                "block-table entries in one decode call",
                tables.len() / 2,
            )?);
            lens.push(to_u32("sequence length", s.seq_len)?);
            // Pages outside the pool are refused by the kernel, in the same
            // order as generation mismatches (first sequence, first entry),
            // as the CPU kernels do.
            for entry in &s.block_table[..pages_needed] {
                tables.push(entry.page.0);
                tables.push(entry.generation.0);
            }
            q.extend_from_slice(s.q);
        }
        to_u32("block-table entries in one decode call", tables.len() / 2)?;
        if tables.is_empty() {
            // Every sequence is empty; the kernel still needs a valid buffer.
            tables.extend([0, 0]);
        }

        let q = self.upload(&q, "copy queries to the device")?;
        let tables = self.upload(&tables, "copy block tables to the device")?;
        let offsets = self.upload(&offsets, "copy block-table offsets to the device")?;
        let lens = self.upload(&lens, "copy sequence lengths to the device")?;
        let mut errors = self
            .stream
            .alloc_zeros::<u32>(ERROR_WORDS * seqs.len())
            .map_err(CudaError::driver("allocate the error records"))?;
        let mut out = self
            .stream
            .alloc_zeros::<f32>(seqs.len() * q_len)
            .map_err(CudaError::driver("allocate the attention output"))?;
        let args = DecodeLaunch {
            pool: &pool.pages,
            generations: &pool.generations,
            n_pages: to_u32("pages in the pool", pool.n_pages)?,
            page_slots: to_u32("page slots", geometry.page_slots)?,
            n_layers: to_u32("layers", geometry.n_layers)?,
            n_kv_heads: to_u32("KV heads", geometry.n_kv_heads)?,
            head_dim: to_u32("head dimension", head_dim)?,
            layer: to_u32("layer", layer)?,
            n_heads: to_u32("query heads", n_heads)?,
            scale,
            q: &q,
            block_tables: &tables,
            table_offsets: &offsets,
            seq_lens: &lens,
            checked: u32::from(checked),
            n_seqs,
        };
        // SAFETY: `check_pool` and `check_geometry` (at pool creation) hold
        // the pool to `n_pages * page_elems` values with non-zero dimensions
        // and head_dim <= MAX_HEAD_DIM; above, layer < n_layers, n_heads is a
        // non-zero multiple of n_kv_heads and <= 65535, n_seqs >= 1; `q` and
        // `out` hold n_seqs * n_heads * head_dim values, `errors` ERROR_WORDS
        // zeroed words per sequence; each sequence's table offset plus
        // ceil(seq_len / page_slots) entries lie inside `tables`, which was
        // built from exactly those entries. All buffers live on this stream.
        unsafe { result::launch_decode(&self.stream, &self.decode, &args, &mut errors, &mut out) }?;
        let records = self.download(&errors, "copy the error records to the host")?;
        for (seq, record) in records.chunks_exact(ERROR_WORDS).enumerate() {
            let (status, index, page) = (record[0], record[1] as usize, PageId(record[2]));
            match status {
                STATUS_OK => {}
                STATUS_GENERATION => {
                    return Err(KernelError::GenerationMismatch {
                        seq,
                        index,
                        page,
                        found: Generation(record[3]),
                        current: Generation(record[4]),
                    }
                    .into());
                }
                STATUS_OUT_OF_RANGE => {
                    return Err(KernelError::PageOutOfRange {
                        seq,
                        index,
                        page,
                        n_pages: pool.n_pages,
                    }
                    .into());
                }
                status => return Err(CudaError::CorruptErrorRecord { seq, status }),
            }
        }
        self.download(&out, "copy the attention output to the host")
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
