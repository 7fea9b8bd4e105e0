//! Errors as OpenAI clients expect them: a status and
//! `{"error": {"message", "type", "code", "param"}}`, plus, for programs,
//! `"rejection": {"reason", "prompt_tokens", "limit", "node"}` when the
//! engine refused the prompt and `"violation": {"id", "kind"}` when a
//! sanitizer aborted the request.
//!
//! A message names the input and the limit, or the violation id and kind;
//! it never carries prompt text or KV contents.

use axum::http::{HeaderValue, StatusCode, header};
use axum::response::{IntoResponse, Response};
use kvsan_engine::request::{ErrorKind, Rejection, RequestError, Violated};
use serde_json::{Value, json};

/// One error answer.
#[derive(Debug)]
pub struct ApiError {
    /// The HTTP status.
    pub status: StatusCode,
    /// OpenAI's error type (`invalid_request_error`, `server_error`, …).
    pub kind: &'static str,
    /// A stable code for programs (`unknown_field`, `rejected`, …).
    pub code: &'static str,
    /// A message for a person.
    pub message: String,
    /// The request field at fault, when one is.
    pub param: Option<String>,
    /// The limit a rejected prompt broke.
    pub rejection: Option<Box<Rejection>>,
    /// The violation a sanitizer abort names.
    pub violation: Option<Violated>,
}

impl ApiError {
    fn new(status: StatusCode, kind: &'static str, code: &'static str, message: String) -> Self {
        ApiError {
            status,
            kind,
            code,
            message,
            param: None,
            rejection: None,
            violation: None,
        }
    }

    /// 400: the request is malformed (`code` says how).
    pub fn invalid(code: &'static str, message: impl Into<String>) -> Self {
        Self::new(
            StatusCode::BAD_REQUEST,
            "invalid_request_error",
            code,
            message.into(),
        )
    }

    /// 400 for the field `param`.
    pub fn invalid_field(
        code: &'static str,
        param: impl Into<String>,
        message: impl Into<String>,
    ) -> Self {
        ApiError {
            param: Some(param.into()),
            ..Self::invalid(code, message)
        }
    }

    /// 401: no key, or a key the server does not know.
    pub fn unauthorized(message: impl Into<String>) -> Self {
        Self::new(
            StatusCode::UNAUTHORIZED,
            "authentication_error",
            "invalid_api_key",
            message.into(),
        )
    }

    /// 404: the request names a model this server does not serve.
    pub fn unknown_model(asked: &str, served: &str) -> Self {
        ApiError {
            param: Some("model".into()),
            ..Self::new(
                StatusCode::NOT_FOUND,
                "invalid_request_error",
                "model_not_found",
                format!("the model {asked:?} does not exist: this server serves {served:?}"),
            )
        }
    }

    /// 404: no such route.
    pub fn not_found(message: String) -> Self {
        Self::new(
            StatusCode::NOT_FOUND,
            "invalid_request_error",
            "not_found",
            message,
        )
    }

    /// 405: a known route with another method.
    pub fn method_not_allowed(message: String) -> Self {
        Self::new(
            StatusCode::METHOD_NOT_ALLOWED,
            "invalid_request_error",
            "method_not_allowed",
            message,
        )
    }

    /// 413: a body over the limit.
    pub fn too_large(message: String) -> Self {
        Self::new(
            StatusCode::PAYLOAD_TOO_LARGE,
            "invalid_request_error",
            "body_too_large",
            message,
        )
    }

    /// 503: more requests in flight than the server takes.
    pub fn overloaded(message: impl Into<String>) -> Self {
        Self::new(
            StatusCode::SERVICE_UNAVAILABLE,
            "server_error",
            "overloaded",
            message.into(),
        )
    }

    /// 500: the server failed to do what it should (`message` says what).
    pub fn internal(message: &str) -> Self {
        Self::new(
            StatusCode::INTERNAL_SERVER_ERROR,
            "server_error",
            "internal",
            message.into(),
        )
    }

    /// 500: the engine's stream ended without the request's end.
    pub fn engine_stopped() -> Self {
        Self::internal("the engine stopped before the request ended")
    }

    /// The answer to a request the engine ended with `e`.
    pub fn from_request(e: &RequestError) -> Self {
        let (status, kind) = match e.kind {
            // Too long for a pool or the context: the client must shorten it.
            ErrorKind::Rejected | ErrorKind::Capacity | ErrorKind::InvalidRequest => {
                (StatusCode::BAD_REQUEST, "invalid_request_error")
            }
            ErrorKind::Transport | ErrorKind::Cancelled => {
                (StatusCode::SERVICE_UNAVAILABLE, "server_error")
            }
            ErrorKind::Violation | ErrorKind::Internal | ErrorKind::Anomaly => {
                (StatusCode::INTERNAL_SERVER_ERROR, "server_error")
            }
        };
        ApiError {
            rejection: e.rejection.clone(),
            violation: e.violation,
            ..Self::new(status, kind, e.kind.name(), e.message.clone())
        }
    }

    /// The JSON body, also sent as the last event of a stream that fails.
    pub fn body(&self) -> Value {
        let mut error = json!({
            "message": self.message,
            "type": self.kind,
            "code": self.code,
            "param": self.param,
        });
        if let Some(r) = &self.rejection {
            error["rejection"] = json!(r);
        }
        if let Some(v) = &self.violation {
            error["violation"] = json!(v);
        }
        json!({ "error": error })
    }
}

impl IntoResponse for ApiError {
    fn into_response(self) -> Response {
        let mut response = (self.status, super::json_body(&self.body())).into_response();
        if self.status == StatusCode::SERVICE_UNAVAILABLE {
            response
                .headers_mut()
                .insert(header::RETRY_AFTER, HeaderValue::from_static("1"));
        }
        response
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use kvsan_engine::request::Rejection;

    #[test]
    fn an_oversize_prompt_is_a_400_naming_the_limit_in_words_and_fields() {
        let e = RequestError::rejected(Rejection {
            reason: "prompt exceeds the prefill pool".into(),
            prompt_tokens: 1100,
            limit: 1024,
            node: "prefill".into(),
        });
        let api = ApiError::from_request(&e);
        assert_eq!(api.status, StatusCode::BAD_REQUEST);
        let body = api.body();
        assert_eq!(body["error"]["code"], "rejected");
        let message = body["error"]["message"].as_str().unwrap();
        assert!(message.contains("limit 1024 tokens"), "{message}");
        let rejection = &body["error"]["rejection"];
        assert_eq!(rejection["limit"], 1024, "{body}");
        assert_eq!(rejection["prompt_tokens"], 1100, "{body}");
        assert_eq!(rejection["node"], "prefill", "{body}");
    }
}
