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

use std::collections::VecDeque;
use std::io::Write;
use std::ops::Range;
use std::sync::OnceLock;
use std::sync::atomic::{AtomicU32, AtomicU64, Ordering};

use parking_lot::Mutex;

use crate::error::SanitizerError;
use crate::geometry::PoolGeometry;
use crate::history::{Event, EventKind};
use crate::ids::{Generation, Owner, PageId, PageRef, PoolId, RequestId};
use crate::kernel_shadow::{AccessOp, KernelAccess, KernelShadow};
use crate::lifecycle::{Lifecycle, RequestEvent, RequestState, Scope, Transition};
use crate::options::{OnViolation, Options, ReportFormat};
use crate::pool::ShadowPool;
use crate::report::{PageReport, Report, Sink, exit_process};
use crate::shadow::{
    AllocOutcome, FLAG_OWNER_RELEASED, FLAG_SHARED, FreeOutcome, Needed, PageState, PageView,
    ReadCheck, StateWord,
};
use crate::stats::{CheckCounters, Checks};
use crate::transfer::{Manifest, pages_of};
use crate::violation::{Counters, Verdict, Violation, ViolationId, ViolationKind};

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

/// What a hook was doing when it found a violation.
#[derive(Clone, Debug)]
pub(crate) struct Finding {
    kind: ViolationKind,
    accessor: Owner,
    action: String,
    pool: Option<PoolId>,
    page: Option<PageRef>,
    slot: Option<u32>,
    step: Option<u64>,
    detail: String,
}

impl Finding {
    fn new(kind: ViolationKind, accessor: Owner, action: &str) -> Finding {
        Finding {
            kind,
            accessor,
            action: action.to_string(),
            pool: None,
            page: None,
            slot: None,
            step: None,
            detail: String::new(),
        }
    }

    fn at(mut self, pool: PoolId, page: PageRef) -> Finding {
        self.pool = Some(pool);
        self.page = Some(page);
        self
    }

    fn slot(mut self, slot: Option<u32>) -> Finding {
        self.slot = slot;
        self
    }

    fn step(mut self, step: Option<u64>) -> Finding {
        self.step = step;
        self
    }

    fn detail(mut self, detail: String) -> Finding {
        self.detail = detail;
        self
    }
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

    // ----------------------------------------------------------------- hooks

    /// Registers a pool and returns its id (ids count up from 0).
    ///
    /// # Errors
    /// A bad geometry, or more than [`MAX_POOLS`] pools.
    pub fn pool_register(&self, geometry: PoolGeometry) -> Result<PoolId, SanitizerError> {
        geometry.validate()?;
        let index = self
            .registered
            .fetch_update(Ordering::AcqRel, Ordering::Acquire, |n| {
                (n < MAX_POOLS).then_some(n + 1)
            })
            .map_err(|_| SanitizerError::TooManyPools { limit: MAX_POOLS })?;
        let id = PoolId(index);
        let pool = ShadowPool::new(
            id,
            geometry,
            self.options.history_depth,
            self.options.quarantine_pages,
        );
        // Each index is handed out once, so the cell is empty.
        let _ = self.pools[index as usize].set(pool);
        Ok(id)
    }

    /// A request enters the state `event`, as the whole process sees it
    /// (an engine of one node; see [`Sanitizer::request_event_at`] for a
    /// node's own view). Illegal moves are `illegal-transition`; any event
    /// after Rejected or Aborted is `terminal-request-activity`; reaching
    /// Finished, Rejected or Aborted while holding pages is `page-leak` (the
    /// engine frees first).
    pub fn request_event(&self, owner: Owner, event: RequestEvent) -> Verdict {
        self.scoped_event(Scope::Process, owner, event)
    }

    /// A request enters the state `event` as the node that owns `pool` sees
    /// it. Each node's view moves on its own: decode aborting a request does
    /// not end it for the prefill node, which goes on legally until it is
    /// told and reports its own end. The checks are
    /// [`Sanitizer::request_event`]'s, judged on the node's view (and an
    /// event after the process's view was rejected or aborted is
    /// `terminal-request-activity`); a `page-leak` is judged on the pages
    /// the request holds in `pool` when its node ends it.
    ///
    /// # Errors
    /// Unknown pool.
    pub fn request_event_at(
        &self,
        pool: PoolId,
        owner: Owner,
        event: RequestEvent,
    ) -> Result<Verdict, SanitizerError> {
        self.pool(pool)?;
        Ok(self.scoped_event(Scope::Pool(pool), owner, event))
    }

