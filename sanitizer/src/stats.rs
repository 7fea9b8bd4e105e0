//! Counters of the checks the sanitizer performed, so that a run that
//! checked nothing cannot pass for a run with no overhead.
//!
//! The hot hooks (`read`, `write`) run on many threads at once; one shared
//! counter would be a cache line every thread writes, and an atomic
//! read-modify-write on every hook. Counts go instead to one of [`SHARDS`]
//! cache-line-aligned shards. The first `SHARDS - 1` threads of the process
//! that count each own a shard alone and bump it with a relaxed load and
//! store (one writer: exact, no locked instruction); later threads share the
//! last shard with relaxed `fetch_add`. `CheckCounters::snapshot` sums
//! the shards.
//!
//! ```text
//!  thread 0  ─▶ shard 0  [read_calls read_pages writes transfers allocs frees]  (128-byte line, one writer)
//!  thread 1  ─▶ shard 1  [ …                                                 ]
//!  …            …
//!  thread 31 ─▶ shard 31 [ … ]  ◀─ thread 32, 33, …  (shared: fetch_add)
//! ```

use std::cell::Cell;
use std::sync::atomic::{AtomicU64, AtomicUsize, Ordering};

/// Shards of the counters.
pub const SHARDS: usize = 32;

/// Checks performed so far, by hook.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct Checks {
    /// `read` hook calls (an engine about to read a block table; the kvsan
    /// engine's kernels check in place instead, counted below).
    pub read_calls: u64,
    /// Block-table pages those reads checked.
    pub read_pages: u64,
    /// `write` calls (KV computed into a page).
    pub writes: u64,
    /// `transfer_send`, `transfer_recv` and `transfer_commit` calls.
    pub transfers: u64,
    /// `alloc` calls.
    pub allocs: u64,
    /// `free` calls.
    pub frees: u64,
    /// Pages the attention kernels checked before reading them (per page,
    /// layer and kernel task).
    pub kernel_read_pages: u64,
    /// Token-layer KV stores the store kernels checked.
    pub kernel_stores: u64,
}

impl Checks {
    /// All checks: pages read-checked (by the `read` hook and by the
    /// kernels), writes and kernel stores, transfers, allocations and frees
    /// (the figure the summary line gives).
    #[must_use]
    pub fn total(&self) -> u64 {
        self.read_pages
            + self.writes
            + self.transfers
            + self.allocs
            + self.frees
            + self.kernel_read_pages
            + self.kernel_stores
    }
}

#[derive(Default)]
#[repr(align(128))]
struct Shard {
    read_calls: AtomicU64,
    read_pages: AtomicU64,
    writes: AtomicU64,
    transfers: AtomicU64,
    allocs: AtomicU64,
    frees: AtomicU64,
}

/// The sharded counters one sanitizer keeps.
pub(crate) struct CheckCounters {
    shards: Box<[Shard]>,
}

static NEXT_SHARD: AtomicUsize = AtomicUsize::new(0);

thread_local! {
    static SHARD: Cell<usize> = const { Cell::new(usize::MAX) };
}

/// This thread's shard index, assigned at its first count: its own shard
/// for the first `SHARDS - 1` threads, the shared last one after.
#[inline]
fn shard_index() -> usize {
    SHARD.with(|s| {
        let i = s.get();
        if i < SHARDS {
            i
        } else {
            let i = NEXT_SHARD.fetch_add(1, Ordering::Relaxed).min(SHARDS - 1);
            s.set(i);
            i
        }
    })
}

/// Adds `n` to `counter` of shard `index`.
#[inline]
fn bump(counter: &AtomicU64, index: usize, n: u64) {
    if index < SHARDS - 1 {
        // This thread is the shard's only writer: a plain load and store
        // cannot lose an update.
        counter.store(counter.load(Ordering::Relaxed) + n, Ordering::Relaxed);
    } else {
        counter.fetch_add(n, Ordering::Relaxed);
    }
}

impl CheckCounters {
    pub(crate) fn new() -> CheckCounters {
        CheckCounters {
            shards: (0..SHARDS).map(|_| Shard::default()).collect(),
        }
    }

    #[inline]
    fn count(&self, field: impl Fn(&Shard) -> &AtomicU64, n: u64) {
        let i = shard_index();
        bump(field(&self.shards[i]), i, n);
    }

    /// One `read` checking `pages` pages.
    #[inline]
    pub(crate) fn read(&self, pages: u64) {
        let i = shard_index();
        let s = &self.shards[i];
        bump(&s.read_calls, i, 1);
        bump(&s.read_pages, i, pages);
    }

    /// One `write`.
    #[inline]
    pub(crate) fn write(&self) {
        self.count(|s| &s.writes, 1);
    }

    /// One transfer hook.
    #[inline]
    pub(crate) fn transfer(&self) {
        self.count(|s| &s.transfers, 1);
    }

    /// One `alloc`.
    #[inline]
    pub(crate) fn alloc(&self) {
        self.count(|s| &s.allocs, 1);
    }

    /// One `free`.
    #[inline]
    pub(crate) fn free(&self) {
        self.count(|s| &s.frees, 1);
    }

    /// The sums over all shards.
    pub(crate) fn snapshot(&self) -> Checks {
        let mut c = Checks::default();
        for s in &self.shards {
            c.read_calls += s.read_calls.load(Ordering::Relaxed);
            c.read_pages += s.read_pages.load(Ordering::Relaxed);
            c.writes += s.writes.load(Ordering::Relaxed);
            c.transfers += s.transfers.load(Ordering::Relaxed);
            c.allocs += s.allocs.load(Ordering::Relaxed);
            c.frees += s.frees.load(Ordering::Relaxed);
        }
        c
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn counts_from_many_threads_sum_exactly() {
        let c = CheckCounters::new();
        std::thread::scope(|s| {
            for _ in 0..SHARDS + 3 {
                s.spawn(|| {
                    for _ in 0..1000 {
                        c.read(3);
                        c.write();
                    }
                    c.transfer();
                    c.alloc();
                    c.free();
                });
            }
        });
        let n = (SHARDS + 3) as u64;
        let got = c.snapshot();
        assert_eq!(
            got,
            Checks {
                read_calls: 1000 * n,
                read_pages: 3000 * n,
                writes: 1000 * n,
                transfers: n,
                allocs: n,
                frees: n,
                ..Checks::default()
            }
        );
        assert_eq!(got.total(), 3000 * n + 1000 * n + 3 * n);
    }
}
