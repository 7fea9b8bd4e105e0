//! What every node does with its pool: allocate and free pages, and run a
//! forward step over a batch of sequences — its KV accesses checked in the
//! kernels ([`crate::kv_access`]). Each request's state on the node is its
//! lifecycle's ([`crate::node::lifecycle`]).

use std::sync::Arc;

use kvsan_sanitizer::{NodeRole, Owner, PageRef, PoolGeometry, PoolId};

use crate::anomaly::{AnomalyCounts, FirstToken, Monitor};
use crate::hooks::{Hooks, KernelShadowHandle};
use crate::kv_access::{KvAccess, RowFault};
use crate::kv_pool::KvPool;
use crate::model::{AttentionCheck, Logits, Model};
use crate::node::batch::{BatchBuilder, PlannedRow};
use crate::node::lifecycle::Lifecycle;
use crate::node::sequence::Sequence;
use crate::prefix_cache::{self, Place, PrefixCache, PrefixCachePolicy};
use crate::request::{ErrorKind, RequestError, Violated};
use crate::tier::{TierConfig, TierStats, Tiers};

mod faults;
mod tiering;

pub(crate) use faults::complete_late_stores;

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
    /// Lifecycle moves refused as engine bugs since start (0 in a correct
    /// engine; each is logged).
    pub illegal_transitions: u64,
    /// Freed pages held in quarantine now (counted in `free_pages`).
    pub quarantined_pages: usize,
    /// Requests the anomaly monitor flagged since start, by kind.
    pub anomalies: AnomalyCounts,
    /// Prompt tokens looked up in the prefix cache since start.
    pub prefix_cache_queries: u64,
    /// Prompt tokens found in the prefix cache since start.
    pub prefix_cache_hits: u64,
    /// Pages the prefix cache holds now.
    pub cached_pages: usize,
    /// Prefix-cache pages whose KV is in a tier now.
    pub cached_tiered: usize,
    /// The KV tiers, host and disk (all zero for one not configured).
    pub tiers: [TierStats; 2],
}

/// How a node is set up: the engine configuration's part that every node
/// shares.
#[derive(Clone, Debug)]
pub(crate) struct NodeSettings {
    /// Token slots per KV page.
    pub page_slots: usize,
    /// The hook target.
    pub hooks: Hooks,
    /// How attention reads the pool.
    pub check: AttentionCheck,
    /// What the anomaly monitor does with a flagged request.
    pub anomaly: crate::anomaly::AnomalyAction,
    /// The node's prefix cache.
    pub prefix_cache: PrefixCachePolicy,
    /// The KV tiers below the pool.
    pub tiers: TierConfig,
}

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
    /// Not computed this step (another row made the step's batch invalid);
    /// planned again next step.
    NotRun,
    /// A check refused one of its KV accesses (or the engine's own bounds):
    /// abort the request with this error.
    Refused(RequestError),
}

/// A node's pool, model and hooks.
pub(crate) struct Executor {
    pub model: Arc<Model>,
    pub pool: KvPool,
    pub pool_id: PoolId,
    pub hooks: Hooks,
    /// Each request's state on this node; its lifecycle events.
    pub lifecycle: Lifecycle,
    /// The hook target's kernel shadow of the pool, if it has one.
    pub kernel_shadow: Option<KernelShadowHandle>,
    pub check: AttentionCheck,
    pub name: String,
    pub step: u64,
    pub stats: NodeStats,
    /// Checks each request at its first token.
    pub monitor: Monitor,
    /// Full pages kept for later requests with the same prefix.
    pub cache: PrefixCache,
    /// Per page: how many hold it (its owner, the cache, each sharer); the
    /// page goes back to the pool at 0.
    holders: Vec<u32>,
    batch: BatchBuilder,
    /// Where preempted requests' and evicted cached pages go, if anywhere.
    tiers: Option<Tiers>,
    /// The tier fail points' state (empty without them).
    tier_faults: faults::TierFaults,
}

