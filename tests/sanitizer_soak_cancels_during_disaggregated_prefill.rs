//! No false positives when clients cancel while a disaggregated prefill is
//! in flight: sixteen clients send prompts of 1 to 2,600 tokens (context
//! 2,048, prefill pool 1,024 tokens, decode pool 3,072) for six tenants while
//! a canceller thread cancels live requests at random moments — so cancels
//! land while long prompts are still being computed and shipped by the
//! prefill node. The sanitizer must report nothing, every request must be
//! answered (finished, rejected or cancelled), and every page must be back
//! on both free lists. The decode pool is small enough that decoding
//! requests are preempted too: four long requests the canceller leaves
//! alone make sure of it.
//!
//! Two deployments: both nodes in one process sharing one sanitizer, and a
//! decode node and a prefill node each with a sanitizer of its own (as two
//! processes have). Both run again in a child process under the shim (one
//! library sanitizer for the process). `KVSAN_SOAK_REQUESTS` sets the
//! requests per run (default 2,500: 10,000 in all).

mod shim_common;
mod soak_common;

use std::collections::HashMap;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Mutex};
use std::time::Duration;

use kvsan_engine::engine::{Engine, EngineConfig, PrefillControl, RequestHandle, serve_prefill};
use kvsan_engine::hooks::{HookTarget, Hooks};
use kvsan_engine::model::{AttentionCheck, Model, SyntheticSpec};
use kvsan_engine::node::NodeStats;
use kvsan_engine::request::{ErrorKind, Request};
use kvsan_engine::sampler::SamplingParams;
use kvsan_engine::scheduler::SchedulerConfig;
use kvsan_engine::transport::in_process;
use kvsan_sanitizer::{Options, ReportBuffer, RequestId, Sanitizer, TenantId};
use soak_common::Rng;

const CONTEXT: usize = 2048;
const PREFILL_POOL: usize = 1024;
const DECODE_POOL: usize = 3072;
const CLIENTS: usize = 16;
/// Clients whose first request is an anchor: a long prompt that decodes
/// nearly to the context and is never cancelled. Two anchors decoding at
/// once need more pages than the decode pool has, so the load preempts
/// however fast the canceller ends the others (on a loaded machine it ends
/// most requests before they decode far).
const ANCHORS: usize = 4;
const ANCHOR_PROMPT: usize = 1000;
/// The sanitizer's defaults: pages reused in the release engine's order.
const OPTIONS: &str = "";

fn requests() -> usize {
    std::env::var("KVSAN_SOAK_REQUESTS")
        .ok()
        .and_then(|v| v.parse().ok())
        .unwrap_or(2_500)
}

fn request(rng: &mut Rng) -> Request {
    let len = 1 + rng.below(2600);
    Request {
        tenant: TenantId(1 + rng.below(6) as u32),
        prompt: (0..len).map(|_| rng.below(256) as u32).collect(),
        max_tokens: 1 + rng.below(32) as usize,
        sampling: SamplingParams::greedy(),
        stop_tokens: Vec::new(),
        cache_salt: Default::default(),
    }
}

fn anchor(rng: &mut Rng) -> Request {
    Request {
        tenant: TenantId(1 + rng.below(6) as u32),
        prompt: (0..ANCHOR_PROMPT).map(|_| rng.below(256) as u32).collect(),
        max_tokens: CONTEXT - ANCHOR_PROMPT - 8,
        sampling: SamplingParams::greedy(),
        stop_tokens: Vec::new(),
        cache_salt: Default::default(),
    }
}

fn model() -> Arc<Model> {
    Arc::new(
        SyntheticSpec {
            context_length: CONTEXT,
            ..SyntheticSpec::default()
        }
        .build()
        .expect("synthetic model"),
    )
}

fn config(hooks: Hooks) -> EngineConfig {
    EngineConfig {
        context: Some(CONTEXT),
        prefill_pool_tokens: Some(PREFILL_POOL),
        decode_pool_tokens: Some(DECODE_POOL),
        allow_pool_smaller_than_context: true,
        scheduler: SchedulerConfig {
            step_tokens: 256,
            max_running: 8,
            chunk_tokens: None,
        },
        check: AttentionCheck::Generations,
        hooks,
        ..EngineConfig::default()
    }
}

/// The deployment under test.
enum Deployment {
    /// Both nodes in one engine, one hook target.
    Shared(Hooks),
    /// A decode engine and a prefill node on a thread, each with its own target.
    Separate { decode: Hooks, prefill: Hooks },
}

