//! Quantized matrix products against plain f64 references on random inputs.

mod common;

use common::*;
use kvsan_kernels::quant::{self, ActFormat, QK, QK_K};
use kvsan_kernels::{DType, Exec, Isa, ThreadPool, WeightMatrix, matmul, matmul_with};

/// Activations as the dot product sees them: the quantized row decoded back to f32.
fn dequantize_activations(fmt: ActFormat, q: &[u8], cols: usize) -> Vec<f32> {
    let f16_at =
        |b: &[u8], o: usize| half::f16::from_bits(u16::from_le_bytes([b[o], b[o + 1]])).to_f32();
    let mut v: Vec<f32> = match fmt {
        ActFormat::F32 => q
            .chunks_exact(4)
            .map(|b| f32::from_le_bytes([b[0], b[1], b[2], b[3]]))
            .collect(),
        ActFormat::F16 => q.chunks_exact(2).map(|b| f16_at(b, 0)).collect(),
        ActFormat::Q8_0 | ActFormat::Q8_1 => {
            let (bb, qo) = if fmt == ActFormat::Q8_0 {
                (34, 2)
            } else {
                (36, 4)
            };
            q.chunks_exact(bb)
                .flat_map(|b| {
                    let d = f16_at(b, 0);
                    b[qo..qo + QK].iter().map(move |&v| f32::from(v as i8) * d)
                })
                .collect()
        }
        ActFormat::Q8K => q
            .chunks_exact(292)
            .flat_map(|b| {
                let d = f32::from_le_bytes([b[0], b[1], b[2], b[3]]);
                b[4..4 + QK_K].iter().map(move |&v| f32::from(v as i8) * d)
            })
            .collect(),
    };
    v.truncate(cols);
    v
}

fn f16_bits(b: &[u8], o: usize) -> f32 {
    half::f16::from_bits(u16::from_le_bytes([b[o], b[o + 1]])).to_f32()
}

#[test]
fn vec_dot_equals_the_exact_product_of_dequantized_weights_and_quantized_activations() {
    let mut rng = rng(1);
    let cols = 512;
    for dtype in DType::ALL {
        let fmt = ActFormat::for_weight(dtype);
        for isa in Isa::all_available() {
            for trial in 0..20 {
                let w = random_weights(&mut rng, dtype, 1, cols);
                let x = random_f32(&mut rng, cols, 2.0);
                let mut xq = vec![0u8; fmt.row_bytes(cols)];
                quant::quantize_activations(fmt, &x, &mut xq);
                let wf = dequantize_all(dtype, 1, cols, &w);
                let xf = dequantize_activations(fmt, &xq, cols);
                let (mut want, mag) = reference_matmul(&wf, 1, cols, &xf, 1);
                if fmt == ActFormat::Q8_1 {
                    // Q8_1 carries s = f16(d·Σq): the min term uses the stored
                    // s, not the exact sum, in llama.cpp as here.
                    for b in 0..cols / QK {
                        let m = f64::from(f16_bits(&w, 20 * b + 2));
                        let exact: f64 =
                            xf[b * QK..(b + 1) * QK].iter().map(|&v| f64::from(v)).sum();
                        want[0] += m * (f64::from(f16_bits(&xq, 36 * b + 2)) - exact);
                    }
                }
                let got = kvsan_kernels::matmul::vec_dot(isa, dtype, cols, &w, &xq);
                assert_close(
                    &format!("{dtype} on {isa:?}, trial {trial}"),
                    &[got],
                    &want,
                    &mag,
                    2e-6,
                );
            }
        }
    }
}

#[test]
fn matmul_matches_f32_reference_of_dequantized_weights_for_every_dtype() {
    let mut rng = rng(2);
    let pool = ThreadPool::new(3);
    for dtype in DType::ALL {
        // Activation quantization costs up to ~1% of Σ|w·x| with 8-bit
        // activations; float types are exact up to rounding.
        let rel = match dtype {
            DType::F32 => 1e-6,
            DType::F16 => 2e-3,
            _ => 1e-2,
        };
        for (rows, cols, n_tokens) in [(37, 256, 1), (64, 512, 3), (19, 768, 17)] {
            let data = random_weights(&mut rng, dtype, rows, cols);
            let w = WeightMatrix::new(dtype, rows, cols, &data).unwrap();
            let x = random_f32(&mut rng, n_tokens * cols, 1.5);
            let wf = dequantize_all(dtype, rows, cols, &data);
            let (want, mag) = reference_matmul(&wf, rows, cols, &x, n_tokens);
            for isa in Isa::all_available() {
                let mut y = vec![f32::NAN; n_tokens * rows];
                matmul_with(Exec { pool: &pool, isa }, &w, &x, n_tokens, &mut y);
                assert_close(
                    &format!("{dtype} {rows}x{cols}x{n_tokens} on {isa:?}"),
                    &y,
                    &want,
                    &mag,
                    rel,
                );
            }
        }
    }
}

#[test]
fn simd_and_portable_paths_agree_to_float_rounding() {
    let mut rng = rng(3);
    let pool = ThreadPool::new(2);
    for dtype in DType::ALL {
        let (rows, cols, n_tokens) = (33, 1536, 5);
        let data = random_weights(&mut rng, dtype, rows, cols);
        let w = WeightMatrix::new(dtype, rows, cols, &data).unwrap();
        let x = random_f32(&mut rng, n_tokens * cols, 1.0);
        let mut portable = vec![0.0; n_tokens * rows];
        matmul_with(
            Exec {
                pool: &pool,
                isa: Isa::Portable,
            },
            &w,
            &x,
            n_tokens,
            &mut portable,
        );
        for isa in Isa::all_available() {
            let mut y = vec![0.0; n_tokens * rows];
            matmul_with(Exec { pool: &pool, isa }, &w, &x, n_tokens, &mut y);
            let scale = portable.iter().fold(0.0f32, |m, v| m.max(v.abs()));
            for (i, (a, b)) in y.iter().zip(&portable).enumerate() {
                assert!(
                    (a - b).abs() <= 1e-5 * scale,
                    "{dtype} on {isa:?}, element {i}: {a} vs portable {b}"
                );
            }
        }
    }
}

