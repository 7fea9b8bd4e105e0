//! Continuous batching with chunked prefill under a per-step token budget,
//! and preemption by recompute when the pool runs out mid-decode.
//!
//! Each step is planned in named phases:
//!
//! 1. `Scheduler::schedule_decodes` — every running sequence with one token
//!    pending gets it; when its next slot needs a page and none is free, the
//!    most recently admitted other sequence is preempted (its pages freed, it
//!    goes back to the head of the queue): to the host tier when the node
//!    has one with room (its pages stored there, loaded back when it is
//!    admitted again), else to be recomputed.
//! 2. `Scheduler::schedule_prefill_chunks` — sequences part-way through their
//!    prompt (or a recompute) continue, in chunks that fit the budget left.
//! 3. `Scheduler::admit` — waiting sequences join, first come first served,
//!    while budget, batch slots and free pages last.

use std::collections::VecDeque;

use kvsan_sanitizer::RequestId;

use crate::node::executor::{Executor, Planned};
use crate::node::lifecycle::State;
use crate::node::sequence::Sequence;
use crate::request::{ErrorKind, RequestError};

mod faults;

/// Limits of one step.
#[derive(Clone, Copy, Debug)]
pub struct SchedulerConfig {
    /// Tokens computed per step at most (decode tokens and prefill chunks).
    pub step_tokens: usize,
    /// Sequences running at once at most.
    pub max_running: usize,
    /// Most prompt tokens one sequence computes in a step, so that several
    /// prefills go on side by side (vLLM's `long_prefill_token_threshold`);
    /// `None`: as many as the step's budget leaves.
    pub chunk_tokens: Option<usize>,
}

impl Default for SchedulerConfig {
    fn default() -> Self {
        SchedulerConfig {
            step_tokens: 512,
            max_running: 64,
            chunk_tokens: None,
        }
    }
}

/// The waiting queue and the running batch of one node.
#[derive(Debug)]
pub(crate) struct Scheduler {
    pub config: SchedulerConfig,
    pub waiting: VecDeque<Sequence>,
    pub running: Vec<Sequence>,
    /// A decoding sequence waited for a page in the last plan.
    pub starved: bool,
    admissions: u64,
}

/// A sequence the scheduler had to give up on, with the client's error.
pub(crate) type Failed = (Sequence, RequestError);

impl Scheduler {
    pub fn new(config: SchedulerConfig) -> Scheduler {
        Scheduler {
            config: SchedulerConfig {
                step_tokens: config.step_tokens.max(1),
                max_running: config.max_running.max(1),
                chunk_tokens: config.chunk_tokens.map(|n| n.max(1)),
            },
            waiting: VecDeque::new(),
            running: Vec::new(),
            starved: false,
            admissions: 0,
        }
    }

    /// Nothing to do.
    pub fn is_idle(&self) -> bool {
        self.waiting.is_empty() && self.running.is_empty()
    }

    /// Removes request `id` from either queue.
    pub fn take(&mut self, id: RequestId) -> Option<Sequence> {
        if let Some(i) = self.running.iter().position(|s| s.owner.request == id) {
            return Some(self.running.remove(i));
        }
        let i = self.waiting.iter().position(|s| s.owner.request == id)?;
        self.waiting.remove(i)
    }

    /// Plans one step: which sequences compute how many tokens. Pages are
    /// allocated here. Sequences that cannot go on come back in the second list.
    pub fn plan(&mut self, core: &mut Executor) -> (Vec<Planned>, Vec<Failed>) {
        let mut failed = Vec::new();
        let mut planned: Vec<(RequestId, usize)> = Vec::new();
        self.starved = false;
        crate::node::executor::complete_late_stores(core);
        let budget = self.schedule_decodes(core, &mut planned, &mut failed);
        let budget = self.schedule_prefill_chunks(core, budget, &mut planned, &mut failed);
        self.admit(core, budget, &mut planned, &mut failed);
        let plan = planned
            .into_iter()
            .filter_map(|(id, n)| {
                let seq = self.running.iter().position(|s| s.owner.request == id)?;
                Some(Planned { seq, n })
            })
            .collect();
        (plan, failed)
    }