    fn scoped_event(&self, scope: Scope, owner: Owner, event: RequestEvent) -> Verdict {
        let mut rec = self.lifecycle.entry(owner.request, owner.tenant);
        let process = rec.view(Scope::Process).map(|v| v.state);
        let view = rec.view_mut(scope, RequestState::Queued);
        let from = match process {
            Some(p @ (RequestState::Rejected | RequestState::Aborted))
                if scope != Scope::Process =>
            {
                p
            }
            _ => view.state,
        };
        match from.transition(event) {
            Transition::Legal => {
                view.state = event;
                if !event.is_terminal() {
                    return Verdict::Continue;
                }
                if rec.held(scope) == 0 {
                    drop(rec);
                    self.lifecycle.retire_if_over(owner.request);
                    return Verdict::Continue;
                }
                drop(rec);
                let leaked = self.pages_held_by(owner.request, scope, true);
                self.page_leak(owner, event, &leaked)
            }
            Transition::TerminalActivity => {
                drop(rec);
                self.lifecycle.retire_if_over(owner.request);
                self.violation(
                    Finding::new(ViolationKind::TerminalRequestActivity, owner, "reporting")
                        .detail(format!(
                            "lifecycle event {} after the request was {}",
                            event.name(),
                            from.name()
                        )),
                )
            }
            Transition::Illegal => {
                drop(rec);
                self.violation(
                    Finding::new(ViolationKind::IllegalTransition, owner, "reporting").detail(
                        format!(
                            "lifecycle event {} is not legal from {}",
                            event.name(),
                            from.name()
                        ),
                    ),
                )
            }
        }
    }

    /// Pages `who` holds in `scope`'s pool (every pool for the process),
    /// marking the ones it owns as held by an ended request if asked.
    fn pages_held_by(
        &self,
        who: RequestId,
        scope: Scope,
        mark_terminal: bool,
    ) -> Vec<(PoolId, PageRef)> {
        let mut held = Vec::new();
        let pools = self.pools.iter().filter_map(OnceLock::get);
        for pool in pools.filter(|p| scope == Scope::Process || scope == Scope::Pool(p.id)) {
            for (page, owned) in pool.pages_held_by(who) {
                if owned
                    && mark_terminal
                    && let Ok(view) = pool.page(page.page)
                {
                    view.mark_terminal_owner(page.generation, who);
                }
                held.push((pool.id, page));
            }
        }
        held
    }

    #[cold]
    fn page_leak(
        &self,
        owner: Owner,
        event: RequestEvent,
        leaked: &[(PoolId, PageRef)],
    ) -> Verdict {
        let Some(&(pool, first)) = leaked.first() else {
            return Verdict::Continue;
        };
        let list: Vec<String> = leaked
            .iter()
            .take(8)
            .map(|(pool, page)| format!("{pool} {page}"))
            .collect();
        let more = if leaked.len() > 8 { ", …" } else { "" };
        self.violation(
            Finding::new(ViolationKind::PageLeak, owner, "ending")
                .at(pool, first)
                .detail(format!(
                    "request became {} still holding {} page reference(s): {}{more}",
                    event.name(),
                    leaked.len(),
                    list.join(", ")
                )),
        )
    }

    /// The engine took `page` from its free list for `owner`. Returns the
    /// page's new generation (the tag for the block table).
    ///
    /// `double-alloc` if the page is not Free or Quarantined (nothing changes;
    /// the page's current generation is returned); otherwise
    /// `terminal-request-activity` if the owner is terminal (the allocation
    /// is still recorded).
    ///
    /// # Errors
    /// Unknown pool or page out of range.
    pub fn alloc(
        &self,
        pool: PoolId,
        page: PageId,
        owner: Owner,
        step: u64,
    ) -> Result<(Verdict, Generation), SanitizerError> {
        let shadow = self.pool(pool)?;
        let view = shadow.page(page)?;
        self.checks.alloc();
        let mut rec = self.lifecycle.entry(owner.request, owner.tenant);
        let state = match rec.state_at(pool) {
            Some(state) => state,
            None => rec.view_mut(Scope::Process, RequestState::Admitted).state,
        };
        let outcome = view.alloc(owner, state.is_terminal());
        drop(rec);
        if matches!(outcome, AllocOutcome::Allocated { .. }) {
            self.lifecycle
                .add_held(owner.request, owner.tenant, pool, 1);
        }
        match outcome {
            AllocOutcome::Allocated { generation } => {
                shadow.log(
                    page,
                    Event::new(EventKind::Alloc, owner, generation, Some(step), None),
                );
                let verdict = if state.is_terminal() {
                    self.violation(
                        Finding::new(ViolationKind::TerminalRequestActivity, owner, "allocating")
                            .at(pool, PageRef { page, generation })
                            .step(Some(step))
                            .detail(format!(
                                "{} request allocates a page",
                                with_article(state.name())
                            )),
                    )
                } else {
                    Verdict::Continue
                };
                Ok((verdict, generation))
            }
            AllocOutcome::AlreadyAllocated(word) => {
                let generation = word.generation();
                let verdict = self.violation(
                    Finding::new(ViolationKind::DoubleAlloc, owner, "allocating")
                        .at(pool, PageRef { page, generation })
                        .step(Some(step))
                        .detail(format!(
                            "the page is {}, not free or quarantined",
                            word.state().name()
                        )),
                );
                Ok((verdict, generation))
            }
        }
    }

