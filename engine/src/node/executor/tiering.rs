//! A node's pages going down its KV tiers and coming back: a preempted
//! request's pages (host tier first), the prefix cache's evicted pages
//! (disk tier first), each store, load and release reported to the hook
//! target, which keeps the block's identity.
//!
//! ```text
//!  offload(seq)   tier_store ─ staging copy ─ tier_store_done(digest) ─ write queued ─ pages freed
//!  reload(seq)    reads queued … (wait at the queue's head) … pages taken ─ tier_load ─ copy
//!                 ─ tier_verify(digest of the page) ─ blocks released
//!  evict cached   the same store, by the cache's holder; the entry stays, in its block
//!  hit in a tier  the same load, by the request; the page registered in the cache again
//! ```

use kvsan_sanitizer::{Owner, PageRef, TierBlockId, Verdict};

use super::{Executor, faults};
use crate::node::sequence::{Offloaded, Sequence};
use crate::prefix_cache::{Evicted, Hit, Place};
use crate::request::RequestError;
use crate::tier::{self, DISK_TIER, HOST_TIER, ReadState, TierStats};

/// Where a preempted request's pages go: host memory first.
const PREEMPTION_ORDER: [u32; 2] = [HOST_TIER, DISK_TIER];
/// Where the prefix cache's evicted pages go: disk first (they may be
/// wanted again much later).
const CACHE_ORDER: [u32; 2] = [DISK_TIER, HOST_TIER];

/// What became of one page's load.
enum Landed {
    /// Its KV is in the page, checked.
    Loaded,
    /// The tier's read failed: nothing is served from the block.
    Lost(String),
}

impl Executor {
    /// Preempts `seq` down a tier: each of its pages is stored into a tier
    /// block (the hook target told before the copy, and what was read
    /// after it), then its pages are let go of. `Ok(false)`, with nothing
    /// changed, when there is no tier or none has room: the caller
    /// preempts by recompute. An error when the target refuses a store:
    /// the request ends (its blocks let go of; its pages, which it still
    /// holds, go with it).
    pub fn offload(&mut self, seq: &mut Sequence) -> Result<bool, RequestError> {
        let pages: Vec<PageRef> = seq.table.pages().to_vec();
        if seq.computed == 0 || pages.is_empty() {
            return Ok(false);
        }
        let Some(tier) = self.room(&PREEMPTION_ORDER, pages.len()) else {
            return Ok(false);
        };
        let mut blocks: Vec<TierBlockId> = Vec::with_capacity(pages.len());
        for page in pages {
            match self.store(tier, seq.owner, page) {
                Ok(Some(id)) => blocks.push(id),
                Ok(None) => {
                    // No block after all: recompute.
                    self.release_blocks(&blocks);
                    return Ok(false);
                }
                Err(verdict) => {
                    self.release_blocks(&blocks);
                    return Err(RequestError::aborted_by(verdict, &self.name));
                }
            }
        }
        let tokens = seq.computed;
        let kv = std::mem::take(&mut seq.kv);
        self.release(seq);
        seq.offloaded = Some(Offloaded { blocks, tokens, kv });
        Ok(true)
    }

    /// Stores `page` into a new block of `tier` for `owner`: the block
    /// (`None` when the tier has no free one), or the hook target's
    /// refusal (the block let go of when it is not another store's).
    fn store(
        &mut self,
        tier: u32,
        owner: Owner,
        page: PageRef,
    ) -> Result<Option<TierBlockId>, Verdict> {
        let Some((id, fresh)) = faults::block_for_store(self, tier) else {
            return Ok(None);
        };
        let verdict = self
            .hooks
            .tier_store(self.pool_id, owner, page, id, self.step);
        if !verdict.is_continue() {
            // Refused before the copy: the block was never stored, and is
            // not the target's to be told of.
            if fresh && let Some(t) = self.tiers.as_mut() {
                t.put_back(id);
            }
            return Err(verdict);
        }
        if faults::store_late(self, owner, page, id) {
            return Ok(Some(id));
        }
        let verdict = self.finish_store(id, page);
        if verdict.is_continue() {
            Ok(Some(id))
        } else {
            Err(verdict)
        }
    }

    /// The staging copy of `page` for block `id` (the store has read its
    /// source), reported with its digest, and its write queued.
    pub(super) fn finish_store(&mut self, id: TierBlockId, page: PageRef) -> Verdict {
        let data = self.pool.page_data(page.page).to_vec();
        let verdict = self.hooks.tier_store_done(id, tier::digest(&data), true);
        if verdict.is_continue()
            && let Some(t) = self.tiers.as_mut()
        {
            t.write(id, data);
        }
        verdict
    }

