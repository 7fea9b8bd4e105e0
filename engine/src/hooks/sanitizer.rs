//! The in-process target: [`KvHooks`] over a linked-in
//! [`kvsan_sanitizer::Sanitizer`] (debug-build mode).
//!
//! The sanitizer's hooks return `Result<Verdict, SanitizerError>`: an error is
//! API misuse by the engine (an unknown pool, a page or slot out of range), not
//! a violation by a request. The adapter logs it, counts it in a sticky
//! counter ([`SanitizerHooks::errors`]) and lets the request go on — the
//! engine's own checks (the pool's free-list bookkeeping, the KV kernels' bounds)
//! still stand.

use std::sync::Arc;
use std::sync::atomic::{AtomicU64, Ordering};

use kvsan_sanitizer::{
    KernelAccess, Manifest, Owner, PageLanding, PageRef, PoolGeometry, PoolId, RequestEvent,
    Sanitizer, SanitizerError, TierBlockId, Verdict,
};

use super::{HookSettings, KernelShadowHandle, KvHooks, SanitizerCounters};

/// Errors logged in full before the adapter only counts them.
const LOGGED_ERRORS: u64 = 16;

/// [`KvHooks`] calling a [`Sanitizer`] in this process.
#[derive(Debug)]
pub struct SanitizerHooks {
    sanitizer: Arc<Sanitizer>,
    errors: AtomicU64,
}

impl SanitizerHooks {
    /// Hooks that call `sanitizer`.
    #[must_use]
    pub fn new(sanitizer: Arc<Sanitizer>) -> SanitizerHooks {
        SanitizerHooks {
            sanitizer,
            errors: AtomicU64::new(0),
        }
    }

    /// The sanitizer called.
    #[must_use]
    pub fn sanitizer(&self) -> &Arc<Sanitizer> {
        &self.sanitizer
    }

    /// Hook calls the sanitizer refused as API misuse since start.
    #[must_use]
    pub fn errors(&self) -> u64 {
        self.errors.load(Ordering::Relaxed)
    }

    #[inline]
    fn verdict(&self, hook: &'static str, result: Result<Verdict, SanitizerError>) -> Verdict {
        match result {
            Ok(v) => v,
            Err(e) => self.misuse(hook, &e),
        }
    }

    #[cold]
    #[inline(never)]
    fn misuse(&self, hook: &'static str, error: &dyn std::fmt::Display) -> Verdict {
        let n = self.errors.fetch_add(1, Ordering::Relaxed);
        if n < LOGGED_ERRORS {
            tracing::error!(hook, "kvsan: the sanitizer refused a hook call: {error}");
        } else if n == LOGGED_ERRORS {
            tracing::error!("kvsan: further hook errors are only counted");
        }
        Verdict::Continue
    }
}

impl KvHooks for SanitizerHooks {
    fn pool_register(&self, geometry: &PoolGeometry) -> Option<PoolId> {
        match self.sanitizer.pool_register(geometry.clone()) {
            Ok(id) => Some(id),
            Err(e) => {
                let _ = self.misuse("pool_register", &e);
                None
            }
        }
    }

    fn request_event(&self, pool: PoolId, owner: Owner, event: RequestEvent) -> Verdict {
        self.verdict(
            "request_event",
            self.sanitizer.request_event_at(pool, owner, event),
        )
    }

    fn alloc(&self, pool: PoolId, owner: Owner, page: PageRef, step: u64) -> Verdict {
        match self.sanitizer.alloc(pool, page.page, owner, step) {
            Ok((verdict, generation)) => {
                if generation != page.generation && verdict.is_continue() {
                    // The shadow and the pool count allocations of the page
                    // differently: every later check of it would be wrong.
                    let _ = self.misuse(
                        "alloc",
                        &format_args!(
                            "shadow generation {} differs from the engine's {} for {pool} {}",
                            generation.0, page.generation.0, page.page
                        ),
                    );
                }
                verdict
            }
            Err(e) => self.misuse("alloc", &e),
        }
    }

    fn free(&self, pool: PoolId, owner: Owner, page: PageRef, step: u64) -> Verdict {
        self.verdict("free", self.sanitizer.free(pool, owner, page, step))
    }

    fn share(&self, pool: PoolId, page: PageRef, sharer: Owner) -> Verdict {
        self.verdict("share", self.sanitizer.share(pool, page, sharer))
    }

    fn declare_salt(&self, owner: Owner, salt: u64) -> Verdict {
        self.sanitizer.declare_salt(owner, salt);
        Verdict::Continue
    }

