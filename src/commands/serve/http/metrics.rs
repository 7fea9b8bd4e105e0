//! `GET /metrics`: Prometheus metrics (OpenMetrics text, the
//! `prometheus-client` crate), under the names vLLM users already scrape
//! and kvsan's own.
//!
//! ```text
//!  per request (bridge.rs, as events pass)       per scrape (the engine's and sanitizer's counters)
//!  vllm:prompt_tokens_total                      vllm:num_requests_running / _waiting
//!  vllm:generation_tokens_total                  vllm:kv_cache_usage_perc
//!  vllm:time_to_first_token_seconds              vllm:num_preemptions_total
//!  vllm:inter_token_latency_seconds              kvsan:free_pages{node}, kvsan:quarantined_pages{node}
//!  vllm:e2e_request_latency_seconds              kvsan:kv_transfers_total{node}, kvsan:pages_allocated_total{node}, kvsan:steps_total{node}
//!  vllm:request_success_total{finished_reason}   kvsan:anomalies_total{kind}
//!  kvsan:rejections_total{limit,node}            kvsan:violations_total{kind}, kvsan:checks_total,
//!                                                kvsan:checker_stalled
//!                                                kvsan:sanitizer_attached{target}
//!                                                vllm:prefix_cache_queries_total, vllm:prefix_cache_hits_total
//!                                                kvsan:cached_pages{node}
//!                                                kvsan:cached_pages_tiered{node}
//!                                                kvsan:kv_offload_blocks{node,tier}, kvsan:kv_offload_blocks_used{node,tier}
//!                                                kvsan:kv_offload_stores_total{node,tier}, _loads_total, _hits_total,
//!                                                _io_errors_total (tier: host, disk)
//! ```
//!
//! Every series carries `model_name`, as vLLM's do. The request metrics are
//! measured where the HTTP front end sees the engine's events (time to
//! first token from the request's submission). `finished_reason` is `stop`
//! or `length` for answers, `abort` for a request its client left, and
//! `error` for one the engine ended with an error (rejections are counted
//! apart, by the limit they broke). The sanitizer's counters come from the
//! hook target — the in-process sanitizer, or a preloaded shim that
//! exports its counters — and are absent without one.
//!
//! The prefix cache lives on the nodes that compute prompts (unified,
//! prefill): its counters are theirs, in tokens as vLLM's are. A decode
//! process whose prefill node runs in another process has none to show,
//! and leaves them out rather than show a cache that is not its own.

use std::fmt;
use std::sync::Arc;
use std::time::{Duration, Instant};

use kvsan_engine::anomaly::AnomalyKind;
use kvsan_engine::engine::{Engine, EngineStats};
use kvsan_engine::hooks::Hooks;
use kvsan_engine::node::NodeStats;
use kvsan_engine::request::{ErrorKind, Event, FinishReason, RequestError};
use kvsan_engine::tier::{TIER_NAMES, TierStats};
use kvsan_sanitizer::ViolationKind;
use prometheus_client::collector::Collector;
use prometheus_client::encoding::{DescriptorEncoder, EncodeMetric};
use prometheus_client::metrics::counter::{ConstCounter, Counter};
use prometheus_client::metrics::family::Family;
use prometheus_client::metrics::gauge::ConstGauge;
use prometheus_client::metrics::histogram::Histogram;
use prometheus_client::registry::Registry;

use super::watchdog::Watchdog;

/// The media type of the answer.
pub const CONTENT_TYPE: &str = "application/openmetrics-text; version=1.0.0; charset=utf-8";

/// vLLM's time-to-first-token buckets, in seconds.
const TTFT_BUCKETS: [f64; 22] = [
    0.001, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5, 10.0,
    20.0, 40.0, 80.0, 160.0, 640.0, 2560.0,
];
/// vLLM's inter-token latency buckets, in seconds.
const ITL_BUCKETS: [f64; 19] = [
    0.01, 0.025, 0.05, 0.075, 0.1, 0.15, 0.2, 0.3, 0.4, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5, 10.0, 20.0,
    40.0, 80.0,
];
/// vLLM's end-to-end latency buckets, in seconds.
const E2E_BUCKETS: [f64; 21] = [
    0.3, 0.5, 0.8, 1.0, 1.5, 2.0, 2.5, 5.0, 10.0, 15.0, 20.0, 30.0, 40.0, 50.0, 60.0, 120.0, 240.0,
    480.0, 960.0, 1920.0, 7680.0,
];

