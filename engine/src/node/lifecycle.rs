//! Each request's life on one node: the engine's one request state machine.
//! Nothing else sets a request's state; every move is checked legal here,
//! and each move's lifecycle event goes to the hooks from here, once.
//!
//! The paths each role takes (a recompute after preemption runs on the
//! node that decodes):
//!
//! ```text
//!  unified   Queued ─> Admitted ─> Prefilling ─> Decoding ─> Finished
//!  prefill   Queued ─> Admitted ─> Prefilling ─> Transferring ─> Finished
//!  decode    Queued ─> Admitted ─> Transferring ─> Decoding ─> Finished
//!                                      └─> Draining ─> Cancelled
//!
//!  every role   (not live) ──> Rejected | Cancelled | Aborted      refused before it was queued
//!               any live state ──> Cancelled | Aborted               cancelled, or failed
//!  every role   Admitted | Prefilling ──> Queued                     the pool disagreed, or preempted
//!  unified,     Decoding ──> Queued ──> Admitted ──> Prefilling      preempted, then recomputed
//!  decode       Prefilling ──> Decoding                              the recompute's token sampled
//! ```
//!
//! | move | made by | event reported |
//! | --- | --- | --- |
//! | → Queued | submission ([`Lifecycle::queue`]); preemption, or a pool that could not hold what admission planned (requeue) | `queued` |
//! | → Rejected, Cancelled, Aborted (not live) | a request refused, cancelled or failed before it was queued ([`Lifecycle::refuse`]) | `rejected`, `aborted`, `aborted` |
//! | Queued → Admitted | the scheduler's admission; decode's page reservation | `admitted` |
//! | Admitted → Prefilling | the scheduler's admission (its first chunk is planned) | `prefilling` |
//! | Prefilling → Decoding | the prompt's (or recompute's) last chunk sampled a token ([`Lifecycle::token_sampled`]) | `decoding` |
//! | Prefilling → Transferring | prefill: the prompt is computed, its KV ships | `transferring` |
//! | Admitted → Transferring | decode: the prefill order goes out, the KV is on its way | `transferring` |
//! | Transferring → Decoding | decode: the KV is committed | `decoding` |
//! | Transferring → Finished | prefill: the KV is shipped | `finished` |
//! | Transferring → Draining | decode: cancelled with its KV on the way; its client is answered, its pages stay until prefill acknowledges | none: the pages are still the request's and KV may still land in them |
//! | Draining → Cancelled | decode: prefill acknowledged, the pages are freed | `aborted` |
//! | Decoding → Finished | the last token | `finished` |
//! | live → Cancelled, Aborted | a cancel; a failure or a violation ([`Lifecycle::fail`]) | `aborted` |
//!
//! A terminal move is reported after the request's pages went back, so the
//! hook target judges a `page-leak` on what the request really still holds.
//!
//! # What the lifecycle judges, and what it leaves to the sanitizer
//!
//! The lifecycle judges *moves*. A move the correct engine never makes —
//! admitting a request that is not queued, finishing one that never
//! decoded, moving a request that is not live — is an engine bug: it is
//! refused (the state stays, nothing is reported), logged at error level,
//! counted ([`crate::node::NodeStats::illegal_transitions`]) and returned
//! as [`Refused::Illegal`], and the caller ends the request. It never
//! panics, in a debug build either: a node serving other requests goes on,
//! and the fault-injection tests run the very bugs that make such moves.
//!
//! It does not judge *activity*: an allocation, a computed token, a
//! transfer or a commit for a request in the wrong state are page events,
//! which the hooks see, and `terminal-request-activity` is the sanitizer's
//! verdict on them. And it keeps live requests only: a request that ended
//! is forgotten (the node's memory does not grow with the requests it
//! served), so to it a request queued again under an ended request's id is
//! a new one. Remembering ended requests, and catching what is done for
//! them, is the sanitizer's job (its `ended_requests`).
//!
//! That is the line fault injection keeps: the lifecycle describes the
//! correct engine, and has no fail point. The lifecycle bugs the faults
//! re-create are callers doing the wrong thing — queueing a rejected
//! request again as a placeholder (`reject-as-placeholder`), committing
//! from a record kept outside the lifecycle without asking it
//! (`commit-after-abort`), freeing pages a transfer still writes
//! (`free-during-transfer`), freeing a page twice (`double-free`), keeping
//! a freed block table (`stale-block-table`) — and what they do to pages
//! only the sanitizer sees.

