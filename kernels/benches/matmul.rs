//! Matrix products at SmolLM2-135M's shapes, in FLOP/s (criterion's
//! "elements" are FLOPs: 2 per weight per token), plus the thread pool's
//! dispatch cost as the floor a small matvec pays.

use criterion::{BenchmarkId, Criterion, Throughput, criterion_group, criterion_main};
use kvsan_kernels::{DType, Exec, Isa, WeightMatrix, matmul_with, quant, threads};

fn weights(dtype: DType, rows: usize, cols: usize) -> Vec<u8> {
    let rb = dtype.row_bytes(cols).unwrap();
    let mut data = vec![0u8; rows * rb];
    let mut s = 0x2545_f491_4f6c_dd1du64;
    let mut row = vec![0.0f32; cols];
    for r in 0..rows {
        for v in row.iter_mut() {
            s ^= s << 13;
            s ^= s >> 7;
            s ^= s << 17;
            *v = (s >> 40) as f32 / (1u64 << 24) as f32 - 0.5;
        }
        quant::quantize_row(dtype, &row, &mut data[r * rb..(r + 1) * rb]).unwrap();
    }
    data
}

fn bench_matmul(c: &mut Criterion) {
    let shapes: [(&str, DType, usize, usize, usize); 6] = [
        ("q4_1_576x576_matvec", DType::Q4_1, 576, 576, 1),
        ("q4_1_1536x576_matvec", DType::Q4_1, 1536, 576, 1),
        ("q4_1_576x1536_matvec", DType::Q4_1, 576, 1536, 1),
        ("q8_0_49152x576_matvec", DType::Q8_0, 49152, 576, 1),
        ("q4_1_1536x576_512tok", DType::Q4_1, 1536, 576, 512),
        ("q4_1_576x1536_512tok", DType::Q4_1, 576, 1536, 512),
    ];
    let pool = threads::global();
    let mut g = c.benchmark_group("matmul");
    for (name, dtype, rows, cols, n_tokens) in shapes {
        let data = weights(dtype, rows, cols);
        let w = WeightMatrix::new(dtype, rows, cols, &data).unwrap();
        let x: Vec<f32> = (0..n_tokens * cols)
            .map(|i| ((i * 7) % 13) as f32 / 13.0 - 0.5)
            .collect();
        let mut y = vec![0.0f32; n_tokens * rows];
        g.throughput(Throughput::Elements((2 * rows * cols * n_tokens) as u64));
        for isa in Isa::all_available() {
            let id = BenchmarkId::new(name, format!("{isa:?}/{}t", pool.threads()));
            g.bench_function(id, |b| {
                b.iter(|| matmul_with(Exec { pool, isa }, &w, &x, n_tokens, &mut y));
            });
        }
    }
    g.finish();
}

fn bench_dispatch(c: &mut Criterion) {
    let pool = threads::global();
    let mut g = c.benchmark_group("dispatch");
    g.bench_function(format!("empty_16_tasks/{}t", pool.threads()), |b| {
        b.iter(|| {
            pool.run(16, |i| {
                std::hint::black_box(i);
            })
        });
    });
    g.finish();
}

/// The 576×1536 matvec while another thread keeps one core busy: the pool
/// must degrade (its workers park) rather than collapse.
fn bench_shared_core(c: &mut Criterion) {
    let (rows, cols) = (576, 1536);
    let data = weights(DType::Q4_1, rows, cols);
    let w = WeightMatrix::new(DType::Q4_1, rows, cols, &data).unwrap();
    let x = vec![0.25f32; cols];
    let mut y = vec![0.0f32; rows];
    let stop = std::sync::atomic::AtomicBool::new(false);
    let pool = threads::global();
    std::thread::scope(|s| {
        s.spawn(|| {
            let mut v = 1u64;
            while !stop.load(std::sync::atomic::Ordering::Relaxed) {
                v = std::hint::black_box(v.wrapping_mul(3).wrapping_add(1));
            }
        });
        let mut g = c.benchmark_group("shared_core");
        g.throughput(Throughput::Elements((2 * rows * cols) as u64));
        g.bench_function(
            format!(
                "q4_1_576x1536_matvec_beside_a_busy_thread/{}t",
                pool.threads()
            ),
            |b| {
                b.iter(|| matmul_with(Exec::global(), &w, &x, 1, &mut y));
            },
        );
        g.finish();
        stop.store(true, std::sync::atomic::Ordering::Relaxed);
    });
}

criterion_group!(benches, bench_matmul, bench_dispatch, bench_shared_core);
criterion_main!(benches);
