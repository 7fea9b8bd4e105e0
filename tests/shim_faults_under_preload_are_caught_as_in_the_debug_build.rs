//! Every fault of the engine's fault injection, run through the engine
//! binary built without `sanitize` (`kvsan replay fault NAME --json`, one
//! real process per run): with `LD_PRELOAD=libkvsan_shim.so` the hooks go
//! through the C hook table and the scenario's expected violation kind
//! aborts the scenario's culprit — the kind and request the debug-build
//! tests expect (`Scenario::of`) — while the bystander finishes; without the
//! preload nothing is attached, nothing is aborted and the probe's output
//! depends on the victim's data (the leak).
#![cfg(feature = "faults")]

mod shim_common;

use std::process::Command;

use kvsan_engine::faults::Fault;
use kvsan_engine::scenario::{Culprit, Scenario, VictimEnd};
use serde_json::Value;

fn replay(fault: Fault, seed: u32, preload: bool) -> (Value, String) {
    let mut cmd = Command::new(shim_common::kvsan_bin());
    cmd.args(["replay", "fault", fault.name(), "--json", "--seed"])
        .arg(seed.to_string())
        .env_remove("KVSAN_FAULTS")
        .env_remove("KVSAN_OPTIONS")
        .env_remove("LD_PRELOAD");
    if preload {
        cmd.env("LD_PRELOAD", shim_common::shim_library());
    }
    let out = cmd.output().expect("run kvsan replay fault");
    let (stdout, stderr) = shim_common::texts(&out);
    assert!(out.status.success(), "{}: {stdout}\n{stderr}", fault.name());
    let json = serde_json::from_str(stdout.trim()).expect("one JSON object");
    (json, stderr)
}

#[test]
fn every_fault_under_the_preload_aborts_the_expected_request_with_the_expected_kind() {
    for fault in Fault::ALL {
        let scenario = Scenario::of(fault);
        let name = fault.name();
        let kind = scenario.expected.name();
        let (run, stderr) = replay(fault, 1, true);
        assert_eq!(run["hooks"], "C hook table", "{name}: {stderr}");
        // The request aborted, and the one that must not be; a culprit that
        // had already ended leaves both live requests alone.
        let (culprit, others): (Option<&str>, &[&str]) = match scenario.culprit {
            // The victim's own row misuses pages too: it is aborted as well.
            Culprit::Probe if scenario.victim_end == VictimEnd::Aborted => (Some("probe"), &[]),
            Culprit::Probe => (Some("probe"), &["victim"]),
            Culprit::Victim => (Some("victim"), &["probe"]),
            Culprit::Ended | Culprit::Cache => (None, &["victim", "probe"]),
        };
        if scenario.victim_end == VictimEnd::Aborted {
            assert_eq!(run["victim"]["outcome"], "error", "{name}: {run}");
            assert!(!run["victim"]["violation_kind"].is_null(), "{name}: {run}");
        }
        if let Some(culprit) = culprit {
            assert_eq!(run[culprit]["outcome"], "error", "{name}: {run}");
            assert_eq!(run[culprit]["violation_kind"], kind, "{name}: {run}");
        }
        for other in others {
            assert!(
                run[*other]["violation_kind"].is_null(),
                "{name}: only the culprit is aborted: {run}"
            );
        }
        assert_eq!(run["bystander"]["outcome"], "finished", "{name}: {run}");
        // A refused registration is the prefix cache's own access.
        let actor = match scenario.culprit {
            Culprit::Cache => "prefix cache",
            _ => "request",
        };
        assert!(
            stderr.contains(&format!("kvsan: ERROR: {kind} in {actor}")),
            "{name}: {stderr}"
        );
        let summary = stderr.lines().last().unwrap_or_default();
        assert!(
            summary.starts_with("kvsan: ") && summary.contains(&format!("{kind}: ")),
            "{name}: summary {summary}"
        );

        let (a, _) = replay(fault, 1, false);
        let (b, _) = replay(fault, 2, false);
        assert_eq!(a["hooks"], "none", "{name}");
        for who in ["victim", "probe", "bystander"] {
            assert!(a[who]["violation_kind"].is_null(), "{name}: {a}");
        }
        assert_ne!(
            a["probe"], b["probe"],
            "{name}: without the preload the probe must see the victim's data"
        );
    }
}
