//! A registered pool's shadow: one record, `stride` bitmap words and a
//! history ring per page, the kernels' check counters, the sharer table of
//! the prefix cache, and the quarantine FIFO.

use std::collections::{HashMap, VecDeque};

use parking_lot::Mutex;

use crate::error::SanitizerError;
use crate::geometry::PoolGeometry;
use crate::history::{Event, EventKind, PageHistory};
use crate::ids::{Generation, Owner, PageId, PageRef, PoolId, RequestId};
use crate::kernel_shadow::{KernelCounters, KernelShadow};
use crate::shadow::{BitLayout, FLAG_SHARED, PageShadow, PageView, StateWord};
use crate::sync::AtomicU64;
use crate::transfer::Landing;

pub(crate) struct ShadowPool {
    pub(crate) id: PoolId,
    pub(crate) geometry: PoolGeometry,
    /// Whether the engine reports where received KV lands.
    pub(crate) landing: Landing,
    pub(crate) layout: BitLayout,
    records: Box<[PageShadow]>,
    bits: Box<[AtomicU64]>,
    history: Box<[PageHistory]>,
    counters: KernelCounters,
    /// Read-only sharers per page: (sharer, references held).
    sharers: Mutex<HashMap<u32, Vec<(Owner, u32)>>>,
    /// The cache salt each page's owner declared when it took the page
    /// (0: none).
    salts: Box<[AtomicU64]>,
    quarantine: Mutex<VecDeque<(PageId, Generation)>>,
    quarantine_cap: usize,
}

impl ShadowPool {
    pub(crate) fn new(
        id: PoolId,
        geometry: PoolGeometry,
        landing: Landing,
        history_depth: u32,
        quarantine_pages: u32,
    ) -> ShadowPool {
        let layout = BitLayout::new(geometry.page_slots, geometry.layers);
        let pages = geometry.pages as usize;
        ShadowPool {
            id,
            landing,
            layout,
            records: (0..pages).map(|_| PageShadow::new()).collect(),
            bits: (0..pages * layout.stride)
                .map(|_| AtomicU64::new(0))
                .collect(),
            history: (0..pages)
                .map(|_| PageHistory::new(history_depth))
                .collect(),
            counters: KernelCounters::default(),
            sharers: Mutex::new(HashMap::new()),
            salts: (0..pages).map(|_| AtomicU64::new(0)).collect(),
            quarantine: Mutex::new(VecDeque::new()),
            quarantine_cap: quarantine_pages as usize,
            geometry,
        }
    }

    /// Shadow bytes per page: record, bitmap words and history ring.
    pub(crate) fn bytes_per_page(page_slots: u32, layers: u32, history_depth: u32) -> usize {
        std::mem::size_of::<PageShadow>()
            + BitLayout::new(page_slots, layers).stride * std::mem::size_of::<u64>()
            + PageHistory::bytes_per_page(history_depth)
            + std::mem::size_of::<u64>()
    }

