//! The shadow of one KV page: a packed atomic state word, the owner, and the
//! written bitmap, with every lock-free transition in one place.
//!
//! Page states: `Free → Owned → (Receiving → Owned) → Quarantined → Free`
//! (`Allocating` is the brief window while `alloc` resets the owner and the
//! bitmap). Transitions are compare-and-swap loops on the state word, so two
//! racing `alloc`s (or `free`s) of one page cannot both succeed.
//!
//! ```text
//!  state word (AtomicU64)
//!   63          39 38  37  36  35 34  32 31                    0
//!  +--------------+---+---+---+---+------+-----------------------+
//!  |   (unused)   | L | S | R | T | state|      generation       |
//!  +--------------+---+---+---+---+------+-----------------------+
//!   T: owner is a terminal request   R: owner released its reference
//!   S: shared read-only (sharers in the pool's sharer table)
//!   L: first write of this generation already logged in the history
//!
//!  written bitmap, two arrays of AtomicU64 per pool:
//!
//!  complete words (complete_words per page, pages back to back)
//!  +------------------+------------------+-----
//!  | page 0           | page 1           | ...     bit s: slot s has
//!  +------------------+------------------+-----    every layer written
//!
//!  slot words (page_slots × words_per_slot per page)
//!  +-----------------+-----------------+-----+-----------------+-----
//!  | p0 slot 0       | p0 slot 1       | ... | p1 slot 0       | ...
//!  | bit l: layer l  |                 |     |                 |
//!  +-----------------+-----------------+-----+-----------------+-----
//! ```
//!
//! The complete words are the read fast path: a read of all layers checks
//! one word per 64 slots instead of one per slot, and a block table's
//! complete words sit close together in memory.
//!
//! Readers are optimistic, seqlock style: they load the state word, check
//! owner and bits, fence, and re-load the word; if it moved, they check again.
//! `alloc` first moves the word to `Allocating` and fences before it resets
//! owner and bits, so a reader can never pair the old generation with the new
//! page's contents (model-checked in `tests/loom.rs`, which found the missing
//! fence). A write racing with the free of the same page is itself an
//! engine bug: the write reports `write-after-free` or `generation-mismatch`
//! when it sees the new state, though its bits may already have landed.

use std::ops::Range;

use crate::ids::{Generation, Owner, RequestId, TenantId};
use crate::sync::{AtomicU32, AtomicU64, Ordering, fence};
use crate::violation::ViolationKind;

/// Where a page is in its life.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
#[repr(u8)]
pub enum PageState {
    /// On the free list; no owner.
    Free = 0,
    /// Held by its owner (and maybe shared).
    Owned = 1,
    /// Owned, with an incoming transfer not yet committed.
    Receiving = 2,
    /// Freed recently; kept out of Free for a while to tell late accesses apart.
    Quarantined = 3,
    /// `alloc` is resetting the page (transient).
    Allocating = 4,
}

impl PageState {
    #[inline]
    fn from_bits(bits: u64) -> PageState {
        match bits {
            0 => PageState::Free,
            1 => PageState::Owned,
            2 => PageState::Receiving,
            3 => PageState::Quarantined,
            _ => PageState::Allocating,
        }
    }

    /// The lower-case name used in reports.
    #[must_use]
    pub const fn name(self) -> &'static str {
        match self {
            PageState::Free => "free",
            PageState::Owned => "owned",
            PageState::Receiving => "receiving",
            PageState::Quarantined => "quarantined",
            PageState::Allocating => "allocating",
        }
    }

    /// Free, quarantined or being allocated: nobody may touch it.
    #[must_use]
    #[inline]
    pub const fn is_free(self) -> bool {
        matches!(
            self,
            PageState::Free | PageState::Quarantined | PageState::Allocating
        )
    }
}

