//! The tier hooks: a page stored into a tier block, the store completed
//! or failed, the block loaded into a page and its digest compared, the
//! block released (see [`crate::tier`]).

use super::Sanitizer;
use super::finding::{Finding, with_article};
use crate::error::SanitizerError;
use crate::history::{Event, EventKind};
use crate::ids::{Owner, PageRef, PoolId, RequestId};
use crate::shadow::{FLAG_OWNER_RELEASED, FLAG_SHARED};
use crate::tier::{Identity, TierBlock, TierBlockId, TierBlockState};
use crate::violation::{Verdict, ViolationKind};

impl Sanitizer {
    /// A store of `page` (pool `pool`) into tier block `block` starts, for
    /// `owner` (a preempted request, or the prefix cache,
    /// [`RequestId::PREFIX_CACHE`] with the writer's tenant, moving a
    /// cached page down a tier). The store reads the page as it is now:
    /// the page must be current (`generation-mismatch`), allocated
    /// (`read-free-page`) and held by `owner`, as owner or sharer
    /// (`foreign-read`); the block must not be live — storing or holding
    /// another page's KV (`tier-block-aliased`: two pages would map to one
    /// block). A terminal `owner` is `terminal-request-activity`.
    ///
    /// On `Continue` the block is storing, with the page's identity (its
    /// writer, salt, whether it is the prefix cache's, and its written map
    /// now); it may be loaded once [`Sanitizer::tier_store_done`] says the
    /// store completed.
    ///
    /// # Errors
    /// Unknown pool or page out of range.
    pub fn tier_store(
        &self,
        pool: PoolId,
        owner: Owner,
        page: PageRef,
        block: TierBlockId,
        step: u64,
    ) -> Result<Verdict, SanitizerError> {
        let shadow = self.pool(pool)?;
        let view = shadow.page(page.page)?;
        self.checks.transfer();
        if let Some(v) = self.terminal_tier_activity(pool, owner, page, "storing to a tier") {
            return Ok(v);
        }
        let word = view.rec.load();
        let refused = if word.generation() != page.generation {
            Some(ViolationKind::GenerationMismatch)
        } else if word.state().is_free() {
            Some(ViolationKind::ReadFreePage)
        } else if !(view.rec.held_by(word, owner.request)
            || word.has(FLAG_SHARED) && shadow.is_sharer(page.page, owner.request))
        {
            Some(ViolationKind::ForeignRead)
        } else {
            None
        };
        if let Some(kind) = refused {
            return Ok(self.violation(
                Finding::new(kind, owner, "storing to a tier")
                    .at(pool, page)
                    .step(Some(step))
                    .detail(format!(
                        "the store into {block} reads the page through a tag of gen {}; the page is {} at gen {}",
                        page.generation.0,
                        word.state().name(),
                        word.generation().0
                    )),
            ));
        }
        let mut tiers = self.tiers.lock();
        if let Some(live) = tiers.get(&block)
            && live.state != TierBlockState::Failed
        {
            let held = &live.identity;
            let detail = format!(
                "{block} is {} with page {} (gen {}) of pool {} for request {}, stored at step {}: the store of this page would put two pages' KV in one block",
                live.state.name(),
                held.page.page.0,
                held.page.generation.0,
                held.pool.0,
                held.storer.request.0,
                held.step
            );
            drop(tiers);
            return Ok(self.violation(
                Finding::new(ViolationKind::TierBlockAliased, owner, "storing to a tier")
                    .at(pool, page)
                    .step(Some(step))
                    .detail(detail),
            ));
        }
        shadow.flush_kernel_write(page.page);
        let identity = Identity {
            pool,
            page,
            storer: owner,
            writer: view.rec.owner(),
            salt: shadow.salt_of(page.page),
            cached: owner.request.is_prefix_cache() || word.has(FLAG_SHARED),
            page_slots: shadow.geometry.page_slots,
            layers: shadow.geometry.layers,
            written: view.written_words(),
            step,
        };
        tiers.insert(
            block,
            TierBlock {
                state: TierBlockState::Storing,
                identity,
                digest: 0,
                failure: None,
            },
        );
        drop(tiers);
        shadow.log(
            page.page,
            Event::new(
                EventKind::TierStore,
                owner,
                page.generation,
                Some(step),
                None,
            ),
        );
        Ok(Verdict::Continue)
    }

