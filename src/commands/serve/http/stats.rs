//! `GET /stats`: the nodes' counters as JSON, for the benchmarks and tests
//! that check what the engine holds (pages, requests, transfers, steps,
//! anomalies) — the counters `/metrics` shows, as fields a program reads
//! without a Prometheus parser.
//!
//! ```text
//!  {"front":   {"total_pages", "free_pages", "pages_allocated", "transfers",
//!               "running", "waiting", "preemptions", "steps", "quarantined_pages",
//!               "prefix_cache_queries", "prefix_cache_hits", "cached_pages",
//!               "anomalies": {"short-kv": n, "fast-first-token": n}},
//!   "prefill": {… the same …} | null}     null: no prefill node in this process
//! ```
//!
//! Counts only: no request, tenant or prompt is named, so no key is asked
//! (as for `/health`).

use std::sync::Arc;

use axum::extract::State;
use axum::response::Response;
use kvsan_engine::anomaly::AnomalyKind;
use kvsan_engine::node::NodeStats;
use serde_json::{Value, json};

use super::{Front, json_body};

/// `GET /stats`.
pub async fn stats(State(front): State<Arc<Front>>) -> Response {
    let s = front.engine.stats();
    json_body(&json!({
        "front": node(&s.front),
        "prefill": s.prefill.as_ref().map(node),
    }))
}

fn node(s: &NodeStats) -> Value {
    json!({
        "total_pages": s.total_pages,
        "free_pages": s.free_pages,
        "pages_allocated": s.pages_allocated,
        "transfers": s.transfers,
        "running": s.running,
        "waiting": s.waiting,
        "preemptions": s.preemptions,
        "steps": s.steps,
        "quarantined_pages": s.quarantined_pages,
        "prefix_cache_queries": s.prefix_cache_queries,
        "prefix_cache_hits": s.prefix_cache_hits,
        "cached_pages": s.cached_pages,
        "anomalies": AnomalyKind::ALL
            .iter()
            .map(|&k| (k.name().to_string(), json!(s.anomalies.of(k))))
            .collect::<serde_json::Map<String, Value>>(),
    })
}