/// A running deployment: the engine clients talk to, and the prefill node's
/// control when it runs apart.
struct Running {
    engine: Engine,
    prefill: Option<(PrefillControl, std::thread::JoinHandle<()>)>,
}

impl Running {
    fn start(deployment: Deployment) -> Running {
        let model = model();
        match deployment {
            Deployment::Shared(hooks) => Running {
                engine: Engine::disaggregated(model, &config(hooks)).expect("engine"),
                prefill: None,
            },
            Deployment::Separate { decode, prefill } => {
                let engine = Engine::decode_only(model.clone(), &config(decode)).expect("engine");
                let pair = in_process::pair();
                let mut link = Some((pair.to_decode, pair.prefill_inbox));
                let (control, inbox) = PrefillControl::new();
                let cfg = config(prefill);
                let thread = std::thread::spawn(move || {
                    serve_prefill(model, &cfg, inbox, || {
                        let (tx, rx) = link.take()?;
                        Some((
                            Box::new(tx) as Box<dyn kvsan_engine::transport::Link<_>>,
                            rx,
                        ))
                    })
                    .expect("prefill node");
                });
                engine.attach_prefill(Box::new(pair.to_prefill), pair.decode_inbox);
                Running {
                    engine,
                    prefill: Some((control, thread)),
                }
            }
        }
    }

    /// The sum of a counter over both nodes.
    fn both(&self, counter: fn(&NodeStats) -> u64) -> u64 {
        let stats = self.engine.stats();
        let prefill = match &self.prefill {
            Some((control, _)) => control.stats().as_ref().map_or(0, counter),
            None => stats.prefill.as_ref().map_or(0, counter),
        };
        counter(&stats.front) + prefill
    }

    /// Preemptions on both nodes since start.
    fn preemptions(&self) -> u64 {
        self.both(|s| s.preemptions)
    }

    /// Free pages of (decode or front, prefill).
    fn free_pages(&self) -> (usize, Option<usize>) {
        let stats = self.engine.stats();
        let prefill = match &self.prefill {
            Some((control, _)) => control.stats().map(|s| s.free_pages),
            None => stats.prefill.map(|s| s.free_pages),
        };
        (stats.front.free_pages, prefill)
    }

    fn stop(self) {
        let Running { engine, prefill } = self;
        engine.shutdown();
        if let Some((control, thread)) = prefill {
            control.shutdown();
            thread.join().expect("prefill thread");
        }
    }
}

/// Runs the load; returns the outcomes by kind.
fn load(running: &Running, seed: u64) -> HashMap<&'static str, usize> {
    let n = requests();
    let live: Arc<Mutex<Vec<RequestId>>> = Arc::default();
    let done = Arc::new(AtomicBool::new(false));
    let outcomes: Arc<Mutex<HashMap<&'static str, usize>>> = Arc::default();
    std::thread::scope(|s| {
        // The canceller: another client, cancelling live requests at random moments.
        s.spawn(|| {
            let mut rng = Rng(seed ^ 0xca9c);
            while !done.load(Ordering::Relaxed) {
                std::thread::sleep(Duration::from_micros(5_000 + rng.below(75_000)));
                let victim = {
                    let live = live.lock().unwrap();
                    (!live.is_empty()).then(|| live[rng.below(live.len() as u64) as usize])
                };
                if let Some(id) = victim {
                    running.engine.cancel(id);
                }
            }
        });
        let clients: Vec<_> = (0..CLIENTS)
            .map(|c| {
                let (live, outcomes) = (live.clone(), outcomes.clone());
                s.spawn(move || {
                    let mut rng = Rng(seed + c as u64);
                    for (i, _) in (c..n).step_by(CLIENTS).enumerate() {
                        let anchored = i == 0 && c < ANCHORS;
                        let req = if anchored {
                            anchor(&mut rng)
                        } else {
                            request(&mut rng)
                        };
                        let over = req.prompt.len() + req.max_tokens > CONTEXT
                            || req.prompt.len() > PREFILL_POOL;
                        let handle: RequestHandle = running.engine.submit(req);
                        if !anchored {
                            live.lock().unwrap().push(handle.id);
                        }
                        let outcome = match handle.wait() {
                            Ok(_) => "finished",
                            Err(e) if e.kind == ErrorKind::Rejected && over => "rejected",
                            Err(e) if e.kind == ErrorKind::Cancelled => "cancelled",
                            Err(e) => panic!("unexpected {}: {}", e.kind.name(), e.message),
                        };
                        live.lock().unwrap().retain(|&id| id != handle.id);
                        *outcomes.lock().unwrap().entry(outcome).or_default() += 1;
                    }
                })
            })
            .collect();
        for c in clients {
            c.join().expect("client");
        }
        done.store(true, Ordering::Relaxed);
    });
    Arc::try_unwrap(outcomes).unwrap().into_inner().unwrap()
}

