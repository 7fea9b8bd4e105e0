//! The incident's bug class, re-created by the `reject-as-placeholder` fault
//! in the real engine (disaggregated, synthetic model): without the
//! sanitizer the probe's output depends on an earlier tenant's request — it
//! leaks — and with the fault off the probe is cleanly rejected.
//!
//! Run with `cargo test -p kvsan-engine --features faults`.
#![cfg(feature = "faults")]

use std::sync::{Arc, Mutex};

use kvsan_engine::engine::{Engine, EngineConfig, Output};
use kvsan_engine::faults::{self, Fault};
use kvsan_engine::model::{Model, SyntheticSpec};
use kvsan_engine::request::{ErrorKind, Request, RequestError};
use kvsan_engine::sampler::SamplingParams;
use kvsan_sanitizer::TenantId;

/// The fault switch is process-wide: tests that flip it take turns.
static FAULTS: Mutex<()> = Mutex::new(());

fn model() -> Arc<Model> {
    Arc::new(SyntheticSpec::default().build().expect("synthetic model"))
}

/// Prefill pool of 256 tokens, decode pool of 1,024: a 300-token prompt is
/// over the prefill node's limit. No sanitizer, plain kernels — a release
/// engine — whatever features this test binary was built with.
fn config() -> EngineConfig {
    EngineConfig {
        prefill_pool_tokens: Some(256),
        decode_pool_tokens: Some(1024),
        allow_pool_smaller_than_context: true,
        hooks: kvsan_engine::hooks::Hooks::none(),
        check: kvsan_engine::model::AttentionCheck::Unchecked,
        ..EngineConfig::default()
    }
}

fn request(tenant: u32, prompt: Vec<u32>, max_tokens: usize) -> Request {
    Request {
        tenant: TenantId(tenant),
        prompt,
        max_tokens,
        sampling: SamplingParams::greedy(),
        stop_tokens: Vec::new(),
    }
}

/// Victim `v` of tenant A, then the oversize probe of tenant B, on a fresh engine.
fn victim_then_probe(
    model: &Arc<Model>,
    victim_seed: u32,
) -> (Output, Result<Output, RequestError>) {
    let engine = Engine::disaggregated(model.clone(), &config()).expect("engine");
    let victim: Vec<u32> = (0..200).map(|i| (i * 7 + victim_seed * 31) % 256).collect();
    let v = engine
        .submit(request(1, victim, 8))
        .wait()
        .expect("victim finishes");
    let probe: Vec<u32> = (0..300).map(|i| (i * 13 + 5) % 256).collect();
    let p = engine.submit(request(2, probe, 16)).wait();
    (v, p)
}

#[test]
fn with_the_fault_the_probe_reads_the_victims_kv_and_its_output_leaks() {
    let _turn = FAULTS.lock().unwrap_or_else(|e| e.into_inner());
    faults::set(&[Fault::RejectAsPlaceholder]).expect("faults build");
    let model = model();
    let (_, p1) = victim_then_probe(&model, 1);
    let (_, p2) = victim_then_probe(&model, 2);
    faults::set(&[]).expect("faults build");
    let (p1, p2) = (
        p1.expect("the rejected probe is served"),
        p2.expect("the rejected probe is served"),
    );
    // Noninterference broken: the probe's tokens depend on the victim's prompt.
    assert_ne!(
        p1.tokens, p2.tokens,
        "the probe's output must change with the victim's KV"
    );
}

#[test]
fn without_the_fault_the_oversize_probe_is_rejected_and_noninterference_holds() {
    let _turn = FAULTS.lock().unwrap_or_else(|e| e.into_inner());
    faults::set(&[]).expect("faults build");
    let model = model();
    for seed in [1, 2] {
        let (_, p) = victim_then_probe(&model, seed);
        let err = p.expect_err("rejected");
        assert_eq!(err.kind, ErrorKind::Rejected);
        assert_eq!(
            err.rejection.as_ref().map(|r| (r.limit, r.node.as_str())),
            Some((256, "prefill"))
        );
    }
}

/// A report sink the test can read.
#[derive(Clone, Default)]
struct Sink(Arc<Mutex<Vec<u8>>>);

impl std::io::Write for Sink {
    fn write(&mut self, buf: &[u8]) -> std::io::Result<usize> {
        self.0
            .lock()
            .unwrap_or_else(|e| e.into_inner())
            .extend_from_slice(buf);
        Ok(buf.len())
    }
    fn flush(&mut self) -> std::io::Result<()> {
        Ok(())
    }
}

#[test]
fn with_the_sanitizer_the_probe_is_aborted_and_the_others_finish() {
    use kvsan_engine::hooks::Hooks;
    use kvsan_sanitizer::{Options, Sanitizer, ViolationKind};

    let _turn = FAULTS.lock().unwrap_or_else(|e| e.into_inner());
    faults::set(&[Fault::RejectAsPlaceholder]).expect("faults build");
    let sink = Sink::default();
    let sanitizer = Arc::new(Sanitizer::with_writer(
        Options::parse("report_format=both").expect("options"),
        sink.clone(),
    ));
    let cfg = EngineConfig {
        hooks: Hooks::sanitizer(sanitizer.clone()),
        ..config()
    };
    let engine = Engine::disaggregated(model(), &cfg).expect("engine");
    let victim: Vec<u32> = (0..200).map(|i| (i * 7 + 31) % 256).collect();
    let v = engine.submit(request(1, victim, 8)).wait();
    let probe: Vec<u32> = (0..300).map(|i| (i * 13 + 5) % 256).collect();
    let bystander = engine.submit(request(3, vec![9; 40], 12));
    let p = engine.submit(request(2, probe, 16)).wait();
    let bystander = bystander.wait();
    faults::set(&[]).expect("faults build");

    assert_eq!(v.expect("the victim finishes").tokens.len(), 8);
    assert_eq!(
        bystander
            .expect("an unrelated request finishes")
            .tokens
            .len(),
        12
    );
    let err = p.expect_err("the probe must be aborted");
    assert_eq!(err.kind, ErrorKind::Violation, "{}", err.message);
    let (id, kind) = *err.violation.expect("violation details");
    // The rejected request is caught at its first activity after rejection.
    assert_eq!(kind, ViolationKind::TerminalRequestActivity.name());
    assert!(err.message.contains(&id), "{}", err.message);
    let report = String::from_utf8(sink.0.lock().expect("sink").clone()).expect("utf-8 report");
    assert!(
        report.contains("terminal-request-activity") && report.contains(&id),
        "{report}"
    );
    assert_eq!(sanitizer.violation_count(), 1, "{report}");
    let stats = engine.stats();
    assert_eq!(
        stats.front.free_pages, stats.front.total_pages,
        "the aborted probe's pages were freed"
    );
}
