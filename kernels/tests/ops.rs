//! RMSNorm, RoPE, SwiGLU and softmax against plain references on random inputs.

mod common;

use common::*;
use kvsan_kernels::{rms_norm, rope_inplace, softmax_inplace, swiglu};

#[test]
fn rms_norm_matches_reference_on_every_row() {
    let mut rng = rng(10);
    let (n, rows) = (576, 3);
    let x = random_f32(&mut rng, n * rows, 3.0);
    let w = random_f32(&mut rng, n, 1.0);
    let mut out = vec![0.0; n * rows];
    rms_norm(&x, &w, 1e-5, &mut out);
    for r in 0..rows {
        let xr = &x[r * n..(r + 1) * n];
        let ms = xr.iter().map(|&v| f64::from(v).powi(2)).sum::<f64>() / n as f64;
        let inv = 1.0 / (ms + 1e-5).sqrt();
        for c in 0..n {
            let want = f64::from(xr[c]) * inv * f64::from(w[c]);
            let got = f64::from(out[r * n + c]);
            assert!(
                (got - want).abs() <= 1e-5 * want.abs().max(1.0),
                "row {r} col {c}: {got} vs {want}"
            );
        }
    }
}

#[test]
fn rope_rotates_adjacent_pairs_by_position_times_frequency() {
    let mut rng = rng(11);
    let (n_heads, head_dim, rope_dim, base) = (3, 64, 48, 100_000.0f32);
    let positions = [0usize, 1, 17, 4095];
    let x = random_f32(&mut rng, positions.len() * n_heads * head_dim, 1.0);
    let mut got = x.clone();
    rope_inplace(&mut got, n_heads, head_dim, rope_dim, &positions, base);
    for (ti, &pos) in positions.iter().enumerate() {
        for h in 0..n_heads {
            let o = (ti * n_heads + h) * head_dim;
            for i in 0..head_dim / 2 {
                let (x0, x1) = (f64::from(x[o + 2 * i]), f64::from(x[o + 2 * i + 1]));
                let (want0, want1) = if 2 * i < rope_dim {
                    let theta =
                        pos as f64 * f64::from(base).powf(-2.0 * i as f64 / rope_dim as f64);
                    (
                        x0 * theta.cos() - x1 * theta.sin(),
                        x0 * theta.sin() + x1 * theta.cos(),
                    )
                } else {
                    (x0, x1)
                };
                // f32 angles at position 4095 carry ~1e-4 of phase error, as in ggml.
                let tol = 2e-4 + pos as f64 * 5e-8;
                assert!(
                    (f64::from(got[o + 2 * i]) - want0).abs() <= tol,
                    "pos {pos} head {h} pair {i}"
                );
                assert!(
                    (f64::from(got[o + 2 * i + 1]) - want1).abs() <= tol,
                    "pos {pos} head {h} pair {i}"
                );
            }
        }
    }
    // Position 0 is the identity; pairs past rope_dim are untouched bit for bit.
    assert_eq!(&got[..n_heads * head_dim], &x[..n_heads * head_dim]);
}

#[test]
fn swiglu_is_silu_of_gate_times_up() {
    let mut rng = rng(12);
    let gate = random_f32(&mut rng, 1536, 8.0);
    let up = random_f32(&mut rng, 1536, 2.0);
    let mut got = gate.clone();
    swiglu(&mut got, &up);
    for i in 0..gate.len() {
        let g = f64::from(gate[i]);
        let want = g / (1.0 + (-g).exp()) * f64::from(up[i]);
        assert!(
            (f64::from(got[i]) - want).abs() <= 1e-5 * want.abs().max(1.0),
            "element {i}"
        );
    }
}

#[test]
fn softmax_matches_reference_and_sums_to_one() {
    let mut rng = rng(13);
    for n in [1usize, 7, 49152] {
        let x = random_f32(&mut rng, n, 30.0);
        let mut got = x.clone();
        softmax_inplace(&mut got);
        let max = x
            .iter()
            .fold(f64::NEG_INFINITY, |m, &v| m.max(f64::from(v)));
        let sum: f64 = x.iter().map(|&v| (f64::from(v) - max).exp()).sum();
        for i in 0..n {
            let want = (f64::from(x[i]) - max).exp() / sum;
            assert!(
                (f64::from(got[i]) - want).abs() <= 1e-6 * want.max(1e-3),
                "n {n} element {i}"
            );
        }
        let total: f64 = got.iter().map(|&v| f64::from(v)).sum();
        assert!((total - 1.0).abs() < 1e-4, "n {n}: sum {total}");
    }
}
