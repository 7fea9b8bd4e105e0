//! `POST /v1/completions` and `POST /v1/chat/completions`: a body becomes
//! an engine request of the key's tenant; the answer is one JSON object
//! or, with `"stream": true`, server-sent events.
//!
//! The status is decided by the request's first event: a request the
//! engine refuses at admission (a prompt over a pool or the context) gets
//! its 4xx before any byte of a stream is sent. An error after tokens have
//! been streamed is the stream's last data event before `[DONE]`.

use std::hash::{BuildHasher, RandomState};
use std::sync::Arc;
use std::time::{SystemTime, UNIX_EPOCH};

use axum::body::Body;
use axum::extract::State;
use axum::http::HeaderMap;
use axum::response::{IntoResponse, Response};
use kvsan_engine::EngineError;
use kvsan_engine::request::{CacheSalt, Event, Request};
use kvsan_engine::sampler::SamplingParams;

use super::answer::{Answer, Step};
use super::api_keys::{MAX_CACHE_SALT_BYTES, Tenant};
use super::bridge::Generation;
use super::error::ApiError;
use super::openai::{self, Delta, Endpoint, GenerateBody, Reply, Stop};
use super::stop::{MAX_STOP_STRINGS, StopStrings};
use super::{Front, json_body, prompt, read_body, sse};

/// Tokens a completion generates when `max_tokens` is not given (OpenAI's
/// and vLLM's default for this endpoint).
const COMPLETION_DEFAULT_MAX_TOKENS: usize = 16;

/// `POST /v1/completions`.
pub async fn completions(
    State(front): State<Arc<Front>>,
    headers: HeaderMap,
    body: Body,
) -> Response {
    generate(&front, &headers, body, Endpoint::Completions)
        .await
        .unwrap_or_else(IntoResponse::into_response)
}

/// `POST /v1/chat/completions`.
pub async fn chat(State(front): State<Arc<Front>>, headers: HeaderMap, body: Body) -> Response {
    generate(&front, &headers, body, Endpoint::Chat)
        .await
        .unwrap_or_else(IntoResponse::into_response)
}

async fn generate(
    front: &Arc<Front>,
    headers: &HeaderMap,
    body: Body,
    endpoint: Endpoint,
) -> Result<Response, ApiError> {
    let tenant = front.authorize(headers)?.clone();
    let body: GenerateBody = openai::parse(&read_body(body).await?)?;
    let job = Job::from_body(front, body, endpoint)?;
    let permit = front.admit()?;
    let prompt_tokens = job.prompt.len();
    let (stream, include_usage, stops) = (job.stream, job.include_usage, job.stop.clone());
    let mut generation = Generation::start(
        &front.engine,
        job.request(front, &tenant),
        permit,
        &front.metrics,
    );
    let first = match generation.next().await {
        None => return Err(ApiError::engine_stopped()),
        Some(Event::Error(e)) => return Err(ApiError::from_request(&e)),
        Some(event) => event,
    };
    let prefix = match endpoint {
        Endpoint::Completions => "cmpl",
        Endpoint::Chat => "chatcmpl",
    };
    let reply = Reply {
        endpoint,
        id: format!("{prefix}-{}", generation.id.0),
        created: SystemTime::now()
            .duration_since(UNIX_EPOCH)
            .map_or(0, |d| d.as_secs()),
        model: front.model_id.clone(),
        token_ids: front.text.is_none(),
        include_usage,
    };
    let answer = Answer::new(front.text.clone(), StopStrings::new(stops), prompt_tokens);
    if stream {
        return Ok(sse::respond(generation, answer, reply, first));
    }
    whole(generation, answer, &reply, first).await
}

/// Collects the whole answer of a request that is not streamed.
async fn whole(
    mut generation: Generation,
    mut answer: Answer,
    reply: &Reply,
    first: Event,
) -> Result<Response, ApiError> {
    let mut all = Delta::default();
    let mut event = first;
    loop {
        match answer.step(event) {
            Step::More(d) => {
                all.text.push_str(&d.text);
                all.ids.extend(d.ids);
            }
            Step::End(d, reason) => {
                // Ends the request in the engine if a stop string ended it here.
                generation.end();
                all.text.push_str(&d.text);
                all.ids.extend(d.ids);
                return Ok(json_body(&reply.whole(&all, reason, answer.usage())));
            }
            Step::Failed(e) => return Err(ApiError::from_request(&e)),
        }
        event = generation
            .next()
            .await
            .ok_or_else(ApiError::engine_stopped)?;
    }
}

/// A validated generation body.
struct Job {
    prompt: Vec<u32>,
    max_tokens: usize,
    sampling: SamplingParams,
    stop: Vec<String>,
    stream: bool,
    include_usage: bool,
    /// The client's `cache_salt`.
    cache_salt: Option<String>,
}

