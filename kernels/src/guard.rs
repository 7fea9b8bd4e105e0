//! What the KV kernels ask before they touch a page: the [`KvGuard`].
//!
//! The store kernel asks before it writes a token's K and V; the attention
//! kernel asks before it reads a page. Both pass what they were handed —
//! the batch row, the block-table entry or token, the `PageRef`, the slots
//! and the layer — so whatever checks sit behind the guard see the access
//! itself, not a description of it. A refused access is not made; the row
//! it belongs to stops (its later stores and reads are skipped and its
//! attention output is zero) and the guard keeps why.
//!
//! A page outside the pool is never touched, whatever the guard: the kernel
//! calls [`KvGuard::outside`] instead of any check.
//!
//! Three guards here, from none to the pool's own generation array; the
//! sanitizer's in-place check (the kernel shadow) is a guard the engine
//! builds over the same [`RowLedger`].

use std::sync::atomic::{AtomicBool, Ordering};

use std::sync::Mutex;

use kvsan_ids::{Generation, PageRef};

/// One access a kernel was about to make.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Access {
    /// Attention reading slots `0..slots` of a page for `layer`, through
    /// entry `entry` of the row's block table.
    Read {
        /// The block-table entry.
        entry: usize,
        /// The layer.
        layer: usize,
        /// Slots `0..slots`.
        slots: usize,
    },
    /// The store of token `token` (its index in the step's tokens) into
    /// `slot` of a page for `layer`.
    Store {
        /// The token.
        token: usize,
        /// The layer.
        layer: usize,
        /// The slot.
        slot: usize,
    },
}

/// Why an access was refused.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Reason {
    /// The page is outside the pool of `pages` pages (or the entry outside
    /// the block-table array).
    Outside {
        /// Pages in the pool.
        pages: usize,
    },
    /// The `PageRef`'s generation is not the page's `current` one.
    Generation {
        /// The page's generation now.
        current: Generation,
    },
    /// A guard's own check (its owner keeps the details).
    Checked,
}

/// A refused access: the row, the access, the page and why.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Refusal {
    /// The batch row.
    pub row: usize,
    /// What the kernel was about to do.
    pub access: Access,
    /// The `PageRef` it would have used.
    pub page: PageRef,
    /// Why it did not.
    pub reason: Reason,
}

/// Which rows of a batch still run, and why the others stopped.
#[derive(Debug)]
pub struct RowLedger {
    dead: Box<[AtomicBool]>,
    refusals: Mutex<Vec<Refusal>>,
}

impl RowLedger {
    /// A ledger for `rows` rows, all running.
    #[must_use]
    pub fn new(rows: usize) -> RowLedger {
        RowLedger {
            dead: (0..rows).map(|_| AtomicBool::new(false)).collect(),
            refusals: Mutex::new(Vec::new()),
        }
    }

    /// Whether `row` still runs.
    #[inline]
    #[must_use]
    pub fn live(&self, row: usize) -> bool {
        self.dead
            .get(row)
            .is_some_and(|d| !d.load(Ordering::Relaxed))
    }

    /// Stops `row`: `access` through `page` is outside the pool of `pages`
    /// pages (or the block-table array).
    #[cold]
    pub fn outside(&self, row: usize, access: Access, page: PageRef, pages: usize) {
        self.refuse(Refusal {
            row,
            access,
            page,
            reason: Reason::Outside { pages },
        });
    }

    /// Stops `row` for `refusal`; only a row's first refusal is kept.
    #[cold]
    pub fn refuse(&self, refusal: Refusal) {
        if let Some(d) = self.dead.get(refusal.row)
            && !d.swap(true, Ordering::Relaxed)
        {
            self.refusals
                .lock()
                .unwrap_or_else(std::sync::PoisonError::into_inner)
                .push(refusal);
        }
    }

    /// Every row's first refusal, by row.
    #[must_use]
    pub fn refusals(&self) -> Vec<Refusal> {
        let mut all = self
            .refusals
            .lock()
            .unwrap_or_else(std::sync::PoisonError::into_inner)
            .clone();
        all.sort_by_key(|r| r.row);
        all
    }
}

/// What a kernel asks before it touches KV memory (see the module doc).
pub trait KvGuard: Sync {
    /// Where the rows' state and refusals are kept.
    fn ledger(&self) -> &RowLedger;
    /// Whether `row` still runs.
    #[inline]
    fn live(&self, row: usize) -> bool {
        self.ledger().live(row)
    }
    /// Before `row` reads slots `0..slots` of `page` (block-table entry
    /// `entry`) for `layer`: `true` to read.
    fn read(&self, row: usize, entry: usize, page: PageRef, layer: usize, slots: usize) -> bool;
    /// Before the store of `token` (of `row`) into `slot` of `page` for
    /// `layer`: `true` to store.
    fn store(&self, row: usize, token: usize, page: PageRef, slot: usize, layer: usize) -> bool;
    /// `row` was about to make `access` through `page`, which is outside
    /// the pool of `pages` pages: the access is not made and the row stops.
    fn outside(&self, row: usize, access: Access, page: PageRef, pages: usize) {
        self.ledger().outside(row, access, page, pages);
    }
    /// Checks one kernel task made (reads of pages, stores), for counters.
    #[inline]
    fn count(&self, read_pages: u64, stores: u64) {
        let _ = (read_pages, stores);
    }
}

/// No check beyond the pool's bounds (release builds).
#[derive(Debug)]
pub struct Unchecked<'a> {
    /// Where refusals go.
    pub ledger: &'a RowLedger,
}

impl KvGuard for Unchecked<'_> {
    fn ledger(&self) -> &RowLedger {
        self.ledger
    }

    #[inline]
    fn read(&self, _: usize, _: usize, _: PageRef, _: usize, _: usize) -> bool {
        true
    }

    #[inline]
    fn store(&self, _: usize, _: usize, _: PageRef, _: usize, _: usize) -> bool {
        true
    }
}

/// Compares every `PageRef` with the pool's generation array before the
/// page is touched: a tag from before the page was freed and re-allocated
/// is refused (the in-kernel tag check of a debug build, with no sanitizer).
#[derive(Debug)]
pub struct GenerationChecked<'a> {
    /// Where refusals go.
    pub ledger: &'a RowLedger,
    /// The pool's current generation of every page.
    pub generations: &'a [Generation],
}

impl GenerationChecked<'_> {
    #[inline]
    fn check(&self, row: usize, access: Access, page: PageRef) -> bool {
        match self.generations.get(page.page.0 as usize) {
            Some(&current) if current == page.generation => true,
            Some(&current) => {
                self.ledger.refuse(Refusal {
                    row,
                    access,
                    page,
                    reason: Reason::Generation { current },
                });
                false
            }
            None => {
                self.ledger
                    .outside(row, access, page, self.generations.len());
                false
            }
        }
    }
}

impl KvGuard for GenerationChecked<'_> {
    fn ledger(&self) -> &RowLedger {
        self.ledger
    }

    #[inline]
    fn read(&self, row: usize, entry: usize, page: PageRef, layer: usize, slots: usize) -> bool {
        self.check(
            row,
            Access::Read {
                entry,
                layer,
                slots,
            },
            page,
        )
    }

    #[inline]
    fn store(&self, row: usize, token: usize, page: PageRef, slot: usize, layer: usize) -> bool {
        self.check(row, Access::Store { token, layer, slot }, page)
    }
}
