//! The prefill node of a disaggregated deployment: computes prompts' KV in
//! its own pool (continuous batching, chunked prefill) and pushes it into the
//! pages the decode node reserved, then the first token.
//!
//! It reports its own view of each request's lifecycle (queued, admitted,
//! prefilling, transferring, then finished, rejected or aborted) in the
//! scope of its pool: decode cancelling a request does not end it here
//! until the cancel arrives. A cancel is acknowledged (`PrefillFailed`,
//! kind `cancelled`) once nothing more will be sent for the request, so
//! decode can free the pages the KV was going to.

use std::collections::HashMap;

use crossbeam_channel::{Receiver, select};
use kvsan_sanitizer::{Manifest, PoolId, RequestId};

use crate::node::Command;
use crate::node::admission::{self, PoolLimit};
use crate::node::executor::{ChunkOutcome, Executor};
use crate::node::lifecycle::{Refused, State};
use crate::node::scheduler::Scheduler;
use crate::node::sequence::Sequence;
use crate::node::step_loop::{self, new_sequence};
use crate::request::{ErrorKind, Request, RequestError};
use crate::transport::{
    Inbound, KvPayload, KvTransfer, Link, NodeInfo, PrefillOrder, ToDecode, ToPrefill, kv_checksum,
    kv_slices, landing_digests,
};

mod faults;

/// Tokens per KV transfer message (a prompt's KV goes in pieces of this size).
pub const TRANSFER_TOKENS: usize = 64;

/// Where a request's KV goes.
struct Destination {
    pool: PoolId,
    pages: Vec<kvsan_sanitizer::PageRef>,
}

/// The prefill node's state.
pub(crate) struct PrefillNode {
    pub core: Executor,
    pub sched: Scheduler,
    pub context: usize,
    dests: HashMap<RequestId, Destination>,
    /// KV messages a fail point keeps for a retry (none without it).
    retry: faults::Retry,
}

/// Why the prefill loop returned.
pub(crate) enum Exit {
    /// The decode link broke (everything was freed).
    LinkDown,
    /// Shutdown was asked for.
    Shutdown,
}

impl PrefillNode {
    pub fn new(core: Executor, sched: Scheduler, context: usize) -> PrefillNode {
        PrefillNode {
            core,
            sched,
            context,
            dests: HashMap::new(),
            retry: faults::Retry::default(),
        }
    }

    /// What this node announces on a new link.
    pub fn info(&self) -> NodeInfo {
        let g = self.core.pool.geometry();
        NodeInfo {
            pool_tokens: self.core.capacity_tokens(),
            page_slots: g.page_slots,
            n_layers: g.n_layers,
            kv_dim: g.slot_width(),
            context_length: self.context,
        }
    }

    /// Serves one decode link until it breaks or shutdown is asked for.
    pub fn serve(
        &mut self,
        link: &dyn Link<ToDecode>,
        inbox: &Receiver<Inbound<ToPrefill>>,
        control: &Receiver<Command>,
    ) -> Exit {
        if link.send(ToDecode::Hello(self.info())).is_err() {
            self.drop_all("the decode node is unreachable");
            return Exit::LinkDown;
        }
        loop {
            if self.sched.is_idle() {
                self.core.idle();
                select! {
                    recv(inbox) -> m => match m {
                        Ok(m) => if let Some(exit) = self.inbound(m, link) { return exit; },
                        Err(_) => { self.drop_all("the decode link closed"); return Exit::LinkDown; }
                    },
                    recv(control) -> c => if let Some(exit) = self.control(c.ok()) { return exit; },
                }
            }
            while let Ok(m) = inbox.try_recv() {
                if let Some(exit) = self.inbound(m, link) {
                    return exit;
                }
            }
            while let Ok(c) = control.try_recv() {
                if let Some(exit) = self.control(Some(c)) {
                    return exit;
                }
            }
            self.step(link);
        }
    }

    fn control(&mut self, cmd: Option<Command>) -> Option<Exit> {
        match cmd {
            Some(Command::Stats(tx)) => {
                let _ = tx.send(step_loop::stats(&self.core, &self.sched));
                None
            }
            Some(Command::Shutdown) | None => {
                self.drop_all("the prefill node is shutting down");
                Some(Exit::Shutdown)
            }
            Some(_) => None,
        }
    }

