//! Leak-oracle scenarios: for every [`Fault`], a short script in the real
//! engine (synthetic model; disaggregated, or unified for the faults of a
//! node's own forward path) with a victim request of tenant A, a probe
//! request of tenant B and an unrelated bystander of tenant C.
//!
//! The oracle is noninterference: the probe's outcome must not depend on
//! the victim. Each scenario is run twice with victims that differ only in
//! their prompt (`victim_seed`); with the fault injected and no sanitizer the
//! probe's outcome differs (the fault really leaks), with the fault off it is
//! the same, and with the sanitizer the culprit is aborted with
//! [`Scenario::expected`] while the bystander finishes: the probe itself
//! when its read would see the victim's data, or the victim when its faulty
//! write would land in the probe's pages (then the probe's outcome is the
//! correct engine's).
//!
//! The same scripts back the engine's fault tests, `kvsan replay fault NAME`
//! and the shim's release-binary tests, so every way of running the
//! sanitizer is held to the same cases.

use std::sync::Arc;

use kvsan_sanitizer::{TenantId, ViolationKind};

use crate::EngineError;
use crate::engine::{Engine, EngineConfig, Output};
use crate::faults::{self, Fault};
use crate::hooks::Hooks;
use crate::model::{AttentionCheck, Model, SyntheticSpec};
use crate::prefix_cache::PrefixCachePolicy;
use crate::request::{Request, RequestError};
use crate::sampler::SamplingParams;

/// The tenants of every scenario.
pub const VICTIM_TENANT: TenantId = TenantId(1);
/// Tenant B, whose request must not see tenant A's data.
pub const PROBE_TENANT: TenantId = TenantId(2);
/// Tenant C, unrelated to both.
pub const BYSTANDER_TENANT: TenantId = TenantId(3);

/// How one run of a scenario ended, request by request.
#[derive(Debug)]
pub struct ScenarioRun {
    /// Tenant A's request (whose data must not leak).
    pub victim: Result<Output, RequestError>,
    /// Tenant B's request (which must not see it).
    pub probe: Result<Output, RequestError>,
    /// Tenant C's unrelated request, served alongside.
    pub bystander: Result<Output, RequestError>,
}

/// A run whose timing margin (stated beside each script) was missed, as
/// the engine's own counters show: what it saw says nothing of the fault.
#[derive(Debug)]
struct MissedMargin(String);

/// One run of a script: its outcome, or the margin it missed.
type Attempt = Result<ScenarioRun, MissedMargin>;

/// Fresh engines a script is run on before a missed margin is an error.
const MARGIN_ATTEMPTS: usize = 5;

/// What the victim's request is expected to do when the sanitizer is on.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum VictimEnd {
    /// It finishes normally.
    Finishes,
    /// The script itself cancels it (the fault acts on a cancelled request).
    Cancelled,
    /// It is aborted too: the fault makes it misuse pages as well (its own
    /// batch row moved with the probe's).
    Aborted,
}

/// The deployment a scenario runs in.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Topology {
    /// Prefill and decode nodes, linked in process.
    Disaggregated,
    /// One node computes prefill and decode.
    Unified,
}

/// Which request the sanitizer aborts.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Culprit {
    /// The probe, whose read would see the victim's data.
    Probe,
    /// The victim, whose faulty write or transfer would land in the probe's
    /// pages; the abort stops it before it lands, so the probe finishes with
    /// the output of a correct engine.
    Victim,
    /// No live request: the fault is made on behalf of a request that has
    /// already ended (a second free of its page at its release). The
    /// violation is reported against that request and the operation is
    /// refused, so no client sees an abort and the probe gets the output of
    /// a correct engine.
    Ended,
    /// No request: the prefix cache's registration of a page is refused
    /// (reported against the cache), so no client sees an abort and no
    /// request finds the page.
    Cache,
}

impl Culprit {
    /// `probe`, `victim` or `ended`.
    #[must_use]
    pub fn name(self) -> &'static str {
        match self {
            Culprit::Probe => "probe",
            Culprit::Victim => "victim",
            Culprit::Ended => "ended",
            Culprit::Cache => "cache",
        }
    }
}

/// One fault's leak-oracle script.
#[derive(Clone, Copy, Debug)]
pub struct Scenario {
    /// The fault the script provokes.
    pub fault: Fault,
    /// The violation kind the sanitizer reports.
    pub expected: ViolationKind,
    /// The request it aborts.
    pub culprit: Culprit,
    /// Whether the KV kernels' own generation check alone (no sanitizer)
    /// catches the fault, and which request it then aborts (with
    /// `generation-mismatch`).
    pub kernel_check: Option<Culprit>,
    /// How the victim ends when it is not the culprit.
    pub victim_end: VictimEnd,
    /// Where the script runs.
    pub topology: Topology,
    /// Engine settings of the scenario (pool sizes, limits).
    configure: fn(&mut EngineConfig),
    /// Submits the requests and waits for them.
    drive: fn(&Engine, u32) -> Attempt,
}

