//! The step executor's fail points: its pages' way into and out of the
//! prefix cache and back to the pool. Each seam is the identity (or a
//! no-op) unless its fault is injected; without the `faults` feature every
//! one compiles away.

use std::borrow::Cow;

use std::collections::HashMap;

use kvsan_sanitizer::{Owner, PageId, PageRef, RequestId, TenantId, TierBlockId};

use super::Executor;
use crate::faults::{Fault, active};
use crate::node::sequence::Sequence;
use crate::prefix_cache::{self, Hit, Place, PrefixCachePolicy};
use crate::request::CacheSalt;

/// Nothing: a page enters the prefix cache after the step that writes it.
///
/// Fault `cache-register-before-write`: a page just allocated for `seq` is
/// registered at once, keyed by the tokens it is to hold, before the step
/// that writes them has run.
pub(super) fn cache_register_before_write(core: &mut Executor, seq: &mut Sequence) {
    if active(Fault::CacheRegisterBeforeWrite) {
        let upto = seq.tokens.len();
        core.register_pages(seq, upto);
    }
}

/// Nothing: an evicted `page` (which the cache has let go of) stays with
/// whoever else holds it.
///
/// Fault `cache-evict-referenced`: it goes back to the pool, whoever else
/// holds it.
pub(super) fn cache_evict_referenced(core: &mut Executor, page: PageRef) {
    let idx = page.page.0 as usize;
    if active(Fault::CacheEvictReferenced)
        && core.holders[idx] > 0
        && core.pool.generations()[idx] == page.generation
    {
        core.holders[idx] = 0;
        if let Err(e) = core.pool.free(page) {
            tracing::error!(node = %core.name, "{e}");
        }
    }
}

/// The keys a request's pages are registered under: `keys`, those it
/// entered the cache with.
///
/// Fault `cache-salt-dropped`: a salted request's keys are taken again
/// without its cache salt (the lookup at admission keeps it).
pub(super) fn cache_salt_dropped<'a>(
    policy: PrefixCachePolicy,
    tenant: TenantId,
    salt: &CacheSalt,
    keys: &'a [u8],
) -> Cow<'a, [u8]> {
    if active(Fault::CacheSaltDropped) && !salt.is_empty() {
        return Cow::Owned(prefix_cache::extra_keys(
            policy,
            tenant,
            &CacheSalt::default(),
        ));
    }
    Cow::Borrowed(keys)
}

/// Nothing: only full pages are registered.
///
/// Fault `cache-partial-page-shared`: the partial page after `seq`'s full
/// ones (up to position `upto`) is registered, under `keys`, by the
/// tokens it holds so far.
pub(super) fn cache_partial_page_shared(
    core: &mut Executor,
    seq: &Sequence,
    upto: usize,
    keys: &[u8],
) {
    if !active(Fault::CachePartialPageShared) {
        return;
    }
    let ps = core.pool.page_slots();
    let i = seq.page_hashes.len();
    let end = upto.min(seq.tokens.len());
    if end <= i * ps || end >= (i + 1) * ps || i >= seq.table.len() {
        return;
    }
    let page = seq.table.pages()[i];
    let parent = i.checked_sub(1).map(|p| seq.table.pages()[p]);
    if core.cache.holds(page) || parent.is_some_and(|p| !core.cache.holds(p)) {
        return;
    }
    let tokens = &seq.tokens[i * ps..end];
    let hash = prefix_cache::page_hash(seq.page_hashes.last().copied(), keys, tokens);
    if core.cache.contains_hash(hash) {
        return;
    }
    let holder = prefix_cache::holder(seq.owner.tenant);
    if core.hooks.share(core.pool_id, page, holder).is_continue() {
        core.holders[page.page.0 as usize] += 1;
        core.cache
            .insert(hash, page, parent, keys, tokens, seq.owner.tenant);
        core.stats.cached_pages = core.cache.len();
    }
}

/// Nothing: a request that leaves before its prefill is done registers no
/// page.
///
/// Fault `cache-keeps-aborted`: the unfinished prefill's pages are
/// registered as if it had filled them.
pub(super) fn cache_keeps_aborted(core: &mut Executor, seq: &mut Sequence) {
    if active(Fault::CacheKeepsAborted) && seq.computed < seq.prompt_len {
        let upto = seq.prompt_len;
        core.register_pages(seq, upto);
    }
}

/// Nothing: a released sequence's `pages` (tail first) are each freed once.
///
/// Fault `double-free`: the tail page is freed on its own first (as when
/// the page being filled was kept outside the block table), and then again
/// with the rest of the table.
pub(super) fn double_free(core: &mut Executor, owner: Owner, pages: &[PageRef]) {
    if active(Fault::DoubleFree)
        && let Some(&tail) = pages.first()
    {
        core.free_page(owner, tail);
    }
}

