//! The paged KV pool: page storage, per-page generations, the free list.
//!
//! ```text
//!  data: n_pages × page_elems f16, never zeroed on reuse
//!  page p: [layer 0: K[slot][kv_head][dim] V[slot][kv_head][dim]] [layer 1: …] …
//!  generations[p]: +1 at every allocation of p; a PageRef carries the value
//!                  it had when the page was handed out
//! ```
//!
//! Only this type touches the free list. It is a stack: the page freed last
//! is handed out first (its lines are the likeliest to be in cache), as
//! production allocators do. Pages go back to the free list
//! without being cleared — as in production engines — so a read of a slot
//! its request never wrote sees whatever an earlier request left there.

use std::collections::VecDeque;
use std::ops::Range;

use half::f16;
use kvsan_kernels::attention::KvGeometry;
use kvsan_sanitizer::{Generation, PageId, PageRef};

use crate::EngineError;

pub use crate::error::PoolError;

mod faults;

/// A pool of KV pages for one model geometry.
#[derive(Debug)]
pub struct KvPool {
    geometry: KvGeometry,
    data: Vec<f16>,
    generations: Vec<Generation>,
    free: VecDeque<PageId>,
    is_free: Vec<bool>,
    /// Freed pages held back, oldest first.
    quarantine: VecDeque<PageId>,
    quarantine_cap: usize,
}

/// The f16 bit pattern freed pages are poisoned with: a quiet NaN whose
/// payload spells `0x5A` (the CUDA poison kernel's `KVSAN_POISON_F16`), so a
/// dump tells poison from a NaN arithmetic produced. Attention over a
/// poisoned slot outputs NaN.
pub const POISON_F16_BITS: u16 = 0x7E5A;

impl KvPool {
    /// A pool of `n_pages` pages of `geometry`.
    ///
    /// # Errors
    /// [`PoolError::TooLarge`] when the pool's size overflows or cannot
    /// be allocated.
    pub fn new(geometry: KvGeometry, n_pages: usize) -> Result<KvPool, PoolError> {
        let elems = geometry
            .page_elems()
            .checked_mul(n_pages)
            .filter(|_| n_pages <= u32::MAX as usize)
            .ok_or(PoolError::TooLarge {
                pages: n_pages,
                page_bytes: geometry.page_elems() * 2,
            })?;
        let mut data = Vec::new();
        data.try_reserve_exact(elems)
            .map_err(|_| PoolError::TooLarge {
                pages: n_pages,
                page_bytes: geometry.page_elems() * 2,
            })?;
        // Zeroed once at creation (the allocator hands out zero pages for
        // free); never again on reuse.
        data.resize(elems, f16::ZERO);
        Ok(KvPool {
            geometry,
            data,
            generations: vec![Generation(0); n_pages],
            free: (0..n_pages as u32).rev().map(PageId).collect(),
            is_free: vec![true; n_pages],
            quarantine: VecDeque::new(),
            quarantine_cap: 0,
        })
    }

    /// The page geometry.
    #[must_use]
    pub fn geometry(&self) -> &KvGeometry {
        &self.geometry
    }

    /// Pages in the pool.
    #[must_use]
    pub fn n_pages(&self) -> usize {
        self.generations.len()
    }

    /// Pages an allocation can take: the free list and the quarantine.
    #[must_use]
    pub fn free_pages(&self) -> usize {
        self.free.len() + self.quarantine.len()
    }

    /// Freed pages held in quarantine now (counted in [`KvPool::free_pages`]).
    #[must_use]
    pub fn quarantined_pages(&self) -> usize {
        self.quarantine.len()
    }

    /// Holds up to `pages` freed pages back (FIFO) before the free list hands
    /// them out again; 0 turns the quarantine off. Pages beyond a smaller
    /// limit go to the free list, oldest first.
    pub fn set_quarantine(&mut self, pages: usize) {
        self.quarantine_cap = pages;
        self.trim_quarantine();
    }

    /// Moves every quarantined page to the free list, oldest first.
    pub fn drain_quarantine(&mut self) {
        self.free.extend(self.quarantine.drain(..));
    }

    fn trim_quarantine(&mut self) {
        while self.quarantine.len() > self.quarantine_cap {
            if let Some(p) = self.quarantine.pop_front() {
                self.free.push_back(p);
            }
        }
    }

    /// Fills every slot of every layer of `page` (K and V) with
    /// [`POISON_F16_BITS`].
    ///
    /// # Panics
    /// If `page` is outside the pool.
    pub fn poison_page(&mut self, page: PageId) {
        let n = self.geometry.page_elems();
        let at = page.0 as usize * n;
        self.data[at..at + n].fill(f16::from_bits(POISON_F16_BITS));
    }

    /// The elements of `page` (every layer, K and V).
    ///
    /// # Panics
    /// If `page` is outside the pool.
    #[must_use]
    pub fn page_data(&self, page: PageId) -> &[f16] {
        let n = self.geometry.page_elems();
        let at = page.0 as usize * n;
        &self.data[at..at + n]
    }

    /// Token slots per page.
    #[must_use]
    pub fn page_slots(&self) -> usize {
        self.geometry.page_slots
    }

    /// Takes a page from the free list — or, when it is empty, the oldest
    /// quarantined page — advancing its generation.
    pub fn alloc(&mut self) -> Option<PageRef> {
        let page = self
            .free
            .pop_back()
            .or_else(|| self.quarantine.pop_front())?;
        self.is_free[page.0 as usize] = false;
        let g = &mut self.generations[page.0 as usize];
        *g = g.next();
        Some(PageRef {
            page,
            generation: *g,
        })
    }

