//! Time to first token with and without the prefix cache, and the
//! sanitizer's overhead with sharing on, as ratios measured in one run.
//!
//! ```text
//! cargo bench --bench prefix_cache [-- --rounds N]
//! ```
//!
//! Workloads (each request: a 384-token system prompt and a 16-token user
//! message, one token generated, sent one after another so each time is
//! the request's alone):
//!
//! - `within`: 4 tenants, each with its own two system prompts, 24
//!   requests round-robin: under `--prefix-cache tenant` each tenant's
//!   prompts are computed once and found after.
//! - `across`: 4 tenants with one system prompt in common, 24 requests:
//!   `tenant` computes it once per tenant, `global` once in all (the
//!   sharing `tenant` refuses on purpose).
//!
//! Variants, each on a fresh unified engine of a synthetic model (4 layers,
//! width 256; a pool of 8,192 tokens, room for every system prompt) per
//! round, in the same round interleaved: cache `off`,
//! `tenant`, `global`; and `tenant` with the in-process sanitizer attached
//! (kernel-shadow checks, every share checked). Reported: the mean time to
//! first token of each variant (median over rounds), and the per-round
//! ratios' median with their spread.

use std::sync::Arc;
use std::time::{Duration, Instant};

use kvsan_engine::engine::{Engine, EngineConfig};
use kvsan_engine::hooks::Hooks;
use kvsan_engine::model::{AttentionCheck, Model, SyntheticSpec};
use kvsan_engine::prefix_cache::PrefixCachePolicy;
use kvsan_engine::request::{Event, Request};
use kvsan_engine::sampler::SamplingParams;
use kvsan_sanitizer::{Options, Sanitizer, TenantId};

const SYSTEM_TOKENS: u32 = 384;
const USER_TOKENS: u32 = 16;
const REQUESTS: u32 = 24;
const TENANTS: u32 = 4;
const POOL_TOKENS: usize = 8192;

#[derive(Clone, Copy, PartialEq, Eq)]
enum Workload {
    Within,
    Across,
}

#[derive(Clone, Copy)]
struct Variant {
    name: &'static str,
    policy: PrefixCachePolicy,
    sanitizer: bool,
}

const VARIANTS: [Variant; 4] = [
    Variant {
        name: "off",
        policy: PrefixCachePolicy::Off,
        sanitizer: false,
    },
    Variant {
        name: "tenant",
        policy: PrefixCachePolicy::Tenant,
        sanitizer: false,
    },
    Variant {
        name: "global",
        policy: PrefixCachePolicy::Global,
        sanitizer: false,
    },
    Variant {
        name: "tenant+sanitizer",
        policy: PrefixCachePolicy::Tenant,
        sanitizer: true,
    },
];

fn model() -> Arc<Model> {
    Arc::new(
        SyntheticSpec {
            n_layers: 4,
            d_model: 256,
            n_heads: 8,
            n_kv_heads: 4,
            ffn_dim: 512,
            context_length: 2048,
            ..SyntheticSpec::default()
        }
        .build()
        .expect("synthetic model"),
    )
}

fn requests(workload: Workload) -> Vec<Request> {
    (0..REQUESTS)
        .map(|i| {
            let tenant = i % TENANTS;
            let system = match workload {
                Workload::Within => tenant * 2 + (i / TENANTS) % 2,
                Workload::Across => 0,
            };
            let mut prompt: Vec<u32> = (0..SYSTEM_TOKENS)
                .map(|t| (t * 13 + system * 71 + 1) % 256)
                .collect();
            prompt.extend((0..USER_TOKENS).map(|t| (t * 7 + i * 29) % 256));
            Request {
                tenant: TenantId(tenant + 1),
                prompt,
                max_tokens: 1,
                sampling: SamplingParams::greedy(),
                stop_tokens: Vec::new(),
                cache_salt: Default::default(),
            }
        })
        .collect()
}

/// Mean time to first token of `workload` on a fresh engine of `variant`.
fn run(model: &Arc<Model>, variant: Variant, workload: Workload) -> Duration {
    let (hooks, check) = if variant.sanitizer {
        let share = match variant.policy {
            PrefixCachePolicy::Global => "global",
            _ => "tenant",
        };
        let options = Options::parse(&format!("prefix_share={share}")).expect("options");
        (
            Hooks::sanitizer(Arc::new(Sanitizer::new(options).expect("sanitizer"))),
            AttentionCheck::Generations,
        )
    } else {
        (Hooks::none(), AttentionCheck::Unchecked)
    };
    let cfg = EngineConfig {
        hooks,
        check,
        prefix_cache: variant.policy,
        // Room for every system prompt at once (8 × 24 pages): the figures
        // are of sharing, not of eviction.
        pool_tokens: Some(POOL_TOKENS),
        ..EngineConfig::default()
    };
    let engine = Engine::unified(model.clone(), &cfg).expect("engine");
    let reqs = requests(workload);
    let mut total = Duration::ZERO;
    for r in &reqs {
        let start = Instant::now();
        let h = engine.submit(r.clone());
        match h.events.recv() {
            Ok(Event::Token(_) | Event::Finished { .. }) => total += start.elapsed(),
            other => panic!("no first token: {other:?}"),
        }
        h.wait().expect("finished");
    }
    total / reqs.len() as u32
}

fn median(v: &mut [f64]) -> f64 {
    v.sort_by(f64::total_cmp);
    v[v.len() / 2]
}

fn main() {
    let args: Vec<String> = std::env::args().collect();
    let rounds = args
        .iter()
        .position(|a| a == "--rounds")
        .and_then(|i| args.get(i + 1))
        .and_then(|n| n.parse::<usize>().ok())
        .unwrap_or(7)
        .max(1);
    let model = model();
    println!(
        "prefix cache: {REQUESTS} requests of {SYSTEM_TOKENS} + {USER_TOKENS} tokens, {TENANTS} tenants, {rounds} rounds interleaved"
    );
    for workload in [Workload::Within, Workload::Across] {
        let label = match workload {
            Workload::Within => "within a tenant (each tenant's own system prompts)",
            Workload::Across => "across tenants (one system prompt for all)",
        };
        let mut ttft: Vec<Vec<f64>> = vec![Vec::new(); VARIANTS.len()];
        for round in 0..rounds {
            // Each round starts the variants in a rotated order.
            for k in 0..VARIANTS.len() {
                let i = (k + round) % VARIANTS.len();
                ttft[i].push(run(&model, VARIANTS[i], workload).as_secs_f64() * 1e3);
            }
        }
        println!("\n{label}");
        println!("  {:<18} {:>14}", "variant", "mean TTFT (ms)");
        for (v, t) in VARIANTS.iter().zip(&ttft) {
            let mut t = t.clone();
            println!("  {:<18} {:>14.3}", v.name, median(&mut t));
        }
        let ratio = |a: usize, b: usize| {
            let mut r: Vec<f64> = ttft[a].iter().zip(&ttft[b]).map(|(x, y)| x / y).collect();
            let m = median(&mut r);
            let (lo, hi) = (r[0], r[r.len() - 1]);
            format!("{m:.3} (rounds {lo:.3}..{hi:.3})")
        };
        println!("  tenant / off:              {}", ratio(1, 0));
        println!("  global / off:              {}", ratio(2, 0));
        println!("  tenant+sanitizer / tenant: {}", ratio(3, 1));
    }
}
