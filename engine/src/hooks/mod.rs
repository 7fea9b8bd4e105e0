//! The one dispatch point between the engine and a sanitizer.
//!
//! The engine calls a hook at every KV page event (DESIGN.md's table):
//!
//! | moment                                   | hook              |
//! | ---------------------------------------- | ----------------- |
//! | pool created                             | `pool_register`, then `kernel_shadow` |
//! | request queued/admitted/…/finished       | `request_event`   |
//! | page taken from the free list            | `alloc`           |
//! | the store kernel writes a token's KV     | in-kernel check against the kernel shadow |
//! | the attention kernel reads a page        | in-kernel check against the kernel shadow |
//! | a kernel access that check did not pass  | `kernel_refusal` (cold: report, verdict) |
//! | prefill ships KV                         | `transfer_send`   |
//! | bytes land on decode                     | `transfer_recv`   |
//! | decode starts using the request's KV     | `transfer_commit` |
//! | page returned                            | `free`            |
//!
//! KV stores and attention reads are not reported as hook calls: the
//! kernels check each page they touch, with the arguments they were given,
//! against the target's kernel shadow ([`kvsan_sanitizer::kernel_shadow`])
//! in place, and only an access that does not pass leaves the kernel for
//! the target ([`KvHooks::kernel_refusal`]). See [`crate::kv_access`].
//!
//! [`Hooks`] holds the target chosen once at start-up
//! ([`Hooks::from_environment`]):
//!
//! ```text
//!  feature `sanitize`  ──▶ in-process kvsan_sanitizer::Sanitizer (KVSAN_OPTIONS)   sanitizer.rs
//!  otherwise           ──▶ dlsym(RTLD_DEFAULT, "kvsan_hook_table_v1") found?      ctable.rs
//!                            yes ──▶ the C hook table (LD_PRELOAD shim)
//!                            no  ──▶ none
//! ```
//!
//! With none (a release build without a sanitizer), every hook is one
//! predictable branch on an `Option` returning [`Verdict::Continue`]; the
//! engine-side settings a target asks for (poison freed pages, quarantine
//! length) are read once when the target is attached, not per hook.

pub mod ctable;
pub mod sanitizer;

use std::sync::{Arc, OnceLock};

use kvsan_sanitizer::abi::KvsanKernelShadow;
pub use kvsan_sanitizer::{KernelAccess, Manifest, NodeRole, PoolGeometry, RequestEvent, Verdict};
use kvsan_sanitizer::{KernelShadow, Owner, PageRef, PoolId};

pub use ctable::CTableHooks;
pub use sanitizer::SanitizerHooks;

use crate::EngineError;

/// The pool id hooks see for a pool the target refused to register: no
/// target knows it, so every later hook on that pool is an error the target
/// reports, never a check against another pool's shadow.
pub const UNREGISTERED_POOL: PoolId = PoolId(u32::MAX);

/// A hook target: something that checks the engine's KV page events.
///
/// Every method may be called from several threads at once. A
/// [`Verdict::Abort`] tells the engine to abort the request the event
/// concerns (and only that request).
pub trait KvHooks: Send + Sync {
    /// A pool was created; returns the id the target knows it by, or `None`
    /// if the target refused it (it says why in its own log).
    fn pool_register(&self, geometry: &PoolGeometry) -> Option<PoolId>;
    /// A request entered `event`'s state, as the node that owns `pool`
    /// sees it (each node of a disaggregated deployment has its own view:
    /// `kvsan_sanitizer::Scope`).
    fn request_event(&self, pool: PoolId, owner: Owner, event: RequestEvent) -> Verdict;
    /// `page` (at its new generation) was taken from the free list for `owner`.
    fn alloc(&self, pool: PoolId, owner: Owner, page: PageRef, step: u64) -> Verdict;
    /// `owner` returns `page` to the pool.
    fn free(&self, pool: PoolId, owner: Owner, page: PageRef, step: u64) -> Verdict;
    /// The kernel shadow of `pool`, which the engine's kernels check every
    /// KV store and attention read against in place; `None` if the target
    /// has none (KV accesses then go unchecked by it).
    fn kernel_shadow(&self, pool: PoolId) -> Option<KernelShadowHandle>;
    /// The cold path of a kernel access the in-place check did not pass:
    /// the access as the kernel was about to make it, by the batch row of
    /// `owner`, at `step`. The target checks it against its whole state
    /// (sharers included), reports a violation and returns the verdict;
    /// [`Verdict::Continue`] lets the kernel go on (a legal shared read, or
    /// `on_violation=report`).
    fn kernel_refusal(
        &self,
        pool: PoolId,
        owner: Owner,
        access: &KernelAccess,
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

    /// What the target asks of the engine's pools (read once at attach time).
    fn settings(&self) -> HookSettings {
        HookSettings::default()
    }

    /// Writes the target's end-of-run summary (`kvsan: N violations`), if it
    /// keeps one.
    fn print_summary(&self) {}
}

/// A target's kernel shadow of one pool, kept alive with its target.
///
/// It describes memory the target owns (records, written bits, counters):
/// the target's sanitizer keeps it for its whole life, and `keep` holds
/// that sanitizer (or nothing, for a preloaded library whose sanitizer
/// lives as long as the process).
pub struct KernelShadowHandle {
    raw: KvsanKernelShadow,
    _keep: Option<Arc<dyn std::any::Any + Send + Sync>>,
}

// SAFETY: the raw pointers address atomics (records, bits, counters) that
// any thread may access; `keep` is Send + Sync.
unsafe impl Send for KernelShadowHandle {}
// SAFETY: as for `Send`: shared access is only atomic loads and RMWs.
unsafe impl Sync for KernelShadowHandle {}

impl std::fmt::Debug for KernelShadowHandle {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("KernelShadowHandle")
            .field("pages", &self.raw.pages)
            .field("page_slots", &self.raw.page_slots)
            .field("layers", &self.raw.layers)
            .finish_non_exhaustive()
    }
}

