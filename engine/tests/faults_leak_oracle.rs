//! The leak oracle, fault by fault, in the real disaggregated engine
//! (synthetic model): noninterference between a victim of tenant A and a
//! probe of tenant B.
//!
//! For every fault:
//! - injected, no sanitizer, plain kernels (a release engine): the probe's
//!   outcome changes when only the victim's prompt changes — the fault
//!   really leaks;
//! - not injected: the probe's outcome is the same for both victims;
//! - injected, with the sanitizer: the culprit (the probe, or the victim
//!   whose faulty write would land in the probe's pages) is aborted with the
//!   expected violation kind, the report names it, the bystander finishes,
//!   and a probe that is not the culprit gets the correct engine's outcome;
//! - for the faults the checked attention kernel can see on its own
//!   (hooks off): the probe is aborted by the kernel's generation check.
//!
//! Run with `cargo test -p kvsan-engine --features faults`.
#![cfg(feature = "faults")]

use std::sync::{Arc, Mutex};

use kvsan_engine::engine::Output;
use kvsan_engine::faults::Fault;
use kvsan_engine::hooks::Hooks;
use kvsan_engine::model::AttentionCheck;
use kvsan_engine::request::{ErrorKind, RequestError};
use kvsan_engine::scenario::{
    BYSTANDER_TOKENS, Culprit, Scenario, ScenarioRun, VictimEnd, scenario_model,
};
use kvsan_sanitizer::{Options, ReportBuffer, Sanitizer};

/// The fault switch is process-wide: tests that flip it take turns.
static FAULTS: Mutex<()> = Mutex::new(());

/// A sanitizer writing its text reports where the test reads them.
fn sanitizer_with_sink() -> (Arc<Sanitizer>, ReportBuffer) {
    let sink = ReportBuffer::default();
    let sanitizer = Arc::new(Sanitizer::with_writer(
        Options::parse("report_format=text").expect("options"),
        sink.clone(),
    ));
    (sanitizer, sink)
}

/// What a client of the probe sees: its tokens, or its error's kind and
/// rejection limit (messages carry request ids, which differ run to run).
fn seen(r: &Result<Output, RequestError>) -> String {
    match r {
        // The prompt tokens it found in the prefix cache are seen too (in
        // `usage`, and in its time to first token).
        Ok(out) => format!("tokens {:?}, cached {}", out.tokens, out.cached_tokens),
        Err(e) => format!(
            "error {} {:?}",
            e.kind.name(),
            e.rejection.as_ref().map(|r| r.limit)
        ),
    }
}

fn unsanitized(fault: Fault, seed: u32, inject: bool) -> ScenarioRun {
    let _turn = FAULTS.lock().unwrap_or_else(|e| e.into_inner());
    let model = scenario_model().expect("synthetic model");
    Scenario::of(fault)
        .run(
            &model,
            Hooks::none(),
            AttentionCheck::Unchecked,
            seed,
            inject,
        )
        .expect("engine")
}

fn injected_leaks(fault: Fault) {
    let a = unsanitized(fault, 1, true);
    let b = unsanitized(fault, 2, true);
    assert_ne!(
        seen(&a.probe),
        seen(&b.probe),
        "{}: the probe's outcome must change with the victim's data",
        fault.name()
    );
}

fn fault_off_is_noninterfering(fault: Fault) {
    let a = unsanitized(fault, 1, false);
    let b = unsanitized(fault, 2, false);
    assert_eq!(seen(&a.probe), seen(&b.probe), "{}", fault.name());
    assert!(a.bystander.is_ok() && b.bystander.is_ok());
}