    /// `owner` lets go of its reference to `page` (ownership or share). The
    /// page goes to quarantine when its last holder lets go.
    ///
    /// `double-free` if the page is already free or the generation moved on;
    /// `foreign-free` if `owner` neither owns nor shares it.
    ///
    /// # Errors
    /// Unknown pool or page out of range.
    pub fn free(
        &self,
        pool: PoolId,
        owner: Owner,
        page: PageRef,
        step: u64,
    ) -> Result<Verdict, SanitizerError> {
        let shadow = self.pool(pool)?;
        let view = shadow.page(page.page)?;
        self.checks.free();
        let released = match view.free_by_owner(page.generation, owner.request) {
            FreeOutcome::Released => true,
            FreeOutcome::OwnerReleased => false,
            FreeOutcome::DoubleFree(word) => {
                let detail = if word.generation() == page.generation {
                    format!("the page is already {}", word.state().name())
                } else {
                    format!(
                        "the reference is stale: the page is at gen {} ({})",
                        word.generation().0,
                        word.state().name()
                    )
                };
                return Ok(self.violation(
                    Finding::new(ViolationKind::DoubleFree, owner, "freeing")
                        .at(pool, page)
                        .step(Some(step))
                        .detail(detail),
                ));
            }
            FreeOutcome::NotOwner(_) => match shadow.drop_sharer(view, page, owner.request) {
                Some(released) => released,
                None => {
                    return Ok(self.violation(
                        Finding::new(ViolationKind::ForeignFree, owner, "freeing")
                            .at(pool, page)
                            .step(Some(step))
                            .detail("the freeing request neither owns nor shares the page".into()),
                    ));
                }
            },
        };
        shadow.flush_kernel_write(page.page);
        shadow.log(
            page.page,
            Event::new(EventKind::Free, owner, page.generation, Some(step), None),
        );
        if released {
            shadow.quarantine(page.page, page.generation);
        }
        self.lifecycle
            .add_held(owner.request, owner.tenant, pool, -1);
        Ok(Verdict::Continue)
    }

    /// The prefix cache shares `page` read-only with `sharer` (one more
    /// reference; the sharer frees it like an owner).
    ///
    /// `terminal-request-activity` for a terminal sharer; `generation-mismatch`
    /// or `read-free-page` if the page is not held at that generation.
    ///
    /// # Errors
    /// Unknown pool or page out of range.
    pub fn share(
        &self,
        pool: PoolId,
        page: PageRef,
        sharer: Owner,
    ) -> Result<Verdict, SanitizerError> {
        let shadow = self.pool(pool)?;
        let view = shadow.page(page.page)?;
        if let Some(state) = self.lifecycle.state_at(sharer.request, pool)
            && state.is_terminal()
        {
            return Ok(self.violation(
                Finding::new(ViolationKind::TerminalRequestActivity, sharer, "sharing")
                    .at(pool, page)
                    .detail(format!(
                        "{} request takes a shared page",
                        with_article(state.name())
                    )),
            ));
        }
        match shadow.add_sharer(view, page, sharer) {
            Ok(()) => {
                shadow.log(
                    page.page,
                    Event::new(EventKind::Share, sharer, page.generation, None, None),
                );
                self.lifecycle
                    .add_held(sharer.request, sharer.tenant, pool, 1);
                Ok(Verdict::Continue)
            }
            Err(word) => {
                let kind = if word.generation() == page.generation {
                    ViolationKind::ReadFreePage
                } else {
                    ViolationKind::GenerationMismatch
                };
                Ok(
                    self.violation(Finding::new(kind, sharer, "sharing").at(pool, page).detail(
                        format!(
                            "the page is {} at gen {}",
                            word.state().name(),
                            word.generation().0
                        ),
                    )),
                )
            }
        }
    }

    /// KV computed by `owner` into `slots × layers` of `page`.
    ///
    /// In order: `generation-mismatch` (stale tag), `write-after-free` (page
    /// free or quarantined), `foreign-write` (writer does not hold the
    /// ownership: another request, a mere sharer, or an owner who released
    /// it), `terminal-request-activity` (owner is terminal).
    ///
    /// # Errors
    /// Unknown pool; page, slot or layer out of range.
    #[inline]
    pub fn write(
        &self,
        pool: PoolId,
        owner: Owner,
        page: PageRef,
        slots: Range<u32>,
        layers: Range<u32>,
        step: u64,
    ) -> Result<Verdict, SanitizerError> {
        let shadow = self.pool(pool)?;
        let view = shadow.page(page.page)?;
        check_range(&slots, shadow.geometry.page_slots, || {
            SanitizerError::SlotOutOfRange {
                pool: pool.0,
                start: slots.start,
                end: slots.end,
                page_slots: shadow.geometry.page_slots,
            }
        })?;
        self.check_layers(shadow, &layers)?;
        self.checks.write();
        match view.write(owner.request, page.generation, slots.clone(), &layers) {
            Ok(false) => Ok(Verdict::Continue),
            Ok(true) => {
                shadow.log(
                    page.page,
                    Event::new(
                        EventKind::Write,
                        owner,
                        page.generation,
                        Some(step),
                        Some((slots.start, slots.end)),
                    ),
                );
                Ok(Verdict::Continue)
            }
            Err((kind, word)) => {
                Ok(self.write_violation(kind, owner, pool, page, &slots, &layers, step, word))
            }
        }
    }

