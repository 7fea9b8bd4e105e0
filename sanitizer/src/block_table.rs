//! Block tables: a request's pages in token order, and the one place that
//! says which pages and slots hold tokens `a..b`.
//!
//! ```text
//!  tokens      0 ........ 15 | 16 ........ 31 | 32 ... 37
//!  table      [ page 9@gen 3 ][ page 4@gen 7 ][ page 12@gen 1 ]     page_slots = 16
//!  spans(20..38) = (entry 1, page 4@gen 7, slots 4..16), (entry 2, page 12@gen 1, slots 0..6)
//! ```
//!
//! A [`BlockTable`] only grows while its request holds the pages (entries
//! are never rewritten, as in vLLM's append-only block tables); giving the
//! pages back empties it at once ([`BlockTable::take`]). Every table has an
//! epoch, fresh at creation, at each `take` and for each clone, so a copy
//! kept elsewhere (a batch's block-table array) can tell "the same table,
//! grown" from "another table".

use std::ops::Range;
use std::sync::atomic::{AtomicU64, Ordering};

use crate::ids::PageRef;

/// One page a token range touches.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Span {
    /// The entry of the table.
    pub entry: usize,
    /// The page there.
    pub page: PageRef,
    /// The slots of the page the range covers.
    pub slots: Range<u32>,
}

/// The spans of tokens `tokens` over `pages` of `page_slots` slots, in token
/// order. Entries past the end of `pages` are not produced (a range beyond
/// the table stops at its end).
pub fn spans(
    pages: &[PageRef],
    tokens: Range<u64>,
    page_slots: u32,
) -> impl Iterator<Item = Span> + '_ {
    entry_slots(tokens, page_slots).map_while(move |(entry, slots)| {
        Some(Span {
            entry,
            page: *pages.get(entry)?,
            slots,
        })
    })
}

/// `(entry, slots)` for every page tokens `tokens` touch, whatever the table.
pub fn entry_slots(
    tokens: Range<u64>,
    page_slots: u32,
) -> impl Iterator<Item = (usize, Range<u32>)> {
    let ps = u64::from(page_slots.max(1));
    let first = tokens.start / ps;
    let end = tokens.end.div_ceil(ps);
    (first..end).filter_map(move |p| {
        let lo = tokens.start.max(p * ps) - p * ps;
        let hi = tokens.end.min((p + 1) * ps) - p * ps;
        (hi > lo).then_some((p as usize, lo as u32..hi as u32))
    })
}

static NEXT_EPOCH: AtomicU64 = AtomicU64::new(1);

fn fresh_epoch() -> u64 {
    NEXT_EPOCH.fetch_add(1, Ordering::Relaxed)
}

/// A request's pages in one pool, from token 0 (see the module doc).
#[derive(Debug, PartialEq, Eq)]
pub struct BlockTable {
    pages: Vec<PageRef>,
    page_slots: u32,
    epoch: u64,
}

impl Clone for BlockTable {
    /// A copy with its own epoch: once apart, the two may grow differently.
    fn clone(&self) -> BlockTable {
        BlockTable {
            pages: self.pages.clone(),
            page_slots: self.page_slots,
            epoch: fresh_epoch(),
        }
    }
}

impl BlockTable {
    /// An empty table for a pool of `page_slots`-slot pages.
    #[must_use]
    pub fn new(page_slots: usize) -> BlockTable {
        BlockTable {
            pages: Vec::new(),
            page_slots: page_slots.max(1) as u32,
            epoch: fresh_epoch(),
        }
    }

    /// Appends a page.
    pub fn push(&mut self, page: PageRef) {
        self.pages.push(page);
    }

    /// Hands every page back and empties the table (a new epoch).
    pub fn take(&mut self) -> Vec<PageRef> {
        self.epoch = fresh_epoch();
        std::mem::take(&mut self.pages)
    }

    /// The pages, from token 0.
    #[must_use]
    pub fn pages(&self) -> &[PageRef] {
        &self.pages
    }

    /// Entries.
    #[must_use]
    pub fn len(&self) -> usize {
        self.pages.len()
    }

    /// No pages.
    #[must_use]
    pub fn is_empty(&self) -> bool {
        self.pages.is_empty()
    }

    /// Slots per page.
    #[must_use]
    pub fn page_slots(&self) -> usize {
        self.page_slots as usize
    }

    /// Which table this is (see the module doc).
    #[must_use]
    pub fn epoch(&self) -> u64 {
        self.epoch
    }

    /// Tokens the pages hold.
    #[must_use]
    pub fn capacity(&self) -> usize {
        self.pages.len() * self.page_slots as usize
    }

    /// Entries needed to hold `tokens` tokens.
    #[must_use]
    pub fn entries_for(&self, tokens: usize) -> usize {
        tokens.div_ceil(self.page_slots as usize)
    }

    /// The page and slot of token `pos`, if the table reaches it.
    #[must_use]
    pub fn slot_of(&self, pos: usize) -> Option<(PageRef, u32)> {
        let ps = self.page_slots as usize;
        Some((*self.pages.get(pos / ps)?, (pos % ps) as u32))
    }

    /// The pages and slots holding tokens `tokens`.
    pub fn spans(&self, tokens: Range<usize>) -> impl Iterator<Item = Span> + '_ {
        spans(
            &self.pages,
            tokens.start as u64..tokens.end as u64,
            self.page_slots,
        )
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn token_ranges_split_over_pages_like_the_drawing() {
        let mut t = BlockTable::new(16);
        for (p, g) in [(9, 3), (4, 7), (12, 1)] {
            t.push(PageRef::new(p, g));
        }
        let got: Vec<Span> = t.spans(20..38).collect();
        assert_eq!(
            got,
            vec![
                Span {
                    entry: 1,
                    page: PageRef::new(4, 7),
                    slots: 4..16
                },
                Span {
                    entry: 2,
                    page: PageRef::new(12, 1),
                    slots: 0..6
                },
            ]
        );
        assert_eq!(t.spans(0..0).count(), 0);
        assert_eq!(t.spans(40..60).count(), 1, "stops at the table's end");
        assert_eq!(t.slot_of(37), Some((PageRef::new(12, 1), 5)));
        assert_eq!(t.slot_of(48), None);
        assert_eq!(t.entries_for(33), 3);
        assert_eq!(t.capacity(), 48);
    }

    #[test]
    fn take_and_clone_give_a_new_epoch() {
        let mut t = BlockTable::new(16);
        t.push(PageRef::new(1, 1));
        let e = t.epoch();
        let c = t.clone();
        assert_ne!(c.epoch(), e);
        assert_eq!(c.pages(), t.pages());
        assert_eq!(t.take(), vec![PageRef::new(1, 1)]);
        assert!(t.is_empty());
        assert_ne!(t.epoch(), e);
    }
}
