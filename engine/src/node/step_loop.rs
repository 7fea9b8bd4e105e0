//! The step loop every node that runs batches shares: a request's entry,
//! end and cancel on the node, one scheduled step (plan, execute, apply each
//! row's outcome), the node's counters and its shutdown. The unified node
//! runs it for everything; the decode node for its decodes and recomputes;
//! the prefill node for its chunks' ends.

use kvsan_sanitizer::Owner;

use crate::node::executor::{ChunkOutcome, Executor, Planned};
use crate::node::lifecycle::{Refused, State};
use crate::node::scheduler::Scheduler;
use crate::node::sequence::Sequence;
use crate::request::{ErrorKind, Request, RequestError};
use crate::sampler::Sampler;

/// A fresh sequence for `request` (not yet admitted) on a pool of
/// `page_slots`-slot pages.
pub(crate) fn new_sequence(
    owner: Owner,
    request: Request,
    page_slots: usize,
    events: Option<crossbeam_channel::Sender<crate::request::Event>>,
) -> Result<Sequence, RequestError> {
    let sampler = Sampler::new(request.sampling)
        .map_err(|e| RequestError::new(ErrorKind::InvalidRequest, e.to_string()))?;
    Ok(Sequence {
        owner,
        prompt_len: request.prompt.len(),
        tokens: request.prompt,
        max_tokens: request.max_tokens,
        stop_tokens: request.stop_tokens,
        sampler,
        table: kvsan_sanitizer::BlockTable::new(page_slots),
        computed: 0,
        events,
        admitted_at: 0,
        placeholder: false,
        arrived: std::time::Instant::now(),
        admitted: None,
        peer_queued: std::time::Duration::ZERO,
        kv: crate::anomaly::KvCoverage::default(),
        cache_salt: request.cache_salt,
        cache_keys: Vec::new(),
        page_hashes: Vec::new(),
        cached_tokens: 0,
        offloaded: None,
    })
}

/// Enters `seq` in the node's lifecycle as queued and gives it back; when
/// the lifecycle refuses, its client gets the error instead.
pub(crate) fn queue(core: &mut Executor, mut seq: Sequence) -> Option<Sequence> {
    match core.lifecycle.queue(seq.owner) {
        Ok(()) => {
            core.enter_cache(&mut seq);
            Some(seq)
        }
        // Queued, and aborted by the hook target at once.
        Err(Refused::Violation(e)) => {
            fail(core, seq, e);
            None
        }
        // Its id is live on the node already: that record is not this
        // sequence's to end.
        Err(refused @ Refused::Illegal(_)) => {
            seq.fail(refused.into());
            None
        }
    }
}

/// Ends `seq` with `error`: frees its pages, ends it in the lifecycle.
pub(crate) fn fail(core: &mut Executor, mut seq: Sequence, error: RequestError) {
    fail_in_place(core, &mut seq, error);
}

/// [`fail`], leaving the emptied sequence with the caller.
pub(crate) fn fail_in_place(core: &mut Executor, seq: &mut Sequence, error: RequestError) {
    core.release(seq);
    // The request ends either way: a move the lifecycle refuses is logged
    // there, a violation at the end is the hook target's to report.
    let _ = core.lifecycle.fail(seq.owner, &error);
    tracing::info!(node = %core.name, request = seq.owner.request.0, tenant = seq.owner.tenant.0, kind = error.kind.name(), "request failed: {}", error.message);
    seq.fail(error);
}

/// Ends `seq`, whose last token came with `reason`: frees its pages, then
/// ends it in the lifecycle, then answers its client.
pub(crate) fn finish(core: &mut Executor, mut seq: Sequence, reason: crate::request::FinishReason) {
    core.release(&mut seq);
    match core.lifecycle.enter(seq.owner, State::Finished) {
        Ok(()) => seq.finish(reason),
        // A page leak or lifecycle violation found at the end.
        Err(e) => seq.fail(e.into()),
    }
}

/// How a sequence leaves the running batch after a step.
enum End {
    Finished(crate::request::FinishReason),
    Failed(RequestError),
}

/// Applies a step's outcomes: new tokens, finished and refused sequences.
/// `plan` indexes `sched.running`.
pub(crate) fn apply_outcomes(
    core: &mut Executor,
    sched: &mut Scheduler,
    plan: &[Planned],
    outcomes: Vec<ChunkOutcome>,
) {
    let mut ended: Vec<(usize, End)> = Vec::new();
    for (p, outcome) in plan.iter().zip(outcomes) {
        let seq = &mut sched.running[p.seq];
        match outcome {
            ChunkOutcome::Done(None) | ChunkOutcome::NotRun => {}
            ChunkOutcome::Done(Some(token)) => {
                if seq.generated() == 0
                    && let Some(e) = core.first_token_anomaly(seq)
                {
                    ended.push((p.seq, End::Failed(e)));
                    continue;
                }
                if let Err(e) = core.lifecycle.token_sampled(seq.owner) {
                    ended.push((p.seq, End::Failed(e.into())));
                    continue;
                }
                if let Some(reason) = seq.push_token(token) {
                    ended.push((p.seq, End::Finished(reason)));
                }
            }
            ChunkOutcome::Refused(e) => ended.push((p.seq, End::Failed(e))),
        }
    }
    ended.sort_by_key(|(i, _)| std::cmp::Reverse(*i));
    for (i, end) in ended {
        let seq = sched.running.remove(i);
        match end {
            End::Finished(reason) => finish(core, seq, reason),
            End::Failed(e) => fail(core, seq, e),
        }
    }
}

/// Runs one scheduled step; false when there was nothing to run.
pub(crate) fn step(core: &mut Executor, sched: &mut Scheduler) -> bool {
    let (plan, failed) = sched.plan(core);
    for (seq, e) in failed {
        fail(core, seq, e);
    }
    if plan.is_empty() {
        // Nothing to run: a request may be waiting for its KV from a tier.
        core.wait_for_tiers();
        return false;
    }
    let outcomes = core.run(&mut sched.running, &plan);
    apply_outcomes(core, sched, &plan, outcomes);
    true
}

/// Cancels request `id` wherever it is.
pub(crate) fn cancel(
    core: &mut Executor,
    sched: &mut Scheduler,
    id: kvsan_sanitizer::RequestId,
) -> bool {
    match sched.take(id) {
        Some(seq) => {
            fail(
                core,
                seq,
                RequestError::new(ErrorKind::Cancelled, "cancelled by the client"),
            );
            true
        }
        None => false,
    }
}

/// Fills in the live counters.
pub(crate) fn stats(core: &Executor, sched: &Scheduler) -> crate::node::NodeStats {
    let mut s = core.stats;
    s.free_pages = core.pool.free_pages();
    s.running = sched.running.len();
    s.waiting = sched.waiting.len();
    s.illegal_transitions = core.lifecycle.illegal_transitions();
    s.quarantined_pages = core.pool.quarantined_pages();
    s.anomalies = core.monitor.counts();
    s.prefix_cache_queries = core.cache.queries;
    s.prefix_cache_hits = core.cache.hits;
    s.cached_pages = core.cache.len();
    s.cached_tiered = core.cache.tiered();
    s.tiers = core.tier_stats();
    s
}

/// Fails every request still on the node.
pub(crate) fn shutdown(core: &mut Executor, sched: &mut Scheduler) {
    let all: Vec<Sequence> = sched
        .running
        .drain(..)
        .chain(sched.waiting.drain(..))
        .collect();
    for seq in all {
        fail(
            core,
            seq,
            RequestError::new(ErrorKind::Internal, "the engine is shutting down"),
        );
    }
}
