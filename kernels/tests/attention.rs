//! The batch KV kernels: attention (decode and prefill rows in one batch,
//! GQA, page boundaries, partial last pages) against a plain reference; the
//! store through the slot mapping; and what the guard is asked — exactly the
//! pages, slots and layers each kernel touches — and what a refusal does.

mod common;

use std::sync::Mutex;

use common::*;
use half::f16;
use kvsan_ids::{Generation, PageId, PageRef};
use kvsan_kernels::guard::{Access, Reason, Refusal};
use kvsan_kernels::{
    Exec, GenerationChecked, Isa, KvBatch, KvGeometry, KvGuard, RowLedger, StoreSlot, ThreadPool,
    Unchecked, attend, store_kv,
};
use rand::Rng;

const GEOM: KvGeometry = KvGeometry {
    page_slots: 16,
    n_layers: 2,
    n_kv_heads: 2,
    head_dim: 72,
};
const N_HEADS: usize = 6;
const N_PAGES: usize = 12;
const LAYER: usize = 1;
const QW: usize = N_HEADS * GEOM.head_dim;

/// A pool of N_PAGES pages full of random values (as a recycled pool is).
fn random_pool(seed: u64) -> Vec<f16> {
    let mut rng = rng(seed);
    (0..N_PAGES * GEOM.page_elems())
        .map(|_| f16::from_f32(rng.random_range(-1.0..1.0)))
        .collect()
}

fn refs(pages: &[u32]) -> Vec<PageRef> {
    pages.iter().map(|&p| PageRef::new(p, 1)).collect()
}

/// Owned batch arrays built from per-row tables, lengths and new-token counts.
struct Batch {
    block_tables: Vec<PageRef>,
    width: usize,
    seq_lens: Vec<u32>,
    query_start: Vec<u32>,
    store_slots: Vec<StoreSlot>,
}

impl Batch {
    /// Row r: table `tables[r]`, context `lens[r]` of which the last
    /// `news[r]` are new (stored through the row's table).
    fn new(tables: &[Vec<PageRef>], lens: &[usize], news: &[usize]) -> Batch {
        let width = tables.iter().map(Vec::len).max().unwrap_or(0);
        let mut b = Batch {
            block_tables: Vec::new(),
            width,
            seq_lens: Vec::new(),
            query_start: vec![0],
            store_slots: Vec::new(),
        };
        for (r, t) in tables.iter().enumerate() {
            let mut row = t.clone();
            row.resize(width, PageRef::new(u32::MAX, 0));
            b.block_tables.extend(row);
            b.seq_lens.push(lens[r] as u32);
            for pos in lens[r] - news[r]..lens[r] {
                b.store_slots.push(StoreSlot {
                    page: t[pos / GEOM.page_slots],
                    slot: (pos % GEOM.page_slots) as u32,
                });
            }
            b.query_start.push(b.store_slots.len() as u32);
        }
        b
    }

    fn view(&self) -> KvBatch<'_> {
        KvBatch {
            block_tables: &self.block_tables,
            width: self.width,
            seq_lens: &self.seq_lens,
            query_start: &self.query_start,
            store_slots: &self.store_slots,
        }
    }
}

/// Plain attention of one query (`N_HEADS × head_dim`) over `len` tokens.
fn reference(pool: &[f16], scale: f32, q: &[f32], table: &[PageRef], len: usize) -> Vec<f64> {
    let hd = GEOM.head_dim;
    let group = N_HEADS / GEOM.n_kv_heads;
    let mut out = vec![0.0f64; N_HEADS * hd];
    let at = |kv: usize, t: usize, h: usize| {
        let o = GEOM.offset(
            table[t / GEOM.page_slots].page,
            LAYER,
            kv,
            t % GEOM.page_slots,
        ) + (h / group) * hd;
        &pool[o..o + hd]
    };
    for h in 0..N_HEADS {
        let qh = &q[h * hd..(h + 1) * hd];
        let scores: Vec<f64> = (0..len)
            .map(|t| {
                f64::from(scale)
                    * qh.iter()
                        .zip(at(0, t, h))
                        .map(|(&a, b)| f64::from(a) * f64::from(b.to_f32()))
                        .sum::<f64>()
            })
            .collect();
        let max = scores.iter().fold(f64::NEG_INFINITY, |m, &s| m.max(s));
        let sum: f64 = scores.iter().map(|s| (s - max).exp()).sum();
        for (t, s) in scores.iter().enumerate() {
            let p = (s - max).exp() / sum;
            for (o, v) in out[h * hd..(h + 1) * hd].iter_mut().zip(at(1, t, h)) {
                *o += p * f64::from(v.to_f32());
            }
        }
    }
    out
}

