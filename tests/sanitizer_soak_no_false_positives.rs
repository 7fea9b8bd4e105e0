//! No false positives: a soak of 1,200 mixed requests (600 per topology) with
//! the in-process sanitizer and the checked kernel on, and no fault — the
//! sanitizer must report nothing and every request must be answered.
//!
//! The mix: six tenants; prompts from 1 token to over the context (rejected
//! at admission) and over the prefill pool (rejected there in the
//! disaggregated engine), most of them starting with one of four shared
//! system prompts, under the prefix cache (`tenant`: shared within a
//! tenant, every share checked); chunked prefill (small steps);
//! preemption and cache eviction (small pools); client cancels at random
//! points; poisoned freed pages, reused in the release engine's order (no
//! quarantine, the default).
//!
//! Both topologies soak once more with a host KV tier: preempted
//! requests' pages stored and loaded back, every store and load checked.
//!
//! The same soak runs once more in a child process of this test binary
//! (built without `sanitize`) under `LD_PRELOAD` of the shim: the engine
//! finds the shim's hook table itself, and the shim's exit summary must say
//! zero violations and a non-zero number of checks.

mod shim_common;
mod soak_common;

use std::sync::Arc;

use kvsan_engine::engine::{Engine, EngineConfig, RequestHandle};
use kvsan_engine::hooks::{HookTarget, Hooks};
use kvsan_engine::model::{AttentionCheck, SyntheticSpec};
use kvsan_engine::prefix_cache::PrefixCachePolicy;
use kvsan_engine::request::{ErrorKind, Request};
use kvsan_engine::sampler::SamplingParams;
use kvsan_engine::scheduler::SchedulerConfig;
use kvsan_sanitizer::{Options, ReportBuffer, Sanitizer, TenantId};
use soak_common::Rng;

/// Requests per topology.
const REQUESTS: usize = 600;
/// Requests in flight at once.
const IN_FLIGHT: usize = 24;
const CONTEXT: usize = 512;
const PREFILL_POOL: usize = 384;

/// What the client meant to do with a request.
#[derive(Clone, Copy, PartialEq, Eq, Hash, Debug)]
enum Plan {
    Serve,
    OverContext,
    OverPrefillPool,
    Cancel,
}

fn plan(rng: &mut Rng, disaggregated: bool) -> (Plan, Request) {
    let roll = rng.below(100);
    let (plan, len) = match roll {
        0..=3 => (Plan::OverContext, CONTEXT as u64 + 1 + rng.below(64)),
        4..=7 if disaggregated => (
            Plan::OverPrefillPool,
            PREFILL_POOL as u64 + 1 + rng.below((CONTEXT - PREFILL_POOL - 64) as u64),
        ),
        8..=17 => (Plan::Cancel, 1 + rng.below(300)),
        _ => (Plan::Serve, 1 + rng.below(300)),
    };
    // Two in three prompts begin with a shared system prompt (of 40 to 160
    // tokens), as far as their length goes.
    let system = (rng.below(3) > 0).then(|| rng.below(4) as u32);
    let prompt = (0..len as u32)
        .map(|i| match system {
            Some(k) if i < 40 * (k + 1) => (i * 7 + k * 61 + 1) % 256,
            _ => rng.below(256) as u32,
        })
        .collect();
    let request = Request {
        tenant: TenantId(1 + rng.below(6) as u32),
        prompt,
        max_tokens: 1 + rng.below(48) as usize,
        sampling: SamplingParams::greedy(),
        stop_tokens: Vec::new(),
        cache_salt: Default::default(),
    };
    (plan, request)
}

/// Which sanitizer the soak runs under.
enum Under {
    /// The in-process sanitizer, whose reports the test reads.
    InProcess,
    /// Whatever this process found at start-up: the preloaded shim.
    Environment,
}

fn soak(disaggregated: bool) {
    soak_under(disaggregated, &Under::InProcess, false);
}