    #[cold]
    #[allow(clippy::too_many_arguments)]
    fn write_violation(
        &self,
        kind: ViolationKind,
        owner: Owner,
        pool: PoolId,
        page: PageRef,
        slots: &Range<u32>,
        layers: &Range<u32>,
        step: u64,
        word: StateWord,
    ) -> Verdict {
        let detail = format!(
            "write of slots {}..{}, layers {}..{} through a tag of gen {}; the page is {} at gen {}",
            slots.start,
            slots.end,
            layers.start,
            layers.end,
            page.generation.0,
            word.state().name(),
            word.generation().0
        );
        self.violation(
            Finding::new(kind, owner, "writing")
                .at(pool, page)
                .slot((!slots.is_empty()).then_some(slots.start))
                .step(Some(step))
                .detail(detail),
        )
    }

    /// Attention by `owner` is about to read tokens `0..tokens` of `layers`
    /// through `block_table` (token `t` is entry `t / page_slots`, slot
    /// `t % page_slots`). Entries holding no token below `tokens` are not read
    /// and not checked.
    ///
    /// `terminal-request-activity` first (a terminal reader); then, page by
    /// page: `generation-mismatch`, `read-free-page`, `read-during-transfer`,
    /// `foreign-read` (neither holding owner nor sharer), `stale-read` (a slot
    /// not written for every layer read). The first violation is reported.
    ///
    /// # Errors
    /// Unknown pool; page or layer out of range; `tokens` beyond the table.
    #[inline]
    pub fn read(
        &self,
        pool: PoolId,
        owner: Owner,
        block_table: &[PageRef],
        tokens: usize,
        layers: Range<u32>,
        step: u64,
    ) -> Result<Verdict, SanitizerError> {
        let shadow = self.pool(pool)?;
        self.check_layers(shadow, &layers)?;
        Self::check_capacity(shadow, block_table.len(), tokens as u64)?;
        let ps = shadow.geometry.page_slots as usize;
        self.checks.read(tokens.div_ceil(ps) as u64);
        if let Some(state) = self.lifecycle.state_at(owner.request, pool)
            && state.is_terminal()
        {
            return Ok(self.violation(
                Finding::new(ViolationKind::TerminalRequestActivity, owner, "reading")
                    .step(Some(step))
                    .detail(format!(
                        "{} request reads {tokens} tokens of KV",
                        with_article(state.name())
                    )),
            ));
        }
        // What a whole page needs, worked out once; the last page may be partial.
        let whole = shadow.layout.needed(0..ps as u32, &layers);
        for (i, page) in block_table.iter().enumerate().take(tokens.div_ceil(ps)) {
            let slots = (tokens - i * ps).min(ps) as u32;
            let partial;
            let needed = if slots as usize == ps {
                &whole
            } else {
                partial = shadow.layout.needed(0..slots, &layers);
                &partial
            };
            if let Some(verdict) = self.read_page(
                shadow,
                owner,
                i,
                *page,
                0..slots,
                &layers,
                needed,
                Some(step),
            )? {
                return Ok(verdict);
            }
        }
        Ok(Verdict::Continue)
    }

    /// The read check of one page, `slots` of `layers`, by `owner` through
    /// block-table entry `index`: `None` when legal (owner, or sharer with
    /// every slot written), else the verdict of the violation reported.
    #[allow(clippy::too_many_arguments)]
    #[inline]
    fn read_page(
        &self,
        shadow: &ShadowPool,
        owner: Owner,
        index: usize,
        page: PageRef,
        slots: Range<u32>,
        layers: &Range<u32>,
        needed: &Needed,
        step: Option<u64>,
    ) -> Result<Option<Verdict>, SanitizerError> {
        let view = shadow.page(page.page)?;
        Ok(
            match view.check_read_needed(
                owner.request,
                page.generation,
                slots.clone(),
                layers,
                needed,
            ) {
                ReadCheck::Ok => None,
                other => self.read_slow(
                    shadow, view, other, owner, page, index, slots, layers, step, "reading",
                ),
            },
        )
    }

