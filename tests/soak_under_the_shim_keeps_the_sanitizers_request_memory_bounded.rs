//! `kvsan bench soak`, small: 2,000 requests per role through real `kvsan
//! serve` processes (this build's binary, unified and disaggregated) under
//! `LD_PRELOAD` of this build's shim, with `ended_requests=200` so that ten
//! times more requests end than the sanitizer may remember. Every request
//! is answered over HTTP as its kind expects (completions, clients that go
//! away at several points of their stream, rejections over the pool and
//! over the context), the engine is idle once every answer is in (a client
//! gone cancelled its request and freed its pages), the sanitizer reports
//! no violation, and at exit it tracks no live request and exactly 200
//! ended ones: its memory for requests is bounded by the option, not by
//! the requests served.
//!
//! Resident memory is sampled and written but not asserted: it depends on
//! the allocator and the machine. The full soak (100,000 requests, release
//! build) is in docs/sanitizer.md.

mod shim_common;

use std::process::Command;

use serde_json::Value;

const REQUESTS: u64 = 2_000;
const ENDED_REQUESTS: u64 = 200;

#[test]
fn a_soak_under_the_shim_answers_everything_with_zero_violations_and_remembers_at_most_ended_requests()
 {
    let shim = shim_common::shim_library();
    let out = shim_common::scratch().join("soak");
    let output = Command::new(shim_common::kvsan_bin())
        .args(["bench", "soak", "--json", "--clients", "4"])
        .args(["--requests", &REQUESTS.to_string(), "--samples", "10"])
        .arg("--kvsan-options")
        .arg(format!("ended_requests={ENDED_REQUESTS}"))
        .arg("--server")
        .arg(shim_common::kvsan_bin())
        .arg("--shim")
        .arg(shim)
        .arg("--out")
        .arg(&out)
        .output()
        .expect("run kvsan bench soak");
    let (stdout, stderr) = shim_common::texts(&output);
    assert!(output.status.success(), "{}\n{stderr}", output.status);
    let doc: Value = serde_json::from_str(stdout.trim())
        .unwrap_or_else(|e| panic!("stdout is one JSON object ({e}):\n{stdout}\n{stderr}"));
    assert_eq!(doc["passed"], true, "{stderr}");

    let roles = doc["roles"].as_array().expect("roles");
    let names: Vec<&str> = roles.iter().map(|r| r["role"].as_str().unwrap()).collect();
    assert_eq!(names, ["unified", "disagg"]);
    for r in roles {
        let role = r["role"].as_str().unwrap();
        let o = &r["outcomes"];
        let n = |k: &str| {
            o[k].as_u64()
                .unwrap_or_else(|| panic!("{role}: {k} in {o}"))
        };
        assert_eq!(n("unexpected"), 0, "{role}: {o}");
        let answered =
            n("finished") + n("cancelled") + n("rejected_over_pool") + n("rejected_over_context");
        assert_eq!(answered, REQUESTS, "{role}: {o}");
        for kind in [
            "finished",
            "cancelled",
            "rejected_over_pool",
            "rejected_over_context",
        ] {
            assert!(n(kind) > 0, "{role}: no {kind} in the load: {o}");
        }

        assert_eq!(r["sanitized"], true, "{role}");
        assert_eq!(r["violations"], 0, "{role}: {r}");
        assert_eq!(r["reports"], 0, "{role}: {r}");
        assert!(r["checks"].as_u64().unwrap() > 0, "{role}: {r}");
        // Every request ended, ten times the bound: the sanitizer keeps
        // none live and exactly the bound of the ended ones.
        let t = &r["tracked_at_exit"];
        assert_eq!(t["live"], 0, "{role}: {t}");
        assert_eq!(t["remembered"], ENDED_REQUESTS, "{role}: {t}");
        assert_eq!(t["ended_requests"], ENDED_REQUESTS, "{role}: {t}");

        let samples = r["samples"].as_array().expect("samples");
        assert!(samples.len() >= 11, "{role}: {} samples", samples.len());
        assert_eq!(samples[0]["requests"], 0);
        assert_eq!(samples.last().unwrap()["requests"], REQUESTS);
        assert!(samples.iter().all(|s| s["rss_kib"].as_u64().unwrap() > 0));
        // The point from which what the sanitizer remembers stays the same
        // size: the first sample once ended_requests were answered.
        let warm = r["rss"]["warm_requests"].as_u64().expect("a warm point");
        assert!((ENDED_REQUESTS..REQUESTS).contains(&warm), "{role}: {warm}");
        for check in r["verdict"].as_array().expect("verdict") {
            assert_eq!(check["passed"], true, "{role}: {check}");
        }
        assert!(
            r["verdict"]
                .as_array()
                .unwrap()
                .iter()
                .any(|c| c["name"] == "the anomaly monitor flags nothing"),
            "{role}: the anomaly check is part of the verdict"
        );
    }
    for file in ["soak.json", "soak.csv", "soak.svg"] {
        assert!(out.join(file).is_file(), "{file} not written");
    }
    let csv = std::fs::read_to_string(out.join("soak.csv")).unwrap();
    assert!(csv.starts_with("role,requests,seconds,rss_kib,"), "{csv}");
    assert!(csv.contains("\ndisagg,2000,"), "{csv}");
}

#[test]
fn a_soak_without_a_shim_library_is_refused_by_name() {
    let output = Command::new(shim_common::kvsan_bin())
        .args(["bench", "soak", "--requests", "1"])
        .output()
        .expect("kvsan runs");
    assert!(!output.status.success());
    let (_, stderr) = shim_common::texts(&output);
    assert!(
        stderr.contains("--shim") && stderr.contains("scripts/bench-soak"),
        "{stderr}"
    );
}

#[test]
fn a_soak_with_a_missing_binary_is_refused_by_name() {
    let missing = shim_common::scratch().join("no-such-kvsan");
    let output = Command::new(shim_common::kvsan_bin())
        .args([
            "bench",
            "soak",
            "--requests",
            "1",
            "--without-shim",
            "--server",
        ])
        .arg(&missing)
        .output()
        .expect("kvsan runs");
    assert!(!output.status.success());
    let (_, stderr) = shim_common::texts(&output);
    assert!(
        stderr.contains("--server") && stderr.contains(&missing.display().to_string()),
        "{stderr}"
    );
}
