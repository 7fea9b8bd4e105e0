//! Minimum-of-N timings of the SmolLM2-135M matmul shapes (a quick check on a
//! noisy machine; criterion's `benches/matmul.rs` is the benchmark).
//! Run: `cargo run --release -p kvsan-kernels --example kernel_timing [threads]`.

use std::time::Instant;

use kvsan_kernels::{DType, Exec, Isa, ThreadPool, WeightMatrix, matmul_with, quant};

fn main() {
    let threads = std::env::args()
        .nth(1)
        .and_then(|a| a.parse().ok())
        .unwrap_or(2);
    let pool = ThreadPool::new(threads);
    for (dtype, rows, cols, n_tokens, reps) in [
        (DType::Q4_1, 576, 576, 1, 2000),
        (DType::Q4_1, 1536, 576, 1, 1000),
        (DType::Q4_1, 576, 1536, 1, 1000),
        (DType::Q8_0, 49152, 576, 1, 30),
        (DType::Q4_1, 576, 576, 8, 500),
        (DType::Q4_1, 576, 576, 32, 200),
        (DType::Q4_1, 1536, 576, 512, 5),
    ] {
        let rb = dtype.row_bytes(cols).unwrap();
        let mut data = vec![0u8; rows * rb];
        let row: Vec<f32> = (0..cols)
            .map(|i| ((i * 37) % 101) as f32 / 101.0 - 0.5)
            .collect();
        for r in data.chunks_exact_mut(rb) {
            quant::quantize_row(dtype, &row, r).unwrap();
        }
        let w = WeightMatrix::new(dtype, rows, cols, &data).unwrap();
        let x: Vec<f32> = (0..n_tokens * cols)
            .map(|i| ((i * 7) % 13) as f32 / 13.0 - 0.5)
            .collect();
        let mut y = vec![0.0; n_tokens * rows];
        let exec = Exec {
            pool: &pool,
            isa: Isa::detected(),
        };
        let mut times = Vec::with_capacity(reps);
        for _ in 0..reps {
            let t = Instant::now();
            matmul_with(exec, &w, &x, n_tokens, &mut y);
            times.push(t.elapsed().as_secs_f64());
        }
        times.sort_by(f64::total_cmp);
        let (best, median) = (times[0], times[times.len() / 2]);
        let gflops = 2.0 * (rows * cols * n_tokens) as f64 / best / 1e9;
        if n_tokens == 1 {
            let xr = &xq_row(dtype, &x);
            let mut best_dot = f64::MAX;
            for _ in 0..reps {
                let t = Instant::now();
                let mut acc = 0.0;
                for r in 0..rows {
                    acc +=
                        kvsan_kernels::matmul::vec_dot(Isa::detected(), dtype, cols, w.row(r), xr);
                }
                std::hint::black_box(acc);
                best_dot = best_dot.min(t.elapsed().as_secs_f64());
            }
            let blocks = (rows * cols / 32) as f64;
            println!(
                "  bare dot loop, one thread: {:.2} ns per 32-value block",
                best_dot / blocks * 1e9
            );
        }
        println!(
            "{dtype} {rows}x{cols} x{n_tokens} tokens, {threads} threads: best {:.1} us ({gflops:.1} GFLOP/s), median {:.1} us",
            best * 1e6,
            median * 1e6
        );
    }
}

fn xq_row(dtype: DType, x: &[f32]) -> Vec<u8> {
    let fmt = quant::ActFormat::for_weight(dtype);
    let mut q = vec![0u8; fmt.row_bytes(x.len())];
    quant::quantize_activations(fmt, x, &mut q);
    q
}
