//! The C hook table: how a release engine finds a sanitizer it was not built
//! with (the NVTX injection pattern). A library loaded with `LD_PRELOAD`
//! exports a getter named [`HOOK_TABLE_SYMBOL`]; at start-up the engine looks
//! it up with `dlsym(RTLD_DEFAULT, …)`, calls it once, validates the table it
//! returns and, if the table is sound, sends every hook through it. Without
//! the library the lookup returns null and nothing is attached.
//!
//! The table's layout, the `#[repr(C)]` types and the constants are the
//! sanitizer's C ABI, [`kvsan_sanitizer::abi`] (re-exported here); its hooks
//! are those of the list, [`kvsan_sanitizer::for_each_hook!`], in order:
//!
//! ```text
//!  const KvsanHookTable *kvsan_hook_table_v1(void);   // the exported getter
//!  KvsanHookTable { u32 size; u16 version_major, version_minor; u32 flags,
//!                   quarantine_pages; void *ctx; 14 hooks … }  (136 bytes, v1.2;
//!                                                               120 bytes, v1.1;
//!                                                               96 bytes, v1.0)
//!  every hook returns KvsanVerdict { u32 code; u32 kind; u64 violation_id }
//! ```
//!
//! Rules of the table:
//!
//! - `size` comes first so the engine can read it before trusting anything
//!   else. A table smaller than a version 1.0 table, a null table, a null
//!   hook, or another major version is not attached: the engine says so
//!   loudly (stderr and the log) and runs without hooks — never a crash.
//!   A larger table (a newer minor version) is attached; the engine uses the
//!   fields it knows: the hooks of the newest minor version that both the
//!   table's version and its size cover ([`hook_table_size`]); every one of
//!   those must be non-null.
//! - A version 1.0 table has no `kernel_shadow`/`kernel_refusal`/
//!   `request_event_at`: it is attached, and the engine says loudly that its
//!   KV stores and attention reads go unchecked (the engine's kernels check
//!   against a kernel shadow, not through `read`/`write` calls, which it
//!   never makes); lifecycle events go to `request_event`, the process's view.
//! - A table older than version 1.2 has no `share`/`declare_salt`: it is
//!   attached, the engine says loudly that prefix-cache shares go
//!   unchecked, and [`KvHooks::share`] and [`KvHooks::declare_salt`]
//!   continue without a call.
//! - Hooks may be called from several threads at once, for the rest of the
//!   process; the table, `ctx` and the functions must stay valid that long.
//! - `pool_register` returns code 0 and writes the pool id, or refuses the
//!   pool with any other code (its pages then go unchecked).
//! - Code 2 (error) means the library could not check the call (an unknown
//!   pool, a page out of range): the engine logs and counts it and the request
//!   goes on, as with the in-process sanitizer.
//! - **Unknown verdicts fail closed.** Code 1 with a `kind` this engine does
//!   not know (a newer library), or a code other than 0, 1, 2, still aborts
//!   the request: the library found something and continuing could let a leak
//!   through. The violation id is kept (the library's report has the real
//!   kind); the kind the engine shows is the one the hook's own check is
//!   named after ([`Hook::main_violation`]: `stale-read` for `read`,
//!   `write-after-free` for `transfer_recv`, …), and the raw index is logged.
//!
//! Besides the table, a library may export two counters, looked up the same
//! way and used when both are there ([`KvHooks::counters`], an operator's
//! metrics): `int32_t kvsan_violation_count_of(uint32_t kind, uint64_t *out)`
//! and `int32_t kvsan_check_count(uint64_t *out)` (0 on success).

use std::ffi::CStr;
use std::sync::atomic::{AtomicU64, Ordering};

pub use kvsan_sanitizer::Hook;
use kvsan_sanitizer::{
    KernelAccess, Landing, Manifest, Owner, PageLanding, PageRef, PoolGeometry, PoolId,
    RequestEvent, TierBlockId, Verdict, ViolationId, ViolationKind,
};

use super::{HookSettings, KvHooks, SanitizerCounters};
use crate::EngineError;

// The C ABI types and constants live with the sanitizer (the ABI is the
// sanitizer's; a library implementing it needs no engine). Re-exported here
// so engine code speaks of `hooks::ctable::KvsanHookTable` and friends.
pub use kvsan_sanitizer::abi::*;

