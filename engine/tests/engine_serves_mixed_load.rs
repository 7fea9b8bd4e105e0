//! The engine under load, on the synthetic model: unified and disaggregated,
//! continuous batching, chunked prefill, preemption, cancellation — every
//! request answered, every page returned, each greedy output equal to the
//! same request run alone.

use std::sync::Arc;

use kvsan_engine::engine::{Engine, EngineConfig, Output};
use kvsan_engine::hooks::Hooks;
use kvsan_engine::model::{AttentionCheck, Model, SyntheticSpec};
use kvsan_engine::request::{ErrorKind, Event, Request};
use kvsan_engine::sampler::SamplingParams;
use kvsan_engine::scheduler::SchedulerConfig;
use kvsan_sanitizer::{Options, ReportBuffer, Sanitizer, TenantId};
use rand::{RngExt, SeedableRng};
use rand_chacha::ChaCha8Rng;

fn model(context: usize) -> Arc<Model> {
    Arc::new(
        SyntheticSpec {
            context_length: context,
            ..SyntheticSpec::default()
        }
        .build()
        .expect("synthetic model"),
    )
}

fn request(rng: &mut ChaCha8Rng, max_prompt: usize, max_new: usize, vocab: u32) -> Request {
    let n = rng.random_range(1..=max_prompt);
    Request {
        tenant: TenantId(rng.random_range(1..=4)),
        prompt: (0..n).map(|_| rng.random_range(0..vocab)).collect(),
        max_tokens: rng.random_range(1..=max_new),
        sampling: SamplingParams::greedy(),
        stop_tokens: Vec::new(),
        cache_salt: Default::default(),
    }
}

/// Each request run alone, one at a time, on a fresh unified engine.
fn alone(model: &Arc<Model>, requests: &[Request]) -> Vec<Output> {
    let engine = Engine::unified(model.clone(), &EngineConfig::default()).expect("engine");
    requests
        .iter()
        .map(|r| engine.submit(r.clone()).wait().expect("alone"))
        .collect()
}

/// Submits `requests` keeping `in_flight` outstanding; returns the outputs in order.
fn run_load(engine: &Engine, requests: &[Request], in_flight: usize) -> Vec<Output> {
    let mut handles = std::collections::VecDeque::new();
    let mut outputs = Vec::new();
    for r in requests {
        if handles.len() == in_flight {
            let h: kvsan_engine::engine::RequestHandle = handles.pop_front().expect("handle");
            outputs.push(h.wait().expect("request answered"));
        }
        handles.push_back(engine.submit(r.clone()));
    }
    for h in handles {
        outputs.push(h.wait().expect("request answered"));
    }
    outputs
}

fn check_load(disaggregated: bool) {
    let model = model(4096);
    let mut rng = ChaCha8Rng::seed_from_u64(if disaggregated { 2 } else { 1 });
    let requests: Vec<Request> = (0..200)
        .map(|_| request(&mut rng, 2000, 256, 256))
        .collect();
    let cfg = EngineConfig {
        scheduler: SchedulerConfig {
            step_tokens: 256,
            max_running: 32,
            chunk_tokens: None,
        },
        ..EngineConfig::default()
    };
    let engine = if disaggregated {
        Engine::disaggregated(model.clone(), &cfg)
    } else {
        Engine::unified(model.clone(), &cfg)
    }
    .expect("engine");
    let start = engine.stats();
    let outputs = run_load(&engine, &requests, 16);
    let end = engine.stats();
    assert_eq!(
        end.front.free_pages, start.front.free_pages,
        "front pool pages returned"
    );
    assert_eq!(end.front.free_pages, end.front.total_pages);
    if let (Some(s), Some(e)) = (start.prefill, end.prefill) {
        assert_eq!(e.free_pages, s.free_pages, "prefill pool pages returned");
        assert_eq!(
            e.transfers, end.front.transfers,
            "every KV transfer sent was received"
        );
        assert!(e.transfers >= 200, "prompts went through the prefill node");
    }
    let expected = alone(&model, &requests);
    for (i, (got, want)) in outputs.iter().zip(&expected).enumerate() {
        assert_eq!(
            got,
            want,
            "request {i} (prompt {}, max {}) differs from running alone",
            requests[i].prompt.len(),
            requests[i].max_tokens
        );
        assert_eq!(got.tokens.len(), requests[i].max_tokens);
    }
}

#[test]
fn unified_engine_answers_200_mixed_requests_like_alone_and_returns_every_page() {
    check_load(false);
}

#[test]
fn disaggregated_engine_answers_200_mixed_requests_like_alone_and_returns_every_page() {
    check_load(true);
}