type Labels = Vec<(&'static str, String)>;

/// The server's metrics.
#[derive(Debug)]
pub struct Metrics {
    registry: Registry,
    /// What `/health` asks: whether the sanitizer still checks.
    checker: Checker,
    prompt_tokens: Counter,
    generation_tokens: Counter,
    ttft: Histogram,
    itl: Histogram,
    e2e: Histogram,
    finished: Family<Labels, Counter>,
    rejections: Family<Labels, Counter>,
}

impl Metrics {
    /// Metrics of `engine` serving `model_name`, whose front node (the one
    /// clients' requests enter) is `front_node` (`unified` or `decode`),
    /// with the sanitizer behind `hooks` (if any).
    pub fn new(
        engine: Arc<Engine>,
        front_node: &'static str,
        hooks: Hooks,
        model_name: &str,
        checker_stall: Duration,
    ) -> Metrics {
        let checker = Checker {
            engine: engine.clone(),
            hooks: hooks.clone(),
            watchdog: Arc::new(Watchdog::new(checker_stall)),
        };
        let mut registry = Registry::with_labels(std::iter::once((
            "model_name".into(),
            model_name.to_string().into(),
        )));
        let m = Metrics {
            prompt_tokens: Counter::default(),
            generation_tokens: Counter::default(),
            ttft: Histogram::new(TTFT_BUCKETS),
            itl: Histogram::new(ITL_BUCKETS),
            e2e: Histogram::new(E2E_BUCKETS),
            finished: Family::default(),
            rejections: Family::default(),
            registry: Registry::default(),
            checker: checker.clone(),
        };
        registry.register(
            "vllm:prompt_tokens",
            "Prompt tokens of the requests whose first token was generated",
            m.prompt_tokens.clone(),
        );
        registry.register(
            "vllm:generation_tokens",
            "Tokens generated",
            m.generation_tokens.clone(),
        );
        registry.register(
            "vllm:time_to_first_token_seconds",
            "Time from a request's submission to its first token",
            m.ttft.clone(),
        );
        registry.register(
            "vllm:inter_token_latency_seconds",
            "Time between two tokens of one request",
            m.itl.clone(),
        );
        registry.register(
            "vllm:e2e_request_latency_seconds",
            "Time from a request's submission to its last token",
            m.e2e.clone(),
        );
        registry.register(
            "vllm:request_success",
            "Requests ended, by finished_reason (stop, length, abort, error)",
            m.finished.clone(),
        );
        registry.register(
            "kvsan:rejections",
            "Requests rejected at admission, by the limit broken (context, pool) and the node",
            m.rejections.clone(),
        );
        registry.register_collector(Box::new(Live {
            engine,
            front_node,
            hooks,
            checker,
        }));
        Metrics { registry, ..m }
    }

    /// Why the sanitizer is not checking (steps ran and its check count
    /// stood still past `--checker-stall-secs`), if it is not.
    pub fn checker_stalled(&self) -> Option<String> {
        self.checker.stalled()
    }

    /// The metrics as OpenMetrics text.
    pub fn render(&self) -> Result<String, fmt::Error> {
        let mut out = String::new();
        prometheus_client::encoding::text::encode(&mut out, &self.registry)?;
        Ok(out)
    }

    /// The record of a request submitted now with `prompt_tokens` tokens.
    pub fn request(self: &Arc<Self>, prompt_tokens: usize) -> RequestMetrics {
        RequestMetrics {
            metrics: self.clone(),
            prompt_tokens,
            submitted: Instant::now(),
            last_token: None,
            ended: false,
        }
    }

    fn finished(&self, reason: &str) {
        self.finished
            .get_or_create(&vec![("finished_reason", reason.to_string())])
            .inc();
    }
}

/// One request's metrics, recorded as its events pass.
#[derive(Debug)]
pub struct RequestMetrics {
    metrics: Arc<Metrics>,
    prompt_tokens: usize,
    submitted: Instant,
    last_token: Option<Instant>,
    ended: bool,
}

impl RequestMetrics {
    /// Records `event`.
    pub fn event(&mut self, event: &Event) {
        match event {
            Event::Token(_) => self.token(),
            Event::Finished { reason, .. } => self.end(match reason {
                FinishReason::Stop => "stop",
                FinishReason::Length => "length",
            }),
            Event::Error(e) => self.error(e),
        }
    }

    fn token(&mut self) {
        let now = Instant::now();
        let m = &self.metrics;
        match self.last_token {
            None => {
                m.ttft.observe((now - self.submitted).as_secs_f64());
                m.prompt_tokens.inc_by(self.prompt_tokens as u64);
            }
            Some(last) => m.itl.observe((now - last).as_secs_f64()),
        }
        m.generation_tokens.inc();
        self.last_token = Some(now);
    }

    fn error(&mut self, e: &RequestError) {
        match (&e.rejection, e.kind) {
            (Some(r), _) => {
                self.ended = true;
                self.metrics
                    .rejections
                    .get_or_create(&vec![
                        ("limit", r.limit_kind().to_string()),
                        ("node", r.node.clone()),
                    ])
                    .inc();
            }
            (None, ErrorKind::Cancelled) => self.end("abort"),
            (None, _) => self.end("error"),
        }
    }

    /// The request ended with `reason` (a stop string ends it in the front
    /// end: `stop`).
    pub fn end(&mut self, reason: &str) {
        if self.ended {
            return;
        }
        self.ended = true;
        if self.last_token.is_some() {
            self.metrics
                .e2e
                .observe(self.submitted.elapsed().as_secs_f64());
        }
        self.metrics.finished(reason);
    }
}

impl Drop for RequestMetrics {
    /// Dropped before its end: its client went away.
    fn drop(&mut self) {
        self.end("abort");
    }
}

/// The counters read at each scrape.
struct Live {
    engine: Arc<Engine>,
    front_node: &'static str,
    hooks: Hooks,
    checker: Checker,
}

/// The engine's steps and the sanitizer's checks, under a watchdog.
#[derive(Clone)]
struct Checker {
    engine: Arc<Engine>,
    hooks: Hooks,
    watchdog: Arc<Watchdog>,
}

impl fmt::Debug for Checker {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("Checker")
            .field("watchdog", &self.watchdog)
            .finish()
    }
}