/// `false`: a page read back from a tier is copied into its page.
///
/// Fault `tier-load-failed-as-hit`: the read fails and the failure is
/// swallowed — the load counts as done, its copy never made.
pub(super) fn tier_read_fails() -> bool {
    active(Fault::TierLoadFailedAsHit)
}

/// The tier fail points' state: stores whose copy is made late and the
/// errors their completions ended their requests with
/// (`tier-store-after-reuse`), the step's last block handed out
/// (`tier-two-pages-one-block`), blocks filed by the page they were stored
/// from (`tier-meta-by-page-id`). Empty without the faults.
#[derive(Debug, Default)]
pub(crate) struct TierFaults {
    /// Each late store's owner, source page and block, in order.
    copies: Vec<(Owner, PageRef, TierBlockId)>,
    /// A request whose late store the hook target refused: its error, for
    /// its load to end it with.
    doomed: HashMap<RequestId, crate::request::RequestError>,
    /// The block last handed out, and the step it was in.
    last_block: Option<(u64, TierBlockId)>,
    /// Blocks by the pool page they were stored from.
    by_page: HashMap<PageId, TierBlockId>,
}

/// A free block of `tier` for a store (`true`: taken off the free list).
///
/// Fault `tier-two-pages-one-block` (TensorRT-LLM#8813, fixed by #9056:
/// two device blocks offloaded into the same host block in one step): the
/// blocks of a step are counted from the free list as it was when the step
/// began, so every store after the first in a step is handed the first
/// one's block again.
pub(super) fn block_for_store(core: &mut Executor, tier: u32) -> Option<(TierBlockId, bool)> {
    if active(Fault::TierTwoPagesOneBlock)
        && let Some((step, id)) = core.tier_faults.last_block
        && step == core.step
        && id.tier == tier
    {
        return Some((id, false));
    }
    let id = core.tiers.as_mut()?.take(tier)?;
    core.tier_faults.last_block = Some((core.step, id));
    Some((id, true))
}

/// Nothing: a cached page's block is its entry's own.
///
/// Fault `tier-meta-by-page-id`: the block is also filed by the pool page
/// it was stored from, a logical id the pool hands out again.
pub(super) fn file_tier_block(core: &mut Executor, from: PageId, block: TierBlockId) {
    if active(Fault::TierMetaByPageId) {
        core.tier_faults.by_page.insert(from, block);
    }
}

/// The block a cached entry in a tier is loaded from: its own.
///
/// Fault `tier-meta-by-page-id` (TensorRT-LLM#8830: a reused offloaded
/// block took the wrong block's state): the block filed under the page the
/// entry was stored from — the latest page stored from that page id, which
/// after the page's reuse is another entry's.
pub(super) fn tier_block_of(core: &Executor, hit: &Hit) -> TierBlockId {
    let Place::Tier { block, from } = hit.place else {
        unreachable!("only entries in a tier are loaded");
    };
    if active(Fault::TierMetaByPageId)
        && let Some(&filed) = core.tier_faults.by_page.get(&from)
    {
        return filed;
    }
    block
}

/// `false`: a store into a tier block copies the page now.
///
/// Fault `tier-store-after-reuse`: the copy is queued for later (as an
/// asynchronous copy engine runs it), while the preemption frees the
/// page at once, as if the copy had been taken.
pub(super) fn store_late(
    core: &mut Executor,
    owner: Owner,
    page: PageRef,
    block: TierBlockId,
) -> bool {
    if !active(Fault::TierStoreAfterReuse) {
        return false;
    }
    core.tier_faults.copies.push((owner, page, block));
    true
}

/// Nothing: no store is late.
///
/// Fault `tier-store-after-reuse`: the queued copies are made now, from
/// the pages as they are now, and completed (the hook target told).
pub(crate) fn complete_late_stores(core: &mut Executor) {
    for (owner, page, block) in std::mem::take(&mut core.tier_faults.copies) {
        let verdict = core.finish_store(block, page);
        if !verdict.is_continue() {
            let e = crate::request::RequestError::aborted_by(verdict, &core.name);
            core.tier_faults.doomed.insert(owner.request, e);
        }
    }
}

/// `None`: a request's stores completed as they started.
///
/// Fault `tier-store-after-reuse`: the error a refused late completion
/// ended the request with.
pub(super) fn doomed(
    core: &mut Executor,
    request: RequestId,
) -> Option<crate::request::RequestError> {
    core.tier_faults.doomed.remove(&request)
}
