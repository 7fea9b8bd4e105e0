//! `on_violation` wired through the real engine (disaggregated, synthetic
//! model, the `short-transfer` fault): `abort` aborts only the probe (see
//! the leak-oracle tests), `report` reports and lets the request go on,
//! `halt` writes the report and exits the process with `exitcode`.
#![cfg(feature = "faults")]

use std::process::Command;
use std::sync::{Arc, Mutex};

use kvsan_engine::faults::Fault;
use kvsan_engine::hooks::Hooks;
use kvsan_engine::model::AttentionCheck;
use kvsan_engine::scenario::{Scenario, ScenarioRun, scenario_model};
use kvsan_sanitizer::{Options, ReportBuffer, Sanitizer, ViolationKind};

/// The fault switch is process-wide: tests that flip it take turns.
static FAULTS: Mutex<()> = Mutex::new(());

fn short_transfer(sanitizer: Arc<Sanitizer>) -> ScenarioRun {
    let _turn = FAULTS.lock().unwrap_or_else(|e| e.into_inner());
    let model = scenario_model().expect("synthetic model");
    Scenario::of(Fault::ShortTransfer)
        .run(
            &model,
            Hooks::sanitizer(sanitizer),
            AttentionCheck::Generations,
            1,
            true,
        )
        .expect("engine")
}

#[test]
fn report_policy_reports_the_violation_and_the_request_goes_on() {
    let sink = ReportBuffer::default();
    let sanitizer = Arc::new(Sanitizer::with_writer(
        Options::parse("on_violation=report").expect("options"),
        sink.clone(),
    ));
    let run = short_transfer(sanitizer.clone());
    let report = sink.text();
    assert!(
        sanitizer.count(ViolationKind::ShortTransfer) >= 1,
        "{report}"
    );
    assert!(report.contains("short-transfer"), "{report}");
    assert_eq!(
        run.probe
            .expect("report only: the probe is served")
            .tokens
            .len(),
        16
    );
    run.victim.expect("the victim finishes");
    run.bystander.expect("the bystander finishes");
}

const HALT_CHILD: &str = "KVSAN_TEST_ENGINE_HALT_CHILD";

#[test]
fn halt_policy_writes_the_report_and_exits_with_exitcode() {
    if std::env::var_os(HALT_CHILD).is_some() {
        let sanitizer = Arc::new(
            Sanitizer::new(Options::parse("on_violation=halt:exitcode=42").expect("options"))
                .expect("sanitizer"),
        );
        let _ = short_transfer(sanitizer);
        panic!("on_violation=halt let the engine go on");
    }
    let out = Command::new(std::env::current_exe().expect("test binary"))
        .args([
            "--exact",
            "halt_policy_writes_the_report_and_exits_with_exitcode",
            "--nocapture",
        ])
        .env(HALT_CHILD, "1")
        .output()
        .expect("child");
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert_eq!(out.status.code(), Some(42), "stderr:\n{stderr}");
    assert!(stderr.contains("kvsan: ERROR: short-transfer"), "{stderr}");
}
