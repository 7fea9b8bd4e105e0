//! The shadow of one KV page: a packed atomic state word, the owner, and the
//! written bitmap, with every lock-free transition in one place.
//!
//! Page states: `Free → Owned → (Receiving → Owned) → Quarantined → Free`
//! (`Allocating` is the brief window while `alloc` resets the owner and the
//! bitmap). While the page is shared (`S` below: the prefix cache or a
//! request holds a read-only reference) nobody writes it, its owner
//! included. Transitions are compare-and-swap loops on the state word, so two
//! racing `alloc`s (or `free`s) of one page cannot both succeed.
//!
//! ```text
//!  record (PageShadow, 32 bytes, #[repr(C)])
//!  +0  state word (AtomicU64)
//!   63          39 38  37  36  35 34  32 31                    0
//!  +--------------+---+---+---+---+------+-----------------------+
//!  |   (unused)   | L | S | R | T | state|      generation       |
//!  +--------------+---+---+---+---+------+-----------------------+
//!   T: owner is a terminal request   R: owner released its reference
//!   S: shared read-only (sharers in the pool's sharer table)
//!   L: first write of this generation already seen
//!  +8  owner request (AtomicU64)   +16 owner tenant (AtomicU32)   +20 zero
//!  +24 first kernel write of the generation: step + 1, 0 if none (AtomicU64)
//!
//!  written bitmap, layer-major and packed: bit `layer × page_slots + slot`
//!  of a page's `stride = ceil(layers × page_slots / 64)` AtomicU64 words,
//!  pages back to back (16-slot pages: four layers per word):
//!
//!  page p:  word 0                                 word 1
//!          +---------+---------+---------+---------+---------+----
//!          | layer 0 | layer 1 | layer 2 | layer 3 | layer 4 | ...
//!          | s0..s15 | s0..s15 | s0..s15 | s0..s15 | s0..s15 |
//!          +---------+---------+---------+---------+---------+----
//! ```
//!
//! Layer-major because attention reads one layer at a time: "are slots
//! `0..n` of this page written for layer `l`?" is one load and a mask (two
//! when the layer's bits straddle a word), which is what a kernel can afford
//! per page it touches ([`crate::kernel_shadow`]), and a KV store of one
//! token sets one bit. Packed, it costs `layers × page_slots` bits a page
//! and nothing more (60 bytes for SmolLM2's 30 layers × 16 slots). A check
//! of every layer (a transfer, a host-side read) walks the page's words.
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

/// The per-page shadow record (32 bytes, layout in the module doc; bitmap
/// and history live elsewhere). Kernels read it in place
/// ([`crate::kernel_shadow`]), so its layout is part of the C ABI.
#[repr(C)]
#[derive(Debug)]
pub struct PageShadow {
    word: AtomicU64,
    owner_request: AtomicU64,
    owner_tenant: AtomicU32,
    reserved: AtomicU32,
    first_write_step: AtomicU64,
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
            reserved: AtomicU32::new(0),
            first_write_step: AtomicU64::new(0),
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

    /// The owner's request id alone (one load; kernels compare it with a
    /// reader's or writer's).
    #[must_use]
    #[inline]
    pub fn owner_request(&self) -> RequestId {
        RequestId(self.owner_request.load(Ordering::Relaxed))
    }

    /// The step of the generation's first write by a kernel, taken (reset to
    /// none) so that it is logged once: `None` if there was none since the
    /// last take or allocation.
    pub fn take_first_kernel_write(&self) -> Option<u64> {
        if self.first_write_step.load(Ordering::Relaxed) == 0 {
            return None;
        }
        match self.first_write_step.swap(0, Ordering::Relaxed) {
            0 => None,
            s => Some(s - 1),
        }
    }

    /// Marks the generation written, once: returns `true` for the call
    /// that set [`FLAG_WRITE_LOGGED`] (the generation's first write) if the
    /// page is still at `generation`.
    #[inline]
    pub(crate) fn mark_written(&self, generation: Generation) -> bool {
        let prev = StateWord(self.word.fetch_or(FLAG_WRITE_LOGGED, Ordering::AcqRel));
        !prev.has(FLAG_WRITE_LOGGED) && prev.generation() == generation
    }

