//! Preemption with a KV tier (host memory, or the disk tier's file)
//! against preemption by recompute, with and without the sanitizer, on the default model (SmolLM2-135M Q4_1) in
//! the real engine (unified node, 2 threads as the machine gives).
//!
//! ```text
//! cargo bench --bench preemption
//! ```
//!
//! Workload: 8 requests of 192-token prompts and 64 new tokens each, all in
//! flight at once, on a pool of 48 pages of 16 slots (768 tokens: a few
//! requests fit at once, the rest wait or are preempted mid-decode). Six
//! arms — recompute, host tier (`kv_offload_host_bytes`) or disk tier
//! (`kv_offload_dir` in a temporary directory), each with no sanitizer or
//! the in-process sanitizer with the checked kernel — run alternately,
//! `KVSAN_BENCH_RUNS` rounds (default 3). Prints, per arm, the median wall
//! time and generated tokens/s, the preemptions and tier hits of a run, and
//! per round the ratio of each tier's time to recompute's (below 1: the
//! tier is faster) with and without the sanitizer, and the sanitizer's
//! cost on each.

mod common;

use std::sync::Arc;
use std::time::Instant;

use kvsan_engine::engine::{Engine, EngineConfig};
use kvsan_engine::fetch::ensure_default_model;
use kvsan_engine::hooks::Hooks;
use kvsan_engine::model::{AttentionCheck, Model};
use kvsan_engine::request::Request;
use kvsan_engine::sampler::SamplingParams;
use kvsan_engine::scheduler::SchedulerConfig;
use kvsan_sanitizer::{Options, Sanitizer, TenantId};

use common::{median, tokens};

const REQUESTS: usize = 8;
const PROMPT: usize = 192;
const NEW: usize = 64;

#[derive(Clone, Copy, PartialEq, Eq)]
enum Tier {
    Recompute,
    Host,
    Disk,
}

#[derive(Clone, Copy)]
struct Arm {
    name: &'static str,
    tier: Tier,
    sanitized: bool,
}

struct Run {
    secs: f64,
    preemptions: u64,
    tier_hits: u64,
}

fn run(model: &Arc<Model>, arm: Arm, disk: &std::path::Path) -> Run {
    let (hooks, check, sanitizer) = if arm.sanitized {
        let s = Arc::new(Sanitizer::with_writer(Options::default(), std::io::sink()));
        (
            Hooks::sanitizer(s.clone()),
            AttentionCheck::Generations,
            Some(s),
        )
    } else {
        (Hooks::none(), AttentionCheck::Unchecked, None)
    };
    let cfg = EngineConfig {
        context: Some(1024),
        pool_tokens: Some(48 * 16),
        allow_pool_smaller_than_context: true,
        scheduler: SchedulerConfig {
            step_tokens: 256,
            max_running: REQUESTS,
            chunk_tokens: None,
        },
        check,
        hooks,
        kv_offload_host_bytes: if arm.tier == Tier::Host { 256 << 20 } else { 0 },
        kv_offload_dir: (arm.tier == Tier::Disk).then(|| disk.to_path_buf()),
        kv_offload_disk_bytes: 256 << 20,
        ..EngineConfig::default()
    };
    let engine = Engine::unified(model.clone(), &cfg).expect("engine");
    let t = Instant::now();
    let handles: Vec<_> = (0..REQUESTS)
        .map(|i| {
            engine.submit(Request {
                tenant: TenantId(1 + i as u32 % 2),
                prompt: tokens(PROMPT, i as u64),
                max_tokens: NEW,
                sampling: SamplingParams::greedy(),
                stop_tokens: Vec::new(),
                cache_salt: Default::default(),
            })
        })
        .collect();
    for h in handles {
        h.wait().expect("answered");
    }
    let secs = t.elapsed().as_secs_f64();
    let stats = engine.stats();
    if let Some(s) = sanitizer {
        assert_eq!(s.violation_count(), 0, "{}", s.summary());
    }
    Run {
        secs,
        preemptions: stats.front.preemptions,
        tier_hits: stats.front.tiers.iter().map(|t| t.hits).sum(),
    }
}

fn main() {
    // `cargo bench` passes `--bench`; nothing here takes arguments.
    let path = ensure_default_model(&mut |line| eprintln!("{line}")).expect("default model");
    let model = Arc::new(Model::load(path).expect("default model loads"));
    let rounds: usize = std::env::var("KVSAN_BENCH_RUNS")
        .ok()
        .and_then(|v| v.parse().ok())
        .unwrap_or(3);
    let arm = |name, tier, sanitized| Arm {
        name,
        tier,
        sanitized,
    };
    let arms = [
        arm("recompute", Tier::Recompute, false),
        arm("host tier", Tier::Host, false),
        arm("disk tier", Tier::Disk, false),
        arm("recompute, sanitized", Tier::Recompute, true),
        arm("host tier, sanitized", Tier::Host, true),
        arm("disk tier, sanitized", Tier::Disk, true),
    ];
    let dir = tempfile::tempdir().expect("a directory for the disk tier");
    run(&model, arms[0], dir.path()); // warm-up: page in the weights
    let mut secs: Vec<Vec<f64>> = vec![Vec::new(); arms.len()];
    let mut seen: Vec<(u64, u64)> = vec![(0, 0); arms.len()];
    for _ in 0..rounds {
        for (i, &arm) in arms.iter().enumerate() {
            let r = run(&model, arm, dir.path());
            secs[i].push(r.secs);
            seen[i] = (r.preemptions, r.tier_hits);
        }
    }
    let generated = (REQUESTS * NEW) as f64;
    for (i, arm) in arms.iter().enumerate() {
        let m = median(secs[i].clone());
        println!(
            "{:<22} median {:>7.2} s  {:>6.1} generated tokens/s  preemptions {:>3}  tier hits {:>3}",
            arm.name,
            m,
            generated / m,
            seen[i].0,
            seen[i].1
        );
    }
    let ratios = |a: usize, b: usize| -> Vec<String> {
        secs[a]
            .iter()
            .zip(&secs[b])
            .map(|(x, y)| format!("{:.3}", x / y))
            .collect()
    };
    for (label, a, b) in [
        ("host tier / recompute, time per round:", 1, 0),
        ("disk tier / recompute, time per round:", 2, 0),
        ("host tier / recompute, sanitized:     ", 4, 3),
        ("disk tier / recompute, sanitized:     ", 5, 3),
        ("sanitized / not, recompute:           ", 3, 0),
        ("sanitized / not, host tier:           ", 4, 1),
        ("sanitized / not, disk tier:           ", 5, 2),
    ] {
        println!("{label} {}", ratios(a, b).join(" "));
    }
}