/// The bystander finishes; the victim ends as the scenario says unless it
/// is the request aborted (`culprit`).
fn assert_bystander_and_victim(fault: Fault, culprit: Culprit, run: &ScenarioRun) {
    let scenario = Scenario::of(fault);
    assert_eq!(
        run.bystander
            .as_ref()
            .expect("an unrelated request finishes")
            .tokens
            .len(),
        BYSTANDER_TOKENS
    );
    if culprit == Culprit::Victim {
        return;
    }
    match scenario.victim_end {
        VictimEnd::Finishes => {
            run.victim.as_ref().expect("the victim finishes");
        }
        VictimEnd::Cancelled => {
            let e = run.victim.as_ref().expect_err("the victim is cancelled");
            assert_eq!(e.kind, ErrorKind::Cancelled, "{}", e.message);
        }
        VictimEnd::Aborted => {
            let e = run.victim.as_ref().expect_err("the victim is aborted too");
            assert_eq!(e.kind, ErrorKind::Violation, "{}", e.message);
        }
    }
}

/// The culprit's error: aborted for a violation; returns its id and kind.
fn aborted(culprit: &Result<Output, RequestError>) -> (String, String) {
    let err = culprit.as_ref().expect_err("the culprit must be aborted");
    assert_eq!(err.kind, ErrorKind::Violation, "{}", err.message);
    let v = err.violation.expect("violation details");
    let (id, kind) = (v.id.to_string(), v.kind.name().to_string());
    assert!(err.message.contains(id.as_str()), "{}", err.message);
    (id, kind)
}

/// The aborted request's outcome (none for a culprit that had ended).
fn culprit_of(culprit: Culprit, run: &ScenarioRun) -> Option<&Result<Output, RequestError>> {
    match culprit {
        Culprit::Probe => Some(&run.probe),
        Culprit::Victim => Some(&run.victim),
        Culprit::Ended | Culprit::Cache => None,
    }
}

/// When the probe is not the one stopped, it gets what a correct engine
/// gives it.
fn assert_probe_as_without_the_fault(fault: Fault, culprit: Culprit, run: &ScenarioRun) {
    if culprit != Culprit::Probe {
        let correct = unsanitized(fault, 1, false);
        assert_eq!(seen(&run.probe), seen(&correct.probe), "{}", fault.name());
    }
}

/// `fault`'s scenario, injected, with a sanitizer of `options` writing its
/// reports where the test reads them.
fn sanitized(fault: Fault, options: &str) -> (ScenarioRun, Arc<Sanitizer>, ReportBuffer) {
    let sink = ReportBuffer::default();
    let sanitizer = Arc::new(Sanitizer::with_writer(
        Options::parse(options).expect("options"),
        sink.clone(),
    ));
    let _turn = FAULTS.lock().unwrap_or_else(|e| e.into_inner());
    let model = scenario_model().expect("synthetic model");
    let run = Scenario::of(fault)
        .run(
            &model,
            Hooks::sanitizer(sanitizer.clone()),
            AttentionCheck::Generations,
            1,
            true,
        )
        .expect("engine");
    (run, sanitizer, sink)
}

fn sanitized_aborts_the_culprit(fault: Fault) {
    let scenario = Scenario::of(fault);
    let (run, sanitizer, sink) = sanitized(fault, "report_format=text");
    let report = sink.text();
    let expected = scenario.expected.name();
    let id = match culprit_of(scenario.culprit, &run) {
        Some(outcome) => {
            let (id, kind) = aborted(outcome);
            assert_eq!(kind, expected, "{report}");
            id
        }
        // Reported against a request that had ended: the first violation.
        None => sanitizer
            .violations()
            .first()
            .map(|v| {
                assert_eq!(v.kind, scenario.expected, "{report}");
                v.id.to_string()
            })
            .expect("the violation is reported"),
    };
    assert!(
        report.contains(id.as_str()) && report.contains(expected),
        "{report}"
    );
    assert!(sanitizer.count(scenario.expected) >= 1);
    assert_bystander_and_victim(fault, scenario.culprit, &run);
    assert_probe_as_without_the_fault(fault, scenario.culprit, &run);
}

