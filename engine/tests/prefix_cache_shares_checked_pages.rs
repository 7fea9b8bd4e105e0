//! The prefix cache in the real engine (synthetic model), unified and
//! disaggregated, with the in-process sanitizer checking every share:
//! requests with a common system prompt find it in the cache within their
//! tenant (and salt) and answer exactly as without the cache; another
//! tenant finds nothing; small pools evict and preempt; zero violations.

use std::sync::Arc;

use kvsan_engine::engine::{Engine, EngineConfig, Output};
use kvsan_engine::hooks::Hooks;
use kvsan_engine::model::{AttentionCheck, Model, SyntheticSpec};
use kvsan_engine::prefix_cache::PrefixCachePolicy;
use kvsan_engine::request::{CacheSalt, Request};
use kvsan_engine::sampler::SamplingParams;
use kvsan_engine::scheduler::SchedulerConfig;
use kvsan_sanitizer::{Options, ReportBuffer, Sanitizer, TenantId};
use rand::{RngExt, SeedableRng};
use rand_chacha::ChaCha8Rng;

fn model() -> Arc<Model> {
    Arc::new(
        SyntheticSpec {
            context_length: 1024,
            ..SyntheticSpec::default()
        }
        .build()
        .expect("synthetic model"),
    )
}

/// An engine of `topology` with `policy`, the sanitizer checking shares
/// under `prefix_share` (with quarantine and poison on), and `pool` tokens
/// per pool.
fn engine(
    disaggregated: bool,
    policy: PrefixCachePolicy,
    prefix_share: &str,
    pool: usize,
) -> (Engine, Arc<Sanitizer>, ReportBuffer) {
    engine_with_tiers(disaggregated, policy, prefix_share, pool, None)
}

/// [`engine`] whose nodes send evicted cached pages down a disk tier in
/// `disk` (and preempted requests' pages to a small host tier).
fn engine_with_tiers(
    disaggregated: bool,
    policy: PrefixCachePolicy,
    prefix_share: &str,
    pool: usize,
    disk: Option<&std::path::Path>,
) -> (Engine, Arc<Sanitizer>, ReportBuffer) {
    let options = Options::parse(&format!(
        "quarantine_pages=4:poison=1:prefix_share={prefix_share}"
    ))
    .expect("options");
    let sink = ReportBuffer::default();
    let sanitizer = Arc::new(Sanitizer::with_writer(options, sink.clone()));
    let cfg = EngineConfig {
        pool_tokens: Some(pool),
        prefill_pool_tokens: Some(pool),
        decode_pool_tokens: Some(pool),
        allow_pool_smaller_than_context: true,
        scheduler: SchedulerConfig {
            step_tokens: 64,
            max_running: 8,
            chunk_tokens: None,
        },
        check: AttentionCheck::Generations,
        hooks: Hooks::sanitizer(sanitizer.clone()),
        prefix_cache: policy,
        kv_offload_host_bytes: if disk.is_some() { 1 << 20 } else { 0 },
        kv_offload_dir: disk.map(std::path::Path::to_path_buf),
        kv_offload_disk_bytes: 8 << 20,
        ..EngineConfig::default()
    };
    let engine = if disaggregated {
        Engine::disaggregated(model(), &cfg)
    } else {
        Engine::unified(model(), &cfg)
    }
    .expect("engine");
    (engine, sanitizer, sink)
}

fn request(tenant: u32, prompt: Vec<u32>, max_tokens: usize) -> Request {
    Request {
        tenant: TenantId(tenant),
        prompt,
        max_tokens,
        sampling: SamplingParams::greedy(),
        stop_tokens: Vec::new(),
        cache_salt: CacheSalt::default(),
    }
}

/// A system prompt of `len` tokens, `which` telling prompts apart.
fn system(which: u32, len: usize) -> Vec<u32> {
    (0..len as u32)
        .map(|i| (i * 11 + which * 37 + 3) % 256)
        .collect()
}

fn with_user(system: &[u32], user: u32) -> Vec<u32> {
    let mut p = system.to_vec();
    p.extend((0..12).map(|i| (i * 5 + user * 17) % 256));
    p
}

/// Runs `requests` one after another (each finished before the next), on a
/// fresh engine each time, returning each output.
fn serve_one_by_one(engine: &Engine, requests: &[Request]) -> Vec<Output> {
    requests
        .iter()
        .map(|r| engine.submit(r.clone()).wait().expect("finished"))
        .collect()
}

fn assert_clean(sanitizer: &Sanitizer, sink: &ReportBuffer) {
    assert_eq!(
        sanitizer.violation_count(),
        0,
        "{}\n{}",
        sanitizer.summary(),
        sink.text()
    );
}