    /// The first tier of `order` that has, or can make, `n` free blocks
    /// (by letting go of the prefix cache's oldest blocks there).
    fn room(&mut self, order: &[u32], n: usize) -> Option<u32> {
        let tiers = self.tiers.as_ref()?;
        let tier = order.iter().copied().find(|&t| {
            let free = tiers.free_blocks(t);
            tiers.has(t) && (free >= n || free + self.cache.releasable_in_tier(t) >= n)
        })?;
        while self.tiers.as_ref()?.free_blocks(tier) < n {
            let serial = self.cache.oldest_in_tier(tier)?;
            if let Some(block) = self.cache.forget(serial) {
                self.release_blocks(&[block]);
            }
            self.stats.cached_tiered = self.cache.tiered();
        }
        Some(tier)
    }

    /// Brings a sequence preempted down a tier back. Its blocks' reads are
    /// queued first; until every one has come back, `Ok(false)` (the
    /// sequence waits at the head of the queue, holding no page). Then
    /// pages for its tokens, each block loaded into its page (the hook
    /// target asked before the copy, and told the digest of what landed),
    /// the blocks let go of. `Ok(false)` too when the pool has too few
    /// pages. A read the tier lost: the sequence recomputes, from nothing.
    /// An error when the target refuses a load: the request ends.
    pub fn reload(&mut self, seq: &mut Sequence) -> Result<bool, RequestError> {
        let Some(off) = seq.offloaded.take() else {
            return Ok(true);
        };
        if let Some(e) = faults::doomed(self, seq.owner.request) {
            self.release_blocks(&off.blocks);
            return Err(e);
        }
        if !self.reads_back(&off.blocks) {
            seq.offloaded = Some(off);
            return Ok(false);
        }
        match self.ensure_pages(seq, off.tokens) {
            Ok(true) => {}
            Ok(false) => {
                self.release(seq);
                seq.offloaded = Some(off);
                return Ok(false);
            }
            Err(e) => {
                self.release_blocks(&off.blocks);
                return Err(e);
            }
        }
        let pages: Vec<PageRef> = seq.table.pages().to_vec();
        for (&id, &page) in off.blocks.iter().zip(&pages) {
            match self.load(seq.owner, page, id) {
                Ok(Landed::Loaded) => {}
                Ok(Landed::Lost(why)) => {
                    tracing::warn!(node = %self.name, request = seq.owner.request.0, block = %id, "a preempted request's KV could not be read back ({why}); it is recomputed");
                    self.release_blocks(&off.blocks);
                    self.release(seq);
                    return Ok(true);
                }
                Err(e) => {
                    self.release_blocks(&off.blocks);
                    return Err(e);
                }
            }
        }
        if let (Some(t), Some(&first)) = (self.tiers.as_mut(), off.blocks.first()) {
            for &id in &off.blocks {
                t.count_load(id, id == first);
            }
        }
        self.release_blocks(&off.blocks);
        seq.computed = off.tokens;
        seq.kv = off.kv;
        Ok(true)
    }

    /// Whether every one of `blocks` has been read back (each read queued
    /// once).
    fn reads_back(&mut self, blocks: &[TierBlockId]) -> bool {
        let Some(t) = self.tiers.as_mut() else {
            return true;
        };
        t.poll();
        for &id in blocks {
            t.request_read(id);
        }
        blocks.iter().all(|&id| t.read_done(id))
    }

    /// Loads block `id`, read back, into `page` for `owner`: the hook
    /// target's check before the copy, the copy, the digest of what
    /// landed checked.
    fn load(
        &mut self,
        owner: Owner,
        page: PageRef,
        id: TierBlockId,
    ) -> Result<Landed, RequestError> {
        let read = self
            .tiers
            .as_mut()
            .map_or(ReadState::Failed("no tier".into()), |t| t.take_read(id));
        let data = match read {
            ReadState::Ready(data) => data,
            ReadState::Failed(why) => return Ok(Landed::Lost(why)),
            ReadState::Pending => return Ok(Landed::Lost("its read has not come back".into())),
        };
        let mut verdict = self
            .hooks
            .tier_load(self.pool_id, owner, page, id, self.step);
        if verdict.is_continue() {
            let ps = self.pool.geometry().page_elems();
            let at = page.page.0 as usize * ps;
            let dst = &mut self.pool.data_mut()[at..at + ps];
            if !faults::tier_read_fails() {
                dst.copy_from_slice(&data);
            }
            let landed = tier::digest(dst);
            verdict = self
                .hooks
                .tier_verify(self.pool_id, owner, page, id, landed);
        }
        if verdict.is_continue() {
            Ok(Landed::Loaded)
        } else {
            Err(RequestError::aborted_by(verdict, &self.name))
        }
    }

