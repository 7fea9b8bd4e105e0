//! The kernels' side: the kernel-shadow view and the cold path of a refused
//! kernel access.

use super::finding::{Finding, with_article};
use super::{Sanitizer, check_range};
use crate::error::SanitizerError;
use crate::ids::{Owner, PoolId};
use crate::kernel_shadow::{AccessOp, KernelAccess, KernelShadow};
use crate::violation::{Verdict, ViolationKind};

impl Sanitizer {
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
}
