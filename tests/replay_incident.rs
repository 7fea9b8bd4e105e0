//! `kvsan replay incident --json` end to end (real process, real model): the
//! unsanitized run leaks tenant A's data into tenant B's response, the
//! sanitized run aborts B with the violation, and with the fault off B is
//! cleanly rejected.
#![cfg(feature = "faults")]

use std::process::Command;

use serde_json::Value;

#[test]
fn replay_incident_leaks_unsanitized_aborts_sanitized_and_rejects_when_fixed() {
    let out = Command::new(env!("CARGO_BIN_EXE_kvsan"))
        .args(["replay", "incident", "--json"])
        .output()
        .expect("run kvsan");
    assert!(
        out.status.success(),
        "{}",
        String::from_utf8_lossy(&out.stderr)
    );
    let runs: Vec<Value> = String::from_utf8(out.stdout)
        .expect("utf-8")
        .lines()
        .map(|l| serde_json::from_str(l).expect("one JSON object per line"))
        .collect();
    let names: Vec<&str> = runs
        .iter()
        .map(|r| r["run"].as_str().expect("run"))
        .collect();
    assert_eq!(names, ["unsanitized", "sanitized", "fault-off"]);

    let unsanitized = &runs[0];
    assert_eq!(unsanitized["outcome"], "leaked", "{unsanitized}");
    assert!(
        unsanitized["leak_evidence"]
            .as_str()
            .expect("evidence")
            .contains("noninterference broken"),
        "{unsanitized}"
    );

    let sanitized = &runs[1];
    assert_eq!(sanitized["outcome"], "aborted", "{sanitized}");
    assert_eq!(
        sanitized["violations"],
        serde_json::json!(["terminal-request-activity"])
    );
    assert!(
        sanitized["tenant_b_text"].is_null(),
        "an aborted request gets no text"
    );

    let fixed = &runs[2];
    assert_eq!(fixed["outcome"], "rejected", "{fixed}");
    assert!(
        fixed["leak_evidence"]
            .as_str()
            .expect("error")
            .contains("limit 1024"),
        "{fixed}"
    );
}