/// [`KvHooks`] through a validated C hook table.
#[derive(Debug)]
pub struct CTableHooks {
    table: KvsanHookTable,
    /// The minor version the library declared.
    minor: u16,
    errors: AtomicU64,
    /// The library's counters, when it exports them.
    counts: Option<CountFns>,
}

/// `kvsan_violation_count_of(kind, out)`.
type ViolationCountOfFn = unsafe extern "C" fn(u32, *mut u64) -> i32;
/// `kvsan_check_count(out)`.
type CheckCountFn = unsafe extern "C" fn(*mut u64) -> i32;

/// The counter functions a library exports next to its table.
#[derive(Clone, Copy, Debug)]
struct CountFns {
    violations_of: ViolationCountOfFn,
    checks: CheckCountFn,
}

impl CountFns {
    /// Both functions, looked up with `dlsym(RTLD_DEFAULT, …)`, or `None`.
    fn find() -> Option<CountFns> {
        let look = |name: &CStr| {
            // SAFETY: RTLD_DEFAULT is a valid pseudo-handle and `name` is
            // NUL-terminated.
            let address = unsafe { libc::dlsym(libc::RTLD_DEFAULT, name.as_ptr()) };
            (!address.is_null()).then_some(address)
        };
        let violations_of = look(c"kvsan_violation_count_of")?;
        let checks = look(c"kvsan_check_count")?;
        // SAFETY: a library exporting these names promises (module
        // documentation) these signatures; a function pointer and a data
        // pointer have one size on the platforms dlsym serves.
        unsafe {
            Some(CountFns {
                violations_of: std::mem::transmute::<*mut libc::c_void, ViolationCountOfFn>(
                    violations_of,
                ),
                checks: std::mem::transmute::<*mut libc::c_void, CheckCountFn>(checks),
            })
        }
    }

    fn read(self) -> Option<SanitizerCounters> {
        let mut checks = 0u64;
        // SAFETY: the library's function, given a writable u64.
        if unsafe { (self.checks)(&raw mut checks) } != 0 {
            return None;
        }
        let violations = ViolationKind::ALL
            .iter()
            .map(|k| {
                let mut n = 0u64;
                // SAFETY: as above; `k.code()` is a kind this engine knows.
                (unsafe { (self.violations_of)(k.code(), &raw mut n) } == 0).then_some(n)
            })
            .collect::<Option<Vec<u64>>>()?;
        Some(SanitizerCounters { violations, checks })
    }
}

// SAFETY: the table's contract (module documentation) is that its hooks may
// be called from any thread, concurrently, with its `ctx`, for the rest of
// the process; the engine only copies the table and calls through it.
unsafe impl Send for CTableHooks {}
// SAFETY: as for `Send`: every hook is `&self` and the contract makes
// concurrent calls through the shared `ctx` sound.
unsafe impl Sync for CTableHooks {}

/// Errors logged in full before the adapter only counts them.
const LOGGED_ERRORS: u64 = 16;

fn rejected(what: String) -> EngineError {
    EngineError::HookTable { what }
}

impl CTableHooks {
    /// Looks up `symbol` with `dlsym(RTLD_DEFAULT, …)`, calls it as a
    /// [`HookTableGetter`] and validates the table. `None` when the symbol is
    /// absent (no library: nothing to attach), or when the table is rejected
    /// — then a line naming what was wrong goes to stderr and the log.
    #[must_use]
    pub fn from_symbol(symbol: &CStr) -> Option<CTableHooks> {
        // SAFETY: RTLD_DEFAULT is a valid pseudo-handle and `symbol` is a
        // NUL-terminated string that outlives the call.
        let address = unsafe { libc::dlsym(libc::RTLD_DEFAULT, symbol.as_ptr()) };
        if address.is_null() {
            tracing::debug!(symbol = ?symbol, "kvsan: no hook table exported");
            return None;
        }
        // SAFETY: a library exporting this name promises (module
        // documentation) that it is a `HookTableGetter`; a function pointer
        // and a data pointer have one size on the platforms dlsym serves.
        let getter: HookTableGetter = unsafe { std::mem::transmute(address) };
        // SAFETY: the getter takes no arguments and returns a table pointer
        // valid for the rest of the process (or null), per the contract.
        let table = unsafe { getter() };
        // SAFETY: the pointer comes from the library's getter, which promises
        // a table of at least its declared `size` bytes, or null.
        match unsafe { CTableHooks::from_raw(table) } {
            Ok(hooks) => Some(CTableHooks {
                counts: CountFns::find(),
                ..hooks
            }),
            Err(e) => {
                eprintln!(
                    "kvsan: hook table `{}` not attached: {e}",
                    symbol.to_string_lossy()
                );
                tracing::error!(symbol = ?symbol, "kvsan: hook table not attached: {e}");
                None
            }
        }
    }

