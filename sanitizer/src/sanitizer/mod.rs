//! The `Sanitizer` facade: the hooks an engine calls, each returning a
//! [`Verdict`]. All hooks take `&self` and may be called from many threads
//! at once (scheduler, compute and transfer threads).
//!
//! Checks are inline and cheap; finding a violation leaves the hot path for
//! the `#[cold]` [`Sanitizer::violation`] path, which numbers, counts, records
//! and reports it, then applies `on_violation`.
//!
//! A hook that finds a violation changes no shadow state, with two
//! exceptions: `alloc` by a terminal request still records the allocation
//! (the engine has taken the page), and `transfer_commit` that finds a
//! `short-transfer` still moves the table's pages to Owned. `transfer_recv`
//! stops at the first failing page (pages before it have received).

use std::collections::{HashMap, VecDeque};
use std::io::Write;
use std::ops::Range;
use std::sync::OnceLock;
use std::sync::atomic::{AtomicU32, AtomicU64, Ordering};

use parking_lot::Mutex;

mod batch;
mod events;
mod finding;
mod kernel;
mod pages;
mod tier;
mod transfer;

use crate::error::SanitizerError;
use crate::geometry::PoolGeometry;
use crate::ids::{Generation, Owner, PageId, PoolId, RequestId};
use crate::lifecycle::{Lifecycle, RequestState};
use crate::options::Options;
use crate::pool::ShadowPool;
use crate::report::Sink;
use crate::shadow::{FLAG_OWNER_RELEASED, FLAG_SHARED, PageState};
use crate::stats::{CheckCounters, Checks};
use crate::tier::{TierBlock, TierBlockId};
use crate::violation::{Counters, Violation, ViolationKind};

/// The most pools one sanitizer shadows.
pub const MAX_POOLS: u32 = 256;

/// What a caller can learn about one page (for tests and engine assertions).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct PageInfo {
    /// Its state.
    pub state: PageState,
    /// Its current generation.
    pub generation: Generation,
    /// The owner recorded at the last allocation.
    pub owner: Owner,
    /// Whether it has read-only sharers.
    pub shared: bool,
    /// Whether the owner released it while sharers hold it.
    pub owner_released: bool,
}

/// The sanitizer: shadow pools, request lifecycle, violation log and report sink.
pub struct Sanitizer {
    options: Options,
    pools: Box<[OnceLock<ShadowPool>]>,
    registered: AtomicU32,
    lifecycle: Lifecycle,
    counters: Counters,
    checks: CheckCounters,
    recent: Mutex<VecDeque<Violation>>,
    printed: AtomicU64,
    sink: Mutex<Sink>,
    /// Tier blocks storing, stored or failed (see [`crate::tier`]).
    tiers: Mutex<HashMap<TierBlockId, TierBlock>>,
}

impl std::fmt::Debug for Sanitizer {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Sanitizer")
            .field("options", &self.options)
            .field("pools", &self.registered.load(Ordering::Relaxed))
            .field("violations", &self.counters.total())
            .finish_non_exhaustive()
    }
}

fn check_range(
    range: &Range<u32>,
    limit: u32,
    err: impl FnOnce() -> SanitizerError,
) -> Result<(), SanitizerError> {
    if range.start > range.end || range.end > limit {
        Err(err())
    } else {
        Ok(())
    }
}

impl Sanitizer {
    /// A sanitizer writing reports to stderr, or to `<log_path>.<pid>`.
    ///
    /// (`self_test=1` is honoured by [`crate::self_test::start`], which
    /// the shim and the engine call instead.)
    ///
    /// # Errors
    /// [`SanitizerError::LogFile`] if the log file cannot be opened.
    pub fn new(options: Options) -> Result<Sanitizer, SanitizerError> {
        let sink = if options.log_path.is_empty() {
            Sink::Stderr
        } else {
            let path =
                std::path::PathBuf::from(format!("{}.{}", options.log_path, std::process::id()));
            let file = std::fs::OpenOptions::new()
                .create(true)
                .append(true)
                .open(&path)
                .map_err(|source| SanitizerError::LogFile { path, source })?;
            Sink::File(file)
        };
        Ok(Sanitizer::with_sink(options, sink))
    }

    /// A sanitizer configured from `KVSAN_OPTIONS`.
    ///
    /// # Errors
    /// A bad option, or a log file that cannot be opened.
    pub fn from_env() -> Result<Sanitizer, SanitizerError> {
        Sanitizer::new(Options::from_env()?)
    }

    /// A sanitizer writing reports to `writer` (`log_path` is ignored).
    pub fn with_writer(options: Options, writer: impl Write + Send + 'static) -> Sanitizer {
        Sanitizer::with_sink(options, Sink::Writer(Box::new(writer)))
    }