use std::collections::HashMap;

use kvsan_sanitizer::{NodeRole, Owner, PoolId, RequestId, Verdict, ViolationKind};

use crate::hooks::{Hooks, RequestEvent};
use crate::request::{ErrorKind, RequestError};

/// Where a request is in its life on one node.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub(crate) enum State {
    /// Waiting for admission (also: preempted, waiting to be recomputed).
    Queued,
    /// Admitted: may take pages.
    Admitted,
    /// Its prompt's KV (or a recompute's) is being computed here.
    Prefilling,
    /// Its KV is being shipped (prefill) or is on its way in (decode).
    Transferring,
    /// Decode: cancelled while its KV was on its way. Its client has its
    /// answer; its pages stay reserved until prefill acknowledges the
    /// cancel, so KV already on the wire lands in pages it still holds.
    Draining,
    /// Generating tokens.
    Decoding,
    /// Done (terminal).
    Finished,
    /// Refused by admission control before it was queued (terminal).
    Rejected,
    /// Cancelled by its client, or by decode on a prefill node (terminal).
    Cancelled,
    /// Ended by a failure or a violation (terminal).
    Aborted,
}

impl State {
    /// Finished, Rejected, Cancelled or Aborted.
    #[must_use]
    pub const fn is_terminal(self) -> bool {
        matches!(
            self,
            State::Finished | State::Rejected | State::Cancelled | State::Aborted
        )
    }

    /// The lower-case name used in logs and errors.
    #[must_use]
    pub const fn name(self) -> &'static str {
        match self {
            State::Queued => "queued",
            State::Admitted => "admitted",
            State::Prefilling => "prefilling",
            State::Transferring => "transferring",
            State::Draining => "draining",
            State::Decoding => "decoding",
            State::Finished => "finished",
            State::Rejected => "rejected",
            State::Cancelled => "cancelled",
            State::Aborted => "aborted",
        }
    }

    /// The lifecycle event the hooks get for entering this state. The
    /// sanitizer's vocabulary has no `cancelled` (a cancel is an abort to
    /// it) and no `draining` (a draining request's pages are still its own:
    /// its view stays `transferring` until the request ends).
    #[must_use]
    pub const fn event(self) -> Option<RequestEvent> {
        Some(match self {
            State::Queued => RequestEvent::Queued,
            State::Admitted => RequestEvent::Admitted,
            State::Prefilling => RequestEvent::Prefilling,
            State::Transferring => RequestEvent::Transferring,
            State::Draining => return None,
            State::Decoding => RequestEvent::Decoding,
            State::Finished => RequestEvent::Finished,
            State::Rejected => RequestEvent::Rejected,
            State::Cancelled | State::Aborted => RequestEvent::Aborted,
        })
    }

    /// Whether a live request in this state may move to `to` on a node of
    /// `role` (the table in the module's documentation).
    #[must_use]
    pub fn may_move(self, role: NodeRole, to: State) -> bool {
        use NodeRole::{Decode, Prefill};
        use State::*;
        match (self, to) {
            (Draining, Cancelled | Aborted) => role == Decode,
            (Draining, _) => false,
            (_, Cancelled | Aborted) => true,
            (Queued, Admitted) | (Admitted | Prefilling, Queued) => true,
            (Admitted, Prefilling) => true,
            (Admitted, Transferring) | (Transferring, Decoding | Draining) => role == Decode,
            (Prefilling, Transferring) | (Transferring, Finished) => role == Prefill,
            (Prefilling, Decoding) | (Decoding, Queued | Finished) => role != Prefill,
            _ => false,
        }
    }
}

impl std::fmt::Display for State {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(self.name())
    }
}

/// A move the correct engine never makes, refused by the lifecycle.
#[derive(Clone, Debug, PartialEq, Eq, thiserror::Error)]
#[error(
    "the {node} node's lifecycle refused to move {request} from {} to {to}: not a move this engine makes (an engine bug)",
    from.map_or("not live (never queued, or ended)", State::name)
)]
pub(crate) struct IllegalTransition {
    /// The node whose lifecycle refused it.
    pub node: String,
    /// The request.
    pub request: RequestId,
    /// Its state there; `None` when it is not live there.
    pub from: Option<State>,
    /// The state the caller asked for.
    pub to: State,
}