impl Scenario {
    /// The scenario of `fault`.
    #[must_use]
    pub fn of(fault: Fault) -> Scenario {
        match fault {
            Fault::RejectAsPlaceholder => Scenario {
                fault,
                expected: ViolationKind::TerminalRequestActivity,
                culprit: Culprit::Probe,
                kernel_check: None,
                victim_end: VictimEnd::Finishes,
                topology: Topology::Disaggregated,
                configure: |cfg| {
                    // The probe's 300 tokens are over the prefill pool.
                    cfg.prefill_pool_tokens = Some(256);
                    cfg.decode_pool_tokens = Some(1024);
                    cfg.allow_pool_smaller_than_context = true;
                },
                drive: |engine, seed| {
                    let v = engine.submit(victim(seed, 200, 8)).wait();
                    let bystander = engine.submit(bystander());
                    let p = engine.submit(probe(300, 16)).wait();
                    finish(v, p, &bystander)
                },
            },
            Fault::FreeDuringTransfer => Scenario {
                fault,
                expected: ViolationKind::TerminalRequestActivity,
                culprit: Culprit::Ended,
                kernel_check: None,
                victim_end: VictimEnd::Cancelled,
                topology: Topology::Disaggregated,
                configure: |cfg| {
                    // Small steps: the filler's prefill takes many of them.
                    // Decode holds the probe's whole answer next to the
                    // filler's and the victim's reservations.
                    cfg.scheduler.step_tokens = FDT_STEP_TOKENS;
                    cfg.decode_pool_tokens = Some(FDT_DECODE_POOL_TOKENS);
                },
                drive: free_during_transfer,
            },
            Fault::CommitAfterAbort => Scenario {
                fault,
                drive: commit_after_abort,
                // The settings, kind, culprit and victim's end of
                // free-during-transfer, whose script it shares.
                ..Scenario::of(Fault::FreeDuringTransfer)
            },
            Fault::ShortTransfer => Scenario {
                fault,
                expected: ViolationKind::ShortTransfer,
                culprit: Culprit::Probe,
                kernel_check: None,
                victim_end: VictimEnd::Finishes,
                topology: Topology::Disaggregated,
                configure: |_| {},
                drive: |engine, seed| {
                    // A short victim (one transfer piece, untouched by the
                    // fault) whose answer fills the decode pages the probe
                    // later gets back, then a probe sent in several pieces.
                    let v = engine.submit(victim(seed, 40, 200)).wait();
                    let bystander = engine.submit(bystander());
                    let p = engine.submit(probe(200, 16)).wait();
                    finish(v, p, &bystander)
                },
            },
            Fault::DescriptorOffsetDropped | Fault::BlockSizeMismatch => Scenario {
                fault,
                expected: ViolationKind::TransferDigestMismatch,
                culprit: Culprit::Probe,
                kernel_check: None,
                victim_end: VictimEnd::Finishes,
                topology: Topology::Disaggregated,
                configure: |_| {},
                drive: |engine, seed| {
                    // The victim's and the bystander's prompts end inside a
                    // page, so their messages take the partial-page path the
                    // fault leaves alone; the victim's long answer fills the
                    // decode pages the probe gets back. The probe's prompt
                    // goes in messages of whole pages: part of each lands
                    // elsewhere in its own pages (or nowhere), and the rest
                    // of its pages keep the victim's KV.
                    let v = engine.submit(victim(seed, 20, 200)).wait();
                    let bystander = engine.submit(bystander());
                    let p = engine.submit(probe(200, 16)).wait();
                    finish(v, p, &bystander)
                },
            },
            Fault::TransferReplayedAfterCommit => Scenario {
                fault,
                expected: ViolationKind::TerminalRequestActivity,
                culprit: Culprit::Ended,
                kernel_check: None,
                victim_end: VictimEnd::Finishes,
                topology: Topology::Disaggregated,
                configure: |_| {},
                drive: |engine, seed| {
                    // The victim's one message is kept for a retry; when
                    // the probe's prefill is done it goes again, after the
                    // probe's KV, and decode copies it into the pages the
                    // victim held — the probe's now (the freed pages are
                    // handed out again first). With the sanitizer the copy
                    // is refused, and the probe reads its own prompt.
                    let v = engine.submit(victim(seed, 20, 8)).wait();
                    let p = engine.submit(probe(24, 16)).wait();
                    let bystander = engine.submit(bystander());
                    finish(v, p, &bystander)
                },
            },
            Fault::SkipLayerWrite => Scenario {
                fault,
                expected: ViolationKind::StaleRead,
                culprit: Culprit::Probe,
                kernel_check: None,
                victim_end: VictimEnd::Finishes,
                topology: Topology::Disaggregated,
                configure: |_| {},
                drive: |engine, seed| {
                    // A victim and a bystander short enough for the intact
                    // store path; the probe's long prompt takes the broken
                    // one and gets the prefill pages the victim left, whose
                    // last layer still holds the victim's KV. The probe goes
                    // first so the bystander cannot take those pages.
                    let v = engine.submit(victim(seed, 60, 8)).wait();
                    let p = engine.submit(probe(200, 16));
                    let bystander = engine.submit(bystander());
                    finish(v, p.wait(), &bystander)
                },
            },
            Fault::StaleBlockTable => Scenario {
                fault,
                expected: ViolationKind::GenerationMismatch,
                culprit: Culprit::Probe,
                kernel_check: Some(Culprit::Probe),
                victim_end: VictimEnd::Finishes,
                topology: Topology::Disaggregated,
                configure: |cfg| {
                    // Decode holds the victim's prompt (32 pages) and the
                    // probe's one page, nothing more.
                    cfg.decode_pool_tokens = Some(33 * cfg.page_slots);
                    cfg.allow_pool_smaller_than_context = true;
                },
                drive: |engine, seed| {
                    // The victim's prompt fills whole pages, so its first
                    // decode step needs a page: it waits for the probe's
                    // reservation to commit, then preempts the probe and
                    // takes its page. The resumed probe (one page, which it
                    // never outgrows) reads through its kept table the
                    // decode KV the victim writes there.
                    let v = engine.submit(victim(seed, 512, 12));
                    let p = engine.submit(probe(4, 12));
                    let (v, p) = (v.wait(), p.wait());
                    let bystander = engine.submit(bystander());
                    finish(v, p, &bystander)
                },
            },
            Fault::DoubleFree => Scenario {
                fault,
                expected: ViolationKind::DoubleFree,
                culprit: Culprit::Ended,
                kernel_check: Some(Culprit::Probe),
                victim_end: VictimEnd::Finishes,
                topology: Topology::Disaggregated,
                configure: |cfg| cfg.page_slots = DF_PAGE_SLOTS,
                drive: |engine, seed| {
                    // The bystander ends first, alone: on both nodes its
                    // release puts its tail page L (the last of DF_PAGES
                    // pages; its answer fits them) on the free list twice.
                    // The probe, its prompt as many pages with the last
                    // half full, then reserves L, and the victim, submitted
                    // next, reserves L again: reservations go in
                    // submission order and the free list is a stack. The
                    // victim's one page is L: each of its first decode
                    // steps writes a slot of L that holds the probe's
                    // prompt KV, which the probe attends over at every step
                    // of its 64-token decode (the probe's own writes only
                    // reach L's upper half). The one race: the victim's
                    // reservation must come before the probe grows past L
                    // (else the probe takes L's second copy itself); the
                    // client sends the two submissions back to back, the
                    // probe grows only after its prefill round trip and
                    // DF_PAGE_SLOTS / 2 decode steps. On the prefill node
                    // the victim shares L with the probe only when both
                    // are in one step, and leaks there too then.
                    let bystander = engine
                        .submit(request(
                            BYSTANDER_TENANT,
                            vec![9; DF_BYSTANDER_TOKENS],
                            BYSTANDER_TOKENS,
                        ))
                        .wait();
                    let p = engine.submit(probe(DF_PROBE_TOKENS as u32, 64));
                    let v = engine.submit(victim(seed, DF_VICTIM_TOKENS as u32, 24));
                    Ok(ScenarioRun {
                        probe: p.wait(),
                        victim: v.wait(),
                        bystander,
                    })
                },
            },
            Fault::PaddingSlotWrap => Scenario {
                fault,
                expected: ViolationKind::ForeignWrite,
                culprit: Culprit::Victim,
                kernel_check: None,
                victim_end: VictimEnd::Finishes,
                topology: Topology::Disaggregated,
                configure: |cfg| {
                    // The prefill pool holds the victim's prompt and the
                    // probe's one page, nothing more: on a fresh pool
                    // (first-fit page order) the victim takes every page but
                    // the last, which the probe gets.
                    cfg.scheduler.step_tokens = PAD_STEP_TOKENS;
                    cfg.prefill_pool_tokens = Some(PAD_VICTIM_TOKENS + PAD_PROBE_TOKENS);
                    cfg.allow_pool_smaller_than_context = true;
                },
                drive: |engine, seed| {
                    // Prefill admits first come, first served, and the
                    // running victim takes the whole step budget until its
                    // last chunk (half a budget) leaves room for the probe's
                    // whole prompt: that step has two rows, is padded, and
                    // the padding (a copy of the victim's last row) writes
                    // the victim's KV into the probe's last prompt slot
                    // after the probe's own write, which the probe attends
                    // over and prefill ships. The probe's order is sent
                    // right after the victim's; the margin for it to reach
                    // the prefill node in time is the victim's whole
                    // chunked prefill (62 steps before its last chunk).
                    // The bystander comes after, alone, so it is never in a
                    // padded batch.
                    let v = engine.submit(victim(seed, PAD_VICTIM_TOKENS as u32, 8));
                    let p = engine.submit(probe(PAD_PROBE_TOKENS as u32, 16));
                    let (v, p) = (v.wait(), p.wait());
                    let bystander = engine.submit(bystander());
                    finish(v, p, &bystander)
                },
            },
            Fault::DecodeLengthOverrun => Scenario {
                fault,
                expected: ViolationKind::StaleRead,
                culprit: Culprit::Probe,
                kernel_check: None,
                victim_end: VictimEnd::Finishes,
                topology: Topology::Unified,
                configure: |_| {},
                drive: |engine, seed| {
                    // The victim's 400-token prompt fills 25 pages and it
                    // ends with its first token. The probe's 300-token
                    // prompt gets the first 19 of them back (the free list
                    // is a stack): its last page holds its tokens 288..300
                    // and the victim's 300..304. Past 256 tokens, the probe's
                    // decode reads its whole last page: the victim's KV, and
                    // past each page boundary the next page's.
                    let v = engine.submit(victim(seed, DLO_VICTIM_TOKENS, 1)).wait();
                    let p = engine.submit(probe(DLO_PROBE_TOKENS, 16)).wait();
                    let bystander = engine.submit(bystander());
                    finish(v, p, &bystander)
                },
            },
            Fault::BlockTableRowOrder => Scenario {
                fault,
                expected: ViolationKind::ForeignWrite,
                culprit: Culprit::Probe,
                kernel_check: None,
                victim_end: VictimEnd::Aborted,
                topology: Topology::Unified,
                configure: |cfg| cfg.scheduler.step_tokens = ROW_STEP_TOKENS,
                drive: |engine, seed| {
                    // The probe prefills, then decodes one token a step while
                    // the victim's prompt goes in chunks of the rest of the
                    // budget: each of those steps plans the probe's decode
                    // row first and the victim's chunk second, the kernel
                    // rows are sorted longest first, and the block-table
                    // rows are not: the probe's query reads, and its KV is
                    // stored into, the victim's pages (and the victim's into
                    // the probe's). The one race: the victim's submission,
                    // sent right after the probe's, must reach the node
                    // within the probe's 24 decode steps.
                    let p = engine.submit(probe(20, 24));
                    let v = engine.submit(victim(seed, 200, 8));
                    let (v, p) = (v.wait(), p.wait());
                    let bystander = engine.submit(bystander());
                    finish(v, p, &bystander)
                },
            },
            Fault::SlotMappingChunkOffset => Scenario {
                fault,
                expected: ViolationKind::StaleRead,
                culprit: Culprit::Probe,
                kernel_check: None,
                victim_end: VictimEnd::Finishes,
                topology: Topology::Unified,
                configure: |cfg| cfg.scheduler.step_tokens = SMO_STEP_TOKENS,
                drive: |engine, seed| {
                    // The victim's prompt is one chunk from token 0, and its
                    // answer's KV fills slots 8..15 of its third page. The
                    // probe gets its pages back; its second chunk starts at
                    // token 40, slot 8 of the third page, and is stored from
                    // slot 0: slots 8..15 keep the victim's KV, which the
                    // chunk's attention reads as the probe's tokens 40..47.
                    let v = engine
                        .submit(victim(seed, SMO_STEP_TOKENS as u32, 8))
                        .wait();
                    let p = engine.submit(probe(2 * SMO_STEP_TOKENS as u32, 16)).wait();
                    let bystander = engine.submit(bystander());
                    finish(v, p, &bystander)
                },
            },
            Fault::StaleBatchArray => Scenario {
                fault,
                expected: ViolationKind::WriteAfterFree,
                culprit: Culprit::Probe,
                kernel_check: None,
                victim_end: VictimEnd::Finishes,
                topology: Topology::Unified,
                configure: |_| {},
                drive: |engine, seed| {
                    // Victim and probe decode side by side, rows 0 and 1,
                    // two pages each (32 tokens). When the victim ends (its
                    // 12 tokens reach position 30), the probe moves to row
                    // 0, which held two pages last step, so the row is kept:
                    // until the probe needs its third page it stores into
                    // and attends over the victim's freed pages. The one
                    // race: the probe's submission must reach the node
                    // before the victim's 12 tokens are done. The node goes
                    // idle before the bystander, which resets the array.
                    let v = engine.submit(victim(seed, 20, 12));
                    let p = engine.submit(probe(20, 16));
                    let (v, p) = (v.wait(), p.wait());
                    let bystander = engine.submit(bystander());
                    finish(v, p, &bystander)
                },
            },
            Fault::OverlappingTransfer => Scenario {
                fault,
                expected: ViolationKind::MisdirectedTransfer,
                culprit: Culprit::Victim,
                kernel_check: None,
                victim_end: VictimEnd::Finishes,
                topology: Topology::Disaggregated,
                configure: |cfg| {
                    // Decode holds the probe's and the victim's prompts and
                    // nothing more, so the probe's first decode page waits
                    // until the victim's transfer has landed and the victim
                    // has ended. The probe's prompt is whole prefill steps:
                    // the victim's first chunk comes in a later step, so the
                    // probe's KV ships, and lands, first.
                    cfg.decode_pool_tokens = Some(OVL_DECODE_PAGES * cfg.page_slots);
                    cfg.scheduler.step_tokens = OVL_STEP_TOKENS;
                    cfg.allow_pool_smaller_than_context = true;
                },
                drive: |engine, seed| {
                    // On the fresh decode pool (first-fit page order) the
                    // probe, submitted first, reserves pages 0..3 and the
                    // victim 3..6. The victim's prompt ends on a page
                    // boundary, so its transfer lands one page early: its
                    // first page's KV overwrites page 2, the probe's last
                    // prompt page (prompt KV in slots 0..8, its first decode
                    // tokens after). The probe's own transfer starts at page
                    // 0 and is written where it belongs. The probe decodes 8
                    // tokens, then waits for a page until the victim (one
                    // token) ends, and reads the overwritten page for the
                    // rest of its answer. The one race: the victim's
                    // submission, sent right after the probe's, must reach
                    // the decode node before the probe's prefill (5 steps)
                    // and first 8 decode steps are done.
                    let p = engine.submit(probe(OVL_PROBE_TOKENS as u32, 48));
                    let v = engine.submit(victim(seed, OVL_VICTIM_TOKENS as u32, 1));
                    let (v, p) = (v.wait(), p.wait());
                    let bystander = engine.submit(bystander());
                    finish(v, p, &bystander)
                },
            },
            Fault::CacheRegisterBeforeWrite => Scenario {
                fault,
                expected: ViolationKind::UnwrittenShare,
                culprit: Culprit::Cache,
                kernel_check: None,
                victim_end: VictimEnd::Finishes,
                topology: Topology::Unified,
                configure: configure_slow_prefill,
                drive: |engine, seed| {
                    // The victim's one partial page goes back to the top of
                    // the free list. The probe's tenant's first request H
                    // gets it as its first page, and fills it one token a
                    // step (256 steps). Under the fault the page is in the
                    // cache from its allocation, keyed by the 256 prompt
                    // tokens it is to hold; the probe, admitted a step or
                    // two later with the same first 256 tokens, shares it and
                    // attends over the slots H has not reached: the
                    // victim's KV. The one margin: the probe's submission,
                    // sent right after H's, must be admitted within H's 256
                    // steps. With the sanitizer the registration is refused
                    // (the page is not written) and the probe computes its
                    // prompt itself.
                    let v = engine.submit(victim(seed, SLOW_VICTIM_TOKENS, 3)).wait();
                    let h = engine.submit(probe(SLOW_HELPER_TOKENS, 1));
                    let p = engine.submit(probe(SLOW_PROBE_TOKENS, 8));
                    let (p, _) = (p.wait(), h.wait());
                    let bystander = engine.submit(bystander());
                    finish(v, p, &bystander)
                },
            },
            Fault::CacheKeepsAborted => Scenario {
                fault,
                drive: |engine, seed| {
                    // The victim's partial page goes back to the top of the
                    // free list; H (the probe's tenant) gets it as its first
                    // page and is cancelled a few of its 256 one-token steps
                    // in. Under the fault H's release registers the page
                    // under the 256 prompt tokens it was to hold, and the
                    // probe, with those tokens, attends over the victim's
                    // KV in the slots H never wrote. The margin: the cancel
                    // is sent once H runs and must land within its 256
                    // steps; a run where it did not (the node's step count
                    // says so) is run again on a fresh engine. With the
                    // sanitizer the registration is refused.
                    let v = engine.submit(victim(seed, SLOW_VICTIM_TOKENS, 3)).wait();
                    let before = engine.stats().front.steps;
                    let h = engine.submit(probe(SLOW_HELPER_TOKENS, 1));
                    let deadline = std::time::Instant::now() + std::time::Duration::from_secs(60);
                    // Each stats answer comes between two steps: no sleep,
                    // so the cancel follows H's admission by a step or two.
                    while engine.stats().front.running == 0 && std::time::Instant::now() < deadline
                    {
                        std::thread::yield_now();
                    }
                    engine.cancel(h.id);
                    let _ = h.wait();
                    // Nothing else runs: the node's steps since the victim
                    // ended are H's, one prompt token each.
                    let h_steps = engine.stats().front.steps - before;
                    if h_steps >= SLOW_PAGE_SLOTS as u64 {
                        return Err(MissedMargin(format!(
                            "H was cancelled after {h_steps} one-token steps, its first page full"
                        )));
                    }
                    let p = engine.submit(probe(SLOW_PROBE_TOKENS, 8)).wait();
                    let bystander = engine.submit(bystander());
                    finish(v, p, &bystander)
                },
                // The kind, culprit and settings of `cache-register-before-write`.
                ..Scenario::of(Fault::CacheRegisterBeforeWrite)
            },
            Fault::CacheSaltDropped => Scenario {
                fault,
                expected: ViolationKind::CrossDomainShare,
                culprit: Culprit::Probe,
                kernel_check: None,
                victim_end: VictimEnd::Finishes,
                topology: Topology::Unified,
                configure: |cfg| cfg.prefix_cache = PrefixCachePolicy::Salt,
                drive: |engine, seed| {
                    // The victim's key carries a server-side salt; under the
                    // fault its pages are registered without it, and the
                    // unsalted probe of another tenant finds them.
                    timing_leak(engine, seed, ("victim-key", None))
                },
            },
            Fault::CacheKeyCollision => Scenario {
                fault,
                drive: |engine, seed| {
                    // The victim's key has the server-side salt `ab`; the
                    // probe, of another tenant, sends `cache_salt: "ab"`.
                    // Typed, the two salts are different keys; under the
                    // fault they are the same bytes.
                    timing_leak(engine, seed, ("ab", Some("ab")))
                },
                // The kind, culprit and settings of `cache-salt-dropped`.
                ..Scenario::of(Fault::CacheSaltDropped)
            },
            Fault::CacheEvictReferenced => Scenario {
                fault,
                expected: ViolationKind::DoubleAlloc,
                culprit: Culprit::Victim,
                kernel_check: Some(Culprit::Probe),
                victim_end: VictimEnd::Finishes,
                topology: Topology::Unified,
                configure: |cfg| {
                    cfg.prefix_cache = PrefixCachePolicy::Tenant;
                    cfg.pool_tokens = Some(EVICT_POOL_PAGES * cfg.page_slots);
                    cfg.allow_pool_smaller_than_context = true;
                },
                drive: |engine, seed| {
                    // H (the probe's tenant) leaves its prompt's 3 pages in
                    // the cache; the probe, admitted first (first come,
                    // first served), shares the first two and takes one of
                    // the 8 free pages. The victim's prompt needs 10 pages:
                    // eviction takes the one unreferenced cached page, then,
                    // under the fault, the oldest cached page though the
                    // probe reads it, and the pool hands it to the victim,
                    // whose prompt KV the probe then attends over (in the
                    // same step when both are admitted together, else within
                    // the probe's 48 decode steps). With the sanitizer the
                    // allocation of a page still held is refused
                    // (double-alloc) and the victim aborted before it
                    // writes; the probe's pages are untouched.
                    let _ = engine.submit(probe(TIMING_TOKENS, 1)).wait();
                    let p = engine.submit(probe(TIMING_TOKENS, EVICT_PROBE_ANSWER));
                    let v = engine.submit(victim(seed, EVICT_VICTIM_TOKENS, 1));
                    let (p, v) = (p.wait(), v.wait());
                    let bystander = engine.submit(bystander());
                    finish(v, p, &bystander)
                },
            },
            Fault::CachePartialPageShared => Scenario {
                fault,
                expected: ViolationKind::UnwrittenShare,
                culprit: Culprit::Cache,
                kernel_check: None,
                victim_end: VictimEnd::Finishes,
                topology: Topology::Unified,
                configure: |cfg| cfg.prefix_cache = PrefixCachePolicy::Tenant,
                drive: |engine, seed| {
                    // Two users of one tenant (the cache may share their
                    // prompts' full pages, never their answers). The probe's
                    // 40-token prompt ends half-way into its third page,
                    // which under the fault is registered after its
                    // prefill, partial. The victim's prompt is the probe's
                    // plus 8 tokens of its own: it shares the two full
                    // pages and the partial one, without a copy, and writes
                    // its 8 tokens' KV into the slots the probe's answer
                    // goes to, which the probe attends over. With the
                    // sanitizer the partial page's registration is refused
                    // (not every slot written) and the victim computes its
                    // own copy.
                    let p = engine.submit(probe(PARTIAL_PROBE_TOKENS, PARTIAL_PROBE_ANSWER));
                    let first = p.events.recv();
                    let mut prompt = probe(PARTIAL_PROBE_TOKENS, 1).prompt;
                    prompt.extend(victim(seed, 8, 1).prompt);
                    let v = engine.submit(request(PROBE_TENANT, prompt, 1));
                    let p = with_first(first, &p);
                    let v = v.wait();
                    let bystander = engine.submit(bystander());
                    finish(v, p, &bystander)
                },
            },
            Fault::TierLoadFailedAsHit => Scenario {
                fault,
                expected: ViolationKind::TierDigestMismatch,
                culprit: Culprit::Probe,
                kernel_check: None,
                victim_end: VictimEnd::Finishes,
                topology: Topology::Unified,
                configure: preempting_to_the_host_tier,
                drive: |engine, seed| {
                    // The probe is admitted first; the victim's 512-token
                    // prompt fills the rest of the pool, so its first
                    // decode step needs a page and preempts the probe,
                    // whose one page goes to the host tier. The victim
                    // finishes and lets go of its pages; the probe comes
                    // back into the first of them (the free list is a
                    // stack). Under the fault the tier's read is lost and
                    // counted done: the probe decodes on over the victim's
                    // prompt KV. With the sanitizer the digest of what
                    // landed is not the stored one.
                    probe_preempted_by_the_victim(engine, seed)
                },
            },
            Fault::TierTwoPagesOneBlock => Scenario {
                fault,
                expected: ViolationKind::TierBlockAliased,
                culprit: Culprit::Cache,
                kernel_check: None,
                victim_end: VictimEnd::Finishes,
                topology: Topology::Unified,
                configure: |cfg| caching_down_the_host_tier(cfg, TTP_POOL_PAGES),
                drive: |engine, seed| {
                    // The probe's tenant's first request H leaves one
                    // cached prompt page, the victim two; with the pages
                    // they let go of, the pool is full. The filler's prompt
                    // needs the whole pool: one allocation evicts the three
                    // cached pages, H's first, in one step, each down the
                    // host tier. Under the fault all three are stored into
                    // H's block, which ends up holding the victim's first
                    // page; the probe, with H's prompt, hits H's page in
                    // the tier and loads the victim's KV. With the
                    // sanitizer each store after the first into the block
                    // is refused (reported against the cache, whose stores
                    // they are) and the victim's pages are dropped: the
                    // probe loads H's page as a correct engine serves it.
                    let h = engine.submit(probe(TTP_PROBE, 1)).wait();
                    let v = engine.submit(victim(seed, TTP_VICTIM, 1)).wait();
                    let filler = engine.submit(filler(TTP_POOL_PAGES * 16)).wait();
                    let p = engine.submit(probe(TTP_PROBE, 1)).wait();
                    drop((h, filler));
                    let bystander = engine.submit(bystander());
                    finish(v, p, &bystander)
                },
            },
            Fault::TierMetaByPageId => Scenario {
                fault,
                expected: ViolationKind::TierForeignLoad,
                culprit: Culprit::Probe,
                kernel_check: None,
                victim_end: VictimEnd::Finishes,
                topology: Topology::Unified,
                configure: |cfg| caching_down_the_host_tier(cfg, TMP_POOL_PAGES),
                drive: |engine, seed| {
                    // A pool of three pages. H (the probe's tenant) leaves
                    // three cached pages; the victim's allocation evicts
                    // them down the host tier, H's last first, so the
                    // victim's last page is the page H's first came from;
                    // the filler's evicts the victim's pages down the tier
                    // in turn, its last first. Under the fault the tier files blocks by
                    // the pool page they came from: the probe, with H's
                    // prompt, hits H's first page in the tier and is handed
                    // the block filed last under its page, the victim's
                    // second page's KV. With the sanitizer that block's
                    // load by another tenant is refused and the probe is
                    // aborted.
                    let h = engine.submit(probe(TMP_PROMPT, 1)).wait();
                    let v = engine.submit(victim(seed, TMP_PROMPT, 1)).wait();
                    let filler = engine.submit(filler(TMP_PROMPT as usize)).wait();
                    let p = engine.submit(probe(TMP_PROMPT, 1)).wait();
                    drop((h, filler));
                    let bystander = engine.submit(bystander());
                    finish(v, p, &bystander)
                },
            },
            Fault::TierStoreAfterReuse => Scenario {
                fault,
                expected: ViolationKind::TierStoreSourceReused,
                culprit: Culprit::Probe,
                kernel_check: None,
                victim_end: VictimEnd::Finishes,
                topology: Topology::Unified,
                configure: preempting_to_the_host_tier,
                drive: |engine, seed| {
                    // The victim's first decode step preempts the probe to
                    // the host tier. Under the fault the probe's page is
                    // freed before its copy is made: the victim takes it
                    // and writes its first decoded token's KV into it in
                    // that step, and the copy, made at the next step, takes
                    // that KV into the probe's block. The probe comes back
                    // from the block and attends over the victim's KV at
                    // its own first position. With the sanitizer the
                    // store's completion finds its source page
                    // re-allocated, and the probe ends there.
                    probe_preempted_by_the_victim(engine, seed)
                },
            },
        }
    }

