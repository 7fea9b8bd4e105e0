//! `KVSAN_OPTIONS=self_test=1`: a sanitizer that silently stopped checking
//! would look exactly like a clean run, so before it checks anything the
//! sanitizer proves that it catches: each kind of violation it checks is
//! provoked once, on scratch pools of a private sanitizer built from the
//! process's options, and must come back as that kind. If one does not, the
//! sanitizer refuses to start ([`SanitizerError::SelfTest`]) — the engine
//! refuses to serve, the shim stays detached — naming the kind.
//!
//! The private sanitizer writes no report and counts nothing in the
//! process's sanitizer. Its violations abort (whatever `on_violation` says,
//! so that a self-test never halts the process), and its freed pages are
//! quarantined, so that each scenario meets the check it is meant for.
//! Kinds the options turn off are skipped and listed: `cross-domain-share`
//! under `prefix_share=global`, `poison-read` without `poison=1`.

use std::ops::Range;

use crate::error::SanitizerError;
use crate::geometry::{NodeRole, PoolGeometry};
use crate::ids::{Owner, PageId, PageRef, PoolId};
use crate::kernel_shadow::{AccessOp, KernelAccess};
use crate::lifecycle::RequestEvent;
use crate::options::{OnViolation, Options, SharePolicy};
use crate::sanitizer::Sanitizer;
use crate::tier::TierBlockId;
use crate::transfer::{Manifest, PageLanding};
use crate::violation::{Verdict, ViolationKind};

const SLOTS: u32 = 16;
const LAYERS: u32 = 4;
const ALL: Range<u32> = 0..LAYERS;
const A: Owner = Owner::new(4, 1);
const B: Owner = Owner::new(7, 2);
const A2: Owner = Owner::new(9, 1);
const BLOCK: TierBlockId = TierBlockId::new(0, 1);

/// What the self-test did.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct SelfTest {
    /// The kinds provoked and caught.
    pub caught: Vec<ViolationKind>,
    /// The kinds the options turn off, not provoked.
    pub skipped: Vec<(ViolationKind, &'static str)>,
}

/// Scratch pools of a private sanitizer.
struct Bench {
    san: Sanitizer,
    decode: PoolId,
    prefill: PoolId,
}

type Step = Result<(), SanitizerError>;

impl Bench {
    fn new(options: &Options) -> Result<Bench, SanitizerError> {
        let mut options = options.clone();
        options.on_violation = OnViolation::Abort;
        options.quarantine_pages = 64;
        options.self_test = false;
        let san = Sanitizer::with_writer(options, std::io::sink());
        let geometry = |role, node: &str| PoolGeometry {
            pages: 8,
            page_slots: SLOTS,
            layers: LAYERS,
            bytes_per_slot: 64,
            role,
            node: node.into(),
        };
        let decode = san.pool_register(geometry(NodeRole::Decode, "self-test-decode"))?;
        let prefill = san.pool_register(geometry(NodeRole::Prefill, "self-test-prefill"))?;
        Ok(Bench {
            san,
            decode,
            prefill,
        })
    }

    /// A legal step of a scenario: anything but Continue is the self-test
    /// failing (the check fired where it must not).
    fn legal(&self, v: Verdict, what: &'static str) -> Step {
        if v.is_continue() {
            Ok(())
        } else {
            Err(SanitizerError::SelfTest {
                kind: "(legal step)",
                found: format!("{what}: {v:?}"),
            })
        }
    }

    fn alloc(&self, pool: PoolId, page: u32, owner: Owner) -> Result<PageRef, SanitizerError> {
        let (v, generation) = self.san.alloc(pool, PageId(page), owner, 1)?;
        self.legal(v, "alloc")?;
        Ok(PageRef {
            page: PageId(page),
            generation,
        })
    }

    fn write(&self, pool: PoolId, owner: Owner, page: PageRef, slots: Range<u32>) -> Step {
        let v = self.san.write(pool, owner, page, slots, ALL, 2)?;
        self.legal(v, "write")
    }