/// Why a move did not go through cleanly.
#[derive(Clone, Debug, PartialEq, Eq)]
pub(crate) enum Refused {
    /// Not a move this engine makes: nothing was recorded or reported.
    Illegal(IllegalTransition),
    /// The move was made and reported, and the hook target's verdict
    /// aborts the request: this is its client's error.
    Violation(RequestError),
}

impl From<Refused> for RequestError {
    fn from(refused: Refused) -> RequestError {
        match refused {
            Refused::Illegal(e) => RequestError::new(ErrorKind::Internal, e.to_string()),
            Refused::Violation(e) => e,
        }
    }
}

/// Whether a move is a request's first on the node or a live request's.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
enum Entry {
    /// The request must not be live: it is queued, or refused at once.
    New,
    /// The request must be live, in a state the move may leave.
    Live,
}

/// The live requests of one node and their states.
#[derive(Debug)]
pub(crate) struct Lifecycle {
    role: NodeRole,
    node: String,
    pool: PoolId,
    hooks: Hooks,
    live: HashMap<RequestId, State>,
    illegal: u64,
}

impl Lifecycle {
    /// The lifecycle of the `role` node `node`, whose events the hooks get
    /// in the view of `pool` (the node's own pool).
    pub fn new(role: NodeRole, node: &str, pool: PoolId, hooks: Hooks) -> Lifecycle {
        Lifecycle {
            role,
            node: node.to_string(),
            pool,
            hooks,
            live: HashMap::new(),
            illegal: 0,
        }
    }

    /// The state of `request`; `None` when it is not live here.
    pub fn state(&self, request: RequestId) -> Option<State> {
        self.live.get(&request).copied()
    }

    /// Moves refused since the node started.
    pub fn illegal_transitions(&self) -> u64 {
        self.illegal
    }

    /// A request that is not live here joins the queue.
    pub fn queue(&mut self, owner: Owner) -> Result<(), Refused> {
        self.go(owner, Entry::New, State::Queued, true)
    }

    /// A request that is not live here ends before it was queued: rejected
    /// by admission control, cancelled, or failed (an invalid request, no
    /// prefill node) as `error` says.
    pub fn refuse(&mut self, owner: Owner, error: &RequestError) -> Result<(), Refused> {
        let to = match error.kind {
            ErrorKind::Rejected => State::Rejected,
            ErrorKind::Cancelled => State::Cancelled,
            _ => State::Aborted,
        };
        self.go(owner, Entry::New, to, true)
    }

    /// A live request moves to `to`.
    pub fn enter(&mut self, owner: Owner, to: State) -> Result<(), Refused> {
        self.go(owner, Entry::Live, to, true)
    }

    /// A token was sampled for a request: one that was prefilling (its
    /// prompt, or a recompute) has started decoding. The one move the
    /// lifecycle infers, because whether the chunk that sampled was a
    /// prefill's last is the request's state, which lives here. In any
    /// other state this is no move: a decoding request goes on, and a
    /// token computed for a request that should compute nothing is
    /// activity, the hooks' to judge.
    pub fn token_sampled(&mut self, owner: Owner) -> Result<(), Refused> {
        if self.state(owner.request) == Some(State::Prefilling) {
            self.enter(owner, State::Decoding)
        } else {
            Ok(())
        }
    }

    /// A live request ends with `error`: cancelled when its kind says so,
    /// aborted otherwise. A request the hook target caught acting after its
    /// rejection or abort (`terminal-request-activity`) is already ended
    /// there: its end is recorded here and not reported, which would only
    /// report the same breach again.
    pub fn fail(&mut self, owner: Owner, error: &RequestError) -> Result<(), Refused> {
        let to = if error.kind == ErrorKind::Cancelled {
            State::Cancelled
        } else {
            State::Aborted
        };
        let report = error
            .violation
            .is_none_or(|v| v.kind != ViolationKind::TerminalRequestActivity);
        self.go(owner, Entry::Live, to, report)
    }

    /// Moves `owner`'s request to `to` if that is legal, and reports the
    /// move's event unless `report` is false.
    fn go(&mut self, owner: Owner, entry: Entry, to: State, report: bool) -> Result<(), Refused> {
        let from = self.state(owner.request);
        let legal = match (entry, from) {
            (Entry::New, None) => true,
            (Entry::Live, Some(from)) => from.may_move(self.role, to),
            _ => false,
        };
        if !legal {
            return Err(self.illegal(owner, from, to));
        }
        if to.is_terminal() {
            self.live.remove(&owner.request);
        } else {
            self.live.insert(owner.request, to);
        }
        let Some(event) = to.event().filter(|_| report) else {
            return Ok(());
        };
        match self.hooks.request_event(self.pool, owner, event) {
            Verdict::Continue => Ok(()),
            verdict => Err(Refused::Violation(RequestError::aborted_by(
                verdict, &self.node,
            ))),
        }
    }