    /// Every fault's scenario.
    pub fn all() -> impl Iterator<Item = Scenario> {
        Fault::ALL.into_iter().map(Scenario::of)
    }

    /// The engine configuration of the scenario with `hooks` and `check`.
    #[must_use]
    pub fn config(&self, hooks: Hooks, check: AttentionCheck) -> EngineConfig {
        let mut cfg = EngineConfig {
            hooks,
            check,
            ..EngineConfig::default()
        };
        (self.configure)(&mut cfg);
        cfg
    }

    /// Runs the script once on a fresh disaggregated engine over `model`
    /// (any model whose vocabulary has at least 256 tokens), with the fault
    /// injected if `inject`. The process-wide fault switch is set for the
    /// run and cleared after it: callers running scenarios concurrently in
    /// one process must take turns.
    ///
    /// # Errors
    /// The engine could not be built (a configuration the model refuses).
    pub fn run(
        &self,
        model: &Arc<Model>,
        hooks: Hooks,
        check: AttentionCheck,
        victim_seed: u32,
        inject: bool,
    ) -> Result<ScenarioRun, EngineError> {
        self.until_in_margin(|| {
            let cfg = self.config(hooks.clone(), check);
            let engine = match self.topology {
                Topology::Disaggregated => Engine::disaggregated(model.clone(), &cfg)?,
                Topology::Unified => Engine::unified(model.clone(), &cfg)?,
            };
            self.attempt(&engine, victim_seed, inject)
        })
    }

