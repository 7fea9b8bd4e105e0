//! The attention inner loop: rows of queries (query heads sharing one KV
//! head) over a span of keys, one block of keys at a time, with an online
//! softmax (each row keeps its running maximum, sum and unnormalised
//! output, rescaled when a block raises the maximum).
//!
//! ```text
//!  keys t0 ──────────────────────────────────────────────▶ t1
//!        │ block │ block │ block │ …    blocks of 16 keys, at multiples of 16
//!  per block: K and V of its keys converted from f16 once (into f32 rows),
//!  then for each row r that sees any of them (position < lens[r]):
//!     s_j  = scale · q_r·k_j                    (lane sums, then a fixed tree)
//!     m'   = max(m_r, s_j)   α = e^(m_r − m')   p_j = e^(s_j − m')
//!     l_r  = α·l_r + Σ p_j   acc_r = α·acc_r + Σ_j p_j·v_j   m_r = m'
//! ```
//!
//! A row's arithmetic depends only on its own query, its length and the
//! keys, never on the other rows of the call: a query's output is the same
//! bits alone and in any tile or batch. Many rows (a prefill tile) score
//! from the block's keys transposed, a row's sixteen scores built lane by
//! lane; few rows (a decode row's heads) take each key's lanes and fold
//! sixteen keys at once — the same products and sums in the same order, so
//! the same bits. The loop is written once (a macro) over a module of
//! 16-lane operations and compiled three times: AVX-512 intrinsics, AVX2 +
//! FMA intrinsics on two 8-lane registers, and plain arrays (portable);
//! the exponential is a polynomial in those lanes.

use half::f16;
use kvsan_ids::PageId;

use crate::isa::Isa;

/// Lanes of the per-row vectors (one AVX-512 register of f32).
const LANES: usize = 16;
/// Keys per block of the online softmax.
const KEY_BLOCK: usize = 16;

type Lanes = [f32; LANES];

/// The K and V one task reads: every KV head of one layer, position `t`
/// in `pages[(t - base) / page_slots]` (the pool layout of
/// [`crate::attention`]).
#[derive(Clone, Copy)]
pub(crate) struct Keys<'a> {
    pub pool: &'a [f16],
    pub pages: &'a [PageId],
    /// Position of the first slot of `pages[0]`.
    pub base: usize,
    /// f16 values per page.
    pub page_elems: usize,
    pub page_slots: usize,
    pub n_kv_heads: usize,
    pub head_dim: usize,
    /// Where in a page the layer's K of slot 0 begins.
    pub layer_at: usize,
}

impl<'a> Keys<'a> {
    /// The K and V slot rows (every KV head, `n_kv_heads × head_dim`
    /// values, contiguous) of positions `t..t + n`, in order: one division
    /// for the run, not one per key.
    #[inline(always)]
    fn run(&self, t: usize, n: usize) -> impl Iterator<Item = (&'a [f16], &'a [f16])> + use<'a> {
        let (ps, w) = (self.page_slots, self.n_kv_heads * self.head_dim);
        let (pool, pages, pe, at) = (self.pool, self.pages, self.page_elems, self.layer_at);
        let (mut entry, mut slot) = ((t - self.base) / ps, t % ps);
        (0..n).map(move |_| {
            let k = pages[entry].0 as usize * pe + at + slot * w;
            let v = k + ps * w;
            slot += 1;
            if slot == ps {
                slot = 0;
                entry += 1;
            }
            (&pool[k..k + w], &pool[v..v + w])
        })
    }
}

/// Running state of `rows` rows: maximum, sum of exponentials and the
/// unnormalised weighted sum of V (padded to whole lanes).
pub(crate) struct RowState {
    pub max: Vec<f32>,
    pub sum: Vec<f32>,
    pub acc: Vec<f32>,
    /// Values per row of `acc` (the head dimension rounded up to lanes).
    pub stride: usize,
}

impl RowState {
    pub fn new(rows: usize, head_dim: usize) -> RowState {
        let stride = head_dim.div_ceil(LANES) * LANES;
        RowState {
            max: vec![f32::NEG_INFINITY; rows],
            sum: vec![0.0; rows],
            acc: vec![0.0; rows * stride],
            stride,
        }
    }

    /// Back to no key seen.
    pub fn reset(&mut self) {
        self.max.fill(f32::NEG_INFINITY);
        self.sum.fill(0.0);
        self.acc.fill(0.0);
    }

    /// Row `r`'s unnormalised output (`head_dim` values).
    pub fn acc_row(&self, r: usize, head_dim: usize) -> &[f32] {
        &self.acc[r * self.stride..r * self.stride + head_dim]
    }