impl Checker {
    /// Reads the engine's steps (waiting for its nodes) and judges them.
    fn stalled(&self) -> Option<String> {
        self.stalled_at(&self.engine.stats())
    }

    /// Judges `stats`, the engine's counters already read.
    fn stalled_at(&self, stats: &EngineStats) -> Option<String> {
        let steps = stats.front.steps + stats.prefill.as_ref().map_or(0, |p| p.steps);
        let checks = self.hooks.counters().map(|c| c.checks);
        self.watchdog.observe(Instant::now(), steps, checks)
    }
}

impl fmt::Debug for Live {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("Live").field("hooks", &self.hooks).finish()
    }
}

/// Writes one metric of `value` with `labels`.
fn family<M: EncodeMetric>(
    encoder: &mut DescriptorEncoder,
    name: &str,
    help: &str,
    series: &[(Labels, M)],
) -> fmt::Result {
    let Some((_, first)) = series.first() else {
        return Ok(());
    };
    let mut metric = encoder.encode_descriptor(name, help, None, first.metric_type())?;
    for (labels, value) in series {
        value.encode(metric.encode_family(labels)?)?;
    }
    Ok(())
}

fn one<M: EncodeMetric>(
    encoder: &mut DescriptorEncoder,
    name: &str,
    help: &str,
    value: &M,
) -> fmt::Result {
    value.encode(encoder.encode_descriptor(name, help, None, value.metric_type())?)
}