    /// Runs `once` (the script on a fresh deployment) until a run keeps
    /// its timing margin, at most [`MARGIN_ATTEMPTS`] times.
    fn until_in_margin(
        &self,
        mut once: impl FnMut() -> Result<Attempt, EngineError>,
    ) -> Result<ScenarioRun, EngineError> {
        let mut missed = Vec::new();
        while missed.len() < MARGIN_ATTEMPTS {
            match once()? {
                Ok(run) => return Ok(run),
                Err(MissedMargin(why)) => missed.push(why),
            }
        }
        Err(self.missed(&missed.join("; ")))
    }

    fn missed(&self, why: &str) -> EngineError {
        EngineError::Config {
            what: format!(
                "scenario {}: the script's timing margin was missed ({why})",
                self.fault.name()
            ),
        }
    }

    /// As [`Scenario::run`], on a deployment whose prefill node has hooks of
    /// its own (`prefill_hooks`), as when the two nodes are separate
    /// processes each with its own sanitizer: a decode engine and a prefill
    /// node served on a thread, linked in-process.
    ///
    /// # Errors
    /// The engine could not be built, or the scenario runs on a unified node.
    pub fn run_separate(
        &self,
        model: &Arc<Model>,
        decode_hooks: Hooks,
        prefill_hooks: Hooks,
        check: AttentionCheck,
        victim_seed: u32,
        inject: bool,
    ) -> Result<ScenarioRun, EngineError> {
        if self.topology == Topology::Unified {
            return Err(EngineError::Config {
                what: format!("scenario {} runs on a unified node", self.fault.name()),
            });
        }
        self.until_in_margin(|| {
            self.attempt_separate(
                model,
                &decode_hooks,
                &prefill_hooks,
                check,
                victim_seed,
                inject,
            )
        })
    }

