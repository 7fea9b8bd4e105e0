//! The prefix cache: full KV pages kept after their request, found again by
//! the tokens they hold and shared read-only with later requests.
//!
//! ```text
//!  page i of a sequence, full:  hash_i = xxh3(hash_{i-1} ‖ keys (i = 0 only) ‖ tokens of page i)
//!  keys: the isolation domain, typed — tag, length, bytes each:
//!        tenant (policy tenant), server salt, client salt (any policy)
//!  entry: hash → (page, its tokens, its keys, the page before it), verified on
//!         every hit: a hash collision is a miss, never a wrong page
//!  holders of a page: its owner, the cache, each request it is shared with;
//!         the page goes back to the pool when the last lets go
//!  LRU: entries only the cache holds, evicted oldest first when the pool is empty
//! ```
//!
//! The hash is 64-bit xxh3 (the KV checksum's) because it only indexes: a
//! hit is checked against the entry's own tokens, keys and parent page, so
//! a collision costs a miss. The parent is a `PageRef` (page and
//! generation), so a chain is the exact sequence of pages written after one
//! another — the tokens before a page decide its KV, and they are checked
//! link by link.
//!
//! Only full pages whose every slot the writer computed are registered, after
//! the step that wrote them; the partial last page of a sequence is computed
//! again by each request (never written while shared). Every registration
//! and every hit goes through the sanitizer's `share` hook, which checks the
//! page is fully written and the sharer is allowed by its isolation policy.

use std::collections::{BTreeMap, HashMap};
use std::fmt;
use std::str::FromStr;

use kvsan_sanitizer::{Owner, PageId, PageRef, RequestId, TenantId, TierBlockId};

use crate::request::CacheSalt;

mod faults;

/// Who may share a cached page (`--prefix-cache`).
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Hash)]
pub enum PrefixCachePolicy {
    /// No prefix cache.
    #[default]
    Off,
    /// Requests of one tenant (API key), and of one salt when salted.
    Tenant,
    /// vLLM's `cache_salt`: requests of one salt, across tenants; unsalted
    /// requests share among themselves.
    Salt,
    /// Every request (salted requests still only with their salt): the
    /// prompt-timing side channel is open across tenants.
    Global,
}

impl PrefixCachePolicy {
    /// Every policy, in `--help` order.
    pub const ALL: [PrefixCachePolicy; 4] = [
        PrefixCachePolicy::Off,
        PrefixCachePolicy::Tenant,
        PrefixCachePolicy::Salt,
        PrefixCachePolicy::Global,
    ];

    /// The flag's value (`off`, `tenant`, `salt`, `global`).
    #[must_use]
    pub fn name(self) -> &'static str {
        match self {
            PrefixCachePolicy::Off => "off",
            PrefixCachePolicy::Tenant => "tenant",
            PrefixCachePolicy::Salt => "salt",
            PrefixCachePolicy::Global => "global",
        }
    }

    /// The sanitizer's `prefix_share` option that checks this policy.
    #[must_use]
    pub fn share_option(self) -> &'static str {
        self.name()
    }
}

impl fmt::Display for PrefixCachePolicy {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(self.name())
    }
}

impl FromStr for PrefixCachePolicy {
    type Err = String;

    fn from_str(s: &str) -> Result<Self, Self::Err> {
        PrefixCachePolicy::ALL
            .into_iter()
            .find(|p| p.name() == s)
            .ok_or_else(|| format!("unknown prefix-cache policy '{s}' (off, tenant, salt, global)"))
    }
}

/// Tag of the tenant in the typed keys.
const TENANT_TAG: u8 = 0x54;

/// The extra keys of a request's first page under `policy`: its isolation
/// domain, typed so that no two kinds of key can encode alike.
///
/// Fault `cache-key-collision`: the salts are concatenated untyped, so a
/// server salt `"ab"` and a client salt `"ab"` (or `"a"` + `"b"`) give the
/// same keys.
#[must_use]
pub fn extra_keys(policy: PrefixCachePolicy, tenant: TenantId, salt: &CacheSalt) -> Vec<u8> {
    let mut keys = Vec::new();
    if policy == PrefixCachePolicy::Tenant {
        let id = tenant.0.to_le_bytes();
        keys.push(TENANT_TAG);
        keys.extend_from_slice(&(id.len() as u32).to_le_bytes());
        keys.extend_from_slice(&id);
    }
    keys.extend_from_slice(&faults::cache_key_collision(salt.encode(), salt));
    keys
}

