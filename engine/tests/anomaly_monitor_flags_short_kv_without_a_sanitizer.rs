//! The anomaly monitor, in the disaggregated engine with no sanitizer and
//! plain kernels (a release engine): the incident's fault
//! (`reject-as-placeholder`) and `short-transfer` each give a request its
//! first token with KV for fewer positions than its prompt; the monitor
//! counts that, and with `--anomaly abort` ends the request before its
//! first token leaves. The same scripts without the fault flag nothing.
//!
//! Run with `cargo test -p kvsan-engine --features faults`.
#![cfg(feature = "faults")]

use std::sync::Mutex;

use kvsan_engine::anomaly::{AnomalyAction, AnomalyCounts};
use kvsan_engine::engine::Engine;
use kvsan_engine::faults::Fault;
use kvsan_engine::hooks::Hooks;
use kvsan_engine::model::AttentionCheck;
use kvsan_engine::request::ErrorKind;
use kvsan_engine::scenario::{Scenario, ScenarioRun, scenario_model};

/// The fault switch is process-wide: tests that flip it take turns.
static FAULTS: Mutex<()> = Mutex::new(());

/// The fault's script on a release engine whose monitor does `action`:
/// how each request ended, and what the decode node's monitor counted.
fn run(fault: Fault, inject: bool, action: AnomalyAction) -> (ScenarioRun, AnomalyCounts) {
    let _turn = FAULTS.lock().unwrap_or_else(|e| e.into_inner());
    let model = scenario_model().expect("synthetic model");
    let scenario = Scenario::of(fault);
    let mut cfg = scenario.config(Hooks::none(), AttentionCheck::Unchecked);
    cfg.anomaly = action;
    let engine = Engine::disaggregated(model, &cfg).expect("engine");
    let run = scenario.run_on(&engine, 1, inject).expect("scenario");
    let counts = engine.stats().front.anomalies;
    (run, counts)
}

const FLAGGED: [Fault; 2] = [Fault::RejectAsPlaceholder, Fault::ShortTransfer];

#[test]
fn short_kv_is_counted_and_the_request_goes_on_by_default() {
    for fault in FLAGGED {
        let (run, counts) = run(fault, true, AnomalyAction::Log);
        assert_eq!(counts.short_kv, 1, "{}: {counts:?}", fault.name());
        // Only counted: the leaking answer still goes out.
        assert!(run.probe.is_ok(), "{}: {:?}", fault.name(), run.probe);
        assert!(run.victim.is_ok() && run.bystander.is_ok());
    }
}

#[test]
fn with_abort_the_flagged_request_ends_before_its_first_token_and_the_others_finish() {
    for fault in FLAGGED {
        let (run, counts) = run(fault, true, AnomalyAction::Abort);
        assert_eq!(counts.short_kv, 1, "{}: {counts:?}", fault.name());
        let e = run.probe.expect_err("the probe is aborted");
        assert_eq!(e.kind, ErrorKind::Anomaly, "{}: {e}", fault.name());
        assert!(e.message.contains("short-kv"), "{}", e.message);
        assert!(run.victim.is_ok(), "{}: {:?}", fault.name(), run.victim);
        assert!(
            run.bystander.is_ok(),
            "{}: {:?}",
            fault.name(),
            run.bystander
        );
    }
}

#[test]
fn without_a_fault_no_script_is_flagged_even_with_abort() {
    for scenario in Scenario::all() {
        let fault = scenario.fault;
        let (run, counts) = run(fault, false, AnomalyAction::Abort);
        assert_eq!(counts, AnomalyCounts::default(), "{}", fault.name());
        for (who, r) in [
            ("victim", &run.victim),
            ("probe", &run.probe),
            ("bystander", &run.bystander),
        ] {
            if let Err(e) = r {
                assert_ne!(e.kind, ErrorKind::Anomaly, "{} {who}: {e}", fault.name());
            }
        }
    }
}