    fn free(&self, pool: PoolId, owner: Owner, page: PageRef) -> Step {
        let v = self.san.free(pool, owner, page, 3)?;
        self.legal(v, "free")
    }

    /// Page 2 of the decode pool, all written by A.
    fn written(&self) -> Result<PageRef, SanitizerError> {
        let page = self.alloc(self.decode, 2, A)?;
        self.write(self.decode, A, page, 0..SLOTS)?;
        Ok(page)
    }

    fn manifest(request: Owner, src: &[PageRef], dst: &[PageRef], tokens: u32) -> Manifest {
        Manifest {
            request,
            src_pool: PoolId(1),
            src_pages: src.to_vec(),
            dst_pool: PoolId(0),
            dst_pages: dst.to_vec(),
            first_token: 0,
            tokens,
            layers: ALL,
            checksum: 0,
        }
    }

    fn landing(m: &Manifest, entry: usize, slots: Range<u32>) -> PageLanding {
        PageLanding {
            request: m.request,
            page: m.dst_pages[entry],
            first_token: entry as u64 * u64::from(SLOTS) + u64::from(slots.start),
            slots,
            layers: m.layers.clone(),
            sent_digest: 1,
            landed_digest: 1,
        }
    }

    /// A's one page sent from prefill and reserved on decode (page 6).
    fn sent(&self) -> Result<Manifest, SanitizerError> {
        let src = self.alloc(self.prefill, 0, A)?;
        self.write(self.prefill, A, src, 0..SLOTS)?;
        let dst = self.alloc(self.decode, 6, A)?;
        let m = Bench::manifest(A, &[src], &[dst], SLOTS);
        self.legal(self.san.transfer_send(self.prefill, &m)?, "send")?;
        self.legal(self.san.transfer_recv(self.decode, &m)?, "recv")?;
        Ok(m)
    }

    /// A's written page 2 stored into `block` (digest 1).
    fn stored(&self, block: TierBlockId) -> Step {
        let page = self.written()?;
        self.legal(
            self.san.tier_store(self.decode, A, page, block, 4)?,
            "tier store",
        )?;
        self.legal(self.san.tier_store_done(block, 1, true)?, "tier store done")
    }

