//! [`CudaKvPool`]: a KV page pool in device memory, with its per-page
//! generation array next to it.

use std::mem::ManuallyDrop;
use std::sync::Arc;

use cudarc::driver::{CudaSlice, CudaStream};
use half::f16;
use half::slice::HalfFloatSliceExt;
use half::vec::HalfBitsVecExt;
use kvsan_ids::{Generation, PageId};

use super::error::CudaError;
use crate::attention::KvGeometry;

/// A KV page pool on one CUDA device: `n_pages` pages of f16 values in the
/// layout of [`KvGeometry`], and one [`Generation`] per page for the
/// in-kernel tag check.
///
/// ```text
///  pages       = page 0 | page 1 | ... | page n_pages-1     (f16, device)
///  page        = [layer][K=0 | V=1][slot][kv_head][head_dim]
///  generations = gen 0 | gen 1 | ... | gen n_pages-1        (u32, device)
/// ```
///
/// Created by [`super::CudaKernels::alloc_pool`] (pages uninitialised, as an
/// engine's pool is: pages are never zeroed) or
/// [`super::CudaKernels::upload_pool`]; the pages are one plain allocation
/// (cuMemAlloc), which tools such as compute-sanitizer see as an allocation
/// of its own. Dropping it frees the device memory; a failure there goes to
/// the context's sticky error slot, which the next [`super::CudaKernels`]
/// operation returns.
#[derive(Debug)]
pub struct CudaKvPool {
    pub(super) geometry: KvGeometry,
    pub(super) n_pages: usize,
    pub(super) page_elems: usize,
    /// A plain allocation (cuMemAlloc) seen as a slice; freed by `Drop`.
    pub(super) pages: ManuallyDrop<CudaSlice<u16>>,
    /// The pages described to NVTX ([`CudaKvPool::attach_nvtx`]); dropped
    /// (its heap unregistered) before the memory is freed.
    #[cfg(feature = "nvtx")]
    pub(super) nvtx: Option<super::NvtxPool>,
    pub(super) generations: CudaSlice<u32>,
    pub(super) stream: Arc<CudaStream>,
}

impl Drop for CudaKvPool {
    fn drop(&mut self) {
        // The NVTX heap goes first: a tool refuses to unregister a heap
        // whose memory is gone.
        #[cfg(feature = "nvtx")]
        drop(self.nvtx.take());
        // SAFETY: `pages` is not used after this.
        let pages = unsafe { ManuallyDrop::take(&mut self.pages) };
        // `leak` waits for the work that used the slice; then the plain
        // allocation goes back with cuMemFree (after the stream's work),
        // its errors to the context's sticky slot.
        let ptr = pages.leak();
        let ctx = self.stream.context();
        ctx.record_err(self.stream.synchronize());
        // SAFETY: `ptr` is the pool's own cuMemAlloc allocation
        // (`CudaKernels::alloc_pool`), no longer used by any queued work.
        ctx.record_err(unsafe { cudarc::driver::result::free_sync(ptr) });
    }
}

/// Values in one page of `geometry`, or an error if that overflows.
pub(super) fn page_elems(geometry: &KvGeometry) -> Result<usize, CudaError> {
    [
        geometry.n_layers,
        2,
        geometry.page_slots,
        geometry.n_kv_heads,
        geometry.head_dim,
    ]
    .into_iter()
    .try_fold(1usize, |acc, n| acc.checked_mul(n))
    .ok_or(CudaError::TooLarge {
        what: "values per page",
        value: usize::MAX,
        limit: usize::MAX,
    })
}

impl CudaKvPool {
    /// The pool's geometry.
    pub fn geometry(&self) -> &KvGeometry {
        &self.geometry
    }

    /// Pages in the pool.
    pub fn n_pages(&self) -> usize {
        self.n_pages
    }

    /// f16 values per page.
    pub fn page_elems(&self) -> usize {
        self.page_elems
    }

    /// Where the pages lie in device memory, as one NVTX plane (feature
    /// `nvtx`): page `p` at `base + p·page_stride`, `page_bytes` long.
    #[cfg(feature = "nvtx")]
    pub fn nvtx_plane(&self) -> super::NvtxPlane {
        use cudarc::driver::DevicePtr;
        let (base, _sync) = self.pages.device_ptr(&self.stream);
        let page_bytes = (self.page_elems * std::mem::size_of::<u16>()) as u64;
        super::NvtxPlane {
            base,
            page_stride: page_bytes,
            page_bytes,
        }
    }

    /// Describes the pool's pages to NVTX under `name` ([`super::NvtxPool`]:
    /// one heap, the whole allocation; no page held yet), for
    /// compute-sanitizer; keep the regions in step with
    /// [`CudaKvPool::nvtx_mut`]'s `sync` after the hooks that allocate and
    /// free pages. A tool takes one description per allocation: a second
    /// call keeps the first.
    ///
    /// # Errors
    /// A name with a NUL byte.
    #[cfg(feature = "nvtx")]
    pub fn attach_nvtx(&mut self, name: &str) -> Result<&mut super::NvtxPool, CudaError> {
        if self.nvtx.is_none() {
            self.nvtx = Some(super::NvtxPool::new(
                name,
                &[self.nvtx_plane()],
                self.n_pages,
            )?);
        }
        Ok(self.nvtx.as_mut().expect("set just above"))
    }