    /// One run of [`Scenario::run_separate`] on a fresh deployment.
    fn attempt_separate(
        &self,
        model: &Arc<Model>,
        decode_hooks: &Hooks,
        prefill_hooks: &Hooks,
        check: AttentionCheck,
        victim_seed: u32,
        inject: bool,
    ) -> Result<Attempt, EngineError> {
        let engine = Engine::decode_only(model.clone(), &self.config(decode_hooks.clone(), check))?;
        let prefill_cfg = self.config(prefill_hooks.clone(), check);
        let pair = crate::transport::in_process::pair();
        let mut link = Some((pair.to_decode, pair.prefill_inbox));
        let (control, inbox) = crate::engine::PrefillControl::new();
        let prefill_model = model.clone();
        let prefill = std::thread::Builder::new()
            .name("kvsan-scenario-prefill".into())
            .spawn(move || {
                crate::engine::serve_prefill(prefill_model, &prefill_cfg, inbox, || {
                    let (tx, rx) = link.take()?;
                    Some((Box::new(tx) as Box<dyn crate::transport::Link<_>>, rx))
                })
            })
            .map_err(|e| EngineError::io("scenario", "spawn the prefill node", e))?;
        engine.attach_prefill(Box::new(pair.to_prefill), pair.decode_inbox);
        let run = self.attempt(&engine, victim_seed, inject);
        drop(engine);
        control.shutdown();
        prefill.join().map_err(|_| EngineError::Config {
            what: "the scenario's prefill node panicked".into(),
        })??;
        run
    }