    /// What the scenario of `kind` returns: the verdict of its last call.
    fn provoke(&self, kind: ViolationKind) -> Result<Verdict, SanitizerError> {
        use ViolationKind as K;
        let (s, d, p) = (&self.san, self.decode, self.prefill);
        Ok(match kind {
            K::StaleRead => {
                let old = self.written()?;
                self.free(d, A, old)?;
                let new = self.alloc(d, 2, B)?;
                self.write(d, B, new, 0..1)?;
                s.read(d, B, &[new], SLOTS as usize, ALL, 4)?
            }
            K::ForeignRead => s.read(d, B, &[self.written()?], SLOTS as usize, ALL, 4)?,
            K::GenerationMismatch => {
                let old = self.written()?;
                self.free(d, A, old)?;
                let new = self.alloc(d, 2, B)?;
                self.write(d, B, new, 0..SLOTS)?;
                s.read(d, A, &[old], SLOTS as usize, ALL, 4)?
            }
            K::ReadFreePage => {
                let page = self.written()?;
                self.free(d, A, page)?;
                s.read(d, A, &[page], SLOTS as usize, ALL, 4)?
            }
            K::ReadDuringTransfer => {
                let m = self.sent()?;
                let landing = Bench::landing(&m, 0, 0..SLOTS);
                self.legal(s.transfer_land(d, &landing)?, "land")?;
                s.read(d, A, &m.dst_pages, SLOTS as usize, ALL, 4)?
            }
            K::ForeignWrite => {
                let page = self.written()?;
                self.legal(s.share(d, page, A2)?, "share")?;
                s.write(d, A2, page, 3..4, ALL, 4)?
            }
            K::WriteAfterFree => {
                let src = self.alloc(p, 0, A)?;
                self.write(p, A, src, 0..SLOTS)?;
                let dst = self.alloc(d, 6, A)?;
                self.free(d, A, dst)?;
                s.transfer_recv(d, &Bench::manifest(A, &[src], &[dst], SLOTS))?
            }
            K::DoubleAlloc => {
                self.alloc(d, 1, A)?;
                s.alloc(d, PageId(1), B, 4)?.0
            }
            K::DoubleFree => {
                let page = self.written()?;
                self.free(d, A, page)?;
                s.free(d, A, page, 4)?
            }
            K::ForeignFree => s.free(d, B, self.written()?, 4)?,
            K::TerminalRequestActivity => {
                self.legal(s.request_event(B, RequestEvent::Queued), "queued")?;
                self.legal(s.request_event(B, RequestEvent::Rejected), "rejected")?;
                s.alloc(d, PageId(3), B, 4)?.0
            }
            K::ShortTransfer => {
                let m = self.sent()?;
                let landing = Bench::landing(&m, 0, 0..1);
                self.legal(s.transfer_land(d, &landing)?, "land")?;
                s.transfer_commit(d, A, &m.dst_pages, SLOTS as usize)?
            }
            K::UnwrittenTransfer => {
                let src = self.alloc(p, 0, B)?;
                self.write(p, B, src, 0..1)?;
                let dst = self.alloc(d, 3, B)?;
                s.transfer_send(p, &Bench::manifest(B, &[src], &[dst], SLOTS))?
            }
            K::PageLeak => {
                self.legal(s.request_event(A, RequestEvent::Admitted), "admitted")?;
                self.written()?;
                self.legal(s.request_event(A, RequestEvent::Decoding), "decoding")?;
                s.request_event(A, RequestEvent::Finished)
            }
            K::IllegalTransition => {
                self.legal(s.request_event(A, RequestEvent::Queued), "queued")?;
                s.request_event(A, RequestEvent::Transferring)
            }
            K::PoisonRead => {
                let access = KernelAccess {
                    op: AccessOp::Poison,
                    page: self.written()?,
                    entry: 0,
                    layer: 1,
                    slots: 5..6,
                };
                s.kernel_refusal(d, A, &access, 4)?
            }
            K::CrossDomainShare => s.share(d, self.written()?, B)?,
            K::UnwrittenShare => {
                let page = self.alloc(d, 2, A)?;
                self.write(d, A, page, 0..10)?;
                s.share(d, page, A2)?
            }
            K::MisdirectedTransfer => {
                let other = self.alloc(d, 5, B)?;
                self.write(d, B, other, 0..SLOTS)?;
                let m = self.sent()?;
                let landing = PageLanding {
                    page: other,
                    ..Bench::landing(&m, 0, 0..SLOTS)
                };
                s.transfer_land(d, &landing)?
            }
            K::TransferDigestMismatch => {
                let m = self.sent()?;
                let landing = PageLanding {
                    landed_digest: 2,
                    ..Bench::landing(&m, 0, 0..SLOTS)
                };
                s.transfer_verify(d, &landing)?
            }
            K::TierBlockAliased => {
                self.stored(BLOCK)?;
                let other = self.alloc(d, 3, B)?;
                self.write(d, B, other, 0..SLOTS)?;
                s.tier_store(d, B, other, BLOCK, 4)?
            }
            K::TierStoreSourceReused => {
                let page = self.written()?;
                self.legal(s.tier_store(d, A, page, BLOCK, 4)?, "tier store")?;
                self.free(d, A, page)?;
                s.tier_store_done(BLOCK, 1, true)?
            }
            K::TierLoadUnstored => {
                let dst = self.alloc(d, 3, A)?;
                s.tier_load(d, A, dst, BLOCK, 4)?
            }
            K::TierForeignLoad => {
                self.stored(BLOCK)?;
                let dst = self.alloc(d, 3, B)?;
                s.tier_load(d, B, dst, BLOCK, 4)?
            }
            K::TierDigestMismatch => {
                self.stored(BLOCK)?;
                let dst = self.alloc(d, 3, A)?;
                self.legal(s.tier_load(d, A, dst, BLOCK, 4)?, "tier load")?;
                s.tier_verify(d, A, dst, BLOCK, 2)?
            }
        })
    }
}

