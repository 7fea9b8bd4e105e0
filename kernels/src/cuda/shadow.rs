//! [`CudaKernelShadow`]: the sanitizer's kernel shadow of one pool, copied
//! to the device, where the batch kernels check it in place.

use std::sync::Arc;

use cudarc::driver::{CudaFunction, CudaSlice, CudaStream};
use kvsan_ids::{PageId, PageRef};
use kvsan_sanitizer::KernelShadow;
use kvsan_sanitizer::shadow::BitLayout;

use super::error::CudaError;
use super::pool::CudaKvPool;
use super::result;

/// A device copy of a pool's kernel shadow ([`KernelShadow`]): per page its
/// state word and owner request, and its written words in the same packed
/// layer-major layout.
///
/// ```text
///  records = page 0: state word | owner | page 1: state word | owner | ...   (u64)
///  bits    = page 0: stride words       | page 1: stride words       | ...   (u64)
///            bit layer·page_slots + slot: the slot was written for the layer
/// ```
///
/// The host keeps it in step: after the hooks that change a page's record
/// or clear its bits (alloc, free, share, transfer receipt and commit, a
/// request's end) it uploads those pages ([`CudaKernelShadow::upload`])
/// before the next launch that must see them; after a store launch it
/// brings the bits the device set back ([`CudaKernelShadow::download_written`]),
/// where the sanitizer's host-side hooks and reports see them. The records'
/// "first write seen" flag and first-write step are the host's alone: the
/// download notes them (`KernelShadow::merge_bits`).
///
/// Created by [`super::CudaKernels::upload_shadow`]. Dropping it frees the
/// device memory (a failure there goes to the context's sticky error slot).
#[derive(Debug)]
pub struct CudaKernelShadow {
    pub(super) pages: usize,
    pub(super) layout: BitLayout,
    pub(super) records: CudaSlice<u64>,
    pub(super) bits: CudaSlice<u64>,
    pub(super) scatter: CudaFunction,
    pub(super) gather: CudaFunction,
    pub(super) stream: Arc<CudaStream>,
}

/// The words a device shadow needs for `pages` pages of `layout`:
/// `(records, bits)`, or an error if that overflows.
pub(super) fn shadow_words(pages: usize, layout: &BitLayout) -> Result<(usize, usize), CudaError> {
    let too_large = || CudaError::TooLarge {
        what: "pages in a device kernel shadow",
        value: pages,
        limit: usize::MAX / (2 + layout.stride),
    };
    let records = pages.checked_mul(2).ok_or_else(too_large)?;
    let bits = pages.checked_mul(layout.stride).ok_or_else(too_large)?;
    Ok((records, bits))
}

impl CudaKernelShadow {
    /// Pages shadowed.
    pub fn pages(&self) -> usize {
        self.pages
    }

    /// The written bits' layout (page slots, layers, words per page).
    pub fn layout(&self) -> &BitLayout {
        &self.layout
    }

    /// Ordinal of the device the shadow lives on.
    pub fn ordinal(&self) -> usize {
        self.stream.context().ordinal()
    }

    /// Refuses a host shadow of another geometry.
    fn check_host(&self, host: &KernelShadow<'_>) -> Result<(), CudaError> {
        let other = "host shadow";
        let layout = host.layout();
        for (what, shadow, expected) in [
            ("pages", self.pages, host.pages()),
            (
                "page slots",
                self.layout.page_slots as usize,
                layout.page_slots as usize,
            ),
            (
                "layers",
                self.layout.layers as usize,
                layout.layers as usize,
            ),
            ("words per page", self.layout.stride, layout.stride),
        ] {
            if shadow != expected {
                return Err(CudaError::ShadowGeometry {
                    what,
                    shadow,
                    other,
                    expected,
                });
            }
        }
        Ok(())
    }

    /// Refuses a pool of another geometry (pages, page slots, layers) or on
    /// another device.
    pub(super) fn check_pool(&self, pool: &CudaKvPool) -> Result<(), CudaError> {
        if pool.ordinal() != self.ordinal() {
            return Err(CudaError::WrongDevice {
                pool_device: pool.ordinal(),
                kernels_device: self.ordinal(),
            });
        }
        let geometry = pool.geometry();
        let other = "pool";
        for (what, shadow, expected) in [
            ("pages", self.pages, pool.n_pages()),
            (
                "page slots",
                self.layout.page_slots as usize,
                geometry.page_slots,
            ),
            ("layers", self.layout.layers as usize, geometry.n_layers),
        ] {
            if shadow != expected {
                return Err(CudaError::ShadowGeometry {
                    what,
                    shadow,
                    other,
                    expected,
                });
            }
        }
        Ok(())
    }