    /// Validates the table at `table` and copies the part this engine knows.
    ///
    /// # Errors
    /// [`EngineError::HookTable`] naming what is wrong: a null pointer, a
    /// `size` smaller than this engine's table, a major version other than
    /// [`HOOK_TABLE_VERSION_MAJOR`], a null hook.
    ///
    /// # Safety
    /// - `table` is null, or points to readable memory of at least 4 bytes
    ///   holding the table's `size`, and of at least `size` bytes in all;
    /// - if the table passes validation, its hooks may be called with its
    ///   `ctx` from any thread, concurrently, for the rest of the process.
    pub unsafe fn from_raw(table: *const KvsanHookTable) -> Result<CTableHooks, EngineError> {
        if table.is_null() {
            return Err(rejected("the table pointer is null".into()));
        }
        // SAFETY: non-null, and the caller guarantees the first 4 bytes are
        // readable; read unaligned since nothing is trusted yet.
        let size = unsafe { table.cast::<u32>().read_unaligned() } as usize;
        let need = HOOK_TABLE_V1_0_SIZE;
        if size < need {
            return Err(rejected(format!(
                "its size is {size} bytes; a version {HOOK_TABLE_VERSION_MAJOR}.0 table needs at least {need}"
            )));
        }
        // SAFETY: `size` ≥ a 1.0 table's bytes are readable, and the
        // versions follow `size` in every version's header.
        let (major, minor) = unsafe {
            (
                table
                    .byte_add(std::mem::offset_of!(KvsanHookTable, version_major))
                    .cast::<u16>()
                    .read_unaligned(),
                table
                    .byte_add(std::mem::offset_of!(KvsanHookTable, version_minor))
                    .cast::<u16>()
                    .read_unaligned(),
            )
        };
        if major != HOOK_TABLE_VERSION_MAJOR {
            return Err(rejected(format!(
                "its version is {major}.{minor}; this engine speaks major version {HOOK_TABLE_VERSION_MAJOR}"
            )));
        }
        // The hooks this engine knows of the newest minor version that both
        // the table's version and its size cover; later ones stay null.
        let known = (0..=minor.min(HOOK_TABLE_VERSION_MINOR))
            .rev()
            .find(|&m| hook_table_size(m) <= size)
            .unwrap_or(0);
        let mut copy = std::mem::MaybeUninit::<KvsanHookTable>::zeroed();
        // SAFETY: `hook_table_size(known)` ≤ `size` bytes are readable at
        // `table`, and fit in `copy`; every field of the table is valid as
        // all-zero bytes (integers, a null pointer, `None`), so a copy of a
        // prefix of it is a valid table.
        let copy = unsafe {
            std::ptr::copy_nonoverlapping(
                table.cast::<u8>(),
                copy.as_mut_ptr().cast::<u8>(),
                hook_table_size(known),
            );
            copy.assume_init()
        };
        for &hook in Hook::ALL {
            if hook.table_minor().is_some_and(|since| since <= known) && !copy.is_set(hook) {
                return Err(rejected(format!("its `{}` hook is null", hook.name())));
            }
        }
        if !copy.is_set(Hook::KernelShadow) {
            eprintln!(
                "kvsan: hook table version {}.{} has no kernel shadow: KV stores and attention reads go UNCHECKED",
                copy.version_major, copy.version_minor
            );
            tracing::error!(
                minor = copy.version_minor,
                "kvsan: the hook table has no kernel shadow; KV stores and attention reads go unchecked"
            );
        }
        if !copy.is_set(Hook::Share) {
            eprintln!(
                "kvsan: hook table version {}.{} has no share hook: prefix-cache shares go UNCHECKED",
                copy.version_major, copy.version_minor
            );
            tracing::error!(
                minor = copy.version_minor,
                "kvsan: the hook table has no share hook; prefix-cache shares go unchecked"
            );
        }
        Ok(CTableHooks {
            minor: copy.version_minor,
            table: copy,
            errors: AtomicU64::new(0),
            counts: None,
        })
    }