    /// Phase 1: one token for every decoding sequence, preempting when pages run out.
    fn schedule_decodes(
        &mut self,
        core: &mut Executor,
        planned: &mut Vec<(RequestId, usize)>,
        failed: &mut Vec<Failed>,
    ) -> usize {
        let mut budget = self.config.step_tokens;
        let mut i = 0;
        while i < self.running.len() && budget > 0 {
            let s = &self.running[i];
            if s.pending() != 1 || s.computed == 0 {
                i += 1;
                continue;
            }
            let need = s.computed + 1;
            match core.ensure_pages(&mut self.running[i], need) {
                Ok(true) => {
                    planned.push((self.running[i].owner.request, 1));
                    budget -= 1;
                    i += 1;
                }
                Ok(false) => match self.preempt_newest_other_than(core, i, failed) {
                    Some((victim, at)) => {
                        // A victim planned earlier in this phase gives its token back.
                        let before = planned.len();
                        planned.retain(|(id, _)| *id != victim);
                        budget += before - planned.len();
                        if at < i {
                            i -= 1;
                        }
                    }
                    None if self.pages_held_elsewhere(core) > 0 => {
                        // Pages are reserved outside the batch (KV on its
                        // way from a prefill node); they come back once those
                        // requests run and can be preempted. Wait a step.
                        self.starved = true;
                        i += 1;
                    }
                    None => {
                        let seq = self.running.remove(i);
                        let err = capacity_error(&seq, core);
                        failed.push((seq, err));
                    }
                },
                Err(e) => failed.push((self.running.remove(i), e)),
            }
        }
        budget
    }

    /// Phase 2: chunks for sequences part-way through their prompt or a recompute.
    fn schedule_prefill_chunks(
        &mut self,
        core: &mut Executor,
        mut budget: usize,
        planned: &mut Vec<(RequestId, usize)>,
        failed: &mut Vec<Failed>,
    ) -> usize {
        let mut i = 0;
        while i < self.running.len() && budget > 0 {
            let s = &self.running[i];
            let id = s.owner.request;
            if planned.iter().any(|(p, _)| *p == id) || s.pending() == 0 {
                i += 1;
                continue;
            }
            let n = self.chunk(s.pending().min(budget).min(room_for(core, s)));
            if n == 0 {
                i += 1;
                continue;
            }
            let need = self.running[i].computed + n;
            match core.ensure_pages(&mut self.running[i], need) {
                Ok(true) => {
                    planned.push((id, n));
                    budget -= n;
                    i += 1;
                }
                Ok(false) => i += 1,
                Err(e) => failed.push((self.running.remove(i), e)),
            }
        }
        budget
    }

    /// Phase 3: waiting sequences join while budget, slots and pages last.
    fn admit(
        &mut self,
        core: &mut Executor,
        mut budget: usize,
        planned: &mut Vec<(RequestId, usize)>,
        failed: &mut Vec<Failed>,
    ) {
        while budget > 0 && self.running.len() < self.config.max_running {
            let Some(front) = self.waiting.front() else {
                break;
            };
            let n = front
                .pending_after_reload()
                .min(budget)
                .min(room_for(core, front));
            if n == 0 {
                break; // first come, first served: nobody overtakes the head
            }
            let mut seq = self.waiting.pop_front().expect("front exists");
            if let Err(e) = core
                .lifecycle
                .enter(seq.owner, State::Admitted)
                .and_then(|()| core.lifecycle.enter(seq.owner, State::Prefilling))
            {
                failed.push((seq, e.into()));
                continue;
            }
            seq.admitted_at = self.next_admission();
            seq.admitted = Some(std::time::Instant::now());
            // A sequence preempted down a tier gets its KV back; any other
            // shares the cached prefix before anything is computed. Either
            // may wait for a tier's reads: it stays at the head.
            let resumed = if seq.offloaded.is_some() {
                core.reload(&mut seq)
            } else {
                core.share_prefix(&mut seq)
            };
            let n = match resumed {
                Ok(true) => self.chunk(seq.pending().min(budget).min(room_for(core, &seq))),
                Ok(false) => {
                    match core.lifecycle.enter(seq.owner, State::Queued) {
                        Ok(()) => self.waiting.push_front(seq),
                        Err(e) => failed.push((seq, e.into())),
                    }
                    break;
                }
                Err(e) => {
                    failed.push((seq, e));
                    continue;
                }
            };
            let fits = if n == 0 {
                Ok(false)
            } else {
                let need = seq.computed + n;
                core.ensure_pages(&mut seq, need)
            };
            match fits {
                Ok(true) => {
                    planned.push((seq.owner.request, n));
                    budget -= n;
                    self.running.push(seq);
                }
                Ok(false) => {
                    // room_for said it fits; the pool disagrees: wait again.
                    core.release(&mut seq);
                    match core.lifecycle.enter(seq.owner, State::Queued) {
                        Ok(()) => self.waiting.push_front(seq),
                        Err(e) => failed.push((seq, e.into())),
                    }
                    break;
                }
                Err(e) => failed.push((seq, e)),
            }
        }
    }