/// The client-facing error for a row the step's kernels stopped.
fn row_error(node: &str, fault: &RowFault) -> RequestError {
    match fault {
        RowFault::Violation(verdict) => RequestError::aborted_by(*verdict, node),
        RowFault::Generation(refusal) => {
            // The pool's generation check (no sanitizer attached): a
            // violation of its own id, found without any hook.
            let id = kvsan_sanitizer::ViolationId::next();
            let kind = kvsan_sanitizer::ViolationKind::GenerationMismatch;
            let current = match refusal.reason {
                kvsan_kernels::guard::Reason::Generation { current } => current.0,
                _ => 0,
            };
            let what = format!(
                "{:?} through {} whose page is at gen {current}",
                refusal.access, refusal.page
            );
            tracing::error!(node, violation = %id, kind = kind.name(), "checked kernel refused an access: {what}");
            RequestError {
                kind: ErrorKind::Violation,
                message: format!(
                    "aborted by the checked KV kernels on the {node} node: violation {id} ({kind}): {what}"
                ),
                rejection: None,
                violation: Some(Violated { id, kind }),
            }
        }
        RowFault::Outside(refusal) => {
            tracing::error!(
                node,
                "KV kernels refused an access outside the pool: {refusal:?}"
            );
            RequestError::new(
                ErrorKind::Internal,
                format!(
                    "the {node} node's batch sent a KV access outside its pool ({:?} through {}); the request is aborted",
                    refusal.access, refusal.page
                ),
            )
        }
        RowFault::Nan { layer } => RequestError::new(
            ErrorKind::Internal,
            format!(
                "attention output of layer {layer} on the {node} node turned NaN with no poisoned slot behind it"
            ),
        ),
    }
}

impl Executor {
    /// A node named `name` with a pool of `n_pages` pages, set up as `cfg`
    /// says.
    pub fn new(
        model: Arc<Model>,
        n_pages: usize,
        role: NodeRole,
        name: &str,
        cfg: NodeSettings,
    ) -> Result<Executor, crate::EngineError> {
        let (page_slots, hooks) = (cfg.page_slots, cfg.hooks);
        let geometry = model.kv_geometry(page_slots);
        let mut pool = KvPool::new(geometry, n_pages)?;
        pool.set_quarantine(hooks.quarantine_pages() as usize);
        let tiers = Tiers::new(geometry.page_elems(), &cfg.tiers, name)?;
        let shadow = PoolGeometry {
            pages: n_pages as u32,
            page_slots: page_slots as u32,
            layers: geometry.n_layers as u32,
            bytes_per_slot: (geometry.slot_width() * 2 * 2) as u64,
            role,
            node: name.to_string(),
        };
        let pool_id = hooks.pool_register(&shadow, PoolId(0));
        let kernel_shadow = kernel_shadow_of(&hooks, pool_id, &shadow, name);
        let lifecycle = Lifecycle::new(role, name, pool_id, hooks.clone());
        let width = model
            .config()
            .context_length
            .div_ceil(page_slots)
            .min(n_pages);
        Ok(Executor {
            model,
            stats: NodeStats {
                total_pages: n_pages,
                free_pages: n_pages,
                ..NodeStats::default()
            },
            pool,
            pool_id,
            hooks,
            lifecycle,
            kernel_shadow,
            check: cfg.check,
            name: name.to_string(),
            step: 0,
            monitor: Monitor::new(cfg.anomaly),
            cache: PrefixCache::new(cfg.prefix_cache, page_slots),
            holders: vec![0; n_pages],
            batch: BatchBuilder::new(width),
            tiers,
            tier_faults: faults::TierFaults::default(),
        })
    }

    /// Tokens the pool can hold.
    pub fn capacity_tokens(&self) -> usize {
        self.pool.n_pages() * self.pool.page_slots()
    }

    /// Pages an allocation can take now: the free list, the quarantine and
    /// the cached pages no request holds (evicted on demand).
    pub fn free_pages(&self) -> usize {
        self.pool.free_pages() + self.cache.evictable()
    }

    /// Grows `seq`'s block table to cover `tokens` positions. `Ok(false)` when
    /// the pool ran out (pages taken so far stay with the sequence).
    pub fn ensure_pages(
        &mut self,
        seq: &mut Sequence,
        tokens: usize,
    ) -> Result<bool, RequestError> {
        let need = seq.table.entries_for(tokens);
        while seq.table.len() < need {
            let Some(page) = self.alloc_page() else {
                return Ok(false);
            };
            self.stats.pages_allocated += 1;
            seq.table.push(page);
            let verdict = self.hooks.alloc(self.pool_id, seq.owner, page, self.step);
            if !verdict.is_continue() {
                return Err(RequestError::aborted_by(verdict, &self.name));
            }
            faults::cache_register_before_write(self, seq);
        }
        Ok(true)
    }

    /// A page off the free list, or from evicting the least recently used
    /// cached page when the list is empty.
    fn alloc_page(&mut self) -> Option<PageRef> {
        loop {
            if let Some(page) = self.pool.alloc() {
                self.holders[page.page.0 as usize] = 1;
                return Some(page);
            }
            self.evict_one()?;
        }
    }