    /// Drives the script on `engine` (built from [`Scenario::config`], with
    /// any settings of the caller's own) with the fault switch set for the
    /// run, as [`Scenario::run`] does.
    ///
    /// # Errors
    /// An injection asked of a build without fail points, or a run that
    /// missed its timing margin (the engine is not fresh after it, so it
    /// is not run again).
    pub fn run_on(
        &self,
        engine: &Engine,
        victim_seed: u32,
        inject: bool,
    ) -> Result<ScenarioRun, EngineError> {
        self.attempt(engine, victim_seed, inject)?
            .map_err(|MissedMargin(why)| self.missed(&why))
    }

    /// One run of the script on `engine`, as [`Scenario::run_on`].
    fn attempt(
        &self,
        engine: &Engine,
        victim_seed: u32,
        inject: bool,
    ) -> Result<Attempt, EngineError> {
        // The switch only exists in builds with the feature; without it
        // `set(&[])` is accepted and an injection request is refused below.
        let faults: &[Fault] = if inject {
            std::slice::from_ref(&self.fault)
        } else {
            &[]
        };
        faults::set(faults).map_err(|what| EngineError::Config { what })?;
        let run = (self.drive)(engine, victim_seed);
        let _ = faults::set(&[]);
        Ok(run)
    }
}

/// `free-during-transfer`: the probe decodes while the victim, cancelled
/// with its KV on the way, is prefilled behind a long filler prompt. The
/// cancel frees the victim's decode pages; the probe's next page (one every
/// 16 decode tokens) comes off the top of the free list, one of them, and
/// holds its decode KV; under the fault the victim's KV lands there after
/// the filler's prefill, and the probe reads it for the rest of its answer.
/// With the sanitizer, prefill, never told of the cancel, computes and
/// ships the victim legally (its own view of the request is live); decode,
/// which aborted it, receives the late KV, and that receipt is refused
/// (terminal-request-activity) before a byte lands, so the probe gets a
/// correct engine's answer.
///
/// Orderings: reservations and prefills go in submission order, so the
/// filler's prefill comes before the victim's; the cancel is sent once the
/// victim's order has reached prefill (seen in its stats), so decode holds
/// the victim as transferring when the cancel comes. Margins, each in the
/// cheap one-token decode steps against the costlier prefill steps: the
/// cancel must reach decode before the filler's `FDT_FILLER_TOKENS /
/// FDT_STEP_TOKENS` = 32 prefill steps are done; the probe needs at most 16
/// decode steps to take a freed page before the victim's KV lands, and its
/// `FDT_PROBE_ANSWER` = 4,000 decode steps must outlast the filler's and the
/// victim's 39 prefill steps. Measured on a loaded 2-core machine, the
/// victim's KV landed 400 to 520 decode steps after the cancel, at the
/// probe's step 540 to 600: about 25 times the first bound, a sixth of the
/// second.
fn free_during_transfer(engine: &Engine, seed: u32) -> Attempt {
    cancel_behind_filler(engine, victim(seed, FDT_VICTIM_TOKENS, 8))
}

