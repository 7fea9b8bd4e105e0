//! `kvsan audit` against real servers on loopback: a `kvsan serve` with no
//! fault (nothing found, exit 0); faults that move one request's KV into
//! another's output, each found by a noninterference pattern (exit 1); the
//! incident's fault (found by the limit probe, written as SARIF); a prefix
//! cache shared across tenants (`--prefix-cache global`: found by timing,
//! exit 1) next to the default per-tenant cache (a hit with the same key,
//! none across keys: exit 0); and servers it cannot audit — unreachable,
//! or hung after answering `/v1/models` (exit 2).

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

/// The audit of a server at `listen` with a budget and timing samples per
/// arm of the caller's, as JSON (and its exit status).
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

/// `kvsan serve --role ROLE` of SmolLM2 with a 256-token context and
/// 72-token steps (long prompts are prefilled in chunks), two tenants'
/// keys, and `extra` flags.
fn chunked_server(name: &'static str, role: &str, extra: &[&str]) -> Server {
    let keys = keys_file(name);
    let mut args = vec![
        "--context",
        "256",
        "--step-tokens",
        "72",
        "--api-keys",
        &keys,
    ];
    args.extend_from_slice(extra);
    Server::http(name, role, &args, &[])
}

/// A server that lists its model and then never answers a completion (a
/// hung engine behind a live socket): the audit stops after three requests
/// in a row get no answer instead of waiting out its budget, says why, and
/// exits 2 — it could not run.
#[test]
fn a_server_that_stops_answering_stops_the_audit_with_exit_status_2() {
    use std::io::{Read, Write};
    let listener = std::net::TcpListener::bind("127.0.0.1:0").unwrap();
    let addr = listener.local_addr().unwrap();
    std::thread::spawn(move || {
        let mut held = Vec::new();
        for mut stream in listener.incoming().map_while(Result::ok) {
            let mut buf = [0u8; 4096];
            let n = stream.read(&mut buf).unwrap_or(0);
            if buf[..n].starts_with(b"GET /v1/models") {
                let body =
                    r#"{"object":"list","data":[{"id":"m","object":"model","max_model_len":256}]}"#;
                let _ = write!(
                    stream,
                    "HTTP/1.1 200 OK\r\ncontent-type: application/json\r\ncontent-length: {}\r\nconnection: close\r\n\r\n{body}",
                    body.len()
                );
            } else {
                // Never answered: the connection stays open until the test ends.
                held.push(stream);
            }
        }
    });
    let url = format!("http://{addr}");
    let out = audit(&["--base-url", &url, "--timeout", "1", "--json"]);
    assert_eq!(out.status.code(), Some(2), "{out:?}");
    let report: Value = serde_json::from_slice(&out.stdout).unwrap();
    assert_eq!(report["requests_sent"], 3, "{report:#}");
    assert_eq!(report["unresponsive"], true, "{report:#}");
    assert!(
        report["notes"]
            .as_array()
            .unwrap()
            .iter()
            .any(|n| n.as_str().unwrap().contains("the server stopped answering")),
        "{report:#}"
    );
}