    /// The store into `block` completed (`stored`: the tier holds the
    /// page's KV, and `digest` is the engine's digest of what it holds) or
    /// failed. A completed store's source page must still be held at the
    /// generation the store read: a page freed or re-allocated before the
    /// store completed may have been overwritten while the store read it
    /// (`tier-store-source-reused`, for the store's owner). A failed store,
    /// or one that finds that, leaves the block failed: it is never loaded.
    ///
    /// # Errors
    /// [`SanitizerError::TierBlockNotStoring`] if no store into `block` is
    /// in flight.
    pub fn tier_store_done(
        &self,
        block: TierBlockId,
        digest: u64,
        stored: bool,
    ) -> Result<Verdict, SanitizerError> {
        let mut tiers = self.tiers.lock();
        let entry = match tiers.get_mut(&block) {
            Some(b) if b.state == TierBlockState::Storing => b,
            other => {
                return Err(SanitizerError::TierBlockNotStoring {
                    tier: block.tier,
                    block: block.block,
                    state: other.map_or("unknown", |b| b.state.name()),
                });
            }
        };
        self.checks.transfer();
        if !stored {
            entry.state = TierBlockState::Failed;
            entry.failure = Some("its store failed".into());
            return Ok(Verdict::Continue);
        }
        let id = entry.identity.clone();
        let now = self
            .pool(id.pool)?
            .page(id.page.page)
            .map(|view| view.rec.load())?;
        if now.generation() == id.page.generation && !now.state().is_free() {
            entry.state = TierBlockState::Stored;
            entry.digest = digest;
            return Ok(Verdict::Continue);
        }
        entry.state = TierBlockState::Failed;
        entry.failure = Some(format!(
            "its source page was {} at gen {} when the store completed",
            now.state().name(),
            now.generation().0
        ));
        drop(tiers);
        let what = if now.generation() == id.page.generation {
            "freed"
        } else {
            "freed and re-allocated"
        };
        Ok(self.violation(
            Finding::new(
                ViolationKind::TierStoreSourceReused,
                id.storer,
                "completing a tier store",
            )
            .at(id.pool, id.page)
            .step(Some(id.step))
            .detail(format!(
                "the store into {block} started at step {} reading the page at gen {}; the page was {what} before it completed (now {} at gen {}): what the tier holds may be another request's KV",
                id.step,
                id.page.generation.0,
                now.state().name(),
                now.generation().0
            )),
        ))
    }

    /// A load from tier block `block` is about to copy it into `page`
    /// (pool `pool`) for `owner`. In order: `terminal-request-activity`;
    /// `tier-load-unstored` if the block's store never completed, failed or
    /// was released; `tier-foreign-load` if the block is not `owner`'s —
    /// another request's KV (only the request it was stored for gets it
    /// back), or a prefix-cache block the isolation policy keeps apart
    /// from `owner`; then the copy is checked like a kernel store into
    /// `page` (`generation-mismatch`, `write-after-free`, `foreign-write`).
    /// On `Continue` the copy may write, and the slots the block's store
    /// found written count as written in `page` — those, no more.
    ///
    /// # Errors
    /// Unknown pool or page out of range;
    /// [`SanitizerError::TierGeometry`] if the block holds a page of another
    /// shape than `pool`'s.
    pub fn tier_load(
        &self,
        pool: PoolId,
        owner: Owner,
        page: PageRef,
        block: TierBlockId,
        step: u64,
    ) -> Result<Verdict, SanitizerError> {
        let shadow = self.pool(pool)?;
        let view = shadow.page(page.page)?;
        self.checks.transfer();
        if let Some(v) = self.terminal_tier_activity(pool, owner, page, "loading from a tier") {
            return Ok(v);
        }
        let stored = match self.stored_block(pool, owner, page, block, step, "loading from a tier")
        {
            Ok(b) => b,
            Err(v) => return Ok(v),
        };
        let id = &stored.identity;
        if (id.page_slots, id.layers) != (shadow.geometry.page_slots, shadow.geometry.layers) {
            return Err(SanitizerError::TierGeometry {
                tier: block.tier,
                block: block.block,
                pool: pool.0,
                stored: (id.page_slots, id.layers),
                pool_shape: (shadow.geometry.page_slots, shadow.geometry.layers),
            });
        }
        if let Some(why) = self.foreign_load(id, owner) {
            return Ok(self.violation(
                Finding::new(ViolationKind::TierForeignLoad, owner, "loading from a tier")
                    .at(pool, page)
                    .step(Some(step))
                    .detail(format!("{block} holds {why}")),
            ));
        }
        match view.load_words(owner.request, page.generation, &id.written) {
            Ok(()) => {
                shadow.log(
                    page.page,
                    Event::new(
                        EventKind::TierLoad,
                        owner,
                        page.generation,
                        Some(step),
                        None,
                    ),
                );
                Ok(Verdict::Continue)
            }
            Err((kind, word)) => {
                let holder = if word.state().is_free() {
                    String::new()
                } else if word.has(FLAG_OWNER_RELEASED) {
                    " (its owner let go of it)".into()
                } else {
                    format!(" held by request {}", view.rec.owner_request().0)
                };
                Ok(self.violation(
                    Finding::new(kind, owner, "loading from a tier")
                        .at(pool, page)
                        .step(Some(step))
                        .detail(format!(
                            "the load of {block} writes the page through a tag of gen {}; the page is {} at gen {}{holder}",
                            page.generation.0,
                            word.state().name(),
                            word.generation().0
                        )),
                ))
            }
        }
    }