    fn check_page(&self, what: &'static str, page: PageId) -> Result<(), CudaError> {
        if (page.0 as usize) < self.pages {
            Ok(())
        } else {
            Err(CudaError::OutOfRange {
                what,
                value: page.0 as usize,
                limit: self.pages,
            })
        }
    }

    fn stride_u32(&self) -> Result<u32, CudaError> {
        to_u32("written words per page", self.layout.stride)
    }

    /// Copies the listed pages' records and written words from `host` (the
    /// same pool's shadow) to the device: after the host-side hooks that
    /// changed them. A page listed twice is copied once.
    ///
    /// # Errors
    /// A host shadow of another geometry, a page outside the pool, or a
    /// CUDA failure.
    pub fn upload(&mut self, host: &KernelShadow<'_>, pages: &[PageId]) -> Result<(), CudaError> {
        self.check_host(host)?;
        for &page in pages {
            self.check_page("page to upload to the device shadow", page)?;
        }
        let mut list: Vec<u32> = pages.iter().map(|p| p.0).collect();
        list.sort_unstable();
        list.dedup();
        if list.is_empty() {
            return Ok(());
        }
        let stride = self.layout.stride;
        let mut packed = Vec::with_capacity(list.len() * (2 + stride));
        for &page in &list {
            let (word, owner) = host
                .record_words(PageId(page))
                .ok_or(CudaError::OutOfRange {
                    what: "page to upload to the device shadow",
                    value: page as usize,
                    limit: host.pages(),
                })?;
            let bits = host.page_bits(PageId(page)).ok_or(CudaError::OutOfRange {
                what: "page to upload to the device shadow",
                value: page as usize,
                limit: host.pages(),
            })?;
            packed.extend([word, owner]);
            packed.extend(bits);
        }
        let stride = self.stride_u32()?;
        let n_pages = to_u32("pages in the device shadow", self.pages)?;
        let pages = self.upload_words(&list, "copy the page list to the device")?;
        let packed = self.upload_words(&packed, "copy shadow pages to the device")?;
        // SAFETY: `records` holds 2 words and `bits` `stride` words per page
        // of the shadow's `n_pages` (its constructor), stride >= 1 (layers
        // and page slots are non-zero there); the page list is non-empty and
        // `packed` holds 2 + stride words for each listed page; all buffers
        // live on this stream.
        unsafe {
            result::launch_shadow_scatter(
                &self.stream,
                &self.scatter,
                &mut self.records,
                &mut self.bits,
                n_pages,
                stride,
                &pages,
                &packed,
            )
        }?;
        self.finish("upload shadow pages")
    }

    /// Copies every page's record and written words from `host`.
    ///
    /// # Errors
    /// As [`CudaKernelShadow::upload`].
    pub fn upload_all(&mut self, host: &KernelShadow<'_>) -> Result<(), CudaError> {
        self.check_host(host)?;
        let (records, bits) = host_words(host);
        for (what, len, expected) in [
            ("host shadow records", records.len(), self.records.len()),
            ("host shadow written words", bits.len(), self.bits.len()),
        ] {
            if len != expected {
                return Err(CudaError::Length {
                    what,
                    len,
                    expected,
                });
            }
        }
        self.stream
            .memcpy_htod(&records, &mut self.records)
            .map_err(CudaError::driver("copy shadow records to the device"))?;
        self.stream
            .memcpy_htod(&bits, &mut self.bits)
            .map_err(CudaError::driver("copy written bits to the device"))?;
        self.finish("upload the shadow")
    }