/// Runs `deployment` under the load and checks everything but the
/// violation count (which the caller reads from its sanitizer).
fn soak(deployment: Deployment, seed: u64) {
    let running = Running::start(deployment);
    let before = running.free_pages();
    let outcomes = load(&running, seed);
    let answered: usize = outcomes.values().sum();
    assert_eq!(answered, requests(), "every request answered: {outcomes:?}");
    for kind in ["finished", "rejected", "cancelled"] {
        assert!(
            outcomes.get(kind).copied().unwrap_or(0) > 0,
            "{kind}: {outcomes:?}"
        );
    }
    // Pages come back once the nodes have seen every end (poll briefly:
    // the last cancels may still be on their way to the prefill node).
    let mut after = running.free_pages();
    for _ in 0..200 {
        if after == before {
            break;
        }
        std::thread::sleep(Duration::from_millis(10));
        after = running.free_pages();
    }
    assert_eq!(
        after, before,
        "every page back on both free lists: {outcomes:?}"
    );
    let preemptions = running.preemptions();
    eprintln!("outcomes: {outcomes:?}; preemptions: {preemptions}");
    assert!(preemptions > 0, "the load must preempt: {outcomes:?}");
    assert_eq!(
        running.both(|s| s.illegal_transitions),
        0,
        "no lifecycle move refused as an engine bug on either node"
    );
    assert_eq!(
        running.both(|s| s.anomalies.total()),
        0,
        "the anomaly monitor flags no honest request"
    );
    running.stop();
}

fn sanitizer() -> (Arc<Sanitizer>, ReportBuffer) {
    let sink = ReportBuffer::default();
    let san = Arc::new(Sanitizer::with_writer(
        Options::parse(OPTIONS).expect("options"),
        sink.clone(),
    ));
    (san, sink)
}

fn assert_clean(san: &Sanitizer, sink: &ReportBuffer) {
    assert_eq!(
        san.violation_count(),
        0,
        "{}\n{}",
        san.summary(),
        sink.text()
    );
    assert!(san.checks().total() > 0);
}

#[test]
fn one_sanitizer_for_both_nodes_sees_no_violation_when_cancels_land_during_prefill() {
    let (san, sink) = sanitizer();
    soak(Deployment::Shared(Hooks::sanitizer(san.clone())), 0x5eed);
    assert_clean(&san, &sink);
}

#[test]
fn a_sanitizer_per_node_sees_no_violation_when_cancels_land_during_prefill() {
    let (decode, dsink) = sanitizer();
    let (prefill, psink) = sanitizer();
    soak(
        Deployment::Separate {
            decode: Hooks::sanitizer(decode.clone()),
            prefill: Hooks::sanitizer(prefill.clone()),
        },
        0xfee1,
    );
    assert_clean(&decode, &dsink);
    assert_clean(&prefill, &psink);
}

const SHIM_CHILD: &str = "KVSAN_TEST_CANCEL_SOAK_UNDER_SHIM";

#[test]
fn under_the_shim_both_deployments_see_no_violation_when_cancels_land_during_prefill() {
    if std::env::var_os(SHIM_CHILD).is_some() {
        let hooks = Hooks::from_environment().expect("hooks");
        assert_eq!(hooks.target(), HookTarget::CTable, "the shim is attached");
        soak(Deployment::Shared(hooks.clone()), 0x5eed);
        soak(
            Deployment::Separate {
                decode: hooks.clone(),
                prefill: hooks,
            },
            0xfee1,
        );
        return;
    }
    let out = std::process::Command::new(std::env::current_exe().expect("test binary"))
        .args([
            "--exact",
            "under_the_shim_both_deployments_see_no_violation_when_cancels_land_during_prefill",
            "--nocapture",
        ])
        .env(SHIM_CHILD, "1")
        .env("LD_PRELOAD", shim_common::shim_library())
        .env("KVSAN_OPTIONS", OPTIONS)
        .output()
        .expect("child");
    let (stdout, stderr) = shim_common::texts(&out);
    assert!(out.status.success(), "{stdout}\n{stderr}");
    let summary = stderr
        .lines()
        .rev()
        .find(|l| l.starts_with("kvsan: ") && l.contains(" checks"))
        .unwrap_or_else(|| panic!("no summary line: {stderr}"));
    assert!(
        summary.starts_with("kvsan: 0 violations"),
        "{summary}\n{stderr}"
    );
}
