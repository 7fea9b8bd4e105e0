//! The transfer hooks: send, receive, commit.

use super::Sanitizer;
use super::finding::{Finding, with_article};
use super::pages::list_holders;
use crate::error::SanitizerError;
use crate::history::{Event, EventKind};
use crate::ids::{Owner, PageRef, PoolId};
use crate::shadow::{FLAG_OWNER_RELEASED, FLAG_SHARED, ReadCheck, StateWord};
use crate::transfer::{Landing, Manifest, PageLanding, pages_of};
use crate::violation::{Verdict, ViolationKind};

impl Sanitizer {
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

    /// A transfer of `manifest` arrives at the receiver's pool `pool`: each
    /// destination page must still be held by the manifest's request at its
    /// tagged generation (`write-after-free` if freed or re-allocated since,
    /// `foreign-write` if another request holds it or it is shared
    /// read-only with the prefix cache or a request). The pages become
    /// Receiving: reserved for the KV that [`Sanitizer::transfer_land`] and
    /// [`Sanitizer::transfer_verify`] then see land. Nothing counts as
    /// written yet — except on a pool registered as [`Landing::Manifest`]
    /// (an engine that reports no landing), where the manifest's slots ×
    /// layers count as written now.
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
        let mark = shadow.landing == Landing::Manifest;
        for (i, slots) in pages_of(manifest.token_range(), shadow.geometry.page_slots) {
            let page = manifest.dst_pages[i];
            let view = shadow.page(page.page)?;
            match view.receive(
                owner.request,
                page.generation,
                slots.clone(),
                &manifest.layers,
                mark,
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
                    let shared = if word.has(FLAG_SHARED) && word.generation() == page.generation {
                        format!(
                            ", shared read-only with {}",
                            list_holders(&shadow.sharers_of(page.page))
                        )
                    } else {
                        String::new()
                    };
                    return Ok(self.violation(
                        Finding::new(kind, owner, "receiving into")
                            .at(pool, page)
                            .slot(Some(slots.start))
                            .detail(format!(
                                "transfer of tokens {}..{} lands in slots {}..{} through a tag of gen {}; the page is {} at gen {}{shared}",
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

    /// A copy is about to put received KV where `landing` says: tokens
    /// `landing.token_range()` of its request into `landing.slots` ×
    /// `landing.layers` of `landing.page`. The copy is checked like a kernel
    /// store: the page must be one the request holds at the tag's
    /// generation and reserved for an incoming transfer by
    /// [`Sanitizer::transfer_recv`] (`misdirected-transfer` if another
    /// request holds it or it is not reserved, `write-after-free` if it was
    /// freed or re-allocated since the tag, `foreign-write` if it is shared
    /// read-only). Only on `Continue` may the copy write; then, and only
    /// then, its slots count as written. The digests are not looked at.
    ///
    /// # Errors
    /// Unknown pool; page, slot or layer out of range.
    pub fn transfer_land(
        &self,
        pool: PoolId,
        landing: &PageLanding,
    ) -> Result<Verdict, SanitizerError> {
        self.landing_check(pool, landing, "landing", false)
    }

    /// The KV of `landing` is in its page: `landing.landed_digest`, the
    /// receiver's digest of what `landing.slots` × `landing.layers` of the
    /// page hold now, must equal `landing.sent_digest`, the sender's digest
    /// of the KV of those tokens (`transfer-digest-mismatch` otherwise: the
    /// bytes went elsewhere, in another order, or not at all). The page is
    /// checked as [`Sanitizer::transfer_land`] checks it, and on a match the
    /// slots count as written — the evidence of a landing no copy showed
    /// (an RDMA WRITE), and a second look at one a copy did.
    ///
    /// # Errors
    /// Unknown pool; page, slot or layer out of range.
    pub fn transfer_verify(
        &self,
        pool: PoolId,
        landing: &PageLanding,
    ) -> Result<Verdict, SanitizerError> {
        self.landing_check(pool, landing, "verifying", true)
    }

    fn landing_check(
        &self,
        pool: PoolId,
        landing: &PageLanding,
        action: &'static str,
        verify: bool,
    ) -> Result<Verdict, SanitizerError> {
        let shadow = self.pool(pool)?;
        let owner = landing.request;
        let page = landing.page;
        let view = shadow.page(page.page)?;
        let slots = landing.slots.clone();
        Self::check_slots(shadow, &slots)?;
        self.check_layers(shadow, &landing.layers)?;
        self.checks.transfer();
        let tokens = landing.token_range();
        if let Some(state) = self.lifecycle.state_at(owner.request, pool)
            && state.is_terminal()
        {
            return Ok(self.violation(
                Finding::new(ViolationKind::TerminalRequestActivity, owner, action)
                    .at(pool, page)
                    .detail(format!(
                        "{} request's transferred tokens {}..{} land",
                        with_article(state.name()),
                        tokens.start,
                        tokens.end
                    )),
            ));
        }
        // A mismatch marks nothing: only KV found to be what was sent counts.
        let mismatch = verify && landing.sent_digest != landing.landed_digest;
        let landed = view.land(
            owner.request,
            page.generation,
            slots.clone(),
            &landing.layers,
            !mismatch,
        );
        let found = match landed {
            Err((kind, word)) => Some((kind, word)),
            Ok(()) if mismatch => Some((ViolationKind::TransferDigestMismatch, view.rec.load())),
            Ok(()) => None,
        };
        let Some((kind, word)) = found else {
            if verify {
                // A match confirms what a landing already logged (or, after
                // an RDMA WRITE, what the recv reserved).
                return Ok(Verdict::Continue);
            }
            shadow.log(
                page.page,
                Event::new(
                    EventKind::Land,
                    owner,
                    page.generation,
                    None,
                    Some((slots.start, slots.end)),
                ),
            );
            return Ok(Verdict::Continue);
        };
        let holder = if word.state().is_free() {
            String::new()
        } else if view.rec.held_by(word, owner.request) {
            " held by this request".to_string()
        } else {
            format!(" held by request {}", view.rec.owner_request().0)
        };
        let what = if kind == ViolationKind::TransferDigestMismatch {
            "; the KV found there is not the KV the sender sent for these tokens".to_string()
        } else {
            String::new()
        };
        Ok(self.violation(
            Finding::new(kind, owner, action)
                .at(pool, page)
                .slot(Some(slots.start))
                .detail(format!(
                    "transferred tokens {}..{}, layers {}..{}, land in slots {}..{} through a tag of gen {}; the page is {} at gen {}{holder}{what}",
                    tokens.start,
                    tokens.end,
                    landing.layers.start,
                    landing.layers.end,
                    slots.start,
                    slots.end,
                    page.generation.0,
                    word.state().name(),
                    word.generation().0
                )),
        ))
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
}
