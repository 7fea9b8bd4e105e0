//! What every node does with its pool: allocate and free pages, and run a
//! forward step over a batch of sequences — each through the hooks.

use std::sync::Arc;

use kvsan_sanitizer::{NodeRole, Owner, PageId, PageRef, PoolGeometry, PoolId, Verdict};

use crate::faults::{self, Fault};
use crate::hooks::{Hooks, RequestEvent};
use crate::kv_pool::KvPool;
use crate::model::forward::stored_layers;
use crate::model::{AttentionCheck, Logits, Model, SeqChunk};
use crate::node::sequence::Sequence;
use crate::request::{ErrorKind, RequestError};

/// Counters a node keeps for tests and the operator.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct NodeStats {
    /// Pages in the pool.
    pub total_pages: usize,
    /// Pages on the free list now.
    pub free_pages: usize,
    /// Page allocations since start.
    pub pages_allocated: u64,
    /// KV transfers sent (prefill) or received (decode) since start.
    pub transfers: u64,
    /// Requests running now.
    pub running: usize,
    /// Requests waiting now.
    pub waiting: usize,
    /// Requests preempted (by recompute) since start.
    pub preemptions: u64,
    /// Forward steps run since start.
    pub steps: u64,
}

/// Fault `padding-slot-wrap`: a batch of two or more rows is padded to a
/// multiple of this many rows, as an engine that runs fixed batch shapes does.
pub(crate) const PAD_ROWS_TO: usize = 4;

/// A sequence's share of one step: `n` new tokens from `computed`.
#[derive(Clone, Copy, Debug)]
pub(crate) struct Planned {
    /// Index of the sequence in the node's running list.
    pub seq: usize,
    /// Tokens to compute.
    pub n: usize,
}

/// What became of a planned chunk.
#[derive(Debug)]
pub(crate) enum ChunkOutcome {
    /// Computed; `Some(token)` when the chunk completed the context and a
    /// next token was sampled.
    Done(Option<u32>),
    /// A hook or checked kernel refused it: abort the request with this error.
    Refused(RequestError),
}

/// A node's pool, model and hooks.
pub(crate) struct NodeCore {
    pub model: Arc<Model>,
    pub pool: KvPool,
    pub pool_id: PoolId,
    pub hooks: Hooks,
    pub check: AttentionCheck,
    pub name: String,
    pub step: u64,
    pub stats: NodeStats,
}

/// The client-facing error for a hook's abort verdict.
pub(crate) fn violation_error(verdict: Verdict, node: &str) -> RequestError {
    match verdict {
        Verdict::Abort { violation, kind } => RequestError {
            kind: ErrorKind::Violation,
            message: format!(
                "aborted by kvsan on the {node} node: violation {violation} ({})",
                kind.name()
            ),
            rejection: None,
            violation: Some(Box::new((violation.to_string(), kind.name().to_string()))),
        },
        Verdict::Continue => RequestError::new(ErrorKind::Internal, "aborted without a violation"),
    }
}

/// A checked attention kernel refused a `PageRef` whose generation is not
/// the page's current one: the request is aborted with a violation of its
/// own id, kind `generation-mismatch`, found without any sanitizer hook.
fn kernel_refusal(node: &str, e: &crate::EngineError) -> RequestError {
    let id = kvsan_sanitizer::ViolationId::next();
    let kind = kvsan_sanitizer::ViolationKind::GenerationMismatch.name();
    tracing::error!(node, violation = %id, kind, "checked kernel refused a read: {e}");
    RequestError {
        kind: ErrorKind::Violation,
        message: format!(
            "aborted by the checked attention kernel on the {node} node: violation {id} ({kind}): {e}"
        ),
        rejection: None,
        violation: Some(Box::new((id.to_string(), kind.to_string()))),
    }
}

impl NodeCore {
    /// A node named `name` with a pool of `n_pages` pages of `page_slots` slots.
    pub fn new(
        model: Arc<Model>,
        n_pages: usize,
        page_slots: usize,
        role: NodeRole,
        name: &str,
        hooks: Hooks,
        check: AttentionCheck,
    ) -> Result<NodeCore, crate::EngineError> {
        let geometry = model.kv_geometry(page_slots);
        let mut pool = KvPool::new(geometry, n_pages)?;
        pool.set_quarantine(hooks.quarantine_pages() as usize);
        let shadow = PoolGeometry {
            pages: n_pages as u32,
            page_slots: page_slots as u32,
            layers: geometry.n_layers as u32,
            bytes_per_slot: (geometry.slot_width() * 2 * 2) as u64,
            role,
            node: name.to_string(),
        };
        let pool_id = hooks.pool_register(&shadow, PoolId(0));
        Ok(NodeCore {
            model,
            stats: NodeStats {
                total_pages: n_pages,
                free_pages: n_pages,
                ..NodeStats::default()
            },
            pool,
            pool_id,
            hooks,
            check,
            name: name.to_string(),
            step: 0,
        })
    }

    /// Tokens the pool can hold.
    pub fn capacity_tokens(&self) -> usize {
        self.pool.n_pages() * self.pool.page_slots()
    }