fn assert_near(what: &str, got: &[f32], want: &[f64]) {
    for (i, (&g, &w)) in got.iter().zip(want).enumerate() {
        // q is rounded to f16 before the dot product, as llama.cpp does.
        assert!(
            (f64::from(g) - w).abs() <= 2e-3,
            "{what}: element {i}: {g} vs {w}"
        );
    }
}

/// Decode rows of 1, 16, 37 and 100 tokens and a prefill row of 5 new
/// tokens after 14 (crossing a page), in one batch.
fn mixed() -> (Vec<Vec<PageRef>>, Vec<usize>, Vec<usize>) {
    let tables = vec![
        refs(&[3]),
        refs(&[7]),
        refs(&[9, 2, 5]),
        refs(&[0, 11, 4, 8, 1, 6, 10]),
        refs(&[6, 1]),
    ];
    // Row 3 prefills 20 tokens: two tiles of queries, the second partial.
    (tables, vec![1, 16, 37, 100, 19], vec![1, 1, 1, 20, 5])
}

fn run_attend(exec: Exec, pool: &[f16], b: &Batch, q: &[f32], guard: &impl KvGuard) -> Vec<f32> {
    let mut out = vec![-7.0f32; q.len()];
    attend(
        exec,
        pool,
        &GEOM,
        LAYER,
        N_HEADS,
        0.1,
        &b.view(),
        q,
        &mut out,
        guard,
    );
    out
}

#[test]
fn attention_over_a_mixed_batch_matches_the_reference_on_any_pool_and_isa() {
    let pool = random_pool(22);
    let (tables, lens, news) = mixed();
    let b = Batch::new(&tables, &lens, &news);
    let q = random_f32(&mut rng(23), b.store_slots.len() * QW, 2.0);
    let ledger = RowLedger::new(lens.len());
    let guard = Unchecked { ledger: &ledger };
    let global = run_attend(Exec::global(), &pool, &b, &q, &guard);
    let mut token = 0;
    for (r, t) in tables.iter().enumerate() {
        for i in 0..news[r] {
            let len = lens[r] - news[r] + i + 1;
            let want = reference(&pool, 0.1, &q[token * QW..(token + 1) * QW], t, len);
            assert_near(
                &format!("row {r} query {i}"),
                &global[token * QW..(token + 1) * QW],
                &want,
            );
            token += 1;
        }
    }
    let one = ThreadPool::new(1);
    for isa in Isa::all_available() {
        let got = run_attend(Exec { pool: &one, isa }, &pool, &b, &q, &guard);
        assert_near(
            &format!("{isa:?} on one thread"),
            &got,
            &global.iter().map(|&v| f64::from(v)).collect::<Vec<_>>(),
        );
    }
    assert!(ledger.refusals().is_empty());
}

#[test]
fn the_store_writes_each_token_where_its_slot_mapping_says_and_skips_padding() {
    let mut pool = random_pool(20);
    let before = pool.clone();
    let tables = vec![refs(&[7]), refs(&[2, 5])];
    let mut b = Batch::new(&tables, &[6, 20], &[1, 3]);
    // A padding token appended to row 1.
    b.store_slots.push(StoreSlot::PADDING);
    *b.query_start.last_mut().unwrap() += 1;
    b.seq_lens[1] += 1;
    let w = GEOM.slot_width();
    let n = b.store_slots.len();
    let k = random_f32(&mut rng(21), n * w, 1.0);
    let v = random_f32(&mut rng(24), n * w, 1.0);
    let ledger = RowLedger::new(2);
    store_kv(
        &mut pool,
        &GEOM,
        LAYER,
        &b.view(),
        &k,
        &v,
        &Unchecked { ledger: &ledger },
    );
    for (t, slot) in b.store_slots.iter().enumerate().take(n - 1) {
        let ko = GEOM.offset(slot.page.page, LAYER, 0, slot.slot as usize);
        let vo = GEOM.offset(slot.page.page, LAYER, 1, slot.slot as usize);
        for i in 0..w {
            assert_eq!(pool[ko + i], f16::from_f32(k[t * w + i]));
            assert_eq!(pool[vo + i], f16::from_f32(v[t * w + i]));
        }
    }
    let changed = pool.iter().zip(&before).filter(|(a, b)| a != b).count();
    assert!(
        changed <= 4 * 2 * w,
        "only the four real tokens' K and V change"
    );
    assert!(ledger.refusals().is_empty());
}