impl KernelShadowHandle {
    /// A handle for `raw`, after checking that it describes this build's
    /// layout.
    ///
    /// # Errors
    /// What in `raw` does not match this build's layout.
    ///
    /// # Safety
    /// - `raw` describes a live pool's kernel shadow whose memory stays
    ///   allocated while `keep` is held (or for the rest of the process).
    pub unsafe fn new(
        raw: KvsanKernelShadow,
        keep: Option<Arc<dyn std::any::Any + Send + Sync>>,
    ) -> Result<KernelShadowHandle, &'static str> {
        // SAFETY: the caller's contract; checked here once.
        unsafe { KernelShadow::from_raw(&raw) }?;
        Ok(KernelShadowHandle { raw, _keep: keep })
    }

    /// The kernels' view.
    #[must_use]
    pub fn view(&self) -> KernelShadow<'_> {
        // SAFETY: `new` checked the description; the memory lives while
        // `self` (and so `keep`) does.
        unsafe { KernelShadow::from_raw(&self.raw) }
            .expect("a checked kernel-shadow description stays valid")
    }

    /// Pages, slots per page and layers the shadow covers.
    #[must_use]
    pub fn geometry(&self) -> (u32, u32, u32) {
        (self.raw.pages, self.raw.page_slots, self.raw.layers)
    }
}

/// What a target asks the engine to do with freed pages — the checks only
/// the engine can add, because only it touches KV bytes.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct HookSettings {
    /// Fill freed pages with the poison NaN pattern
    /// ([`crate::kv_pool::POISON_F16_BITS`]).
    pub poison: bool,
    /// Freed pages held back (FIFO) before the free list hands them out
    /// again; see [`crate::kv_pool::KvPool::set_quarantine`].
    pub quarantine_pages: u32,
}

/// Which target [`Hooks`] dispatches to.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
#[non_exhaustive]
pub enum HookTarget {
    /// No sanitizer: every hook continues.
    None,
    /// The in-process sanitizer (debug-build mode, feature `sanitize`).
    InProcess,
    /// A C hook table found at start-up (the LD_PRELOAD shim).
    CTable,
    /// Another Rust implementation of [`KvHooks`] (tests, embedders).
    Custom,
}

impl HookTarget {
    /// Lower-case name for logs.
    #[must_use]
    pub const fn name(self) -> &'static str {
        match self {
            HookTarget::None => "none",
            HookTarget::InProcess => "in-process sanitizer",
            HookTarget::CTable => "C hook table",
            HookTarget::Custom => "custom",
        }
    }
}

/// The hook target chosen at start-up, or none.
#[derive(Clone)]
pub struct Hooks {
    target: Option<Arc<dyn KvHooks>>,
    kind: HookTarget,
    settings: HookSettings,
}

impl Default for Hooks {
    fn default() -> Self {
        Hooks::none()
    }
}

impl std::fmt::Debug for Hooks {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "Hooks({}, {:?})", self.kind.name(), self.settings)
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

/// The process's choice, made by the first successful
/// [`Hooks::from_environment`].
static CHOSEN: OnceLock<Hooks> = OnceLock::new();

impl Hooks {
    /// No target: every hook continues.
    #[must_use]
    pub fn none() -> Hooks {
        Hooks {
            target: None,
            kind: HookTarget::None,
            settings: HookSettings::default(),
        }
    }

    /// Calls go to `target` (a custom implementation).
    #[must_use]
    pub fn new(target: Arc<dyn KvHooks>) -> Hooks {
        Hooks::with_kind(target, HookTarget::Custom)
    }

