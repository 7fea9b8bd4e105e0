//! `on_violation` policies, report forms, sinks and limits.

mod common;

use std::process::Command;

use common::*;
use kvsan_sanitizer::{NodeRole, Options, PageId, Sanitizer, ViolationKind};

fn double_free(f: &Fixture) -> kvsan_sanitizer::Verdict {
    let page = f.alloc(f.decode, 0, A, 1);
    f.free(f.decode, A, page, 2);
    f.san.free(f.decode, A, page, 3).unwrap()
}

const HALT_CHILD: &str = "KVSAN_TEST_HALT_CHILD";

#[test]
fn halt_policy_writes_the_report_then_exits_with_exitcode() {
    if std::env::var_os(HALT_CHILD).is_some() {
        let san = Sanitizer::new(Options::parse("on_violation=halt:exitcode=42").unwrap()).unwrap();
        let pool = san
            .pool_register(geometry(NodeRole::Unified, "unified-0", 4))
            .unwrap();
        let (_, generation) = san.alloc(pool, PageId(0), A, 1).unwrap();
        let page = kvsan_sanitizer::PageRef {
            page: PageId(0),
            generation,
        };
        let _ = san.free(pool, A, page, 2).unwrap();
        let _ = san.free(pool, A, page, 3);
        panic!("on_violation=halt returned to the caller");
    }
    let out = Command::new(std::env::current_exe().unwrap())
        .args([
            "--exact",
            "halt_policy_writes_the_report_then_exits_with_exitcode",
            "--nocapture",
        ])
        .env(HALT_CHILD, "1")
        .output()
        .unwrap();
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert_eq!(out.status.code(), Some(42), "stderr:\n{stderr}");
    assert!(
        stderr.contains(
            "kvsan: ERROR: double-free in request 4 (tenant 1) freeing pool 0 page 0@gen 1"
        ),
        "{stderr}"
    );
    assert!(
        stderr.contains("kvsan: 1 violation (double-free: 1)"),
        "{stderr}"
    );
}

#[test]
fn abort_policy_returns_abort_with_the_violation_id() {
    let f = fixture_with("on_violation=abort");
    let v = double_free(&f);
    let recorded = f.san.violations();
    assert_eq!(
        v,
        kvsan_sanitizer::Verdict::Abort {
            violation: recorded[0].id,
            kind: ViolationKind::DoubleFree
        }
    );
    assert!(f.out.text().contains(&recorded[0].id.to_string()));
}

#[test]
fn report_policy_continues_but_reports_and_counts() {
    let f = fixture_with("on_violation=report");
    let v = double_free(&f);
    assert!(v.is_continue());
    assert_eq!(f.san.count(ViolationKind::DoubleFree), 1);
    assert!(f.out.text().contains("kvsan: ERROR: double-free"));
    // alloc, free, free: three checks.
    assert_eq!(
        f.san.summary(),
        "kvsan: 1 violation (double-free: 1); 3 checks"
    );
}

#[test]
fn json_reports_are_one_line_with_the_text_fields() {
    let f = fixture_with("report_format=json:on_violation=report");
    let page = f.alloc(f.decode, 3, A, 1);
    f.write_all(f.decode, A, page, 0..2, 2);
    let _ = f.san.read(f.decode, A, &[page], 3, ALL, 3).unwrap();
    let text = f.out.text();
    assert_eq!(text.lines().count(), 1, "{text}");
    let json: serde_json::Value = serde_json::from_str(text.trim()).unwrap();
    assert_eq!(json["kind"], "stale-read");
    assert!(json["id"].as_str().unwrap().starts_with("KV-"));
    assert_eq!(
        json["summary"],
        "kvsan: stale-read in request 4 (tenant 1) reading pool 0 page 3@gen 1 owned by request 4 (tenant 1)"
    );
    assert_eq!(json["accessor"]["request"], 4);
    assert_eq!(json["accessor"]["tenant"], 1);
    assert_eq!(json["page"]["owner"]["request"], 4);
    assert_eq!(json["page"]["slot_map"], "WW..............");
    assert_eq!(json["page"]["faulting_slot"], 2);
    assert_eq!(json["page"]["node"], "decode-0");
    assert_eq!(json["history"][0]["kind"], "alloc");
    assert_eq!(json["history"][1]["kind"], "write");
    assert_eq!(json["history"][1]["step"], 2);
}

#[test]
fn both_writes_the_text_block_then_the_json_line_with_the_same_summary() {
    let f = fixture_with("report_format=both");
    let _ = double_free(&f);
    let text = f.out.text();
    let last = text.lines().last().unwrap();
    let json: serde_json::Value = serde_json::from_str(last).unwrap();
    let summary = json["summary"].as_str().unwrap();
    assert!(
        text.contains(&summary.replacen("kvsan: ", "kvsan: ERROR: ", 1)),
        "{text}"
    );
}