/// The owner is a terminal (rejected, aborted, finished) request.
pub const FLAG_TERMINAL_OWNER: u64 = 1 << 35;
/// The owner let go of the page while sharers still hold it.
pub const FLAG_OWNER_RELEASED: u64 = 1 << 36;
/// The page has read-only sharers.
pub const FLAG_SHARED: u64 = 1 << 37;
/// The generation's first write is in the history.
pub const FLAG_WRITE_LOGGED: u64 = 1 << 38;

const STATE_SHIFT: u32 = 32;
const STATE_MASK: u64 = 0x7 << STATE_SHIFT;
const GEN_MASK: u64 = 0xFFFF_FFFF;

/// A decoded copy of a page's state word.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct StateWord(pub u64);

impl StateWord {
    /// Packs generation, state and flags.
    #[must_use]
    pub const fn new(generation: Generation, state: PageState, flags: u64) -> StateWord {
        StateWord(generation.0 as u64 | ((state as u64) << STATE_SHIFT) | flags)
    }

    /// The page's current generation.
    #[must_use]
    #[inline]
    pub const fn generation(self) -> Generation {
        Generation((self.0 & GEN_MASK) as u32)
    }

    /// The page's state.
    #[must_use]
    #[inline]
    pub fn state(self) -> PageState {
        PageState::from_bits((self.0 & STATE_MASK) >> STATE_SHIFT)
    }

    /// Whether `flag` is set.
    #[must_use]
    #[inline]
    pub const fn has(self, flag: u64) -> bool {
        self.0 & flag != 0
    }

    const fn with(self, flag: u64) -> StateWord {
        StateWord(self.0 | flag)
    }

    const fn without(self, flag: u64) -> StateWord {
        StateWord(self.0 & !flag)
    }

    const fn with_state(self, state: PageState) -> StateWord {
        StateWord((self.0 & !STATE_MASK) | ((state as u64) << STATE_SHIFT))
    }
}

/// The per-page shadow record (24 bytes; bitmap and history live elsewhere).
#[repr(C)]
#[derive(Debug)]
pub struct PageShadow {
    word: AtomicU64,
    owner_request: AtomicU64,
    owner_tenant: AtomicU32,
}

impl Default for PageShadow {
    fn default() -> Self {
        PageShadow::new()
    }
}

impl PageShadow {
    /// A never-allocated page: Free at generation 0.
    #[must_use]
    pub fn new() -> PageShadow {
        PageShadow {
            word: AtomicU64::new(StateWord::new(Generation(0), PageState::Free, 0).0),
            owner_request: AtomicU64::new(0),
            owner_tenant: AtomicU32::new(0),
        }
    }

    /// The state word now.
    #[must_use]
    #[inline]
    pub fn load(&self) -> StateWord {
        StateWord(self.word.load(Ordering::Acquire))
    }

    /// The owner recorded at the last allocation.
    #[must_use]
    pub fn owner(&self) -> Owner {
        Owner {
            request: RequestId(self.owner_request.load(Ordering::Relaxed)),
            tenant: TenantId(self.owner_tenant.load(Ordering::Relaxed)),
        }
    }

    /// The read fast path: `true` if the page is Owned at `generation`, held
    /// by `who` (not released) and every slot in `slot_mask` has every layer
    /// written (`complete` is the page's complete word). `false` says only
    /// "take the full check", which finds what is wrong, if anything.
    #[inline(always)]
    #[must_use]
    pub fn read_fast(
        &self,
        generation: Generation,
        who: RequestId,
        complete: &AtomicU64,
        slot_mask: u64,
    ) -> bool {
        let word = self.word.load(Ordering::Acquire);
        let expect = StateWord::new(generation, PageState::Owned, 0).0;
        if word & (GEN_MASK | STATE_MASK | FLAG_OWNER_RELEASED) != expect
            || self.owner_request.load(Ordering::Relaxed) != who.0
            || complete.load(Ordering::Relaxed) & slot_mask != slot_mask
        {
            return false;
        }
        fence(Ordering::Acquire);
        self.word.load(Ordering::Relaxed) == word
    }

    fn cas(&self, current: StateWord, new: StateWord) -> Result<(), StateWord> {
        self.word
            .compare_exchange(current.0, new.0, Ordering::AcqRel, Ordering::Acquire)
            .map(|_| ())
            .map_err(StateWord)
    }