/// `commit-after-abort`: the script of `free-during-transfer`, with a
/// victim of three prefill chunks (`CAA_VICTIM_TOKENS`, three decode
/// pages). The cancel frees the victim's decode pages and leaves its record;
/// the probe's next three pages (one every 16 decode steps) come off the top
/// of the free list, the victim's, and hold its decode KV. Under the fault
/// the victim's KV, computed after the filler's, is dropped, but its
/// completion is committed: the victim decodes its 8 tokens through its old
/// block table, and its first 7 write their KV into slots 8 to 14 of its
/// last page, the probe's third new page, which the probe attends over for
/// the rest of its answer. With the sanitizer, prefill, never told, computes
/// and ships the victim legally; decode drops its KV and commits its
/// completion, and the commit of a request decode aborted is refused
/// (terminal-request-activity) before the victim decodes a step, so the
/// probe gets a correct engine's answer.
///
/// The margins are those of `free-during-transfer` with 48 decode steps
/// (three pages) in place of 16 for the probe to take the victim's pages
/// before the victim's completion comes, which was 400 to 520 decode steps
/// after the cancel on a loaded 2-core machine.
fn commit_after_abort(engine: &Engine, seed: u32) -> Attempt {
    cancel_behind_filler(engine, victim(seed, CAA_VICTIM_TOKENS, 8))
}

/// The script `free-during-transfer` and `commit-after-abort` share: a
/// probe decoding a long answer, then a filler whose prefill keeps the
/// `victim`'s back, then the victim, cancelled once its order waits at
/// prefill.
fn cancel_behind_filler(engine: &Engine, victim: Request) -> Attempt {
    let p = engine.submit(probe(FDT_PROBE_TOKENS, FDT_PROBE_ANSWER));
    // The probe decodes (and is done on prefill) before the others come.
    let first = p.events.recv();
    let filler = engine.submit(request(BYSTANDER_TENANT, vec![11; FDT_FILLER_TOKENS], 1));
    let v = engine.submit(victim);
    // Prefill holds the filler and the victim's order: decode has reserved
    // the victim's pages and waits for its KV.
    let deadline = std::time::Instant::now() + std::time::Duration::from_secs(60);
    while std::time::Instant::now() < deadline {
        // With the prefill node out of sight (its own process), decode's
        // count of requests waiting on it says the same: both orders are
        // sent, and the link keeps them ahead of any cancel.
        let stats = engine.stats();
        let queued = stats
            .prefill
            .map_or(stats.front.waiting, |s| s.running + s.waiting);
        if queued >= 2 {
            break;
        }
        std::thread::sleep(std::time::Duration::from_millis(1));
    }
    engine.cancel(v.id);
    let probe = with_first(first, &p);
    let victim = v.wait();
    let _ = filler.wait();
    let bystander = engine.submit(bystander());
    finish(victim, probe, &bystander)
}

/// The tier scenarios' pool: the victim's 512-token prompt (32 pages) and
/// the probe's one page; preempted pages go to a host tier.
fn preempting_to_the_host_tier(cfg: &mut EngineConfig) {
    cfg.pool_tokens = Some(33 * cfg.page_slots);
    cfg.allow_pool_smaller_than_context = true;
    cfg.kv_offload_host_bytes = 16 << 20;
}

/// A pool of `pages` pages of 16 slots whose prefix cache (per tenant)
/// sends evicted pages down a host tier.
fn caching_down_the_host_tier(cfg: &mut EngineConfig, pages: usize) {
    cfg.page_slots = 16;
    cfg.pool_tokens = Some(pages * 16);
    cfg.allow_pool_smaller_than_context = true;
    cfg.prefix_cache = PrefixCachePolicy::Tenant;
    cfg.kv_offload_host_bytes = 16 << 20;
}

/// The bystander's tenant's request of `len` prompt tokens, the same in
/// every run: it takes the pool's pages.
fn filler(len: usize) -> Request {
    let prompt = (0..len as u32).map(|i| (i * 11 + 3) % 256).collect();
    request(BYSTANDER_TENANT, prompt, 1)
}

/// `tier-two-pages-one-block`: pages of the pool, H's two and the
/// victim's two.
const TTP_POOL_PAGES: usize = 4;
/// `tier-two-pages-one-block`: H's and the probe's prompt, one full page
/// and a token.
const TTP_PROBE: u32 = 17;
/// `tier-two-pages-one-block`: the victim's prompt, two full pages.
const TTP_VICTIM: u32 = 32;
/// `tier-meta-by-page-id`: pages of the pool.
const TMP_POOL_PAGES: usize = 3;
/// `tier-meta-by-page-id`: every prompt, the whole pool.
const TMP_PROMPT: u32 = 48;

/// The probe is admitted first; the victim's prompt fills the rest of the
/// pool, so its first decode step needs a page and preempts the probe to
/// the host tier; the probe comes back once the victim is done.
fn probe_preempted_by_the_victim(engine: &Engine, seed: u32) -> Result<ScenarioRun, MissedMargin> {
    let p = engine.submit(probe(4, 12));
    let v = engine.submit(victim(seed, 512, 12));
    let (v, p) = (v.wait(), p.wait());
    let bystander = engine.submit(bystander());
    finish(v, p, &bystander)
}

/// `free-during-transfer`: the step budget of both nodes.
const FDT_STEP_TOKENS: usize = 16;
/// `free-during-transfer`: the decode pool, room for the probe's whole
/// answer and the others' reservations.
const FDT_DECODE_POOL_TOKENS: usize = 8192;
/// `free-during-transfer`: the probe's prompt.
const FDT_PROBE_TOKENS: u32 = 20;
/// `free-during-transfer`: the probe's answer, long enough to go on well
/// after the victim's KV lands.
const FDT_PROBE_ANSWER: usize = 4000;
/// `free-during-transfer`: the filler's prompt, whose prefill keeps the
/// victim's back.
const FDT_FILLER_TOKENS: usize = 512;
/// `free-during-transfer`: the victim's prompt, seven decode pages.
const FDT_VICTIM_TOKENS: u32 = 100;

/// `commit-after-abort`: the victim's prompt, three prefill chunks and
/// three decode pages, the last half full.
const CAA_VICTIM_TOKENS: u32 = 40;

/// `padding-slot-wrap`: the prefill step budget.
const PAD_STEP_TOKENS: usize = 32;
/// `padding-slot-wrap`: the victim's prompt, whole budgets and half a
/// budget, so its last chunk leaves room for the probe's whole prompt.
const PAD_VICTIM_TOKENS: usize = 62 * PAD_STEP_TOKENS + PAD_STEP_TOKENS / 2;
/// `padding-slot-wrap`: the probe's prompt, one page (of the default 16
/// slots), so its last prompt slot is the prefill pool's last slot.
const PAD_PROBE_TOKENS: usize = 16;

/// `double-free`: slots per page.
const DF_PAGE_SLOTS: usize = 16;
/// `double-free`: pages the bystander and the probe each hold; the last is
/// the one freed twice.
const DF_PAGES: usize = 3;
/// `double-free`: the bystander's prompt; with its answer it stays within
/// `DF_PAGES` pages on decode, as on prefill.
const DF_BYSTANDER_TOKENS: usize = (DF_PAGES - 1) * DF_PAGE_SLOTS + 4;
/// `double-free`: the probe's prompt, half of its last page.
const DF_PROBE_TOKENS: usize = (DF_PAGES - 1) * DF_PAGE_SLOTS + DF_PAGE_SLOTS / 2;
/// `double-free`: the victim's prompt, the first slots of its one page.
const DF_VICTIM_TOKENS: usize = 2;

