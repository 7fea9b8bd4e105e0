//! Request lifecycle: the states a request goes through and which moves are
//! legal, kept per request in a concurrent map.
//!
//! ```text
//!  Queued ──> Admitted ──> Prefilling ──> Transferring ──> Decoding ──> Finished
//!    │  ^        │  ^  │        │              ^  │             │
//!    │  └────────┴──┴──┼────────┴──────────────┼──┴─────────────┘ preemption
//!    │                 └──────────────────────>┘    (back to Queued/Admitted)
//!    └──> Rejected          any non-terminal ──> Aborted
//! ```
//!
//! Finished, Rejected and Aborted are terminal. Any event after Rejected or
//! Aborted, and any activity (alloc, write, read, send, receive) after any
//! terminal state, is `terminal-request-activity`; other moves not drawn are
//! `illegal-transition`.
//!
//! Each node keeps its own view of a request ([`Scope`]): the moves are
//! judged per view, and activity in a pool is judged by the view of that
//! pool's node (or by the process's, once it has ended the request).

use std::collections::{HashMap, VecDeque};

use dashmap::DashMap;
use parking_lot::Mutex;
use serde::Serialize;

use crate::ids::{PoolId, RequestId, TenantId};

/// Where a request is in its life. Also the event that moves it there
/// ([`RequestEvent`]).
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, Serialize)]
#[serde(rename_all = "kebab-case")]
pub enum RequestState {
    /// Waiting for admission (also: preempted for recompute).
    Queued,
    /// Admitted: may allocate pages.
    Admitted,
    /// Prompt KV being computed.
    Prefilling,
    /// KV being shipped (prefill side) or received (decode side).
    Transferring,
    /// Generating tokens.
    Decoding,
    /// Done (terminal).
    Finished,
    /// Refused at admission (terminal): never allocates, computes, sends or reads.
    Rejected,
    /// Cancelled (terminal): never allocates, computes, sends or reads again.
    Aborted,
}

/// The event `request_event` reports: the state the request enters.
pub type RequestEvent = RequestState;

/// How a lifecycle move is judged.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Transition {
    /// Legal: the request is now in the new state.
    Legal,
    /// The request is Rejected or Aborted: it may have no further events.
    TerminalActivity,
    /// Not a legal move; the state is unchanged.
    Illegal,
}

impl RequestState {
    /// Finished, Rejected or Aborted.
    #[must_use]
    pub const fn is_terminal(self) -> bool {
        matches!(
            self,
            RequestState::Finished | RequestState::Rejected | RequestState::Aborted
        )
    }

    /// The name used in reports.
    #[must_use]
    pub const fn name(self) -> &'static str {
        match self {
            RequestState::Queued => "queued",
            RequestState::Admitted => "admitted",
            RequestState::Prefilling => "prefilling",
            RequestState::Transferring => "transferring",
            RequestState::Decoding => "decoding",
            RequestState::Finished => "finished",
            RequestState::Rejected => "rejected",
            RequestState::Aborted => "aborted",
        }
    }

    /// Judges the move `self → to`.
    #[must_use]
    pub fn transition(self, to: RequestState) -> Transition {
        use RequestState::*;
        if matches!(self, Rejected | Aborted) {
            return Transition::TerminalActivity;
        }
        let legal = match (self, to) {
            (Finished, _) => false,
            (_, Aborted) => true,
            (from, to) if from == to => true,
            (Queued, Admitted | Rejected) => true,
            (Admitted, Prefilling | Transferring | Decoding | Queued | Finished) => true,
            (Prefilling, Transferring | Decoding | Queued | Admitted | Finished) => true,
            (Transferring, Decoding | Queued | Admitted | Finished) => true,
            (Decoding, Queued | Admitted | Finished) => true,
            _ => false,
        };
        if legal {
            Transition::Legal
        } else {
            Transition::Illegal
        }
    }
}

/// Whose view of a request an event or a check is about.
///
/// A disaggregated request lives on two nodes at once, and a cancel travels
/// between them: decode aborting a request does not stop the prefill node's
/// work for it until prefill has been told. So each node keeps its own view
/// — keyed by the pool its node registered — and a lifecycle event of a
/// node ([`Scope::Pool`]) moves only that node's view. An event that names
/// no pool ([`Scope::Process`], an engine with one node, the plain C
/// `kvsan_request_event`) is the whole process's view, which every node
/// follows.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub enum Scope {
    /// The whole process.
    Process,
    /// The node that owns this pool.
    Pool(PoolId),
}

/// One view of a request: whose, and the state there.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) struct View {
    pub(crate) scope: Scope,
    pub(crate) state: RequestState,
}