/// Why the options leave `kind` unchecked, if they do.
fn off(kind: ViolationKind, options: &Options) -> Option<&'static str> {
    match kind {
        ViolationKind::CrossDomainShare if options.prefix_share == SharePolicy::Global => {
            Some("prefix_share=global shares across every request")
        }
        ViolationKind::PoisonRead if !options.poison => {
            Some("poison=0: freed pages are not poisoned")
        }
        _ => None,
    }
}

/// The process's sanitizer from `options`: with `self_test=1`, only after
/// [`run`] proved every check it makes fires (what the shim and the engine
/// call to start one).
///
/// # Errors
/// [`SanitizerError::SelfTest`] naming a kind not caught; a log file that
/// cannot be opened.
pub fn start(options: Options) -> Result<Sanitizer, SanitizerError> {
    if options.self_test {
        run(&options)?;
    }
    Sanitizer::new(options)
}

/// `v`, the verdict of `kind`'s provoking call, is that kind.
fn judge(kind: ViolationKind, v: Verdict) -> Result<(), SanitizerError> {
    if v.kind() == Some(kind) {
        Ok(())
    } else {
        Err(SanitizerError::SelfTest {
            kind: kind.name(),
            found: format!("{v:?}"),
        })
    }
}

/// Provokes every kind the options check, each on a fresh private
/// sanitizer, and requires each to come back as that kind.
///
/// # Errors
/// [`SanitizerError::SelfTest`] naming the first kind not caught (or a
/// legal step of its scenario that was refused).
pub fn run(options: &Options) -> Result<SelfTest, SanitizerError> {
    let mut out = SelfTest::default();
    for kind in ViolationKind::ALL.iter().copied() {
        if let Some(why) = off(kind, options) {
            out.skipped.push((kind, why));
            continue;
        }
        let bench = Bench::new(options)?;
        let v = bench.provoke(kind).map_err(|e| match e {
            SanitizerError::SelfTest { found, .. } => SanitizerError::SelfTest {
                kind: kind.name(),
                found,
            },
            other => other,
        })?;
        judge(kind, v)?;
        out.caught.push(kind);
    }
    Ok(out)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn every_kind_the_defaults_check_is_caught() {
        let t = run(&Options::default()).unwrap();
        assert_eq!(t.caught.len() + t.skipped.len(), ViolationKind::ALL.len());
        assert_eq!(
            t.skipped.iter().map(|(k, _)| *k).collect::<Vec<_>>(),
            [ViolationKind::PoisonRead]
        );
    }

    #[test]
    fn with_poison_every_kind_is_caught_and_global_sharing_skips_its_kind() {
        let t = run(&Options::parse("poison=1").unwrap()).unwrap();
        assert_eq!(t.caught.len(), ViolationKind::ALL.len());
        let t = run(&Options::parse("prefix_share=global:on_violation=halt").unwrap()).unwrap();
        assert!(
            t.skipped
                .iter()
                .any(|(k, _)| *k == ViolationKind::CrossDomainShare)
        );
    }

    #[test]
    fn a_kind_not_caught_refuses_to_start_naming_it() {
        // The provoking call of foreign-read answered Continue: a check that
        // stopped firing. The self-test fails naming the kind.
        let err = judge(ViolationKind::ForeignRead, Verdict::Continue).unwrap_err();
        assert!(
            matches!(
                err,
                SanitizerError::SelfTest {
                    kind: "foreign-read",
                    ..
                }
            ),
            "{err}"
        );
        assert!(err.to_string().contains("foreign-read"), "{err}");
        // The real checks pass: a sanitizer asked for the self-test starts.
        assert!(start(Options::parse("self_test=1").unwrap()).is_ok());
    }
}