    /// `n` tokens of one sequence, within the per-sequence chunk limit.
    fn chunk(&self, n: usize) -> usize {
        self.config.chunk_tokens.map_or(n, |cap| n.min(cap))
    }

    /// Pages of the pool held neither on the free list, nor in the prefix
    /// cache's LRU, nor by the batch (a page shared by several sequences
    /// counts for each: the figure errs low).
    fn pages_held_elsewhere(&self, core: &Executor) -> usize {
        let in_batch: usize = self.running.iter().map(|s| s.table.len()).sum();
        core.pool
            .n_pages()
            .saturating_sub(core.free_pages() + in_batch)
    }

    /// The admission order number for a sequence joining the running batch.
    pub fn next_admission(&mut self) -> u64 {
        self.admissions += 1;
        self.admissions
    }

    /// Preempts the most recently admitted running sequence other than
    /// `keep` (to the host tier, else by recompute); returns its id and
    /// former index, `None` when
    /// there is none. A sequence the lifecycle does not let go back to the
    /// queue goes to `failed` instead.
    fn preempt_newest_other_than(
        &mut self,
        core: &mut Executor,
        keep: usize,
        failed: &mut Vec<Failed>,
    ) -> Option<(RequestId, usize)> {
        let v = (0..self.running.len())
            .filter(|&j| j != keep)
            .max_by_key(|&j| self.running[j].admitted_at)?;
        let mut seq = self.running.remove(v);
        core.stats.preemptions += 1;
        let id = seq.owner.request;
        match core.offload(&mut seq) {
            Ok(true) => {}
            Ok(false) => faults::stale_block_table(&mut seq, |seq| core.release(seq)),
            Err(e) => {
                // A store the hook target refused: the request ends, its
                // pages freed now for the sequence that needs one.
                core.release(&mut seq);
                failed.push((seq, e));
                return Some((id, v));
            }
        }
        match core.lifecycle.enter(seq.owner, State::Queued) {
            Ok(()) => self.waiting.push_front(seq),
            Err(e) => failed.push((seq, e.into())),
        }
        Some((id, v))
    }
}

/// Tokens `s` could still place: the free slots of its last page plus the
/// free pages, less the tokens it gets back from the host tier.
fn room_for(core: &Executor, s: &Sequence) -> usize {
    let slack = s.table.capacity() - s.computed.min(s.table.capacity());
    let reloaded = s.offloaded.as_ref().map_or(0, |o| o.tokens);
    (slack + core.free_pages() * core.pool.page_slots()).saturating_sub(reloaded)
}

fn capacity_error(seq: &Sequence, core: &Executor) -> RequestError {
    RequestError::new(
        ErrorKind::Capacity,
        format!(
            "the {} node's KV pool of {} tokens cannot hold this request's {} tokens",
            core.name,
            core.capacity_tokens(),
            seq.tokens.len()
        ),
    )
}