    /// The library's declared version `(major, minor)`.
    #[must_use]
    pub fn version(&self) -> (u16, u16) {
        (self.table.version_major, self.minor)
    }

    /// Calls the library reported as errors (code 2) since start.
    #[must_use]
    pub fn errors(&self) -> u64 {
        self.errors.load(Ordering::Relaxed)
    }

    /// The engine's verdict for the library's `v` from `hook`.
    #[inline]
    fn verdict(&self, hook: Hook, v: KvsanVerdict) -> Verdict {
        match v.code {
            KVSAN_VERDICT_CONTINUE => Verdict::Continue,
            KVSAN_VERDICT_ABORT => match ViolationKind::from_code(v.kind) {
                Some(kind) => Verdict::Abort {
                    violation: ViolationId(v.violation_id),
                    kind,
                },
                None => self.unknown(hook, v),
            },
            KVSAN_VERDICT_ERROR => {
                let n = self.errors.fetch_add(1, Ordering::Relaxed);
                if n < LOGGED_ERRORS {
                    tracing::error!(
                        hook = hook.name(),
                        "kvsan: the hook table could not check a call"
                    );
                }
                Verdict::Continue
            }
            _ => self.unknown(hook, v),
        }
    }

    #[cold]
    #[inline(never)]
    fn unknown(&self, hook: Hook, v: KvsanVerdict) -> Verdict {
        let kind = hook.main_violation();
        tracing::error!(
            hook = hook.name(),
            code = v.code,
            kind_index = v.kind,
            violation = v.violation_id,
            shown_as = kind.name(),
            "kvsan: the hook table returned a verdict this engine does not know; aborting the request"
        );
        Verdict::Abort {
            violation: ViolationId(v.violation_id),
            kind,
        }
    }
}

/// The hook of a validated table (validation rejected every null one).
macro_rules! hook {
    ($self:ident . $name:ident) => {
        match $self.table.$name {
            Some(f) => f,
            None => unreachable!(concat!(
                "validated table has a null `",
                stringify!($name),
                "`"
            )),
        }
    };
}

impl CTableHooks {
    /// `tier_store`, `tier_load` or `tier_verify` (`f`, `hook`): a page and
    /// a tier block, then the step or the digest (`last`). A library older
    /// than 1.6 has no tier hooks: the call continues unchecked.
    #[allow(clippy::too_many_arguments)]
    fn tier_page(
        &self,
        f: Option<TierPageFn>,
        hook: Hook,
        pool: PoolId,
        owner: Owner,
        page: PageRef,
        block: TierBlockId,
        last: u64,
    ) -> Verdict {
        let Some(f) = f else {
            return Verdict::Continue;
        };
        // SAFETY: validated table (a 1.6 table's hook); every argument is
        // passed by value.
        let v = unsafe {
            f(
                self.table.ctx,
                pool.0,
                owner.into(),
                page.into(),
                block.tier,
                block.block,
                last,
            )
        };
        self.verdict(hook, v)
    }
}

impl KvHooks for CTableHooks {
    fn pool_register(&self, geometry: &PoolGeometry) -> Option<PoolId> {
        // A library older than 1.5 has no landing hooks: this engine then
        // cannot report where received KV lands, and says so in the pool's
        // registration (the library takes the manifest as written).
        let landing = if self.table.transfer_land.is_some() && self.table.transfer_verify.is_some()
        {
            Landing::Reported
        } else {
            Landing::Manifest
        };
        let g = KvsanPoolGeometry::borrow(geometry, landing);
        let mut id = u32::MAX;
        // SAFETY: the table was validated; `g` and its node name outlive the
        // call; `id` is a writable u32.
        let v = unsafe { hook!(self.pool_register)(self.table.ctx, &g, &mut id) };
        (v.code == KVSAN_VERDICT_CONTINUE).then_some(PoolId(id))
    }

