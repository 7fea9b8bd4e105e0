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

use dashmap::DashMap;
use serde::Serialize;

use crate::ids::{RequestId, TenantId};

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

/// What the sanitizer knows of one request.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) struct RequestRecord {
    pub(crate) state: RequestState,
    pub(crate) tenant: TenantId,
    /// Page references held (ownerships plus shares), in every pool.
    pub(crate) held: u64,
}

/// Every request seen, keyed by id. A request first seen through a lifecycle
/// event starts from `Queued`; one first seen through an allocation is taken
/// as `Admitted`.
#[derive(Default)]
pub(crate) struct Lifecycle {
    pub(crate) requests: DashMap<RequestId, RequestRecord>,
}

impl Lifecycle {
    /// The request's state, if known.
    pub(crate) fn state(&self, id: RequestId) -> Option<RequestState> {
        self.requests.get(&id).map(|r| r.state)
    }

    pub(crate) fn add_held(&self, id: RequestId, tenant: TenantId, delta: i64) {
        let mut rec = self.requests.entry(id).or_insert(RequestRecord {
            state: RequestState::Admitted,
            tenant,
            held: 0,
        });
        rec.held = rec.held.saturating_add_signed(delta);
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
    fn skipping_admission_is_illegal() {
        assert_eq!(Queued.transition(Transferring), Transition::Illegal);
        assert_eq!(Queued.transition(Prefilling), Transition::Illegal);
        assert_eq!(Finished.transition(Decoding), Transition::Illegal);
    }
}
