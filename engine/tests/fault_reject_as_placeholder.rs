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
/// over the prefill node's limit.
fn config() -> EngineConfig {
    EngineConfig {
        prefill_pool_tokens: Some(256),
        decode_pool_tokens: Some(1024),
        allow_pool_smaller_than_context: true,
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
