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
//! | a request's cache salt, before it allocates | `declare_salt` |
//! | the prefix cache registers a full page (holder `RequestId::PREFIX_CACHE`), or hands one to a request | `share` |
//! | page returned, or evicted from the prefix cache | `free`   |
//!
//! KV stores and attention reads are not reported as hook calls: the
//! kernels check each page they touch, with the arguments they were given,
//! against the target's kernel shadow ([`kvsan_sanitizer::kernel_shadow`])
//! in place, and only an access that does not pass leaves the kernel for
//! the target ([`KvHooks::kernel_refusal`]). See [`crate::kv_access`].
//!
//! The hooks are those of the one list, [`kvsan_sanitizer::for_each_hook!`]:
//! the [`KvHooks`] trait (one method a hook that has an engine method) and
//! the [`Hooks`] method of each hook that answers a verdict are generated
//! from it. Written by hand: the two [`Hooks`] methods that answer
//! something else (`pool_register`, `kernel_shadow`; the list checks they
//! are there) and the targets' methods ([`SanitizerHooks`],
//! [`CTableHooks`]), which the trait makes the compiler ask for, hook by
//! hook.
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

pub use kvsan_sanitizer::{
    KernelAccess, KernelShadowHandle, Manifest, NodeRole, PageLanding, PoolGeometry, RequestEvent,
    TierBlockId, Verdict,
};
use kvsan_sanitizer::{Owner, PageRef, PoolId};

pub use ctable::CTableHooks;
pub use sanitizer::SanitizerHooks;

use crate::EngineError;

/// The pool id hooks see for a pool the target refused to register: no
/// target knows it, so every later hook on that pool is an error the target
/// reports, never a check against another pool's shadow.
pub const UNREGISTERED_POOL: PoolId = PoolId(u32::MAX);

macro_rules! define_kv_hooks {
    ($(
        $(#[$doc:meta])*
        ($(#[$attr:meta])* fn $method:ident($($arg:ident: $ty:ty),*) -> $($answer:tt)+);
    )*) => {
        /// A hook target: something that checks the engine's KV page events.
        ///
        /// One method a hook of the list with an engine method
        /// ([`kvsan_sanitizer::for_each_hook!`]), and two settings. Every
        /// method may be called from several threads at once. A
        /// [`Verdict::Abort`] tells the engine to abort the request the
        /// event concerns (and only that request).
        pub trait KvHooks: Send + Sync {
            $(
                $(#[$doc])*
                fn $method(&self, $($arg: $ty),*) -> $($answer)+;
            )*

            /// What the target asks of the engine's pools (read once at attach time).
            fn settings(&self) -> HookSettings {
                HookSettings::default()
            }

            /// Writes the target's end-of-run summary (`kvsan: N violations`), if it
            /// keeps one.
            fn print_summary(&self) {}

            /// The target's counts so far (violations by kind, checks), if it
            /// keeps them: what an operator's metrics show.
            fn counters(&self) -> Option<SanitizerCounters> {
                None
            }
        }

        $(dispatch! { [$(#[$attr])*] $method($($arg: $ty),*) -> $($answer)+ })*
    };
}

/// The [`Hooks`] method of one hook: for a verdict, one predictable branch
/// on the target; for another answer (a pool's id, its kernel shadow), a
/// method written out below, which this checks is there.
macro_rules! dispatch {
    ([$(#[$attr:meta])+] $method:ident($($arg:ident: $ty:ty),*) -> Verdict) => {
        impl Hooks {
            #[doc = concat!("See [`KvHooks::", stringify!($method), "`]; continues without a target.")]
            $(#[$attr])+
            pub fn $method(&self, $($arg: $ty),*) -> Verdict {
                match &self.target {
                    None => Verdict::Continue,
                    Some(t) => t.$method($($arg),*),
                }
            }
        }
    };
    ([] $method:ident($($arg:ident: $ty:ty),*) -> Verdict) => {
        dispatch! { [#[inline]] $method($($arg: $ty),*) -> Verdict }
    };
    ([$(#[$attr:meta])*] $method:ident($($arg:ident: $ty:ty),*) -> $($answer:tt)+) => {
        const _: () = {
            let _ = Hooks::$method;
        };
    };
}

kvsan_sanitizer::for_each_hook!(engine => define_kv_hooks);

/// A target's counts so far.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct SanitizerCounters {
    /// Violations of each kind, indexed by [`kvsan_sanitizer::ViolationKind::index`].
    pub violations: Vec<u64>,
    /// Checks performed (pages read-checked, writes and stores, transfers,
    /// allocations, frees: [`kvsan_sanitizer::Checks::total`]).
    pub checks: u64,
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
        Hooks::from_environment_with("")
    }

    /// [`Hooks::from_environment`], with `defaults` (`key=value:…`, as in
    /// `KVSAN_OPTIONS`) under `KVSAN_OPTIONS` for an in-process sanitizer:
    /// what the engine's own settings imply (its prefix-cache policy as
    /// `prefix_share`), which the operator's options still override. The
    /// first call's choice is the process's.
    ///
    /// # Errors
    /// As [`Hooks::from_environment`]; a bad default is named like a bad
    /// option.
    pub fn from_environment_with(defaults: &str) -> Result<Hooks, EngineError> {
        if let Some(chosen) = CHOSEN.get() {
            return Ok(chosen.clone());
        }
        let hooks = Hooks::choose(defaults)?;
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
    fn choose(defaults: &str) -> Result<Hooks, EngineError> {
        use kvsan_sanitizer::options::{OPTIONS_ENV, Options};
        let env = std::env::var(OPTIONS_ENV).unwrap_or_default();
        // Later items win: the environment's over the defaults.
        let sanitizer = Options::parse(&format!("{defaults}:{env}"))
            .and_then(kvsan_sanitizer::self_test::start)
            .map_err(|source| EngineError::Sanitizer { source })?;
        Ok(Hooks::sanitizer(Arc::new(sanitizer)))
    }

    #[cfg(not(feature = "sanitize"))]
    #[allow(clippy::unnecessary_wraps)]
    fn choose(_defaults: &str) -> Result<Hooks, EngineError> {
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

    /// See [`KvHooks::counters`]; `None` without a target.
    #[must_use]
    pub fn counters(&self) -> Option<SanitizerCounters> {
        self.target.as_ref()?.counters()
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

    /// See [`KvHooks::kernel_shadow`]; `None` without a target.
    #[must_use]
    pub fn kernel_shadow(&self, pool: PoolId) -> Option<KernelShadowHandle> {
        self.target.as_ref()?.kernel_shadow(pool)
    }
}