    #[inline]
    fn held_by(&self, word: StateWord, who: RequestId) -> bool {
        !word.has(FLAG_OWNER_RELEASED) && self.owner_request.load(Ordering::Relaxed) == who.0
    }
}

/// How the written bitmap of a pool is laid out (see the module doc).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct BitLayout {
    /// Slots per page.
    pub page_slots: u32,
    /// Layers per slot.
    pub layers: u32,
    /// `ceil(layers / 64)`.
    pub words_per_slot: usize,
    /// `ceil(page_slots / 64)`.
    pub complete_words: usize,
    /// Words per page: `complete_words + page_slots × words_per_slot`.
    pub stride: usize,
    /// With `words_per_slot == 1`: the mask of every layer.
    pub full_mask: u64,
}

/// Bits `lo..hi` of a word.
#[inline]
#[must_use]
pub fn range_mask(lo: u32, hi: u32) -> u64 {
    if hi <= lo {
        0
    } else if hi - lo == 64 {
        u64::MAX
    } else {
        ((1u64 << (hi - lo)) - 1) << lo
    }
}

impl BitLayout {
    /// The layout for `page_slots × layers`.
    #[must_use]
    pub fn new(page_slots: u32, layers: u32) -> BitLayout {
        let words_per_slot = layers.div_ceil(64) as usize;
        let complete_words = page_slots.div_ceil(64) as usize;
        BitLayout {
            page_slots,
            layers,
            words_per_slot,
            complete_words,
            stride: complete_words + page_slots as usize * words_per_slot,
            full_mask: range_mask(0, layers.min(64)),
        }
    }

    /// Mask of `layers` inside word `w` of a slot.
    #[inline]
    fn layer_mask(&self, w: usize, layers: &Range<u32>) -> u64 {
        let base = 64 * w as u32;
        let clamp = |x: u32| x.clamp(base, base + 64) - base;
        range_mask(clamp(layers.start), clamp(layers.end))
    }

    /// Slot words per page: `page_slots × words_per_slot`.
    #[inline]
    #[must_use]
    pub fn slot_words(&self) -> usize {
        self.stride - self.complete_words
    }

    fn all_layers(&self) -> Range<u32> {
        0..self.layers
    }
}

/// One page's shadow: record, bitmap words and layout, borrowed together.
#[derive(Clone, Copy, Debug)]
pub struct PageView<'a> {
    /// The record.
    pub rec: &'a PageShadow,
    /// This page's `complete_words` words: bit `s` set when slot `s` has every layer.
    pub complete: &'a [AtomicU64],
    /// This page's `page_slots × words_per_slot` per-slot layer words.
    pub slots: &'a [AtomicU64],
    /// The pool's layout.
    pub layout: &'a BitLayout,
}

/// What `alloc` did.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum AllocOutcome {
    /// The page is now Owned at `generation`.
    Allocated {
        /// The new generation.
        generation: Generation,
    },
    /// The page was not Free or Quarantined; nothing changed.
    AlreadyAllocated(StateWord),
}

/// What a release of the owner's reference did.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum FreeOutcome {
    /// The page went to Quarantined.
    Released,
    /// The owner's reference is gone; sharers still hold the page.
    OwnerReleased,
    /// The caller does not hold the owner's reference (maybe a sharer's).
    NotOwner(StateWord),
    /// Already free, or the generation moved on.
    DoubleFree(StateWord),
}

/// What a read check of one page found.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum ReadCheck {
    /// Legal.
    Ok,
    /// The reader is not the holding owner: legal only if it is a sharer
    /// (the caller looks it up, then checks the bits).
    NotOwner(StateWord),
    /// A violation, with the slot at fault where there is one.
    Fail {
        /// The kind.
        kind: ViolationKind,
        /// The word seen.
        word: StateWord,
        /// The first slot at fault.
        slot: Option<u32>,
    },
}