/// A question a guard was asked: (row, entry or token, page, layer or slot,
/// slots or layer), in the order of `KvGuard::read` / `KvGuard::store`.
type Asked = (usize, usize, PageRef, usize, usize);

/// A guard that records every question and refuses what it is told to.
struct Recording {
    reads: Mutex<Vec<Asked>>,
    stores: Mutex<Vec<Asked>>,
    refuse_page: Option<PageRef>,
    ledger: RowLedger,
}

impl Recording {
    fn new(rows: usize, refuse_page: Option<PageRef>) -> Recording {
        Recording {
            reads: Mutex::default(),
            stores: Mutex::default(),
            refuse_page,
            ledger: RowLedger::new(rows),
        }
    }

    fn allow(&self, row: usize, access: Access, page: PageRef) -> bool {
        if Some(page) != self.refuse_page {
            return true;
        }
        self.ledger.refuse(Refusal {
            row,
            access,
            page,
            reason: Reason::Checked,
        });
        false
    }
}

impl KvGuard for Recording {
    fn ledger(&self) -> &RowLedger {
        &self.ledger
    }
    fn read(&self, row: usize, entry: usize, page: PageRef, layer: usize, slots: usize) -> bool {
        self.reads
            .lock()
            .unwrap()
            .push((row, entry, page, layer, slots));
        self.allow(
            row,
            Access::Read {
                entry,
                layer,
                slots,
            },
            page,
        )
    }
    fn store(&self, row: usize, token: usize, page: PageRef, slot: usize, layer: usize) -> bool {
        self.stores
            .lock()
            .unwrap()
            .push((row, token, page, slot, layer));
        self.allow(row, Access::Store { token, layer, slot }, page)
    }
}

#[test]
fn attention_asks_about_exactly_the_pages_and_slots_each_task_reads() {
    let pool = random_pool(25);
    // Row 0 decodes at 37 tokens; row 1 prefills 20 tokens after 14.
    let tables = vec![refs(&[9, 2, 5]), refs(&[6, 1, 8])];
    let b = Batch::new(&tables, &[37, 34], &[1, 20]);
    let q = random_f32(&mut rng(26), b.store_slots.len() * QW, 1.0);
    let guard = Recording::new(b.seq_lens.len(), None);
    run_attend(Exec::global(), &pool, &b, &q, &guard);
    let mut reads = guard.reads.lock().unwrap().clone();
    reads.sort_by_key(|r| (r.0, r.1, r.4));
    reads.dedup();
    let p = |t: &Vec<PageRef>, i: usize| t[i];
    assert_eq!(
        reads,
        vec![
            // Row 0: pages 0, 1 whole, 5 slots of the third (37 = 16 + 16 + 5).
            (0, 0, p(&tables[0], 0), LAYER, 16),
            (0, 1, p(&tables[0], 1), LAYER, 16),
            (0, 2, p(&tables[0], 2), LAYER, 5),
            // Row 1: its first tile (the 16 queries at 14..30) reads up to
            // position 29, its second (queries 30..34) up to 33: page 0
            // whole, then 14 or 16 slots of page 1, and 2 of page 2.
            (1, 0, p(&tables[1], 0), LAYER, 16),
            (1, 1, p(&tables[1], 1), LAYER, 14),
            (1, 1, p(&tables[1], 1), LAYER, 16),
            (1, 2, p(&tables[1], 2), LAYER, 2),
        ]
    );
    // Every (task, page) asks once: a task reads every KV head of a page.
    assert_eq!(guard.reads.lock().unwrap().len(), 3 + 2 + 3);
}

#[test]
fn the_store_asks_about_each_token_with_its_page_slot_and_layer() {
    let mut pool = random_pool(27);
    let tables = vec![refs(&[4]), refs(&[6, 1])];
    let b = Batch::new(&tables, &[3, 18], &[1, 3]);
    let w = GEOM.slot_width();
    let kv = random_f32(&mut rng(28), 4 * w, 1.0);
    let guard = Recording::new(b.seq_lens.len(), None);
    store_kv(&mut pool, &GEOM, 0, &b.view(), &kv, &kv, &guard);
    assert_eq!(
        *guard.stores.lock().unwrap(),
        vec![
            (0, 0, PageRef::new(4, 1), 2, 0),
            (1, 1, PageRef::new(6, 1), 15, 0),
            (1, 2, PageRef::new(1, 1), 0, 0),
            (1, 3, PageRef::new(1, 1), 1, 0),
        ]
    );
}