    /// The pool's NVTX description, if [`CudaKvPool::attach_nvtx`] made one.
    #[cfg(feature = "nvtx")]
    pub fn nvtx(&self) -> Option<&super::NvtxPool> {
        self.nvtx.as_ref()
    }

    /// The pool's NVTX description, to sync and bind.
    #[cfg(feature = "nvtx")]
    pub fn nvtx_mut(&mut self) -> Option<&mut super::NvtxPool> {
        self.nvtx.as_mut()
    }

    /// Ordinal of the device the pool lives on.
    pub fn ordinal(&self) -> usize {
        self.stream.context().ordinal()
    }

    fn check_page(&self, what: &'static str, page: PageId) -> Result<usize, CudaError> {
        let index = page.0 as usize;
        if index < self.n_pages {
            Ok(index)
        } else {
            Err(CudaError::OutOfRange {
                what,
                value: index,
                limit: self.n_pages,
            })
        }
    }

    /// Overwrites whole pages from `first` on with `data` (a whole number of
    /// pages).
    pub fn upload_pages(&mut self, first: PageId, data: &[f16]) -> Result<(), CudaError> {
        let start = self.check_page("first page to upload", first)?;
        if !data.len().is_multiple_of(self.page_elems) {
            return Err(CudaError::Length {
                what: "page data to upload",
                len: data.len(),
                expected: data.len().next_multiple_of(self.page_elems),
            });
        }
        let count = data.len() / self.page_elems;
        if start + count > self.n_pages {
            return Err(CudaError::OutOfRange {
                what: "last page to upload",
                value: start + count - 1,
                limit: self.n_pages,
            });
        }
        let begin = start * self.page_elems;
        let mut dst = self.pages.slice_mut(begin..begin + data.len());
        self.stream
            .memcpy_htod(data.reinterpret_cast(), &mut dst)
            .map_err(CudaError::driver("copy pages to the device"))?;
        self.finish("copy pages to the device")
    }

    /// Every page, copied to the host.
    pub fn download(&self) -> Result<Vec<f16>, CudaError> {
        let bits = self
            .stream
            .clone_dtoh(&*self.pages)
            .map_err(CudaError::driver("copy the pool to the host"))?;
        self.finish("copy the pool to the host")?;
        Ok(bits.reinterpret_into())
    }

    /// One page, copied to the host.
    pub fn download_page(&self, page: PageId) -> Result<Vec<f16>, CudaError> {
        let index = self.check_page("page to download", page)?;
        let begin = index * self.page_elems;
        let view = self.pages.slice(begin..begin + self.page_elems);
        let bits = self
            .stream
            .clone_dtoh(&view)
            .map_err(CudaError::driver("copy a page to the host"))?;
        self.finish("copy a page to the host")?;
        Ok(bits.reinterpret_into())
    }

    /// Replaces the whole generation array (one entry per page).
    pub fn upload_generations(&mut self, generations: &[Generation]) -> Result<(), CudaError> {
        if generations.len() != self.n_pages {
            return Err(CudaError::Length {
                what: "generation array",
                len: generations.len(),
                expected: self.n_pages,
            });
        }
        let words: Vec<u32> = generations.iter().map(|g| g.0).collect();
        self.stream
            .memcpy_htod(&words, &mut self.generations)
            .map_err(CudaError::driver("copy generations to the device"))?;
        self.finish("copy generations to the device")
    }

    /// Sets one page's generation (as an allocation does).
    pub fn set_generation(
        &mut self,
        page: PageId,
        generation: Generation,
    ) -> Result<(), CudaError> {
        let index = self.check_page("page whose generation to set", page)?;
        let mut dst = self.generations.slice_mut(index..index + 1);
        self.stream
            .memcpy_htod(&[generation.0], &mut dst)
            .map_err(CudaError::driver("copy a generation to the device"))?;
        self.finish("copy a generation to the device")
    }

    /// The generation array, copied to the host.
    pub fn generations(&self) -> Result<Vec<Generation>, CudaError> {
        let words = self
            .stream
            .clone_dtoh(&self.generations)
            .map_err(CudaError::driver("copy generations to the host"))?;
        self.finish("copy generations to the host")?;
        Ok(words.into_iter().map(Generation).collect())
    }

    /// Waits for the pool's stream and returns any error recorded so far,
    /// including ones recorded in `Drop` of earlier device buffers.
    fn finish(&self, op: &'static str) -> Result<(), CudaError> {
        self.stream.synchronize().map_err(CudaError::driver(op))?;
        self.stream
            .context()
            .check_err()
            .map_err(CudaError::driver("an earlier CUDA call (recorded error)"))
    }
}