    fn request_event(&self, pool: PoolId, owner: Owner, event: RequestEvent) -> Verdict {
        match self.table.request_event_at {
            Some(f) => {
                // SAFETY: validated table (a 1.1 table's hook); arguments by value.
                let v = unsafe { f(self.table.ctx, pool.0, owner.into(), event_code(event)) };
                self.verdict(Hook::RequestEventAt, v)
            }
            // A 1.0 library knows only the process's view.
            None => {
                // SAFETY: validated table; arguments by value.
                let v = unsafe {
                    hook!(self.request_event)(self.table.ctx, owner.into(), event_code(event))
                };
                self.verdict(Hook::RequestEvent, v)
            }
        }
    }

    fn alloc(&self, pool: PoolId, owner: Owner, page: PageRef, step: u64) -> Verdict {
        // SAFETY: validated table; arguments by value.
        let v =
            unsafe { hook!(self.alloc)(self.table.ctx, pool.0, owner.into(), page.into(), step) };
        self.verdict(Hook::Alloc, v)
    }

    fn free(&self, pool: PoolId, owner: Owner, page: PageRef, step: u64) -> Verdict {
        // SAFETY: validated table; arguments by value.
        let v =
            unsafe { hook!(self.free)(self.table.ctx, pool.0, owner.into(), page.into(), step) };
        self.verdict(Hook::Free, v)
    }

    fn share(&self, pool: PoolId, page: PageRef, sharer: Owner) -> Verdict {
        // A library older than 1.2 cannot check shares (said at attach).
        let Some(f) = self.table.share else {
            return Verdict::Continue;
        };
        // SAFETY: validated table (a 1.2 table's hook); arguments by value.
        let v = unsafe { f(self.table.ctx, pool.0, page.into(), sharer.into()) };
        self.verdict(Hook::Share, v)
    }

    fn declare_salt(&self, owner: Owner, salt: u64) -> Verdict {
        let Some(f) = self.table.declare_salt else {
            return Verdict::Continue;
        };
        // SAFETY: validated table (a 1.2 table's hook); arguments by value.
        let v = unsafe { f(self.table.ctx, owner.into(), salt) };
        self.verdict(Hook::DeclareSalt, v)
    }

    fn kernel_shadow(&self, pool: PoolId) -> Option<KernelShadowHandle> {
        let f = self.table.kernel_shadow?;
        let mut raw = std::mem::MaybeUninit::<KvsanKernelShadow>::zeroed();
        // SAFETY: validated table (a non-null kernel_shadow hook of a 1.1
        // table); `raw` is writable for a whole description.
        let v = unsafe { f(self.table.ctx, pool.0, raw.as_mut_ptr()) };
        if v.code != KVSAN_VERDICT_CONTINUE {
            let _ = self.verdict(Hook::KernelShadow, v);
            return None;
        }
        // SAFETY: all-zero is a valid description, and the hook filled it.
        let raw = unsafe { raw.assume_init() };
        // SAFETY: the library's sanitizer lives for the rest of the process
        // (the table's contract), and with it the memory `raw` describes.
        match unsafe { KernelShadowHandle::new(raw, None) } {
            Ok(handle) => Some(handle),
            Err(e) => {
                tracing::error!(
                    "kvsan: the library's kernel shadow is refused: {e}; KV accesses go unchecked"
                );
                None
            }
        }
    }

    fn kernel_refusal(
        &self,
        pool: PoolId,
        owner: Owner,
        access: &KernelAccess,
        step: u64,
    ) -> Verdict {
        let Some(f) = self.table.kernel_refusal else {
            return Verdict::Continue;
        };
        let a = KvsanKernelAccess::borrow(access);
        // SAFETY: validated table; `a` is alive for the call.
        let v = unsafe { f(self.table.ctx, pool.0, owner.into(), &a, step) };
        self.verdict(Hook::KernelRefusal, v)
    }

