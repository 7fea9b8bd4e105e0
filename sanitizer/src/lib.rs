//! kvsan-sanitizer: the shadow KV page pool that enforces kvsan's invariant.
//!
//! > A request may read a KV slot only if that request, in the page's current
//! > generation, wrote it (by computing it or by receiving it in a completed
//! > transfer) — or the page is shared with it read-only by the prefix cache.
//!
//! The engine calls the hooks of [`Sanitizer`] at every allocation, free,
//! write, read, transfer and lifecycle event; each returns a [`Verdict`].
//! Subsystems, one file each (compiler-rt style):
//!
//! | module | what lives there |
//! | --- | --- |
//! | `block_table` | `BlockTable`: a request's pages, and which pages and slots hold tokens `a..b` |
//! | `hooks` | the one list of hooks (`for_each_hook!`), from which the hook table, the engine's hook trait and the shim's C functions are generated; `Hook` |
//! | `layouts` | the one list of batch layouts (`for_each_batch_layout!`): the buffers an engine hands its attention and store kernels, from which the layout enum, the shim's `kvsan_check_*` functions and the device checks' batches are generated |
//! | `queries` | the list of the library's other C functions (`for_each_query!`: versions, counts, names, NVTX), checked against the shim's exports and the header |
//! | `abi` | the C ABI: `#[repr(C)]` hook table, page refs, manifests, verdicts, status codes, the kernel shadow's C description |
//! | `ids` | pool, page, generation, request, tenant, owner ids (crate `kvsan-ids`, re-exported) |
//! | `geometry` | `PoolGeometry`, `NodeRole` |
//! | `shadow` | per-page state word, owner, written bitmap; lock-free transitions |
//! | `kernel_shadow` | the shadow as the KV kernels check it in place: fast read and store checks, counters |
//! | `pool` | one registered pool: records, bitmaps, history, sharers, quarantine |
//! | `history` | per-page origin ring |
//! | `stats` | sharded counters of the checks performed |
//! | `lifecycle` | request states and legal transitions |
//! | `tier` | `TierBlockId`: KV pages stored out of their pool (host memory, disk) and the identity they carry back |
//! | `transfer` | `Manifest` |
//! | `violation` | the list of violation kinds, ids, counters, `Verdict` |
//! | `report` | human and JSON reports, the sink |
//! | `options` | the options table and `KVSAN_OPTIONS` parser |
//! | `error` | `SanitizerError` (API misuse) |
//! | `sanitizer` | the `Sanitizer` facade (`mod.rs`: construction, pools, queries) and its hooks: `events.rs` (pool registration, request events), `pages.rs` (alloc, free, share, host write and read), `transfer.rs` (send, receive, commit), `tier.rs` (tier store, load, verify, release), `kernel.rs` (the kernel-shadow view, refused kernel accesses), `finding.rs` (the cold path that numbers and reports a violation) |
#![warn(missing_docs)]

pub mod abi;
pub mod block_table;
pub mod error;
pub mod geometry;
pub mod history;
pub mod hooks;
pub mod ids;
pub mod kernel_shadow;
pub mod layouts;
pub mod lifecycle;
pub mod options;
mod pool;
mod queries;
pub mod report;
mod sanitizer;
pub mod self_test;
pub mod shadow;
pub mod stats;
#[doc(hidden)]
pub mod sync;
pub mod tier;
pub mod transfer;
pub mod violation;

#[cfg(not(loom))]
pub use abi::KernelShadowHandle;
pub use block_table::{BlockTable, Span};
pub use error::SanitizerError;
pub use geometry::{NodeRole, PoolGeometry};
pub use history::{EventKind, HistoryEvent};
pub use hooks::Hook;
pub use ids::{Generation, Owner, PageId, PageRef, PoolId, RequestId, TenantId};
pub use kernel_shadow::{AccessOp, Check, KernelAccess, KernelShadow};
pub use layouts::{Batch, BatchLayout};
pub use lifecycle::{RequestEvent, RequestState, Scope, Transition};
pub use options::{OnViolation, Options, ReportFormat, SharePolicy};
pub use report::{PageReport, Report, ReportBuffer};
pub use sanitizer::{MAX_POOLS, PageInfo, Sanitizer};
pub use shadow::PageState;
pub use stats::Checks;
pub use tier::{TierBlockId, TierBlockState};
pub use transfer::{Landing, Manifest, PageLanding};
pub use violation::{Verdict, Violation, ViolationId, ViolationKind};
