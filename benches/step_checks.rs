//! Host-side sanitizer work per decode step, before and after the checks
//! moved into the kernels, at batch 1 / 64 / 256 and context 1k / 8k / 32k
//! / 128k tokens.
//!
//! ```text
//! cargo bench --bench step_checks
//! ```
//!
//! - `before/B×C`: what the engine's step did on the host when it reported
//!   accesses from its plan: per row, a `read` hook over the row's whole
//!   block table for every layer and a `write` hook of its new token's slot
//!   (SmolLM2's 30 layers, 16-slot pages). It walks every page of every row.
//! - `after/B×C`: what the step does on the host now: the checked access
//!   for the batch (`KvAccess::new`: the kernel shadow's view, the rows'
//!   ledger) and its end (`finish`). The pages are checked inside the
//!   kernels, one record and one bit word per page touched, timed by
//!   `cargo bench --bench kernel_check`.
//!
//! Throughput is one step, so criterion prints time per step.

use std::hint::black_box;
use std::sync::Arc;
use std::time::Duration;

use criterion::{BenchmarkId, Criterion, criterion_group, criterion_main};
use kvsan_engine::hooks::Hooks;
use kvsan_engine::kv_access::{AttentionCheck, KvAccess, Logits, SeqChunk, StepBatch};
use kvsan_engine::kv_pool::KvPool;
use kvsan_kernels::attention::KvGeometry;
use kvsan_sanitizer::{NodeRole, Options, Owner, PageRef, PoolGeometry, Sanitizer};

const LAYERS: u32 = 30;
const SLOTS: usize = 16;
const BATCHES: [usize; 3] = [1, 64, 256];
const CONTEXTS: [usize; 4] = [1024, 8 * 1024, 32 * 1024, 128 * 1024];

/// Every row's pages, owned and written in one sanitizer, for the largest
/// batch and context; smaller cases use a prefix of it.
struct Setup {
    san: Arc<Sanitizer>,
    pool_id: kvsan_sanitizer::PoolId,
    /// KV storage of one value per slot: the host-side work does not read it.
    pool: KvPool,
    tables: Vec<Vec<PageRef>>,
}

fn setup() -> Setup {
    let rows = *BATCHES.iter().max().expect("batches");
    let per_row = CONTEXTS.iter().max().expect("contexts") / SLOTS;
    let pages = rows * per_row;
    let san = Arc::new(Sanitizer::with_writer(
        Options::parse("history_depth=1:quarantine_pages=0").expect("options"),
        std::io::sink(),
    ));
    let pool_id = san
        .pool_register(PoolGeometry {
            pages: pages as u32,
            page_slots: SLOTS as u32,
            layers: LAYERS,
            bytes_per_slot: 2 * 3 * 64 * 2,
            role: NodeRole::Decode,
            node: "bench-0".into(),
        })
        .expect("geometry");
    let pool = KvPool::new(
        KvGeometry {
            page_slots: SLOTS,
            n_layers: 1,
            n_kv_heads: 1,
            head_dim: 1,
        },
        pages,
    )
    .expect("pool");
    let tables = (0..rows)
        .map(|r| {
            let owner = Owner::new(r as u64 + 1, 0);
            (0..per_row)
                .map(|i| {
                    let page = kvsan_sanitizer::PageId((r * per_row + i) as u32);
                    let (_, generation) = san.alloc(pool_id, page, owner, 0).expect("alloc");
                    let page = PageRef { page, generation };
                    let _ = san.write(pool_id, owner, page, 0..SLOTS as u32, 0..LAYERS, 0);
                    page
                })
                .collect()
        })
        .collect();
    Setup {
        san,
        pool_id,
        pool,
        tables,
    }
}

fn step_checks(c: &mut Criterion) {
    let mut s = setup();
    let hooks = Hooks::sanitizer(s.san.clone());
    let mut group = c.benchmark_group("host_step");
    group
        .sample_size(10)
        .warm_up_time(Duration::from_millis(300))
        .measurement_time(Duration::from_secs(2));
    for &batch in &BATCHES {
        for &context in &CONTEXTS {
            let pages = context / SLOTS;
            let id = format!("{batch}x{context}");
            let tables: Vec<&[PageRef]> = s.tables[..batch].iter().map(|t| &t[..pages]).collect();
            group.bench_function(BenchmarkId::new("before", &id), |b| {
                b.iter(|| {
                    for (r, table) in tables.iter().enumerate() {
                        let owner = Owner::new(r as u64 + 1, 0);
                        let last = table[pages - 1];
                        let w = s
                            .san
                            .write(s.pool_id, owner, last, 15..16, 0..LAYERS, 1)
                            .expect("write");
                        let v = s
                            .san
                            .read(s.pool_id, owner, table, context, 0..LAYERS, 1)
                            .expect("read");
                        black_box(w.is_continue() && v.is_continue());
                    }
                });
            });
            let token = [0u32];
            let chunks: Vec<SeqChunk<'_>> = tables
                .iter()
                .map(|t| SeqChunk {
                    tokens: &token,
                    start_pos: context - 1,
                    block_table: t,
                    logits: Logits::Last,
                })
                .collect();
            let step = StepBatch::of_chunks(&chunks, SLOTS).expect("batch");
            group.bench_function(BenchmarkId::new("after", &id), |b| {
                b.iter(|| {
                    let shadow = s.san.kernel_shadow(s.pool_id).expect("shadow");
                    let kv = KvAccess::new(
                        &mut s.pool,
                        &step,
                        AttentionCheck::Generations,
                        Some(shadow),
                        &hooks,
                        s.pool_id,
                        1,
                    );
                    black_box(kv.live(0));
                    black_box(kv.finish().len())
                });
            });
        }
    }
    group.finish();
}

criterion_group!(benches, step_checks);
criterion_main!(benches);