    fn inbound(&mut self, m: Inbound<ToPrefill>, link: &dyn Link<ToDecode>) -> Option<Exit> {
        match m {
            Inbound::Message(ToPrefill::Prefill(order)) => {
                self.accept(order, link);
                None
            }
            Inbound::Message(ToPrefill::Cancel { request }) => {
                self.dests.remove(&request);
                if let Some(seq) = self.sched.take(request) {
                    self.end(seq, State::Cancelled);
                }
                // Nothing more goes out for it: decode may free its pages.
                let _ = link.send(ToDecode::PrefillFailed {
                    request,
                    error: RequestError::new(ErrorKind::Cancelled, "cancelled by decode"),
                });
                None
            }
            Inbound::Disconnected { reason } => {
                tracing::warn!(node = %self.core.name, "decode link down: {reason}; freeing every request");
                self.drop_all("the decode node disconnected");
                Some(Exit::LinkDown)
            }
        }
    }

    /// Admission on the prefill side: every queue checks the request fits.
    fn accept(&mut self, order: PrefillOrder, link: &dyn Link<ToDecode>) {
        let owner = order.owner;
        let request = Request {
            tenant: owner.tenant,
            prompt: order.prompt,
            max_tokens: 1,
            sampling: order.sampling,
            stop_tokens: Vec::new(),
            cache_salt: order.cache_salt,
        };
        let limits = [PoolLimit {
            node: "prefill",
            tokens: self.core.capacity_tokens(),
        }];
        let ps = self.core.pool.page_slots();
        let mut verdict =
            admission::check(&request, &self.core.model, "prefill", self.context, &limits);
        if verdict.is_ok() && order.dst_pages.len() * ps < request.prompt.len() {
            verdict = Err(RequestError::new(
                ErrorKind::InvalidRequest,
                format!(
                    "{} destination pages of {ps} slots cannot hold a prompt of {} tokens",
                    order.dst_pages.len(),
                    request.prompt.len()
                ),
            ));
        }
        let seq = verdict.and_then(|()| new_sequence(owner, request, ps, None));
        let error = match seq {
            Ok(mut seq) => match self.core.lifecycle.queue(owner) {
                Ok(()) => {
                    self.core.enter_cache(&mut seq);
                    self.dests.insert(
                        owner.request,
                        Destination {
                            pool: order.dst_pool,
                            pages: order.dst_pages,
                        },
                    );
                    self.sched.waiting.push_back(seq);
                    return;
                }
                // Queued, and aborted by the hook target at once.
                Err(Refused::Violation(error)) => {
                    let _ = self.core.lifecycle.fail(owner, &error);
                    error
                }
                // Its id is live here already: not this order's to end.
                Err(refused) => refused.into(),
            },
            Err(error) => {
                // Refused either way; a move the lifecycle refuses is logged there.
                let _ = self.core.lifecycle.refuse(owner, &error);
                error
            }
        };
        tracing::info!(node = %self.core.name, request = owner.request.0, "prefill refused: {}", error.message);
        let _ = link.send(ToDecode::PrefillFailed {
            request: owner.request,
            error,
        });
    }

    /// One batched prefill step; completed prompts are shipped.
    fn step(&mut self, link: &dyn Link<ToDecode>) {
        let (plan, failed) = self.sched.plan(&mut self.core);
        for (seq, error) in failed {
            self.fail(seq, error, link);
        }
        if plan.is_empty() {
            return;
        }
        let outcomes = self.core.run(&mut self.sched.running, &plan);
        let mut done: Vec<(usize, Result<u32, RequestError>)> = Vec::new();
        for (p, outcome) in plan.iter().zip(outcomes) {
            match outcome {
                ChunkOutcome::Done(None) | ChunkOutcome::NotRun => {}
                ChunkOutcome::Done(Some(first)) => done.push((p.seq, Ok(first))),
                ChunkOutcome::Refused(e) => done.push((p.seq, Err(e))),
            }
        }
        done.sort_by_key(|(i, _)| std::cmp::Reverse(*i));
        for (i, result) in done {
            let seq = self.sched.running.remove(i);
            match result {
                Ok(first) => self.ship(seq, first, link),
                Err(e) => self.fail(seq, e, link),
            }
        }
    }

