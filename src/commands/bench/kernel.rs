//! The in-kernel check on its own: CPU paged-attention decode with and
//! without the generation check (`paged_attention_decode_checked` compares
//! every `PageRef` with the pool's generation array before reading), timed
//! alternately in this process.
//!
//! Shape: SmolLM2-135M's attention (9 query heads over 3 KV heads of 64,
//! 16-slot pages), one layer, a batch of 8 sequences of 512 tokens (32 pages
//! each). The check's work does not depend on the layer count.

use std::hint::black_box;
use std::time::Instant;

use half::f16;
use kvsan_kernels::attention::{
    DecodeSeq, KvGeometry, paged_attention_decode, paged_attention_decode_checked,
};
use kvsan_sanitizer::{Generation, PageId, PageRef};
use serde::Serialize;

const N_HEADS: usize = 9;
const SEQS: usize = 8;
const SEQ_LEN: usize = 512;

/// Checked vs unchecked decode attention, as measured.
#[derive(Clone, Debug, Serialize)]
pub struct KernelCheck {
    /// What was timed.
    pub shape: String,
    /// Median time of one unchecked batched decode call, in microseconds.
    pub unchecked_us: f64,
    /// Median time of one checked call, in microseconds.
    pub checked_us: f64,
    /// Checked ÷ unchecked time per round: min, median, max.
    pub ratio: Spread,
    /// Rounds timed (each: `calls` calls of each kernel).
    pub rounds: usize,
    /// Calls per kernel per round.
    pub calls: usize,
}

/// Min, median and max of a set of ratios, with the values themselves.
#[derive(Clone, Debug, Serialize)]
pub struct Spread {
    /// Smallest.
    pub min: f64,
    /// Median.
    pub median: f64,
    /// Largest.
    pub max: f64,
    /// Every value, in round order.
    pub values: Vec<f64>,
}

impl Spread {
    /// The spread of `values` (all zero when empty).
    pub fn of(values: Vec<f64>) -> Spread {
        let mut sorted = values.clone();
        sorted.sort_by(f64::total_cmp);
        Spread {
            min: sorted.first().copied().unwrap_or(0.0),
            median: median(&sorted),
            max: sorted.last().copied().unwrap_or(0.0),
            values,
        }
    }
}

/// Median of sorted `values` (mean of the middle two for an even count; 0 when empty).
pub fn median(sorted: &[f64]) -> f64 {
    match sorted.len() {
        0 => 0.0,
        n if n % 2 == 1 => sorted[n / 2],
        n => (sorted[n / 2 - 1] + sorted[n / 2]) / 2.0,
    }
}

/// Times both kernels for `rounds` rounds of `calls` calls each,
/// alternating unchecked and checked.
pub fn measure(rounds: usize, calls: usize) -> KernelCheck {
    let geom = KvGeometry {
        page_slots: 16,
        n_layers: 1,
        n_kv_heads: 3,
        head_dim: 64,
    };
    let pages_per_seq = SEQ_LEN.div_ceil(geom.page_slots);
    let n_pages = SEQS * pages_per_seq;
    let pool: Vec<f16> = (0..n_pages * geom.page_elems())
        .map(|i| f16::from_f32(((i * 7) % 13) as f32 / 13.0 - 0.5))
        .collect();
    let generations: Vec<Generation> = (0..n_pages).map(|_| Generation(3)).collect();
    let tables: Vec<Vec<PageRef>> = (0..SEQS)
        .map(|s| {
            (0..pages_per_seq)
                .map(|p| PageRef {
                    page: PageId(u32::try_from(s * pages_per_seq + p).unwrap_or(u32::MAX)),
                    generation: Generation(3),
                })
                .collect()
        })
        .collect();
    let q: Vec<f32> = (0..N_HEADS * geom.head_dim)
        .map(|i| ((i * 5) % 11) as f32 / 11.0 - 0.5)
        .collect();
    let seqs: Vec<DecodeSeq> = tables
        .iter()
        .map(|t| DecodeSeq {
            q: &q,
            block_table: t,
            seq_len: SEQ_LEN,
        })
        .collect();
    let mut out = vec![0.0f32; SEQS * N_HEADS * geom.head_dim];
    let scale = 1.0 / (geom.head_dim as f32).sqrt();
    let mut unchecked = Vec::with_capacity(rounds);
    let mut checked = Vec::with_capacity(rounds);
    // One untimed call of each first: page faults and thread start-up.
    for _ in 0..=rounds {
        let t = Instant::now();
        for _ in 0..calls {
            paged_attention_decode(&pool, &geom, 0, N_HEADS, scale, &seqs, &mut out);
            black_box(&out);
        }
        let u = t.elapsed().as_secs_f64() / calls as f64;
        let t = Instant::now();
        for _ in 0..calls {
            let r = paged_attention_decode_checked(
                &pool,
                &geom,
                0,
                N_HEADS,
                scale,
                &seqs,
                &mut out,
                &generations,
            );
            black_box(r.is_ok());
            black_box(&out);
        }
        let c = t.elapsed().as_secs_f64() / calls as f64;
        unchecked.push(u);
        checked.push(c);
    }
    unchecked.remove(0);
    checked.remove(0);
    let ratios: Vec<f64> = checked.iter().zip(&unchecked).map(|(c, u)| c / u).collect();
    unchecked.sort_by(f64::total_cmp);
    checked.sort_by(f64::total_cmp);
    KernelCheck {
        shape: format!(
            "decode attention, {SEQS} sequences x {SEQ_LEN} tokens, {N_HEADS} heads over {} KV heads of {}, {}-slot pages, one layer",
            geom.n_kv_heads, geom.head_dim, geom.page_slots
        ),
        unchecked_us: median(&unchecked) * 1e6,
        checked_us: median(&checked) * 1e6,
        ratio: Spread::of(ratios),
        rounds,
        calls,
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn spread_of_ratios_is_min_median_max() {
        let s = Spread::of(vec![1.2, 0.9, 1.0, 1.1]);
        assert_eq!((s.min, s.median, s.max), (0.9, 1.05, 1.2));
        assert_eq!(s.values, vec![1.2, 0.9, 1.0, 1.1]);
    }

    #[test]
    fn kernel_check_reports_one_ratio_per_round() {
        let k = measure(2, 1);
        assert_eq!((k.rounds, k.calls), (2, 1));
        assert_eq!(k.ratio.values.len(), 2);
        assert!(k.ratio.min <= k.ratio.median && k.ratio.median <= k.ratio.max);
    }
}