fn shares_within_a_tenant(disaggregated: bool) {
    let sys = system(1, 100);
    let requests = [
        request(1, with_user(&sys, 1), 6),
        request(1, with_user(&sys, 2), 6),
        request(2, with_user(&sys, 3), 6),
        request(1, with_user(&sys, 3), 6),
        request(2, with_user(&sys, 4), 6),
    ];
    let (plain, ..) = engine(disaggregated, PrefixCachePolicy::Off, "tenant", 1024);
    let expected = serve_one_by_one(&plain, &requests);
    let (cached, sanitizer, sink) =
        engine(disaggregated, PrefixCachePolicy::Tenant, "tenant", 1024);
    let got = serve_one_by_one(&cached, &requests);
    for (i, (g, e)) in got.iter().zip(&expected).enumerate() {
        assert_eq!(
            g.tokens, e.tokens,
            "request {i} answers as without the cache"
        );
        assert_eq!(e.cached_tokens, 0);
    }
    let cached_tokens: Vec<usize> = got.iter().map(|o| o.cached_tokens).collect();
    // 100 system tokens: 6 full pages of 16 = 96 tokens shared.
    assert_eq!(cached_tokens, [0, 96, 0, 96, 96], "{cached_tokens:?}");
    assert_clean(&sanitizer, &sink);
    let stats = cached.stats();
    let node = stats.prefill.unwrap_or(stats.front);
    assert_eq!(node.prefix_cache_hits, 3 * 96);
    assert!(node.prefix_cache_queries >= 5 * 112);
    assert!(node.cached_pages > 0);
    assert_eq!(node.free_pages + node.cached_pages, node.total_pages);
}

#[test]
fn unified_cache_shares_a_system_prompt_within_a_tenant_only() {
    shares_within_a_tenant(false);
}

#[test]
fn disaggregated_prefill_cache_shares_a_system_prompt_within_a_tenant_only() {
    shares_within_a_tenant(true);
}

fn salted(tenant: u32, prompt: Vec<u32>, client: Option<&str>) -> Request {
    Request {
        cache_salt: CacheSalt {
            server: None,
            client: client.map(str::to_string),
        },
        ..request(tenant, prompt, 3)
    }
}

#[test]
fn salt_policy_shares_across_tenants_with_one_salt_and_never_across_salts() {
    let sys = system(2, 64);
    let (engine, sanitizer, sink) = engine(false, PrefixCachePolicy::Salt, "salt", 1024);
    let requests = [
        salted(1, with_user(&sys, 1), Some("team-a")),
        salted(2, with_user(&sys, 2), Some("team-a")),
        salted(3, with_user(&sys, 3), Some("team-b")),
        salted(4, with_user(&sys, 4), None),
        salted(5, with_user(&sys, 5), None),
    ];
    let cached: Vec<usize> = serve_one_by_one(&engine, &requests)
        .iter()
        .map(|o| o.cached_tokens)
        .collect();
    assert_eq!(cached, [0, 64, 0, 0, 64], "{cached:?}");
    assert_clean(&sanitizer, &sink);
}

#[test]
fn global_policy_shares_across_tenants() {
    let sys = system(3, 48);
    let (engine, sanitizer, sink) = engine(true, PrefixCachePolicy::Global, "global", 1024);
    let requests = [
        request(1, with_user(&sys, 1), 3),
        request(2, with_user(&sys, 2), 3),
    ];
    let cached: Vec<usize> = serve_one_by_one(&engine, &requests)
        .iter()
        .map(|o| o.cached_tokens)
        .collect();
    assert_eq!(cached, [0, 48]);
    assert_clean(&sanitizer, &sink);
}

/// Small pools: cached pages are evicted, running requests preempted and
/// recomputed (finding their own pages in the cache), four tenants with
/// two system prompts each, all at once — every answer as without the
/// cache, zero violations, every page back in the pool or the cache.
fn mixed_load(disaggregated: bool, tiers: bool) {
    let mut rng = ChaCha8Rng::seed_from_u64(if disaggregated { 22 } else { 21 });
    let systems: Vec<Vec<u32>> = (0..2)
        .map(|w| system(w + 10, 40 + 30 * w as usize))
        .collect();
    let requests: Vec<Request> = (0..40)
        .map(|i| {
            let sys = &systems[rng.random_range(0..2)];
            request(
                rng.random_range(1..=4),
                with_user(sys, i),
                rng.random_range(1..=40),
            )
        })
        .collect();
    let (plain, ..) = engine(disaggregated, PrefixCachePolicy::Off, "tenant", 1024);
    let expected = serve_one_by_one(&plain, &requests);
    let dir = tempfile::tempdir().expect("a directory for the disk tier");
    let disk = tiers.then(|| dir.path());
    let (cached, sanitizer, sink) = engine_with_tiers(
        disaggregated,
        PrefixCachePolicy::Tenant,
        "tenant",
        384,
        disk,
    );
    let start = cached.stats();
    let handles: Vec<_> = requests.iter().map(|r| cached.submit(r.clone())).collect();
    for (i, (h, e)) in handles.iter().zip(&expected).enumerate() {
        let got = h.wait().expect("finished");
        assert_eq!(got.tokens, e.tokens, "request {i}");
    }
    assert_clean(&sanitizer, &sink);
    let end = cached.stats();
    let (s, e) = match (start.prefill, end.prefill) {
        (Some(s), Some(e)) => (s, e),
        _ => (start.front, end.front),
    };
    assert!(e.prefix_cache_hits > 0, "the cache is used");
    assert_eq!(e.free_pages + e.cached_pages, s.free_pages);
    assert_eq!(end.front.illegal_transitions, 0);
    if tiers {
        let disk = e.tiers[1];
        assert!(
            disk.stores > 0 && disk.hits > 0,
            "the disk tier is used: {disk:?}"
        );
        assert_eq!(disk.used, e.cached_tiered, "tier blocks are the cache's");
        assert_eq!(disk.io_errors, 0);
    }
}