/// 8 pages of 16 slots per pool: any one request of [`preempting_load`]
/// (≤ 100 tokens) fits alone, a few do not together.
fn small_pools() -> EngineConfig {
    EngineConfig {
        pool_tokens: Some(128),
        decode_pool_tokens: Some(128),
        prefill_pool_tokens: Some(128),
        allow_pool_smaller_than_context: true,
        scheduler: SchedulerConfig {
            step_tokens: 64,
            max_running: 16,
            chunk_tokens: None,
        },
        ..EngineConfig::default()
    }
}

fn engine(model: &Arc<Model>, cfg: &EngineConfig, disaggregated: bool) -> Engine {
    if disaggregated {
        Engine::disaggregated(model.clone(), cfg)
    } else {
        Engine::unified(model.clone(), cfg)
    }
    .expect("engine")
}

/// 24 requests of at most 40 prompt and 60 new tokens, and each one's
/// output run alone.
fn preempting_load(model: &Arc<Model>) -> (Vec<Request>, Vec<Output>) {
    let mut rng = ChaCha8Rng::seed_from_u64(7);
    let requests: Vec<Request> = (0..24).map(|_| request(&mut rng, 40, 60, 256)).collect();
    let expected = alone(model, &requests);
    (requests, expected)
}

#[test]
fn a_pool_of_a_few_pages_forces_preemption_and_every_request_finishes() {
    let model = model(4096);
    let (requests, expected) = preempting_load(&model);
    for disaggregated in [false, true] {
        let engine = engine(&model, &small_pools(), disaggregated);
        let outputs = run_load(&engine, &requests, 12);
        let stats = engine.stats();
        assert!(
            stats.front.preemptions > 0,
            "the pool was meant to force preemption"
        );
        assert_eq!(stats.front.free_pages, stats.front.total_pages);
        assert_eq!(
            outputs, expected,
            "preempted requests recompute to the same tokens"
        );
    }
}

/// The same small pools with a KV tier: a preempted request's pages go to
/// host memory (or to the disk tier's file, in a run without a host tier)
/// and come back when it is admitted again, instead of being recomputed —
/// each output equal to the request run alone, every page and tier block
/// returned, and the sanitizer (attached, the checked kernel on) finding
/// nothing in the stores, loads and reads.
#[test]
fn preempted_requests_come_back_from_a_tier_as_they_would_have_answered() {
    let model = model(4096);
    let (requests, expected) = preempting_load(&model);
    let dir = tempfile::tempdir().expect("a directory for the disk tier");
    for (disaggregated, disk) in [(false, false), (true, false), (false, true)] {
        let sanitizer = Arc::new(Sanitizer::with_writer(
            Options::default(),
            ReportBuffer::default(),
        ));
        let cfg = EngineConfig {
            check: AttentionCheck::Generations,
            hooks: Hooks::sanitizer(sanitizer.clone()),
            kv_offload_host_bytes: if disk { 0 } else { 64 << 20 },
            kv_offload_dir: disk.then(|| dir.path().to_path_buf()),
            kv_offload_disk_bytes: 64 << 20,
            ..small_pools()
        };
        let engine = engine(&model, &cfg, disaggregated);
        let outputs = run_load(&engine, &requests, 12);
        let stats = engine.stats();
        let tier = stats.front.tiers[usize::from(disk)];
        assert!(
            stats.front.preemptions > 0,
            "the pool was meant to force preemption"
        );
        assert!(
            tier.hits > 0 && tier.loads > 0 && tier.stores >= tier.loads,
            "preempted requests came back from the tier: {tier:?}"
        );
        assert_eq!(tier.used, 0, "every tier block let go of");
        assert_eq!(tier.io_errors, 0);
        assert_eq!(stats.front.free_pages, stats.front.total_pages);
        assert_eq!(sanitizer.violation_count(), 0, "{}", sanitizer.summary());
        assert_eq!(
            outputs, expected,
            "requests back from the tier answer as alone"
        );
    }
}

#[test]
fn a_host_tier_smaller_than_a_page_is_refused_naming_the_page_size() {
    let cfg = EngineConfig {
        kv_offload_host_bytes: 100,
        ..EngineConfig::default()
    };
    let err = Engine::unified(model(256), &cfg)
        .err()
        .expect("refused")
        .to_string();
    assert!(
        err.contains("a host KV tier of 100 bytes holds no page: a page of this model is"),
        "{err}"
    );
}

