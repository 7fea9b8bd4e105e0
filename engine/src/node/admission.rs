//! Admission control: a request is rejected — before it allocates, computes
//! or sends anything — when it cannot fit the context or a pool.

use crate::model::Model;
use crate::request::{CONTEXT_REASON, ErrorKind, Rejection, Request, RequestError};

/// A limit a request's prompt must fit.
pub(crate) struct PoolLimit<'a> {
    /// The node whose pool it is (`unified`, `prefill`, `decode`).
    pub node: &'a str,
    /// Tokens the pool can hold.
    pub tokens: usize,
}

/// Checks a request against the model, the context (enforced by the
/// admitting node `node`) and every pool it will use. The error is a rejection naming the prompt length, the limit and the
/// node, or an invalid-request error naming the bad field.
pub(crate) fn check(
    request: &Request,
    model: &Model,
    node: &str,
    context: usize,
    pools: &[PoolLimit<'_>],
) -> Result<(), RequestError> {
    let vocab = model.config().vocab_size;
    if request.prompt.is_empty() {
        return Err(RequestError::new(
            ErrorKind::InvalidRequest,
            "the prompt is empty",
        ));
    }
    if request.max_tokens == 0 {
        return Err(RequestError::new(
            ErrorKind::InvalidRequest,
            "max_tokens is 0",
        ));
    }
    if let Some(&bad) = request.prompt.iter().find(|&&t| t as usize >= vocab) {
        return Err(RequestError::new(
            ErrorKind::InvalidRequest,
            format!("prompt token id {bad} is outside the vocabulary of {vocab}"),
        ));
    }
    if let Err(e) = request.sampling.validate() {
        return Err(RequestError::new(ErrorKind::InvalidRequest, e.to_string()));
    }
    let prompt = request.prompt.len();
    let total = prompt.saturating_add(request.max_tokens);
    if total > context {
        return Err(RequestError::rejected(Rejection {
            reason: format!(
                "prompt + max_tokens ({prompt} + {}) {CONTEXT_REASON}",
                request.max_tokens
            ),
            prompt_tokens: prompt,
            limit: context,
            node: node.to_string(),
        }));
    }
    for pool in pools {
        if prompt > pool.tokens {
            return Err(RequestError::rejected(Rejection {
                reason: format!(
                    "prompt exceeds what the {} node's KV pool can ever hold",
                    pool.node
                ),
                prompt_tokens: prompt,
                limit: pool.tokens,
                node: pool.node.to_string(),
            }));
        }
    }
    Ok(())
}
