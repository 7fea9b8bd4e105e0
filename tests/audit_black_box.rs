//! `kvsan audit` against real servers on loopback: a `kvsan serve` with no
//! fault (nothing found, exit 0), one with the incident's fault (found,
//! exit 1, SARIF), one whose prefix cache is shared across tenants
//! (`--prefix-cache global`: found by timing, exit 1) next to the default
//! per-tenant cache (a hit with the same key, none across keys: exit 0),
//! and servers it cannot audit (exit 2).

mod serve_common;

use std::process::{Command, Output};

use serde_json::Value;
use serve_common::Server;

fn audit(args: &[&str]) -> Output {
    Command::new(env!("CARGO_BIN_EXE_kvsan"))
        .arg("audit")
        .args(args)
        .output()
        .expect("run kvsan audit")
}

fn keys_file(name: &str) -> String {
    let path = std::path::Path::new(env!("CARGO_TARGET_TMPDIR")).join(format!("audit-{name}.keys"));
    std::fs::write(&path, "sk-victim 1\nsk-probe 2\n").unwrap();
    path.to_str().unwrap().to_string()
}

/// The audit of a server at `listen` (90 requests, 3 timing samples per
/// arm), as JSON (and its exit status).
fn audit_json(listen: &str, extra: &[&str]) -> (Option<i32>, Value, String) {
    audit_json_sized(listen, "90", "3", extra)
}

/// [`audit_json`] with a budget and timing samples of the caller's.
fn audit_json_sized(
    listen: &str,
    budget: &str,
    samples: &str,
    extra: &[&str],
) -> (Option<i32>, Value, String) {
    let url = format!("http://{listen}");
    let mut args = vec![
        "--base-url",
        &url,
        "--api-key",
        "sk-victim",
        "--other-api-key",
        "sk-probe",
        "--budget",
        budget,
        "--timing-samples",
        samples,
        "--seed",
        "7",
        "--json",
    ];
    args.extend_from_slice(extra);
    let out = audit(&args);
    let stdout = String::from_utf8_lossy(&out.stdout).to_string();
    let stderr = String::from_utf8_lossy(&out.stderr).to_string();
    let json: Value = serde_json::from_str(stdout.trim())
        .unwrap_or_else(|e| panic!("audit JSON: {e}\nstdout: {stdout}\nstderr: {stderr}"));
    (out.status.code(), json, stderr)
}

fn rules(report: &Value) -> Vec<String> {
    report["findings"]
        .as_array()
        .unwrap()
        .iter()
        .map(|f| f["rule"].as_str().unwrap().to_string())
        .collect()
}

#[test]
fn a_server_that_cannot_be_reached_or_spoken_to_is_exit_status_2() {
    let out = audit(&["--base-url", "http://127.0.0.1:9"]);
    assert_eq!(out.status.code(), Some(2), "{out:?}");
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert!(
        stderr.contains("cannot reach http://127.0.0.1:9/v1/models"),
        "{stderr}"
    );
    let out = audit(&["--base-url", "https://example.invalid"]);
    assert_eq!(out.status.code(), Some(2), "{out:?}");
    assert!(String::from_utf8_lossy(&out.stderr).contains("plain HTTP only"));
    let out = audit(&["--base-url", "http://127.0.0.1:9", "--budget", "0"]);
    assert_eq!(out.status.code(), Some(2), "{out:?}");
}

/// SmolLM2 behind `kvsan serve`, no fault: deterministic, every limit
/// enforced with a 400, no output moved by another tenant's canary: exit
/// 0. Three timing samples per arm cannot reach p < 0.01 (the smallest
/// two-sample KS p-value for 3 and 3 is 0.1), so the timing phase says "no
/// cache detected"; the cache's timing is the next tests'.
#[test]
fn a_server_without_a_fault_is_clean() {
    let keys = keys_file("clean");
    let server = Server::http(
        "audit-clean",
        "unified",
        &["--context", "256", "--api-keys", &keys],
        &[],
    );
    let (code, report, stderr) = audit_json(&server.listen(), &[]);
    assert_eq!(code, Some(0), "{report:#}\n{stderr}");
    assert!(rules(&report).is_empty(), "{report:#}");
    assert_eq!(
        report["context_length"], 256,
        "max_model_len is the served context"
    );
    assert_eq!(report["determinism"]["deterministic"], true, "{report:#}");
    assert!(
        report["noninterference_pairs"].as_u64().unwrap() >= 6,
        "{report:#}"
    );
    let limits = report["limits"].as_array().unwrap();
    for over in ["just over the context", "twice the context"] {
        let probe = limits.iter().find(|l| l["name"] == over).unwrap();
        assert_eq!(probe["status"], 400, "{probe}");
    }
    let timing = report["timing"].as_array().unwrap();
    assert_eq!(timing.len(), 2, "{report:#}");
    assert!(
        timing[0]["verdict"]
            .as_str()
            .unwrap()
            .starts_with("no cache detected"),
        "{report:#}"
    );
    assert!(report["requests_sent"].as_u64().unwrap() <= 90);
}