/// The chained hash of a page: its parent's hash, the keys (first page
/// only) and its tokens.
#[must_use]
pub fn page_hash(parent: Option<u64>, keys: &[u8], tokens: &[u32]) -> u64 {
    let mut h = xxhash_rust::xxh3::Xxh3::new();
    match parent {
        Some(p) => {
            h.update(&[1]);
            h.update(&p.to_le_bytes());
        }
        None => {
            h.update(&[0]);
            h.update(&(keys.len() as u64).to_le_bytes());
            h.update(keys);
        }
    }
    for t in tokens {
        h.update(&t.to_le_bytes());
    }
    h.digest()
}

/// The cache's own holder identity for a page written by `tenant`'s request
/// (the sanitizer's `RequestId::PREFIX_CACHE`).
#[must_use]
pub fn holder(tenant: TenantId) -> Owner {
    Owner {
        request: RequestId::PREFIX_CACHE,
        tenant,
    }
}

/// Where a cached page's KV is.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Place {
    /// In the pool, at this page.
    Pool(PageRef),
    /// In a tier block, stored from the pool page `from` (fault
    /// `tier-meta-by-page-id` files it by that page).
    Tier {
        /// The block.
        block: TierBlockId,
        /// The page it was stored from.
        from: PageId,
    },
}

#[derive(Debug)]
struct Entry {
    hash: u64,
    place: Place,
    /// The entry before it in the writer's sequence (`None`: the first).
    parent: Option<u64>,
    tokens: Box<[u32]>,
    /// The keys (first page only).
    keys: Box<[u8]>,
    /// The cache's holder identity (the writer's tenant).
    holder: Owner,
    /// Its place in the LRU while only the cache holds the page (in the
    /// pool), or in the tier LRU (in a tier).
    lru: Option<u64>,
    /// Order of registration (fault `cache-evict-referenced` evicts by it).
    born: u64,
    /// Being loaded from its tier: not to be let go of.
    pinned: bool,
}

/// One node's prefix cache. It keeps the entries; the node keeps the pages'
/// holder counts, the tier blocks and calls the hooks.
///
/// An entry has a serial number for its life, through every move between
/// the pool and a tier: the chain links are serials, so a page that comes
/// back from a tier into another pool page is still its children's parent,
/// and a page of the pool that is re-used is not.
#[derive(Debug)]
pub struct PrefixCache {
    policy: PrefixCachePolicy,
    page_slots: usize,
    by_hash: HashMap<u64, u64>,
    by_page: HashMap<PageId, u64>,
    entries: HashMap<u64, Entry>,
    lru: BTreeMap<u64, u64>,
    tier_lru: BTreeMap<u64, u64>,
    tick: u64,
    /// Prompt tokens looked up (vLLM's `prefix_cache_queries`).
    pub queries: u64,
    /// Prompt tokens found (vLLM's `prefix_cache_hits`).
    pub hits: u64,
}

/// A cached page the lookup found: the entry, where its KV is, its chain
/// hash.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Hit {
    /// The entry's serial.
    pub serial: u64,
    /// Where its KV is.
    pub place: Place,
    /// Its chain hash.
    pub hash: u64,
    /// Token slots of it the sharer uses (a full page, except under fault
    /// `cache-partial-page-shared`).
    pub tokens: usize,
}

impl Hit {
    /// The pool page, when the KV is in the pool.
    #[must_use]
    pub fn page(&self) -> Option<PageRef> {
        match self.place {
            Place::Pool(p) => Some(p),
            Place::Tier { .. } => None,
        }
    }
}

/// A cached page evicted from the pool: the node stores it down a tier
/// ([`PrefixCache::demoted`]) or lets it go ([`PrefixCache::forget`]).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Evicted {
    /// The entry.
    pub serial: u64,
    /// The page it held.
    pub page: PageRef,
    /// The cache's holder identity of it.
    pub holder: Owner,
}