    #[cold]
    fn illegal(&mut self, owner: Owner, from: Option<State>, to: State) -> Refused {
        self.illegal += 1;
        let e = IllegalTransition {
            node: self.node.clone(),
            request: owner.request,
            from,
            to,
        };
        tracing::error!(node = %self.node, request = owner.request.0, tenant = owner.tenant.0, "{e}");
        Refused::Illegal(e)
    }
}

#[cfg(test)]
mod tests {
    use std::sync::{Arc, Mutex};

    use kvsan_sanitizer::{
        KernelAccess, Manifest, PageLanding, PageRef, PoolGeometry, TenantId, TierBlockId,
        ViolationId, ViolationKind,
    };

    use super::*;
    use crate::hooks::{KernelShadowHandle, KvHooks};
    use crate::request::Violated;

    const POOL: PoolId = PoolId(7);
    const OWNER: Owner = Owner {
        request: RequestId(42),
        tenant: TenantId(3),
    };

    /// A hook target that records every lifecycle event and aborts the
    /// request on `abort_on`.
    #[derive(Default)]
    struct Recording {
        events: Mutex<Vec<(PoolId, Owner, RequestEvent)>>,
        abort_on: Option<RequestEvent>,
    }

    impl KvHooks for Recording {
        fn pool_register(&self, _: &PoolGeometry) -> Option<PoolId> {
            Some(POOL)
        }
        fn request_event(&self, pool: PoolId, owner: Owner, event: RequestEvent) -> Verdict {
            self.events.lock().unwrap().push((pool, owner, event));
            if self.abort_on == Some(event) {
                Verdict::Abort {
                    violation: ViolationId::next(),
                    kind: ViolationKind::PageLeak,
                }
            } else {
                Verdict::Continue
            }
        }
        fn alloc(&self, _: PoolId, _: Owner, _: PageRef, _: u64) -> Verdict {
            Verdict::Continue
        }
        fn free(&self, _: PoolId, _: Owner, _: PageRef, _: u64) -> Verdict {
            Verdict::Continue
        }
        fn kernel_shadow(&self, _: PoolId) -> Option<KernelShadowHandle> {
            None
        }
        fn kernel_refusal(&self, _: PoolId, _: Owner, _: &KernelAccess, _: u64) -> Verdict {
            Verdict::Continue
        }
        fn transfer_send(&self, _: PoolId, _: &Manifest) -> Verdict {
            Verdict::Continue
        }
        fn transfer_recv(&self, _: PoolId, _: &Manifest) -> Verdict {
            Verdict::Continue
        }
        fn transfer_land(&self, _: PoolId, _: &PageLanding) -> Verdict {
            Verdict::Continue
        }
        fn transfer_verify(&self, _: PoolId, _: &PageLanding) -> Verdict {
            Verdict::Continue
        }
        fn transfer_commit(&self, _: PoolId, _: Owner, _: &[PageRef], _: usize) -> Verdict {
            Verdict::Continue
        }
        fn share(&self, _: PoolId, _: PageRef, _: Owner) -> Verdict {
            Verdict::Continue
        }
        fn declare_salt(&self, _: Owner, _: u64) -> Verdict {
            Verdict::Continue
        }
        fn tier_store(&self, _: PoolId, _: Owner, _: PageRef, _: TierBlockId, _: u64) -> Verdict {
            Verdict::Continue
        }
        fn tier_store_done(&self, _: TierBlockId, _: u64, _: bool) -> Verdict {
            Verdict::Continue
        }
        fn tier_load(&self, _: PoolId, _: Owner, _: PageRef, _: TierBlockId, _: u64) -> Verdict {
            Verdict::Continue
        }
        fn tier_verify(&self, _: PoolId, _: Owner, _: PageRef, _: TierBlockId, _: u64) -> Verdict {
            Verdict::Continue
        }
        fn tier_release(&self, _: TierBlockId) -> Verdict {
            Verdict::Continue
        }
    }

