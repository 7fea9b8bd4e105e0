//! The prefix cache's fail points: its keys, its partial-page hits and its
//! eviction. Each seam is the identity (or a no-op) unless its fault is
//! injected; without the `faults` feature every one compiles away.

use super::{Hit, PrefixCache};
use crate::faults::{Fault, active};
use crate::request::CacheSalt;

/// The bytes `salt` adds to a request's extra keys: `encoded`, its typed
/// encoding.
///
/// Fault `cache-key-collision`: the salts are concatenated untyped, so a
/// server salt `"ab"` and a client salt `"ab"` (or `"a"` + `"b"`) give the
/// same keys.
pub(super) fn cache_key_collision(encoded: Vec<u8>, salt: &CacheSalt) -> Vec<u8> {
    if !active(Fault::CacheKeyCollision) {
        return encoded;
    }
    [&salt.server, &salt.client]
        .into_iter()
        .flatten()
        .flat_map(|part| part.as_bytes().iter().copied())
        .collect()
}

/// Pages evictable now: `unreferenced`, those only the cache holds.
///
/// Fault `cache-evict-referenced`: every cached page.
pub(super) fn evictable_referenced(cache: &PrefixCache, unreferenced: usize) -> usize {
    if active(Fault::CacheEvictReferenced) {
        return cache.by_page.len();
    }
    unreferenced
}

/// The page to evict when no page is unreferenced: none.
///
/// Fault `cache-evict-referenced`: the oldest registered page anyway — the
/// eviction ignores who else holds it.
pub(super) fn evict_referenced(cache: &PrefixCache) -> Option<u64> {
    if !active(Fault::CacheEvictReferenced) {
        return None;
    }
    cache
        .by_page
        .values()
        .copied()
        .min_by_key(|s| cache.entries.get(s).map_or(u64::MAX, |e| e.born))
}

/// Nothing: a lookup hits full pages only.
///
/// Fault `cache-partial-page-shared`: the page after the full `hits` is
/// matched on as many of its tokens (of the `usable` first of `tokens`) as
/// some cached partial page holds.
pub(super) fn cache_partial_page_shared(
    cache: &PrefixCache,
    keys: &[u8],
    tokens: &[u32],
    usable: usize,
    hits: &mut Vec<Hit>,
) {
    if !active(Fault::CachePartialPageShared) {
        return;
    }
    let ps = cache.page_slots;
    let at = hits.len() * ps;
    for m in (1..ps).rev() {
        if at + m > usable {
            continue;
        }
        if let Some(hit) = cache.find(hits.last(), keys, &tokens[at..at + m]) {
            hits.push(hit);
            break;
        }
    }
}