impl PrefixCache {
    /// An empty cache for pages of `page_slots` slots.
    #[must_use]
    pub fn new(policy: PrefixCachePolicy, page_slots: usize) -> PrefixCache {
        PrefixCache {
            policy,
            page_slots,
            by_hash: HashMap::new(),
            by_page: HashMap::new(),
            entries: HashMap::new(),
            lru: BTreeMap::new(),
            tier_lru: BTreeMap::new(),
            tick: 0,
            queries: 0,
            hits: 0,
        }
    }

    /// The isolation policy.
    #[must_use]
    pub fn policy(&self) -> PrefixCachePolicy {
        self.policy
    }

    /// Whether the cache is on.
    #[must_use]
    pub fn enabled(&self) -> bool {
        self.policy != PrefixCachePolicy::Off
    }

    /// Pool pages the cache holds.
    #[must_use]
    pub fn len(&self) -> usize {
        self.by_page.len()
    }

    /// Whether the cache holds no pool page.
    #[must_use]
    pub fn is_empty(&self) -> bool {
        self.by_page.is_empty()
    }

    /// Cached pages whose KV is in a tier.
    #[must_use]
    pub fn tiered(&self) -> usize {
        self.entries.len() - self.by_page.len()
    }

    /// Pages only the cache holds (evictable now). Under fault
    /// `cache-evict-referenced`, every cached page.
    #[must_use]
    pub fn evictable(&self) -> usize {
        faults::evictable_referenced(self, self.lru.len())
    }

    fn at_page(&self, page: PageRef) -> Option<(u64, &Entry)> {
        let serial = *self.by_page.get(&page.page)?;
        let e = self.entries.get(&serial)?;
        (e.place == Place::Pool(page)).then_some((serial, e))
    }

    /// Whether `page` is a cached page at that generation.
    #[must_use]
    pub fn holds(&self, page: PageRef) -> bool {
        self.at_page(page).is_some()
    }

    /// The chain hash of cached `page`, if it is one.
    #[must_use]
    pub fn hash_of(&self, page: PageRef) -> Option<u64> {
        self.at_page(page).map(|(_, e)| e.hash)
    }

    /// The longest chain of cached pages, in the pool or a tier, that
    /// `tokens` (with `keys`) begins with, leaving at least one token to
    /// compute (the one whose logits come next). Counts the query.
    #[must_use]
    pub fn lookup(&mut self, keys: &[u8], tokens: &[u32]) -> Vec<Hit> {
        let hits = self.peek(keys, tokens);
        self.count(tokens.len(), &hits);
        hits
    }

    /// Counts a lookup of `queried` tokens that found `hits` (from
    /// [`PrefixCache::peek`]).
    pub fn count(&mut self, queried: usize, hits: &[Hit]) {
        self.queries += queried as u64;
        self.hits += hits.iter().map(|h| h.tokens as u64).sum::<u64>();
    }

    /// [`PrefixCache::lookup`] without counting it.
    #[must_use]
    pub fn peek(&self, keys: &[u8], tokens: &[u32]) -> Vec<Hit> {
        let ps = self.page_slots;
        let usable = tokens.len().saturating_sub(1);
        let mut hits: Vec<Hit> = Vec::new();
        for i in 0..usable / ps {
            let page_tokens = &tokens[i * ps..(i + 1) * ps];
            match self.find(hits.last(), keys, page_tokens) {
                Some(hit) => hits.push(hit),
                None => break,
            }
        }
        faults::cache_partial_page_shared(self, keys, tokens, usable, &mut hits);
        hits
    }

    /// The entry for `page_tokens` after `parent`, verified.
    fn find(&self, parent: Option<&Hit>, keys: &[u8], page_tokens: &[u32]) -> Option<Hit> {
        let keys_here: &[u8] = if parent.is_none() { keys } else { &[] };
        let hash = page_hash(parent.map(|p| p.hash), keys_here, page_tokens);
        let serial = *self.by_hash.get(&hash)?;
        let e = self.entries.get(&serial)?;
        let same = e.tokens.as_ref() == page_tokens
            && e.keys.as_ref() == keys_here
            && e.parent == parent.map(|p| p.serial);
        same.then_some(Hit {
            serial,
            place: e.place,
            hash,
            tokens: page_tokens.len(),
        })
    }