    impl Recording {
        /// The events reported, checking each came for `OWNER` in `POOL`.
        fn events(&self) -> Vec<RequestEvent> {
            let events = self.events.lock().unwrap();
            assert!(
                events
                    .iter()
                    .all(|&(pool, owner, _)| pool == POOL && owner == OWNER)
            );
            events.iter().map(|&(_, _, event)| event).collect()
        }
    }

    fn lifecycle_with(role: NodeRole, hooks: Recording) -> (Lifecycle, Arc<Recording>) {
        let hooks = Arc::new(hooks);
        let lifecycle = Lifecycle::new(role, role.name(), POOL, Hooks::new(hooks.clone()));
        (lifecycle, hooks)
    }

    fn lifecycle(role: NodeRole) -> (Lifecycle, Arc<Recording>) {
        lifecycle_with(role, Recording::default())
    }

    /// One move a caller makes.
    #[derive(Clone, Copy, Debug)]
    enum Step {
        Queue,
        Enter(State),
        Sampled,
        Fail(ErrorKind),
    }

    fn walk(lifecycle: &mut Lifecycle, steps: &[Step]) {
        for &step in steps {
            let moved = match step {
                Step::Queue => lifecycle.queue(OWNER),
                Step::Enter(to) => lifecycle.enter(OWNER, to),
                Step::Sampled => lifecycle.token_sampled(OWNER),
                Step::Fail(kind) => lifecycle.fail(OWNER, &RequestError::new(kind, "test")),
            };
            assert_eq!(moved, Ok(()), "{step:?}");
        }
    }

    use NodeRole::{Decode, Prefill, Unified};
    use RequestEvent as E;
    use State::*;
    use Step::{Enter, Queue, Sampled};

    /// Each role's legal paths, as the states a request enters (the first
    /// by `queue`, the others by `enter`).
    const PATHS: &[(NodeRole, &[State])] = &[
        (Unified, &[Queued, Admitted, Prefilling, Decoding, Finished]),
        // Preempted while decoding, then recomputed.
        (
            Unified,
            &[
                Queued, Admitted, Prefilling, Decoding, Queued, Admitted, Prefilling, Decoding,
                Finished,
            ],
        ),
        // The pool could not hold the first chunk; later cancelled.
        (
            Unified,
            &[Queued, Admitted, Prefilling, Queued, Admitted, Cancelled],
        ),
        (
            Prefill,
            &[Queued, Admitted, Prefilling, Transferring, Finished],
        ),
        (
            Prefill,
            &[Queued, Admitted, Prefilling, Transferring, Aborted],
        ),
        (
            Decode,
            &[Queued, Admitted, Transferring, Decoding, Finished],
        ),
        // No pages for the reservation yet: back to the queue.
        (
            Decode,
            &[
                Queued,
                Admitted,
                Queued,
                Admitted,
                Transferring,
                Decoding,
                Finished,
            ],
        ),
        // Preempted after its commit, recomputed on decode.
        (
            Decode,
            &[
                Queued,
                Admitted,
                Transferring,
                Decoding,
                Queued,
                Admitted,
                Prefilling,
                Decoding,
                Finished,
            ],
        ),
        // Cancelled with its KV on the way: drained, then ended.
        (
            Decode,
            &[Queued, Admitted, Transferring, Draining, Cancelled],
        ),
    ];

    #[test]
    fn each_roles_legal_paths_pass_and_report_each_move_once() {
        for &(role, states) in PATHS {
            let (mut lifecycle, hooks) = lifecycle(role);
            assert_eq!(lifecycle.queue(OWNER), Ok(()));
            for &to in &states[1..] {
                assert_eq!(
                    lifecycle.enter(OWNER, to),
                    Ok(()),
                    "{role:?} {states:?} {to}"
                );
            }
            let events: Vec<_> = states.iter().filter_map(|s| s.event()).collect();
            assert_eq!(hooks.events(), events, "{role:?} {states:?}");
            assert_eq!(lifecycle.state(OWNER.request), None, "ended: not live");
            assert_eq!(lifecycle.illegal_transitions(), 0);
        }
    }

    #[test]
    fn a_drained_request_is_reported_transferring_until_it_ends_aborted() {
        let (mut lifecycle, hooks) = lifecycle(NodeRole::Decode);
        walk(
            &mut lifecycle,
            &[Queue, Enter(Admitted), Enter(Transferring), Enter(Draining)],
        );
        assert_eq!(lifecycle.state(OWNER.request), Some(Draining));
        assert_eq!(hooks.events(), [E::Queued, E::Admitted, E::Transferring]);
        walk(&mut lifecycle, &[Step::Fail(ErrorKind::Cancelled)]);
        assert_eq!(
            hooks.events(),
            [E::Queued, E::Admitted, E::Transferring, E::Aborted]
        );
    }