    fn with_kind(target: Arc<dyn KvHooks>, kind: HookTarget) -> Hooks {
        let settings = target.settings();
        Hooks {
            target: Some(target),
            kind,
            settings,
        }
    }

    /// Calls go to the in-process `sanitizer`; its `poison` and
    /// `quarantine_pages` options become the engine's pool settings.
    #[must_use]
    pub fn sanitizer(sanitizer: Arc<kvsan_sanitizer::Sanitizer>) -> Hooks {
        Hooks::with_kind(
            Arc::new(SanitizerHooks::new(sanitizer)),
            HookTarget::InProcess,
        )
    }

    /// Calls go through a validated C hook table.
    #[must_use]
    pub fn c_table(table: CTableHooks) -> Hooks {
        Hooks::with_kind(Arc::new(table), HookTarget::CTable)
    }

    /// The target for this process, chosen once (later calls return the
    /// same choice) and logged once:
    ///
    /// - with feature `sanitize`: the in-process sanitizer configured by
    ///   `KVSAN_OPTIONS` (on by default);
    /// - otherwise: the C hook table exported as
    ///   [`ctable::HOOK_TABLE_SYMBOL`] by a preloaded library, if there is
    ///   one and it passes validation; else none.
    ///
    /// # Errors
    /// [`EngineError::Sanitizer`] for a bad `KVSAN_OPTIONS` (naming the key
    /// or item) or a report log file that cannot be opened (feature
    /// `sanitize` only). A failure is not cached: the next call tries again.
    pub fn from_environment() -> Result<Hooks, EngineError> {
        if let Some(chosen) = CHOSEN.get() {
            return Ok(chosen.clone());
        }
        let hooks = Hooks::choose()?;
        let chosen = CHOSEN.get_or_init(|| {
            tracing::info!(
                target = hooks.kind.name(),
                poison = hooks.settings.poison,
                quarantine_pages = hooks.settings.quarantine_pages,
                "kvsan hooks chosen"
            );
            hooks
        });
        Ok(chosen.clone())
    }

    #[cfg(feature = "sanitize")]
    fn choose() -> Result<Hooks, EngineError> {
        let sanitizer = kvsan_sanitizer::Sanitizer::from_env()
            .map_err(|source| EngineError::Sanitizer { source })?;
        Ok(Hooks::sanitizer(Arc::new(sanitizer)))
    }

    #[cfg(not(feature = "sanitize"))]
    #[allow(clippy::unnecessary_wraps)]
    fn choose() -> Result<Hooks, EngineError> {
        Ok(CTableHooks::from_symbol(ctable::HOOK_TABLE_SYMBOL)
            .map_or_else(Hooks::none, Hooks::c_table))
    }

    /// Whether a target is attached.
    #[must_use]
    pub fn is_attached(&self) -> bool {
        self.target.is_some()
    }

    /// Which kind of target is attached.
    #[must_use]
    pub fn target(&self) -> HookTarget {
        self.kind
    }

    /// Whether freed pages are to be poison-filled.
    #[must_use]
    pub fn poison(&self) -> bool {
        self.settings.poison
    }

    /// Freed pages to hold in quarantine before reuse (0: none).
    #[must_use]
    pub fn quarantine_pages(&self) -> u32 {
        self.settings.quarantine_pages
    }

    /// Writes the target's end-of-run summary, if it keeps one.
    pub fn print_summary(&self) {
        if let Some(t) = &self.target {
            t.print_summary();
        }
    }

    /// See [`KvHooks::pool_register`]. Without a target, `fallback` (pool ids
    /// count from 0 in the caller); a target that refuses the pool gives
    /// [`UNREGISTERED_POOL`].
    pub fn pool_register(&self, geometry: &PoolGeometry, fallback: PoolId) -> PoolId {
        match &self.target {
            None => fallback,
            Some(t) => t.pool_register(geometry).unwrap_or_else(|| {
                tracing::error!(
                    node = %geometry.node,
                    target = self.kind.name(),
                    "kvsan: the hook target refused to register the pool; its pages go unchecked"
                );
                UNREGISTERED_POOL
            }),
        }
    }

    /// See [`KvHooks::request_event`].
    #[inline]
    pub fn request_event(&self, pool: PoolId, owner: Owner, event: RequestEvent) -> Verdict {
        dispatch!(self, request_event(pool, owner, event))
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

    /// See [`KvHooks::kernel_shadow`]; `None` without a target.
    #[must_use]
    pub fn kernel_shadow(&self, pool: PoolId) -> Option<KernelShadowHandle> {
        self.target.as_ref()?.kernel_shadow(pool)
    }

    /// See [`KvHooks::kernel_refusal`].
    #[cold]
    pub fn kernel_refusal(
        &self,
        pool: PoolId,
        owner: Owner,
        access: &KernelAccess,
        step: u64,
    ) -> Verdict {
        dispatch!(self, kernel_refusal(pool, owner, access, step))
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
