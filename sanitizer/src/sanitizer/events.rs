//! Pool registration and the request lifecycle events, per node's view.

use super::finding::Finding;
use super::{MAX_POOLS, Sanitizer};
use crate::error::SanitizerError;
use crate::geometry::PoolGeometry;
use crate::ids::{Owner, PageRef, PoolId, RequestId};
use crate::lifecycle::{RequestEvent, RequestState, Scope, Transition};
use crate::pool::ShadowPool;
use crate::transfer::Landing;
use crate::violation::{Verdict, ViolationKind};
use std::sync::OnceLock;
use std::sync::atomic::Ordering;

impl Sanitizer {
    /// Registers a pool and returns its id (ids count up from 0).
    ///
    /// # Errors
    /// A bad geometry, or more than [`MAX_POOLS`] pools.
    pub fn pool_register(&self, geometry: PoolGeometry) -> Result<PoolId, SanitizerError> {
        self.pool_register_with(geometry, Landing::Reported)
    }

    /// [`Sanitizer::pool_register`] for a pool whose engine reports received
    /// KV's landing as `landing` says: [`Landing::Manifest`] for an engine
    /// that calls neither `transfer_land` nor `transfer_verify` (then
    /// `transfer_recv` marks the manifest's slots written, and where the
    /// bytes land is not checked).
    ///
    /// # Errors
    /// As [`Sanitizer::pool_register`].
    pub fn pool_register_with(
        &self,
        geometry: PoolGeometry,
        landing: Landing,
    ) -> Result<PoolId, SanitizerError> {
        geometry.validate()?;
        let index = self
            .registered
            .fetch_update(Ordering::AcqRel, Ordering::Acquire, |n| {
                (n < MAX_POOLS).then_some(n + 1)
            })
            .map_err(|_| SanitizerError::TooManyPools { limit: MAX_POOLS })?;
        let id = PoolId(index);
        let pool = ShadowPool::new(
            id,
            geometry,
            landing,
            self.options.history_depth,
            self.options.quarantine_pages,
        );
        // Each index is handed out once, so the cell is empty.
        let _ = self.pools[index as usize].set(pool);
        Ok(id)
    }

    /// A request enters the state `event`, as the whole process sees it
    /// (an engine of one node; see [`Sanitizer::request_event_at`] for a
    /// node's own view). Illegal moves are `illegal-transition`; any event
    /// after Rejected or Aborted is `terminal-request-activity`; reaching
    /// Finished, Rejected or Aborted while holding pages is `page-leak` (the
    /// engine frees first).
    pub fn request_event(&self, owner: Owner, event: RequestEvent) -> Verdict {
        self.scoped_event(Scope::Process, owner, event)
    }

    /// A request enters the state `event` as the node that owns `pool` sees
    /// it. Each node's view moves on its own: decode aborting a request does
    /// not end it for the prefill node, which goes on legally until it is
    /// told and reports its own end. The checks are
    /// [`Sanitizer::request_event`]'s, judged on the node's view (and an
    /// event after the process's view was rejected or aborted is
    /// `terminal-request-activity`); a `page-leak` is judged on the pages
    /// the request holds in `pool` when its node ends it.
    ///
    /// # Errors
    /// Unknown pool.
    pub fn request_event_at(
        &self,
        pool: PoolId,
        owner: Owner,
        event: RequestEvent,
    ) -> Result<Verdict, SanitizerError> {
        self.pool(pool)?;
        Ok(self.scoped_event(Scope::Pool(pool), owner, event))
    }

    fn scoped_event(&self, scope: Scope, owner: Owner, event: RequestEvent) -> Verdict {
        let mut rec = self.lifecycle.entry(owner.request, owner.tenant);
        let process = rec.view(Scope::Process).map(|v| v.state);
        let view = rec.view_mut(scope, RequestState::Queued);
        let from = match process {
            Some(p @ (RequestState::Rejected | RequestState::Aborted))
                if scope != Scope::Process =>
            {
                p
            }
            _ => view.state,
        };
        match from.transition(event) {
            Transition::Legal => {
                view.state = event;
                if !event.is_terminal() {
                    return Verdict::Continue;
                }
                if rec.held(scope) == 0 {
                    drop(rec);
                    self.lifecycle.retire_if_over(owner.request);
                    return Verdict::Continue;
                }
                drop(rec);
                let leaked = self.pages_held_by(owner.request, scope, true);
                self.page_leak(owner, event, &leaked)
            }
            Transition::TerminalActivity => {
                drop(rec);
                self.lifecycle.retire_if_over(owner.request);
                self.violation(
                    Finding::new(ViolationKind::TerminalRequestActivity, owner, "reporting")
                        .detail(format!(
                            "lifecycle event {} after the request was {}",
                            event.name(),
                            from.name()
                        )),
                )
            }
            Transition::Illegal => {
                drop(rec);
                self.violation(
                    Finding::new(ViolationKind::IllegalTransition, owner, "reporting").detail(
                        format!(
                            "lifecycle event {} is not legal from {}",
                            event.name(),
                            from.name()
                        ),
                    ),
                )
            }
        }
    }

    /// Pages `who` holds in `scope`'s pool (every pool for the process),
    /// marking the ones it owns as held by an ended request if asked.
    fn pages_held_by(
        &self,
        who: RequestId,
        scope: Scope,
        mark_terminal: bool,
    ) -> Vec<(PoolId, PageRef)> {
        let mut held = Vec::new();
        let pools = self.pools.iter().filter_map(OnceLock::get);
        for pool in pools.filter(|p| scope == Scope::Process || scope == Scope::Pool(p.id)) {
            for (page, owned) in pool.pages_held_by(who) {
                if owned
                    && mark_terminal
                    && let Ok(view) = pool.page(page.page)
                {
                    view.mark_terminal_owner(page.generation, who);
                }
                held.push((pool.id, page));
            }
        }
        held
    }

    #[cold]
    fn page_leak(
        &self,
        owner: Owner,
        event: RequestEvent,
        leaked: &[(PoolId, PageRef)],
    ) -> Verdict {
        let Some(&(pool, first)) = leaked.first() else {
            return Verdict::Continue;
        };
        let list: Vec<String> = leaked
            .iter()
            .take(8)
            .map(|(pool, page)| format!("{pool} {page}"))
            .collect();
        let more = if leaked.len() > 8 { ", …" } else { "" };
        self.violation(
            Finding::new(ViolationKind::PageLeak, owner, "ending")
                .at(pool, first)
                .detail(format!(
                    "request became {} still holding {} page reference(s): {}{more}",
                    event.name(),
                    leaked.len(),
                    list.join(", ")
                )),
        )
    }
}
