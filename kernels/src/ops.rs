//! Element-wise and row-wise operations of a Llama block: RMSNorm, RoPE,
//! SwiGLU, softmax and the embedding lookup. Each follows llama.cpp's CPU
//! code (summation in f64 where ggml uses `ggml_float`, RoPE angles by
//! repeated multiplication) so the engine's logits track llama.cpp's.

use crate::matmul::{WeightMatrix, dequantize_row};

/// `out = x / sqrt(mean(x²) + eps) * weight`, row by row; `x` holds one or
/// more rows of `weight.len()` values.
///
/// # Panics
/// If `x.len()` is not a multiple of `weight.len()` or `out.len() != x.len()`.
pub fn rms_norm(x: &[f32], weight: &[f32], eps: f32, out: &mut [f32]) {
    let n = weight.len();
    assert!(
        n > 0 && x.len().is_multiple_of(n),
        "x of {} values is not rows of {n}",
        x.len()
    );
    assert_eq!(out.len(), x.len(), "rms_norm output length");
    for (xr, or) in x.chunks_exact(n).zip(out.chunks_exact_mut(n)) {
        let sum: f64 = xr.iter().map(|&v| f64::from(v) * f64::from(v)).sum();
        let mean = (sum / n as f64) as f32;
        let scale = 1.0 / (mean + eps).sqrt();
        for ((o, &v), &g) in or.iter_mut().zip(xr).zip(weight) {
            *o = (v * scale) * g;
        }
    }
}

/// Rotary position embedding, Llama "normal" mode (llama.cpp
/// `LLAMA_ROPE_TYPE_NORM`), in place. `x` is `positions.len()` tokens ×
/// `n_heads` × `head_dim`; in each head the adjacent pairs `(x[2i], x[2i+1])`
/// for `2i < rope_dim` rotate by `pos * base^(-2i/rope_dim)`; the rest of the
/// head is left as is.
///
/// # Panics
/// If `x.len() != positions.len() * n_heads * head_dim`, `rope_dim` is odd or
/// larger than `head_dim`.
pub fn rope_inplace(
    x: &mut [f32],
    n_heads: usize,
    head_dim: usize,
    rope_dim: usize,
    positions: &[usize],
    base: f32,
) {
    assert_eq!(
        x.len(),
        positions.len() * n_heads * head_dim,
        "rope input length"
    );
    assert!(
        rope_dim.is_multiple_of(2) && rope_dim <= head_dim,
        "rope_dim {rope_dim} for head_dim {head_dim}"
    );
    let theta_scale = base.powf(-2.0 / rope_dim as f32);
    let mut cache = vec![0.0f32; rope_dim];
    for (tok, &pos) in x.chunks_exact_mut(n_heads * head_dim).zip(positions) {
        let mut theta = pos as f32;
        for pair in cache.chunks_exact_mut(2) {
            pair[0] = theta.cos();
            pair[1] = theta.sin();
            theta *= theta_scale;
        }
        for head in tok.chunks_exact_mut(head_dim) {
            for (v, cs) in head[..rope_dim]
                .chunks_exact_mut(2)
                .zip(cache.chunks_exact(2))
            {
                let (x0, x1) = (v[0], v[1]);
                v[0] = x0 * cs[0] - x1 * cs[1];
                v[1] = x0 * cs[1] + x1 * cs[0];
            }
        }
    }
}

/// `gate = silu(gate) * up`, with `silu(v) = v / (1 + e^-v)`.
///
/// # Panics
/// If the lengths differ.
pub fn swiglu(gate: &mut [f32], up: &[f32]) {
    assert_eq!(gate.len(), up.len(), "swiglu gate and up lengths");
    for (g, &u) in gate.iter_mut().zip(up) {
        *g = *g / (1.0 + (-*g).exp()) * u;
    }
}

/// Softmax of `x` in place (max subtracted, sum in f64). An empty slice is
/// left alone; a row of all `-inf` becomes NaN, as in ggml.
pub fn softmax_inplace(x: &mut [f32]) {
    let max = x.iter().fold(f32::NEG_INFINITY, |m, &v| m.max(v));
    let mut sum = 0.0f64;
    for v in x.iter_mut() {
        *v = (*v - max).exp();
        sum += f64::from(*v);
    }
    let inv = (1.0 / sum) as f32;
    for v in x.iter_mut() {
        *v *= inv;
    }
}

/// Embedding lookup: row `ids[i]` of `table` into `out[i*cols..(i+1)*cols]`.
///
/// # Panics
/// If an id is not a row of `table` or `out.len() != ids.len() * table.cols`.
pub fn embedding(table: &WeightMatrix, ids: &[u32], out: &mut [f32]) {
    assert_eq!(out.len(), ids.len() * table.cols, "embedding output length");
    for (&id, o) in ids.iter().zip(out.chunks_exact_mut(table.cols.max(1))) {
        dequantize_row(table, id as usize, o);
    }
}
