//! The in-process sanitizer attached to the real engine (synthetic model):
//! unified and disaggregated, ~50 mixed requests with chunked prefill,
//! preemption and several tenants — zero violations, every request
//! answered, every page returned, with the debug-build settings on
//! (checked kernel, poisoned and quarantined freed pages).

use std::sync::Arc;

use kvsan_engine::engine::{Engine, EngineConfig};
use kvsan_engine::hooks::{HookTarget, Hooks};
use kvsan_engine::model::{AttentionCheck, SyntheticSpec};
use kvsan_engine::request::Request;
use kvsan_engine::sampler::SamplingParams;
use kvsan_engine::scheduler::SchedulerConfig;
use kvsan_sanitizer::{Options, ReportBuffer, Sanitizer, TenantId};
use rand::{RngExt, SeedableRng};
use rand_chacha::ChaCha8Rng;

fn run(disaggregated: bool) {
    let model = Arc::new(
        SyntheticSpec {
            context_length: 1024,
            ..SyntheticSpec::default()
        }
        .build()
        .expect("synthetic model"),
    );
    let options = Options::parse("quarantine_pages=8:poison=1").expect("options");
    let sink = ReportBuffer::default();
    let sanitizer = Arc::new(Sanitizer::with_writer(options, sink.clone()));
    let hooks = Hooks::sanitizer(sanitizer.clone());
    assert_eq!(hooks.target(), HookTarget::InProcess);
    assert!(hooks.poison());
    assert_eq!(hooks.quarantine_pages(), 8);
    // Small pools force preemption; small steps force chunked prefill.
    let cfg = EngineConfig {
        pool_tokens: Some(512),
        prefill_pool_tokens: Some(512),
        decode_pool_tokens: Some(512),
        allow_pool_smaller_than_context: true,
        scheduler: SchedulerConfig {
            step_tokens: 64,
            max_running: 8,
            chunk_tokens: None,
        },
        check: AttentionCheck::Generations,
        hooks,
        ..EngineConfig::default()
    };
    let engine = if disaggregated {
        Engine::disaggregated(model.clone(), &cfg)
    } else {
        Engine::unified(model.clone(), &cfg)
    }
    .expect("engine");
    let start = engine.stats();
    let mut rng = ChaCha8Rng::seed_from_u64(if disaggregated { 12 } else { 11 });
    let handles: Vec<_> = (0..50)
        .map(|_| {
            let n = rng.random_range(1..=300);
            engine.submit(Request {
                tenant: TenantId(rng.random_range(1..=4)),
                prompt: (0..n).map(|_| rng.random_range(0..256)).collect(),
                max_tokens: rng.random_range(1..=40),
                sampling: SamplingParams::greedy(),
                stop_tokens: Vec::new(),
                cache_salt: Default::default(),
            })
        })
        .collect();
    let answered = handles.iter().filter(|h| h.wait().is_ok()).count();
    let reports = sink.text();
    assert_eq!(
        sanitizer.violation_count(),
        0,
        "violations in a clean load: {}\n{reports}",
        sanitizer.summary()
    );
    assert_eq!(answered, 50, "every request finished normally");
    let end = engine.stats();
    assert_eq!(end.front.free_pages, start.front.free_pages);
    assert_eq!(
        end.front.illegal_transitions, 0,
        "no lifecycle move refused"
    );
    if let (Some(s), Some(e)) = (start.prefill, end.prefill) {
        assert_eq!(e.free_pages, s.free_pages);
        assert_eq!(e.illegal_transitions, 0, "no lifecycle move refused");
    }
}

#[test]
fn unified_engine_with_the_sanitizer_serves_50_mixed_requests_without_a_violation() {
    run(false);
}

#[test]
fn disaggregated_engine_with_the_sanitizer_serves_50_mixed_requests_without_a_violation() {
    run(true);
}