    #[test]
    fn a_request_refused_before_it_was_queued_ends_at_once() {
        for (kind, event) in [
            (ErrorKind::Rejected, E::Rejected),
            (ErrorKind::Cancelled, E::Aborted),
            (ErrorKind::Transport, E::Aborted),
            (ErrorKind::InvalidRequest, E::Aborted),
        ] {
            let (mut lifecycle, hooks) = lifecycle(NodeRole::Decode);
            let error = RequestError::new(kind, "test");
            assert_eq!(lifecycle.refuse(OWNER, &error), Ok(()));
            assert_eq!(hooks.events(), [event]);
            assert_eq!(lifecycle.state(OWNER.request), None);
        }
    }

    #[test]
    fn an_illegal_move_is_refused_with_both_states_and_changes_nothing() {
        let (mut lifecycle, hooks) = lifecycle(NodeRole::Unified);
        walk(&mut lifecycle, &[Queue]);
        let refused = lifecycle.enter(OWNER, Decoding);
        let Err(Refused::Illegal(e)) = &refused else {
            panic!("refused as illegal: {refused:?}");
        };
        assert_eq!(
            (e.request, e.from, e.to),
            (OWNER.request, Some(Queued), Decoding)
        );
        let message = e.to_string();
        for part in ["unified", "request 42", "queued", "decoding", "engine bug"] {
            assert!(message.contains(part), "{message}");
        }
        let client = RequestError::from(refused.unwrap_err());
        assert_eq!(client.kind, ErrorKind::Internal);
        assert_eq!(client.message, message);
        assert_eq!(lifecycle.state(OWNER.request), Some(Queued));
        assert_eq!(hooks.events(), [E::Queued], "nothing reported");
        assert_eq!(lifecycle.illegal_transitions(), 1);
    }

    #[test]
    fn a_move_another_role_makes_is_refused() {
        let cases: [(NodeRole, &[Step], Step); 6] = [
            // A prefill node never decodes.
            (
                NodeRole::Prefill,
                &[Queue, Enter(Admitted), Enter(Prefilling)],
                Sampled,
            ),
            // A unified node ships no KV.
            (
                NodeRole::Unified,
                &[Queue, Enter(Admitted)],
                Enter(Transferring),
            ),
            (
                NodeRole::Unified,
                &[Queue, Enter(Admitted), Enter(Prefilling)],
                Enter(Transferring),
            ),
            // Decode decodes what it received before it finishes.
            (
                NodeRole::Decode,
                &[Queue, Enter(Admitted), Enter(Transferring)],
                Enter(Finished),
            ),
            // Only decode drains.
            (
                NodeRole::Prefill,
                &[
                    Queue,
                    Enter(Admitted),
                    Enter(Prefilling),
                    Enter(Transferring),
                ],
                Enter(Draining),
            ),
            // A draining request only ends.
            (
                NodeRole::Decode,
                &[Queue, Enter(Admitted), Enter(Transferring), Enter(Draining)],
                Enter(Decoding),
            ),
        ];
        for (role, before, step) in cases {
            let (mut lifecycle, hooks) = lifecycle(role);
            walk(&mut lifecycle, before);
            let state = lifecycle.state(OWNER.request);
            let reported = hooks.events().len();
            let refused = match step {
                Sampled => lifecycle.token_sampled(OWNER),
                Enter(to) => lifecycle.enter(OWNER, to),
                _ => unreachable!(),
            };
            assert!(
                matches!(refused, Err(Refused::Illegal(_))),
                "{role:?} {step:?}"
            );
            assert_eq!(lifecycle.state(OWNER.request), state);
            assert_eq!(hooks.events().len(), reported);
        }
    }