/// What the sanitizer knows of one request: its tenant, each view, and the
/// page references it holds in each pool.
#[derive(Clone, Debug, PartialEq, Eq)]
pub(crate) struct RequestRecord {
    pub(crate) tenant: TenantId,
    /// The cache salt the request declared (0: none).
    pub(crate) salt: u64,
    pub(crate) views: Vec<View>,
    held: Vec<(PoolId, u64)>,
}

impl RequestRecord {
    pub(crate) fn new(tenant: TenantId) -> RequestRecord {
        RequestRecord {
            tenant,
            salt: 0,
            views: Vec::with_capacity(2),
            held: Vec::with_capacity(2),
        }
    }

    pub(crate) fn view(&self, scope: Scope) -> Option<&View> {
        self.views.iter().find(|v| v.scope == scope)
    }

    /// The view of `scope`, created in state `first` if there is none.
    pub(crate) fn view_mut(&mut self, scope: Scope, first: RequestState) -> &mut View {
        match self.views.iter().position(|v| v.scope == scope) {
            Some(i) => &mut self.views[i],
            None => {
                self.views.push(View {
                    scope,
                    state: first,
                });
                self.views.last_mut().expect("just pushed")
            }
        }
    }

    /// The state that governs activity in `pool`: the process's view when it
    /// has ended the request, else the pool's node's view, else the
    /// process's.
    pub(crate) fn state_at(&self, pool: PoolId) -> Option<RequestState> {
        let process = self.view(Scope::Process).map(|v| v.state);
        if process.is_some_and(RequestState::is_terminal) {
            return process;
        }
        self.view(Scope::Pool(pool)).map(|v| v.state).or(process)
    }

    /// The state a report shows when no pool is involved: the process's
    /// view, else the latest node view to change.
    pub(crate) fn state(&self) -> Option<RequestState> {
        self.view(Scope::Process)
            .or(self.views.last())
            .map(|v| v.state)
    }

    /// Every view has ended and no page is held: the request can leave the
    /// live map.
    pub(crate) fn is_over(&self) -> bool {
        !self.views.is_empty()
            && self.views.iter().all(|v| v.state.is_terminal())
            && self.held(Scope::Process) == 0
    }

    /// Page references held in `scope`'s pool (in every pool for the
    /// process).
    pub(crate) fn held(&self, scope: Scope) -> u64 {
        self.held
            .iter()
            .filter(|(p, _)| scope == Scope::Process || scope == Scope::Pool(*p))
            .map(|(_, n)| n)
            .sum()
    }

    fn add_held(&mut self, pool: PoolId, delta: i64) {
        match self.held.iter_mut().find(|(p, _)| *p == pool) {
            Some((_, n)) => *n = n.saturating_add_signed(delta),
            None => self.held.push((pool, 0u64.saturating_add_signed(delta))),
        }
    }
}

/// Requests that ended recently, oldest first, at most `cap` of them.
struct Ended {
    cap: usize,
    records: HashMap<RequestId, RequestRecord>,
    order: VecDeque<RequestId>,
}

/// Every request seen: the live ones, keyed by id, and a bounded memory of
/// the ones that ended.
///
/// A request leaves the live map once every view of it has ended and it
/// holds no page; its record is kept among the `ended_requests` most
/// recently ended, so activity after its end is still judged against it
/// (an event, an allocation, a transfer for it: `terminal-request-activity`).
/// Past that many, the oldest is forgotten: activity of a request that
/// ended that long ago is taken as a new request's. So the sanitizer's
/// memory does not grow with the requests served.
///
/// A request first seen through a lifecycle event starts that view from
/// `Queued`; one first seen through an allocation is taken as `Admitted`.
pub(crate) struct Lifecycle {
    requests: DashMap<RequestId, RequestRecord>,
    ended: Mutex<Ended>,
}

impl Lifecycle {
    /// A lifecycle remembering the last `ended_requests` ended requests.
    pub(crate) fn new(ended_requests: usize) -> Lifecycle {
        Lifecycle {
            requests: DashMap::new(),
            ended: Mutex::new(Ended {
                cap: ended_requests,
                records: HashMap::new(),
                order: VecDeque::new(),
            }),
        }
    }

