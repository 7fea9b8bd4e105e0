//! The one dispatch point between the engine and a sanitizer.
//!
//! The engine calls a hook at every KV page event (DESIGN.md's table):
//!
//! | moment                                   | hook              |
//! | ---------------------------------------- | ----------------- |
//! | pool created                             | `pool_register`   |
//! | request queued/admitted/…/finished       | `request_event`   |
//! | page taken from the free list            | `alloc`           |
//! | KV computed into slots                   | `write`           |
//! | before attention reads a block table     | `read`            |
//! | prefill ships KV                         | `transfer_send`   |
//! | bytes land on decode                     | `transfer_recv`   |
//! | decode starts using the request's KV     | `transfer_commit` |
//! | page returned                            | `free`            |
//!
//! [`Hooks`] holds the target chosen once at start-up. With none (a release
//! build without a sanitizer), every hook is one predictable branch returning
//! [`Verdict::Continue`].

use std::ops::Range;
use std::sync::Arc;

pub use kvsan_sanitizer::{Manifest, NodeRole, PoolGeometry, RequestEvent, Verdict};
use kvsan_sanitizer::{Owner, PageRef, PoolId};

/// A hook target: something that checks the engine's KV page events.
///
/// Every method may be called from several threads at once. A
/// [`Verdict::Abort`] tells the engine to abort the request the event
/// concerns (and only that request).
pub trait KvHooks: Send + Sync {
    /// A pool was created; returns the id the target knows it by.
    fn pool_register(&self, geometry: &PoolGeometry) -> PoolId;
    /// A request entered `event`'s state.
    fn request_event(&self, owner: Owner, event: RequestEvent) -> Verdict;
    /// `page` (at its new generation) was taken from the free list for `owner`.
    fn alloc(&self, pool: PoolId, owner: Owner, page: PageRef, step: u64) -> Verdict;
    /// `owner` returns `page` to the pool.
    fn free(&self, pool: PoolId, owner: Owner, page: PageRef, step: u64) -> Verdict;
    /// `owner` computes KV into `slots` × `layers` of `page`.
    fn write(
        &self,
        pool: PoolId,
        owner: Owner,
        page: PageRef,
        slots: Range<u32>,
        layers: Range<u32>,
        step: u64,
    ) -> Verdict;
    /// Attention of `owner` is about to read the first `tokens` positions of
    /// `table` for `layers`.
    fn read(
        &self,
        pool: PoolId,
        owner: Owner,
        table: &[PageRef],
        tokens: usize,
        layers: Range<u32>,
        step: u64,
    ) -> Verdict;
    /// The sender ships what `manifest` describes.
    fn transfer_send(&self, pool: PoolId, manifest: &Manifest) -> Verdict;
    /// The bytes `manifest` describes landed in the receiver's pages.
    fn transfer_recv(&self, pool: PoolId, manifest: &Manifest) -> Verdict;
    /// The receiver starts using the first `committed_tokens` positions of `table`.
    fn transfer_commit(
        &self,
        pool: PoolId,
        owner: Owner,
        table: &[PageRef],
        committed_tokens: usize,
    ) -> Verdict;
}

/// The hook target chosen at start-up, or none.
#[derive(Clone, Default)]
pub struct Hooks {
    target: Option<Arc<dyn KvHooks>>,
}

impl std::fmt::Debug for Hooks {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(if self.target.is_some() {
            "Hooks(attached)"
        } else {
            "Hooks(none)"
        })
    }
}

macro_rules! dispatch {
    ($self:ident, $method:ident ( $($arg:expr),* )) => {
        match &$self.target {
            None => Verdict::Continue,
            Some(t) => t.$method($($arg),*),
        }
    };
}

impl Hooks {
    /// No target: every hook continues.
    #[must_use]
    pub fn none() -> Hooks {
        Hooks { target: None }
    }

    /// Calls go to `target`.
    #[must_use]
    pub fn new(target: Arc<dyn KvHooks>) -> Hooks {
        Hooks {
            target: Some(target),
        }
    }

    /// Whether a target is attached.
    #[must_use]
    pub fn is_attached(&self) -> bool {
        self.target.is_some()
    }

    /// See [`KvHooks::pool_register`]; without a target, pool ids count from 0
    /// in the caller.
    pub fn pool_register(&self, geometry: &PoolGeometry, fallback: PoolId) -> PoolId {
        match &self.target {
            None => fallback,
            Some(t) => t.pool_register(geometry),
        }
    }

    /// See [`KvHooks::request_event`].
    #[inline]
    pub fn request_event(&self, owner: Owner, event: RequestEvent) -> Verdict {
        dispatch!(self, request_event(owner, event))
    }

    /// See [`KvHooks::alloc`].
    #[inline]
    pub fn alloc(&self, pool: PoolId, owner: Owner, page: PageRef, step: u64) -> Verdict {
        dispatch!(self, alloc(pool, owner, page, step))
    }

    /// See [`KvHooks::free`].
    #[inline]
    pub fn free(&self, pool: PoolId, owner: Owner, page: PageRef, step: u64) -> Verdict {
        dispatch!(self, free(pool, owner, page, step))
    }

    /// See [`KvHooks::write`].
    #[inline]
    pub fn write(
        &self,
        pool: PoolId,
        owner: Owner,
        page: PageRef,
        slots: Range<u32>,
        layers: Range<u32>,
        step: u64,
    ) -> Verdict {
        dispatch!(self, write(pool, owner, page, slots, layers, step))
    }

    /// See [`KvHooks::read`].
    #[inline]
    pub fn read(
        &self,
        pool: PoolId,
        owner: Owner,
        table: &[PageRef],
        tokens: usize,
        layers: Range<u32>,
        step: u64,
    ) -> Verdict {
        dispatch!(self, read(pool, owner, table, tokens, layers, step))
    }

    /// See [`KvHooks::transfer_send`].
    #[inline]
    pub fn transfer_send(&self, pool: PoolId, manifest: &Manifest) -> Verdict {
        dispatch!(self, transfer_send(pool, manifest))
    }

    /// See [`KvHooks::transfer_recv`].
    #[inline]
    pub fn transfer_recv(&self, pool: PoolId, manifest: &Manifest) -> Verdict {
        dispatch!(self, transfer_recv(pool, manifest))
    }

    /// See [`KvHooks::transfer_commit`].
    #[inline]
    pub fn transfer_commit(
        &self,
        pool: PoolId,
        owner: Owner,
        table: &[PageRef],
        committed_tokens: usize,
    ) -> Verdict {
        dispatch!(self, transfer_commit(pool, owner, table, committed_tokens))
    }
}