    /// A kernel's first write of the generation happened at `step` (logged
    /// later as a history event, off the kernel's path).
    #[inline]
    pub(crate) fn note_kernel_write(&self, step: u64) {
        self.first_write_step
            .store(step.saturating_add(1), Ordering::Relaxed);
    }

    #[inline]
    pub(crate) fn word_now(&self) -> u64 {
        self.word.load(Ordering::Relaxed)
    }

    fn cas(&self, current: StateWord, new: StateWord) -> Result<(), StateWord> {
        self.word
            .compare_exchange(current.0, new.0, Ordering::AcqRel, Ordering::Acquire)
            .map(|_| ())
            .map_err(StateWord)
    }

    #[inline]
    pub(crate) fn held_by(&self, word: StateWord, who: RequestId) -> bool {
        !word.has(FLAG_OWNER_RELEASED) && self.owner_request.load(Ordering::Relaxed) == who.0
    }
}

/// How the written bitmap of a pool is laid out (see the module doc).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct BitLayout {
    /// Slots per page.
    pub page_slots: u32,
    /// Layers per page.
    pub layers: u32,
    /// Words per page: `ceil(layers × page_slots / 64)`.
    pub stride: usize,
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
        BitLayout {
            page_slots,
            layers,
            stride: (u64::from(layers) * u64::from(page_slots)).div_ceil(64) as usize,
        }
    }

    /// The page-relative bit of `slot` in `layer`.
    #[inline]
    #[must_use]
    pub fn bit(&self, layer: u32, slot: u32) -> u64 {
        u64::from(layer) * u64::from(self.page_slots) + u64::from(slot)
    }

    /// The words holding `slots` of `layer`: `(word index in the page, mask)`
    /// for each word the range touches (one, or two when it straddles).
    #[inline]
    pub fn words(&self, layer: u32, slots: Range<u32>) -> impl Iterator<Item = (usize, u64)> {
        let lo = self.bit(layer, slots.start);
        let hi = self.bit(layer, slots.end.max(slots.start));
        (lo / 64..hi.div_ceil(64)).map(move |w| {
            let base = 64 * w;
            let mask = range_mask(
                (lo.clamp(base, base + 64) - base) as u32,
                (hi.clamp(base, base + 64) - base) as u32,
            );
            (w as usize, mask)
        })
    }
}

/// The written bits a check of some slots × layers needs set, word by word
/// within a page (worked out once per hook call, then one load and compare
/// per word of each page checked).
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct Needed {
    words: Vec<(usize, u64)>,
}

impl BitLayout {
    /// What a check of `slots` × `layers` needs.
    #[must_use]
    pub fn needed(&self, slots: Range<u32>, layers: &Range<u32>) -> Needed {
        let mut words = Vec::with_capacity(self.stride.min(16));
        self.for_each_word(slots, layers, |w, m| words.push((w, m)));
        Needed { words }
    }

    /// Calls `f(word, mask)` once for each word of a page holding bits of
    /// `slots` × `layers`, in word order.
    #[inline]
    pub fn for_each_word(
        &self,
        slots: Range<u32>,
        layers: &Range<u32>,
        mut f: impl FnMut(usize, u64),
    ) {
        if slots.is_empty() || layers.is_empty() {
            return;
        }
        let ps = u64::from(self.page_slots);
        if ps <= 64 && 64 % ps == 0 {
            // Whole layers per word: the slots' lane mask, once per layer held.
            let per_word = 64 / ps;
            let lane = range_mask(slots.start, slots.end);
            let (first, last) = (
                u64::from(layers.start) / per_word,
                (u64::from(layers.end) - 1) / per_word,
            );
            for w in first..=last {
                let lo = (w * per_word).max(u64::from(layers.start));
                let hi = ((w + 1) * per_word).min(u64::from(layers.end));
                let mask = (lo..hi).fold(0u64, |m, l| m | lane << ((l - w * per_word) * ps));
                f(w as usize, mask);
            }
            return;
        }
        // Layers straddle words: merge each layer's words in order.
        let mut pending: Option<(usize, u64)> = None;
        for layer in layers.clone() {
            for (w, mask) in self.words(layer, slots.clone()) {
                pending = match pending {
                    Some((pw, pm)) if pw == w => Some((w, pm | mask)),
                    Some((pw, pm)) => {
                        f(pw, pm);
                        Some((w, mask))
                    }
                    None => Some((w, mask)),
                };
            }
        }
        if let Some((pw, pm)) = pending {
            f(pw, pm);
        }
    }
}