    /// Whether an entry of hash `hash` exists.
    #[must_use]
    pub fn contains_hash(&self, hash: u64) -> bool {
        self.by_hash.contains_key(&hash)
    }

    /// Registers `page` (written by a request of `tenant`) under `hash`,
    /// holding `tokens` after the cached page `parent`. The caller has
    /// counted the cache as a holder of the page. False (nothing changes)
    /// if the hash or the page is cached already, or `parent` is not.
    pub fn insert(
        &mut self,
        hash: u64,
        page: PageRef,
        parent: Option<PageRef>,
        keys: &[u8],
        tokens: &[u32],
        tenant: TenantId,
    ) -> bool {
        if self.by_hash.contains_key(&hash) || self.by_page.contains_key(&page.page) {
            return false;
        }
        let parent = match parent {
            Some(p) => match self.at_page(p) {
                Some((serial, _)) => Some(serial),
                None => return false,
            },
            None => None,
        };
        self.tick += 1;
        let serial = self.tick;
        self.by_hash.insert(hash, serial);
        self.by_page.insert(page.page, serial);
        self.entries.insert(
            serial,
            Entry {
                hash,
                place: Place::Pool(page),
                parent,
                tokens: tokens.into(),
                keys: if parent.is_none() {
                    keys.into()
                } else {
                    Box::default()
                },
                holder: holder(tenant),
                lru: None,
                born: serial,
                pinned: false,
            },
        );
        true
    }

    /// The cache's holder identity of cached `page`.
    #[must_use]
    pub fn holder_of(&self, page: PageRef) -> Option<Owner> {
        self.at_page(page).map(|(_, e)| e.holder)
    }

    /// The cache's holder identity of entry `serial`.
    #[must_use]
    pub fn holder_of_entry(&self, serial: u64) -> Option<Owner> {
        self.entries.get(&serial).map(|e| e.holder)
    }

    /// `page` is now held by the cache alone: it joins the LRU.
    pub fn unreferenced(&mut self, page: PageRef) {
        self.tick += 1;
        let tick = self.tick;
        let Some((serial, _)) = self.at_page(page) else {
            return;
        };
        if let Some(e) = self.entries.get_mut(&serial) {
            if let Some(old) = e.lru.replace(tick) {
                self.lru.remove(&old);
            }
            self.lru.insert(tick, serial);
        }
    }

    /// `page` is held by a request again: it leaves the LRU.
    pub fn referenced(&mut self, page: PageRef) {
        let Some((serial, _)) = self.at_page(page) else {
            return;
        };
        if let Some(e) = self.entries.get_mut(&serial)
            && let Some(old) = e.lru.take()
        {
            self.lru.remove(&old);
        }
    }

    /// Takes the least recently used page only the cache holds out of the
    /// pool; the caller lets go of the cache's reference and either stores
    /// the page down a tier ([`PrefixCache::demoted`]) or forgets the entry
    /// ([`PrefixCache::forget`]).
    ///
    /// Fault `cache-evict-referenced`: when no page is unreferenced, the
    /// oldest registered page is taken anyway — the eviction ignores who
    /// else holds it.
    pub fn evict(&mut self) -> Option<Evicted> {
        let serial = match self.lru.pop_first() {
            Some((_, serial)) => serial,
            None => faults::evict_referenced(self)?,
        };
        let e = self.entries.get_mut(&serial)?;
        if let Some(tick) = e.lru.take() {
            self.lru.remove(&tick);
        }
        let Place::Pool(page) = e.place else {
            return None;
        };
        self.by_page.remove(&page.page);
        Some(Evicted {
            serial,
            page,
            holder: e.holder,
        })
    }

    /// The evicted entry `serial`'s KV is now in tier block `block`,
    /// stored from page `from`.
    pub fn demoted(&mut self, serial: u64, block: TierBlockId, from: PageId) {
        self.tick += 1;
        let tick = self.tick;
        if let Some(e) = self.entries.get_mut(&serial) {
            e.place = Place::Tier { block, from };
            e.lru = Some(tick);
            self.tier_lru.insert(tick, serial);
        }
    }