    /// Pushes a completed prompt's KV to decode, then frees its pages and
    /// sends the first token, with the prompt tokens found in the prefix
    /// cache and how long the request waited in this node's queue (decode's
    /// anomaly monitor leaves both out of its timing).
    fn ship(&mut self, seq: Sequence, first_token: u32, link: &dyn Link<ToDecode>) {
        let Some(dest) = self.dests.remove(&seq.owner.request) else {
            // Cancelled while computing.
            self.end(seq, State::Cancelled);
            return;
        };
        if let Err(e) = self.core.lifecycle.enter(seq.owner, State::Transferring) {
            self.fail(seq, e.into(), link);
            return;
        }
        let layers = self.core.model.config().n_layers;
        let shipped = faults::short_transfer(seq.prompt_len);
        let mut first = 0;
        while first < shipped {
            let tokens = TRANSFER_TOKENS.min(shipped - first);
            let manifest = Manifest {
                request: seq.owner,
                src_pool: self.core.pool_id,
                src_pages: seq.table.pages().to_vec(),
                dst_pool: dest.pool,
                dst_pages: dest.pages.clone(),
                first_token: first as u32,
                tokens: tokens as u32,
                layers: 0..layers as u32,
                checksum: 0,
            };
            let mut bytes = Vec::new();
            let ps = self.core.pool.page_slots();
            for (idx, slots) in kv_slices(&manifest, ps) {
                self.core.pool.pack_slots(
                    seq.table.pages()[idx].page,
                    slots,
                    0..layers,
                    &mut bytes,
                );
            }
            let kv_dim = self.core.pool.geometry().slot_width();
            let digests = landing_digests(&manifest, ps, kv_dim, &bytes);
            let manifest = Manifest {
                checksum: kv_checksum(&bytes),
                ..manifest
            };
            let verdict = self.core.hooks.transfer_send(self.core.pool_id, &manifest);
            if !verdict.is_continue() {
                let e = RequestError::aborted_by(verdict, &self.core.name);
                self.fail(seq, e, link);
                return;
            }
            let transfer = KvTransfer {
                manifest,
                payload: KvPayload::Bytes(bytes),
                digests,
            };
            faults::keep_for_retry(&mut self.retry, &transfer, first + tokens >= shipped);
            let sent = link.send(ToDecode::Kv(transfer));
            if sent.is_err() {
                self.end(seq, State::Aborted);
                return;
            }
            self.core.stats.transfers += 1;
            first += tokens;
        }
        // The pages go back as soon as the KV is out, before decode hears
        // the prefill is done.
        let request = seq.owner.request;
        let cached_tokens = u32::try_from(seq.cached_tokens).unwrap_or(u32::MAX);
        let queued_us = u64::try_from(seq.queued().as_micros()).unwrap_or(u64::MAX);
        self.end(seq, State::Finished);
        faults::replay_for_retry(&mut self.retry, link);
        let _ = link.send(ToDecode::PrefillDone {
            request,
            first_token,
            cached_tokens,
            queued_us,
        });
    }

    /// Frees a request's pages and ends it (`to`) in this node's view.
    /// Decode answers the client: a violation at the end is the hook
    /// target's to report, a move the lifecycle refuses is logged there.
    fn end(&mut self, mut seq: Sequence, to: State) {
        self.core.release(&mut seq);
        let _ = self.core.lifecycle.enter(seq.owner, to);
    }

    fn fail(&mut self, mut seq: Sequence, error: RequestError, link: &dyn Link<ToDecode>) {
        self.dests.remove(&seq.owner.request);
        let request = seq.owner.request;
        step_loop::fail_in_place(&mut self.core, &mut seq, error.clone());
        let _ = link.send(ToDecode::PrefillFailed { request, error });
    }

    /// Frees every request (the link is gone or the node stops).
    fn drop_all(&mut self, why: &str) {
        let all: Vec<Sequence> = self
            .sched
            .running
            .drain(..)
            .chain(self.sched.waiting.drain(..))
            .collect();
        for seq in all {
            tracing::info!(node = %self.core.name, request = seq.owner.request.0, "prefill dropped: {why}");
            self.end(seq, State::Aborted);
        }
        self.dests.clear();
    }
}