/// One page's shadow: record, bitmap words and layout, borrowed together.
#[derive(Clone, Copy, Debug)]
pub struct PageView<'a> {
    /// The record.
    pub rec: &'a PageShadow,
    /// This page's `stride` written words (layer-major, packed).
    pub bits: &'a [AtomicU64],
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
        self.rec.first_write_step.store(0, Ordering::Relaxed);
        for w in self.bits {
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

    /// Sets the written bits of `slots × layers`.
    #[inline]
    pub(crate) fn set_bits(&self, slots: Range<u32>, layers: &Range<u32>) {
        // One read-modify-write per word touched, not per layer.
        self.layout.for_each_word(slots, layers, |w, mask| {
            let word = &self.bits[w];
            // Bits only grow within a generation: skip the locked
            // instruction when they are already there.
            if word.load(Ordering::Relaxed) & mask != mask {
                word.fetch_or(mask, Ordering::Relaxed);
            }
        });
    }

    /// The page's word if `who` may write it through a tag at `generation`:
    /// `generation-mismatch`, `write-after-free`, `foreign-write` (`who` is
    /// not the holding owner, or it is but the page is shared),
    /// `terminal-request-activity` otherwise.
    #[inline]
    fn writable_by(
        &self,
        who: RequestId,
        generation: Generation,
    ) -> Result<StateWord, (ViolationKind, StateWord)> {
        let cur = self.rec.load();
        if cur.generation() != generation {
            return Err((ViolationKind::GenerationMismatch, cur));
        }
        if cur.state().is_free() {
            return Err((ViolationKind::WriteAfterFree, cur));
        }
        if !self.rec.held_by(cur, who) || cur.has(FLAG_SHARED) {
            return Err((ViolationKind::ForeignWrite, cur));
        }
        if cur.has(FLAG_TERMINAL_OWNER) {
            return Err((ViolationKind::TerminalRequestActivity, cur));
        }
        Ok(cur)
    }

    /// A KV write by `who` into `slots × layers` through a `PageRef` at `generation`.
    ///
    /// Returns whether this is the generation's first logged write, or the
    /// violation (no bits are set then): `generation-mismatch`,
    /// `write-after-free`, `foreign-write` (`who` is not the holding owner,
    /// or it is but the page is shared: a page other holders read is
    /// read-only to all), `terminal-request-activity`.
    #[inline]
    pub fn write(
        &self,
        who: RequestId,
        generation: Generation,
        slots: Range<u32>,
        layers: &Range<u32>,
    ) -> Result<bool, (ViolationKind, StateWord)> {
        let cur = self.writable_by(who, generation)?;
        self.set_bits(slots, layers);
        if cur.has(FLAG_WRITE_LOGGED) {
            return Ok(false);
        }
        Ok(self.rec.mark_written(generation))
    }

    /// Whether every bit `needed` names is set.
    #[must_use]
    #[inline]
    pub fn has(&self, needed: &Needed) -> bool {
        needed
            .words
            .iter()
            .all(|&(w, m)| self.bits[w].load(Ordering::Relaxed) & m == m)
    }

    /// The first of `slots` not written for every layer in `layers`.
    #[must_use]
    #[inline]
    pub fn first_unwritten(&self, slots: Range<u32>, layers: &Range<u32>) -> Option<u32> {
        if slots.is_empty() {
            return None;
        }
        // Each layer's first missing slot; the lowest of them.
        layers
            .clone()
            .filter_map(|layer| {
                self.layout
                    .words(layer, slots.clone())
                    .find_map(|(w, mask)| {
                        let missing = !self.bits[w].load(Ordering::Relaxed) & mask;
                        (missing != 0).then(|| {
                            let bit = 64 * w as u64 + u64::from(missing.trailing_zeros());
                            (bit - self.layout.bit(layer, 0)) as u32
                        })
                    })
            })
            .min()
    }

    /// Layers of `slot` written, counted within `layers`.
    #[must_use]
    pub fn written_layers(&self, slot: u32, layers: &Range<u32>) -> u32 {
        layers
            .clone()
            .filter(|&layer| {
                let bit = self.layout.bit(layer, slot);
                self.bits[(bit / 64) as usize].load(Ordering::Relaxed) & (1 << (bit % 64)) != 0
            })
            .count() as u32
    }

    /// The slots written in any layer, as the range from the lowest to the
    /// highest (for a history line), or `None` if none is.
    #[must_use]
    pub fn written_span(&self) -> Option<Range<u32>> {
        let all = 0..self.layout.layers;
        let slots = 0..self.layout.page_slots;
        let any = |s: u32| self.written_layers(s, &all) > 0;
        let lo = slots.clone().find(|&s| any(s))?;
        let hi = slots.rev().find(|&s| any(s))?;
        Some(lo..hi + 1)
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
        let needed = self.layout.needed(slots.clone(), layers);
        self.check_read_needed(who, generation, slots, layers, &needed)
    }

    /// [`PageView::check_read`] with what it needs worked out already
    /// (`needed` is `layout.needed(slots, layers)`).
    #[inline]
    pub fn check_read_needed(
        &self,
        who: RequestId,
        generation: Generation,
        slots: Range<u32>,
        layers: &Range<u32>,
        needed: &Needed,
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
            } else if self.has(needed) {
                ReadCheck::Ok
            } else {
                ReadCheck::Fail {
                    kind: ViolationKind::StaleRead,
                    word: cur,
                    slot: self.first_unwritten(slots.clone(), layers),
                }
            };
            // Validate: nothing moved while owner and bits were read.
            fence(Ordering::Acquire);
            if self.rec.word.load(Ordering::Relaxed) == cur.0 {
                return found;
            }
        }
    }

    /// A transfer for the request `who` is to land in `slots × layers`
    /// through a `PageRef` at `generation`; the page becomes Receiving. With
    /// `mark`, the slots count as written now (a pool whose engine reports
    /// no landing, [`crate::Landing::Manifest`]).
    ///
    /// # Errors
    /// `write-after-free` if the page was freed (or re-allocated) since,
    /// `foreign-write` if another request holds it or it is shared
    /// read-only; no bits are set then.
    pub fn receive(
        &self,
        who: RequestId,
        generation: Generation,
        slots: Range<u32>,
        layers: &Range<u32>,
        mark: bool,
    ) -> Result<(), (ViolationKind, StateWord)> {
        let mut cur = self.rec.load();
        loop {
            if cur.generation() != generation || cur.state().is_free() {
                return Err((ViolationKind::WriteAfterFree, cur));
            }
            if !self.rec.held_by(cur, who) || cur.has(FLAG_SHARED) {
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
        if mark {
            self.set_bits(slots, layers);
        }
        Ok(())
    }

    /// Received KV for the request `who` lands in `slots × layers` through
    /// a `PageRef` at `generation` (a copy about to write, or bytes verified
    /// where they landed): the page must be one `who` holds and reserved
    /// for an incoming transfer (Receiving). With `mark`, the slots count
    /// as written.
    ///
    /// # Errors
    /// `write-after-free` if the page was freed or re-allocated since the
    /// tag, `misdirected-transfer` if another request holds it or `who`
    /// holds it but it is not Receiving, `foreign-write` if it is shared
    /// read-only; no bits are set then.
    pub fn land(
        &self,
        who: RequestId,
        generation: Generation,
        slots: Range<u32>,
        layers: &Range<u32>,
        mark: bool,
    ) -> Result<(), (ViolationKind, StateWord)> {
        let cur = self.rec.load();
        if cur.generation() != generation || cur.state().is_free() {
            return Err((ViolationKind::WriteAfterFree, cur));
        }
        if !self.rec.held_by(cur, who) || cur.state() != PageState::Receiving {
            return Err((ViolationKind::MisdirectedTransfer, cur));
        }
        if cur.has(FLAG_SHARED) {
            return Err((ViolationKind::ForeignWrite, cur));
        }
        if mark {
            self.set_bits(slots, layers);
        }
        Ok(())
    }

    /// The written words now, in the pool's bit layout (what a tier store
    /// carries away).
    #[must_use]
    pub fn written_words(&self) -> Box<[u64]> {
        self.bits
            .iter()
            .map(|w| w.load(Ordering::Relaxed))
            .collect()
    }

    /// A copy by `who` that brings a stored written map (`words`, this
    /// pool's bit layout) back into the page through a tag at
    /// `generation`: checked like [`PageView::write`] (the copy writes
    /// every slot it brings); on success the words' bits are set.
    ///
    /// # Errors
    /// As [`PageView::write`]; no bits are set then.
    pub fn load_words(
        &self,
        who: RequestId,
        generation: Generation,
        words: &[u64],
    ) -> Result<(), (ViolationKind, StateWord)> {
        self.writable_by(who, generation)?;
        for (word, &set) in self.bits.iter().zip(words) {
            if set != 0 && word.load(Ordering::Relaxed) & set != set {
                word.fetch_or(set, Ordering::Relaxed);
            }
        }
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
        PageView { rec, bits, layout }
    }

    #[test]
    fn page_record_is_32_bytes_two_to_a_cache_line() {
        assert_eq!(std::mem::size_of::<PageShadow>(), 32);
        assert_eq!(std::mem::offset_of!(PageShadow, owner_request), 8);
        assert_eq!(std::mem::offset_of!(PageShadow, first_write_step), 24);
    }

    #[test]
    fn state_word_round_trips_fields() {
        let w = StateWord::new(Generation(77), PageState::Receiving, FLAG_SHARED);
        assert_eq!(w.generation(), Generation(77));
        assert_eq!(w.state(), PageState::Receiving);
        assert!(w.has(FLAG_SHARED) && !w.has(FLAG_OWNER_RELEASED));
    }

    #[test]
    fn a_slot_counts_as_written_only_for_the_layers_written() {
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
        assert_eq!(view.written_span(), Some(0..3));
    }

    #[test]
    fn layouts_wider_than_a_word_track_every_layer() {
        let layout = BitLayout::new(100, 130);
        assert_eq!(layout.stride, 204);
        assert_eq!(BitLayout::new(16, 30).stride, 8);
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
        assert_eq!(view.written_layers(80, &(0..130)), 129);
    }

    #[test]
    fn word_masks_are_the_union_of_each_layers_bits_for_any_page_size() {
        for (ps, layers) in [(16, 30), (4, 7), (64, 3), (12, 9), (100, 3), (1, 70)] {
            let l = BitLayout::new(ps, layers);
            for (slots, range) in [(0..ps, 0..layers), (1..ps.min(3), 1..layers), (0..1, 0..1)] {
                let mut want = vec![0u64; l.stride];
                for layer in range.clone() {
                    for (w, m) in l.words(layer, slots.clone()) {
                        want[w] |= m;
                    }
                }
                let mut got = vec![0u64; l.stride];
                let mut order = Vec::new();
                l.for_each_word(slots.clone(), &range, |w, m| {
                    got[w] |= m;
                    order.push(w);
                });
                assert_eq!(
                    got, want,
                    "{ps} slots x {layers} layers, {slots:?} x {range:?}"
                );
                assert!(
                    order.windows(2).all(|p| p[0] < p[1]),
                    "each word once, in order"
                );
            }
        }
    }

    #[test]
    fn a_new_generation_starts_with_no_bits_and_no_kernel_write() {
        let layout = BitLayout::new(16, 2);
        let (rec, bits) = page(&layout);
        let view = view(&rec, &bits, &layout);
        let owner = Owner::new(1, 1);
        let AllocOutcome::Allocated { generation } = view.alloc(owner, false) else {
            panic!("fresh page must allocate");
        };
        view.write(RequestId(1), generation, 0..16, &(0..2))
            .unwrap();
        rec.note_kernel_write(41);
        assert_eq!(
            view.free_by_owner(generation, RequestId(1)),
            FreeOutcome::Released
        );
        assert!(view.leave_quarantine(generation));
        let AllocOutcome::Allocated { .. } = view.alloc(owner, false) else {
            panic!("a free page must allocate");
        };
        assert_eq!(view.first_unwritten(0..16, &(0..2)), Some(0));
        assert_eq!(rec.take_first_kernel_write(), None);
    }
}
