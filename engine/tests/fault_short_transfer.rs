//! The `short-transfer` bug class in the real engine (disaggregated,
//! synthetic model): prefill drops the last KV piece of a long prompt yet
//! reports the prefill done, decode commits the whole prompt. Without the
//! sanitizer the probe's output depends on an earlier tenant's request;
//! with it the probe is aborted with `short-transfer` and the others finish.
//!
//! Run with `cargo test -p kvsan-engine --features faults`.
#![cfg(feature = "faults")]

use std::sync::{Arc, Mutex};

use kvsan_engine::engine::{Engine, EngineConfig, Output};
use kvsan_engine::faults::{self, Fault};
use kvsan_engine::hooks::Hooks;
use kvsan_engine::model::{AttentionCheck, SyntheticSpec};
use kvsan_engine::request::{ErrorKind, Request, RequestError};
use kvsan_engine::sampler::SamplingParams;
use kvsan_sanitizer::{Options, Sanitizer, TenantId, ViolationKind};

/// The fault switch is process-wide: tests that flip it take turns.
static FAULTS: Mutex<()> = Mutex::new(());

fn request(tenant: u32, prompt: Vec<u32>, max_tokens: usize) -> Request {
    Request {
        tenant: TenantId(tenant),
        prompt,
        max_tokens,
        sampling: SamplingParams::greedy(),
        stop_tokens: Vec::new(),
    }
}

/// A short victim (one transfer piece, unaffected by the fault) whose answer
/// fills the decode pages the probe later gets back, then a 200-token probe.
fn victim_then_probe(
    hooks: Hooks,
    victim_seed: u32,
) -> (
    Result<Output, RequestError>,
    Result<Output, RequestError>,
    Result<Output, RequestError>,
) {
    let model = Arc::new(SyntheticSpec::default().build().expect("synthetic model"));
    let check = if hooks.is_attached() {
        AttentionCheck::Generations
    } else {
        AttentionCheck::Unchecked
    };
    let cfg = EngineConfig {
        hooks,
        check,
        ..EngineConfig::default()
    };
    let engine = Engine::disaggregated(model, &cfg).expect("engine");
    let victim: Vec<u32> = (0..40).map(|i| (i * 7 + victim_seed * 31) % 256).collect();
    let v = engine.submit(request(1, victim, 200)).wait();
    let bystander = engine.submit(request(3, vec![9; 30], 12));
    let probe: Vec<u32> = (0..200).map(|i| (i * 13 + 5) % 256).collect();
    let p = engine.submit(request(2, probe, 16)).wait();
    (v, p, bystander.wait())
}

#[test]
fn without_the_sanitizer_a_short_transfer_leaks_the_previous_requests_kv() {
    let _turn = FAULTS.lock().unwrap_or_else(|e| e.into_inner());
    faults::set(&[Fault::ShortTransfer]).expect("faults build");
    let (_, p1, _) = victim_then_probe(Hooks::none(), 1);
    let (_, p2, _) = victim_then_probe(Hooks::none(), 2);
    faults::set(&[]).expect("faults build");
    let (p1, p2) = (p1.expect("served"), p2.expect("served"));
    assert_ne!(
        p1.tokens, p2.tokens,
        "the probe's output must change with the victim's KV"
    );
    // The legal neighbour: with the fault off the probe does not depend on the victim.
    let (_, q1, _) = victim_then_probe(Hooks::none(), 1);
    let (_, q2, _) = victim_then_probe(Hooks::none(), 2);
    assert_eq!(q1.expect("served").tokens, q2.expect("served").tokens);
}

#[test]
fn with_the_sanitizer_the_short_transfer_is_aborted_at_commit_and_the_others_finish() {
    let _turn = FAULTS.lock().unwrap_or_else(|e| e.into_inner());
    faults::set(&[Fault::ShortTransfer]).expect("faults build");
    let sanitizer = Arc::new(Sanitizer::with_writer(Options::default(), std::io::sink()));
    let (v, p, bystander) = victim_then_probe(Hooks::sanitizer(sanitizer.clone()), 1);
    faults::set(&[]).expect("faults build");
    assert_eq!(v.expect("the victim finishes").tokens.len(), 200);
    assert_eq!(
        bystander
            .expect("an unrelated request finishes")
            .tokens
            .len(),
        12
    );
    let err = p.expect_err("the probe must be aborted");
    assert_eq!(err.kind, ErrorKind::Violation, "{}", err.message);
    assert_eq!(
        err.violation.expect("details").1,
        ViolationKind::ShortTransfer.name()
    );
    assert_eq!(sanitizer.violation_count(), 1);
}