#[allow(
    dead_code,
    reason = "listed by kernel_check_tests! for the faults the kernel sees"
)]
fn kernel_check_alone_aborts_the_culprit(fault: Fault) {
    let scenario = Scenario::of(fault);
    let culprit = scenario
        .kernel_check
        .expect("the scenario says the kernel check catches it");
    let run = {
        let _turn = FAULTS.lock().unwrap_or_else(|e| e.into_inner());
        let model = scenario_model().expect("synthetic model");
        scenario
            .run(&model, Hooks::none(), AttentionCheck::Generations, 1, true)
            .expect("engine")
    };
    let outcome = culprit_of(culprit, &run).expect("the kernel aborts a live request");
    let (_, kind) = aborted(outcome);
    assert_eq!(kind, "generation-mismatch");
    assert_bystander_and_victim(fault, culprit, &run);
    assert_probe_as_without_the_fault(fault, culprit, &run);
}

macro_rules! fault_tests {
    ($($module:ident => $fault:expr),* $(,)?) => {
        /// Every fault the build knows has its tests below.
        #[test]
        fn every_fault_has_leak_oracle_tests() {
            let covered = [$($fault),*];
            for f in Fault::ALL {
                assert!(covered.contains(&f), "no leak-oracle tests for {}", f.name());
            }
        }
        $(
            mod $module {
                use super::*;

                #[test]
                fn injected_without_the_sanitizer_the_probe_depends_on_the_victim() {
                    injected_leaks($fault);
                }

                #[test]
                fn not_injected_the_probe_does_not_depend_on_the_victim() {
                    fault_off_is_noninterfering($fault);
                }

                #[test]
                fn injected_with_the_sanitizer_the_culprit_is_aborted_and_the_others_finish() {
                    sanitized_aborts_the_culprit($fault);
                }

            }
        )*
    };
}

fault_tests! {
    reject_as_placeholder => Fault::RejectAsPlaceholder,
    free_during_transfer => Fault::FreeDuringTransfer,
    short_transfer => Fault::ShortTransfer,
    skip_layer_write => Fault::SkipLayerWrite,
    stale_block_table => Fault::StaleBlockTable,
    double_free => Fault::DoubleFree,
    overlapping_transfer => Fault::OverlappingTransfer,
    padding_slot_wrap => Fault::PaddingSlotWrap,
    commit_after_abort => Fault::CommitAfterAbort,
    decode_length_overrun => Fault::DecodeLengthOverrun,
    block_table_row_order => Fault::BlockTableRowOrder,
    slot_mapping_chunk_offset => Fault::SlotMappingChunkOffset,
    stale_batch_array => Fault::StaleBatchArray,
    cache_register_before_write => Fault::CacheRegisterBeforeWrite,
    cache_salt_dropped => Fault::CacheSaltDropped,
    cache_key_collision => Fault::CacheKeyCollision,
    cache_evict_referenced => Fault::CacheEvictReferenced,
    cache_partial_page_shared => Fault::CachePartialPageShared,
    cache_keeps_aborted => Fault::CacheKeepsAborted,
    descriptor_offset_dropped => Fault::DescriptorOffsetDropped,
    block_size_mismatch => Fault::BlockSizeMismatch,
    transfer_replayed_after_commit => Fault::TransferReplayedAfterCommit,
    tier_load_failed_as_hit => Fault::TierLoadFailedAsHit,
    tier_store_after_reuse => Fault::TierStoreAfterReuse,
    tier_two_pages_one_block => Fault::TierTwoPagesOneBlock,
    tier_meta_by_page_id => Fault::TierMetaByPageId,
}

macro_rules! kernel_check_tests {
    ($($name:ident => $fault:expr),* $(,)?) => {
        /// Every fault whose scenario says the kernel check catches it is tested.
        #[test]
        fn every_fault_the_kernel_check_sees_is_tested() {
            let covered: [Fault; 0 $(+ { let _ = $fault; 1 })*] = [$($fault),*];
            for s in Scenario::all().filter(|s| s.kernel_check.is_some()) {
                assert!(covered.contains(&s.fault), "no kernel-check test for {}", s.fault.name());
            }
        }
        $(
            #[test]
            fn $name() {
                kernel_check_alone_aborts_the_culprit($fault);
            }
        )*
    };
}

kernel_check_tests! {
    kernel_check_alone_catches_stale_block_table => Fault::StaleBlockTable,
    kernel_check_alone_catches_double_free => Fault::DoubleFree,
    kernel_check_alone_catches_cache_evict_referenced => Fault::CacheEvictReferenced,
}