/// `tier`: preempted requests' pages go to a host-memory tier and come
/// back (the engine's `kv_offload_host_bytes`), and the prefix cache's
/// evicted pages to a disk tier (`kv_offload_dir`), coming back on a hit;
/// every store and load checked.
fn soak_under(disaggregated: bool, under: &Under, tier: bool) {
    let model = Arc::new(
        SyntheticSpec {
            context_length: CONTEXT,
            ..SyntheticSpec::default()
        }
        .build()
        .expect("synthetic model"),
    );
    let sink = ReportBuffer::default();
    let sanitizer = Arc::new(Sanitizer::with_writer(
        Options::parse("poison=1").expect("options"),
        sink.clone(),
    ));
    let hooks = match under {
        Under::InProcess => Hooks::sanitizer(sanitizer.clone()),
        Under::Environment => {
            let hooks = Hooks::from_environment().expect("hooks");
            assert_eq!(hooks.target(), HookTarget::CTable, "the shim is attached");
            hooks
        }
    };
    let disk = tempfile::tempdir().expect("a directory for the disk tier");
    let cfg = EngineConfig {
        context: Some(CONTEXT),
        pool_tokens: Some(768),
        prefill_pool_tokens: Some(PREFILL_POOL),
        decode_pool_tokens: Some(768),
        allow_pool_smaller_than_context: true,
        scheduler: SchedulerConfig {
            step_tokens: 64,
            max_running: 8,
            chunk_tokens: None,
        },
        check: AttentionCheck::Generations,
        hooks,
        prefix_cache: PrefixCachePolicy::Tenant,
        kv_offload_host_bytes: if tier { 8 << 20 } else { 0 },
        kv_offload_dir: tier.then(|| disk.path().to_path_buf()),
        kv_offload_disk_bytes: 8 << 20,
        ..EngineConfig::default()
    };
    let engine = if disaggregated {
        Engine::disaggregated(model, &cfg)
    } else {
        Engine::unified(model, &cfg)
    }
    .expect("engine");
    let start = engine.stats();
    let mut rng = Rng(if disaggregated { 0xd15a } else { 0x0f1e });
    let mut window: std::collections::VecDeque<(Plan, RequestHandle)> = Default::default();
    let mut seen = std::collections::HashMap::<(Plan, &'static str), usize>::new();
    let mut finish = |plan: Plan, handle: RequestHandle| {
        let outcome = match handle.wait() {
            Ok(_) => "finished",
            Err(e) => match (plan, e.kind) {
                (Plan::OverContext | Plan::OverPrefillPool, ErrorKind::Rejected) => "rejected",
                (Plan::Cancel, ErrorKind::Cancelled) => "cancelled",
                _ => panic!(
                    "{plan:?}: unexpected error {}: {}",
                    e.kind.name(),
                    e.message
                ),
            },
        };
        *seen.entry((plan, outcome)).or_default() += 1;
    };
    // Cancels wait for a random number of later submissions: the engine has
    // then got the request to admission, prefill or decode, or finished it.
    let mut cancels: Vec<(usize, kvsan_sanitizer::RequestId)> = Vec::new();
    for i in 0..REQUESTS {
        let (plan, request) = plan(&mut rng, disaggregated);
        let handle = engine.submit(request);
        if plan == Plan::Cancel {
            cancels.push((i + rng.below(6) as usize, handle.id));
        }
        cancels.retain(|&(at, id)| {
            if at <= i {
                engine.cancel(id);
            }
            at > i
        });
        window.push_back((plan, handle));
        if window.len() >= IN_FLIGHT {
            let (plan, handle) = window.pop_front().expect("non-empty");
            finish(plan, handle);
        }
    }
    for (_, id) in cancels {
        engine.cancel(id);
    }
    for (plan, handle) in window {
        finish(plan, handle);
    }

    let reports = sink.text();
    assert_eq!(
        sanitizer.violation_count(),
        0,
        "violations in a clean load: {}\n{reports}",
        sanitizer.summary()
    );
    let count = |plan, outcome| seen.get(&(plan, outcome)).copied().unwrap_or(0);
    let answered: usize = seen.values().sum();
    assert_eq!(answered, REQUESTS, "every request answered: {seen:?}");
    assert!(count(Plan::Serve, "finished") > REQUESTS / 2, "{seen:?}");
    assert!(count(Plan::OverContext, "rejected") > 0, "{seen:?}");
    if disaggregated {
        assert!(count(Plan::OverPrefillPool, "rejected") > 0, "{seen:?}");
    }
    assert!(count(Plan::Cancel, "cancelled") > 0, "{seen:?}");
    let end = engine.stats();
    eprintln!("outcomes: {seen:?}\nstats: {end:?}");
    assert!(
        end.front.preemptions + end.prefill.as_ref().map_or(0, |p| p.preemptions) > 0,
        "the load must preempt: {end:?}"
    );
    assert_eq!(
        end.front.free_pages + end.front.cached_pages,
        start.front.free_pages,
        "pages returned (or kept by the prefix cache)"
    );
    if let (Some(s), Some(e)) = (start.prefill, end.prefill) {
        assert_eq!(
            e.free_pages + e.cached_pages,
            s.free_pages,
            "prefill pages returned (or kept by the prefix cache)"
        );
    }
    let cache = end.prefill.as_ref().unwrap_or(&end.front);
    assert!(
        cache.prefix_cache_hits > 0,
        "the prefix cache is used: {end:?}"
    );
    assert_eq!(
        end.front.anomalies.total(),
        0,
        "the anomaly monitor flags no honest request: {end:?}"
    );
    if tier {
        let hits = end.front.tiers[0].hits + end.prefill.as_ref().map_or(0, |p| p.tiers[0].hits);
        assert!(
            hits > 0,
            "preempted requests came back from the tier: {end:?}"
        );
        for node in std::iter::once(&end.front).chain(end.prefill.as_ref()) {
            assert_eq!(
                node.tiers[0].used + node.tiers[1].used,
                node.cached_tiered,
                "every preempted request's tier block let go of; the rest are the cache's: {end:?}"
            );
        }
        assert!(
            cache.tiers[1].stores > 0,
            "evicted cached pages went to disk: {end:?}"
        );
    }
}

#[test]
fn unified_engine_with_the_sanitizer_answers_600_mixed_requests_without_a_violation() {
    soak(false);
}

#[test]
fn disaggregated_engine_with_the_sanitizer_answers_600_mixed_requests_without_a_violation() {
    soak(true);
}

#[test]
fn with_a_host_tier_both_topologies_answer_600_mixed_requests_without_a_violation() {
    soak_under(false, &Under::InProcess, true);
    soak_under(true, &Under::InProcess, true);
}

const SHIM_CHILD: &str = "KVSAN_TEST_SOAK_UNDER_SHIM";

#[test]
fn under_the_shim_both_topologies_answer_600_mixed_requests_without_a_violation() {
    if std::env::var_os(SHIM_CHILD).is_some() {
        soak_under(false, &Under::Environment, false);
        soak_under(true, &Under::Environment, false);
        return;
    }
    let out = std::process::Command::new(std::env::current_exe().expect("test binary"))
        .args([
            "--exact",
            "under_the_shim_both_topologies_answer_600_mixed_requests_without_a_violation",
            "--nocapture",
        ])
        .env(SHIM_CHILD, "1")
        .env("LD_PRELOAD", shim_common::shim_library())
        .env("KVSAN_OPTIONS", "poison=1")
        .output()
        .expect("child");
    let (stdout, stderr) = shim_common::texts(&out);
    assert!(out.status.success(), "{stdout}\n{stderr}");
    assert!(stderr.contains("kvsan: attached"), "{stderr}");
    let summary = stderr
        .lines()
        .rev()
        .find(|l| l.starts_with("kvsan: ") && l.contains(" checks"))
        .unwrap_or_else(|| panic!("no summary line: {stderr}"));
    assert!(summary.starts_with("kvsan: 0 violations"), "{summary}");
    let checks: u64 = summary
        .rsplit("; ")
        .next()
        .and_then(|t| t.trim_end_matches(" checks").replace(',', "").parse().ok())
        .unwrap_or_else(|| panic!("checks in {summary}"));
    assert!(checks > 100_000, "{summary}");
}
