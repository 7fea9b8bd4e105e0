//! kvsan-ids: the vocabulary types every layer shares — pools, pages,
//! generations, page references, requests, tenants and owners.
//!
//! A crate of its own so that the kernels, which check `PageRef`s against
//! generations but know nothing of requests' lifecycles, need not link the
//! sanitizer; `kvsan-sanitizer` re-exports every type here under its own
//! paths (`kvsan_sanitizer::PageRef`, `kvsan_sanitizer::ids::PageRef`).
//! With feature `serde` the ids are `Serialize` (the sanitizer's JSON
//! reports); nothing deserializes them.
//!
//! A [`PageRef`] is what a block table holds. Like a tagged pointer (HWASan,
//! Arm MTE) it carries the tag — the page's [`Generation`] at allocation — and
//! every access through it is checked against the page's current generation.
//!
//! ```text
//!  PageRef (8 bytes, #[repr(C)])
//!  +----------------+----------------+
//!  | page: u32      | generation: u32|
//!  +----------------+----------------+
//! ```

#![warn(missing_docs)]

use std::fmt;

/// One KV page pool on one node (a prefill node's, a decode node's).
#[repr(transparent)]
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, PartialOrd, Ord, Default)]
#[cfg_attr(feature = "serde", derive(serde::Serialize), serde(transparent))]
pub struct PoolId(pub u32);

/// Index of a page in a pool; a page holds `page_slots` token slots for every layer.
#[repr(transparent)]
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, PartialOrd, Ord, Default)]
#[cfg_attr(feature = "serde", derive(serde::Serialize), serde(transparent))]
pub struct PageId(pub u32);

/// Per-page counter, incremented at every allocation of that page.
///
/// Generation 0 means "never allocated"; the first allocation gives 1.
#[repr(transparent)]
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, PartialOrd, Ord, Default)]
#[cfg_attr(feature = "serde", derive(serde::Serialize), serde(transparent))]
pub struct Generation(pub u32);

impl Generation {
    /// The generation the next allocation of a page at `self` gets.
    #[inline]
    #[must_use]
    pub fn next(self) -> Generation {
        Generation(self.0.wrapping_add(1))
    }
}

/// `(PageId, Generation)`: what a block table holds.
#[repr(C)]
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, PartialOrd, Ord, Default)]
#[cfg_attr(feature = "serde", derive(serde::Serialize))]
pub struct PageRef {
    /// The page.
    pub page: PageId,
    /// The page's generation when this reference was taken.
    pub generation: Generation,
}

impl PageRef {
    /// A reference to `page` at `generation`.
    #[inline]
    #[must_use]
    pub const fn new(page: u32, generation: u32) -> PageRef {
        PageRef {
            page: PageId(page),
            generation: Generation(generation),
        }
    }
}

/// Who asked: one inference request.
#[repr(transparent)]
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, PartialOrd, Ord, Default)]
#[cfg_attr(feature = "serde", derive(serde::Serialize), serde(transparent))]
pub struct RequestId(pub u64);

impl RequestId {
    /// The engine's prefix cache as a page holder (`u64::MAX`; C:
    /// `KVSAN_PREFIX_CACHE_REQUEST`), never a request.
    ///
    /// The cache keeps full pages after the request that wrote them has
    /// let go: it takes a read-only reference with
    /// `share(pool, page, Owner { request: PREFIX_CACHE, tenant: <the
    /// writer's tenant> })` when it registers a page and lets go of it
    /// with `free` of the same owner when it evicts the page. The
    /// sanitizer keeps no lifecycle for it (it allocates, reads and
    /// writes nothing, and never ends), exempts its shares from the
    /// isolation policy (it never reads; a request's share from the cache
    /// is checked against the policy), and reports name it "prefix cache".
    /// An engine numbers its requests below it.
    pub const PREFIX_CACHE: RequestId = RequestId(u64::MAX);

    /// Whether this is [`RequestId::PREFIX_CACHE`].
    #[inline]
    #[must_use]
    pub const fn is_prefix_cache(self) -> bool {
        self.0 == RequestId::PREFIX_CACHE.0
    }
}

/// Who pays: the API key / tenant a request belongs to.
#[repr(transparent)]
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, PartialOrd, Ord, Default)]
#[cfg_attr(feature = "serde", derive(serde::Serialize), serde(transparent))]
pub struct TenantId(pub u32);

/// `(RequestId, TenantId)`: the holder of a page.
#[repr(C)]
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, Default)]
#[cfg_attr(feature = "serde", derive(serde::Serialize))]
pub struct Owner {
    /// The request holding the page.
    pub request: RequestId,
    /// The tenant the request belongs to.
    pub tenant: TenantId,
}

impl Owner {
    /// The owner `(request, tenant)`.
    #[inline]
    #[must_use]
    pub const fn new(request: u64, tenant: u32) -> Owner {
        Owner {
            request: RequestId(request),
            tenant: TenantId(tenant),
        }
    }
}

impl fmt::Display for PoolId {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "pool {}", self.0)
    }
}

impl fmt::Display for PageId {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "page {}", self.0)
    }
}

impl fmt::Display for Generation {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "gen {}", self.0)
    }
}

impl fmt::Display for PageRef {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "page {}@gen {}", self.page.0, self.generation.0)
    }
}

impl fmt::Display for RequestId {
    /// `request 7`, or `prefix cache` for [`RequestId::PREFIX_CACHE`].
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        if self.is_prefix_cache() {
            f.write_str("prefix cache")
        } else {
            write!(f, "request {}", self.0)
        }
    }
}

impl fmt::Display for TenantId {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "tenant {}", self.0)
    }
}

impl fmt::Display for Owner {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "{} (tenant {})", self.request, self.tenant.0)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn page_ref_is_two_words_with_c_layout() {
        assert_eq!(std::mem::size_of::<PageRef>(), 8);
        assert_eq!(std::mem::align_of::<PageRef>(), 4);
        assert_eq!(std::mem::offset_of!(PageRef, generation), 4);
    }

    #[test]
    fn the_prefix_cache_holder_displays_as_such_and_requests_by_number() {
        assert_eq!(RequestId(7).to_string(), "request 7");
        assert_eq!(
            Owner::new(7, 2).to_string(),
            "request 7 (tenant 2)",
            "reports and goldens depend on this form"
        );
        let cache = Owner {
            request: RequestId::PREFIX_CACHE,
            tenant: TenantId(2),
        };
        assert_eq!(cache.to_string(), "prefix cache (tenant 2)");
        assert!(RequestId::PREFIX_CACHE.is_prefix_cache() && !RequestId(7).is_prefix_cache());
    }

    #[test]
    fn generation_advances_by_one() {
        assert_eq!(Generation(7).next(), Generation(8));
    }
}