#[test]
fn a_refused_read_stops_its_row_with_zero_output_and_leaves_the_others_exact() {
    let mut pool = random_pool(29);
    // Page 5 holds the poison: a read of it would turn the output NaN.
    let at = 5 * GEOM.page_elems();
    pool[at..at + GEOM.page_elems()].fill(f16::NAN);
    let tables = vec![refs(&[3]), refs(&[9, 2, 5]), refs(&[7])];
    let b = Batch::new(&tables, &[3, 37, 9], &[1, 1, 1]);
    let q = random_f32(&mut rng(30), 3 * QW, 1.0);
    let guard = Recording::new(3, Some(PageRef::new(5, 1)));
    let out = run_attend(Exec::global(), &pool, &b, &q, &guard);
    assert!(
        out[QW..2 * QW].iter().all(|&v| v == 0.0),
        "the refused row reads nothing"
    );
    for r in [0, 2] {
        let want = reference(
            &pool,
            0.1,
            &q[r * QW..(r + 1) * QW],
            &tables[r],
            b.seq_lens[r] as usize,
        );
        assert_near(&format!("row {r}"), &out[r * QW..(r + 1) * QW], &want);
    }
    let refusals = guard.ledger.refusals();
    assert_eq!(refusals.len(), 1);
    assert_eq!(refusals[0].row, 1);
    assert_eq!(
        refusals[0].access,
        Access::Read {
            entry: 2,
            layer: LAYER,
            slots: 5
        }
    );
}

#[test]
fn a_stale_tag_is_refused_by_the_generation_check_before_its_page_is_touched() {
    let mut pool = random_pool(31);
    let at = 5 * GEOM.page_elems();
    pool[at..at + GEOM.page_elems()].fill(f16::NAN);
    let mut generations = vec![Generation(1); N_PAGES];
    generations[5] = Generation(2); // freed and re-allocated since the tag
    let tables = vec![refs(&[3]), refs(&[9, 2, 5])];
    let b = Batch::new(&tables, &[3, 37], &[1, 1]);
    let q = random_f32(&mut rng(32), 2 * QW, 1.0);
    let ledger = RowLedger::new(2);
    let guard = GenerationChecked {
        ledger: &ledger,
        generations: &generations,
    };
    let out = run_attend(Exec::global(), &pool, &b, &q, &guard);
    assert!(out.iter().all(|v| v.is_finite()));
    assert!(out[QW..].iter().all(|&v| v == 0.0));
    assert_eq!(
        ledger.refusals(),
        vec![Refusal {
            row: 1,
            access: Access::Read {
                entry: 2,
                layer: LAYER,
                slots: 5
            },
            page: PageRef::new(5, 1),
            reason: Reason::Generation {
                current: Generation(2)
            },
        }]
    );
    // Its stores are skipped too once the row has stopped.
    let w = GEOM.slot_width();
    let before = pool.clone();
    let kv = vec![0.5f32; 2 * w];
    store_kv(&mut pool, &GEOM, LAYER, &b.view(), &kv, &kv, &guard);
    let at = GEOM.offset(PageId(5), LAYER, 0, 4);
    let bits = |p: &[f16]| {
        p[at..at + w]
            .iter()
            .map(|v| v.to_bits())
            .collect::<Vec<_>>()
    };
    assert_eq!(
        bits(&pool),
        bits(&before),
        "no store through the stopped row"
    );
}

#[test]
fn a_page_outside_the_pool_is_never_touched_even_unchecked() {
    let pool = random_pool(33);
    let tables = vec![
        refs(&[3]),
        vec![PageRef::new(2, 1), PageRef::new(N_PAGES as u32 + 4, 1)],
    ];
    let b = Batch::new(&tables, &[3, 20], &[1, 1]);
    let q = random_f32(&mut rng(34), 2 * QW, 1.0);
    let ledger = RowLedger::new(2);
    let out = run_attend(
        Exec::global(),
        &pool,
        &b,
        &q,
        &Unchecked { ledger: &ledger },
    );
    assert!(out[QW..].iter().all(|&v| v == 0.0));
    let refusals = ledger.refusals();
    assert_eq!(refusals.len(), 1);
    assert_eq!(refusals[0].reason, Reason::Outside { pages: N_PAGES });
    assert_eq!(refusals[0].row, 1);
}