#[test]
fn results_do_not_depend_on_the_number_of_threads() {
    let mut rng = rng(4);
    let (rows, cols, n_tokens) = (576, 576, 40);
    let data = random_weights(&mut rng, DType::Q4_1, rows, cols);
    let w = WeightMatrix::new(DType::Q4_1, rows, cols, &data).unwrap();
    let x = random_f32(&mut rng, n_tokens * cols, 1.0);
    let mut first: Option<Vec<f32>> = None;
    for threads in [1, 2, 3, 5] {
        let pool = ThreadPool::new(threads);
        let mut y = vec![0.0; n_tokens * rows];
        matmul_with(
            Exec {
                pool: &pool,
                isa: Isa::detected(),
            },
            &w,
            &x,
            n_tokens,
            &mut y,
        );
        match &first {
            None => first = Some(y),
            Some(f) => assert!(f == &y, "{threads} threads changed the result"),
        }
    }
}

#[test]
fn matvec_equals_one_row_of_matmul() {
    // The decode path (one token) and the prefill path (many tokens,
    // quantized in parallel, tiled) must give bit-identical rows.
    let mut rng = rng(5);
    let (rows, cols, n_tokens) = (96, 576, 64);
    let data = random_weights(&mut rng, DType::Q8_0, rows, cols);
    let w = WeightMatrix::new(DType::Q8_0, rows, cols, &data).unwrap();
    let x = random_f32(&mut rng, n_tokens * cols, 1.0);
    let mut y = vec![0.0; n_tokens * rows];
    matmul(&w, &x, n_tokens, &mut y);
    for t in [0, 31, 63] {
        let mut y1 = vec![0.0; rows];
        matmul(&w, &x[t * cols..(t + 1) * cols], 1, &mut y1);
        assert_eq!(&y[t * rows..(t + 1) * rows], &y1[..], "token {t}");
    }
}

#[test]
fn dequantize_row_and_embedding_return_the_stored_row() {
    let mut rng = rng(6);
    let (rows, cols) = (10, 64);
    let x = random_f32(&mut rng, rows * cols, 1.0);
    let mut data = vec![0u8; rows * DType::Q8_0.row_bytes(cols).unwrap()];
    for (r, o) in data.chunks_exact_mut(68).enumerate() {
        quant::quantize_row(DType::Q8_0, &x[r * cols..(r + 1) * cols], o).unwrap();
    }
    let w = WeightMatrix::new(DType::Q8_0, rows, cols, &data).unwrap();
    let mut row = vec![0.0; cols];
    kvsan_kernels::dequantize_row(&w, 7, &mut row);
    for (a, b) in row.iter().zip(&x[7 * cols..8 * cols]) {
        assert!((a - b).abs() <= 1.0 / 127.0 * 0.5 + 1e-3, "{a} vs {b}");
    }
    let mut emb = vec![0.0; 2 * cols];
    kvsan_kernels::embedding(&w, &[7, 2], &mut emb);
    assert_eq!(&emb[..cols], &row[..]);
    let mut row2 = vec![0.0; cols];
    kvsan_kernels::dequantize_row(&w, 2, &mut row2);
    assert_eq!(&emb[cols..], &row2[..]);
}

#[test]
fn the_vnni_path_is_bit_identical_to_avx2() {
    // Where the CPU has VNNI, the byte sums inside a block take one
    // instruction instead of two; the integers, and so every output bit,
    // are the same (the golden generations depend on it).
    if !Isa::Avx2Vnni.available() {
        eprintln!("no AVX2 with VNNI on this CPU: nothing to compare");
        return;
    }
    let mut rng = rng(7);
    let pool = ThreadPool::new(2);
    for dtype in [DType::Q4_0, DType::Q4_1, DType::Q8_0] {
        // Token counts that take the one-token and the four-token kernels.
        for n_tokens in [1, 4, 7] {
            let (rows, cols) = (19, 1024);
            let data = random_weights(&mut rng, dtype, rows, cols);
            let w = WeightMatrix::new(dtype, rows, cols, &data).unwrap();
            // Large activations too: quants at ±127 on every block.
            let x = random_f32(&mut rng, n_tokens * cols, 50.0);
            let run = |isa| {
                let mut y = vec![0.0f32; n_tokens * rows];
                matmul_with(Exec { pool: &pool, isa }, &w, &x, n_tokens, &mut y);
                y
            };
            let (avx2, vnni) = (run(Isa::Avx2), run(Isa::Avx2Vnni));
            assert!(
                avx2.iter()
                    .zip(&vnni)
                    .all(|(a, b)| a.to_bits() == b.to_bits()),
                "{dtype}, {n_tokens} tokens: the VNNI path differs from AVX2"
            );
            let fmt = ActFormat::for_weight(dtype);
            let mut xq = vec![0u8; fmt.row_bytes(cols)];
            quant::quantize_activations(fmt, &x[..cols], &mut xq);
            let row = &data[..dtype.row_bytes(cols).unwrap()];
            assert_eq!(
                kvsan_kernels::matmul::vec_dot(Isa::Avx2, dtype, cols, row, &xq).to_bits(),
                kvsan_kernels::matmul::vec_dot(Isa::Avx2Vnni, dtype, cols, row, &xq).to_bits(),
                "{dtype}: one row"
            );
        }
    }
}
