//! Generation of one sequence from a prompt: chunked prefill, then decode
//! token by token, sampling each next token. The serving engine's scheduler
//! batches many such sequences; this is the single-request path the CLI and
//! the correctness tests use.

use std::time::{Duration, Instant};

use kvsan_sanitizer::PageRef;

use crate::EngineError;
use crate::kv_pool::KvPool;
use crate::model::{AttentionCheck, Logits, Model, SeqChunk};
use crate::sampler::{Sampler, SamplingParams};

/// How to generate.
#[derive(Clone, Debug)]
pub struct GenerateOptions {
    /// Most tokens to generate.
    pub max_tokens: usize,
    /// How each token is chosen.
    pub sampling: SamplingParams,
    /// Token slots per KV page.
    pub page_slots: usize,
    /// Prompt tokens per prefill step.
    pub prefill_chunk: usize,
    /// Tokens that end generation (not included in the output).
    pub stop_tokens: Vec<u32>,
    /// How attention reads the pool.
    pub check: AttentionCheck,
}

impl Default for GenerateOptions {
    fn default() -> Self {
        GenerateOptions {
            max_tokens: 64,
            sampling: SamplingParams::greedy(),
            page_slots: 16,
            prefill_chunk: 512,
            stop_tokens: Vec::new(),
            check: AttentionCheck::Unchecked,
        }
    }
}

/// Why generation stopped.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum StopReason {
    /// A stop token was sampled.
    Stop,
    /// `max_tokens` were generated.
    Length,
}

/// The result of [`generate`].
#[derive(Clone, Debug)]
pub struct Completion {
    /// The generated token ids (without the stop token).
    pub ids: Vec<u32>,
    /// Why it stopped.
    pub stop: StopReason,
    /// Wall time of the prompt's prefill (including the first token's logits).
    pub prefill_time: Duration,
    /// Wall time of the decode steps.
    pub decode_time: Duration,
    /// Decode steps run (tokens generated after the first).
    pub decode_steps: usize,
}

impl Completion {
    /// Prompt tokens per second.
    #[must_use]
    pub fn prompt_tokens_per_s(&self, prompt_len: usize) -> f64 {
        prompt_len as f64 / self.prefill_time.as_secs_f64().max(1e-9)
    }

    /// Decode tokens per second.
    #[must_use]
    pub fn decode_tokens_per_s(&self) -> f64 {
        self.decode_steps as f64 / self.decode_time.as_secs_f64().max(1e-9)
    }
}

/// Generates up to `opts.max_tokens` tokens after `prompt`, calling `on_token`
/// with each as it is chosen.
///
/// # Errors
/// [`EngineError::InvalidBatch`] for an empty prompt, a token outside the
/// vocabulary or a prompt that with `max_tokens` exceeds the model's context;
/// any error of the forward pass.
pub fn generate(
    model: &Model,
    prompt: &[u32],
    opts: &GenerateOptions,
    mut on_token: impl FnMut(u32),
) -> Result<Completion, EngineError> {
    let cfg = model.config();
    if prompt.is_empty() {
        return Err(EngineError::InvalidBatch {
            chunk: 0,
            what: "the prompt is empty".into(),
        });
    }
    let total = prompt.len() + opts.max_tokens;
    if total > cfg.context_length {
        return Err(EngineError::InvalidBatch {
            chunk: 0,
            what: format!(
                "prompt of {} tokens + {} new tokens exceeds the model's context of {} tokens",
                prompt.len(),
                opts.max_tokens,
                cfg.context_length
            ),
        });
    }
    let mut sampler = Sampler::new(opts.sampling)?;
    let page_slots = opts.page_slots.max(1);
    let n_pages = total.div_ceil(page_slots);
    let mut pool = KvPool::new(model.kv_geometry(page_slots), n_pages)?;
    let block_table: Vec<PageRef> = (0..n_pages)
        .map(|_| pool.alloc().expect("pool sized for the sequence"))
        .collect();

    let started = Instant::now();
    let chunk = opts.prefill_chunk.max(1);
    let mut logits = Vec::new();
    for (i, part) in prompt.chunks(chunk).enumerate() {
        let last = (i + 1) * chunk >= prompt.len();
        let step = [SeqChunk {
            tokens: part,
            start_pos: i * chunk,
            block_table: &block_table,
            logits: if last { Logits::Last } else { Logits::None },
        }];
        logits = model.forward(&mut pool, &step, opts.check)?;
    }
    let prefill_time = started.elapsed();

    let mut ids = Vec::with_capacity(opts.max_tokens);
    let mut stop = StopReason::Length;
    let decode_started = Instant::now();
    let mut decode_steps = 0;
    while ids.len() < opts.max_tokens {
        let next = sampler.sample(&logits);
        if opts.stop_tokens.contains(&next) {
            stop = StopReason::Stop;
            break;
        }
        ids.push(next);
        on_token(next);
        if ids.len() == opts.max_tokens {
            break;
        }
        let step = [SeqChunk {
            tokens: std::slice::from_ref(&next),
            start_pos: prompt.len() + ids.len() - 1,
            block_table: &block_table,
            logits: Logits::Last,
        }];
        logits = model.forward(&mut pool, &step, opts.check)?;
        decode_steps += 1;
    }
    Ok(Completion {
        ids,
        stop,
        prefill_time,
        decode_time: decode_started.elapsed(),
        decode_steps,
    })
}
