//! The vocabulary types every layer shares: pools, pages, generations, page
//! references, requests, tenants and owners. They live in `kvsan-ids`, which
//! the kernels use without the sanitizer; this module keeps their paths.

pub use kvsan_ids::{Generation, Owner, PageId, PageRef, PoolId, RequestId, TenantId};