    fn with_sink(options: Options, sink: Sink) -> Sanitizer {
        let lifecycle = Lifecycle::new(options.ended_requests as usize);
        Sanitizer {
            options,
            pools: (0..MAX_POOLS).map(|_| OnceLock::new()).collect(),
            registered: AtomicU32::new(0),
            lifecycle,
            counters: Counters::new(),
            checks: CheckCounters::new(),
            recent: Mutex::new(VecDeque::new()),
            printed: AtomicU64::new(0),
            sink: Mutex::new(sink),
            tiers: Mutex::new(HashMap::new()),
        }
    }

    /// The options in force.
    #[must_use]
    pub fn options(&self) -> &Options {
        &self.options
    }

    /// Shadow bytes per page (record + written bitmap + history ring) for a
    /// geometry and history depth. The sharer table (shared pages only) and
    /// the quarantine FIFO are not counted.
    #[must_use]
    pub fn shadow_bytes_per_page(geometry: &PoolGeometry, history_depth: u32) -> usize {
        ShadowPool::bytes_per_page(geometry.page_slots, geometry.layers, history_depth)
    }

    #[inline]
    fn pool(&self, pool: PoolId) -> Result<&ShadowPool, SanitizerError> {
        self.pools
            .get(pool.0 as usize)
            .and_then(OnceLock::get)
            .ok_or_else(|| SanitizerError::UnknownPool {
                pool: pool.0,
                registered: self.registered.load(Ordering::Relaxed).min(MAX_POOLS),
            })
    }

    fn check_layers(&self, pool: &ShadowPool, layers: &Range<u32>) -> Result<(), SanitizerError> {
        check_range(layers, pool.geometry.layers, || {
            SanitizerError::LayerOutOfRange {
                pool: pool.id.0,
                start: layers.start,
                end: layers.end,
                layers: pool.geometry.layers,
            }
        })
    }

    fn check_slots(pool: &ShadowPool, slots: &Range<u32>) -> Result<(), SanitizerError> {
        check_range(slots, pool.geometry.page_slots, || {
            SanitizerError::SlotOutOfRange {
                pool: pool.id.0,
                start: slots.start,
                end: slots.end,
                page_slots: pool.geometry.page_slots,
            }
        })
    }

    fn check_capacity(pool: &ShadowPool, pages: usize, tokens: u64) -> Result<(), SanitizerError> {
        let capacity = pages as u64 * u64::from(pool.geometry.page_slots);
        if tokens > capacity {
            return Err(SanitizerError::TokensBeyondTable {
                pool: pool.id.0,
                tokens,
                pages: pages as u64,
                capacity,
            });
        }
        Ok(())
    }

    // ------------------------------------------------------------ queries

    /// A page's state, generation and owner now.
    ///
    /// # Errors
    /// Unknown pool or page out of range.
    pub fn page_info(&self, pool: PoolId, page: PageId) -> Result<PageInfo, SanitizerError> {
        let view = self.pool(pool)?.page(page)?;
        let word = view.rec.load();
        Ok(PageInfo {
            state: word.state(),
            generation: word.generation(),
            owner: view.rec.owner(),
            shared: word.has(FLAG_SHARED),
            owner_released: word.has(FLAG_OWNER_RELEASED),
        })
    }

    /// Requests the sanitizer tracks now: (live, ended and still remembered
    /// to catch their late activity; at most `ended_requests`).
    #[must_use]
    pub fn tracked_requests(&self) -> (usize, usize) {
        self.lifecycle.tracked()
    }

    /// A request's lifecycle state, if the sanitizer has seen it (and, once
    /// it ended, still remembers it).
    #[must_use]
    pub fn request_state(&self, request: RequestId) -> Option<RequestState> {
        self.lifecycle.state(request)
    }

    /// Every violation so far (bounded by `max_recorded`, oldest dropped first).
    #[must_use]
    pub fn violations(&self) -> Vec<Violation> {
        self.recent.lock().iter().copied().collect()
    }

    /// Violations counted so far, all kinds.
    #[must_use]
    pub fn violation_count(&self) -> u64 {
        self.counters.total()
    }

    /// Violations of `kind` counted so far.
    #[must_use]
    pub fn count(&self, kind: ViolationKind) -> u64 {
        self.counters.get(kind)
    }

    /// Checks performed so far, by hook (counted once the hook's arguments
    /// are found valid, whatever the check then finds).
    #[must_use]
    pub fn checks(&self) -> Checks {
        let mut checks = self.checks.snapshot();
        for pool in self.pools.iter().filter_map(OnceLock::get) {
            let (reads, stores) = pool.kernel_checks();
            checks.kernel_read_pages += reads;
            checks.kernel_stores += stores;
        }
        checks
    }

    /// `kvsan: N violations (stale-read: 2, …); M checks` — M is
    /// [`Checks::total`].
    #[must_use]
    pub fn summary(&self) -> String {
        format!(
            "{}; {} checks",
            self.counters.summary(),
            self.checks().total()
        )
    }

    /// Writes [`Sanitizer::summary`] to the report sink (at shutdown).
    pub fn print_summary(&self) {
        let mut sink = self.sink.lock();
        sink.emit(&format!("{}\n", self.summary()));
        sink.flush();
    }
}
