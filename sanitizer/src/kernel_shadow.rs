//! The kernel shadow: the sanitizer's page records and written bits as the
//! KV kernels consult them, in place, as they touch each page.
//!
//! A sanitizer checks the access, not the plan. The store kernel asks
//! [`KernelShadow::store`] before it writes a token's K and V (and the call
//! sets the written bit); the attention kernel asks
//! [`KernelShadow::check_read`] before it reads a page. Both take exactly
//! what the kernel was handed — the `PageRef` from the batch's block-table
//! array or store slot mapping, the slot, the layer, the row's owner — so a
//! wrong length, row, stride or reused array is seen as what it is.
//!
//! There is no second copy to keep in step on the CPU: the view borrows the
//! sanitizer's own records and bits ([`crate::shadow`]), shared with the
//! host-side hooks (`alloc`, `free`, `transfer_*`). An engine that reaches
//! the sanitizer through the C ABI (the LD_PRELOAD shim) gets the same memory
//! described by a [`KvsanKernelShadow`](crate::abi::KvsanKernelShadow) and builds the same view from it.
//!
//! ```text
//!  per page touched:   record (32 B)                 the layer's bit word(s)
//!  check_read   load state word ─┐   owner ──┐   bits[page][layer·ps .. layer·ps + n] all set
//!                                └ gen, state, flags, owner == reader
//!  store        load state word, owner; fetch_or bit layer·ps + slot
//!                └ gen, state, flags (not shared), owner == writer
//! ```
//!
//! Cost: one record and one bit word per page a read touches; one record
//! and one bit word per token-layer a store writes. Nothing walks a block
//! table apart from the kernel's own walk, so the host-side work per step
//! does not grow with context.
//!
//! The fast path only answers "legal" or "not legal, and why". Anything not
//! legal goes to the host's cold path ([`crate::Sanitizer::kernel_refusal`]),
//! which checks again against the whole shadow (the prefix cache's sharer
//! table included), writes the report with the page's history and returns
//! the verdict. A read of a shared page by a request that does not own it is
//! never decided here: it is [`Check::Arbitrate`].

use std::ops::Range;

use crate::ids::{PageId, PageRef, RequestId};
use crate::shadow::{
    BitLayout, FLAG_SHARED, FLAG_TERMINAL_OWNER, FLAG_WRITE_LOGGED, PageShadow, PageState,
};
use crate::sync::{AtomicU64, Ordering, fence};
use crate::violation::ViolationKind;

/// The version of the kernel-shadow memory layout (records, bit words,
/// counters) that [`KvsanKernelShadow`](crate::abi::KvsanKernelShadow) describes.
pub const KERNEL_SHADOW_LAYOUT: u32 = 1;

/// Checks the kernels performed on one pool: pages read-checked and
/// token-layer stores checked. Bumped once per kernel task, not per check.
#[repr(C, align(128))]
#[derive(Debug, Default)]
pub struct KernelCounters {
    /// Pages attention checked before reading them (one per page, layer and task).
    pub read_pages: AtomicU64,
    /// Token-layer stores checked.
    pub stores: AtomicU64,
}

/// What a kernel did to KV memory, as it reports a refused access.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
#[repr(u32)]
pub enum AccessOp {
    /// Attention read slots `0..n` of a page for one layer.
    Read = 0,
    /// A store wrote one slot of a page for one layer.
    Store = 1,
    /// Poison (a freed page's fill) reached attention output from this slot.
    Poison = 2,
}

impl AccessOp {
    /// The op of a C code.
    #[must_use]
    pub const fn from_code(code: u32) -> Option<AccessOp> {
        match code {
            0 => Some(AccessOp::Read),
            1 => Some(AccessOp::Store),
            2 => Some(AccessOp::Poison),
            _ => None,
        }
    }

    /// Lower-case name for reports.
    #[must_use]
    pub const fn name(self) -> &'static str {
        match self {
            AccessOp::Read => "read",
            AccessOp::Store => "store",
            AccessOp::Poison => "poison",
        }
    }
}