    /// Returns a page to the pool, contents untouched: into the quarantine
    /// when one is set, else onto the free list (handed out next).
    ///
    /// # Errors
    /// [`PoolError::BadFree`] when `page` is out of range, its generation
    /// is not current, or it is already free (not checked under the fault
    /// `double-free`).
    pub fn free(&mut self, page: PageRef) -> Result<(), PoolError> {
        let idx = page.page.0 as usize;
        let current = self.generations.get(idx).copied();
        let already_free = faults::double_free(self.is_free.get(idx).copied().unwrap_or(false));
        if current != Some(page.generation) || already_free {
            return Err(PoolError::BadFree {
                page: page.page.0,
                generation: page.generation.0,
                current: current.map(|g| g.0),
            });
        }
        self.is_free[idx] = true;
        if self.quarantine_cap == 0 {
            self.free.push_back(page.page);
        } else {
            self.quarantine.push_back(page.page);
            self.trim_quarantine();
        }
        Ok(())
    }

    /// The per-page generation array (what the KV kernels compare tags with
    /// when no sanitizer is attached).
    #[must_use]
    pub fn generations(&self) -> &[Generation] {
        &self.generations
    }

    /// The page storage.
    #[must_use]
    pub fn data(&self) -> &[f16] {
        &self.data
    }

    /// The page storage, for writes that are not kernel stores: a transport
    /// registering the pool with a NIC, tests. The forward pass writes only
    /// through [`crate::kv_access::KvAccess`].
    pub fn data_mut(&mut self) -> &mut [f16] {
        &mut self.data
    }

    /// The page storage for writes, with the generation array beside it
    /// (the store kernel checks tags as it writes).
    pub fn data_and_generations_mut(&mut self) -> (&mut [f16], &[Generation]) {
        (&mut self.data, &self.generations)
    }

    /// Appends the K and V of `slots` × `layers` of `page` to `out` as
    /// little-endian f16 (per layer: K of the slots, then V; the wire order of
    /// a KV transfer).
    ///
    /// # Panics
    /// If `page`, `slots` or `layers` are outside the pool's geometry.
    pub fn pack_slots(
        &self,
        page: PageId,
        slots: Range<usize>,
        layers: Range<usize>,
        out: &mut Vec<u8>,
    ) {
        let g = &self.geometry;
        let width = slots.len() * g.slot_width();
        for layer in layers {
            for kv in 0..2 {
                let at = g.offset(page, layer, kv, slots.start);
                for v in &self.data[at..at + width] {
                    out.extend_from_slice(&v.to_bits().to_le_bytes());
                }
            }
        }
    }

    /// The landing digest of `slots` × `layers` of `page`: XXH3-64 with
    /// `seed` of the bytes [`KvPool::pack_slots`] would write for them,
    /// computed in place ([`crate::transport::landing_digest`] of the
    /// packed bytes is the same value).
    ///
    /// # Panics
    /// If `page`, `slots` or `layers` are outside the pool's geometry.
    #[must_use]
    pub fn landing_digest(
        &self,
        page: PageId,
        slots: Range<usize>,
        layers: Range<usize>,
        seed: u64,
    ) -> u64 {
        let g = &self.geometry;
        let width = slots.len() * g.slot_width();
        let mut hasher = xxhash_rust::xxh3::Xxh3::with_seed(seed);
        for layer in layers {
            for kv in 0..2 {
                let at = g.offset(page, layer, kv, slots.start);
                hash_f16(&mut hasher, &self.data[at..at + width]);
            }
        }
        hasher.digest()
    }

    /// Writes K and V of `slots` × `layers` of `page` from `bytes` (the
    /// layout of [`KvPool::pack_slots`]); returns the bytes consumed.
    ///
    /// # Errors
    /// [`EngineError::TransferShape`] when `bytes` is shorter than the slots
    /// need or the range is outside the geometry; nothing is written then.
    pub fn unpack_slots(
        &mut self,
        page: PageId,
        slots: Range<usize>,
        layers: Range<usize>,
        bytes: &[u8],
    ) -> Result<usize, EngineError> {
        let g = self.geometry;
        let width = slots.len() * g.slot_width();
        let need = layers.len() * 2 * width * 2;
        if page.0 as usize >= self.n_pages() || slots.end > g.page_slots || layers.end > g.n_layers
        {
            return Err(EngineError::TransferShape {
                what: format!(
                    "{page}, slots {slots:?}, layers {layers:?} outside a pool of {} pages × {} slots × {} layers",
                    self.n_pages(),
                    g.page_slots,
                    g.n_layers
                ),
            });
        }
        if bytes.len() < need {
            return Err(EngineError::TransferShape {
                what: format!(
                    "{} bytes for {page} slots {slots:?}, {need} needed",
                    bytes.len()
                ),
            });
        }
        let mut src = bytes.chunks_exact(2);
        for layer in layers {
            for kv in 0..2 {
                let at = g.offset(page, layer, kv, slots.start);
                for (dst, b) in self.data[at..at + width].iter_mut().zip(&mut src) {
                    *dst = f16::from_bits(u16::from_le_bytes([b[0], b[1]]));
                }
            }
        }
        Ok(need)
    }
}

/// Feeds `run` to `hasher` as its little-endian wire bytes, without a copy
/// where that is its memory.
pub(crate) fn hash_f16(hasher: &mut xxhash_rust::xxh3::Xxh3, run: &[f16]) {
    if cfg!(target_endian = "little") {
        // The elements' memory is their little-endian wire bytes.
        hasher.update(bytemuck::cast_slice(run));
        return;
    }
    let mut buf = [0u8; 4096];
    for chunk in run.chunks(buf.len() / 2) {
        for (b, v) in buf.chunks_exact_mut(2).zip(chunk) {
            b.copy_from_slice(&v.to_bits().to_le_bytes());
        }
        hasher.update(&buf[..chunk.len() * 2]);
    }
}