    /// A non-Ok read check: a sharer's legal read, or a violation.
    #[cold]
    #[allow(clippy::too_many_arguments)]
    fn read_slow(
        &self,
        shadow: &ShadowPool,
        view: PageView<'_>,
        check: ReadCheck,
        owner: Owner,
        page: PageRef,
        index: usize,
        slots: Range<u32>,
        layers: &Range<u32>,
        step: Option<u64>,
        action: &str,
    ) -> Option<Verdict> {
        let (kind, word, slot) = match check {
            ReadCheck::Ok => return None,
            ReadCheck::NotOwner(word) => {
                if word.has(FLAG_SHARED) && shadow.is_sharer(page.page, owner.request) {
                    match view.first_unwritten(slots.clone(), layers) {
                        None => return None,
                        Some(slot) => (ViolationKind::StaleRead, word, Some(slot)),
                    }
                } else {
                    (ViolationKind::ForeignRead, word, None)
                }
            }
            ReadCheck::Fail { kind, word, slot } => (kind, word, slot),
        };
        let ps = u64::from(shadow.geometry.page_slots);
        let detail = match (kind, slot) {
            (ViolationKind::StaleRead | ViolationKind::UnwrittenTransfer, Some(s)) => {
                let written = view.written_layers(s, layers);
                format!(
                    "slot {s} (token {}) not written for layers {}..{} in gen {}: {written} of {} layers written",
                    index as u64 * ps + u64::from(s),
                    layers.start,
                    layers.end,
                    word.generation().0,
                    layers.len()
                )
            }
            _ => format!(
                "block-table entry {index} tags gen {}; the page is {} at gen {}",
                page.generation.0,
                word.state().name(),
                word.generation().0
            ),
        };
        Some(
            self.violation(
                Finding::new(kind, owner, action)
                    .at(shadow.id, page)
                    .slot(slot)
                    .step(step)
                    .detail(detail),
            ),
        )
    }

    /// The sender is about to ship `manifest` from its pool `pool`: the
    /// request is not terminal, and every source slot × layer shipped is
    /// written (`unwritten-transfer`); the source pages are read like
    /// [`Sanitizer::read`] reads them.
    ///
    /// # Errors
    /// Unknown pool; page or layer out of range; tokens beyond `src_pages`.
    pub fn transfer_send(
        &self,
        pool: PoolId,
        manifest: &Manifest,
    ) -> Result<Verdict, SanitizerError> {
        let shadow = self.pool(pool)?;
        let owner = manifest.request;
        self.check_layers(shadow, &manifest.layers)?;
        Self::check_capacity(shadow, manifest.src_pages.len(), manifest.token_range().end)?;
        self.checks.transfer();
        if let Some(v) = self.terminal_transfer(pool, owner, "sending", manifest) {
            return Ok(v);
        }
        let split: Vec<_> = pages_of(manifest.token_range(), shadow.geometry.page_slots).collect();
        for (i, slots) in &split {
            let page = manifest.src_pages[*i];
            let view = shadow.page(page.page)?;
            if view.rec.load().generation() == page.generation {
                shadow.flush_kernel_write(page.page);
            }
            let check = match view.check_read(
                owner.request,
                page.generation,
                slots.clone(),
                &manifest.layers,
            ) {
                ReadCheck::Fail {
                    kind: ViolationKind::StaleRead,
                    word,
                    slot,
                } => ReadCheck::Fail {
                    kind: ViolationKind::UnwrittenTransfer,
                    word,
                    slot,
                },
                ReadCheck::NotOwner(word)
                    if word.has(FLAG_SHARED) && shadow.is_sharer(page.page, owner.request) =>
                {
                    match view.first_unwritten(slots.clone(), &manifest.layers) {
                        None => ReadCheck::Ok,
                        slot => ReadCheck::Fail {
                            kind: ViolationKind::UnwrittenTransfer,
                            word,
                            slot,
                        },
                    }
                }
                other => other,
            };
            if let Some(v) = self.read_slow(
                shadow,
                view,
                check,
                owner,
                page,
                *i,
                slots.clone(),
                &manifest.layers,
                None,
                "sending",
            ) {
                return Ok(v);
            }
        }
        for (i, slots) in split {
            let page = manifest.src_pages[i];
            shadow.log(
                page.page,
                Event::new(
                    EventKind::Send,
                    owner,
                    page.generation,
                    None,
                    Some((slots.start, slots.end)),
                ),
            );
        }
        Ok(Verdict::Continue)
    }

    fn terminal_transfer(
        &self,
        pool: PoolId,
        owner: Owner,
        action: &str,
        manifest: &Manifest,
    ) -> Option<Verdict> {
        let state = self.lifecycle.state_at(owner.request, pool)?;
        state.is_terminal().then(|| {
            self.violation(
                Finding::new(ViolationKind::TerminalRequestActivity, owner, action).detail(
                    format!(
                        "{} request transfers tokens {}..{}",
                        with_article(state.name()),
                        manifest.first_token,
                        manifest.token_range().end
                    ),
                ),
            )
        })
    }