    /// Reports a lifecycle event; an abort verdict becomes the request's error.
    pub fn event(&self, owner: Owner, event: RequestEvent) -> Result<(), RequestError> {
        match self.hooks.request_event(owner, event) {
            Verdict::Continue => Ok(()),
            v => Err(violation_error(v, &self.name)),
        }
    }

    /// Grows `seq`'s block table to cover `tokens` positions. `Ok(false)` when
    /// the pool ran out (pages taken so far stay with the sequence).
    pub fn ensure_pages(
        &mut self,
        seq: &mut Sequence,
        tokens: usize,
    ) -> Result<bool, RequestError> {
        let need = tokens.div_ceil(self.pool.page_slots());
        while seq.table.len() < need {
            let Some(page) = self.pool.alloc() else {
                return Ok(false);
            };
            self.stats.pages_allocated += 1;
            seq.table.push(page);
            let verdict = self.hooks.alloc(self.pool_id, seq.owner, page, self.step);
            if !verdict.is_continue() {
                return Err(violation_error(verdict, &self.name));
            }
        }
        Ok(true)
    }

    /// Returns every page of `seq` to the pool.
    pub fn release(&mut self, seq: &mut Sequence) {
        // Last page first: the free list is a stack, so the next request
        // gets these pages back in their original order.
        let pages: Vec<PageRef> = seq.table.drain(..).rev().collect();
        // Fault `double-free`: the tail page is freed on its own first (as
        // when the page being filled was kept outside the block table) and
        // then again with the rest of the table.
        let tail = faults::active(Fault::DoubleFree)
            .then(|| pages.first().copied())
            .flatten();
        for page in tail.into_iter().chain(pages) {
            self.free_page(seq.owner, page);
        }
        seq.computed = 0;
    }

    /// Returns one page of `owner` to the pool, unless the free hook refuses
    /// it: a double or foreign free is reported there and the page is not
    /// `owner`'s to return (putting it on the free list again would hand it
    /// to two requests). The request is ending either way.
    fn free_page(&mut self, owner: Owner, page: PageRef) {
        if !self
            .hooks
            .free(self.pool_id, owner, page, self.step)
            .is_continue()
        {
            return;
        }
        match self.pool.free(page) {
            Ok(()) if self.hooks.poison() => self.pool.poison_page(page.page),
            Ok(()) => {}
            Err(e) => tracing::error!(node = %self.name, request = owner.request.0, "{e}"),
        }
    }

    /// Checks one chunk through the hooks: the writes of its new slots, then
    /// the attention read of everything up to its last token.
    fn check_chunk(&self, seq: &Sequence, n: usize) -> Result<(), RequestError> {
        let ps = self.pool.page_slots();
        let n_layers = self.model.config().n_layers;
        let layers = 0..n_layers as u32;
        // The layers the forward pass really stores for this chunk.
        let stored = stored_layers(n_layers, n);
        let stored = stored.start as u32..stored.end as u32;
        let (start, end) = (seq.computed, seq.computed + n);
        let mut pos = start;
        while pos < end {
            let idx = pos / ps;
            let hi = (end - idx * ps).min(ps);
            let verdict = self.hooks.write(
                self.pool_id,
                seq.owner,
                seq.table[idx],
                (pos - idx * ps) as u32..hi as u32,
                stored.clone(),
                self.step,
            );
            if !verdict.is_continue() {
                return Err(violation_error(verdict, &self.name));
            }
            pos = idx * ps + hi;
        }
        let table = &seq.table[..end.div_ceil(ps)];
        let verdict = self
            .hooks
            .read(self.pool_id, seq.owner, table, end, layers, self.step);
        if !verdict.is_continue() {
            return Err(violation_error(verdict, &self.name));
        }
        Ok(())
    }

    /// Runs one forward step over `plan` (pages already allocated), samples
    /// a token for each chunk that completes its context, and advances
    /// `computed`. Outcomes are in plan order.
    pub fn run(&mut self, seqs: &mut [Sequence], plan: &[Planned]) -> Vec<ChunkOutcome> {
        self.step += 1;
        self.stats.steps += 1;
        let mut outcomes: Vec<Option<ChunkOutcome>> = plan
            .iter()
            .map(|p| {
                self.check_chunk(&seqs[p.seq], p.n)
                    .err()
                    .map(ChunkOutcome::Refused)
            })
            .collect();
        let mut live: Vec<usize> = (0..plan.len()).filter(|&i| outcomes[i].is_none()).collect();
        let padding = self.padding_rows(seqs, plan, &mut live, &mut outcomes);
        match self.forward(seqs, plan, &live, padding) {
            Ok(logits) => self.sample(seqs, plan, &live, &logits, &mut outcomes),
            Err(_) => {
                // A checked kernel refused a page of one sequence: find which,
                // chunk by chunk (one row: no padding), and run the others.
                for &i in &live {
                    match self.forward(seqs, plan, &[i], 0) {
                        Ok(logits) => self.sample(seqs, plan, &[i], &logits, &mut outcomes),
                        Err(e) => {
                            outcomes[i] =
                                Some(ChunkOutcome::Refused(kernel_refusal(&self.name, &e)));
                        }
                    }
                }
            }
        }
        outcomes
            .into_iter()
            .map(|o| o.expect("every chunk has an outcome"))
            .collect()
    }

