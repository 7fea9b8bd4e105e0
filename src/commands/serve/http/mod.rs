//! `kvsan serve`'s client interface: OpenAI-compatible HTTP, on axum
//! (hyper, tokio), bridged to the engine's threads.
//!
//! | file | what lives there |
//! | --- | --- |
//! | `routes.rs` | the routes; `/health`, `/v1/models` |
//! | `stats.rs` | `/stats`: the nodes' counters |
//! | `completions.rs` | `/v1/completions`, `/v1/chat/completions`: body → engine request |
//! | `prompt.rs` | prompts and chats → token ids |
//! | `openai.rs` | request bodies (unknown fields refused) and answer shapes |
//! | `answer.rs` | engine events → text, stop strings, usage |
//! | `stop.rs` | stop strings across streamed pieces |
//! | `sse.rs` | `"stream": true` as server-sent events |
//! | `bridge.rs` | engine events → async; cancel when the client goes away |
//! | `tokenize.rs` | `/tokenize`, `/detokenize` |
//! | `api_keys.rs` | `--api-keys FILE`: tenants from `Authorization: Bearer KEY` |
//! | `error.rs` | `{"error": {message, type, code, param}}` and statuses |
//! | `metrics.rs` | `/metrics`: Prometheus metrics, vLLM's names and kvsan's |
//!
//! Capacity: at most `--max-clients` generations are in flight; one more is
//! answered 503 at once (with `Retry-After`), never queued without bound.

mod answer;
pub mod api_keys;
mod bridge;
mod completions;
mod error;
mod metrics;
mod openai;
mod prompt;
mod routes;
mod sse;
mod stats;
mod stop;
mod tokenize;
mod watchdog;

use std::sync::Arc;
use std::time::{SystemTime, UNIX_EPOCH};

use anyhow::Context;
use axum::body::Body;
use axum::http::{HeaderMap, HeaderValue, header};
use axum::response::{IntoResponse, Response};
use axum::serve::ListenerExt;
use kvsan_engine::engine::Engine;
use kvsan_engine::hooks::Hooks;
use serde_json::Value;
use tokio::sync::{OwnedSemaphorePermit, Semaphore};

use super::text::TextSide;
use api_keys::{Tenant, Tenants};
use error::ApiError;

/// Longest request body accepted, in bytes: room for a prompt of a few
/// million token ids, a bound on what one request can make the server hold.
pub const MAX_BODY_BYTES: usize = 16 << 20;

/// What every request shares.
pub struct Front {
    engine: Arc<Engine>,
    text: Option<Arc<TextSide>>,
    /// The name clients give as `model`.
    model_id: String,
    /// The model's context window, in tokens.
    context_length: usize,
    tenants: Tenants,
    /// One permit per generation in flight.
    capacity: Arc<Semaphore>,
    max_in_flight: usize,
    /// Unix seconds at start (`/v1/models`' `created`).
    started: u64,
    /// What `/metrics` shows.
    metrics: Arc<metrics::Metrics>,
}

/// What the front end serves: the model, its name and context window.
pub struct Served {
    /// Its tokenizer and chat template, when it has them.
    pub text: Option<Arc<TextSide>>,
    /// The name clients give as `model`.
    pub model_id: String,
    /// The context window, in tokens.
    pub context_length: usize,
    /// The node clients' requests enter: `unified` or `decode`.
    pub front_node: &'static str,
}

impl Front {
    /// A front end for `engine` serving `served`, whose sanitizer (if any)
    /// is behind `hooks`; `/health` fails once steps ran and the
    /// sanitizer's check count stood still for `checker_stall`.
    pub fn new(
        engine: Arc<Engine>,
        served: Served,
        hooks: Hooks,
        tenants: Tenants,
        max_in_flight: usize,
        checker_stall: std::time::Duration,
    ) -> Front {
        let metrics = metrics::Metrics::new(
            engine.clone(),
            served.front_node,
            hooks,
            &served.model_id,
            checker_stall,
        );
        Front {
            engine,
            text: served.text,
            model_id: served.model_id,
            context_length: served.context_length,
            metrics: Arc::new(metrics),
            tenants,
            capacity: Arc::new(Semaphore::new(max_in_flight)),
            max_in_flight,
            started: SystemTime::now()
                .duration_since(UNIX_EPOCH)
                .map_or(0, |d| d.as_secs()),
        }
    }

    /// The tenant of the request's key (the one tenant without `--api-keys`).
    fn authorize(&self, headers: &HeaderMap) -> Result<&Tenant, ApiError> {
        let value = headers
            .get(header::AUTHORIZATION)
            .map(HeaderValue::as_bytes);
        self.tenants
            .authorize(value)
            .map_err(ApiError::unauthorized)
    }

    /// A place for one more generation, or the 503 of a full server.
    fn admit(&self) -> Result<OwnedSemaphorePermit, ApiError> {
        self.capacity.clone().try_acquire_owned().map_err(|_| {
            ApiError::overloaded(format!(
                "the server already generates for {} requests (--max-clients): retry later",
                self.max_in_flight
            ))
        })
    }
}

/// A JSON answer.
fn json_body(value: &Value) -> Response {
    (
        [(
            header::CONTENT_TYPE,
            HeaderValue::from_static("application/json"),
        )],
        value.to_string(),
    )
        .into_response()
}

/// A request's body, at most [`MAX_BODY_BYTES`].
async fn read_body(body: Body) -> Result<axum::body::Bytes, ApiError> {
    axum::body::to_bytes(body, MAX_BODY_BYTES)
        .await
        .map_err(|e| {
            ApiError::too_large(format!(
                "the request body could not be read within the limit of {MAX_BODY_BYTES} bytes: {e}"
            ))
        })
}

/// Serves HTTP clients on `listener` until the process is stopped.
pub fn serve(listener: std::net::TcpListener, front: Front) -> anyhow::Result<()> {
    // Each generation in flight holds one blocking-pool thread (bridge.rs).
    let runtime = tokio::runtime::Builder::new_multi_thread()
        .enable_all()
        .thread_name("kvsan-http")
        .max_blocking_threads(front.max_in_flight + 16)
        .build()
        .context("cannot start the HTTP runtime")?;
    runtime.block_on(async move {
        listener
            .set_nonblocking(true)
            .context("cannot make the client socket non-blocking")?;
        // Each token's event leaves at once, not held by Nagle's algorithm.
        let listener = tokio::net::TcpListener::from_std(listener)
            .context("cannot hand the client socket to the HTTP runtime")?
            .tap_io(|tcp| {
                if let Err(e) = tcp.set_nodelay(true) {
                    eprintln!("kvsan: client connection: cannot set TCP_NODELAY: {e}");
                }
            });
        axum::serve(listener, routes::router(Arc::new(front)))
            .await
            .context("the HTTP server stopped")
    })
}