    /// Bytes of `manifest` landed in the receiver's pool `pool`: each
    /// destination page must still be held by the manifest's request at its
    /// tagged generation (`write-after-free` if freed or re-allocated since,
    /// `foreign-write` if another request holds it). The pages become
    /// Receiving and the received slots × layers count as written.
    ///
    /// # Errors
    /// Unknown pool; page or layer out of range; tokens beyond `dst_pages`.
    pub fn transfer_recv(
        &self,
        pool: PoolId,
        manifest: &Manifest,
    ) -> Result<Verdict, SanitizerError> {
        let shadow = self.pool(pool)?;
        let owner = manifest.request;
        self.check_layers(shadow, &manifest.layers)?;
        Self::check_capacity(shadow, manifest.dst_pages.len(), manifest.token_range().end)?;
        self.checks.transfer();
        if let Some(v) = self.terminal_transfer(pool, owner, "receiving", manifest) {
            return Ok(v);
        }
        for (i, slots) in pages_of(manifest.token_range(), shadow.geometry.page_slots) {
            let page = manifest.dst_pages[i];
            let view = shadow.page(page.page)?;
            match view.receive(
                owner.request,
                page.generation,
                slots.clone(),
                &manifest.layers,
            ) {
                Ok(()) => shadow.log(
                    page.page,
                    Event::new(
                        EventKind::Recv,
                        owner,
                        page.generation,
                        None,
                        Some((slots.start, slots.end)),
                    ),
                ),
                Err((kind, word)) => {
                    return Ok(self.violation(
                        Finding::new(kind, owner, "receiving into")
                            .at(pool, page)
                            .slot(Some(slots.start))
                            .detail(format!(
                                "transfer of tokens {}..{} lands in slots {}..{} through a tag of gen {}; the page is {} at gen {}",
                                manifest.first_token,
                                manifest.token_range().end,
                                slots.start,
                                slots.end,
                                page.generation.0,
                                word.state().name(),
                                word.generation().0
                            )),
                    ));
                }
            }
        }
        Ok(Verdict::Continue)
    }

    /// Decode is about to use `committed_tokens` tokens received into
    /// `block_table`: every slot below `committed_tokens` must be written for
    /// all layers (`short-transfer` otherwise). Receiving pages become Owned.
    /// Pages must be current (`generation-mismatch`), not free
    /// (`read-free-page`) and held or shared by `owner` (`foreign-read`).
    ///
    /// # Errors
    /// Unknown pool; page out of range; tokens beyond the table.
    pub fn transfer_commit(
        &self,
        pool: PoolId,
        owner: Owner,
        block_table: &[PageRef],
        committed_tokens: usize,
    ) -> Result<Verdict, SanitizerError> {
        let shadow = self.pool(pool)?;
        Self::check_capacity(shadow, block_table.len(), committed_tokens as u64)?;
        self.checks.transfer();
        if let Some(state) = self.lifecycle.state_at(owner.request, pool)
            && state.is_terminal()
        {
            return Ok(self.violation(
                Finding::new(ViolationKind::TerminalRequestActivity, owner, "committing").detail(
                    format!(
                        "{} request commits {committed_tokens} received tokens",
                        with_article(state.name())
                    ),
                ),
            ));
        }
        let ps = shadow.geometry.page_slots as usize;
        let all = 0..shadow.geometry.layers;
        let whole = shadow.layout.needed(0..ps as u32, &all);
        let mut short: Option<(usize, PageRef, u32, StateWord)> = None;
        for (i, page) in block_table.iter().enumerate() {
            let view = shadow.page(page.page)?;
            let word = view.rec.load();
            let kind = if word.generation() != page.generation {
                Some(ViolationKind::GenerationMismatch)
            } else if word.state().is_free() {
                Some(ViolationKind::ReadFreePage)
            } else if (word.has(FLAG_OWNER_RELEASED) || view.rec.owner().request != owner.request)
                && !(word.has(FLAG_SHARED) && shadow.is_sharer(page.page, owner.request))
            {
                Some(ViolationKind::ForeignRead)
            } else {
                None
            };
            if let Some(kind) = kind {
                return Ok(self.violation(
                    Finding::new(kind, owner, "committing")
                        .at(pool, *page)
                        .detail(format!(
                            "block-table entry {i} tags gen {}; the page is {} at gen {}",
                            page.generation.0,
                            word.state().name(),
                            word.generation().0
                        )),
                ));
            }
            let needed = committed_tokens.saturating_sub(i * ps).min(ps) as u32;
            let written = if needed as usize == ps {
                view.has(&whole)
            } else {
                view.first_unwritten(0..needed, &all).is_none()
            };
            if short.is_none()
                && !written
                && let Some(slot) = view.first_unwritten(0..needed, &all)
            {
                short = Some((i, *page, slot, word));
            }
        }
        for page in block_table {
            let view = shadow.page(page.page)?;
            if view.commit(page.generation) {
                shadow.log(
                    page.page,
                    Event::new(EventKind::Commit, owner, page.generation, None, None),
                );
            }
        }
        let Some((i, page, slot, word)) = short else {
            return Ok(Verdict::Continue);
        };
        let received = (i * ps) as u64 + u64::from(slot);
        Ok(self.violation(
            Finding::new(ViolationKind::ShortTransfer, owner, "committing")
                .at(pool, page)
                .slot(Some(slot))
                .detail(format!(
                    "commits {committed_tokens} tokens but token {received} (slot {slot}, gen {}) has not arrived for every layer: {} of {} layers",
                    word.generation().0,
                    shadow.page(page.page).map_or(0, |v| v.written_layers(slot, &all)),
                    all.len()
                )),
        ))
    }

