//! The page hooks: alloc, free, share, and the host-side write and read.

use super::Sanitizer;
use super::finding::{Finding, with_article};
use crate::error::SanitizerError;
use crate::history::{Event, EventKind};
use crate::ids::{Generation, Owner, PageId, PageRef, PoolId};
use crate::lifecycle::{RequestState, Scope};
use crate::options::SharePolicy;
use crate::pool::ShadowPool;
use crate::shadow::{
    AllocOutcome, FLAG_SHARED, FreeOutcome, Needed, PageState, PageView, ReadCheck, StateWord,
};
use crate::violation::{Verdict, ViolationKind};
use std::ops::Range;

impl Sanitizer {
    /// The engine took `page` from its free list for `owner`. Returns the
    /// page's new generation (the tag for the block table).
    ///
    /// `double-alloc` if the page is not Free or Quarantined (nothing changes;
    /// the page's current generation is returned); otherwise
    /// `terminal-request-activity` if the owner is terminal (the allocation
    /// is still recorded).
    ///
    /// # Errors
    /// Unknown pool or page out of range; the prefix cache's reserved id
    /// ([`crate::RequestId::PREFIX_CACHE`]: the cache holds pages, it does
    /// not take them from the free list).
    pub fn alloc(
        &self,
        pool: PoolId,
        page: PageId,
        owner: Owner,
        step: u64,
    ) -> Result<(Verdict, Generation), SanitizerError> {
        let shadow = self.pool(pool)?;
        let view = shadow.page(page)?;
        if owner.request.is_prefix_cache() {
            return Err(SanitizerError::ReservedRequest {
                request: owner.request.0,
                what: "allocate a page",
            });
        }
        self.checks.alloc();
        let mut rec = self.lifecycle.entry(owner.request, owner.tenant);
        let state = match rec.state_at(pool) {
            Some(state) => state,
            None => rec.view_mut(Scope::Process, RequestState::Admitted).state,
        };
        let salt = rec.salt;
        let outcome = view.alloc(owner, state.is_terminal());
        drop(rec);
        if matches!(outcome, AllocOutcome::Allocated { .. }) {
            shadow.set_salt(page, salt);
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
    /// page goes to quarantine when its last holder lets go. The prefix
    /// cache (`RequestId::PREFIX_CACHE`) lets go of a page it evicts the
    /// same way; while a request still shares the page, or its writer
    /// still owns it, the page stays.
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
        // The prefix cache has no lifecycle: nothing to count for it.
        if !owner.request.is_prefix_cache() {
            self.lifecycle
                .add_held(owner.request, owner.tenant, pool, -1);
        }
        Ok(Verdict::Continue)
    }

    /// `owner` declares its cache salt (vLLM's `cache_salt`, hashed by the
    /// caller; 0: none), before it takes pages: the pages it then takes
    /// carry the salt, and under `prefix_share=salt` only a request that
    /// declared the same salt may share them.
    ///
    /// The prefix cache (`RequestId::PREFIX_CACHE`) has no salt of its own
    /// (pages keep their writer's); a declaration for it is ignored.
    pub fn declare_salt(&self, owner: Owner, salt: u64) {
        if owner.request.is_prefix_cache() {
            return;
        }
        self.lifecycle.entry(owner.request, owner.tenant).salt = salt;
    }

    /// The prefix cache shares `page` read-only with `sharer` (one more
    /// reference; the sharer frees it like an owner). While the page is
    /// shared nobody writes it, its owner included (`foreign-write`).
    ///
    /// In order: `terminal-request-activity` for a terminal sharer;
    /// `read-during-transfer` if the page's incoming KV is not committed;
    /// `cross-domain-share` if the `prefix_share` policy keeps the sharer
    /// apart from the page's writer; `unwritten-share` if any slot of any
    /// layer is unwritten (only full pages are shared: a partial last page
    /// is copied or recomputed); `generation-mismatch` or `read-free-page`
    /// if the page is not held at that generation. A violation adds no
    /// sharer.
    ///
    /// The sharer may be the prefix cache itself
    /// ([`crate::RequestId::PREFIX_CACHE`], with the writer's tenant),
    /// taking the reference that keeps a page it registers after the
    /// writer lets go: its share is checked for all of the above but the
    /// policy (the cache never reads; each request the cache later shares
    /// the page with is checked against it) and the terminal check (it has
    /// no lifecycle). A violation on it means the page must not be
    /// registered (no request is at fault: the engine aborts none).
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
        let cache = sharer.request.is_prefix_cache();
        if !cache
            && let Some(state) = self.lifecycle.state_at(sharer.request, pool)
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
        if let Some(finding) = self.share_refusal(shadow, view, page, sharer) {
            return Ok(self.violation(finding.at(pool, page)));
        }
        match shadow.add_sharer(view, page, sharer) {
            Ok(()) => {
                shadow.log(
                    page.page,
                    Event::new(EventKind::Share, sharer, page.generation, None, None),
                );
                if !cache {
                    self.lifecycle
                        .add_held(sharer.request, sharer.tenant, pool, 1);
                }
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

    /// Why the page held at `page.generation` may not be shared with
    /// `sharer`, if it may not. A page not held at that generation is left
    /// to [`ShadowPool::add_sharer`]'s refusal.
    fn share_refusal(
        &self,
        shadow: &ShadowPool,
        view: PageView<'_>,
        page: PageRef,
        sharer: Owner,
    ) -> Option<Finding> {
        let word = view.rec.load();
        if word.generation() != page.generation {
            return None;
        }
        let refuse =
            |kind, detail: String| Some(Finding::new(kind, sharer, "sharing").detail(detail));
        match word.state() {
            PageState::Receiving => {
                return refuse(
                    ViolationKind::ReadDuringTransfer,
                    "the page's incoming KV is not committed: a failed or unfinished store must not be found by a lookup".into(),
                );
            }
            PageState::Owned => {}
            _ => return None,
        }
        // The cache's own reference is not a read: the policy is checked
        // when a request shares the page from the cache.
        if !sharer.request.is_prefix_cache()
            && let Some(detail) = self.policy_refusal(shadow, view, page, sharer)
        {
            return refuse(ViolationKind::CrossDomainShare, detail);
        }
        let geometry = &shadow.geometry;
        if let Some(slot) = view.first_unwritten(0..geometry.page_slots, &(0..geometry.layers)) {
            return refuse(
                ViolationKind::UnwrittenShare,
                format!(
                    "slot {slot} of {} is not written for every layer: only a page its owner filled may be shared",
                    geometry.page_slots
                ),
            );
        }
        None
    }

    /// Why `prefix_share` keeps `sharer` apart from the writer of `page`
    /// (the page's owner at its allocation), if it does.
    fn policy_refusal(
        &self,
        shadow: &ShadowPool,
        view: PageView<'_>,
        page: PageRef,
        sharer: Owner,
    ) -> Option<String> {
        self.policy_refusal_for(view.rec.owner(), shadow.salt_of(page.page), sharer)
    }

    /// Why `prefix_share` keeps `sharer` apart from KV written by `writer`
    /// under `salt` (0: none), if it does. Salts are secrets: the detail
    /// says whether they differ, never what they are.
    pub(super) fn policy_refusal_for(
        &self,
        writer: Owner,
        salt: u64,
        sharer: Owner,
    ) -> Option<String> {
        let salts = || {
            let (theirs, mine) = (salt, self.lifecycle.salt(sharer.request));
            (theirs != mine).then_some(match (theirs, mine) {
                (0, _) => "the page carries no salt, the sharer declared one",
                (_, 0) => "the page carries a salt, the sharer declared none",
                _ => "the page and the sharer carry different salts",
            })
        };
        match self.options.prefix_share {
            SharePolicy::Off => Some("prefix_share=off: no page is shared".to_string()),
            SharePolicy::Global => None,
            SharePolicy::Tenant => {
                if writer.tenant != sharer.tenant {
                    Some(format!(
                        "prefix_share=tenant: the page was written for tenant {}, the sharer is tenant {}",
                        writer.tenant.0, sharer.tenant.0
                    ))
                } else {
                    salts().map(|what| {
                        format!(
                            "prefix_share=tenant: the page was written for the sharer's tenant {}, but {what}",
                            sharer.tenant.0
                        )
                    })
                }
            }
            SharePolicy::Salt => salts().map(|what| format!("prefix_share=salt: {what}")),
        }
    }

    /// KV computed by `owner` into `slots × layers` of `page`.
    ///
    /// In order: `generation-mismatch` (stale tag), `write-after-free` (page
    /// free or quarantined), `foreign-write` (writer does not hold the
    /// ownership: another request, a mere sharer, or an owner who released
    /// it; or the owner writes while the page is shared read-only with the
    /// prefix cache or a request), `terminal-request-activity` (owner is
    /// terminal).
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
        Self::check_slots(shadow, &slots)?;
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
        // The owner writing its own page while others hold it: name them.
        let owners_shared_page = || {
            let shadow = self.pool(pool).ok()?;
            let view = shadow.page(page.page).ok()?;
            (kind == ViolationKind::ForeignWrite
                && word.has(FLAG_SHARED)
                && word.generation() == page.generation
                && view.rec.held_by(word, owner.request))
            .then(|| shadow.sharers_of(page.page))
        };
        let detail = match owners_shared_page() {
            // The owner itself: the page is fine but not writable now.
            Some(sharers) => format!(
                "write of slots {}..{}, layers {}..{} into the writer's own page while it is shared read-only with {}: a page other holders read is written by nobody until they let go",
                slots.start,
                slots.end,
                layers.start,
                layers.end,
                list_holders(&sharers)
            ),
            None => format!(
                "write of slots {}..{}, layers {}..{} through a tag of gen {}; the page is {} at gen {}",
                slots.start,
                slots.end,
                layers.start,
                layers.end,
                page.generation.0,
                word.state().name(),
                word.generation().0
            ),
        };
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
        if let Some(verdict) = self.terminal_reader(pool, owner, tokens, step) {
            return Ok(verdict);
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

    /// `terminal-request-activity` when `owner` has ended in `pool`'s view
    /// and reads `tokens` tokens of KV.
    pub(super) fn terminal_reader(
        &self,
        pool: PoolId,
        owner: Owner,
        tokens: usize,
        step: u64,
    ) -> Option<Verdict> {
        let state = self.lifecycle.state_at(owner.request, pool)?;
        state.is_terminal().then(|| {
            self.violation(
                Finding::new(ViolationKind::TerminalRequestActivity, owner, "reading")
                    .step(Some(step))
                    .detail(format!(
                        "{} request reads {tokens} tokens of KV",
                        with_article(state.name())
                    )),
            )
        })
    }

    /// The read check of one page, `slots` of `layers`, by `owner` through
    /// block-table entry `index`: `None` when legal (owner, or sharer with
    /// every slot written), else the verdict of the violation reported.
    #[allow(clippy::too_many_arguments)]
    #[inline]
    pub(super) fn read_page(
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
    pub(super) fn read_slow(
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
}

/// Holders as reports list them: `prefix cache (tenant 1), request 9
/// (tenant 1)`; at most eight, then `…`.
pub(super) fn list_holders(holders: &[Owner]) -> String {
    if holders.is_empty() {
        return "no one any more".to_string();
    }
    let mut list: Vec<String> = holders.iter().take(8).map(ToString::to_string).collect();
    if holders.len() > 8 {
        list.push("…".to_string());
    }
    list.join(", ")
}