/// The incident behind HTTP: a disaggregated server whose prompts over the
/// prefill pool are turned into placeholders (`reject-as-placeholder`)
/// answers one with 200 and text; the audit finds it, exits 1, and writes
/// SARIF with the rule and its evidence.
#[cfg(feature = "faults")]
#[test]
fn the_incidents_fault_is_found_and_written_as_sarif() {
    let keys = keys_file("fault");
    let server = Server::http(
        "audit-fault",
        "disagg",
        &[
            "--context",
            "256",
            "--prefill-pool-tokens",
            "128",
            "--allow-pool-smaller-than-context",
            "--api-keys",
            &keys,
            "--inject",
            "reject-as-placeholder",
        ],
        &[],
    );
    let sarif = std::path::Path::new(env!("CARGO_TARGET_TMPDIR")).join("audit-fault.sarif");
    let (code, report, stderr) = audit_json(
        &server.listen(),
        &["--pool-limit", "128", "--sarif", sarif.to_str().unwrap()],
    );
    assert_eq!(code, Some(1), "{report:#}\n{stderr}");
    assert!(
        rules(&report).contains(&"oversize-prompt-served".to_string()),
        "{report:#}"
    );
    let sarif: Value = serde_json::from_str(&std::fs::read_to_string(&sarif).unwrap()).unwrap();
    assert_eq!(sarif["version"], "2.1.0");
    let run = &sarif["runs"][0];
    assert_eq!(run["tool"]["driver"]["rules"].as_array().unwrap().len(), 5);
    let result = run["results"]
        .as_array()
        .unwrap()
        .iter()
        .find(|r| r["ruleId"] == "oversize-prompt-served")
        .expect("the finding is a SARIF result");
    assert_eq!(result["properties"]["evidence"]["limit"], 128, "{result}");
    assert_eq!(result["level"], "error");
}

/// The audit's timing phase against kvsan's own prefix cache, `samples`
/// timed requests per arm: the report and exit status for a server with
/// `policy`.
fn timing_audit(name: &'static str, policy: &str) -> (Option<i32>, Value, String) {
    let keys = keys_file(name);
    let server = Server::http(
        name,
        "unified",
        &[
            "--context",
            "256",
            "--api-keys",
            &keys,
            "--prefix-cache",
            policy,
        ],
        &[],
    );
    audit_json_sized(&server.listen(), "140", "8", &[])
}

/// The default per-tenant cache: the same key's repeated prefix is served
/// from the cache (a hit the timing sees), the other key's is not: isolated
/// by key, nothing found.
#[test]
fn a_per_tenant_prefix_cache_is_seen_with_one_key_and_not_across_keys() {
    let (code, report, stderr) = timing_audit("audit-cache-tenant", "tenant");
    assert_eq!(code, Some(0), "{report:#}\n{stderr}");
    let timing = report["timing"].as_array().unwrap();
    assert!(
        timing[0]["verdict"]
            .as_str()
            .unwrap()
            .starts_with("cache detected"),
        "{report:#}"
    );
    assert!(
        timing[1]["verdict"]
            .as_str()
            .unwrap()
            .contains("isolated by key"),
        "{report:#}"
    );
}

/// `--prefix-cache global`: a prefix warmed with one key speeds up the
/// other key's first token — the cross-tenant side channel, found.
#[test]
fn a_prefix_cache_shared_across_tenants_is_found_by_timing() {
    let (code, report, stderr) = timing_audit("audit-cache-global", "global");
    assert_eq!(code, Some(1), "{report:#}\n{stderr}");
    assert!(
        rules(&report).contains(&"cross-key-prefix-cache".to_string()),
        "{report:#}"
    );
}