#[test]
fn a_length_past_the_rows_width_reads_the_next_rows_entry_as_a_flat_array_does() {
    let pool = random_pool(35);
    let tables = vec![refs(&[3]), refs(&[8])];
    let mut b = Batch::new(&tables, &[3, 4], &[1, 1]);
    // Row 0 claims 20 tokens with one entry per row: entry 1 is row 1's entry 0.
    b.seq_lens[0] = 20;
    let q = random_f32(&mut rng(36), 2 * QW, 1.0);
    let guard = Recording::new(b.seq_lens.len(), None);
    run_attend(Exec::global(), &pool, &b, &q, &guard);
    let reads = guard.reads.lock().unwrap().clone();
    assert!(
        reads.contains(&(0, 1, PageRef::new(8, 1), LAYER, 4)),
        "the guard sees the page really read: {reads:?}"
    );
}

#[test]
fn mismatched_batch_arrays_are_refused_by_name() {
    let tables = vec![refs(&[3])];
    let mut b = Batch::new(&tables, &[3], &[2]);
    b.query_start.push(5);
    let err = b.view().validate().unwrap_err().to_string();
    assert!(err.contains("query_start"), "{err}");
    let mut b = Batch::new(&tables, &[3], &[2]);
    b.block_tables.push(PageRef::new(1, 1));
    let err = b.view().validate().unwrap_err().to_string();
    assert!(err.contains("block_tables has 2 entries"), "{err}");
    let mut b = Batch::new(&tables, &[3], &[2]);
    b.seq_lens[0] = 1;
    let err = b.view().validate().unwrap_err().to_string();
    assert!(err.contains("row 0 has 2 new tokens"), "{err}");
}

/// A long decode row is split by its keys across tasks (flash-decoding):
/// the output matches the reference, is the same bit for bit on one thread
/// and on two, and alone and beside another row; the guard is asked about
/// each page exactly once (a segment's task reads every KV head); a refused
/// page in the middle stops the row (zero output) and nothing else.
#[test]
fn a_long_decode_row_split_by_its_keys_matches_and_asks_about_each_page_once() {
    const PAGES: u32 = 48;
    let len: usize = 700; // 43 whole pages and 12 slots of the 44th
    let mut rng = rng(41);
    let pool: Vec<f16> = (0..PAGES as usize * GEOM.page_elems())
        .map(|_| f16::from_f32(rng.random_range(-1.0..1.0)))
        .collect();
    // Pages in a scattered order, as a recycled pool hands them out.
    let table: Vec<PageRef> = (0..len.div_ceil(GEOM.page_slots) as u32)
        .map(|i| PageRef::new((i * 7) % PAGES, 1))
        .collect();
    let short = refs(&[3, 5]);
    let b = Batch::new(&[table.clone(), short.clone()], &[len, 20], &[1, 1]);
    let q = random_f32(&mut rng, 2 * QW, 2.0);
    let two = ThreadPool::new(2);
    let one = ThreadPool::new(1);
    let isa = Isa::detected();
    let guard = Recording::new(2, None);
    let out = run_attend(Exec { pool: &two, isa }, &pool, &b, &q, &guard);
    assert_near(
        "split row",
        &out[..QW],
        &reference(&pool, 0.1, &q[..QW], &table, len),
    );
    let single = Recording::new(2, None);
    let on_one = run_attend(Exec { pool: &one, isa }, &pool, &b, &q, &single);
    assert_eq!(out, on_one, "one thread or two, the same bits");
    let alone_b = Batch::new(std::slice::from_ref(&table), &[len], &[1]);
    let alone = run_attend(
        Exec { pool: &two, isa },
        &pool,
        &alone_b,
        &q[..QW],
        &Recording::new(1, None),
    );
    assert_eq!(&out[..QW], &alone[..], "alone or in a batch, the same bits");
    let asked = |g: &Recording| {
        let mut r = g.reads.lock().unwrap().clone();
        r.sort_by_key(|a| (a.0, a.1, a.2.page.0, a.3, a.4));
        r
    };
    let reads = asked(&guard);
    assert_eq!(reads, asked(&single));
    assert_eq!(reads.len(), table.len() + short.len());
    for (entry, page) in table.iter().enumerate() {
        let slots = (len - entry * GEOM.page_slots).min(GEOM.page_slots);
        let n = reads
            .iter()
            .filter(|r| *r == &(0, entry, *page, LAYER, slots))
            .count();
        assert_eq!(n, 1, "entry {entry}");
    }
    let refused = table[20];
    let guard = Recording::new(2, Some(refused));
    let stopped = run_attend(Exec { pool: &two, isa }, &pool, &b, &q, &guard);
    assert!(
        stopped[..QW].iter().all(|&v| v == 0.0),
        "the refused row reads nothing"
    );
    assert_eq!(&stopped[QW..], &out[QW..], "the other row is exact");
    assert_eq!(guard.ledger.refusals().len(), 1);
}