    /// Entry `serial` is gone (its page evicted and not stored, or its
    /// tier block let go of): its hash misses from now on, and the
    /// entries after it are unreachable until evicted in turn. Returns
    /// its tier block, if it had one.
    pub fn forget(&mut self, serial: u64) -> Option<TierBlockId> {
        let e = self.entries.remove(&serial)?;
        if self.by_hash.get(&e.hash) == Some(&serial) {
            self.by_hash.remove(&e.hash);
        }
        match e.place {
            Place::Pool(page) => {
                if self.by_page.get(&page.page) == Some(&serial) {
                    self.by_page.remove(&page.page);
                }
                if let Some(t) = e.lru {
                    self.lru.remove(&t);
                }
                None
            }
            Place::Tier { block, .. } => {
                if let Some(t) = e.lru {
                    self.tier_lru.remove(&t);
                }
                Some(block)
            }
        }
    }

    /// The least recently stored entry of tier `tier` not being loaded.
    #[must_use]
    pub fn oldest_in_tier(&self, tier: u32) -> Option<u64> {
        self.tier_lru.values().copied().find(|s| {
            self.entries.get(s).is_some_and(|e| {
                !e.pinned && matches!(e.place, Place::Tier { block, .. } if block.tier == tier)
            })
        })
    }

    /// Entries of tier `tier` that may be let go of to make room there
    /// (those not being loaded).
    #[must_use]
    pub fn releasable_in_tier(&self, tier: u32) -> usize {
        self.tier_lru
            .values()
            .filter(|s| {
                self.entries.get(s).is_some_and(|e| {
                    !e.pinned && matches!(e.place, Place::Tier { block, .. } if block.tier == tier)
                })
            })
            .count()
    }

    /// Entry `serial` is being loaded from its tier (`true`) or no longer
    /// is: a pinned entry is not let go of to make room.
    pub fn pin(&mut self, serial: u64, pinned: bool) {
        if let Some(e) = self.entries.get_mut(&serial) {
            e.pinned = pinned;
        }
    }