    fn transfer_send(&self, pool: PoolId, manifest: &Manifest) -> Verdict {
        let m = KvsanManifest::borrow(manifest);
        // SAFETY: validated table; `m` borrows `manifest`'s tables, alive
        // for the call.
        let v = unsafe { hook!(self.transfer_send)(self.table.ctx, pool.0, &m) };
        self.verdict(Hook::TransferSend, v)
    }

    fn transfer_recv(&self, pool: PoolId, manifest: &Manifest) -> Verdict {
        let m = KvsanManifest::borrow(manifest);
        // SAFETY: as in `transfer_send`.
        let v = unsafe { hook!(self.transfer_recv)(self.table.ctx, pool.0, &m) };
        self.verdict(Hook::TransferRecv, v)
    }

    fn transfer_land(&self, pool: PoolId, landing: &PageLanding) -> Verdict {
        let Some(f) = self.table.transfer_land else {
            // A library older than 1.5: the pool was registered as one whose
            // engine reports no landing.
            return Verdict::Continue;
        };
        let l = KvsanPageLanding::borrow(landing);
        // SAFETY: validated table (a 1.5 table's hook); `l` is alive for the call.
        let v = unsafe { f(self.table.ctx, pool.0, &l) };
        self.verdict(Hook::TransferLand, v)
    }

    fn transfer_verify(&self, pool: PoolId, landing: &PageLanding) -> Verdict {
        let Some(f) = self.table.transfer_verify else {
            return Verdict::Continue;
        };
        let l = KvsanPageLanding::borrow(landing);
        // SAFETY: as in `transfer_land`.
        let v = unsafe { f(self.table.ctx, pool.0, &l) };
        self.verdict(Hook::TransferVerify, v)
    }

    // A library older than 1.6 has no tier hooks: an engine's tiers then
    // go unchecked, and every tier call continues.

    fn tier_store(
        &self,
        pool: PoolId,
        owner: Owner,
        page: PageRef,
        block: TierBlockId,
        step: u64,
    ) -> Verdict {
        let f = self.table.tier_store;
        self.tier_page(f, Hook::TierStore, pool, owner, page, block, step)
    }

    fn tier_store_done(&self, block: TierBlockId, digest: u64, stored: bool) -> Verdict {
        let Some(f) = self.table.tier_store_done else {
            return Verdict::Continue;
        };
        // SAFETY: as in `tier_page`.
        let v = unsafe {
            f(
                self.table.ctx,
                block.tier,
                block.block,
                digest,
                u32::from(stored),
            )
        };
        self.verdict(Hook::TierStoreDone, v)
    }

    fn tier_load(
        &self,
        pool: PoolId,
        owner: Owner,
        page: PageRef,
        block: TierBlockId,
        step: u64,
    ) -> Verdict {
        let f = self.table.tier_load;
        self.tier_page(f, Hook::TierLoad, pool, owner, page, block, step)
    }

    fn tier_verify(
        &self,
        pool: PoolId,
        owner: Owner,
        page: PageRef,
        block: TierBlockId,
        digest: u64,
    ) -> Verdict {
        let f = self.table.tier_verify;
        self.tier_page(f, Hook::TierVerify, pool, owner, page, block, digest)
    }

    fn tier_release(&self, block: TierBlockId) -> Verdict {
        let Some(f) = self.table.tier_release else {
            return Verdict::Continue;
        };
        // SAFETY: as in `tier_page`.
        let v = unsafe { f(self.table.ctx, block.tier, block.block) };
        self.verdict(Hook::TierRelease, v)
    }

    fn transfer_commit(
        &self,
        pool: PoolId,
        owner: Owner,
        table: &[PageRef],
        committed_tokens: usize,
    ) -> Verdict {
        // SAFETY: validated table; `table` as in `read`.
        let v = unsafe {
            hook!(self.transfer_commit)(
                self.table.ctx,
                pool.0,
                owner.into(),
                table.as_ptr().cast(),
                table.len(),
                committed_tokens as u64,
            )
        };
        self.verdict(Hook::TransferCommit, v)
    }

    fn settings(&self) -> HookSettings {
        HookSettings {
            poison: self.table.flags & KVSAN_FLAG_POISON != 0,
            quarantine_pages: self.table.quarantine_pages,
        }
    }

    fn counters(&self) -> Option<SanitizerCounters> {
        self.counts?.read()
    }
}