    /// The KV of a load from `block` is in `page`: `digest`, the engine's
    /// digest of what the page holds now, must equal the digest the block's
    /// store reported (`tier-digest-mismatch` otherwise: a partial or
    /// failed load, another block's KV, or a block overwritten since its
    /// store). `tier-load-unstored` if the block is not stored.
    ///
    /// # Errors
    /// Unknown pool or page out of range.
    pub fn tier_verify(
        &self,
        pool: PoolId,
        owner: Owner,
        page: PageRef,
        block: TierBlockId,
        digest: u64,
    ) -> Result<Verdict, SanitizerError> {
        let shadow = self.pool(pool)?;
        shadow.page(page.page)?;
        self.checks.transfer();
        let stored = match self.stored_block(pool, owner, page, block, 0, "verifying a tier load") {
            Ok(b) => b,
            Err(v) => return Ok(v),
        };
        if stored.digest == digest {
            return Ok(Verdict::Continue);
        }
        let id = &stored.identity;
        Ok(self.violation(
            Finding::new(ViolationKind::TierDigestMismatch, owner, "verifying a tier load")
                .at(pool, page)
                .detail(format!(
                    "the KV found in the page after the load of {block} is not what the store of page {} (gen {}) of pool {} put there",
                    id.page.page.0,
                    id.page.generation.0,
                    id.pool.0
                )),
        ))
    }

    /// The tier lets go of `block` (evicted, or its memory reused): it is
    /// forgotten, and a later load of it is `tier-load-unstored`. Releasing
    /// a block no store named is not an error (a tier may release
    /// defensively).
    pub fn tier_release(&self, block: TierBlockId) -> Verdict {
        self.tiers.lock().remove(&block);
        Verdict::Continue
    }

    /// Where tier block `block` stands, if the sanitizer knows it.
    #[must_use]
    pub fn tier_block_state(&self, block: TierBlockId) -> Option<TierBlockState> {
        self.tiers.lock().get(&block).map(|b| b.state)
    }

    /// The block if it is stored; the violation otherwise.
    fn stored_block(
        &self,
        pool: PoolId,
        owner: Owner,
        page: PageRef,
        block: TierBlockId,
        step: u64,
        action: &str,
    ) -> Result<TierBlock, Verdict> {
        let found = self.tiers.lock().get(&block).cloned();
        let why = match &found {
            Some(b) if b.state == TierBlockState::Stored => return Ok(found.expect("matched")),
            Some(b) if b.state == TierBlockState::Storing => format!(
                "its store (page {} of pool {}, step {}) has not completed",
                b.identity.page.page.0, b.identity.pool.0, b.identity.step
            ),
            Some(b) => b
                .failure
                .clone()
                .unwrap_or_else(|| "its store failed".into()),
            None => "no completed store holds it (never stored, or released)".into(),
        };
        Err(self.violation(
            Finding::new(ViolationKind::TierLoadUnstored, owner, action)
                .at(pool, page)
                .step((step != 0).then_some(step))
                .detail(format!("{block} may not be loaded: {why}")),
        ))
    }

    /// Why `owner` may not have the KV of a block stored with `id`, if it
    /// may not. Salts are secrets: never printed.
    fn foreign_load(&self, id: &Identity, owner: Owner) -> Option<String> {
        if id.storer.request == owner.request && !owner.request.is_prefix_cache() {
            return None;
        }
        if !id.cached {
            return Some(format!(
                "the KV of request {} (tenant {}), stored from its own page {} of pool {}; only that request may load it",
                id.storer.request.0, id.storer.tenant.0, id.page.page.0, id.pool.0
            ));
        }
        if owner.request.is_prefix_cache() {
            return None;
        }
        self.policy_refusal_for(id.writer, id.salt, owner)
            .map(|why| format!("a prefix-cache page the policy keeps from this request: {why}"))
    }

    fn terminal_tier_activity(
        &self,
        pool: PoolId,
        owner: Owner,
        page: PageRef,
        action: &str,
    ) -> Option<Verdict> {
        if owner.request == RequestId::PREFIX_CACHE {
            return None;
        }
        let state = self.lifecycle.state_at(owner.request, pool)?;
        state.is_terminal().then(|| {
            self.violation(
                Finding::new(ViolationKind::TerminalRequestActivity, owner, action)
                    .at(pool, page)
                    .detail(format!(
                        "{} request moves KV through a tier",
                        with_article(state.name())
                    )),
            )
        })
    }
}
