//! The in-kernel check on its own: CPU paged attention of a decode batch,
//! unchecked and checked against the sanitizer's kernel shadow (every page
//! touched: owner, generation, the layer's written slots), timed alternately
//! in this process through the engine's one KV access path.
//!
//! Shape: SmolLM2-135M's attention (9 query heads over 3 KV heads of 64,
//! 16-slot pages), one layer, a batch of 8 sequences of 512 tokens (32 pages
//! each). The check's work does not depend on the layer count.

use std::hint::black_box;
use std::sync::Arc;
use std::time::Instant;

use kvsan_engine::hooks::Hooks;
use kvsan_engine::kv_access::{AttentionCheck, KvAccess, Logits, SeqChunk, StepBatch};
use kvsan_engine::kv_pool::KvPool;
use kvsan_kernels::attention::KvGeometry;
use kvsan_sanitizer::{NodeRole, Options, Owner, PageRef, PoolGeometry, PoolId, Sanitizer};
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

/// Min, median and max of a set of ratios, the 95 % confidence interval of
/// the median, and the values themselves.
#[derive(Clone, Debug, Serialize)]
pub struct Spread {
    /// Smallest.
    pub min: f64,
    /// Median.
    pub median: f64,
    /// Largest.
    pub max: f64,
    /// The median's 95 % confidence interval `[low, high]`: the 2.5th and
    /// 97.5th percentiles of the medians of [`BOOTSTRAP_RESAMPLES`]
    /// resamples of the values (percentile bootstrap, a fixed seed, so the
    /// same values give the same interval). One value gives `[v, v]`: no
    /// interval can be claimed from it.
    pub ci95: [f64; 2],
    /// Every value, in round order.
    pub values: Vec<f64>,
}

/// Resamples behind [`Spread::ci95`].
pub const BOOTSTRAP_RESAMPLES: usize = 4000;

impl Spread {
    /// The spread of `values` (all zero when empty).
    pub fn of(values: Vec<f64>) -> Spread {
        let singles: Vec<Vec<f64>> = values.into_iter().map(|v| vec![v]).collect();
        Spread::of_clusters(&singles)
    }

    /// The spread of values measured in clusters (the servings of one
    /// process): the median of them all, and an interval that resamples the
    /// clusters and then the values within each chosen one (a two-level
    /// bootstrap), so that what clusters share is not counted as agreement.
    /// `values` lists them cluster by cluster.
    pub fn of_clusters(clusters: &[Vec<f64>]) -> Spread {
        let values: Vec<f64> = clusters.iter().flatten().copied().collect();
        let mut sorted = values.clone();
        sorted.sort_by(f64::total_cmp);
        Spread {
            min: sorted.first().copied().unwrap_or(0.0),
            median: median(&sorted),
            max: sorted.last().copied().unwrap_or(0.0),
            ci95: clustered_median_ci95(clusters),
            values,
        }
    }

    /// Half the interval's width relative to the median (0.01: ±1 %).
    pub fn ci95_half_width(&self) -> f64 {
        if self.median == 0.0 {
            return f64::INFINITY;
        }
        (self.ci95[1] - self.ci95[0]) / 2.0 / self.median.abs()
    }
}

/// The 95 % interval of the median of the values of `clusters`: each
/// resample draws as many clusters as there are, with replacement, and from
/// each drawn cluster as many of its values, with replacement. Clusters of
/// one value make it the ordinary percentile bootstrap.
fn clustered_median_ci95(clusters: &[Vec<f64>]) -> [f64; 2] {
    use rand::{RngExt, SeedableRng};
    let clusters: Vec<&Vec<f64>> = clusters.iter().filter(|c| !c.is_empty()).collect();
    match clusters.as_slice() {
        [] => return [0.0; 2],
        [c] if c.len() == 1 => return [c[0]; 2],
        _ => {}
    }
    let mut rng = rand_chacha::ChaCha8Rng::seed_from_u64(0x6b76_7361_6e00_0095);
    let mut sample = Vec::new();
    let mut medians: Vec<f64> = (0..BOOTSTRAP_RESAMPLES)
        .map(|_| {
            sample.clear();
            for _ in 0..clusters.len() {
                let c = clusters[rng.random_range(0..clusters.len())];
                if let [v] = c.as_slice() {
                    sample.push(*v);
                } else {
                    for _ in 0..c.len() {
                        sample.push(c[rng.random_range(0..c.len())]);
                    }
                }
            }
            sample.sort_by(f64::total_cmp);
            median(&sample)
        })
        .collect();
    medians.sort_by(f64::total_cmp);
    let at = |q: f64| medians[((medians.len() - 1) as f64 * q).round() as usize];
    [at(0.025), at(0.975)]
}

