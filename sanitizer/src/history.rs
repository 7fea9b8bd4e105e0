//! Per-page origin history: a ring of the last `history_depth` events that
//! touched a page (MSan's chained origins, miri's relevant-events-only
//! diagnostics). A report replays it to say who allocated, wrote, sent and
//! freed the page before the fault.
//!
//! Writes are logged once per generation (the first write); the page's slot
//! map shows everything the owner wrote since.

use parking_lot::Mutex;
use serde::Serialize;

use crate::ids::{Generation, Owner, RequestId, TenantId};

/// What happened to a page.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize)]
#[serde(rename_all = "kebab-case")]
#[repr(u8)]
pub enum EventKind {
    /// Taken from the free list by a request (new generation).
    Alloc,
    /// First KV write of the generation by its owner.
    Write,
    /// Slots shipped to another node.
    Send,
    /// A transfer from another node arrived for these slots (reserved).
    Recv,
    /// A copy put received KV into these slots.
    Land,
    /// The receiver committed the transfer.
    Commit,
    /// Shared read-only with another request (prefix cache).
    Share,
    /// A holder let go of the page.
    Free,
    /// A store of the page into a tier block started (`offload`).
    #[serde(rename = "offload")]
    TierStore,
    /// A load from a tier block put KV into the page (`reload`).
    #[serde(rename = "reload")]
    TierLoad,
}

impl EventKind {
    /// The lower-case name used in reports.
    #[must_use]
    pub const fn name(self) -> &'static str {
        match self {
            EventKind::Alloc => "alloc",
            EventKind::Write => "write",
            EventKind::Send => "send",
            EventKind::Recv => "recv",
            EventKind::Land => "land",
            EventKind::Commit => "commit",
            EventKind::Share => "share",
            EventKind::Free => "free",
            EventKind::TierStore => "offload",
            EventKind::TierLoad => "reload",
        }
    }
}

const NO_STEP: u64 = u64::MAX;

/// One history entry, stored compactly (32 bytes).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) struct Event {
    request: u64,
    step: u64,
    tenant: u32,
    generation: u32,
    kind: EventKind,
    slot_start: u16,
    slot_end: u16,
}

impl Event {
    pub(crate) fn new(
        kind: EventKind,
        who: Owner,
        generation: Generation,
        step: Option<u64>,
        slots: Option<(u32, u32)>,
    ) -> Event {
        // Slot indices fit 16 bits: geometry caps page_slots at MAX_PAGE_SLOTS.
        let (slot_start, slot_end) = slots.map_or((0, 0), |(a, b)| (a as u16, b as u16));
        Event {
            request: who.request.0,
            step: step.unwrap_or(NO_STEP),
            tenant: who.tenant.0,
            generation: generation.0,
            kind,
            slot_start,
            slot_end,
        }
    }

    fn public(&self) -> HistoryEvent {
        HistoryEvent {
            kind: self.kind,
            request: RequestId(self.request),
            tenant: TenantId(self.tenant),
            generation: Generation(self.generation),
            step: (self.step != NO_STEP).then_some(self.step),
            slots: (self.slot_end > self.slot_start)
                .then_some((u32::from(self.slot_start), u32::from(self.slot_end))),
        }
    }
}

/// One history entry as a report shows it.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize)]
pub struct HistoryEvent {
    /// What happened.
    pub kind: EventKind,
    /// The request that did it.
    pub request: RequestId,
    /// Its tenant.
    pub tenant: TenantId,
    /// The page's generation at the time.
    pub generation: Generation,
    /// The engine step, where the hook carries one.
    pub step: Option<u64>,
    /// The slot range concerned (`start..end`), where there is one.
    pub slots: Option<(u32, u32)>,
}

struct Ring {
    next: u32,
    len: u32,
    events: Box<[Event]>,
}

/// The history ring of one page.
pub(crate) struct PageHistory {
    ring: Mutex<Ring>,
}

impl PageHistory {
    pub(crate) fn new(depth: u32) -> PageHistory {
        let blank = Event::new(
            EventKind::Alloc,
            Owner::default(),
            Generation(0),
            None,
            None,
        );
        PageHistory {
            ring: Mutex::new(Ring {
                next: 0,
                len: 0,
                events: vec![blank; depth as usize].into_boxed_slice(),
            }),
        }
    }

    pub(crate) fn push(&self, event: Event) {
        let mut ring = self.ring.lock();
        let depth = ring.events.len() as u32;
        if depth == 0 {
            return;
        }
        let at = ring.next as usize;
        ring.events[at] = event;
        ring.next = (ring.next + 1) % depth;
        ring.len = (ring.len + 1).min(depth);
    }

    /// The kept events, oldest first.
    pub(crate) fn snapshot(&self) -> Vec<HistoryEvent> {
        let ring = self.ring.lock();
        let depth = ring.events.len() as u32;
        (0..ring.len)
            .map(|i| ring.events[((ring.next + depth - ring.len + i) % depth) as usize].public())
            .collect()
    }

    /// Bytes one page's history takes: the ring header plus `depth` events.
    pub(crate) fn bytes_per_page(depth: u32) -> usize {
        std::mem::size_of::<PageHistory>() + depth as usize * std::mem::size_of::<Event>()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn event_is_32_bytes() {
        assert_eq!(std::mem::size_of::<Event>(), 32);
    }

    #[test]
    fn ring_keeps_the_last_depth_events_oldest_first() {
        let h = PageHistory::new(3);
        for step in 0..5 {
            h.push(Event::new(
                EventKind::Write,
                Owner::new(step, 1),
                Generation(1),
                Some(step),
                Some((0, 1)),
            ));
        }
        let steps: Vec<_> = h.snapshot().iter().map(|e| e.step.unwrap()).collect();
        assert_eq!(steps, vec![2, 3, 4]);
    }

    #[test]
    fn zero_depth_keeps_nothing() {
        let h = PageHistory::new(0);
        h.push(Event::new(
            EventKind::Free,
            Owner::new(1, 1),
            Generation(1),
            None,
            None,
        ));
        assert!(h.snapshot().is_empty());
    }
}
