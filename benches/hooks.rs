//! Microbenchmarks of the sanitizer's hot hooks, with a floor to compare to.
//!
//! ```text
//! cargo bench --bench hooks
//! ```
//!
//! - `baseline/atomic_load`: one relaxed atomic load (the cheapest check there is);
//! - `read/128_pages_written`: `read` of a fully written 128-page block table
//!   (throughput in pages, so criterion prints time per page);
//! - `write/1_slot_all_layers`: `write` of one fresh slot for all 30 layers;
//! - `alloc_free/page`: `alloc` then `free` of one page.
//!
//! Geometry: SmolLM2-135M (30 layers, 16-slot pages, 3 KV heads × 64 dims, f16).
//! Each timed call's verdict is consumed the way an engine does
//! (`is_continue()`), not copied out whole.

use std::hint::black_box;
use std::sync::atomic::{AtomicU64, Ordering};
use std::time::{Duration, Instant};

use criterion::{Criterion, Throughput, criterion_group, criterion_main};
use kvsan_sanitizer::{NodeRole, Owner, PageId, PageRef, PoolGeometry, Sanitizer};

const LAYERS: u32 = 30;
const SLOTS: u32 = 16;
const TABLE: u32 = 128;

fn sanitizer() -> (Sanitizer, kvsan_sanitizer::PoolId) {
    // A big quarantine would keep re-allocated pages out of Free; 0 frees at once.
    let options = kvsan_sanitizer::Options::parse("quarantine_pages=0").expect("valid options");
    let san = Sanitizer::with_writer(options, std::io::sink());
    let pool = san
        .pool_register(PoolGeometry {
            pages: 1024,
            page_slots: SLOTS,
            layers: LAYERS,
            bytes_per_slot: 2 * 3 * 64 * 2,
            role: NodeRole::Decode,
            node: "bench-0".into(),
        })
        .expect("geometry is valid");
    (san, pool)
}

fn baseline(c: &mut Criterion) {
    let word = AtomicU64::new(7);
    c.bench_function("baseline/atomic_load", |b| {
        b.iter(|| black_box(&word).load(Ordering::Relaxed))
    });
}

fn read(c: &mut Criterion) {
    let (san, pool) = sanitizer();
    let owner = Owner::new(1, 1);
    let table: Vec<PageRef> = (0..TABLE)
        .map(|p| {
            let (v, generation) = san.alloc(pool, PageId(p), owner, 0).expect("in range");
            assert!(v.is_continue());
            let page = PageRef {
                page: PageId(p),
                generation,
            };
            assert!(
                san.write(pool, owner, page, 0..SLOTS, 0..LAYERS, 0)
                    .expect("in range")
                    .is_continue()
            );
            page
        })
        .collect();
    let tokens = (TABLE * SLOTS) as usize;
    let mut group = c.benchmark_group("read");
    group.throughput(Throughput::Elements(u64::from(TABLE)));
    group.bench_function("128_pages_written", |b| {
        b.iter(|| {
            san.read(
                pool,
                owner,
                black_box(&table),
                black_box(tokens),
                0..LAYERS,
                1,
            )
            .expect("in range")
            .is_continue()
        })
    });
    group.finish();
}

/// Fresh writes: every timed write lands in a slot not yet written in its
/// page's generation (pages are re-allocated, untimed, between batches).
fn write(c: &mut Criterion) {
    let (san, pool) = sanitizer();
    let owner = Owner::new(1, 1);
    let pages = 1024u32;
    let mut table: Vec<PageRef> = Vec::new();
    let fresh = |table: &mut Vec<PageRef>| {
        for page in table.drain(..) {
            assert!(
                san.free(pool, owner, page, 0)
                    .expect("in range")
                    .is_continue()
            );
        }
        for p in 0..pages {
            let (v, generation) = san.alloc(pool, PageId(p), owner, 0).expect("in range");
            assert!(v.is_continue());
            table.push(PageRef {
                page: PageId(p),
                generation,
            });
        }
    };
    c.bench_function("write/1_slot_all_layers", |b| {
        b.iter_custom(|iters| {
            let mut total = Duration::ZERO;
            let mut done = 0u64;
            while done < iters {
                fresh(&mut table);
                let n = (iters - done).min(u64::from(pages * SLOTS));
                let start = Instant::now();
                for i in 0..n as u32 {
                    let slot = i % SLOTS;
                    let v = san
                        .write(
                            pool,
                            owner,
                            table[(i / SLOTS) as usize],
                            slot..slot + 1,
                            0..LAYERS,
                            1,
                        )
                        .expect("in range");
                    black_box(v.is_continue());
                }
                total += start.elapsed();
                done += n;
            }
            total
        })
    });
}

fn alloc_free(c: &mut Criterion) {
    let (san, pool) = sanitizer();
    let owner = Owner::new(1, 1);
    c.bench_function("alloc_free/page", |b| {
        b.iter(|| {
            let (v, generation) = san
                .alloc(pool, black_box(PageId(5)), owner, 0)
                .expect("in range");
            let f = san
                .free(
                    pool,
                    owner,
                    PageRef {
                        page: PageId(5),
                        generation,
                    },
                    0,
                )
                .expect("in range");
            v.is_continue() && f.is_continue()
        })
    });
}

criterion_group!(benches, baseline, read, write, alloc_free);
criterion_main!(benches);