/// A batch of one short row (one task's worth) is split by KV heads so the
/// threads share it: the output matches the reference and is the same bits
/// on one thread, and each page is asked about once per KV head.
#[test]
fn a_lone_short_row_is_split_by_kv_heads_and_matches() {
    let pool = random_pool(27);
    let table = refs(&[4, 9, 2]);
    let b = Batch::new(std::slice::from_ref(&table), &[37], &[1]);
    let q = random_f32(&mut rng(28), QW, 1.0);
    let guard = Recording::new(1, None);
    let two = ThreadPool::new(2);
    let out = run_attend(
        Exec {
            pool: &two,
            isa: Isa::detected(),
        },
        &pool,
        &b,
        &q,
        &guard,
    );
    assert_near("lone row", &out, &reference(&pool, 0.1, &q, &table, 37));
    let one = ThreadPool::new(1);
    let single = Recording::new(1, None);
    let on_one = run_attend(
        Exec {
            pool: &one,
            isa: Isa::detected(),
        },
        &pool,
        &b,
        &q,
        &single,
    );
    assert_eq!(out, on_one, "one thread or two, the same bits");
    assert_eq!(guard.reads.lock().unwrap().len(), GEOM.n_kv_heads * 3);
}

/// A query's output does not depend on how its prompt was chunked: the
/// query at position 616 (617 keys, a long row) computed last in a step of
/// 17 new tokens (alone in its tile of queries), second-to-last in a step
/// of 18 (a tile of two), first in a step of 2, and as a decode row of its
/// own — the same bits every time; likewise a short query (at 300) in
/// tiles of different sizes.
#[test]
fn a_query_is_the_same_bits_however_its_prompt_was_chunked() {
    const PAGES: u32 = 48;
    let mut rng = rng(43);
    let pool: Vec<f16> = (0..PAGES as usize * GEOM.page_elems())
        .map(|_| f16::from_f32(rng.random_range(-1.0..1.0)))
        .collect();
    let table: Vec<PageRef> = (0..40u32)
        .map(|i| PageRef::new((i * 5) % PAGES, 1))
        .collect();
    // One query vector per position, whatever step it is computed in.
    let q_at: Vec<Vec<f32>> = (0..640).map(|_| random_f32(&mut rng, QW, 2.0)).collect();
    let two = ThreadPool::new(2);
    for isa in Isa::all_available() {
        let exec = Exec { pool: &two, isa };
        // Positions `pos..len` new in one step; returns query `at`'s output.
        let run = |len: usize, news: usize, at: usize| {
            let b = Batch::new(std::slice::from_ref(&table), &[len], &[news]);
            let q: Vec<f32> = (len - news..len).flat_map(|p| q_at[p].clone()).collect();
            let ledger = RowLedger::new(1);
            let out = run_attend(exec, &pool, &b, &q, &Unchecked { ledger: &ledger });
            let i = at - (len - news);
            out[i * QW..(i + 1) * QW].to_vec()
        };
        let long = 616;
        let want = run(long + 1, 1, long);
        assert_near(
            &format!("position {long} on {isa:?}"),
            &want,
            &reference(&pool, 0.1, &q_at[long], &table, long + 1),
        );
        for (len, news) in [(617, 17), (618, 18), (618, 2), (620, 40), (640, 100)] {
            assert_eq!(
                run(len, news, long),
                want,
                "position {long}, step of {news} new up to {len}, on {isa:?}"
            );
        }
        let short = 300;
        let want = run(short + 1, 1, short);
        for (len, news) in [(301, 17), (302, 18), (310, 30), (600, 310)] {
            assert_eq!(
                run(len, news, short),
                want,
                "position {short}, step of {news} new up to {len}, on {isa:?}"
            );
        }
    }
}