impl PageView<'_> {
    #[inline]
    fn slot_words(&self, slot: u32) -> &[AtomicU64] {
        let start = slot as usize * self.layout.words_per_slot;
        &self.slots[start..start + self.layout.words_per_slot]
    }

    /// Takes a Free or Quarantined page for `owner` at the next generation,
    /// clearing its bitmap; `terminal` marks an owner that is already terminal.
    pub fn alloc(&self, owner: Owner, terminal: bool) -> AllocOutcome {
        let mut cur = self.rec.load();
        loop {
            if !matches!(cur.state(), PageState::Free | PageState::Quarantined) {
                return AllocOutcome::AlreadyAllocated(cur);
            }
            let generation = cur.generation().next();
            let busy = StateWord::new(generation, PageState::Allocating, 0);
            match self.rec.cas(cur, busy) {
                Ok(()) => break,
                Err(now) => cur = now,
            }
        }
        let generation = cur.generation().next();
        // Seqlock writer side: a reader that sees any store below (the owner,
        // the cleared bits) and then fences must see `Allocating` (or later)
        // when it re-loads the word, so it retries instead of pairing the old
        // generation with the new page contents.
        fence(Ordering::Release);
        self.rec
            .owner_request
            .store(owner.request.0, Ordering::Relaxed);
        self.rec
            .owner_tenant
            .store(owner.tenant.0, Ordering::Relaxed);
        for w in self.complete.iter().chain(self.slots) {
            w.store(0, Ordering::Relaxed);
        }
        let flags = if terminal { FLAG_TERMINAL_OWNER } else { 0 };
        self.rec.word.store(
            StateWord::new(generation, PageState::Owned, flags).0,
            Ordering::Release,
        );
        AllocOutcome::Allocated { generation }
    }

    /// Drops the owner's reference through a `PageRef` at `generation`.
    pub fn free_by_owner(&self, generation: Generation, who: RequestId) -> FreeOutcome {
        let mut cur = self.rec.load();
        loop {
            if cur.generation() != generation
                || !matches!(cur.state(), PageState::Owned | PageState::Receiving)
            {
                return FreeOutcome::DoubleFree(cur);
            }
            if !self.rec.held_by(cur, who) {
                return FreeOutcome::NotOwner(cur);
            }
            let shared = cur.has(FLAG_SHARED);
            let next = if shared {
                cur.with(FLAG_OWNER_RELEASED)
            } else {
                StateWord::new(generation, PageState::Quarantined, 0)
            };
            match self.rec.cas(cur, next) {
                Ok(()) if shared => return FreeOutcome::OwnerReleased,
                Ok(()) => return FreeOutcome::Released,
                Err(now) => cur = now,
            }
        }
    }

    /// Marks the page shared. The caller holds the pool's sharer table lock.
    ///
    /// # Errors
    /// The word seen, if the page is not held at `generation`.
    pub fn mark_shared(&self, generation: Generation) -> Result<(), StateWord> {
        let mut cur = self.rec.load();
        loop {
            if cur.generation() != generation
                || !matches!(cur.state(), PageState::Owned | PageState::Receiving)
            {
                return Err(cur);
            }
            if cur.has(FLAG_SHARED) {
                return Ok(());
            }
            match self.rec.cas(cur, cur.with(FLAG_SHARED)) {
                Ok(()) => return Ok(()),
                Err(now) => cur = now,
            }
        }
    }

    /// The last sharer let go (the caller holds the sharer table lock and has
    /// removed it). Returns `true` if the page went to Quarantined (the owner
    /// had released it), `false` if the owner still holds it.
    pub fn last_sharer_gone(&self, generation: Generation) -> bool {
        let mut cur = self.rec.load();
        loop {
            if cur.generation() != generation || cur.state().is_free() {
                return false;
            }
            let released = cur.has(FLAG_OWNER_RELEASED);
            let next = if released {
                StateWord::new(generation, PageState::Quarantined, 0)
            } else {
                cur.without(FLAG_SHARED)
            };
            match self.rec.cas(cur, next) {
                Ok(()) => return released,
                Err(now) => cur = now,
            }
        }
    }

    /// Quarantined → Free, if the page is still quarantined at `generation`.
    pub fn leave_quarantine(&self, generation: Generation) -> bool {
        let mut cur = self.rec.load();
        loop {
            if cur.generation() != generation || cur.state() != PageState::Quarantined {
                return false;
            }
            match self
                .rec
                .cas(cur, StateWord::new(generation, PageState::Free, 0))
            {
                Ok(()) => return true,
                Err(now) => cur = now,
            }
        }
    }

    /// Marks the page as held by a terminal owner, if `who` still holds it at `generation`.
    pub fn mark_terminal_owner(&self, generation: Generation, who: RequestId) {
        let mut cur = self.rec.load();
        while cur.generation() == generation
            && !cur.state().is_free()
            && self.rec.held_by(cur, who)
            && !cur.has(FLAG_TERMINAL_OWNER)
        {
            match self.rec.cas(cur, cur.with(FLAG_TERMINAL_OWNER)) {
                Ok(()) => return,
                Err(now) => cur = now,
            }
        }
    }

    #[inline]
    fn set_bits(&self, slots: Range<u32>, layers: &Range<u32>) {
        let l = self.layout;
        if l.words_per_slot == 1 {
            // Up to 64 layers: one word per slot.
            let mask = range_mask(layers.start, layers.end);
            for slot in slots {
                let word = &self.slots[slot as usize];
                let prev = word.load(Ordering::Relaxed);
                if prev & mask == mask {
                    continue;
                }
                let prev = if mask == l.full_mask {
                    // Bits only grow within a generation and this is their
                    // maximum: a plain store cannot lose a racing writer's bits.
                    word.store(mask, Ordering::Relaxed);
                    prev
                } else {
                    word.fetch_or(mask, Ordering::Relaxed)
                };
                if prev | mask == l.full_mask {
                    self.complete[slot as usize / 64].fetch_or(1 << (slot % 64), Ordering::Relaxed);
                }
            }
            return;
        }
        for slot in slots {
            let words = self.slot_words(slot);
            let mut complete = true;
            let mut newly = false;
            for (w, word) in words.iter().enumerate() {
                let mask = l.layer_mask(w, layers);
                let full = l.layer_mask(w, &l.all_layers());
                let prev = if mask == 0 {
                    word.load(Ordering::Relaxed)
                } else {
                    word.fetch_or(mask, Ordering::Relaxed)
                };
                complete &= (prev | mask) == full;
                newly |= prev & mask != mask;
            }
            if complete && newly {
                self.complete[slot as usize / 64].fetch_or(1 << (slot % 64), Ordering::Relaxed);
            }
        }
    }

    /// A KV write by `who` into `slots × layers` through a `PageRef` at `generation`.
    ///
    /// Returns whether this is the generation's first logged write, or the
    /// violation (no bits are set then).
    #[inline]
    pub fn write(
        &self,
        who: RequestId,
        generation: Generation,
        slots: Range<u32>,
        layers: &Range<u32>,
    ) -> Result<bool, (ViolationKind, StateWord)> {
        let cur = self.rec.load();
        if cur.generation() != generation {
            return Err((ViolationKind::GenerationMismatch, cur));
        }
        if cur.state().is_free() {
            return Err((ViolationKind::WriteAfterFree, cur));
        }
        if !self.rec.held_by(cur, who) {
            return Err((ViolationKind::ForeignWrite, cur));
        }
        if cur.has(FLAG_TERMINAL_OWNER) {
            return Err((ViolationKind::TerminalRequestActivity, cur));
        }
        self.set_bits(slots, layers);
        if cur.has(FLAG_WRITE_LOGGED) {
            return Ok(false);
        }
        let prev = StateWord(self.rec.word.fetch_or(FLAG_WRITE_LOGGED, Ordering::AcqRel));
        Ok(!prev.has(FLAG_WRITE_LOGGED) && prev.generation() == generation)
    }

    /// The first of `slots` not written for every layer in `layers`.
    #[must_use]
    #[inline]
    pub fn first_unwritten(&self, slots: Range<u32>, layers: &Range<u32>) -> Option<u32> {
        let l = self.layout;
        if slots.is_empty() || layers.is_empty() {
            return None;
        }
        if layers.start == 0 && layers.end == l.layers {
            if l.complete_words == 1 {
                // Fast path: one word says which slots have every layer.
                let mask = range_mask(slots.start, slots.end);
                let have = self.complete[0].load(Ordering::Relaxed);
                return (have & mask != mask).then(|| (!have & mask).trailing_zeros());
            }
            // One complete word covers 64 slots.
            let mut missing = None;
            for w in (slots.start / 64)..slots.end.div_ceil(64) {
                let mask = range_mask(
                    slots.start.clamp(64 * w, 64 * w + 64) - 64 * w,
                    slots.end.clamp(64 * w, 64 * w + 64) - 64 * w,
                );
                let have = self.complete[w as usize].load(Ordering::Relaxed);
                if have & mask != mask {
                    missing = Some(64 * w + (!have & mask).trailing_zeros());
                    break;
                }
            }
            return missing;
        }
        slots.into_iter().find(|&slot| {
            self.slot_words(slot).iter().enumerate().any(|(w, word)| {
                let mask = l.layer_mask(w, layers);
                word.load(Ordering::Relaxed) & mask != mask
            })
        })
    }

    /// Layers of `slot` written, counted within `layers`.
    #[must_use]
    pub fn written_layers(&self, slot: u32, layers: &Range<u32>) -> u32 {
        self.slot_words(slot)
            .iter()
            .enumerate()
            .map(|(w, word)| {
                (word.load(Ordering::Relaxed) & self.layout.layer_mask(w, layers)).count_ones()
            })
            .sum()
    }

    /// The read check of one page through a `PageRef` at `generation`:
    /// `slots` of `layers`.
    #[inline]
    pub fn check_read(
        &self,
        who: RequestId,
        generation: Generation,
        slots: Range<u32>,
        layers: &Range<u32>,
    ) -> ReadCheck {
        loop {
            let cur = self.rec.load();
            let found = if cur.generation() != generation {
                ReadCheck::Fail {
                    kind: ViolationKind::GenerationMismatch,
                    word: cur,
                    slot: None,
                }
            } else if cur.state().is_free() {
                ReadCheck::Fail {
                    kind: ViolationKind::ReadFreePage,
                    word: cur,
                    slot: None,
                }
            } else if cur.state() == PageState::Receiving {
                ReadCheck::Fail {
                    kind: ViolationKind::ReadDuringTransfer,
                    word: cur,
                    slot: None,
                }
            } else if !self.rec.held_by(cur, who) {
                ReadCheck::NotOwner(cur)
            } else {
                match self.first_unwritten(slots.clone(), layers) {
                    None => ReadCheck::Ok,
                    Some(slot) => ReadCheck::Fail {
                        kind: ViolationKind::StaleRead,
                        word: cur,
                        slot: Some(slot),
                    },
                }
            };
            // Validate: nothing moved while owner and bits were read.
            fence(Ordering::Acquire);
            if self.rec.word.load(Ordering::Relaxed) == cur.0 {
                return found;
            }
        }
    }

    /// Bytes land in `slots × layers` for the request `who` through a
    /// `PageRef` at `generation`; the page becomes Receiving.
    ///
    /// # Errors
    /// `write-after-free` if the page was freed (or re-allocated) since,
    /// `foreign-write` if another request holds it; no bits are set then.
    pub fn receive(
        &self,
        who: RequestId,
        generation: Generation,
        slots: Range<u32>,
        layers: &Range<u32>,
    ) -> Result<(), (ViolationKind, StateWord)> {
        let mut cur = self.rec.load();
        loop {
            if cur.generation() != generation || cur.state().is_free() {
                return Err((ViolationKind::WriteAfterFree, cur));
            }
            if !self.rec.held_by(cur, who) {
                return Err((ViolationKind::ForeignWrite, cur));
            }
            let next = cur.with_state(PageState::Receiving);
            if next == cur {
                break;
            }
            match self.rec.cas(cur, next) {
                Ok(()) => break,
                Err(now) => cur = now,
            }
        }
        self.set_bits(slots, layers);
        Ok(())
    }

    /// Receiving → Owned at `generation`; `true` if it was Receiving.
    pub fn commit(&self, generation: Generation) -> bool {
        let mut cur = self.rec.load();
        loop {
            if cur.generation() != generation || cur.state() != PageState::Receiving {
                return false;
            }
            match self.rec.cas(cur, cur.with_state(PageState::Owned)) {
                Ok(()) => return true,
                Err(now) => cur = now,
            }
        }
    }
}

