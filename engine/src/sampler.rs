//! Choosing the next token from logits: greedy, temperature, top-k, top-p,
//! seeded.
//!
//! Order of operations (as in Hugging Face `transformers`): logits are
//! divided by the temperature, the `top_k` largest are kept, the softmax is
//! taken over them, then the smallest set of most likely tokens whose mass
//! reaches `top_p` is kept, and one token is drawn from it. Temperature 0 is
//! greedy: the arg-max, ties going to the lowest id.
//!
//! The random source is ChaCha8 seeded with `seed`, a fixed algorithm, so the
//! same seed and logits give the same tokens on every platform.

use rand::{RngExt, SeedableRng};
use rand_chacha::ChaCha8Rng;

use crate::error::EngineError;

/// How the next token is chosen.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct SamplingParams {
    /// Softmax temperature; 0 = greedy. Allowed: finite, `0.0..=100.0`.
    pub temperature: f32,
    /// Keep only the `top_k` most likely tokens; 0 = no limit.
    pub top_k: usize,
    /// Keep the smallest set of most likely tokens whose probability mass is
    /// at least `top_p`; 1 = no limit. Allowed: `(0.0, 1.0]`.
    pub top_p: f32,
    /// Seed of the random generator.
    pub seed: u64,
}

impl Default for SamplingParams {
    /// Greedy decoding.
    fn default() -> Self {
        SamplingParams::greedy()
    }
}

impl SamplingParams {
    /// Greedy decoding (temperature 0).
    #[must_use]
    pub const fn greedy() -> Self {
        SamplingParams {
            temperature: 0.0,
            top_k: 0,
            top_p: 1.0,
            seed: 0,
        }
    }

    /// Checks every parameter's range.
    ///
    /// # Errors
    /// [`EngineError::InvalidSamplingParam`] naming the first parameter out
    /// of range and its allowed range.
    pub fn validate(&self) -> Result<(), EngineError> {
        if !(self.temperature.is_finite() && (0.0..=100.0).contains(&self.temperature)) {
            return Err(EngineError::InvalidSamplingParam {
                name: "temperature",
                value: self.temperature.to_string(),
                allowed: "0.0..=100.0 (0 = greedy)",
            });
        }
        if !(self.top_p > 0.0 && self.top_p <= 1.0) {
            return Err(EngineError::InvalidSamplingParam {
                name: "top_p",
                value: self.top_p.to_string(),
                allowed: "greater than 0.0, at most 1.0 (1 = off)",
            });
        }
        Ok(())
    }

    /// Whether these parameters always pick the arg-max.
    #[must_use]
    pub fn is_greedy(&self) -> bool {
        self.temperature == 0.0 || self.top_k == 1
    }
}

/// Draws tokens from logits according to [`SamplingParams`].
#[derive(Debug, Clone)]
pub struct Sampler {
    params: SamplingParams,
    rng: ChaCha8Rng,
    /// Scratch: (id, weight) of the candidates.
    candidates: Vec<(u32, f64)>,
}

impl Sampler {
    /// A sampler with `params`, its generator seeded with `params.seed`.
    ///
    /// # Errors
    /// [`EngineError::InvalidSamplingParam`] when a parameter is out of range.
    pub fn new(params: SamplingParams) -> Result<Sampler, EngineError> {
        params.validate()?;
        Ok(Sampler {
            params,
            rng: ChaCha8Rng::seed_from_u64(params.seed),
            candidates: Vec::new(),
        })
    }

    /// The parameters.
    #[must_use]
    pub fn params(&self) -> &SamplingParams {
        &self.params
    }

    /// The next token id drawn from `logits` (one per vocabulary entry).
    ///
    /// NaN logits are never chosen. If no logit is a number above −∞ the
    /// result is the arg-max rule's (the lowest such id, or 0 if all are NaN).
    ///
    /// # Panics
    /// If `logits` is empty or has more than `u32::MAX` entries.
    pub fn sample(&mut self, logits: &[f32]) -> u32 {
        assert!(
            !logits.is_empty(),
            "Sampler::sample needs at least one logit"
        );
        assert!(
            u32::try_from(logits.len()).is_ok(),
            "Sampler::sample: more logits than token ids"
        );
        let best = argmax(logits);
        if self.params.is_greedy() {
            return best;
        }
        let max = logits[best as usize];
        if !max.is_finite() {
            return best;
        }
        let inv_t = 1.0 / f64::from(self.params.temperature);

        let c = &mut self.candidates;
        c.clear();
        c.extend(
            logits
                .iter()
                .enumerate()
                .filter(|(_, l)| !l.is_nan() && **l > f32::NEG_INFINITY)
                .map(|(i, &l)| (i as u32, f64::from(l))),
        );
        // Most likely first; ties to the lower id.
        let by_logit = |a: &(u32, f64), b: &(u32, f64)| b.1.total_cmp(&a.1).then(a.0.cmp(&b.0));
        let k = self.params.top_k;
        if k > 0 && k < c.len() {
            c.select_nth_unstable_by(k - 1, by_logit);
            c.truncate(k);
        }
        let top_p = f64::from(self.params.top_p);
        if top_p < 1.0 {
            c.sort_unstable_by(by_logit);
        }
        let max = f64::from(max);
        let mut total = 0.0;
        for (_, w) in c.iter_mut() {
            *w = ((*w - max) * inv_t).exp();
            total += *w;
        }
        if top_p < 1.0 {
            let mut mass = 0.0;
            let mut keep = c.len();
            for (i, (_, w)) in c.iter().enumerate() {
                mass += w;
                if mass >= top_p * total {
                    keep = i + 1;
                    break;
                }
            }
            c.truncate(keep);
            total = mass.min(total);
        }
        let target = self.rng.random::<f64>() * total;
        let mut acc = 0.0;
        for &(id, w) in c.iter() {
            acc += w;
            if target < acc {
                return id;
            }
        }
        // Rounding left `target` at the very top: the last candidate.
        c.last().map_or(best, |&(id, _)| id)
    }
}

/// Index of the largest logit, ties to the lowest index; NaN never wins
/// (0 if every logit is NaN).
#[must_use]
pub fn argmax(logits: &[f32]) -> u32 {
    let mut best: Option<(usize, f32)> = None;
    for (i, &l) in logits.iter().enumerate() {
        if l.is_nan() {
            continue;
        }
        if best.is_none_or(|(_, b)| l > b) {
            best = Some((i, l));
        }
    }
    best.map_or(0, |(i, _)| i as u32)
}