/// Median of sorted `values` (mean of the middle two for an even count; 0 when empty).
pub fn median(sorted: &[f64]) -> f64 {
    match sorted.len() {
        0 => 0.0,
        n if n % 2 == 1 => sorted[n / 2],
        n => (sorted[n / 2 - 1] + sorted[n / 2]) / 2.0,
    }
}

/// A batch of `seqs` sequences of `seq_len` tokens, the last `new` of each
/// computed in this step (1: a decode row; more: a prefill chunk), over a
/// pool of their pages, owned and fully written in a sanitizer's shadow:
/// what the checked kernel reads legally, every page checked.
pub struct DecodeBench {
    /// The pool.
    pub pool: KvPool,
    /// The batch (one row per sequence).
    pub batch: StepBatch,
    /// The sanitizer shadowing the pool.
    pub sanitizer: Arc<Sanitizer>,
    /// Its id for the pool.
    pub pool_id: PoolId,
    /// One query per token computed.
    pub q: Vec<f32>,
    /// Query heads.
    pub n_heads: usize,
}

impl DecodeBench {
    /// The batch for `seqs × seq_len` with SmolLM2's attention shape,
    /// `new` queries per sequence.
    ///
    /// # Panics
    /// If the pool cannot be built (a size no machine refuses here), or
    /// `new` is 0 or over `seq_len`.
    #[must_use]
    pub fn new(seqs: usize, seq_len: usize, new: usize) -> DecodeBench {
        assert!((1..=seq_len).contains(&new), "1..={seq_len} new tokens");
        let geom = KvGeometry {
            page_slots: 16,
            n_layers: 1,
            n_kv_heads: 3,
            head_dim: 64,
        };
        let per_seq = seq_len.div_ceil(geom.page_slots);
        let n_pages = seqs * per_seq;
        let mut pool = KvPool::new(geom, n_pages).expect("benchmark pool");
        for (i, v) in pool.data_mut().iter_mut().enumerate() {
            *v = half::f16::from_f32(((i * 7) % 13) as f32 / 13.0 - 0.5);
        }
        let sanitizer = Arc::new(Sanitizer::with_writer(Options::default(), std::io::sink()));
        let pool_id = sanitizer
            .pool_register(PoolGeometry {
                pages: n_pages as u32,
                page_slots: geom.page_slots as u32,
                layers: 1,
                bytes_per_slot: (geom.slot_width() * 4) as u64,
                role: NodeRole::Decode,
                node: "bench".into(),
            })
            .expect("register");
        let mut tables: Vec<Vec<PageRef>> = Vec::with_capacity(seqs);
        for s in 0..seqs {
            // Owners as StepBatch::of_chunks numbers them.
            let owner = Owner::new(s as u64 + 1, 0);
            let mut table = Vec::with_capacity(per_seq);
            for _ in 0..per_seq {
                let page = pool.alloc().expect("a page per slot of the pool");
                let (_, g) = sanitizer
                    .alloc(pool_id, page.page, owner, 0)
                    .expect("alloc");
                assert_eq!(g, page.generation);
                let _ = sanitizer.write(pool_id, owner, page, 0..16, 0..1, 0);
                table.push(page);
            }
            tables.push(table);
        }
        let tokens = vec![0u32; new];
        let chunks: Vec<SeqChunk<'_>> = tables
            .iter()
            .map(|t| SeqChunk {
                tokens: &tokens,
                start_pos: seq_len - new,
                block_table: t,
                logits: Logits::None,
            })
            .collect();
        let batch = StepBatch::of_chunks(&chunks, geom.page_slots).expect("a covered batch");
        let n_heads = N_HEADS;
        let q = (0..seqs * new * n_heads * geom.head_dim)
            .map(|i| ((i * 5) % 11) as f32 / 11.0 - 0.5)
            .collect();
        DecodeBench {
            pool,
            batch,
            sanitizer,
            pool_id,
            q,
            n_heads,
        }
    }

    /// One batched attention call, checked against the shadow or not;
    /// returns how many rows the kernels stopped (0 here).
    pub fn attend(&mut self, checked: bool, hooks: &Hooks, out: &mut [f32]) -> usize {
        let shadow = if checked {
            Some(self.sanitizer.kernel_shadow(self.pool_id).expect("shadow"))
        } else {
            None
        };
        let scale = 1.0 / 8.0;
        let kv = KvAccess::new(
            &mut self.pool,
            &self.batch,
            AttentionCheck::Unchecked,
            shadow,
            hooks,
            self.pool_id,
            1,
        );
        kv.attend(0, self.n_heads, scale, &self.q, out);
        kv.finish().len()
    }
}