    /// Evicts one cached page; `None` when none can go.
    fn evict_one(&mut self) -> Option<()> {
        let gone = self.cache.evict()?;
        self.stats.cached_pages = self.cache.len();
        self.demote(gone);
        self.free_page(gone.holder, gone.page);
        faults::cache_evict_referenced(self, gone.page);
        Some(())
    }

    /// Joins `seq` to this node's prefix cache: its keys, and its salt
    /// declared to the hook target before it takes a page.
    pub fn enter_cache(&mut self, seq: &mut Sequence) {
        if !seq.cache_salt.is_empty() {
            let verdict = self.hooks.declare_salt(seq.owner, seq.cache_salt.id());
            if !verdict.is_continue() {
                tracing::warn!(node = %self.name, request = seq.owner.request.0, "the hook target refused the cache salt declaration");
            }
        }
        if self.cache.enabled() {
            seq.cache_keys =
                prefix_cache::extra_keys(self.cache.policy(), seq.owner.tenant, &seq.cache_salt);
        }
    }

    /// Shares the cached pages `seq`'s tokens begin with, read-only, before
    /// it computes anything: they become the first entries of its block
    /// table and count as computed. Every share goes through the hook
    /// target's `share` check first. Cached pages whose KV is in a tier
    /// are read back first: `Ok(false)` until they are (the sequence waits,
    /// holding nothing); then each is loaded into a page of the sequence
    /// and cached again.
    ///
    /// # Errors
    /// The hook target refused a share or a load: the request is aborted
    /// (the pages shared so far are in its table and go with its release).
    pub fn share_prefix(&mut self, seq: &mut Sequence) -> Result<bool, RequestError> {
        if !self.cache.enabled() || !seq.table.is_empty() || seq.computed != 0 {
            return Ok(true);
        }
        let hits = self.cache.peek(&seq.cache_keys, &seq.tokens);
        if !self.cache_reads_back(&hits) {
            return Ok(false);
        }
        self.cache.count(seq.tokens.len(), &hits);
        self.stats.prefix_cache_queries = self.cache.queries;
        self.stats.prefix_cache_hits = self.cache.hits;
        seq.page_hashes.clear();
        // Taking pages for the entries in a tier may evict, and make room
        // in a tier: the chain's pool pages leave the LRU and its tier
        // entries are pinned first.
        for hit in &hits {
            match hit.place {
                Place::Pool(page) => self.cache.referenced(page),
                Place::Tier { .. } => self.cache.pin(hit.serial, true),
            }
        }
        let mut shared = 0;
        let mut result = Ok(true);
        for hit in &hits {
            match hit.place {
                Place::Pool(page) => {
                    let verdict = self.hooks.share(self.pool_id, page, seq.owner);
                    if !verdict.is_continue() {
                        result = Err(RequestError::aborted_by(verdict, &self.name));
                        break;
                    }
                    self.holders[page.page.0 as usize] += 1;
                    seq.table.push(page);
                }
                Place::Tier { .. } => match self.load_cached(seq, hit) {
                    Ok(true) => {}
                    Ok(false) => break,
                    Err(e) => {
                        result = Err(e);
                        break;
                    }
                },
            }
            shared += 1;
            if hit.tokens == self.pool.page_slots() {
                seq.page_hashes.push(hit.hash);
            }
            let layers = self.model.config().n_layers;
            seq.kv
                .record(seq.computed, hit.tokens, 0..layers, seq.prompt_len, layers);
            seq.computed += hit.tokens;
        }
        // Pool pages of the chain this sequence did not take: back to the
        // LRU when only the cache holds them.
        for hit in &hits[shared..] {
            if let Some(page) = hit.page()
                && self.holders[page.page.0 as usize] == 1
            {
                self.cache.unreferenced(page);
            }
            if matches!(hit.place, Place::Tier { .. }) {
                self.cache.pin(hit.serial, false);
            }
        }
        if seq.generated() == 0 {
            seq.cached_tokens = seq.computed.min(seq.prompt_len);
        }
        result
    }

