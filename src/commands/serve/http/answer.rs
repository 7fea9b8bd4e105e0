//! A request's engine events as the client sees them: token ids become
//! text (with the model's tokenizer), stop strings end the text, and the
//! tokens are counted for `usage` — with the prompt tokens the prefix cache
//! served, which the engine says when it finishes the request.

use std::sync::Arc;

use kvsan_engine::request::{Event, FinishReason, RequestError};
use kvsan_engine::tokenizer::StreamDecoder;

use super::openai::{Delta, Usage};
use super::stop::StopStrings;
use crate::commands::serve::text::TextSide;

/// What one engine event means for the client.
#[derive(Debug)]
pub enum Step {
    /// More of the answer.
    More(Delta),
    /// The last of the answer, and why it ended. A stop string can end it
    /// before the engine does: the request is then cancelled in the engine.
    End(Delta, FinishReason),
    /// The request failed.
    Failed(RequestError),
}

/// Turns one request's events into answer steps.
pub struct Answer {
    text: Option<(Arc<TextSide>, StreamDecoder)>,
    stop: StopStrings,
    prompt_tokens: usize,
    generated: usize,
    /// Prompt tokens whose KV came from the prefix cache, once the engine
    /// has finished the request (a stop string ends it here first: unknown).
    cached_tokens: Option<usize>,
}

impl Answer {
    /// For a prompt of `prompt_tokens`; `text` is `None` for a model without
    /// a tokenizer (ids only, and no stop strings).
    pub fn new(text: Option<Arc<TextSide>>, stop: StopStrings, prompt_tokens: usize) -> Self {
        Answer {
            text: text.map(|t| {
                let decoder = t.tokenizer().stream_decoder();
                (t, decoder)
            }),
            stop,
            prompt_tokens,
            generated: 0,
            cached_tokens: None,
        }
    }

    /// The tokens counted so far.
    pub fn usage(&self) -> Usage {
        Usage {
            prompt_tokens: self.prompt_tokens,
            completion_tokens: self.generated,
            cached_tokens: self.cached_tokens,
        }
    }

    /// The step of `event`.
    pub fn step(&mut self, event: Event) -> Step {
        match event {
            Event::Token(id) => {
                self.generated += 1;
                let Some((side, decoder)) = &mut self.text else {
                    return Step::More(Delta {
                        text: String::new(),
                        ids: vec![id],
                    });
                };
                let piece = decoder.push(side.tokenizer(), id);
                let pushed = self.stop.push(&piece);
                let delta = Delta {
                    text: pushed.emit,
                    ids: vec![id],
                };
                if pushed.stopped {
                    Step::End(delta, FinishReason::Stop)
                } else {
                    Step::More(delta)
                }
            }
            Event::Finished {
                reason,
                cached_tokens,
                ..
            } => {
                self.cached_tokens = Some(cached_tokens);
                // Bytes of an incomplete UTF-8 sequence still held back.
                let tail = self
                    .text
                    .take()
                    .map(|(_, decoder)| decoder.finish())
                    .unwrap_or_default();
                let pushed = self.stop.push(&tail);
                if pushed.stopped {
                    return Step::End(Delta::text(pushed.emit), FinishReason::Stop);
                }
                let mut text = pushed.emit;
                text.push_str(&std::mem::take(&mut self.stop).finish());
                Step::End(Delta::text(text), reason)
            }
            Event::Error(e) => Step::Failed(e),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn without_a_tokenizer_each_token_is_its_id_and_counted() {
        let mut answer = Answer::new(None, StopStrings::default(), 3);
        let Step::More(d) = answer.step(Event::Token(7)) else {
            panic!("a token is more of the answer");
        };
        assert_eq!((d.text.as_str(), d.ids.as_slice()), ("", &[7][..]));
        let end = answer.step(Event::Finished {
            reason: FinishReason::Length,
            prompt_tokens: 3,
            generated: 1,
            cached_tokens: 2,
        });
        assert!(matches!(end, Step::End(ref d, FinishReason::Length) if d.is_empty()));
        let usage = answer.usage();
        assert_eq!(
            (
                usage.prompt_tokens,
                usage.completion_tokens,
                usage.cached_tokens
            ),
            (3, 1, Some(2))
        );
    }
}