#[test]
fn not_injected_the_oversize_probe_is_rejected_at_the_prefill_pool_limit() {
    let run = unsanitized(Fault::RejectAsPlaceholder, 1, false);
    let err = run.probe.expect_err("rejected");
    assert_eq!(err.kind, ErrorKind::Rejected);
    assert_eq!(
        err.rejection.as_ref().map(|r| (r.limit, r.node.as_str())),
        Some((256, "prefill"))
    );
}

/// `commit-after-abort` on a deployment whose decode node has a sanitizer
/// and whose prefill node, a process of its own, has none: the run and the
/// sanitizer's text reports.
fn caa_with_a_sanitizer_on_decode_alone(inject: bool) -> (ScenarioRun, Arc<Sanitizer>, String) {
    let (sanitizer, sink) = sanitizer_with_sink();
    let run = {
        let _turn = FAULTS.lock().unwrap_or_else(|e| e.into_inner());
        let model = scenario_model().expect("synthetic model");
        Scenario::of(Fault::CommitAfterAbort)
            .run_separate(
                &model,
                Hooks::sanitizer(sanitizer.clone()),
                Hooks::none(),
                AttentionCheck::Generations,
                1,
                inject,
            )
            .expect("engine")
    };
    (run, sanitizer, sink.text())
}

/// Injected: prefill computes and ships the cancelled victim, decode drops
/// its KV, and the sanitizer refuses the completion's commit
/// (terminal-request-activity) before the victim decodes a step; the probe
/// gets the correct engine's answer.
#[test]
fn commit_after_abort_with_a_sanitizer_on_decode_alone_is_refused_at_the_commit() {
    let (run, sanitizer, report) = caa_with_a_sanitizer_on_decode_alone(true);
    let kinds: Vec<_> = sanitizer.violations().iter().map(|v| v.kind).collect();
    assert_eq!(
        kinds,
        [kvsan_sanitizer::ViolationKind::TerminalRequestActivity],
        "{report}"
    );
    assert!(
        report.contains("committing") && report.contains("an aborted request commits"),
        "{report}"
    );
    assert_bystander_and_victim(Fault::CommitAfterAbort, Culprit::Ended, &run);
    assert_probe_as_without_the_fault(Fault::CommitAfterAbort, Culprit::Ended, &run);
}

/// Not injected: no violation, and the probe's answer is the one engine's.
#[test]
fn commit_after_abort_off_with_a_sanitizer_on_decode_alone_passes() {
    let (run, sanitizer, report) = caa_with_a_sanitizer_on_decode_alone(false);
    assert!(sanitizer.violations().is_empty(), "{report}");
    assert_bystander_and_victim(Fault::CommitAfterAbort, Culprit::Ended, &run);
    assert_probe_as_without_the_fault(Fault::CommitAfterAbort, Culprit::Ended, &run);
}

/// The same scenarios with the sanitizer's quarantine on (64 freed pages
/// held back per pool before reuse, and poison): every fault is still
/// caught, though pages are reused in another order than the release
/// engine's. Prints each fault's verdict under both settings.
#[test]
fn every_fault_is_caught_with_the_default_reuse_order_and_with_quarantine_on() {
    let mut table =
        String::from("fault | default (no quarantine) | quarantine_pages=64:poison=1\n");
    for fault in Fault::ALL {
        let mut row = vec![fault.name().to_string()];
        for options in [
            "report_format=text",
            "report_format=text:quarantine_pages=64:poison=1",
        ] {
            let (_, sanitizer, _) = sanitized(fault, options);
            let kinds: Vec<&str> = sanitizer
                .violations()
                .iter()
                .map(|v| v.kind.name())
                .collect();
            assert!(
                !kinds.is_empty(),
                "{} not caught with {options}",
                fault.name()
            );
            row.push(kinds[0].to_string());
        }
        table.push_str(&row.join(" | "));
        table.push('\n');
    }
    println!("{table}");
}