#[test]
fn unified_cache_under_pool_pressure_answers_as_without_it() {
    mixed_load(false, false);
}

#[test]
fn disaggregated_cache_under_pool_pressure_answers_as_without_it() {
    mixed_load(true, false);
}

#[test]
fn unified_cache_with_tiers_under_pool_pressure_answers_as_without_it() {
    mixed_load(false, true);
}

#[test]
fn disaggregated_cache_with_tiers_under_pool_pressure_answers_as_without_it() {
    mixed_load(true, true);
}

/// Serves `requests` one by one on an engine without a cache and on one
/// with `policy` over a pool of 256 tokens whose evicted cached pages go
/// down a disk tier: every answer the same, no violation; the cached
/// tokens of each request, and the caching node's counters.
fn served_with_a_disk_tier(
    disaggregated: bool,
    policy: PrefixCachePolicy,
    requests: &[Request],
) -> (Vec<usize>, kvsan_engine::node::NodeStats) {
    let share = policy.share_option();
    let (plain, ..) = engine(disaggregated, PrefixCachePolicy::Off, share, 1024);
    let expected = serve_one_by_one(&plain, requests);
    let dir = tempfile::tempdir().expect("a directory for the disk tier");
    let (cached, sanitizer, sink) =
        engine_with_tiers(disaggregated, policy, share, 256, Some(dir.path()));
    let got = serve_one_by_one(&cached, requests);
    for (i, (g, e)) in got.iter().zip(&expected).enumerate() {
        assert_eq!(g.tokens, e.tokens, "request {i} answers as without a cache");
    }
    assert_clean(&sanitizer, &sink);
    let stats = cached.stats();
    let node = stats.prefill.unwrap_or(stats.front);
    (got.iter().map(|o| o.cached_tokens).collect(), node)
}

/// A system prompt's cached pages, evicted from the pool by other
/// tenants' prompts, go down the disk tier; the next request of the
/// tenant with that prompt is served them from disk (`cached_tokens`), and
/// answers as without any cache; another tenant with the same prompt gets
/// nothing from the tier.
fn served_from_disk_after_eviction(disaggregated: bool) {
    let sys = system(7, 100);
    let requests = [
        request(1, with_user(&sys, 1), 6),
        request(3, with_user(&system(8, 200), 1), 6),
        request(3, with_user(&system(9, 200), 1), 6),
        request(1, with_user(&sys, 2), 6),
        request(2, with_user(&sys, 3), 6),
    ];
    let (cached_tokens, node) =
        served_with_a_disk_tier(disaggregated, PrefixCachePolicy::Tenant, &requests);
    // 100 system tokens: 6 full pages, all six back from disk.
    assert_eq!(cached_tokens, [0, 0, 0, 96, 0], "{cached_tokens:?}");
    let disk = node.tiers[1];
    assert!(
        disk.stores >= 6 && disk.loads >= 6 && disk.hits >= 6,
        "{disk:?}"
    );
    assert_eq!(node.tiers[0].stores, 0, "cached pages go to disk first");
}

#[test]
fn unified_cache_serves_evicted_pages_from_disk() {
    served_from_disk_after_eviction(false);
}

#[test]
fn disaggregated_prefill_cache_serves_evicted_pages_from_disk() {
    served_from_disk_after_eviction(true);
}

/// Under the `global` policy a page another tenant's request left in the
/// cache, gone down to disk, is served from there to the next tenant
/// (the block's prefix-cache identity lets it share), cached again in the
/// pool under its writer's identity, evicted and served again: no
/// violation, every answer as without a cache.
#[test]
fn global_policy_serves_another_tenants_page_back_from_disk() {
    let sys = system(5, 100);
    let requests = [
        request(1, with_user(&sys, 1), 6),
        request(3, with_user(&system(8, 200), 1), 6),
        request(2, with_user(&sys, 2), 6),
        request(3, with_user(&system(9, 200), 1), 6),
        request(4, with_user(&sys, 3), 6),
    ];
    let (cached_tokens, node) =
        served_with_a_disk_tier(false, PrefixCachePolicy::Global, &requests);
    assert_eq!(cached_tokens, [0, 0, 96, 0, 96], "{cached_tokens:?}");
    let disk = node.tiers[1];
    assert!(disk.hits >= 6, "pages served from disk: {disk:?}");
}