    #[inline(always)]
    pub(crate) fn page(&self, page: PageId) -> Result<PageView<'_>, SanitizerError> {
        let i = page.0 as usize;
        match self.records.get(i) {
            Some(rec) => Ok(PageView {
                rec,
                bits: &self.bits[i * self.layout.stride..(i + 1) * self.layout.stride],
                layout: &self.layout,
            }),
            None => Err(SanitizerError::PageOutOfRange {
                pool: self.id.0,
                page: page.0,
                pages: self.geometry.pages,
            }),
        }
    }

    /// The kernels' view of this pool.
    pub(crate) fn kernel_shadow(&self) -> KernelShadow<'_> {
        KernelShadow::new(&self.records, &self.bits, self.layout, &self.counters)
    }

    /// Checks the kernels counted: (pages read-checked, stores checked).
    pub(crate) fn kernel_checks(&self) -> (u64, u64) {
        (
            self.counters
                .read_pages
                .load(crate::sync::Ordering::Relaxed),
            self.counters.stores.load(crate::sync::Ordering::Relaxed),
        )
    }

    /// Logs the generation's first kernel write, if one is pending, as a
    /// `write` event of the page's owner (kernels only note its step; the
    /// history is written here, off their path). Called before the events
    /// that follow a write in a page's life (send, free) and before a report.
    pub(crate) fn flush_kernel_write(&self, page: PageId) {
        let Ok(view) = self.page(page) else {
            return;
        };
        let Some(step) = view.rec.take_first_kernel_write() else {
            return;
        };
        let slots = view.written_span().map(|r| (r.start, r.end));
        self.log(
            page,
            Event::new(
                EventKind::Write,
                view.rec.owner(),
                view.rec.load().generation(),
                Some(step),
                slots,
            ),
        );
    }

    /// Pages are checked in range before this is called.
    pub(crate) fn log(&self, page: PageId, event: Event) {
        self.history[page.0 as usize].push(event);
    }

    pub(crate) fn history(&self, page: PageId) -> Vec<crate::history::HistoryEvent> {
        self.history[page.0 as usize].snapshot()
    }

    /// Pages are checked in range before this is called.
    pub(crate) fn set_salt(&self, page: PageId, salt: u64) {
        self.salts[page.0 as usize].store(salt, crate::sync::Ordering::Relaxed);
    }

    /// Pages are checked in range before this is called.
    pub(crate) fn salt_of(&self, page: PageId) -> u64 {
        self.salts[page.0 as usize].load(crate::sync::Ordering::Relaxed)
    }

    pub(crate) fn is_sharer(&self, page: PageId, who: RequestId) -> bool {
        self.sharers
            .lock()
            .get(&page.0)
            .is_some_and(|list| list.iter().any(|(o, _)| o.request == who))
    }

    pub(crate) fn sharers_of(&self, page: PageId) -> Vec<Owner> {
        self.sharers
            .lock()
            .get(&page.0)
            .map(|list| list.iter().map(|(o, _)| *o).collect())
            .unwrap_or_default()
    }

    /// Adds one read-only reference of `who` to the page held at `generation`.
    pub(crate) fn add_sharer(
        &self,
        view: PageView<'_>,
        page: PageRef,
        who: Owner,
    ) -> Result<(), StateWord> {
        let mut table = self.sharers.lock();
        view.mark_shared(page.generation)?;
        let list = table.entry(page.page.0).or_default();
        match list.iter_mut().find(|(o, _)| o.request == who.request) {
            Some((_, n)) => *n += 1,
            None => list.push((who, 1)),
        }
        Ok(())
    }

    /// Drops one read-only reference of `who`. `None` if `who` shares nothing
    /// here; `Some(true)` if the page went to quarantine.
    pub(crate) fn drop_sharer(
        &self,
        view: PageView<'_>,
        page: PageRef,
        who: RequestId,
    ) -> Option<bool> {
        let mut table = self.sharers.lock();
        let list = table.get_mut(&page.page.0)?;
        let at = list.iter().position(|(o, _)| o.request == who)?;
        list[at].1 -= 1;
        if list[at].1 == 0 {
            list.swap_remove(at);
        }
        if !list.is_empty() {
            return Some(false);
        }
        table.remove(&page.page.0);
        Some(view.last_sharer_gone(page.generation))
    }

    /// A freed page enters the quarantine FIFO; the oldest beyond the
    /// capacity become Free.
    pub(crate) fn quarantine(&self, page: PageId, generation: Generation) {
        let mut fifo = self.quarantine.lock();
        fifo.push_back((page, generation));
        while fifo.len() > self.quarantine_cap {
            let Some((old, old_gen)) = fifo.pop_front() else {
                break;
            };
            if let Ok(view) = self.page(old) {
                view.leave_quarantine(old_gen);
            }
        }
    }

    /// Pages `who` still holds: as holding owner (`true`) or as sharer (`false`).
    pub(crate) fn pages_held_by(&self, who: RequestId) -> Vec<(PageRef, bool)> {
        let mut held = Vec::new();
        for (i, rec) in self.records.iter().enumerate() {
            let word = rec.load();
            if !word.state().is_free()
                && !word.has(crate::shadow::FLAG_OWNER_RELEASED)
                && rec.owner().request == who
            {
                held.push((PageRef::new(i as u32, word.generation().0), true));
            }
        }
        let table = self.sharers.lock();
        for (page, list) in table.iter() {
            if list.iter().any(|(o, _)| o.request == who) {
                let word = self.records[*page as usize].load();
                if word.has(FLAG_SHARED) {
                    held.push((PageRef::new(*page, word.generation().0), false));
                }
            }
        }
        held.sort_by_key(|(r, _)| r.page);
        held
    }
}