/// `decode-length-overrun`: the victim's prompt, 25 pages of 16 slots.
const DLO_VICTIM_TOKENS: u32 = 400;
/// `decode-length-overrun`: the probe's prompt, past the long-decode
/// threshold and ending inside a page.
const DLO_PROBE_TOKENS: u32 = 300;

/// `block-table-row-order`: the step budget, so the victim's prompt takes
/// several steps beside the probe's decode.
const ROW_STEP_TOKENS: usize = 32;

/// `slot-mapping-chunk-offset`: the step budget, two and a half pages (of
/// the default 16 slots), so the probe's second chunk starts mid-page.
const SMO_STEP_TOKENS: usize = 40;

/// `overlapping-transfer`: the probe's prompt, two and a half pages (of
/// the default 16 slots), so its last page holds prompt and decode KV.
const OVL_PROBE_TOKENS: usize = 40;
/// `overlapping-transfer`: the victim's prompt, three whole pages: its one
/// transfer message ends on a page boundary.
const OVL_VICTIM_TOKENS: usize = 48;
/// `overlapping-transfer`: the prefill step budget, a divisor of the
/// probe's prompt.
const OVL_STEP_TOKENS: usize = 8;
/// `overlapping-transfer`: decode pages, the probe's three and the victim's
/// three.
const OVL_DECODE_PAGES: usize = 6;

/// The model every scenario is written for.
///
/// # Errors
/// Never in practice (the synthetic model's build is infallible for its
/// default specification); the error is passed on rather than unwrapped.
pub fn scenario_model() -> Result<Arc<Model>, EngineError> {
    Ok(Arc::new(SyntheticSpec::default().build()?))
}

/// Page size and per-sequence chunk of the `cache-register-before-write`
/// and `cache-keeps-aborted` scripts: a page takes `SLOW_PAGE_SLOTS`
/// one-token steps to fill, the margin for the probe's admission or H's
/// cancel.
fn configure_slow_prefill(cfg: &mut EngineConfig) {
    cfg.prefix_cache = PrefixCachePolicy::Tenant;
    cfg.page_slots = SLOW_PAGE_SLOTS;
    cfg.scheduler.chunk_tokens = Some(1);
}

/// Page slots of the slow-prefill scripts.
const SLOW_PAGE_SLOTS: usize = 256;
/// Their victim: one partial page.
const SLOW_VICTIM_TOKENS: u32 = 200;
/// H's prompt: two pages.
const SLOW_HELPER_TOKENS: u32 = 512;
/// The probe's prompt: H's first page and 64 tokens more.
const SLOW_PROBE_TOKENS: u32 = 320;

/// Prompt tokens of the timing scripts' probe (three 16-slot pages).
const TIMING_TOKENS: u32 = 48;

/// The timing scripts' victim: a prompt equal to the probe's (victim 1) or
/// its own (any other), so whether the probe finds it in the cache is what
/// the victim asked.
fn timing_victim(seed: u32) -> Request {
    let mut v = victim(seed, TIMING_TOKENS, 1);
    if seed == 1 {
        v.prompt = probe(TIMING_TOKENS, 1).prompt;
    }
    v
}

/// The script of the cache's timing leaks: the victim (its key's salt
/// `salts.0`) then the probe of another tenant (its `cache_salt`
/// `salts.1`). The probe finds the victim's prompt in the cache, under the
/// fault, when it begins like the probe's (victim 1) and not otherwise
/// (victim 2): its `cached_tokens` (and its time to first token) tell it
/// what another tenant asked.
fn timing_leak(engine: &Engine, seed: u32, salts: (&str, Option<&str>)) -> Attempt {
    let mut v = timing_victim(seed);
    v.cache_salt.server = Some(salts.0.into());
    let v = engine.submit(v).wait();
    let mut p = probe(TIMING_TOKENS, 4);
    p.cache_salt.client = salts.1.map(Into::into);
    let p = engine.submit(p).wait();
    let bystander = engine.submit(bystander());
    finish(v, p, &bystander)
}

/// Pages of the `cache-evict-referenced` pool.
const EVICT_POOL_PAGES: usize = 12;
/// The probe's answer there (decode steps it reads the shared pages).
const EVICT_PROBE_ANSWER: usize = 48;
/// The victim's prompt there: more pages than the probe leaves free.
const EVICT_VICTIM_TOKENS: u32 = 150;

/// The `cache-partial-page-shared` probe's prompt: two pages and a half.
const PARTIAL_PROBE_TOKENS: u32 = 40;
/// Its answer: decode steps during which the victim's write into the
/// shared partial page reaches it (the margin for the victim's submission,
/// sent at the probe's first token).
const PARTIAL_PROBE_ANSWER: usize = 1000;

/// The outcome of `handle`, whose first event was already taken (`first`).
fn with_first(
    first: Result<crate::request::Event, crossbeam_channel::RecvError>,
    handle: &crate::engine::RequestHandle,
) -> Result<Output, RequestError> {
    match first {
        Ok(crate::request::Event::Token(t)) => handle.wait().map(|mut out| {
            out.tokens.insert(0, t);
            out
        }),
        Ok(crate::request::Event::Error(e)) => Err(e),
        Ok(crate::request::Event::Finished {
            reason,
            cached_tokens,
            ..
        }) => Ok(Output {
            tokens: Vec::new(),
            reason,
            cached_tokens,
        }),
        Err(_) => handle.wait(),
    }
}

/// Tenant A's request: `len` prompt tokens that depend on `seed`.
#[must_use]
pub fn victim(seed: u32, len: u32, max_tokens: usize) -> Request {
    let prompt = (0..len).map(|i| (i * 7 + seed * 31) % 256).collect();
    request(VICTIM_TENANT, prompt, max_tokens)
}

/// Tenant B's request: `len` prompt tokens, the same in every run.
#[must_use]
pub fn probe(len: u32, max_tokens: usize) -> Request {
    let prompt = (0..len).map(|i| (i * 13 + 5) % 256).collect();
    request(PROBE_TENANT, prompt, max_tokens)
}

/// Tenant C's short request.
#[must_use]
pub fn bystander() -> Request {
    request(BYSTANDER_TENANT, vec![9; 30], BYSTANDER_TOKENS)
}

/// Tokens the bystander asks for.
pub const BYSTANDER_TOKENS: usize = 12;

fn request(tenant: TenantId, prompt: Vec<u32>, max_tokens: usize) -> Request {
    Request {
        tenant,
        prompt,
        max_tokens,
        sampling: SamplingParams::greedy(),
        stop_tokens: Vec::new(),
        cache_salt: crate::request::CacheSalt::default(),
    }
}

fn finish(
    victim: Result<Output, RequestError>,
    probe: Result<Output, RequestError>,
    bystander: &crate::engine::RequestHandle,
) -> Attempt {
    Ok(ScenarioRun {
        victim,
        probe,
        bystander: bystander.wait(),
    })
}
