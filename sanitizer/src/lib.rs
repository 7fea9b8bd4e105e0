//! kvsan-sanitizer: the shadow KV page pool that enforces kvsan's invariant.
//!
//! > A request may read a KV slot only if that request, in the page's current
//! > generation, wrote it (by computing it or by receiving it in a completed
//! > transfer) — or the page is shared with it read-only by the prefix cache.
#![warn(missing_docs)]

pub mod ids;

pub use ids::{Generation, Owner, PageId, PageRef, PoolId, RequestId, TenantId};
