//! The step executor's fail points: its pages' way into and out of the
//! prefix cache and back to the pool. Each seam is the identity (or a
//! no-op) unless its fault is injected; without the `faults` feature every
//! one compiles away.

use std::borrow::Cow;

use kvsan_sanitizer::{Owner, PageRef, TenantId};

use super::Executor;
use crate::faults::{Fault, active};
use crate::node::sequence::Sequence;
use crate::prefix_cache::{self, PrefixCachePolicy};
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

/// `false`: a page read back from the host tier is copied into its page.
///
/// Fault `tier-load-failed-as-hit`: the read fails and the failure is
/// swallowed — the load counts as done, its copy never made.
pub(super) fn tier_read_fails() -> bool {
    active(Fault::TierLoadFailedAsHit)
}
