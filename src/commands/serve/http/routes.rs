//! The routes, and the small ones that need no file of their own.
//!
//! ```text
//!  GET  /health                 200 while the server runs (no key asked);
//!                               503 when its sanitizer stopped checking (watchdog.rs)
//!  GET  /metrics                Prometheus metrics (no key asked: metrics.rs)
//!  GET  /v1/models              the served model
//!  GET  /stats                  stats.rs (no key asked)
//!  POST /v1/completions         completions.rs
//!  POST /v1/chat/completions    completions.rs
//!  POST /tokenize               tokenize.rs
//!  POST /detokenize             tokenize.rs
//! ```
//!
//! Every other path is a 404, a known path with another method a 405, both
//! in the error format.

use std::sync::Arc;

use axum::Router;
use axum::extract::State;
use axum::http::{HeaderMap, StatusCode, header};
use axum::response::{IntoResponse, Response};
use axum::routing::{get, post};
use serde_json::json;

use super::error::ApiError;
use super::{Front, completions, json_body, stats, tokenize};

/// The server's routes over `front`.
pub fn router(front: Arc<Front>) -> Router {
    Router::new()
        .route("/health", get(health))
        .route("/metrics", get(metrics))
        .route("/v1/models", get(models))
        .route("/stats", get(stats::stats))
        .route("/v1/completions", post(completions::completions))
        .route("/v1/chat/completions", post(completions::chat))
        .route("/tokenize", post(tokenize::tokenize))
        .route("/detokenize", post(tokenize::detokenize))
        .fallback(not_found)
        .method_not_allowed_fallback(method_not_allowed)
        .with_state(front)
}

/// 200, or 503 with the reason when steps run and the sanitizer's check
/// count does not move (read off the async threads: the engine's counters
/// wait for its nodes).
async fn health(State(front): State<Arc<Front>>) -> Response {
    let metrics = front.metrics.clone();
    match tokio::task::spawn_blocking(move || metrics.checker_stalled()).await {
        Ok(None) => StatusCode::OK.into_response(),
        Ok(Some(why)) => (StatusCode::SERVICE_UNAVAILABLE, why).into_response(),
        Err(_) => ApiError::internal("the health check could not run").into_response(),
    }
}

/// The metrics, rendered off the async threads (reading the engine's
/// counters waits for its nodes).
async fn metrics(State(front): State<Arc<Front>>) -> Response {
    let metrics = front.metrics.clone();
    match tokio::task::spawn_blocking(move || metrics.render()).await {
        Ok(Ok(text)) => {
            ([(header::CONTENT_TYPE, super::metrics::CONTENT_TYPE)], text).into_response()
        }
        _ => ApiError::internal("the metrics could not be rendered").into_response(),
    }
}

async fn models(State(front): State<Arc<Front>>, headers: HeaderMap) -> Response {
    if let Err(e) = front.authorize(&headers) {
        return e.into_response();
    }
    json_body(&json!({
        "object": "list",
        "data": [{
            "id": front.model_id,
            "object": "model",
            "created": front.started,
            "owned_by": "kvsan",
            "max_model_len": front.context_length,
        }],
    }))
}

async fn not_found(uri: axum::http::Uri) -> ApiError {
    ApiError::not_found(format!("no route {}", uri.path()))
}

async fn method_not_allowed(method: axum::http::Method, uri: axum::http::Uri) -> ApiError {
    ApiError::method_not_allowed(format!("{} does not take {method}", uri.path()))
}