impl Job {
    fn from_body(front: &Front, body: GenerateBody, endpoint: Endpoint) -> Result<Job, ApiError> {
        if body.model != front.model_id {
            return Err(ApiError::unknown_model(&body.model, &front.model_id));
        }
        if let Some(n) = body.n.filter(|&n| n != 1) {
            return Err(ApiError::invalid_field(
                "unsupported_value",
                "n",
                format!("\"n\" is {n}: this server generates one choice per request (n = 1)"),
            ));
        }
        if let Some(salt) = &body.cache_salt {
            check_cache_salt(salt)?;
        }
        let stream = body.stream.unwrap_or(false);
        if body.stream_options.is_some() && !stream {
            return Err(ApiError::invalid_field(
                "invalid_value",
                "stream_options",
                "\"stream_options\" is allowed only with \"stream\": true",
            ));
        }
        let include_usage = body
            .stream_options
            .as_ref()
            .and_then(|o| o.include_usage)
            .unwrap_or(false);
        let (prompt, asked_max) = match endpoint {
            Endpoint::Completions => {
                if body.messages.is_some() || body.max_completion_tokens.is_some() {
                    let field = if body.messages.is_some() {
                        "messages"
                    } else {
                        "max_completion_tokens"
                    };
                    return Err(not_here(field, "/v1/chat/completions"));
                }
                let ids = prompt::completion_prompt(front, body.prompt.as_ref())?;
                (ids, body.max_tokens)
            }
            Endpoint::Chat => {
                if body.prompt.is_some() {
                    return Err(not_here("prompt", "/v1/completions"));
                }
                let ids = prompt::chat_prompt(front, body.messages.as_deref())?;
                (ids, body.max_completion_tokens.or(body.max_tokens))
            }
        };
        let max_tokens = match asked_max {
            Some(0) => {
                return Err(ApiError::invalid_field(
                    "invalid_value",
                    "max_tokens",
                    "\"max_tokens\" is 0: it must be at least 1",
                ));
            }
            Some(n) => usize::try_from(n).unwrap_or(usize::MAX),
            None if endpoint == Endpoint::Completions => COMPLETION_DEFAULT_MAX_TOKENS,
            // The rest of the context; an over-long prompt is the engine's
            // rejection, which names the limit.
            None => front.context_length.saturating_sub(prompt.len()).max(1),
        };
        let sampling = sampling(&body)?;
        let stop = stop_strings(front, body.stop)?;
        Ok(Job {
            prompt,
            max_tokens,
            sampling,
            stop,
            stream,
            include_usage,
            cache_salt: body.cache_salt,
        })
    }

    /// The engine request of `tenant`'s key: its salt is the server's part
    /// of the cache salt, the body's `cache_salt` the client's.
    fn request(self, front: &Front, tenant: &Tenant) -> Request {
        Request {
            tenant: tenant.id,
            prompt: self.prompt,
            max_tokens: self.max_tokens,
            sampling: self.sampling,
            stop_tokens: front
                .text
                .as_ref()
                .map(|t| t.stop_tokens().to_vec())
                .unwrap_or_default(),
            cache_salt: CacheSalt {
                server: tenant.salt.clone(),
                client: self.cache_salt,
            },
        }
    }
}

fn not_here(field: &str, endpoint: &str) -> ApiError {
    ApiError::invalid_field(
        "unknown_field",
        field,
        format!("unknown or unsupported field \"{field}\" here: it belongs to {endpoint}"),
    )
}

/// `cache_salt`: a non-empty string (vLLM refuses an empty one too) of at
/// most [`MAX_CACHE_SALT_BYTES`]. Never echoed.
fn check_cache_salt(salt: &str) -> Result<(), ApiError> {
    if salt.is_empty() || salt.len() > MAX_CACHE_SALT_BYTES {
        return Err(ApiError::invalid_field(
            "invalid_value",
            "cache_salt",
            format!(
                "\"cache_salt\" has {} bytes: it must be a non-empty string of at most {MAX_CACHE_SALT_BYTES} bytes",
                salt.len()
            ),
        ));
    }
    Ok(())
}

fn stop_strings(front: &Front, stop: Option<Stop>) -> Result<Vec<String>, ApiError> {
    let stops = match stop {
        None => return Ok(Vec::new()),
        Some(Stop::One(s)) => vec![s],
        Some(Stop::Many(list)) => list,
    };
    if stops.len() > MAX_STOP_STRINGS {
        return Err(ApiError::invalid_field(
            "invalid_value",
            "stop",
            format!(
                "\"stop\" has {} strings: at most {MAX_STOP_STRINGS} are allowed",
                stops.len()
            ),
        ));
    }
    if let Some(i) = stops.iter().position(String::is_empty) {
        return Err(ApiError::invalid_field(
            "invalid_value",
            format!("stop[{i}]"),
            format!("\"stop\"[{i}] is empty"),
        ));
    }
    if !stops.is_empty() {
        prompt::text_side(front, "\"stop\"")?;
    }
    Ok(stops)
}

/// The sampling parameters; OpenAI's defaults (temperature 1, a random
/// seed) where the body says nothing.
fn sampling(body: &GenerateBody) -> Result<SamplingParams, ApiError> {
    let top_k = match body.top_k {
        None | Some(0 | -1) => 0,
        Some(k) => usize::try_from(k).map_err(|_| {
            ApiError::invalid_field(
                "invalid_value",
                "top_k",
                format!("\"top_k\" is {k}: it must be at least 1, or 0 or -1 for no limit"),
            )
        })?,
    };
    let params = SamplingParams {
        temperature: body.temperature.unwrap_or(1.0) as f32,
        top_k,
        top_p: body.top_p.unwrap_or(1.0) as f32,
        seed: body
            .seed
            .unwrap_or_else(|| RandomState::new().hash_one(SystemTime::now())),
    };
    params.validate().map_err(|e| match &e {
        EngineError::InvalidSamplingParam { name, .. } => {
            ApiError::invalid_field("invalid_value", *name, e.to_string())
        }
        _ => ApiError::invalid("invalid_value", e.to_string()),
    })?;
    Ok(params)
}