/// Times both kernels for `rounds` rounds of `calls` calls each,
/// alternating unchecked and checked, on the shape of the module doc.
///
/// # Panics
/// If the checked kernel refuses a legal read (it must not).
pub fn measure(rounds: usize, calls: usize) -> KernelCheck {
    measure_shape(SEQS, SEQ_LEN, 1, rounds, calls)
}

/// [`measure`] on a batch of `seqs` sequences of `seq_len` tokens, the
/// last `new` of each computed (1: decode; more: a prefill chunk).
///
/// # Panics
/// If the checked kernel refuses a legal read (it must not).
pub fn measure_shape(
    seqs: usize,
    seq_len: usize,
    new: usize,
    rounds: usize,
    calls: usize,
) -> KernelCheck {
    let mut bench = DecodeBench::new(seqs, seq_len, new);
    let hooks = Hooks::sanitizer(bench.sanitizer.clone());
    let none = Hooks::none();
    let mut out = vec![0.0f32; bench.q.len()];
    let mut unchecked = Vec::with_capacity(rounds);
    let mut checked = Vec::with_capacity(rounds);
    // One untimed call of each first: page faults and thread start-up.
    for _ in 0..=rounds {
        let t = Instant::now();
        for _ in 0..calls {
            black_box(bench.attend(false, &none, &mut out));
            black_box(&out);
        }
        let u = t.elapsed().as_secs_f64() / calls as f64;
        let t = Instant::now();
        for _ in 0..calls {
            let refused = bench.attend(true, &hooks, &mut out);
            assert_eq!(refused, 0, "a legal read was refused");
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
            "{}, {seqs} sequences x {seq_len} tokens, {N_HEADS} heads over 3 KV heads of 64, 16-slot pages, one layer, checked against the kernel shadow",
            if new == 1 {
                "decode attention".to_owned()
            } else {
                format!("prefill attention of {new} tokens per sequence")
            }
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
    fn the_medians_interval_narrows_with_agreeing_rounds_and_is_repeatable() {
        let one = Spread::of(vec![1.02]);
        assert_eq!(one.ci95, [1.02, 1.02], "one round: no interval to claim");
        let wide = Spread::of(vec![0.90, 1.15, 0.97, 1.10, 1.01, 0.93, 1.08]);
        let [lo, hi] = wide.ci95;
        assert!(lo <= wide.median && wide.median <= hi, "{wide:?}");
        assert!(lo >= wide.min && hi <= wide.max, "{wide:?}");
        assert!(wide.ci95_half_width() > 0.01, "{wide:?}");
        let tight: Vec<f64> = (0..21).map(|i| 1.003 + f64::from(i % 3) * 0.001).collect();
        let tight = Spread::of(tight);
        assert!(tight.ci95_half_width() <= 0.01, "{tight:?}");
        // A fixed seed: the same values give the same interval.
        let again = Spread::of(vec![0.90, 1.15, 0.97, 1.10, 1.01, 0.93, 1.08]);
        assert_eq!(again.ci95, wide.ci95);
    }

    #[test]
    fn clustered_values_count_their_clusters_disagreement() {
        // Two processes that each agree with themselves but not with each
        // other: pooled as independent values the interval would be
        // narrow; resampling the processes keeps it as wide as they differ.
        let a: Vec<f64> = (0..20).map(|i| 0.95 + f64::from(i % 2) * 0.001).collect();
        let b: Vec<f64> = (0..20).map(|i| 1.05 + f64::from(i % 2) * 0.001).collect();
        let clustered = Spread::of_clusters(&[a.clone(), b.clone()]);
        let pooled = Spread::of([a.clone(), b].concat());
        assert_eq!(clustered.values, pooled.values);
        assert_eq!(clustered.median, pooled.median);
        assert!(
            clustered.ci95[0] < 0.96 && clustered.ci95[1] > 1.04,
            "{clustered:?}"
        );
        // One cluster: its values are all there is to resample.
        let one = Spread::of_clusters(&[a]);
        assert!(one.ci95_half_width() < 0.001, "{one:?}");
        // Clusters of one value: the ordinary bootstrap, the same interval.
        let values = vec![0.90, 1.15, 0.97, 1.10, 1.01, 0.93, 1.08];
        let singles: Vec<Vec<f64>> = values.iter().map(|v| vec![*v]).collect();
        assert_eq!(Spread::of_clusters(&singles).ci95, Spread::of(values).ci95);
    }

    #[test]
    fn kernel_check_reports_one_ratio_per_round() {
        let k = measure(2, 1);
        assert_eq!((k.rounds, k.calls), (2, 1));
        assert_eq!(k.ratio.values.len(), 2);
        assert!(k.ratio.min <= k.ratio.median && k.ratio.median <= k.ratio.max);
    }
}