    /// Row `r`'s attention output, `acc / sum`, into `out` (`head_dim`
    /// values); zero for a row that saw no key.
    pub fn write_out(&self, r: usize, out: &mut [f32]) {
        let acc = self.acc_row(r, out.len());
        if self.sum[r] > 0.0 {
            let inv = 1.0 / self.sum[r];
            for (o, &a) in out.iter_mut().zip(acc) {
                *o = a * inv;
            }
        } else {
            out.fill(0.0);
        }
    }
}

/// Attention of `lens.len()` rows (`q`: rows × `head_dim`, each rounded to
/// f16 first as llama.cpp does for an f16 cache) over keys `t0..t1`; row
/// `r` reads KV head `heads[r]` and sees the keys before `lens[r]`. Folds
/// the keys into `state`. Each block's K and V are read once for every
/// head, whole slot rows in pool order.
#[allow(clippy::too_many_arguments)]
pub(crate) fn attend_rows(
    isa: Isa,
    keys: &Keys<'_>,
    t0: usize,
    t1: usize,
    scale: f32,
    q: &[f32],
    heads: &[usize],
    lens: &[usize],
    state: &mut RowState,
) {
    Rows::new(keys, q, heads, lens).fold(isa, keys, t0, t1, scale, state);
}

/// Query rows made ready to fold keys into a [`RowState`], as many times
/// as needed (a long row's segments): the queries rounded to f16 once,
/// the block buffers allocated once.
pub(crate) struct Rows<'a> {
    heads: &'a [usize],
    lens: &'a [usize],
    /// rows × stride, f16-rounded, zero-padded.
    q: Vec<f32>,
    /// Three blocks of keys per KV head (K, V, K transposed).
    kv: Vec<f32>,
}

