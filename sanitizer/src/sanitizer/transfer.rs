//! The transfer hooks: send, receive, commit.

use super::Sanitizer;
use super::finding::{Finding, with_article};
use super::pages::list_holders;
use crate::error::SanitizerError;
use crate::history::{Event, EventKind};
use crate::ids::{Owner, PageRef, PoolId};
use crate::shadow::{FLAG_OWNER_RELEASED, FLAG_SHARED, ReadCheck, StateWord};
use crate::transfer::{Manifest, pages_of};
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

    /// Bytes of `manifest` landed in the receiver's pool `pool`: each
    /// destination page must still be held by the manifest's request at its
    /// tagged generation (`write-after-free` if freed or re-allocated since,
    /// `foreign-write` if another request holds it or it is shared
    /// read-only with the prefix cache or a request). The pages become
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