/// SmolLM2 behind `kvsan serve`, no fault, as the fault tests below serve
/// it (72-token steps): deterministic, also with other requests in flight;
/// every limit enforced with a 400; no output moved by another request's
/// canary: exit 0. Three timing samples per arm cannot reach p < 0.01 (the
/// smallest two-sample KS p-value for 3 and 3 is 0.1), so the timing phase
/// says "no cache detected"; the cache's timing is the next tests'. The
/// order and salt phases are left to the tests of the per-tenant cache
/// below (the same server's default), which run them on their own.
#[test]
fn a_server_without_a_fault_is_clean() {
    let server = chunked_server("audit-clean", "unified", &[]);
    let (code, report, stderr) = audit_json_sized(
        &server.listen(),
        "400",
        "3",
        &["--phases", "noninterference,limits,timing"],
    );
    assert_eq!(code, Some(0), "{report:#}\n{stderr}");
    assert!(rules(&report).is_empty(), "{report:#}");
    assert_eq!(
        report["context_length"], 256,
        "max_model_len is the served context"
    );
    assert_eq!(report["determinism"]["deterministic"], true, "{report:#}");
    assert_eq!(
        report["determinism"]["deterministic_one_at_a_time"], true,
        "{report:#}"
    );
    assert!(
        report["noninterference_pairs"].as_u64().unwrap() >= 20,
        "{report:#}"
    );
    assert_eq!(
        report["notes"],
        serde_json::json!(["phases not run (--phases): order, salt"]),
        "nothing skipped, nothing stopped early: {report:#}"
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
    assert!(report["requests_sent"].as_u64().unwrap() <= 400);
    // The length sweep and the coherence probe covered the context.
    assert_eq!(
        report["length_sweep"].as_array().unwrap().len(),
        8,
        "{report:#}"
    );
    let coherence = report["coherence"].as_array().unwrap();
    assert!(coherence.len() >= 6, "{report:#}");
    assert!(
        coherence.iter().all(|p| p["continued"] == true),
        "{report:#}"
    );
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
    let (code, report, stderr) = audit_json_sized(
        &server.listen(),
        "90",
        "3",
        &[
            "--pool-limit",
            "128",
            "--phases",
            "limits",
            "--sarif",
            sarif.to_str().unwrap(),
        ],
    );
    assert_eq!(code, Some(1), "{report:#}\n{stderr}");
    assert!(
        rules(&report).contains(&"oversize-prompt-served".to_string()),
        "{report:#}"
    );
    let sarif: Value = serde_json::from_str(&std::fs::read_to_string(&sarif).unwrap()).unwrap();
    assert_eq!(sarif["version"], "2.1.0");
    let run = &sarif["runs"][0];
    assert_eq!(run["tool"]["driver"]["rules"].as_array().unwrap().len(), 9);
    let result = run["results"]
        .as_array()
        .unwrap()
        .iter()
        .find(|r| r["ruleId"] == "oversize-prompt-served")
        .expect("the finding is a SARIF result");
    assert_eq!(result["properties"]["evidence"]["limit"], 128, "{result}");
    assert_eq!(result["level"], "error");
}

/// The incident's configuration found without being told the pool size: a
/// disaggregated server whose prefill pool holds half the context. With
/// `reject-as-placeholder` it serves prompts between the pool and the
/// context without computing them; the default audit (no `--pool-limit`)
/// finds the band by coherence at length and exits 1. Without the fault
/// those prompts are refused, and the same audit exits 0. (Each audit runs
/// its length probes and stops at an 80-request budget.)
#[cfg(feature = "faults")]
#[test]
fn a_pool_smaller_than_the_context_is_found_without_being_told() {
    for fault in [true, false] {
        let keys = keys_file(if fault { "band-fault" } else { "band-clean" });
        let mut args = vec![
            "--context",
            "256",
            "--prefill-pool-tokens",
            "128",
            "--allow-pool-smaller-than-context",
            "--api-keys",
            &keys,
        ];
        if fault {
            args.extend(["--inject", "reject-as-placeholder"]);
        }
        let server = Server::http(
            if fault {
                "audit-band-fault"
            } else {
                "audit-band-clean"
            },
            "disagg",
            &args,
            &[],
        );
        // The audit as by default (no --pool-limit) up to its length probes,
        // which come first; the budget then stops it (the whole default
        // audit of this server is in docs/audit.md: exit 1 with this finding).
        let (code, report, stderr) = audit_json_sized(
            &server.listen(),
            "80",
            "3",
            &["--phases", "noninterference"],
        );
        let coherence = report["coherence"].as_array().unwrap();
        assert_eq!(report["budget_spent"], true, "{report:#}");
        if !fault {
            assert_eq!(code, Some(0), "{report:#}\n{stderr}");
            assert!(rules(&report).is_empty(), "{report:#}");
            // Prompts over the pool are refused, the others continued.
            assert!(
                coherence
                    .iter()
                    .all(|p| p["continued"] == true || p["status"] == 400),
                "{report:#}"
            );
            continue;
        }
        assert_eq!(code, Some(1), "{report:#}\n{stderr}");
        let band = report["findings"]
            .as_array()
            .unwrap()
            .iter()
            .find(|f| f["rule"] == "long-prompt-not-computed")
            .unwrap_or_else(|| panic!("no long-prompt-not-computed finding: {report:#}"));
        let [low, high] = [0, 1].map(|i| band["evidence"]["band_tokens"][i].as_u64().unwrap());
        assert!(
            low > 128 && high < 256,
            "the band lies between the pool and the context: {band}"
        );
        assert!(
            coherence
                .iter()
                .filter(|p| p["prompt_tokens"].as_u64().is_some_and(|t| t <= 128))
                .all(|p| p["continued"] == true),
            "prompts the pool holds are computed: {report:#}"
        );
    }
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
    audit_json_sized(&server.listen(), "140", "8", &["--phases", "timing"])
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

/// The audit's order phase against kvsan's own prefix cache: 72-token
/// steps, so a burst's prompts are prefilled over several steps, and a
/// pool that holds a whole burst and its warmed prefixes (a pool of one
/// context runs two of them at a time and evicts the prefixes).
fn order_audit(name: &'static str, policy: &str) -> (Option<i32>, Value, String) {
    let keys = keys_file(name);
    let server = Server::http(
        name,
        "unified",
        &[
            "--context",
            "256",
            "--pool-tokens",
            "2048",
            "--step-tokens",
            "72",
            "--api-keys",
            &keys,
            "--prefix-cache",
            policy,
        ],
        &[],
    );
    audit_json_sized(&server.listen(), "160", "1", &["--phases", "order"])
}

/// `--prefix-cache global`: requests on prefixes the other key just sent
/// are answered before fresh ones sent at the same time — found by order.
#[test]
fn a_prefix_cache_shared_across_tenants_is_found_by_order() {
    let (code, report, stderr) = order_audit("audit-order-global", "global");
    assert_eq!(code, Some(1), "{report:#}\n{stderr}");
    assert_eq!(rules(&report), ["cross-key-scheduling-order"], "{report:#}");
    let other = &report["order"][1];
    assert!(other["places_gained"].as_f64().unwrap() > 0.0, "{report:#}");
    assert!(other["p"].as_f64().unwrap() < 0.01, "{report:#}");
}

/// The per-tenant cache: the same key's bursts come back in the cache's
/// order (the control), the other key's do not — isolated, exit 0.
#[test]
fn a_per_tenant_prefix_cache_shows_an_order_with_one_key_and_none_across_keys() {
    let (code, report, stderr) = order_audit("audit-order-tenant", "tenant");
    assert_eq!(code, Some(0), "{report:#}\n{stderr}");
    let order = report["order"].as_array().unwrap();
    assert!(
        order[0]["verdict"]
            .as_str()
            .unwrap()
            .contains("the order shows the cache"),
        "{report:#}"
    );
    assert!(
        order[1]["verdict"]
            .as_str()
            .unwrap()
            .contains("isolated by key"),
        "{report:#}"
    );
}

/// The salt assertions against kvsan's own prefix cache with `policy`.
fn salt_audit(name: &'static str, serve: &[&str], extra: &[&str]) -> (Option<i32>, Value, String) {
    let keys = keys_file(name);
    let mut serve_args = vec!["--context", "256", "--api-keys", &keys];
    serve_args.extend_from_slice(serve);
    let server = Server::http(name, "unified", &serve_args, &[]);
    let mut args = vec!["--phases", "salt"];
    args.extend_from_slice(extra);
    audit_json_sized(&server.listen(), "130", "8", &args)
}

/// The per-tenant cache honours `cache_salt`: the same key and salt hit
/// (the control, seen in `cached_tokens` and in time), another salt,
/// no salt and another key sending the salt do not — every arm paired,
/// exit 0.
#[test]
fn cache_salt_under_the_tenant_policy_hits_with_its_salt_only() {
    let (code, report, stderr) =
        salt_audit("audit-salt-tenant", &["--prefix-cache", "tenant"], &[]);
    assert_eq!(code, Some(0), "{report:#}\n{stderr}");
    let arms = report["salt"].as_array().unwrap();
    assert_eq!(arms.len(), 4, "{report:#}");
    assert_eq!(arms[0]["hit"], true, "{report:#}");
    assert!(arms[0]["cached_hit"].as_f64().unwrap() > 0.0, "{report:#}");
    assert_eq!(arms[0]["cached_miss"].as_f64(), Some(0.0), "{report:#}");
    assert!(
        arms[1]["verdict"]
            .as_str()
            .unwrap()
            .contains("isolated by salt"),
        "{report:#}"
    );
    for arm in &arms[1..3] {
        assert!(
            arm["verdict"]
                .as_str()
                .unwrap()
                .contains("isolated by salt"),
            "{report:#}"
        );
    }
    assert!(
        arms[3]["verdict"]
            .as_str()
            .unwrap()
            .contains("not shared across keys"),
        "{report:#}"
    );
}

/// vLLM's rule (`--prefix-cache salt`): a salt is shared by every key
/// that sends it. The audit says so as a finding — unless told the server
/// documents it, when it is a verdict and exit 0.
#[test]
fn a_salt_shared_across_keys_is_a_finding_unless_the_server_documents_it() {
    let (code, report, stderr) = salt_audit("audit-salt-shared", &["--prefix-cache", "salt"], &[]);
    assert_eq!(code, Some(1), "{report:#}\n{stderr}");
    assert_eq!(rules(&report), ["salt-shared-across-keys"], "{report:#}");
    let (code, report, stderr) = salt_audit(
        "audit-salt-documented",
        &["--prefix-cache", "salt"],
        &["--salts-shared-across-keys"],
    );
    assert_eq!(code, Some(0), "{report:#}\n{stderr}");
    assert!(
        report["salt"][3]["verdict"]
            .as_str()
            .unwrap()
            .contains("as the server documents"),
        "{report:#}"
    );
}

/// `cache-salt-dropped`: a salted prompt's pages are cached without its
/// salt, so the same key's unsalted request finds them — the salt arm
/// without a salt sees the hit.
#[cfg(feature = "faults")]
#[test]
fn a_salt_dropped_from_the_cached_pages_is_found_by_the_salt_assertions() {
    let (code, report, stderr) = salt_audit(
        "audit-salt-dropped",
        &["--prefix-cache", "tenant", "--inject", "cache-salt-dropped"],
        &[],
    );
    assert_eq!(code, Some(1), "{report:#}\n{stderr}");
    assert_eq!(rules(&report), ["salt-not-isolating"], "{report:#}");
    let arm = &report["salt"][2];
    assert_eq!(arm["name"], "same key, no salt", "{report:#}");
    assert_eq!(arm["hit"], true, "{report:#}");
}

/// The audit's noninterference phase against `kvsan serve` (SmolLM2, a
/// 256-token context, 72-token steps so long prompts are prefilled in
/// chunks) with `fault` injected: the faults that move one request's KV
/// into another's output are found, exit 1, as a probe whose greedy
/// output changed with another request's canary or quoted it. Each test
/// runs the probe patterns (`--patterns`) that find its fault; the clean
/// test above runs every pattern without one. With `--fail-fast` the audit
/// stops after the pattern that found it, and says so.
#[cfg(feature = "faults")]
fn kv_fault_is_found(name: &'static str, fault: &str, patterns: &str, fail_fast: bool) -> Value {
    let server = chunked_server(name, "unified", &["--inject", fault]);
    let mut audit_args = vec![
        "--phases",
        "noninterference",
        "--patterns",
        patterns,
        "--timeout",
        "90",
    ];
    if fail_fast {
        audit_args.push("--fail-fast");
    }
    let (code, report, stderr) = audit_json_sized(&server.listen(), "360", "1", &audit_args);
    assert_eq!(code, Some(1), "{fault}: {report:#}\n{stderr}");
    let notes: Vec<&str> = report["notes"]
        .as_array()
        .unwrap()
        .iter()
        .map(|n| n.as_str().unwrap())
        .collect();
    assert!(
        notes
            .iter()
            .any(|n| n.starts_with("noninterference patterns not run (--patterns)")),
        "{fault}: {report:#}"
    );
    if fail_fast {
        assert!(
            notes
                .iter()
                .any(|n| n.starts_with("stopped at the first finding")),
            "{fault}: {report:#}"
        );
        assert_eq!(report["budget_spent"], false, "{report:#}");
    }
    let found = rules(&report);
    assert!(
        found
            .iter()
            .all(|r| r == "output-depends-on-other-request" || r == "canary-quoted"),
        "{fault}: {report:#}"
    );
    assert_eq!(report["determinism"]["deterministic"], true, "{report:#}");
    report
}

/// A long prefill chunk's KV store skips the last layer, which keeps the
/// page's earlier owner's KV: a long prompt sent again after a victim
/// (retried after it was abandoned, or twice at once) answers from it.
#[cfg(feature = "faults")]
#[test]
fn skip_layer_write_is_found_by_the_noninterference_probes() {
    kv_fault_is_found("audit-skip-layer-write", "skip-layer-write", "resent", true);
}

/// A batch-array row kept from step to step (`stale-batch-array`): the
/// probe that moves into the row a same-length victim has just left
/// attends over the victim's freed pages — found side by side.
#[cfg(feature = "faults")]
#[test]
fn stale_batch_array_is_found_side_by_side() {
    let report = kv_fault_is_found(
        "audit-stale-batch-array",
        "stale-batch-array",
        "side-by-side",
        false,
    );
    let findings = report["findings"].as_array().unwrap();
    assert!(
        findings
            .iter()
            .any(|f| f["evidence"]["probe"] == "side-by-side probe"),
        "{report:#}"
    );
}

/// A partial page shared through the prefix cache without a copy: a probe
/// extending another prompt while that one is answered differs from its
/// answer alone.
#[cfg(feature = "faults")]
#[test]
fn cache_partial_page_shared_is_found_by_the_noninterference_probes() {
    kv_fault_is_found(
        "audit-cache-partial-page-shared",
        "cache-partial-page-shared",
        "extended",
        true,
    );
}

/// A released sequence's tail page freed twice and handed out twice: a
/// long prompt sent again after a victim answers from another request's
/// KV.
#[cfg(feature = "faults")]
#[test]
fn double_free_is_found_by_the_noninterference_probes() {
    kv_fault_is_found("audit-double-free", "double-free", "resent", true);
}