impl<'a> Rows<'a> {
    /// `q`: `lens.len()` rows of the keys' head dimension; row `r` reads KV
    /// head `heads[r]` and sees the keys before `lens[r]`.
    pub fn new(keys: &Keys<'_>, q: &[f32], heads: &'a [usize], lens: &'a [usize]) -> Rows<'a> {
        let hd = keys.head_dim;
        let nkv = keys.n_kv_heads;
        let stride = hd.div_ceil(LANES) * LANES;
        let rows = lens.len();
        assert_eq!(q.len(), rows * hd, "{rows} query rows of {hd}");
        assert_eq!(heads.len(), rows, "a KV head per row");
        assert!(heads.iter().all(|&h| h < nkv), "KV heads below {nkv}");
        let mut qp = vec![0.0f32; rows * stride];
        for (d, s) in qp.chunks_exact_mut(stride).zip(q.chunks_exact(hd)) {
            for (d, &s) in d.iter_mut().zip(s) {
                *d = f16::from_f32(s).to_f32();
            }
        }
        Rows {
            heads,
            lens,
            q: qp,
            kv: vec![0.0f32; 3 * nkv * KEY_BLOCK * stride],
        }
    }

    /// Folds keys `t0..t1` (of the geometry `new` was given) into `state`.
    pub fn fold(
        &mut self,
        isa: Isa,
        keys: &Keys<'_>,
        t0: usize,
        t1: usize,
        scale: f32,
        state: &mut RowState,
    ) {
        let rows = self.lens.len();
        assert_eq!(state.max.len(), rows, "state of {rows} rows");
        assert_eq!(
            self.q.len(),
            rows * state.stride,
            "rows of the state's stride"
        );
        assert!(
            self.kv.len() >= 3 * keys.n_kv_heads * KEY_BLOCK * state.stride,
            "block buffers for {} KV heads",
            keys.n_kv_heads
        );
        let args = Args {
            keys,
            t0,
            t1,
            scale,
            q: &self.q,
            heads: self.heads,
            lens: self.lens,
        };
        let kv = &mut self.kv;
        match isa {
            #[cfg(target_arch = "x86_64")]
            Isa::Avx512 => {
                // SAFETY: `isa` is available (callers pass `or_portable()`):
                // AVX-512 F/BW/VL/DQ, AVX2, FMA and F16C are present; the
                // buffers are sized as `blocks_avx512` needs (asserted).
                unsafe { blocks_avx512(&args, state, kv) }
            }
            #[cfg(target_arch = "x86_64")]
            Isa::Avx2 | Isa::Avx2Vnni => {
                // SAFETY: as above, AVX2, FMA and F16C are present.
                unsafe { blocks_avx2(&args, state, kv) }
            }
            // SAFETY: the portable lanes need no CPU feature; buffers as above.
            _ => unsafe { blocks_portable(&args, state, kv) },
        }
    }
}

struct Args<'a, 'k> {
    keys: &'a Keys<'k>,
    t0: usize,
    t1: usize,
    scale: f32,
    /// rows × stride, f16-rounded, zero-padded.
    q: &'a [f32],
    heads: &'a [usize],
    lens: &'a [usize],
}

/// Defines the block loop of the module doc on the lane operations of
/// module `$l`, with the attributes given (the target features of `$l`);
/// `$transposed`: whether many rows score from transposed keys (where
/// sixteen lane vectors fit in registers).
macro_rules! block_loop {
    ($(#[$attr:meta])* $name:ident, $l:ident, $transposed:literal) => {
        $(#[$attr])*
        /// # Safety
        /// The CPU has the features of the lanes' module; `state` holds
        /// `args.lens.len()` rows of a stride that is a whole number of
        /// lanes, `args.q` as many rows of that stride, and `kv` three
        /// blocks of keys of it.
        unsafe fn $name(args: &Args<'_, '_>, state: &mut RowState, kv: &mut [f32]) {
            let stride = state.stride;
            let chunks = stride / LANES;
            let hd = args.keys.head_dim;
            let whole = hd / LANES * LANES;
            let nkv = args.keys.n_kv_heads;
            // Per KV head h: its block of K rows at kf + h·block, of V
            // rows at vf + h·block, its K transposed at kt + h·block.
            let block = KEY_BLOCK * stride;
            let (kf, rest) = kv.split_at_mut(nkv * block);
            let (vf, kt) = rest.split_at_mut(nkv * block);
            let (kf, vf, kt) = (kf.as_mut_ptr(), vf.as_mut_ptr(), kt.as_mut_ptr());
            // Many rows score from the block's keys transposed (lane j =
            // key j), the transposition paid once for all of them: the
            // same sums in the same order.
            // The KV heads the rows read (all of them, or one).
            let used = args.heads.iter().copied().min().unwrap_or(0)
                ..args.heads.iter().copied().max().map_or(0, |h| h + 1);
            let transposed = $transposed && args.lens.len() >= TRANSPOSED_ROWS * used.len();
            let mut b0 = args.t0;
            while b0 < args.t1 {
                let b1 = ((b0 / KEY_BLOCK + 1) * KEY_BLOCK).min(args.t1);
                let n = b1 - b0;
                // Convert only the keys some row sees.
                let seen = args
                    .lens
                    .iter()
                    .map(|&len| len.saturating_sub(b0).min(n))
                    .max()
                    .unwrap_or(0);
                for (j, (k, v)) in args.keys.run(b0, seen).enumerate() {
                    for (src, to) in [(k, kf), (v, vf)] {
                        for h in used.clone() {
                            let src = &src[h * hd..(h + 1) * hd];
                            // SAFETY: row j of head h's block holds
                            // `stride` ≥ hd values; `src` holds hd.
                            unsafe {
                                let to = to.add(h * block + j * stride);
                                for c in (0..whole).step_by(LANES) {
                                    $l::cvt(src.as_ptr().add(c), to.add(c));
                                }
                                for c in whole..hd {
                                    *to.add(c) = src[c].to_f32();
                                }
                            }
                        }
                    }
                }
                if transposed {
                    for h in used.clone() {
                        for j in 0..seen {
                            for d in 0..stride {
                                // SAFETY: j < 16 and d < stride in head h's
                                // blocks.
                                unsafe {
                                    *kt.add(h * block + d * LANES + j) =
                                        *kf.add(h * block + j * stride + d);
                                }
                            }
                        }
                    }
                }
                for (r, &len) in args.lens.iter().enumerate() {
                    let vis = len.saturating_sub(b0).min(n);
                    if vis == 0 {
                        continue;
                    }
                    let h = args.heads[r] * block;
                    // SAFETY: head h's blocks lie inside the buffers.
                    let (kf, vf, kt) = unsafe { (kf.add(h), vf.add(h), kt.add(h)) };
                    // SAFETY: row r of q and of acc, rows j < vis of the
                    // head's block buffers (and its transposed block):
                    // each `chunks` lanes long.
                    unsafe {
                        let q = args.q.as_ptr().add(r * stride);
                        let mut s: Lanes = [0.0; LANES];
                        let sums = if transposed {
                            // Lane l of chunk c's sum for every key at
                            // once, then the lanes folded as `hsum` does.
                            let mut p = [$l::zero(); LANES];
                            for c in 0..chunks {
                                for (l, p) in p.iter_mut().enumerate() {
                                    let d = c * LANES + l;
                                    *p = $l::fma($l::splat(*q.add(d)), $l::load(kt.add(d * LANES)), *p);
                                }
                            }
                            for l in 0..8 {
                                p[l] = $l::add(p[l], p[l + 8]);
                            }
                            for l in 0..4 {
                                p[l] = $l::add(p[l], p[l + 4]);
                            }
                            $l::add($l::add(p[0], p[2]), $l::add(p[1], p[3]))
                        } else {
                            // Each key's lanes summed over the chunks, then
                            // the sixteen keys' lanes folded at once.
                            let mut p = [$l::zero(); KEY_BLOCK];
                            for (j, p) in p.iter_mut().enumerate() {
                                let k = kf.add(j * stride);
                                for c in 0..chunks {
                                    *p = $l::fma($l::load(q.add(c * LANES)), $l::load(k.add(c * LANES)), *p);
                                }
                            }
                            $l::hsum16(&p)
                        };
                        $l::store(s.as_mut_ptr(), $l::mul(sums, $l::splat(args.scale)));
                        s[vis..].fill(f32::NEG_INFINITY);
                        let old = state.max[r];
                        let max = old.max($l::hmax($l::load(s.as_ptr())));
                        let mut p: Lanes = [0.0; LANES];
                        let e = $l::exp($l::sub($l::load(s.as_ptr()), $l::splat(max)));
                        $l::store(p.as_mut_ptr(), e);
                        let alpha = if old == max {
                            1.0
                        } else {
                            let mut a: Lanes = [0.0; LANES];
                            $l::store(a.as_mut_ptr(), $l::exp($l::splat(old - max)));
                            a[0]
                        };
                        state.sum[r] = state.sum[r].mul_add(alpha, $l::hsum(e));
                        state.max[r] = max;
                        let acc = state.acc.as_mut_ptr().add(r * stride);
                        // Four lanes of the row's output held while the
                        // block's values are added in, key by key.
                        let mut c = 0;
                        while c + 4 <= chunks {
                            let at = |i: usize| acc.add((c + i) * LANES);
                            let mut a = [$l::load(at(0)), $l::load(at(1)), $l::load(at(2)), $l::load(at(3))];
                            if alpha != 1.0 {
                                for a in &mut a {
                                    *a = $l::mul(*a, $l::splat(alpha));
                                }
                            }
                            for (j, &pj) in p.iter().enumerate().take(vis) {
                                let pj = $l::splat(pj);
                                let v = vf.add(j * stride + c * LANES);
                                for (i, a) in a.iter_mut().enumerate() {
                                    *a = $l::fma(pj, $l::load(v.add(i * LANES)), *a);
                                }
                            }
                            for (i, a) in a.into_iter().enumerate() {
                                $l::store(at(i), a);
                            }
                            c += 4;
                        }
                        for c in c..chunks {
                            let mut a = $l::load(acc.add(c * LANES));
                            if alpha != 1.0 {
                                a = $l::mul(a, $l::splat(alpha));
                            }
                            for (j, &pj) in p.iter().enumerate().take(vis) {
                                a = $l::fma($l::splat(pj), $l::load(vf.add(j * stride + c * LANES)), a);
                            }
                            $l::store(acc.add(c * LANES), a);
                        }
                    }
                }
                b0 = b1;
            }
        }
    };
}

/// Rows from which [`block_loop`] scores from transposed keys (where the
/// lanes' registers hold sixteen accumulators).
const TRANSPOSED_ROWS: usize = 4;

block_loop!(
    /// The block loop on [`portable`] lanes.
    blocks_portable,
    portable,
    false
);
#[cfg(target_arch = "x86_64")]
block_loop!(
    /// The block loop on [`avx512`] lanes.
    #[target_feature(enable = "avx512f,avx512bw,avx512vl,avx512dq,avx2,fma,f16c")]
    blocks_avx512,
    avx512,
    true
);
#[cfg(target_arch = "x86_64")]
block_loop!(
    /// The block loop on [`avx2`] lanes.
    #[target_feature(enable = "avx2,fma,f16c")]
    blocks_avx2,
    avx2,
    false
);

/// e^x on lanes of `$l` (Cephes' single-precision polynomial, within
/// 2 ulp for x in [-87, 88]); 0 below -87, as e^-inf.
macro_rules! lane_exp {
    ($v:ty $(, $attr:meta)?) => {
        #[inline]
        $(#[$attr])?
        pub(super) unsafe fn exp(x: $v) -> $v {
            // SAFETY: the caller has the lanes' features.
            unsafe {
                let xc = max(min(x, splat(88.0)), splat(-87.0));
                let k = fma(xc, splat(std::f32::consts::LOG2_E), splat(ROUND));
                let n = sub(k, splat(ROUND));
                let r = fma(n, splat(-LN2_HI), xc);
                let r = fma(n, splat(-LN2_LO), r);
                let mut p = splat(1.987_569_1e-4);
                p = fma(p, r, splat(1.398_199_9e-3));
                p = fma(p, r, splat(8.333_452e-3));
                p = fma(p, r, splat(4.166_579_6e-2));
                p = fma(p, r, splat(0.166_666_65));
                p = fma(p, r, splat(0.5));
                let y = add(fma(p, mul(r, r), r), splat(1.0));
                zero_below(x, -87.0, mul(y, pow2(k)))
            }
        }
    };
}

/// 1.5 · 2^23: adding it rounds to an integer, whose bits are then the
/// low bits of the sum.
const ROUND: f32 = 12_582_912.0;
const LN2_HI: f32 = 0.693_359_4;
const LN2_LO: f32 = -2.121_944_4e-4;

/// Lanes as a plain array: any CPU.
mod portable {
    use super::{LANES, LN2_HI, LN2_LO, Lanes, ROUND};
    use half::f16;

    macro_rules! each {
        (|$x:ident| $e:expr) => {{
            let mut o: Lanes = [0.0; LANES];
            for (i, o) in o.iter_mut().enumerate() {
                let $x = i;
                *o = $e;
            }
            o
        }};
    }

    #[inline]
    pub(super) unsafe fn zero() -> Lanes {
        [0.0; LANES]
    }
    #[inline]
    pub(super) unsafe fn splat(v: f32) -> Lanes {
        [v; LANES]
    }
    #[inline]
    pub(super) unsafe fn load(p: *const f32) -> Lanes {
        // SAFETY: the caller guarantees 16 readable values.
        unsafe { p.cast::<Lanes>().read_unaligned() }
    }
    #[inline]
    pub(super) unsafe fn store(p: *mut f32, v: Lanes) {
        // SAFETY: the caller guarantees 16 writable values.
        unsafe { p.cast::<Lanes>().write_unaligned(v) }
    }
    #[inline]
    pub(super) unsafe fn cvt(src: *const f16, dst: *mut f32) {
        for i in 0..LANES {
            // SAFETY: the caller guarantees 16 values at each.
            unsafe { *dst.add(i) = (*src.add(i)).to_f32() };
        }
    }
    #[inline]
    pub(super) unsafe fn fma(a: Lanes, b: Lanes, c: Lanes) -> Lanes {
        each!(|i| a[i].mul_add(b[i], c[i]))
    }
    #[inline]
    pub(super) unsafe fn add(a: Lanes, b: Lanes) -> Lanes {
        each!(|i| a[i] + b[i])
    }
    #[inline]
    pub(super) unsafe fn sub(a: Lanes, b: Lanes) -> Lanes {
        each!(|i| a[i] - b[i])
    }
    #[inline]
    pub(super) unsafe fn mul(a: Lanes, b: Lanes) -> Lanes {
        each!(|i| a[i] * b[i])
    }
    #[inline]
    pub(super) unsafe fn max(a: Lanes, b: Lanes) -> Lanes {
        each!(|i| a[i].max(b[i]))
    }
    #[inline]
    pub(super) unsafe fn min(a: Lanes, b: Lanes) -> Lanes {
        each!(|i| a[i].min(b[i]))
    }
    /// 2^n per lane, n the integer in `k`'s low bits (k = ROUND + n).
    #[inline]
    pub(super) unsafe fn pow2(k: Lanes) -> Lanes {
        each!(|i| f32::from_bits(
            k[i].to_bits()
                .wrapping_sub(ROUND.to_bits())
                .wrapping_add(127)
                << 23
        ))
    }
    #[inline]
    pub(super) unsafe fn zero_below(x: Lanes, bound: f32, v: Lanes) -> Lanes {
        each!(|i| if x[i] < bound { 0.0 } else { v[i] })
    }
    /// Lane j: `hsum(p[j])`.
    #[inline]
    pub(super) unsafe fn hsum16(p: &[Lanes; 16]) -> Lanes {
        // SAFETY: no feature needed.
        std::array::from_fn(|j| unsafe { hsum(p[j]) })
    }
    #[inline]
    pub(super) unsafe fn hmax(v: Lanes) -> f32 {
        v.iter().fold(f32::NEG_INFINITY, |m, &x| m.max(x))
    }
    /// Σ of the lanes: halves added (8 + 8, 4 + 4), then (0 + 2) + (1 + 3).
    #[inline]
    pub(super) unsafe fn hsum(v: Lanes) -> f32 {
        let h: [f32; 8] = std::array::from_fn(|i| v[i] + v[i + 8]);
        let q: [f32; 4] = std::array::from_fn(|i| h[i] + h[i + 4]);
        (q[0] + q[2]) + (q[1] + q[3])
    }
    lane_exp!(Lanes);
}

/// Lanes as one AVX-512 register.
#[cfg(target_arch = "x86_64")]
mod avx512 {
    use super::{LN2_HI, LN2_LO, ROUND};
    use half::f16;
    use std::arch::x86_64::*;

    type V = __m512;

    macro_rules! lanewise {
        ($($name:ident($($a:ident),*) => $f:ident;)*) => {$(
            #[inline]
            #[target_feature(enable = "avx512f,avx512dq,avx2,fma,f16c")]
            pub(super) unsafe fn $name($($a: V),*) -> V {
                $f($($a),*)
            }
        )*};
    }

    lanewise! {
        fma(a, b, c) => _mm512_fmadd_ps;
        add(a, b) => _mm512_add_ps;
        sub(a, b) => _mm512_sub_ps;
        mul(a, b) => _mm512_mul_ps;
        max(a, b) => _mm512_max_ps;
        min(a, b) => _mm512_min_ps;
    }

    #[inline]
    #[target_feature(enable = "avx512f,avx512dq,avx2,fma,f16c")]
    pub(super) unsafe fn zero() -> V {
        _mm512_setzero_ps()
    }
    #[inline]
    #[target_feature(enable = "avx512f,avx512dq,avx2,fma,f16c")]
    pub(super) unsafe fn splat(v: f32) -> V {
        _mm512_set1_ps(v)
    }
    #[inline]
    #[target_feature(enable = "avx512f,avx512dq,avx2,fma,f16c")]
    pub(super) unsafe fn load(p: *const f32) -> V {
        // SAFETY: the caller guarantees 16 readable values.
        unsafe { _mm512_loadu_ps(p) }
    }
    #[inline]
    #[target_feature(enable = "avx512f,avx512dq,avx2,fma,f16c")]
    pub(super) unsafe fn store(p: *mut f32, v: V) {
        // SAFETY: the caller guarantees 16 writable values.
        unsafe { _mm512_storeu_ps(p, v) }
    }
    #[inline]
    #[target_feature(enable = "avx512f,avx512dq,avx2,fma,f16c")]
    pub(super) unsafe fn cvt(src: *const f16, dst: *mut f32) {
        // SAFETY: the caller guarantees 16 values at each.
        unsafe { _mm512_storeu_ps(dst, _mm512_cvtph_ps(_mm256_loadu_si256(src.cast()))) }
    }
    #[inline]
    #[target_feature(enable = "avx512f,avx512dq,avx2,fma,f16c")]
    pub(super) unsafe fn pow2(k: V) -> V {
        let n = _mm512_sub_epi32(
            _mm512_castps_si512(k),
            _mm512_set1_epi32(ROUND.to_bits() as i32),
        );
        _mm512_castsi512_ps(_mm512_slli_epi32::<23>(_mm512_add_epi32(
            n,
            _mm512_set1_epi32(127),
        )))
    }
    #[inline]
    #[target_feature(enable = "avx512f,avx512dq,avx2,fma,f16c")]
    pub(super) unsafe fn zero_below(x: V, bound: f32, v: V) -> V {
        let keep = _mm512_cmp_ps_mask::<_CMP_GE_OQ>(x, _mm512_set1_ps(bound));
        _mm512_maskz_mov_ps(keep, v)
    }
    /// Lane j: `hsum(p[j])`, the sixteen folds done together, each in
    /// `hsum`'s order: halves (8 + 8), quarters (4 + 4), then
    /// (0 + 2) + (1 + 3).
    #[inline]
    #[target_feature(enable = "avx512f,avx512dq,avx2,fma,f16c")]
    pub(super) unsafe fn hsum16(p: &[V; 16]) -> V {
        // Keys 2i, 2i+1: [their 8 half sums].
        let h: [V; 8] = std::array::from_fn(|i| {
            let (a, b) = (p[2 * i], p[2 * i + 1]);
            _mm512_add_ps(
                _mm512_shuffle_f32x4::<0x44>(a, b),
                _mm512_shuffle_f32x4::<0xEE>(a, b),
            )
        });
        // Keys 4m..4m+4, a 128-bit lane each: its 4 quarter sums.
        let q: [V; 4] = std::array::from_fn(|m| {
            let (a, b) = (h[2 * m], h[2 * m + 1]);
            _mm512_add_ps(
                _mm512_shuffle_f32x4::<0x88>(a, b),
                _mm512_shuffle_f32x4::<0xDD>(a, b),
            )
        });
        // Lane k: [key k: 0+2, 1+3; key 4+k: …] and keys 8+k, 12+k.
        let s: [V; 2] = std::array::from_fn(|i| {
            let (a, b) = (q[2 * i], q[2 * i + 1]);
            _mm512_add_ps(
                _mm512_shuffle_ps::<0x44>(a, b),
                _mm512_shuffle_ps::<0xEE>(a, b),
            )
        });
        // Lane 4k + i: key 4i + k.
        let t = _mm512_add_ps(
            _mm512_shuffle_ps::<0x88>(s[0], s[1]),
            _mm512_shuffle_ps::<0xDD>(s[0], s[1]),
        );
        let order = _mm512_setr_epi32(0, 4, 8, 12, 1, 5, 9, 13, 2, 6, 10, 14, 3, 7, 11, 15);
        _mm512_permutexvar_ps(order, t)
    }
    #[inline]
    #[target_feature(enable = "avx512f,avx512dq,avx2,fma,f16c")]
    pub(super) unsafe fn hmax(v: V) -> f32 {
        _mm512_reduce_max_ps(v)
    }
    #[inline]
    #[target_feature(enable = "avx512f,avx512dq,avx2,fma,f16c")]
    pub(super) unsafe fn hsum(v: V) -> f32 {
        let h = _mm256_add_ps(_mm512_castps512_ps256(v), _mm512_extractf32x8_ps::<1>(v));
        let q = _mm_add_ps(_mm256_castps256_ps128(h), _mm256_extractf128_ps::<1>(h));
        let s = _mm_add_ps(q, _mm_movehl_ps(q, q));
        _mm_cvtss_f32(_mm_add_ss(s, _mm_movehdup_ps(s)))
    }
    lane_exp!(V, target_feature(enable = "avx512f,avx512dq,avx2,fma,f16c"));
}

/// Lanes as two AVX2 registers (lanes 0..8, 8..16).
#[cfg(target_arch = "x86_64")]
mod avx2 {
    use super::{LN2_HI, LN2_LO, ROUND};
    use half::f16;
    use std::arch::x86_64::*;

    #[derive(Clone, Copy)]
    pub(super) struct V(__m256, __m256);

    /// Lane-wise operations: the 256-bit instruction on each half.
    macro_rules! lanewise {
        ($($name:ident($($a:ident),*) => $f:ident;)*) => {$(
            #[inline]
            #[target_feature(enable = "avx2,fma,f16c")]
            pub(super) unsafe fn $name($($a: V),*) -> V {
                V($f($($a.0),*), $f($($a.1),*))
            }
        )*};
    }

    lanewise! {
        fma(a, b, c) => _mm256_fmadd_ps;
        add(a, b) => _mm256_add_ps;
        sub(a, b) => _mm256_sub_ps;
        mul(a, b) => _mm256_mul_ps;
        max(a, b) => _mm256_max_ps;
        min(a, b) => _mm256_min_ps;
    }

    #[inline]
    #[target_feature(enable = "avx2,fma,f16c")]
    pub(super) unsafe fn zero() -> V {
        V(_mm256_setzero_ps(), _mm256_setzero_ps())
    }
    #[inline]
    #[target_feature(enable = "avx2,fma,f16c")]
    pub(super) unsafe fn splat(v: f32) -> V {
        V(_mm256_set1_ps(v), _mm256_set1_ps(v))
    }
    #[inline]
    #[target_feature(enable = "avx2,fma,f16c")]
    pub(super) unsafe fn load(p: *const f32) -> V {
        // SAFETY: the caller guarantees 16 readable values.
        unsafe { V(_mm256_loadu_ps(p), _mm256_loadu_ps(p.add(8))) }
    }
    #[inline]
    #[target_feature(enable = "avx2,fma,f16c")]
    pub(super) unsafe fn store(p: *mut f32, v: V) {
        // SAFETY: the caller guarantees 16 writable values.
        unsafe {
            _mm256_storeu_ps(p, v.0);
            _mm256_storeu_ps(p.add(8), v.1);
        }
    }
    #[inline]
    #[target_feature(enable = "avx2,fma,f16c")]
    pub(super) unsafe fn cvt(src: *const f16, dst: *mut f32) {
        // SAFETY: the caller guarantees 16 values at each.
        unsafe {
            _mm256_storeu_ps(dst, _mm256_cvtph_ps(_mm_loadu_si128(src.cast())));
            _mm256_storeu_ps(
                dst.add(8),
                _mm256_cvtph_ps(_mm_loadu_si128(src.add(8).cast())),
            );
        }
    }
    #[inline]
    #[target_feature(enable = "avx2,fma,f16c")]
    pub(super) unsafe fn pow2(k: V) -> V {
        let one = |k: __m256| {
            let n = _mm256_sub_epi32(
                _mm256_castps_si256(k),
                _mm256_set1_epi32(ROUND.to_bits() as i32),
            );
            _mm256_castsi256_ps(_mm256_slli_epi32::<23>(_mm256_add_epi32(
                n,
                _mm256_set1_epi32(127),
            )))
        };
        V(one(k.0), one(k.1))
    }
    #[inline]
    #[target_feature(enable = "avx2,fma,f16c")]
    pub(super) unsafe fn zero_below(x: V, bound: f32, v: V) -> V {
        let one = |x: __m256, v: __m256| {
            _mm256_and_ps(_mm256_cmp_ps::<_CMP_GE_OQ>(x, _mm256_set1_ps(bound)), v)
        };
        V(one(x.0, v.0), one(x.1, v.1))
    }
    /// Lane j: `hsum(p[j])`.
    #[inline]
    #[target_feature(enable = "avx2,fma,f16c")]
    pub(super) unsafe fn hsum16(p: &[V; 16]) -> V {
        let mut s = [0.0f32; 16];
        for (s, &p) in s.iter_mut().zip(p) {
            // SAFETY: the caller has the features.
            *s = unsafe { hsum(p) };
        }
        // SAFETY: 16 values.
        unsafe { load(s.as_ptr()) }
    }
    #[inline]
    #[target_feature(enable = "avx2,fma,f16c")]
    pub(super) unsafe fn hmax(v: V) -> f32 {
        let h = _mm256_max_ps(v.0, v.1);
        let q = _mm_max_ps(_mm256_castps256_ps128(h), _mm256_extractf128_ps::<1>(h));
        let s = _mm_max_ps(q, _mm_movehl_ps(q, q));
        _mm_cvtss_f32(_mm_max_ss(s, _mm_movehdup_ps(s)))
    }
    #[inline]
    #[target_feature(enable = "avx2,fma,f16c")]
    pub(super) unsafe fn hsum(v: V) -> f32 {
        let h = _mm256_add_ps(v.0, v.1);
        let q = _mm_add_ps(_mm256_castps256_ps128(h), _mm256_extractf128_ps::<1>(h));
        let s = _mm_add_ps(q, _mm_movehl_ps(q, q));
        _mm_cvtss_f32(_mm_add_ss(s, _mm_movehdup_ps(s)))
    }
    lane_exp!(V, target_feature(enable = "avx2,fma,f16c"));
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_lane_exponential_is_within_two_ulp_and_zero_below_the_range() {
        let mut worst = 0u32;
        let mut x = -87.0f32;
        while x < 88.0 {
            // SAFETY: the portable lanes need no CPU feature.
            let got = unsafe { portable::exp([x; LANES]) }[0];
            let want = f64::from(x).exp() as f32;
            worst = worst.max(got.to_bits().abs_diff(want.to_bits()));
            x += 0.013_7;
        }
        assert!(worst <= 2, "{worst} ulp");
        // SAFETY: as above.
        let at = |x: f32| unsafe { portable::exp([x; LANES]) }[0];
        assert_eq!(at(f32::NEG_INFINITY), 0.0);
        assert_eq!(at(-100.0), 0.0);
        assert_eq!(at(0.0), 1.0);
    }

    /// The sixteen folds done together give each lane what `hsum` gives
    /// its vector alone, bit for bit, on every path.
    #[test]
    fn sixteen_folds_at_once_equal_sixteen_folds() {
        let mut x = 3u64;
        let mut next = move || {
            x = x.wrapping_mul(6_364_136_223_846_793_005).wrapping_add(1);
            ((x >> 40) as f32 / (1u64 << 20) as f32) - 8.0
        };
        let p: [Lanes; 16] = std::array::from_fn(|_| std::array::from_fn(|_| next()));
        // SAFETY: portable lanes need nothing.
        let want: Lanes = std::array::from_fn(|j| unsafe { portable::hsum(p[j]) });
        // SAFETY: as above.
        assert_eq!(unsafe { portable::hsum16(&p) }, want);
        // Each path's folds, where the CPU has it.
        macro_rules! check {
            ($isa:expr, $l:ident) => {
                if $isa.available() {
                    // SAFETY: the path's features are present; 16 values
                    // per vector.
                    let got = unsafe {
                        let v = p.map(|l| $l::load(l.as_ptr()));
                        let mut out: Lanes = [0.0; LANES];
                        $l::store(out.as_mut_ptr(), $l::hsum16(&v));
                        out
                    };
                    assert_eq!(got.map(f32::to_bits), want.map(f32::to_bits), "{:?}", $isa);
                }
            };
        }
        #[cfg(target_arch = "x86_64")]
        {
            check!(Isa::Avx512, avx512);
            check!(Isa::Avx2, avx2);
        }
    }
}
