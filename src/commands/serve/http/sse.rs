//! `"stream": true`: the answer as server-sent events.
//!
//! ```text
//!  data: {"object": "chat.completion.chunk", "choices": [{"delta": {"role": "assistant", "content": ""}, …}]}   (chat only)
//!  data: {… "choices": [{"delta": {"content": "Hel"}, "finish_reason": null}]}    one per piece of text
//!  data: {… "choices": [{"delta": {}, "finish_reason": "stop"}]}                  the last
//!  data: {… "choices": [], "usage": {"prompt_tokens": …}}    with stream_options.include_usage
//!  data: [DONE]
//! ```
//!
//! (`/v1/completions` sends `"object": "text_completion"` chunks with
//! `"text"` in each choice.) A request that fails after its stream began
//! sends `data: {"error": {…}}` in place of the last chunk, then `[DONE]`.
//! Dropping the stream — hyper does when the client goes away — drops the
//! [`Generation`], which cancels the request in the engine and says so on
//! stderr.

use std::convert::Infallible;

use axum::response::sse::{Event as SseEvent, Sse};
use axum::response::{IntoResponse, Response};
use kvsan_engine::request::Event;

use super::answer::{Answer, Step};
use super::bridge::Generation;
use super::error::ApiError;
use super::openai::{Endpoint, Reply};

/// Where a stream is.
enum Phase {
    /// The chat stream's role chunk is next.
    Role,
    /// The answer's chunks.
    Answer,
    /// The usage chunk is next.
    Usage,
    /// `[DONE]` is next.
    Done,
    Over,
}

struct Streaming {
    /// `None` once the request has ended (or was ended by a stop string).
    generation: Option<Generation>,
    /// The event that decided the status, not yet sent.
    first: Option<Event>,
    answer: Answer,
    reply: Reply,
    phase: Phase,
}

/// The SSE response of a request whose first event was `first`.
pub fn respond(generation: Generation, answer: Answer, reply: Reply, first: Event) -> Response {
    let phase = match reply.endpoint {
        Endpoint::Chat => Phase::Role,
        Endpoint::Completions => Phase::Answer,
    };
    let streaming = Streaming {
        generation: Some(generation),
        first: Some(first),
        answer,
        reply,
        phase,
    };
    let events = futures_util::stream::unfold(streaming, |mut s| async move {
        let data = s.next_data().await?;
        Some((Ok::<_, Infallible>(SseEvent::default().data(data)), s))
    });
    Sse::new(events).into_response()
}

impl Streaming {
    /// The next event's data; `None` after `[DONE]`.
    async fn next_data(&mut self) -> Option<String> {
        loop {
            match self.phase {
                Phase::Role => {
                    self.phase = Phase::Answer;
                    return Some(self.reply.role_chunk().to_string());
                }
                Phase::Answer => {
                    let event = match (self.first.take(), &mut self.generation) {
                        (Some(event), _) => Some(event),
                        (None, Some(generation)) => generation.next().await,
                        (None, None) => None,
                    };
                    let Some(event) = event else {
                        return Some(self.fail(ApiError::engine_stopped()));
                    };
                    match self.answer.step(event) {
                        Step::More(delta) if delta.is_empty() => {}
                        Step::More(delta) => {
                            return Some(self.reply.chunk(&delta, None).to_string());
                        }
                        Step::End(delta, reason) => {
                            if let Some(generation) = self.generation.take() {
                                generation.end();
                            }
                            self.phase = if self.reply.include_usage {
                                Phase::Usage
                            } else {
                                Phase::Done
                            };
                            return Some(self.reply.chunk(&delta, Some(reason)).to_string());
                        }
                        Step::Failed(e) => return Some(self.fail(ApiError::from_request(&e))),
                    }
                }
                Phase::Usage => {
                    self.phase = Phase::Done;
                    return Some(self.reply.usage_chunk(self.answer.usage()).to_string());
                }
                Phase::Done => {
                    self.phase = Phase::Over;
                    return Some("[DONE]".into());
                }
                Phase::Over => return None,
            }
        }
    }

    /// The error event; `[DONE]` follows.
    fn fail(&mut self, e: ApiError) -> String {
        self.generation = None;
        self.phase = Phase::Done;
        e.body().to_string()
    }
}