    /// Registers `seq`'s full pages up to position `upto` in the prefix
    /// cache (those not registered yet), each after the one before it. A
    /// page whose registration the hook target refuses, or whose content
    /// another page already holds, ends the chain here.
    fn register_pages(&mut self, seq: &mut Sequence, upto: usize) {
        if !self.cache.enabled() {
            return;
        }
        let ps = self.pool.page_slots();
        let full = upto.min(seq.tokens.len()) / ps;
        let keys = faults::cache_salt_dropped(
            self.cache.policy(),
            seq.owner.tenant,
            &seq.cache_salt,
            &seq.cache_keys,
        );
        while seq.page_hashes.len() < full.min(seq.table.len()) {
            let i = seq.page_hashes.len();
            let tokens = &seq.tokens[i * ps..(i + 1) * ps];
            let parent = i.checked_sub(1).map(|p| seq.table.pages()[p]);
            if parent.is_some_and(|p| !self.cache.holds(p)) {
                return;
            }
            let hash = prefix_cache::page_hash(seq.page_hashes.last().copied(), &keys, tokens);
            let page = seq.table.pages()[i];
            if !self.cache.holds(page) {
                if self.cache.contains_hash(hash) {
                    return;
                }
                let holder = prefix_cache::holder(seq.owner.tenant);
                if !self.hooks.share(self.pool_id, page, holder).is_continue() {
                    return;
                }
                self.holders[page.page.0 as usize] += 1;
                self.cache
                    .insert(hash, page, parent, &keys, tokens, seq.owner.tenant);
                self.stats.cached_pages = self.cache.len();
            }
            seq.page_hashes.push(hash);
        }
        faults::cache_partial_page_shared(self, seq, upto, &keys);
    }

    /// The anomaly monitor's check of `seq` as its first token is about to
    /// leave: the error to end it with when it is flagged and the node
    /// aborts what it flags.
    pub fn first_token_anomaly(&mut self, seq: &Sequence) -> Option<RequestError> {
        let seen = FirstToken {
            owner: seq.owner,
            prompt_tokens: seq.prompt_len,
            cached_tokens: seq.cached_tokens,
            kv_tokens: seq.kv.positions(),
            service: seq.service_time(),
        };
        self.monitor.first_token(&self.name, seen)
    }

    /// Lets go of every page of `seq` (each goes back to the pool when its
    /// last holder lets go).
    pub fn release(&mut self, seq: &mut Sequence) {
        faults::cache_keeps_aborted(self, seq);
        // Last page first: the free list is a stack, so the next request
        // gets these pages back in their original order.
        let pages: Vec<PageRef> = seq.table.take().into_iter().rev().collect();
        faults::double_free(self, seq.owner, &pages);
        for page in pages {
            self.free_page(seq.owner, page);
        }
        seq.computed = 0;
        seq.page_hashes.clear();
        seq.kv.clear();
        if let Some(off) = seq.offloaded.take() {
            self.release_blocks(&off.blocks);
        }
    }

    /// `owner` (a request, or the cache) lets go of `page`, unless the free
    /// hook refuses it: a double or foreign free is reported there and the
    /// page is not `owner`'s to return (putting it on the free list again
    /// would hand it to two requests). The page goes back to the pool when
    /// no one holds it; a cached page only the cache still holds joins the
    /// cache's LRU.
    fn free_page(&mut self, owner: Owner, page: PageRef) {
        if !self
            .hooks
            .free(self.pool_id, owner, page, self.step)
            .is_continue()
        {
            return;
        }
        let idx = page.page.0 as usize;
        let current = self.pool.generations().get(idx) == Some(&page.generation);
        if current && let Some(h) = self.holders.get_mut(idx) {
            *h = h.saturating_sub(1);
            if *h == 1 && self.cache.holds(page) {
                self.cache.unreferenced(page);
            }
            if *h > 0 {
                return;
            }
        }
        match self.pool.free(page) {
            Ok(()) if self.hooks.poison() => self.pool.poison_page(page.page),
            Ok(()) => {}
            Err(e) => tracing::error!(node = %self.name, request = owner.request.0, "{e}"),
        }
    }

    /// The batch arrays will be built afresh (the node is idle).
    pub fn idle(&mut self) {
        self.batch.reset();
    }