/// One kernel access the fast path did not pass, as the kernel saw it.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct KernelAccess {
    /// Read, store, or poison found in the output.
    pub op: AccessOp,
    /// The `PageRef` the kernel used (from the block-table array or the
    /// store slot mapping).
    pub page: PageRef,
    /// For a read: the entry of the row's block table; for a store or
    /// poison: the token position.
    pub entry: u32,
    /// The layer.
    pub layer: u32,
    /// The slots: `0..n` for a read, `s..s + 1` for a store or poison.
    pub slots: Range<u32>,
}

/// The fast path's answer.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Check {
    /// Legal: go on.
    Ok,
    /// Not legal; the kind the fast path saw (the cold path decides and reports).
    Refused(ViolationKind),
    /// A read of a shared page by a request that is not its holding owner:
    /// only the host's sharer table can say whether it is legal.
    Arbitrate,
}

/// The kernel's view of one registered pool's shadow.
#[derive(Clone, Copy, Debug)]
pub struct KernelShadow<'a> {
    pub(crate) records: &'a [PageShadow],
    pub(crate) bits: &'a [AtomicU64],
    pub(crate) layout: BitLayout,
    pub(crate) counters: &'a KernelCounters,
}

impl<'a> KernelShadow<'a> {
    pub(crate) fn new(
        records: &'a [PageShadow],
        bits: &'a [AtomicU64],
        layout: BitLayout,
        counters: &'a KernelCounters,
    ) -> KernelShadow<'a> {
        debug_assert_eq!(bits.len(), records.len() * layout.stride);
        KernelShadow {
            records,
            bits,
            layout,
            counters,
        }
    }

    /// Pages shadowed.
    #[must_use]
    pub fn pages(&self) -> usize {
        self.records.len()
    }

    /// The bit layout.
    #[must_use]
    pub fn layout(&self) -> &BitLayout {
        &self.layout
    }

    #[inline]
    fn page_words(&self, page: usize) -> &'a [AtomicU64] {
        let at = page * self.layout.stride;
        &self.bits[at..at + self.layout.stride]
    }

    /// Before `reader` reads slots `0..slots` of `page` for `layer`.
    ///
    /// In order: `generation-mismatch`, `read-free-page`,
    /// `read-during-transfer`, not the holding owner (`foreign-read`, or
    /// [`Check::Arbitrate`] for a shared page), `terminal-request-activity`
    /// (the holder has ended), `stale-read` (a slot not written for
    /// `layer`). A page outside the shadow is `generation-mismatch` (no
    /// generation of this pool matches it); `layer` must be below the
    /// layout's layers.
    #[inline]
    #[must_use]
    pub fn check_read(&self, reader: RequestId, page: PageRef, layer: u32, slots: u32) -> Check {
        let i = page.page.0 as usize;
        let Some(rec) = self.records.get(i) else {
            return Check::Refused(ViolationKind::GenerationMismatch);
        };
        loop {
            let word = rec.load();
            let found = if word.generation() != page.generation {
                Check::Refused(ViolationKind::GenerationMismatch)
            } else if word.state().is_free() {
                Check::Refused(ViolationKind::ReadFreePage)
            } else if word.state() == PageState::Receiving {
                Check::Refused(ViolationKind::ReadDuringTransfer)
            } else if !rec.held_by(word, reader) {
                if word.has(FLAG_SHARED) {
                    Check::Arbitrate
                } else {
                    Check::Refused(ViolationKind::ForeignRead)
                }
            } else if word.has(FLAG_TERMINAL_OWNER) {
                Check::Refused(ViolationKind::TerminalRequestActivity)
            } else {
                let words = self.page_words(i);
                let written = self
                    .layout
                    .words(layer, 0..slots)
                    .all(|(w, mask)| words[w].load(Ordering::Relaxed) & mask == mask);
                if written {
                    Check::Ok
                } else {
                    Check::Refused(ViolationKind::StaleRead)
                }
            };
            // Seqlock: nothing moved while owner and bits were read.
            fence(Ordering::Acquire);
            if rec.word_now() == word.0 {
                return found;
            }
        }
    }

    /// Before `writer` stores one token's K and V into `slot` of `page` for
    /// `layer` at `step`; on [`Check::Ok`] the slot is marked written.
    ///
    /// In order: `generation-mismatch`, `write-after-free`, `foreign-write`
    /// (another request holds it, a sharer writes, or the owner writes
    /// while the page is shared read-only with the prefix cache or a
    /// request), and `terminal-request-activity`. No bit is set when the
    /// store is refused.
    #[inline]
    #[must_use]
    pub fn store(
        &self,
        writer: RequestId,
        page: PageRef,
        layer: u32,
        slot: u32,
        step: u64,
    ) -> Check {
        let i = page.page.0 as usize;
        let Some(rec) = self.records.get(i) else {
            return Check::Refused(ViolationKind::GenerationMismatch);
        };
        let word = rec.load();
        let refused = if word.generation() != page.generation {
            Some(ViolationKind::GenerationMismatch)
        } else if word.state().is_free() {
            Some(ViolationKind::WriteAfterFree)
        } else if !rec.held_by(word, writer) || word.has(FLAG_SHARED) {
            Some(ViolationKind::ForeignWrite)
        } else if word.has(FLAG_TERMINAL_OWNER) {
            Some(ViolationKind::TerminalRequestActivity)
        } else {
            None
        };
        if let Some(kind) = refused {
            return Check::Refused(kind);
        }
        let bit = self.layout.bit(layer, slot);
        let bits = &self.page_words(i)[(bit / 64) as usize];
        let mask = 1u64 << (bit % 64);
        if bits.load(Ordering::Relaxed) & mask == 0 {
            bits.fetch_or(mask, Ordering::Relaxed);
        }
        if !word.has(FLAG_WRITE_LOGGED) && rec.mark_written(page.generation) {
            rec.note_kernel_write(step);
        }
        Check::Ok
    }

    /// A page's record as two words, for a copy the host keeps in step
    /// (a device-resident shadow): the state word and the owner request;
    /// `None` past the pool.
    #[must_use]
    pub fn record_words(&self, page: PageId) -> Option<(u64, u64)> {
        let rec = self.records.get(page.0 as usize)?;
        Some((rec.load().0, rec.owner_request().0))
    }

    /// A page's written words, for the same copy; `None` past the pool.
    #[must_use]
    pub fn page_bits(&self, page: PageId) -> Option<Vec<u64>> {
        let i = page.0 as usize;
        (i < self.records.len()).then(|| {
            self.page_words(i)
                .iter()
                .map(|w| w.load(Ordering::Relaxed))
                .collect()
        })
    }

    /// Brings back the written words a copy of the shadow (a device's store
    /// kernel) set for `page` at `generation`: ORs them in, and notes the
    /// generation's first write at `step` if these are its first bits.
    /// Nothing happens if the page has moved to another generation since
    /// (those bits belong to a generation that is gone) or `words` is not
    /// one page's worth.
    pub fn merge_bits(&self, page: PageRef, words: &[u64], step: u64) {
        let i = page.page.0 as usize;
        let Some(rec) = self.records.get(i) else {
            return;
        };
        if words.len() != self.layout.stride || rec.load().generation() != page.generation {
            return;
        }
        let mut any = false;
        for (word, &bits) in self.page_words(i).iter().zip(words) {
            if bits & !word.load(Ordering::Relaxed) != 0 {
                word.fetch_or(bits, Ordering::Relaxed);
                any = true;
            }
        }
        if any && !rec.load().has(FLAG_WRITE_LOGGED) && rec.mark_written(page.generation) {
            rec.note_kernel_write(step);
        }
    }

    /// Adds a kernel task's checks to the pool's counters.
    #[inline]
    pub fn count(&self, read_pages: u64, stores: u64) {
        if read_pages > 0 {
            self.counters
                .read_pages
                .fetch_add(read_pages, Ordering::Relaxed);
        }
        if stores > 0 {
            self.counters.stores.fetch_add(stores, Ordering::Relaxed);
        }
    }
}
