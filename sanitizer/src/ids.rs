//! The vocabulary types every layer shares: pools, pages, generations, page
//! references, requests, tenants and owners. They live in `kvsan-ids`, which
//! the kernels use without the sanitizer; this module keeps their paths.
//!
//! One request id is reserved: [`RequestId::PREFIX_CACHE`] (`u64::MAX`, C
//! `KVSAN_PREFIX_CACHE_REQUEST`) is the engine's prefix cache as a holder of
//! the pages it keeps after their writer let go. It takes and drops its
//! references with `share` and `free` like a sharer, but it is no request:
//! the sanitizer keeps no lifecycle for it (so it can never leak pages or
//! be ended), its shares are checked for a filled, committed, current page
//! but not against `prefix_share` (the cache never reads; the request it
//! later shares a page with is checked), it may not allocate, and reports
//! name it "prefix cache".

pub use kvsan_ids::{Generation, Owner, PageId, PageRef, PoolId, RequestId, TenantId};