    /// Brings back to `host` the written bits the device set (a store
    /// launch) for the listed pages: ORed into the host shadow's
    /// (`KernelShadow::merge_bits`), noting a generation's first write at
    /// `step`. A page whose generation on the host is no longer the
    /// `PageRef`'s gets nothing (its bits belong to a generation gone).
    ///
    /// # Errors
    /// A host shadow of another geometry, a page outside the pool, or a
    /// CUDA failure.
    pub fn download_written(
        &self,
        host: &KernelShadow<'_>,
        pages: &[PageRef],
        step: u64,
    ) -> Result<(), CudaError> {
        self.check_host(host)?;
        for page in pages {
            self.check_page("page to download from the device shadow", page.page)?;
        }
        if pages.is_empty() {
            return Ok(());
        }
        let words = self.gather(pages.iter().map(|p| p.page))?;
        for (page, words) in pages.iter().zip(words.chunks_exact(self.layout.stride)) {
            host.merge_bits(*page, words, step);
        }
        Ok(())
    }

    /// A page's record on the device: `(state word, owner request)`.
    ///
    /// # Errors
    /// A page outside the pool, or a CUDA failure.
    pub fn record_words(&self, page: PageId) -> Result<(u64, u64), CudaError> {
        self.check_page("page whose device record to read", page)?;
        let at = 2 * page.0 as usize;
        let words = self
            .stream
            .clone_dtoh(&self.records.slice(at..at + 2))
            .map_err(CudaError::driver("copy a shadow record to the host"))?;
        self.finish("copy a shadow record to the host")?;
        match words[..] {
            [word, owner] => Ok((word, owner)),
            _ => Err(CudaError::Length {
                what: "device shadow record",
                len: words.len(),
                expected: 2,
            }),
        }
    }

    /// A page's written words on the device.
    ///
    /// # Errors
    /// A page outside the pool, or a CUDA failure.
    pub fn page_bits(&self, page: PageId) -> Result<Vec<u64>, CudaError> {
        self.check_page("page whose device written bits to read", page)?;
        self.gather([page].into_iter())
    }

    /// The listed pages' written words, `stride` per page, in list order.
    fn gather(&self, pages: impl Iterator<Item = PageId>) -> Result<Vec<u64>, CudaError> {
        let list: Vec<u32> = pages.map(|p| p.0).collect();
        let stride = self.stride_u32()?;
        let n_pages = to_u32("pages in the device shadow", self.pages)?;
        let pages = self.upload_words(&list, "copy the page list to the device")?;
        let mut out = self
            .stream
            .alloc_zeros::<u64>(list.len() * self.layout.stride)
            .map_err(CudaError::driver("allocate the gathered written bits"))?;
        // SAFETY: `bits` holds `stride` words per page of the shadow's
        // `n_pages`, stride >= 1; the list is non-empty (callers) and `out`
        // holds `stride` words per listed page; all buffers live on this
        // stream.
        unsafe {
            result::launch_shadow_gather(
                &self.stream,
                &self.gather,
                &self.bits,
                n_pages,
                stride,
                &pages,
                &mut out,
            )
        }?;
        let words = self
            .stream
            .clone_dtoh(&out)
            .map_err(CudaError::driver("copy written bits to the host"))?;
        self.finish("copy written bits to the host")?;
        Ok(words)
    }

    fn upload_words<T: cudarc::driver::DeviceRepr>(
        &self,
        host: &[T],
        op: &'static str,
    ) -> Result<CudaSlice<T>, CudaError> {
        self.stream.clone_htod(host).map_err(CudaError::driver(op))
    }

    /// Waits for the stream; returns its error or one recorded earlier.
    fn finish(&self, op: &'static str) -> Result<(), CudaError> {
        self.stream.synchronize().map_err(CudaError::driver(op))?;
        self.stream
            .context()
            .check_err()
            .map_err(CudaError::driver("an earlier CUDA call (recorded error)"))
    }
}

/// Every page's record words and written words of `host`, as the device
/// shadow holds them.
pub(super) fn host_words(host: &KernelShadow<'_>) -> (Vec<u64>, Vec<u64>) {
    let pages = host.pages();
    let mut records = Vec::with_capacity(2 * pages);
    let mut bits = Vec::with_capacity(pages * host.layout().stride);
    for page in 0..pages {
        let page = PageId(page as u32);
        if let (Some((word, owner)), Some(words)) = (host.record_words(page), host.page_bits(page))
        {
            records.extend([word, owner]);
            bits.extend(words);
        }
    }
    (records, bits)
}

fn to_u32(what: &'static str, value: usize) -> Result<u32, CudaError> {
    u32::try_from(value).map_err(|_| CudaError::TooLarge {
        what,
        value,
        limit: u32::MAX as usize,
    })
}