#[test]
fn the_incident_scaled_down_is_a_clean_rejection_with_nothing_allocated_or_sent() {
    let model = model(8192);
    let cfg = EngineConfig {
        context: Some(8192),
        prefill_pool_tokens: Some(1024),
        decode_pool_tokens: Some(8192),
        allow_pool_smaller_than_context: true,
        ..EngineConfig::default()
    };
    let engine = Engine::disaggregated(model, &cfg).expect("engine");
    let oversize = Request {
        tenant: TenantId(2),
        prompt: vec![7; 1100],
        max_tokens: 16,
        sampling: SamplingParams::greedy(),
        stop_tokens: Vec::new(),
        cache_salt: Default::default(),
    };
    let err = engine
        .submit(oversize)
        .wait()
        .expect_err("must be rejected");
    assert_eq!(err.kind, ErrorKind::Rejected);
    let rejection = err.rejection.expect("rejection details");
    assert_eq!(
        (
            rejection.prompt_tokens,
            rejection.limit,
            rejection.node.as_str()
        ),
        (1100, 1024, "prefill")
    );
    assert!(
        err.message.contains("1100") && err.message.contains("1024"),
        "{}",
        err.message
    );
    let stats = engine.stats();
    let prefill = stats.prefill.expect("prefill node");
    assert_eq!(stats.front.pages_allocated, 0, "decode allocated nothing");
    assert_eq!(prefill.pages_allocated, 0, "prefill allocated nothing");
    assert_eq!(
        (stats.front.transfers, prefill.transfers),
        (0, 0),
        "nothing was transferred"
    );
    assert_eq!(prefill.steps, 0, "nothing was computed");
}

#[test]
fn a_request_over_the_context_is_rejected_naming_the_limit() {
    let engine = Engine::unified(model(4096), &EngineConfig::default()).expect("engine");
    let r = Request {
        tenant: TenantId(1),
        prompt: vec![1; 4000],
        max_tokens: 200,
        sampling: SamplingParams::greedy(),
        stop_tokens: vec![],
        cache_salt: Default::default(),
    };
    let err = engine.submit(r).wait().expect_err("over the context");
    assert_eq!(err.kind, ErrorKind::Rejected);
    assert_eq!(err.rejection.as_ref().map(|r| r.limit), Some(4096));
    assert_eq!(engine.stats().front.pages_allocated, 0);
}

#[test]
fn a_pool_smaller_than_the_context_is_refused_at_start_unless_allowed() {
    let cfg = EngineConfig {
        pool_tokens: Some(1024),
        ..EngineConfig::default()
    };
    let err = Engine::unified(model(4096), &cfg)
        .err()
        .expect("refused")
        .to_string();
    assert!(
        err.contains("1024")
            && err.contains("4096")
            && err.contains("--allow-pool-smaller-than-context"),
        "{err}"
    );
    let allowed = EngineConfig {
        allow_pool_smaller_than_context: true,
        ..cfg
    };
    let engine = Engine::unified(model(4096), &allowed).expect("allowed");
    let r = Request {
        tenant: TenantId(1),
        prompt: vec![1; 1500],
        max_tokens: 4,
        sampling: SamplingParams::greedy(),
        stop_tokens: vec![],
        cache_salt: Default::default(),
    };
    let err = engine.submit(r).wait().expect_err("does not fit the pool");
    assert!(
        err.message.contains("1500") && err.message.contains("1024"),
        "{}",
        err.message
    );
}

#[test]
fn cancelling_mid_decode_frees_the_pages_and_others_go_on() {
    for disaggregated in [false, true] {
        let m = model(4096);
        let engine = if disaggregated {
            Engine::disaggregated(m, &EngineConfig::default())
        } else {
            Engine::unified(m, &EngineConfig::default())
        }
        .expect("engine");
        let long = Request {
            tenant: TenantId(1),
            prompt: vec![3; 50],
            max_tokens: 3000,
            sampling: SamplingParams::greedy(),
            stop_tokens: vec![],
            cache_salt: Default::default(),
        };
        let other = Request {
            tenant: TenantId(2),
            prompt: vec![4; 20],
            max_tokens: 5,
            ..long.clone()
        };
        let h = engine.submit(long);
        // Wait for a few tokens, then cancel.
        for _ in 0..3 {
            assert!(matches!(h.events.recv().expect("token"), Event::Token(_)));
        }
        let o = engine.submit(other);
        engine.cancel(h.id);
        let err = h.wait().expect_err("cancelled");
        assert_eq!(err.kind, ErrorKind::Cancelled);
        assert_eq!(o.wait().expect("other request finishes").tokens.len(), 5);
        let s = engine.stats();
        assert_eq!(s.front.free_pages, s.front.total_pages);
    }
}