#[test]
fn print_limit_caps_printed_reports_but_counting_goes_on() {
    let f = fixture_with("print_limit=1:on_violation=report");
    let _ = double_free(&f);
    let _ = f
        .san
        .free(f.decode, A, f.alloc(f.decode, 1, B, 1), 4)
        .unwrap();
    assert_eq!(f.out.text().matches("kvsan: ERROR:").count(), 1);
    assert_eq!(f.san.violation_count(), 2);
    assert_eq!(
        f.san.summary(),
        "kvsan: 2 violations (double-free: 1, foreign-free: 1); 5 checks"
    );
}

#[test]
fn the_recent_violation_list_is_bounded_oldest_dropped_first() {
    let f = fixture_with("max_recorded=2:print_limit=1");
    let page = f.alloc(f.decode, 0, A, 1);
    let mut ids = Vec::new();
    for step in 0..3 {
        if let kvsan_sanitizer::Verdict::Abort { violation, .. } =
            f.san.free(f.decode, B, page, step).unwrap()
        {
            ids.push(violation);
        }
    }
    let kept: Vec<_> = f.san.violations().iter().map(|v| v.id).collect();
    assert_eq!(kept, ids[1..].to_vec());
    assert_eq!(f.san.violations()[0].page, Some(PageId(0)));
    assert_eq!(f.san.violations()[0].request, B.request);
}

#[test]
fn log_path_appends_the_pid_and_receives_the_reports() {
    let base = std::env::temp_dir().join(format!("kvsan-log-test-{}", std::process::id()));
    let options = Options::parse(&format!("log_path={}", base.display())).unwrap();
    let san = Sanitizer::new(options).unwrap();
    let pool = san
        .pool_register(geometry(NodeRole::Decode, "decode-0", 2))
        .unwrap();
    let (_, generation) = san.alloc(pool, PageId(0), A, 1).unwrap();
    let v = san
        .free(
            pool,
            B,
            kvsan_sanitizer::PageRef {
                page: PageId(0),
                generation,
            },
            2,
        )
        .unwrap();
    assert_eq!(v.kind(), Some(ViolationKind::ForeignFree));
    san.print_summary();
    let path = format!("{}.{}", base.display(), std::process::id());
    let text = std::fs::read_to_string(&path).unwrap();
    std::fs::remove_file(&path).unwrap();
    assert!(text.contains("kvsan: ERROR: foreign-free"), "{text}");
    assert!(
        text.ends_with("kvsan: 1 violation (foreign-free: 1); 2 checks\n"),
        "{text}"
    );
}

#[test]
fn an_unopenable_log_path_is_an_error_naming_the_file() {
    let options = Options::parse("log_path=/nonexistent-dir-kvsan/x").unwrap();
    let err = Sanitizer::new(options).unwrap_err().to_string();
    assert!(err.contains("/nonexistent-dir-kvsan/x."), "{err}");
}

#[test]
fn api_misuse_is_an_error_not_a_violation() {
    let f = fixture();
    let err = f
        .san
        .alloc(f.decode, PageId(99), A, 1)
        .unwrap_err()
        .to_string();
    assert_eq!(err, "page 99 is out of range for pool 0, which has 8 pages");
    let page = f.alloc(f.decode, 0, A, 1);
    let err = f
        .san
        .write(f.decode, A, page, 0..17, ALL, 1)
        .unwrap_err()
        .to_string();
    assert!(
        err.contains("slot range 0..17") && err.contains("16 slots"),
        "{err}"
    );
    let err = f
        .san
        .read(f.decode, A, &[page], 4, 0..31, 1)
        .unwrap_err()
        .to_string();
    assert!(
        err.contains("layer range 0..31") && err.contains("30 layers"),
        "{err}"
    );
    let err = f
        .san
        .read(f.decode, A, &[page], 17, ALL, 1)
        .unwrap_err()
        .to_string();
    assert!(
        err.contains("17 tokens") && err.contains("capacity 16"),
        "{err}"
    );
    let err = f
        .san
        .read(kvsan_sanitizer::PoolId(9), A, &[page], 1, ALL, 1)
        .unwrap_err()
        .to_string();
    assert_eq!(err, "unknown pool 9: 2 pools are registered");
    assert_eq!(f.san.violation_count(), 0);
}

/// SmolLM2-135M: 30 layers, 16-slot pages, 3 KV heads × 64 dims, f16, K and V.
#[test]
fn shadow_memory_is_under_a_thousandth_of_the_kv_pool_for_smollm2() {
    let g = geometry(NodeRole::Decode, "decode-0", 1);
    assert_eq!(g.page_bytes(), 368_640);
    let depth = Options::default().history_depth;
    let shadow = Sanitizer::shadow_bytes_per_page(&g, depth);
    let fraction = shadow as f64 / g.page_bytes() as f64;
    println!(
        "shadow bytes per page: {shadow} (history depth {depth}) = {:.4}% of a {}-byte KV page",
        fraction * 100.0,
        g.page_bytes()
    );
    assert!(fraction <= 0.001, "{shadow} bytes per page is {fraction}");
}
