//! Random inputs and plain reference implementations shared by the tests.
#![allow(dead_code)]

use half::f16;
use kvsan_kernels::DType;
use kvsan_kernels::quant;
use rand::rngs::StdRng;
use rand::{Rng, SeedableRng};

pub fn rng(seed: u64) -> StdRng {
    StdRng::seed_from_u64(seed)
}

pub fn random_f32(rng: &mut StdRng, n: usize, amp: f32) -> Vec<f32> {
    (0..n).map(|_| rng.random_range(-amp..amp)).collect()
}

/// A random weight matrix of `dtype`: f32 values quantized with the crate's
/// quantizers, except for the K-quants whose blocks are random valid bytes
/// (every scale, min and quant value reachable).
pub fn random_weights(rng: &mut StdRng, dtype: DType, rows: usize, cols: usize) -> Vec<u8> {
    let rb = dtype.row_bytes(cols).expect("whole blocks");
    let mut data = vec![0u8; rows * rb];
    match dtype {
        DType::Q4K | DType::Q6K => {
            rng.fill(&mut data[..]);
            let bb = dtype.block_bytes();
            for block in data.chunks_exact_mut(bb) {
                let d = f16::from_f32(rng.random_range(0.0005..0.004))
                    .to_bits()
                    .to_le_bytes();
                if dtype == DType::Q4K {
                    block[0..2].copy_from_slice(&d);
                    let dmin = f16::from_f32(rng.random_range(0.0..0.004))
                        .to_bits()
                        .to_le_bytes();
                    block[2..4].copy_from_slice(&dmin);
                } else {
                    block[208..210].copy_from_slice(&d);
                }
            }
        }
        _ => {
            for row in data.chunks_exact_mut(rb) {
                let x = random_f32(rng, cols, 1.0);
                quant::quantize_row(dtype, &x, row).unwrap();
            }
        }
    }
    data
}

/// Dequantized rows of a whole matrix.
pub fn dequantize_all(dtype: DType, rows: usize, cols: usize, data: &[u8]) -> Vec<f32> {
    let rb = dtype.row_bytes(cols).unwrap();
    let mut out = vec![0.0f32; rows * cols];
    for (r, o) in out.chunks_exact_mut(cols).enumerate() {
        quant::dequantize_row(dtype, &data[r * rb..(r + 1) * rb], o);
    }
    out
}

/// y[t][r] = Σ w[r][c] x[t][c] in f64, and the matching Σ |w x| (the scale
/// a rounding tolerance is relative to).
pub fn reference_matmul(
    w: &[f32],
    rows: usize,
    cols: usize,
    x: &[f32],
    n_tokens: usize,
) -> (Vec<f64>, Vec<f64>) {
    let mut y = vec![0.0f64; n_tokens * rows];
    let mut mag = vec![0.0f64; n_tokens * rows];
    for t in 0..n_tokens {
        for r in 0..rows {
            let (mut s, mut m) = (0.0f64, 0.0f64);
            for c in 0..cols {
                let p = f64::from(w[r * cols + c]) * f64::from(x[t * cols + c]);
                s += p;
                m += p.abs();
            }
            y[t * rows + r] = s;
            mag[t * rows + r] = m;
        }
    }
    (y, mag)
}

/// Asserts |got - want| <= rel * mag + 1e-6 element-wise.
pub fn assert_close(what: &str, got: &[f32], want: &[f64], mag: &[f64], rel: f64) {
    assert_eq!(got.len(), want.len(), "{what}: length");
    for (i, ((&g, &w), &m)) in got.iter().zip(want).zip(mag).enumerate() {
        let err = (f64::from(g) - w).abs();
        assert!(
            err <= rel * m + 1e-6,
            "{what}: element {i}: got {g}, want {w} (error {err}, allowed {})",
            rel * m + 1e-6
        );
    }
}