    #[test]
    fn an_ended_request_moves_no_more_and_its_end_is_reported_once() {
        let (mut lifecycle, hooks) = lifecycle(NodeRole::Unified);
        walk(&mut lifecycle, &[Queue, Step::Fail(ErrorKind::Cancelled)]);
        let cancelled = RequestError::new(ErrorKind::Cancelled, "again");
        for refused in [
            lifecycle.fail(OWNER, &cancelled),
            lifecycle.enter(OWNER, Finished),
            lifecycle.enter(OWNER, Admitted),
        ] {
            let Err(Refused::Illegal(e)) = refused else {
                panic!("refused: {refused:?}");
            };
            assert_eq!(e.from, None);
            assert!(e.to_string().contains("not live"), "{e}");
        }
        assert_eq!(hooks.events(), [E::Queued, E::Aborted]);
        assert_eq!(lifecycle.illegal_transitions(), 3);
    }

    #[test]
    fn a_live_request_cannot_be_queued_or_refused_again() {
        let (mut lifecycle, hooks) = lifecycle(NodeRole::Decode);
        walk(&mut lifecycle, &[Queue, Enter(Admitted)]);
        let rejected = RequestError::new(ErrorKind::Rejected, "test");
        for refused in [lifecycle.queue(OWNER), lifecycle.refuse(OWNER, &rejected)] {
            let Err(Refused::Illegal(e)) = refused else {
                panic!("refused: {refused:?}");
            };
            assert_eq!(e.from, Some(Admitted));
        }
        assert_eq!(lifecycle.state(OWNER.request), Some(Admitted));
        assert_eq!(hooks.events(), [E::Queued, E::Admitted]);
    }

    #[test]
    fn a_token_sampled_moves_only_a_prefilling_request() {
        let (mut lifecycle, hooks) = lifecycle(NodeRole::Unified);
        walk(&mut lifecycle, &[Queue, Sampled, Enter(Admitted), Sampled]);
        assert_eq!(lifecycle.state(OWNER.request), Some(Admitted));
        walk(&mut lifecycle, &[Enter(Prefilling), Sampled, Sampled]);
        assert_eq!(lifecycle.state(OWNER.request), Some(Decoding));
        assert_eq!(
            hooks.events(),
            [E::Queued, E::Admitted, E::Prefilling, E::Decoding]
        );
    }

    #[test]
    fn an_abort_verdict_is_the_requests_error_and_the_move_stands() {
        let (mut lifecycle, hooks) = lifecycle_with(
            NodeRole::Unified,
            Recording {
                abort_on: Some(E::Admitted),
                ..Recording::default()
            },
        );
        walk(&mut lifecycle, &[Queue]);
        let refused = lifecycle.enter(OWNER, Admitted);
        let Err(Refused::Violation(e)) = refused else {
            panic!("aborted by the hooks: {refused:?}");
        };
        assert_eq!(e.kind, ErrorKind::Violation);
        assert_eq!(e.violation.map(|v| v.kind), Some(ViolationKind::PageLeak));
        assert!(e.message.contains("unified node"), "{}", e.message);
        assert_eq!(lifecycle.state(OWNER.request), Some(Admitted));
        assert_eq!(lifecycle.fail(OWNER, &e), Ok(()));
        assert_eq!(hooks.events(), [E::Queued, E::Admitted, E::Aborted]);
    }

    #[test]
    fn an_end_for_terminal_request_activity_is_recorded_and_not_reported_again() {
        let (mut lifecycle, hooks) = lifecycle(NodeRole::Decode);
        walk(&mut lifecycle, &[Queue, Enter(Admitted)]);
        let caught = RequestError {
            violation: Some(Violated {
                id: ViolationId::next(),
                kind: ViolationKind::TerminalRequestActivity,
            }),
            ..RequestError::new(ErrorKind::Violation, "caught acting after its end")
        };
        assert_eq!(lifecycle.fail(OWNER, &caught), Ok(()));
        assert_eq!(lifecycle.state(OWNER.request), None);
        assert_eq!(hooks.events(), [E::Queued, E::Admitted]);
    }

    #[test]
    fn each_state_reports_the_sanitizers_event() {
        let table = [
            (Queued, Some(E::Queued)),
            (Admitted, Some(E::Admitted)),
            (Prefilling, Some(E::Prefilling)),
            (Transferring, Some(E::Transferring)),
            (Draining, None),
            (Decoding, Some(E::Decoding)),
            (Finished, Some(E::Finished)),
            (Rejected, Some(E::Rejected)),
            (Cancelled, Some(E::Aborted)),
            (Aborted, Some(E::Aborted)),
        ];
        for (state, event) in table {
            assert_eq!(state.event(), event, "{state}");
            assert_eq!(
                event.is_some_and(RequestEvent::is_terminal),
                state.is_terminal(),
                "{state}"
            );
        }
    }
}