    /// Fault `padding-slot-wrap`: how many padding rows the batch of `live`
    /// rows gets. A batch of two or more rows is padded to a multiple of
    /// [`PAD_ROWS_TO`] rows; the padding's write (and attention read) of the
    /// pool's last slot is reported as what it is, the first row's request
    /// writing there, before the forward pass. On an abort verdict that row
    /// is refused and the remaining batch is padded anew.
    fn padding_rows(
        &self,
        seqs: &[Sequence],
        plan: &[Planned],
        live: &mut Vec<usize>,
        outcomes: &mut [Option<ChunkOutcome>],
    ) -> usize {
        if !faults::active(Fault::PaddingSlotWrap) {
            return 0;
        }
        while live.len() >= 2 {
            let pad = live.len().next_multiple_of(PAD_ROWS_TO) - live.len();
            if pad == 0 {
                return 0;
            }
            match self.check_padding(seqs[plan[live[0]].seq].owner) {
                Ok(()) => return pad,
                Err(e) => {
                    outcomes[live[0]] = Some(ChunkOutcome::Refused(e));
                    live.remove(0);
                }
            }
        }
        0
    }

    /// The `PageRef` a padding row's slot mapping of −1 resolves to: with no
    /// bounds check, slot −1 of the flat slot array is the last slot of the
    /// pool's last page, taken at that page's current generation (whoever
    /// holds it now).
    fn wrapped_slot_page(&self) -> PageRef {
        let last = self.pool.n_pages() - 1;
        PageRef {
            page: PageId(last as u32),
            generation: self.pool.generations()[last],
        }
    }

    /// Reports a padding row on behalf of `owner` (the batch's first row):
    /// its one-token write into the pool's last slot, then its attention read
    /// of the page up to that slot.
    fn check_padding(&self, owner: Owner) -> Result<(), RequestError> {
        let ps = self.pool.page_slots();
        let n_layers = self.model.config().n_layers;
        let page = self.wrapped_slot_page();
        let stored = stored_layers(n_layers, 1);
        let verdict = self.hooks.write(
            self.pool_id,
            owner,
            page,
            (ps - 1) as u32..ps as u32,
            stored.start as u32..stored.end as u32,
            self.step,
        );
        if !verdict.is_continue() {
            return Err(violation_error(verdict, &self.name));
        }
        let verdict = self.hooks.read(
            self.pool_id,
            owner,
            &[page],
            ps,
            0..n_layers as u32,
            self.step,
        );
        if !verdict.is_continue() {
            return Err(violation_error(verdict, &self.name));
        }
        Ok(())
    }

    /// One forward pass over the `live` chunks of `plan`, followed by
    /// `padding` padding rows (fault `padding-slot-wrap`), whose stores come
    /// after the real rows' and whose outputs are discarded.
    fn forward(
        &mut self,
        seqs: &[Sequence],
        plan: &[Planned],
        live: &[usize],
        padding: usize,
    ) -> Result<Vec<f32>, crate::EngineError> {
        let pad_table = [self.wrapped_slot_page()];
        let pad_pos = self.pool.page_slots() - 1;
        let mut chunks: Vec<SeqChunk<'_>> = live
            .iter()
            .map(|&i| {
                let (s, n) = (&seqs[plan[i].seq], plan[i].n);
                SeqChunk {
                    tokens: &s.tokens[s.computed..s.computed + n],
                    start_pos: s.computed,
                    block_table: &s.table,
                    logits: if s.computed + n == s.tokens.len() {
                        Logits::Last
                    } else {
                        Logits::None
                    },
                }
            })
            .collect();
        if let (true, Some(&first)) = (padding > 0, live.first()) {
            // Each padding row repeats the first row's last token.
            let (s, n) = (&seqs[plan[first].seq], plan[first].n);
            let token = &s.tokens[s.computed + n - 1..s.computed + n];
            chunks.extend((0..padding).map(|_| SeqChunk {
                tokens: token,
                start_pos: pad_pos,
                block_table: &pad_table,
                logits: Logits::None,
            }));
        }
        self.model.forward(&mut self.pool, &chunks, self.check)
    }

    fn sample(
        &self,
        seqs: &mut [Sequence],
        plan: &[Planned],
        live: &[usize],
        logits: &[f32],
        outcomes: &mut [Option<ChunkOutcome>],
    ) {
        let vocab = self.model.config().vocab_size;
        let mut row = 0;
        for &i in live {
            let s = &mut seqs[plan[i].seq];
            s.computed += plan[i].n;
            let token = if s.computed == s.tokens.len() {
                let t = s.sampler.sample(&logits[row * vocab..(row + 1) * vocab]);
                row += 1;
                Some(t)
            } else {
                None
            };
            outcomes[i] = Some(ChunkOutcome::Done(token));
        }
    }
}