impl Collector for Live {
    fn encode(&self, mut encoder: DescriptorEncoder) -> fmt::Result {
        let stats = self.engine.stats();
        let nodes: Vec<(&str, &NodeStats)> = std::iter::once((self.front_node, &stats.front))
            .chain(stats.prefill.as_ref().map(|p| ("prefill", p)))
            .collect();
        let front = &stats.front;
        let e = &mut encoder;
        one(
            e,
            "vllm:num_requests_running",
            "Requests in the front node's running batch.",
            &ConstGauge::new(front.running as i64),
        )?;
        one(
            e,
            "vllm:num_requests_waiting",
            "Requests waiting on the front node.",
            &ConstGauge::new(front.waiting as i64),
        )?;
        let usage = if front.total_pages == 0 {
            0.0
        } else {
            1.0 - front.free_pages as f64 / front.total_pages as f64
        };
        one(
            e,
            "vllm:kv_cache_usage_perc",
            "Fraction of the front node's KV pages in use (1 = all).",
            &ConstGauge::new(usage),
        )?;
        one(
            e,
            "vllm:num_preemptions",
            "Requests preempted (to the host tier or by recompute), all nodes of this process.",
            &ConstCounter::new(nodes.iter().map(|(_, s)| s.preemptions).sum::<u64>()),
        )?;
        let per_node = |f: fn(&NodeStats) -> i64| -> Vec<(Labels, ConstGauge)> {
            nodes
                .iter()
                .map(|(n, s)| (vec![("node", (*n).to_string())], ConstGauge::new(f(s))))
                .collect()
        };
        family(
            e,
            "kvsan:free_pages",
            "KV pages an allocation can take now (free list and quarantine).",
            &per_node(|s| s.free_pages as i64),
        )?;
        family(
            e,
            "kvsan:quarantined_pages",
            "Freed KV pages held in quarantine now.",
            &per_node(|s| s.quarantined_pages as i64),
        )?;
        family(
            e,
            "kvsan:total_pages",
            "KV pages in the pool.",
            &per_node(|s| s.total_pages as i64),
        )?;
        let per_node_total = |f: fn(&NodeStats) -> u64| -> Vec<(Labels, ConstCounter)> {
            nodes
                .iter()
                .map(|(n, s)| (vec![("node", (*n).to_string())], ConstCounter::new(f(s))))
                .collect()
        };
        family(
            e,
            "kvsan:kv_transfers",
            "KV transfers sent (prefill) or received (decode).",
            &per_node_total(|s| s.transfers),
        )?;
        family(
            e,
            "kvsan:pages_allocated",
            "KV pages taken from the free list.",
            &per_node_total(|s| s.pages_allocated),
        )?;
        family(
            e,
            "kvsan:steps",
            "Forward steps run.",
            &per_node_total(|s| s.steps),
        )?;
        // The KV tiers (host, disk) of each node that has them.
        let tiered: Vec<(&str, &str, TierStats)> = nodes
            .iter()
            .flat_map(|(n, s)| {
                TIER_NAMES
                    .iter()
                    .zip(s.tiers)
                    .filter(|(_, t)| t.blocks > 0)
                    .map(|(tier, t)| (*n, *tier, t))
            })
            .collect();
        let tier_labels = |n: &str, tier: &str| -> Labels {
            vec![("node", n.to_string()), ("tier", tier.to_string())]
        };
        let per_tier = |f: fn(&TierStats) -> usize| -> Vec<(Labels, ConstGauge)> {
            tiered
                .iter()
                .map(|(n, tier, t)| (tier_labels(n, tier), ConstGauge::new(f(t) as i64)))
                .collect()
        };
        let per_tier_total = |f: fn(&TierStats) -> u64| -> Vec<(Labels, ConstCounter)> {
            tiered
                .iter()
                .map(|(n, tier, t)| (tier_labels(n, tier), ConstCounter::new(f(t))))
                .collect()
        };
        family(
            e,
            "kvsan:kv_offload_blocks",
            "Page-sized blocks of a KV tier.",
            &per_tier(|t| t.blocks),
        )?;
        family(
            e,
            "kvsan:kv_offload_blocks_used",
            "Blocks of a KV tier holding a page now (a preempted request's, or the prefix cache's).",
            &per_tier(|t| t.used),
        )?;
        family(
            e,
            "kvsan:kv_offload_stores",
            "KV pages stored into a tier.",
            &per_tier_total(|t| t.stores),
        )?;
        family(
            e,
            "kvsan:kv_offload_loads",
            "KV pages loaded back from a tier.",
            &per_tier_total(|t| t.loads),
        )?;
        family(
            e,
            "kvsan:kv_offload_hits",
            "Preempted requests that came back from a tier, and prefix-cache pages served from one.",
            &per_tier_total(|t| t.hits),
        )?;
        family(
            e,
            "kvsan:kv_offload_io_errors",
            "Tier writes and reads that failed (their blocks were not served).",
            &per_tier_total(|t| t.io_errors),
        )?;
        // The nodes that hold a prefix cache: the unified one, or the prefill one.
        let caching: Vec<&(&str, &NodeStats)> =
            nodes.iter().filter(|(n, _)| *n != "decode").collect();
        if !caching.is_empty() {
            one(
                e,
                "vllm:prefix_cache_queries",
                "Prefix cache queries, in terms of number of queried tokens.",
                &ConstCounter::new(
                    caching
                        .iter()
                        .map(|(_, s)| s.prefix_cache_queries)
                        .sum::<u64>(),
                ),
            )?;
            one(
                e,
                "vllm:prefix_cache_hits",
                "Prefix cache hits, in terms of number of cached tokens.",
                &ConstCounter::new(
                    caching
                        .iter()
                        .map(|(_, s)| s.prefix_cache_hits)
                        .sum::<u64>(),
                ),
            )?;
            let per_caching = |f: fn(&NodeStats) -> usize| -> Vec<(Labels, ConstGauge)> {
                caching
                    .iter()
                    .map(|(n, s)| {
                        (
                            vec![("node", (*n).to_string())],
                            ConstGauge::new(f(s) as i64),
                        )
                    })
                    .collect()
            };
            family(
                e,
                "kvsan:cached_pages",
                "KV pages the prefix cache holds now.",
                &per_caching(|s| s.cached_pages),
            )?;
            family(
                e,
                "kvsan:cached_pages_tiered",
                "Prefix-cache pages whose KV is in a tier now (served from there on a hit).",
                &per_caching(|s| s.cached_tiered),
            )?;
        }
        let anomalies: Vec<(Labels, ConstCounter)> = AnomalyKind::ALL
            .iter()
            .map(|&k| {
                (
                    vec![("kind", k.name().to_string())],
                    ConstCounter::new(nodes.iter().map(|(_, s)| s.anomalies.of(k)).sum::<u64>()),
                )
            })
            .collect();
        family(
            e,
            "kvsan:anomalies",
            "Requests the anomaly monitor flagged, by kind.",
            &anomalies,
        )?;
        let attached = vec![("target", self.hooks.target().name().to_string())];
        family(
            e,
            "kvsan:sanitizer_attached",
            "1 when a sanitizer checks this process's KV accesses.",
            &[(
                attached,
                ConstGauge::new(i64::from(self.hooks.is_attached())),
            )],
        )?;
        if self.hooks.counters().is_some() {
            one(
                e,
                "kvsan:checker_stalled",
                "1 when forward steps ran and the sanitizer's check count stood still for --checker-stall-secs (/health answers 503).",
                &ConstGauge::new(i64::from(self.checker.stalled_at(&stats).is_some())),
            )?;
        }
        if let Some(counters) = self.hooks.counters() {
            let violations: Vec<(Labels, ConstCounter)> = ViolationKind::ALL
                .iter()
                .map(|k| {
                    let n = counters.violations.get(k.index()).copied().unwrap_or(0);
                    (vec![("kind", k.name().to_string())], ConstCounter::new(n))
                })
                .collect();
            family(
                e,
                "kvsan:violations",
                "Violations the sanitizer reported, by kind.",
                &violations,
            )?;
            one(
                e,
                "kvsan:checks",
                "Checks the sanitizer performed (pages read-checked, writes and stores, transfers, allocations, frees).",
                &ConstCounter::new(counters.checks),
            )?;
        }
        Ok(())
    }
}