    /// The tier lets go of `blocks` (the hook target told).
    pub(super) fn release_blocks(&mut self, blocks: &[TierBlockId]) {
        let Some(tiers) = self.tiers.as_mut() else {
            return;
        };
        for &id in blocks {
            // A release concerns no request: there is nothing to abort,
            // and a target that found something has reported it.
            let _ = self.hooks.tier_release(id);
            tiers.put_back(id);
        }
    }

    /// A cached page the pool evicts goes down a tier when one has room
    /// (its entry stays, in the block), else it is forgotten. The store is
    /// the cache's (its holder identity holds the page); a store the hook
    /// target refuses forgets the entry.
    pub(super) fn demote(&mut self, gone: Evicted) {
        let tier = self.room(&CACHE_ORDER, 1);
        let stored = tier.and_then(|t| self.store(t, gone.holder, gone.page).ok().flatten());
        match stored {
            Some(block) => {
                faults::file_tier_block(self, gone.page.page, block);
                self.cache.demoted(gone.serial, block, gone.page.page);
            }
            None => {
                if let Some(block) = self.cache.forget(gone.serial) {
                    self.release_blocks(&[block]);
                }
            }
        }
        self.stats.cached_tiered = self.cache.tiered();
    }

    /// Queues the reads of the tier blocks among `hits`; whether all have
    /// come back. (An entry let go of meanwhile is a miss at the lookup
    /// that follows: its read is dropped with its block.)
    pub(super) fn cache_reads_back(&mut self, hits: &[Hit]) -> bool {
        let blocks: Vec<TierBlockId> = hits
            .iter()
            .filter_map(|h| match h.place {
                Place::Tier { .. } => Some(faults::tier_block_of(self, h)),
                Place::Pool(_) => None,
            })
            .collect();
        self.reads_back(&blocks)
    }

    /// Loads cached entry `hit`, in a tier, into a new page of `seq` and
    /// registers the page in the cache again (its block let go of).
    /// `Ok(false)` when it cannot be served (no page, the read lost): the
    /// entry is forgotten and the chain ends there.
    pub(super) fn load_cached(
        &mut self,
        seq: &mut Sequence,
        hit: &Hit,
    ) -> Result<bool, RequestError> {
        let id = faults::tier_block_of(self, hit);
        self.cache.pin(hit.serial, false);
        let forget = |core: &mut Executor| {
            if let Some(block) = core.cache.forget(hit.serial) {
                core.release_blocks(&[block]);
            }
            core.stats.cached_tiered = core.cache.tiered();
        };
        let need = seq.computed + hit.tokens;
        if !self.ensure_pages(seq, need)? {
            forget(self);
            return Ok(false);
        }
        let page = *seq.table.pages().last().expect("a page was just taken");
        match self.load(seq.owner, page, id)? {
            Landed::Loaded => {}
            Landed::Lost(why) => {
                tracing::warn!(node = %self.name, block = %id, "a cached page could not be read back ({why}); it is recomputed");
                forget(self);
                return Ok(false);
            }
        }
        if let Some(t) = self.tiers.as_mut() {
            t.count_load(id, true);
        }
        let holder = self.cache.holder_of_entry(hit.serial).unwrap_or(seq.owner);
        let shared = self.hooks.share(self.pool_id, page, holder).is_continue();
        if shared && self.cache.promoted(hit.serial, page) {
            self.holders[page.page.0 as usize] += 1;
        } else {
            self.cache.forget(hit.serial);
        }
        // The entry's own block (under fault `tier-meta-by-page-id`, not
        // always the one loaded).
        if let Place::Tier { block, .. } = hit.place {
            self.release_blocks(&[block]);
        }
        self.stats.cached_pages = self.cache.len();
        self.stats.cached_tiered = self.cache.tiered();
        Ok(true)
    }

    /// Each tier's counters (all zero for a tier not configured).
    pub fn tier_stats(&self) -> [TierStats; 2] {
        self.tiers.as_ref().map(|t| t.stats()).unwrap_or_default()
    }

    /// Waits a moment for the tiers' I/O when some is in flight (the node
    /// had nothing to run: a request waits for its KV from a tier).
    pub fn wait_for_tiers(&mut self) {
        if let Some(t) = self.tiers.as_mut() {
            t.wait(std::time::Duration::from_millis(2));
        }
    }
}