    /// Entry `serial`, loaded from its tier into `page` (held by the
    /// request that loaded it and by the cache), is in the pool again.
    /// False (nothing changes) if the entry is gone or `page` is cached.
    pub fn promoted(&mut self, serial: u64, page: PageRef) -> bool {
        if self.by_page.contains_key(&page.page) {
            return false;
        }
        let Some(e) = self.entries.get_mut(&serial) else {
            return false;
        };
        if let Some(t) = e.lru.take() {
            self.tier_lru.remove(&t);
        }
        e.place = Place::Pool(page);
        e.pinned = false;
        self.by_page.insert(page.page, serial);
        true
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use kvsan_sanitizer::Generation;

    fn pr(page: u32, generation: u32) -> PageRef {
        PageRef {
            page: PageId(page),
            generation: Generation(generation),
        }
    }

    fn fill(cache: &mut PrefixCache, keys: &[u8], tokens: &[u32], pages: &[PageRef]) {
        let ps = 4;
        let mut parent: Option<(u64, PageRef)> = None;
        for (i, &page) in pages.iter().enumerate() {
            let t = &tokens[i * ps..(i + 1) * ps];
            let k: &[u8] = if i == 0 { keys } else { &[] };
            let h = page_hash(parent.map(|p| p.0), k, t);
            assert!(cache.insert(h, page, parent.map(|p| p.1), keys, t, TenantId(1)));
            parent = Some((h, page));
        }
    }

    #[test]
    fn a_chain_is_found_page_by_page_and_leaves_one_token_to_compute() {
        let mut c = PrefixCache::new(PrefixCachePolicy::Tenant, 4);
        let tokens: Vec<u32> = (0..12).collect();
        fill(&mut c, b"k", &tokens, &[pr(5, 1), pr(9, 1), pr(2, 1)]);
        let hits = c.lookup(b"k", &tokens);
        // 12 tokens: two full pages usable (the third's last token is computed).
        assert_eq!(
            hits.iter().map(|h| h.page().unwrap()).collect::<Vec<_>>(),
            [pr(5, 1), pr(9, 1)]
        );
        let longer: Vec<u32> = (0..13).collect();
        assert_eq!(c.lookup(b"k", &longer).len(), 3);
        assert_eq!((c.queries, c.hits), (25, 20));
    }

    #[test]
    fn other_keys_or_a_changed_token_miss() {
        let mut c = PrefixCache::new(PrefixCachePolicy::Tenant, 4);
        let tokens: Vec<u32> = (0..9).collect();
        fill(&mut c, b"k", &tokens, &[pr(1, 1), pr(2, 1)]);
        assert!(c.lookup(b"other", &tokens).is_empty());
        let mut changed = tokens.clone();
        changed[5] = 99;
        assert_eq!(c.lookup(b"k", &changed).len(), 1);
    }

    #[test]
    fn a_colliding_hash_is_a_miss_not_a_wrong_page() {
        let mut c = PrefixCache::new(PrefixCachePolicy::Global, 4);
        let tokens = [1, 2, 3, 4, 5];
        let h = page_hash(None, &[], &tokens[..4]);
        // An entry filed under that hash holding other tokens (as a
        // collision would leave it).
        assert!(c.insert(h, pr(3, 1), None, &[], &[9, 9, 9, 9], TenantId(1)));
        assert!(c.lookup(&[], &tokens).is_empty());
    }

    #[test]
    fn a_page_registered_after_another_parent_is_not_a_continuation() {
        let mut c = PrefixCache::new(PrefixCachePolicy::Global, 4);
        let tokens: Vec<u32> = (0..9).collect();
        fill(&mut c, &[], &tokens, &[pr(1, 1), pr(2, 1)]);
        // Page 1 evicted and its slot re-registered at a new generation: the
        // old second page's parent is not it.
        c.unreferenced(pr(1, 1));
        let gone = c.evict().expect("evictable");
        assert_eq!(gone.page, pr(1, 1));
        c.forget(gone.serial);
        let h0 = page_hash(None, &[], &tokens[..4]);
        assert!(c.insert(h0, pr(1, 2), None, &[], &tokens[..4], TenantId(1)));
        assert_eq!(c.lookup(&[], &tokens).len(), 1);
    }

    #[test]
    fn typed_keys_keep_the_salt_kinds_and_tenants_apart() {
        let server = CacheSalt {
            server: Some("ab".into()),
            client: None,
        };
        let client = CacheSalt {
            server: None,
            client: Some("ab".into()),
        };
        let split = CacheSalt {
            server: Some("a".into()),
            client: Some("b".into()),
        };
        let p = PrefixCachePolicy::Salt;
        let all = [
            extra_keys(p, TenantId(1), &server),
            extra_keys(p, TenantId(1), &client),
            extra_keys(p, TenantId(1), &split),
            extra_keys(p, TenantId(1), &CacheSalt::default()),
        ];
        for (i, a) in all.iter().enumerate() {
            for b in &all[i + 1..] {
                assert_ne!(a, b);
            }
        }
        let t = PrefixCachePolicy::Tenant;
        assert_ne!(
            extra_keys(t, TenantId(1), &CacheSalt::default()),
            extra_keys(t, TenantId(2), &CacheSalt::default())
        );
        assert_eq!(
            extra_keys(
                PrefixCachePolicy::Global,
                TenantId(1),
                &CacheSalt::default()
            ),
            extra_keys(
                PrefixCachePolicy::Global,
                TenantId(2),
                &CacheSalt::default()
            )
        );
    }

    #[test]
    fn eviction_takes_the_least_recently_unreferenced_page_only() {
        let mut c = PrefixCache::new(PrefixCachePolicy::Global, 4);
        let tokens: Vec<u32> = (0..13).collect();
        fill(&mut c, &[], &tokens, &[pr(1, 1), pr(2, 1), pr(3, 1)]);
        assert_eq!(c.evict(), None, "every page is still referenced");
        c.unreferenced(pr(3, 1));
        c.unreferenced(pr(1, 1));
        c.referenced(pr(3, 1));
        assert_eq!(c.evictable(), 1);
        assert_eq!(c.evict().map(|e| e.page), Some(pr(1, 1)));
        assert_eq!(c.evict(), None);
        assert_eq!(c.len(), 2);
    }

    #[test]
    fn policies_parse_by_name() {
        for p in PrefixCachePolicy::ALL {
            assert_eq!(p.name().parse::<PrefixCachePolicy>(), Ok(p));
        }
        let err = "shared".parse::<PrefixCachePolicy>().unwrap_err();
        assert!(err.contains("'shared'") && err.contains("tenant"), "{err}");
    }
}