    // ------------------------------------------------------------ kernels

    /// The kernels' view of pool `pool`'s shadow: the records and written
    /// bits the store and attention kernels check in place
    /// ([`crate::kernel_shadow`]).
    ///
    /// # Errors
    /// Unknown pool.
    pub fn kernel_shadow(&self, pool: PoolId) -> Result<KernelShadow<'_>, SanitizerError> {
        Ok(self.pool(pool)?.kernel_shadow())
    }

    /// The cold path of a kernel access the fast path did not pass: checks
    /// it again against the whole shadow and reports it. `who` is the owner
    /// of the batch row that made the access; `access` is what the kernel
    /// was handed (the `PageRef`, the entry or position, the layer, the
    /// slots).
    ///
    /// - a read is checked as [`Sanitizer::read`] checks a page, for one
    ///   layer: legal for the holding owner with the slots written, and for
    ///   a sharer of a shared page with the slots written (then
    ///   [`Verdict::Continue`] and nothing is reported);
    /// - a store is checked (and, if legal, its slot marked written) as
    ///   [`Sanitizer::write`] checks a write of one slot;
    /// - poison that reached attention output through the accessed slot is
    ///   always `poison-read`: the shadow said the slot was written, the
    ///   memory held a freed page's fill.
    ///
    /// # Errors
    /// Unknown pool; page, slot or layer out of range.
    pub fn kernel_refusal(
        &self,
        pool: PoolId,
        who: Owner,
        access: &KernelAccess,
        step: u64,
    ) -> Result<Verdict, SanitizerError> {
        let shadow = self.pool(pool)?;
        let layers = access.layer..access.layer.saturating_add(1);
        self.check_layers(shadow, &layers)?;
        check_range(&access.slots, shadow.geometry.page_slots, || {
            SanitizerError::SlotOutOfRange {
                pool: pool.0,
                start: access.slots.start,
                end: access.slots.end,
                page_slots: shadow.geometry.page_slots,
            }
        })?;
        let view = shadow.page(access.page.page)?;
        match access.op {
            AccessOp::Store => {
                self.write(pool, who, access.page, access.slots.clone(), layers, step)
            }
            AccessOp::Read => {
                if let Some(state) = self.lifecycle.state_at(who.request, pool)
                    && state.is_terminal()
                {
                    return Ok(self.violation(
                        Finding::new(ViolationKind::TerminalRequestActivity, who, "reading")
                            .at(pool, access.page)
                            .step(Some(step))
                            .detail(format!(
                                "{} request's attention reads layer {} of block-table entry {}",
                                with_article(state.name()),
                                access.layer,
                                access.entry
                            )),
                    ));
                }
                Ok(self
                    .read_page(
                        shadow,
                        who,
                        access.entry as usize,
                        access.page,
                        access.slots.clone(),
                        &layers,
                        &shadow.layout.needed(access.slots.clone(), &layers),
                        Some(step),
                    )?
                    .unwrap_or(Verdict::Continue))
            }
            AccessOp::Poison => {
                let slot = access.slots.start;
                let token = u64::from(access.entry) * u64::from(shadow.geometry.page_slots)
                    + u64::from(slot);
                let word = view.rec.load();
                Ok(self.violation(
                    Finding::new(ViolationKind::PoisonRead, who, "reading")
                        .at(pool, access.page)
                        .slot(Some(slot))
                        .step(Some(step))
                        .detail(format!(
                            "attention output of layer {} turned NaN: slot {slot} (token {token}) holds the poison of a freed page; the shadow has it as written ({} of {} layers) in gen {}",
                            access.layer,
                            view.written_layers(slot, &(0..shadow.geometry.layers)),
                            shadow.geometry.layers,
                            word.generation().0
                        )),
                ))
            }
        }
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

    // ------------------------------------------------------------ reports

    /// Numbers, counts, records and reports a violation, then applies
    /// `on_violation`.
    #[cold]
    #[inline(never)]
    fn violation(&self, finding: Finding) -> Verdict {
        let id = ViolationId::next();
        self.counters.bump(finding.kind);
        {
            let mut recent = self.recent.lock();
            if self.options.max_recorded > 0 {
                while recent.len() >= self.options.max_recorded as usize {
                    recent.pop_front();
                }
                recent.push_back(Violation {
                    id,
                    kind: finding.kind,
                    request: finding.accessor.request,
                    tenant: finding.accessor.tenant,
                    pool: finding.pool,
                    page: finding.page.map(|p| p.page),
                });
            }
        }
        let limit = u64::from(self.options.print_limit);
        if limit == 0 || self.printed.fetch_add(1, Ordering::Relaxed) < limit {
            let report = self.build_report(id, &finding);
            let text = match self.options.report_format {
                ReportFormat::Text => report.render_text(),
                ReportFormat::Json => format!("{}\n", report.render_json()),
                ReportFormat::Both => format!("{}{}\n", report.render_text(), report.render_json()),
            };
            self.sink.lock().emit(&text);
        }
        tracing::debug!(kind = finding.kind.name(), %id, "kvsan violation");
        match self.options.on_violation {
            OnViolation::Abort => Verdict::Abort {
                violation: id,
                kind: finding.kind,
            },
            OnViolation::Report => Verdict::Continue,
            OnViolation::Halt => {
                let mut sink = self.sink.lock();
                sink.emit(&format!("{}\n", self.summary()));
                sink.flush();
                exit_process(self.options.exitcode)
            }
        }
    }

    /// The report a finding makes: page snapshot, slot map and history.
    #[cold]
    fn build_report(&self, id: ViolationId, f: &Finding) -> Report {
        let accessor_state = match f.pool {
            Some(pool) => self.lifecycle.state_at(f.accessor.request, pool),
            None => self.lifecycle.state(f.accessor.request),
        }
        .map(RequestState::name);
        let page = f.pool.zip(f.page).and_then(|(pool, page)| {
            let shadow = self.pool(pool).ok()?;
            let view = shadow.page(page.page).ok()?;
            Some((shadow, view, page))
        });
        let mut summary = format!("kvsan: {} in {}", f.kind, f.accessor);
        let mut history = Vec::new();
        let page_report = page.map(|(shadow, view, page)| {
            let word = view.rec.load();
            let owner = (word.generation().0 > 0).then(|| view.rec.owner());
            let state = word.state();
            let _ = std::fmt::Write::write_fmt(
                &mut summary,
                format_args!(" {} {} {page}", f.action, shadow.id),
            );
            match owner {
                Some(o) if !state.is_free() => {
                    let _ = std::fmt::Write::write_fmt(&mut summary, format_args!(" owned by {o}"));
                }
                Some(o) => {
                    let _ = std::fmt::Write::write_fmt(
                        &mut summary,
                        format_args!(" which is {} (last owned by {o})", state.name()),
                    );
                }
                None => summary.push_str(" which was never allocated"),
            }
            shadow.flush_kernel_write(page.page);
            history = shadow.history(page.page);
            let layers = shadow.geometry.layers;
            let slot_map = (0..shadow.geometry.page_slots)
                .map(|s| {
                    let n = view.written_layers(s, &(0..layers));
                    match state {
                        _ if state.is_free() => 'F',
                        PageState::Receiving if n > 0 => '~',
                        _ if n == layers => 'W',
                        _ if n > 0 => 'w',
                        _ => '.',
                    }
                })
                .collect();
            PageReport {
                pool: shadow.id,
                node: shadow.geometry.node.clone(),
                role: shadow.geometry.role,
                page: page.page,
                tag: page.generation,
                generation: word.generation(),
                state: state.name(),
                owner,
                owner_state: owner
                    .and_then(|o| self.lifecycle.state_at(o.request, shadow.id))
                    .map(RequestState::name),
                owner_released: word.has(FLAG_OWNER_RELEASED),
                sharers: shadow.sharers_of(page.page),
                page_slots: shadow.geometry.page_slots,
                layers,
                slot_map,
                faulting_slot: f.slot,
            }
        });
        if page_report.is_none() {
            summary.push_str(&format!(" {}", f.action));
        }
        Report {
            id,
            kind: f.kind,
            summary,
            accessor: f.accessor,
            accessor_state,
            action: f.action.clone(),
            step: f.step,
            detail: f.detail.clone(),
            page: page_report,
            history,
        }
    }
}

/// `word` with its indefinite article: "an aborted", "a rejected".
fn with_article(word: &str) -> String {
    let article = if word.starts_with(['a', 'e', 'i', 'o', 'u']) {
        "an"
    } else {
        "a"
    };
    format!("{article} {word}")
}