    /// Runs one forward step over `plan` (pages already allocated), samples
    /// a token for each chunk that completes its context, and advances
    /// `computed`. Outcomes are in plan order.
    pub fn run(&mut self, seqs: &mut [Sequence], plan: &[Planned]) -> Vec<ChunkOutcome> {
        self.step += 1;
        self.stats.steps += 1;
        let rows: Vec<PlannedRow<'_>> = plan
            .iter()
            .map(|p| {
                let s = &seqs[p.seq];
                PlannedRow {
                    owner: s.owner,
                    table: &s.table,
                    tokens: &s.tokens[s.computed..s.computed + p.n],
                    start: s.computed,
                    logits: if s.computed + p.n == s.tokens.len() {
                        Logits::Last
                    } else {
                        Logits::None
                    },
                }
            })
            .collect();
        self.batch.build(&rows, &self.pool);
        drop(rows);
        let plan_rows = self.batch.plan_rows().to_vec();
        let shadow = self.kernel_shadow.as_ref().map(KernelShadowHandle::view);
        let mut kv = KvAccess::new(
            &mut self.pool,
            self.batch.last(),
            self.check,
            shadow,
            &self.hooks,
            self.pool_id,
            self.step,
        );
        let result = self.model.forward(&mut kv);
        let faults = kv.finish();
        let mut outcomes: Vec<Option<ChunkOutcome>> = (0..plan.len()).map(|_| None).collect();
        let owners = &self.batch.last().owners;
        // A stopped row stops every row of its request (padding rows repeat
        // the first row's request).
        for (row, fault) in &faults {
            let owner = owners[*row];
            for (i, p) in plan.iter().enumerate() {
                if seqs[p.seq].owner == owner && outcomes[i].is_none() {
                    outcomes[i] = Some(ChunkOutcome::Refused(row_error(&self.name, fault)));
                }
            }
        }
        match result {
            Ok(logits) => self.sample(seqs, plan, &plan_rows, &logits, &mut outcomes),
            Err(e) => {
                // An invalid batch computes nothing: its row's request is
                // aborted, the others run again next step.
                let bad = match &e {
                    crate::EngineError::InvalidBatch { chunk, .. } => {
                        plan_rows.get(*chunk).copied().flatten()
                    }
                    _ => None,
                };
                tracing::error!(node = %self.name, "step refused: {e}");
                for (i, outcome) in outcomes.iter_mut().enumerate() {
                    if outcome.is_none() {
                        *outcome = Some(if bad.is_none_or(|b| b == i) {
                            ChunkOutcome::Refused(RequestError::new(
                                ErrorKind::Internal,
                                e.to_string(),
                            ))
                        } else {
                            ChunkOutcome::NotRun
                        });
                    }
                }
            }
        }
        outcomes
            .into_iter()
            .map(|o| o.expect("every chunk has an outcome"))
            .collect()
    }

    /// Samples the next token of every computed chunk that completed its
    /// context, kernel row by kernel row (the order the logits come in).
    fn sample(
        &mut self,
        seqs: &mut [Sequence],
        plan: &[Planned],
        plan_rows: &[Option<usize>],
        logits: &[f32],
        outcomes: &mut [Option<ChunkOutcome>],
    ) {
        let vocab = self.model.config().vocab_size;
        let mut written = Vec::new();
        let batch = self.batch.last();
        let mut at = 0;
        for (row, plan_row) in plan_rows.iter().enumerate() {
            let wants = batch.logits[row] == Logits::Last;
            let Some(i) = *plan_row else {
                continue;
            };
            let row_logits = wants.then(|| {
                let l = &logits[at * vocab..(at + 1) * vocab];
                at += 1;
                l
            });
            if outcomes[i].is_some() {
                continue;
            }
            let s = &mut seqs[plan[i].seq];
            if s.computed < s.prompt_len {
                let layers = self.model.config().n_layers;
                s.kv.record(s.computed, plan[i].n, 0..layers, s.prompt_len, layers);
            }
            s.computed += plan[i].n;
            written.push(plan[i].seq);
            let token = match row_logits {
                Some(l) if self.hooks.poison() && l.iter().any(|v| v.is_nan()) => {
                    outcomes[i] = Some(ChunkOutcome::Refused(RequestError::new(
                        ErrorKind::Internal,
                        format!("logits on the {} node are NaN", self.name),
                    )));
                    continue;
                }
                Some(l) => Some(s.sampler.sample(l)),
                None => None,
            };
            outcomes[i] = Some(ChunkOutcome::Done(token));
        }
        // The pages this step filled are registered after it wrote them.
        for seq in written {
            let s = &mut seqs[seq];
            let upto = s.computed;
            self.register_pages(s, upto);
        }
    }
}

/// The target's kernel shadow of the pool just registered, if it has one
/// and it covers the pool as the engine laid it out.
fn kernel_shadow_of(
    hooks: &Hooks,
    pool: PoolId,
    geometry: &PoolGeometry,
    node: &str,
) -> Option<KernelShadowHandle> {
    if !hooks.is_attached() || pool == crate::hooks::UNREGISTERED_POOL {
        return None;
    }
    let Some(handle) = hooks.kernel_shadow(pool) else {
        tracing::error!(
            node,
            "kvsan: the hook target gave no kernel shadow; KV stores and attention reads go unchecked"
        );
        return None;
    };
    let want = (geometry.pages, geometry.page_slots, geometry.layers);
    if handle.geometry() != want {
        tracing::error!(node, shadow = ?handle.geometry(), pool = ?want, "kvsan: the kernel shadow does not cover the pool; KV accesses go unchecked");
        return None;
    }
    Some(handle)
}