    fn kernel_shadow(&self, pool: PoolId) -> Option<KernelShadowHandle> {
        let raw = match self.sanitizer.kernel_shadow(pool) {
            Ok(view) => view.to_raw(),
            Err(e) => {
                let _ = self.misuse("kernel_shadow", &e);
                return None;
            }
        };
        let keep: Arc<dyn std::any::Any + Send + Sync> = self.sanitizer.clone();
        // SAFETY: `raw` describes the sanitizer's own pool, whose memory
        // lives as long as the sanitizer, which the handle keeps.
        match unsafe { KernelShadowHandle::new(raw, Some(keep)) } {
            Ok(handle) => Some(handle),
            Err(e) => {
                let _ = self.misuse("kernel_shadow", &e);
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
        self.verdict(
            "kernel_refusal",
            self.sanitizer.kernel_refusal(pool, owner, access, step),
        )
    }

    fn transfer_send(&self, pool: PoolId, manifest: &Manifest) -> Verdict {
        self.verdict(
            "transfer_send",
            self.sanitizer.transfer_send(pool, manifest),
        )
    }

    fn transfer_recv(&self, pool: PoolId, manifest: &Manifest) -> Verdict {
        self.verdict(
            "transfer_recv",
            self.sanitizer.transfer_recv(pool, manifest),
        )
    }

    fn transfer_land(&self, pool: PoolId, landing: &PageLanding) -> Verdict {
        self.verdict("transfer_land", self.sanitizer.transfer_land(pool, landing))
    }

    fn transfer_verify(&self, pool: PoolId, landing: &PageLanding) -> Verdict {
        self.verdict(
            "transfer_verify",
            self.sanitizer.transfer_verify(pool, landing),
        )
    }

    fn tier_store(
        &self,
        pool: PoolId,
        owner: Owner,
        page: PageRef,
        block: TierBlockId,
        step: u64,
    ) -> Verdict {
        self.verdict(
            "tier_store",
            self.sanitizer.tier_store(pool, owner, page, block, step),
        )
    }

    fn tier_store_done(&self, block: TierBlockId, digest: u64, stored: bool) -> Verdict {
        self.verdict(
            "tier_store_done",
            self.sanitizer.tier_store_done(block, digest, stored),
        )
    }

    fn tier_load(
        &self,
        pool: PoolId,
        owner: Owner,
        page: PageRef,
        block: TierBlockId,
        step: u64,
    ) -> Verdict {
        self.verdict(
            "tier_load",
            self.sanitizer.tier_load(pool, owner, page, block, step),
        )
    }

    fn tier_verify(
        &self,
        pool: PoolId,
        owner: Owner,
        page: PageRef,
        block: TierBlockId,
        digest: u64,
    ) -> Verdict {
        self.verdict(
            "tier_verify",
            self.sanitizer.tier_verify(pool, owner, page, block, digest),
        )
    }

    fn tier_release(&self, block: TierBlockId) -> Verdict {
        self.sanitizer.tier_release(block)
    }

    fn transfer_commit(
        &self,
        pool: PoolId,
        owner: Owner,
        table: &[PageRef],
        committed_tokens: usize,
    ) -> Verdict {
        self.verdict(
            "transfer_commit",
            self.sanitizer
                .transfer_commit(pool, owner, table, committed_tokens),
        )
    }

    fn settings(&self) -> HookSettings {
        let options = self.sanitizer.options();
        HookSettings {
            poison: options.poison,
            quarantine_pages: options.quarantine_pages,
        }
    }

    fn print_summary(&self) {
        self.sanitizer.print_summary();
    }

    fn counters(&self) -> Option<SanitizerCounters> {
        Some(SanitizerCounters {
            violations: kvsan_sanitizer::ViolationKind::ALL
                .iter()
                .map(|&k| self.sanitizer.count(k))
                .collect(),
            checks: self.sanitizer.checks().total(),
        })
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use kvsan_sanitizer::{NodeRole, Options, RequestId, TenantId, ViolationKind};

    fn geometry() -> PoolGeometry {
        PoolGeometry {
            pages: 2,
            page_slots: 2,
            layers: 1,
            bytes_per_slot: 8,
            role: NodeRole::Unified,
            node: "unified".into(),
        }
    }

    #[test]
    fn shares_and_salts_reach_the_in_process_sanitizer_and_misuse_is_counted() {
        let san = Arc::new(Sanitizer::with_writer(Options::default(), std::io::sink()));
        let hooks = SanitizerHooks::new(san.clone());
        let pool = hooks.pool_register(&geometry()).expect("registered");
        let writer = Owner::new(1, 3);
        let page = PageRef::new(0, 1);
        assert!(hooks.declare_salt(writer, 42).is_continue());
        assert!(hooks.alloc(pool, writer, page, 1).is_continue());
        assert!(
            san.write(pool, writer, page, 0..2, 0..1, 2)
                .unwrap()
                .is_continue()
        );
        let cache = Owner {
            request: RequestId::PREFIX_CACHE,
            tenant: TenantId(3),
        };
        assert!(hooks.share(pool, page, cache).is_continue());
        // Same tenant, no salt: the writer's salt keeps it out.
        let unsalted = Owner::new(2, 3);
        assert_eq!(
            hooks.share(pool, page, unsalted).kind(),
            Some(ViolationKind::CrossDomainShare)
        );
        let salted = Owner::new(4, 3);
        assert!(hooks.declare_salt(salted, 42).is_continue());
        assert!(hooks.share(pool, page, salted).is_continue());
        assert_eq!(hooks.errors(), 0);
        // An unknown pool is the engine's misuse, not a violation.
        assert!(hooks.share(PoolId(77), page, salted).is_continue());
        assert_eq!(hooks.errors(), 1);
    }
}