    /// The record of `id`, to update: the live one; else one that ended
    /// recently, brought back so what comes now is judged against its end;
    /// else a new one.
    pub(crate) fn entry(
        &self,
        id: RequestId,
        tenant: TenantId,
    ) -> dashmap::mapref::one::RefMut<'_, RequestId, RequestRecord> {
        if let Some(rec) = self.requests.get_mut(&id) {
            return rec;
        }
        let revived = self.ended.lock().records.remove(&id);
        self.requests
            .entry(id)
            .or_insert_with(|| revived.unwrap_or_else(|| RequestRecord::new(tenant)))
    }

    fn read<T>(&self, id: RequestId, f: impl Fn(&RequestRecord) -> Option<T>) -> Option<T> {
        match self.requests.get(&id) {
            Some(rec) => f(&rec),
            None => self.ended.lock().records.get(&id).and_then(f),
        }
    }

    /// The cache salt `id` declared (0: none, or not known).
    pub(crate) fn salt(&self, id: RequestId) -> u64 {
        self.read(id, |r| Some(r.salt)).unwrap_or(0)
    }

    /// The request's state as reports show it, if known.
    pub(crate) fn state(&self, id: RequestId) -> Option<RequestState> {
        self.read(id, RequestRecord::state)
    }

    /// The state that governs the request's activity in `pool`, if known.
    pub(crate) fn state_at(&self, id: RequestId, pool: PoolId) -> Option<RequestState> {
        self.read(id, |r| r.state_at(pool))
    }

    /// `delta` page references of `id` in `pool`. A request first seen
    /// here is taken as admitted (in the process's view).
    pub(crate) fn add_held(&self, id: RequestId, tenant: TenantId, pool: PoolId, delta: i64) {
        {
            let mut rec = self.entry(id, tenant);
            if rec.views.is_empty() {
                rec.view_mut(Scope::Process, RequestState::Admitted);
            }
            rec.add_held(pool, delta);
        }
        if delta < 0 {
            self.retire_if_over(id);
        }
    }

    /// Moves `id` to the ended requests if every view of it has ended and
    /// it holds no page.
    pub(crate) fn retire_if_over(&self, id: RequestId) {
        let Some((id, rec)) = self.requests.remove_if(&id, |_, r| r.is_over()) else {
            return;
        };
        let mut ended = self.ended.lock();
        if ended.cap == 0 {
            return;
        }
        // Room first, then the new one: the order never holds more than
        // `cap` ids (stale ones aside), so its ring never outgrows `cap`
        // slots. Trimming after the insert took it to `cap + 1` once, which
        // doubled the ring; the doubled ring then touched a new page every
        // 512 requests until it wrapped, `cap` requests later.
        while ended.records.len() >= ended.cap {
            let Some(old) = ended.order.pop_front() else {
                break;
            };
            ended.records.remove(&old);
        }
        if ended.records.insert(id, rec).is_none() {
            ended.order.push_back(id);
        }
        // Ids revived and retired again leave stale entries in the order.
        if ended.order.len() > 2 * ended.cap.max(1) {
            let Ended { records, order, .. } = &mut *ended;
            order.retain(|id| records.contains_key(id));
        }
    }

    /// Requests tracked now: (live, ended and remembered).
    pub(crate) fn tracked(&self) -> (usize, usize) {
        (self.requests.len(), self.ended.lock().records.len())
    }
}

#[cfg(test)]
mod tests {
    use super::RequestState::*;
    use super::*;

    #[test]
    fn the_happy_paths_are_legal() {
        for path in [
            &[Queued, Admitted, Prefilling, Decoding, Finished][..],
            &[Queued, Admitted, Prefilling, Transferring, Finished],
            &[Queued, Admitted, Transferring, Decoding, Finished],
        ] {
            for w in path.windows(2) {
                assert_eq!(w[0].transition(w[1]), Transition::Legal, "{w:?}");
            }
        }
    }

    #[test]
    fn preemption_by_recompute_goes_back_legally() {
        assert_eq!(Decoding.transition(Queued), Transition::Legal);
        assert_eq!(Prefilling.transition(Admitted), Transition::Legal);
    }

    #[test]
    fn rejected_and_aborted_take_no_further_events() {
        for to in [Admitted, Queued, Finished, Aborted] {
            assert_eq!(Rejected.transition(to), Transition::TerminalActivity);
            assert_eq!(Aborted.transition(to), Transition::TerminalActivity);
        }
    }

    #[test]
    fn the_order_of_ended_requests_never_outgrows_the_bound() {
        const CAP: usize = 64;
        let lifecycle = Lifecycle::new(CAP);
        for n in 0..10 * CAP as u64 {
            let id = RequestId(n);
            lifecycle
                .entry(id, TenantId(0))
                .view_mut(Scope::Process, Finished);
            lifecycle.retire_if_over(id);
        }
        assert_eq!(lifecycle.tracked(), (0, CAP));
        let ended = lifecycle.ended.lock();
        assert_eq!(ended.order.len(), CAP);
        // Its ring holds exactly the bound: it never held one more.
        assert_eq!(ended.order.capacity(), CAP);
    }

    #[test]
    fn skipping_admission_is_illegal() {
        assert_eq!(Queued.transition(Transferring), Transition::Illegal);
        assert_eq!(Queued.transition(Prefilling), Transition::Illegal);
        assert_eq!(Finished.transition(Decoding), Transition::Illegal);
    }
}