#[cfg(all(test, not(loom)))]
mod tests {
    use super::*;

    fn page(layout: &BitLayout) -> (PageShadow, Vec<AtomicU64>) {
        let bits = (0..layout.stride).map(|_| AtomicU64::new(0)).collect();
        (PageShadow::new(), bits)
    }

    fn view<'a>(rec: &'a PageShadow, bits: &'a [AtomicU64], layout: &'a BitLayout) -> PageView<'a> {
        let (complete, slots) = bits.split_at(layout.complete_words);
        PageView {
            rec,
            complete,
            slots,
            layout,
        }
    }

    #[test]
    fn page_record_is_at_most_64_bytes() {
        assert!(std::mem::size_of::<PageShadow>() <= 64);
        assert_eq!(std::mem::size_of::<PageShadow>(), 24);
    }

    #[test]
    fn state_word_round_trips_fields() {
        let w = StateWord::new(Generation(77), PageState::Receiving, FLAG_SHARED);
        assert_eq!(w.generation(), Generation(77));
        assert_eq!(w.state(), PageState::Receiving);
        assert!(w.has(FLAG_SHARED) && !w.has(FLAG_OWNER_RELEASED));
    }

    #[test]
    fn complete_word_tracks_slots_with_every_layer_written() {
        let layout = BitLayout::new(16, 30);
        let (rec, bits) = page(&layout);
        let view = view(&rec, &bits, &layout);
        let AllocOutcome::Allocated { generation } = view.alloc(Owner::new(1, 1), false) else {
            panic!("fresh page must allocate");
        };
        view.write(RequestId(1), generation, 0..3, &(0..29))
            .unwrap();
        assert_eq!(view.first_unwritten(0..3, &(0..30)), Some(0));
        assert_eq!(view.first_unwritten(0..3, &(0..29)), None);
        view.write(RequestId(1), generation, 0..3, &(29..30))
            .unwrap();
        assert_eq!(view.first_unwritten(0..3, &(0..30)), None);
        assert_eq!(view.first_unwritten(0..4, &(0..30)), Some(3));
        assert_eq!(view.written_layers(1, &(0..30)), 30);
    }

    #[test]
    fn layouts_wider_than_a_word_track_every_layer() {
        let layout = BitLayout::new(100, 130);
        assert_eq!(layout.words_per_slot, 3);
        assert_eq!(layout.complete_words, 2);
        let (rec, bits) = page(&layout);
        let view = view(&rec, &bits, &layout);
        let AllocOutcome::Allocated { generation } = view.alloc(Owner::new(1, 1), false) else {
            panic!("fresh page must allocate");
        };
        view.write(RequestId(1), generation, 60..80, &(0..130))
            .unwrap();
        assert_eq!(view.first_unwritten(60..80, &(0..130)), None);
        assert_eq!(view.first_unwritten(59..80, &(0..130)), Some(59));
        assert_eq!(view.first_unwritten(60..81, &(0..130)), Some(80));
        view.write(RequestId(1), generation, 80..81, &(0..129))
            .unwrap();
        assert_eq!(view.first_unwritten(60..81, &(0..130)), Some(80));
        assert_eq!(view.first_unwritten(60..81, &(64..129)), None);
    }
}
