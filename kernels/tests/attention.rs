//! Paged attention (decode and prefill, GQA, page boundaries, partial last
//! pages) against a plain reference, and the checked variants' refusals.

mod common;

use common::*;
use half::f16;
use kvsan_kernels::attention::{decode_impl, prefill_impl};
use kvsan_kernels::{
    DecodeSeq, Exec, Isa, KernelError, KvGeometry, ThreadPool, kv_write, paged_attention_decode,
    paged_attention_decode_checked, paged_attention_prefill_checked,
};
use kvsan_sanitizer::{Generation, PageId, PageRef};
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

/// A pool of N_PAGES pages full of random values (as a recycled pool is).
fn random_pool(seed: u64) -> Vec<f16> {
    let mut rng = rng(seed);
    (0..N_PAGES * GEOM.page_elems())
        .map(|_| f16::from_f32(rng.random_range(-1.0..1.0)))
        .collect()
}

fn table(pages: &[u32]) -> Vec<PageRef> {
    pages.iter().map(|&p| PageRef::new(p, 1)).collect()
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

#[test]
fn kv_write_stores_k_and_v_at_the_geometry_offset() {
    let mut pool = random_pool(20);
    let mut rng = rng(21);
    let k = random_f32(&mut rng, GEOM.slot_width(), 1.0);
    let v = random_f32(&mut rng, GEOM.slot_width(), 1.0);
    kv_write(&mut pool, &GEOM, PageId(7), 5, 1, &k, &v);
    let ko = GEOM.offset(PageId(7), 1, 0, 5);
    let vo = GEOM.offset(PageId(7), 1, 1, 5);
    assert_eq!(vo - ko, GEOM.page_slots * GEOM.slot_width());
    for i in 0..k.len() {
        assert_eq!(pool[ko + i], f16::from_f32(k[i]));
        assert_eq!(pool[vo + i], f16::from_f32(v[i]));
    }
}

#[test]
fn decode_matches_reference_across_page_boundaries_and_gqa() {
    let pool = random_pool(22);
    let mut rng = rng(23);
    let tables = [
        table(&[3]),
        table(&[7]),
        table(&[9, 2, 5]),
        table(&[0, 11, 4, 8, 1, 6, 10]),
    ];
    // 1 token, a full page, a partial third page, 100 tokens over 7 pages.
    let lens = [1usize, 16, 37, 100];
    let qs: Vec<Vec<f32>> = lens
        .iter()
        .map(|_| random_f32(&mut rng, N_HEADS * GEOM.head_dim, 2.0))
        .collect();
    let seqs: Vec<DecodeSeq> = (0..lens.len())
        .map(|i| DecodeSeq {
            q: &qs[i],
            block_table: &tables[i],
            seq_len: lens[i],
        })
        .collect();
    let scale = 1.0 / (GEOM.head_dim as f32).sqrt();
    let threads = ThreadPool::new(3);
    let qw = N_HEADS * GEOM.head_dim;
    for isa in Isa::all_available() {
        let mut out = vec![f32::NAN; seqs.len() * qw];
        decode_impl(
            Exec {
                pool: &threads,
                isa,
            },
            &pool,
            &GEOM,
            LAYER,
            N_HEADS,
            scale,
            &seqs,
            &mut out,
            None,
        )
        .unwrap();
        for (i, s) in seqs.iter().enumerate() {
            let want = reference(&pool, scale, s.q, s.block_table, s.seq_len);
            assert_near(
                &format!("{isa:?} seq {i} (len {})", s.seq_len),
                &out[i * qw..(i + 1) * qw],
                &want,
            );
        }
    }
    let mut global = vec![0.0; seqs.len() * qw];
    paged_attention_decode(&pool, &GEOM, LAYER, N_HEADS, scale, &seqs, &mut global);
    let mut checked = vec![0.0; seqs.len() * qw];
    let generations = vec![Generation(1); N_PAGES];
    paged_attention_decode_checked(
        &pool,
        &GEOM,
        LAYER,
        N_HEADS,
        scale,
        &seqs,
        &mut checked,
        &generations,
    )
    .unwrap();
    assert_eq!(global, checked, "checked and unchecked decode differ");
}

#[test]
fn prefill_is_causal_and_matches_reference_for_each_query() {
    let pool = random_pool(24);
    let mut rng = rng(25);
    let bt = table(&[6, 1, 10]);
    let scale = 0.125;
    let threads = ThreadPool::new(2);
    let qw = N_HEADS * GEOM.head_dim;
    // A first chunk crossing a page boundary, then a later chunk ending in a partial page.
    for (start_pos, n_new) in [(0usize, 20usize), (30, 5)] {
        let q = random_f32(&mut rng, n_new * qw, 2.0);
        for isa in Isa::all_available() {
            let mut out = vec![f32::NAN; n_new * qw];
            prefill_impl(
                Exec {
                    pool: &threads,
                    isa,
                },
                &pool,
                &GEOM,
                LAYER,
                N_HEADS,
                scale,
                &q,
                &bt,
                start_pos,
                n_new,
                &mut out,
                None,
            )
            .unwrap();
            for i in 0..n_new {
                let want = reference(
                    &pool,
                    scale,
                    &q[i * qw..(i + 1) * qw],
                    &bt,
                    start_pos + i + 1,
                );
                assert_near(
                    &format!("{isa:?} chunk at {start_pos}, query {i}"),
                    &out[i * qw..(i + 1) * qw],
                    &want,
                );
            }
        }
    }
}

#[test]
fn prefill_query_equals_decode_at_the_same_position() {
    let pool = random_pool(26);
    let mut rng = rng(27);
    let bt = table(&[2, 9, 4]);
    let qw = N_HEADS * GEOM.head_dim;
    let (start_pos, n_new) = (10, 25);
    let q = random_f32(&mut rng, n_new * qw, 1.0);
    let exec = Exec {
        pool: &ThreadPool::new(2),
        isa: Isa::detected(),
    };
    let mut pre = vec![0.0; n_new * qw];
    prefill_impl(
        exec, &pool, &GEOM, LAYER, N_HEADS, 0.1, &q, &bt, start_pos, n_new, &mut pre, None,
    )
    .unwrap();
    for i in [0, 5, 24] {
        let seq = DecodeSeq {
            q: &q[i * qw..(i + 1) * qw],
            block_table: &bt,
            seq_len: start_pos + i + 1,
        };
        let mut dec = vec![0.0; qw];
        decode_impl(
            exec,
            &pool,
            &GEOM,
            LAYER,
            N_HEADS,
            0.1,
            &[seq],
            &mut dec,
            None,
        )
        .unwrap();
        assert_eq!(&pre[i * qw..(i + 1) * qw], &dec[..], "query {i}");
    }
}

fn one_query() -> Vec<f32> {
    random_f32(&mut rng(28), N_HEADS * GEOM.head_dim, 1.0)
}

#[test]
fn checked_decode_refuses_a_stale_page_and_names_sequence_page_and_generations() {
    let pool = random_pool(29);
    let q = one_query();
    let fresh = table(&[3]);
    let mut stale = table(&[9, 2, 5]);
    stale[2].generation = Generation(1);
    let mut generations = vec![Generation(1); N_PAGES];
    generations[5] = Generation(2); // page 5 was freed and re-allocated
    let seqs = [
        DecodeSeq {
            q: &q,
            block_table: &fresh,
            seq_len: 3,
        },
        DecodeSeq {
            q: &q,
            block_table: &stale,
            seq_len: 37,
        },
    ];
    let mut out = vec![-7.0f32; 2 * N_HEADS * GEOM.head_dim];
    let err = paged_attention_decode_checked(
        &pool,
        &GEOM,
        LAYER,
        N_HEADS,
        0.1,
        &seqs,
        &mut out,
        &generations,
    )
    .unwrap_err();
    assert_eq!(
        err,
        KernelError::GenerationMismatch {
            seq: 1,
            index: 2,
            page: PageId(5),
            found: Generation(1),
            current: Generation(2)
        }
    );
    let msg = err.to_string();
    for part in ["sequence 1", "page 5", "generation 1", "generation 2"] {
        assert!(msg.contains(part), "{msg:?} lacks {part:?}");
    }
    assert!(
        out.iter().all(|&v| v == -7.0),
        "a refused call wrote output"
    );
}

#[test]
fn checked_decode_ignores_entries_past_the_tokens_it_reads() {
    let pool = random_pool(30);
    let q = one_query();
    let mut generations = vec![Generation(1); N_PAGES];
    generations[11] = Generation(3);
    let bt = table(&[9, 2, 11]); // page 11 is reserved for tokens 32.. but not read at length 32
    let seqs = [DecodeSeq {
        q: &q,
        block_table: &bt,
        seq_len: 32,
    }];
    let mut out = vec![0.0; N_HEADS * GEOM.head_dim];
    paged_attention_decode_checked(
        &pool,
        &GEOM,
        LAYER,
        N_HEADS,
        0.1,
        &seqs,
        &mut out,
        &generations,
    )
    .unwrap();
    let seqs = [DecodeSeq {
        q: &q,
        block_table: &bt,
        seq_len: 33,
    }];
    let err = paged_attention_decode_checked(
        &pool,
        &GEOM,
        LAYER,
        N_HEADS,
        0.1,
        &seqs,
        &mut out,
        &generations,
    );
    assert!(
        matches!(
            err,
            Err(KernelError::GenerationMismatch {
                page: PageId(11),
                ..
            })
        ),
        "{err:?}"
    );
}

#[test]
fn checked_decode_refuses_short_tables_and_pages_outside_the_pool() {
    let pool = random_pool(31);
    let q = one_query();
    let generations = vec![Generation(1); N_PAGES];
    let mut out = vec![0.0; N_HEADS * GEOM.head_dim];
    let short = table(&[1, 2]);
    let seqs = [DecodeSeq {
        q: &q,
        block_table: &short,
        seq_len: 40,
    }];
    assert_eq!(
        paged_attention_decode_checked(
            &pool,
            &GEOM,
            LAYER,
            N_HEADS,
            0.1,
            &seqs,
            &mut out,
            &generations
        ),
        Err(KernelError::BlockTableTooShort {
            seq: 0,
            seq_len: 40,
            pages_needed: 3,
            block_table_len: 2
        })
    );
    let outside = table(&[1, 99]);
    let seqs = [DecodeSeq {
        q: &q,
        block_table: &outside,
        seq_len: 20,
    }];
    assert_eq!(
        paged_attention_decode_checked(
            &pool,
            &GEOM,
            LAYER,
            N_HEADS,
            0.1,
            &seqs,
            &mut out,
            &generations
        ),
        Err(KernelError::PageOutOfRange {
            seq: 0,
            index: 1,
            page: PageId(99),
            n_pages: N_PAGES
        })
    );
    // A generation array shorter than the pool bounds the pages that can be checked.
    let inside = table(&[1, 8]);
    let seqs = [DecodeSeq {
        q: &q,
        block_table: &inside,
        seq_len: 20,
    }];
    assert_eq!(
        paged_attention_decode_checked(
            &pool,
            &GEOM,
            LAYER,
            N_HEADS,
            0.1,
            &seqs,
            &mut out,
            &generations[..8]
        ),
        Err(KernelError::PageOutOfRange {
            seq: 0,
            index: 1,
            page: PageId(8),
            n_pages: 8
        })
    );
}

#[test]
#[should_panic(expected = "names page 99 but the pool has 12 pages")]
fn unchecked_decode_panics_instead_of_reading_outside_the_pool() {
    let pool = random_pool(32);
    let q = one_query();
    let bt = table(&[99]);
    let seqs = [DecodeSeq {
        q: &q,
        block_table: &bt,
        seq_len: 1,
    }];
    let mut out = vec![0.0; N_HEADS * GEOM.head_dim];
    paged_attention_decode(&pool, &GEOM, LAYER, N_HEADS, 0.1, &seqs, &mut out);
}

#[test]
fn checked_prefill_refuses_a_stale_page_before_reading() {
    let pool = random_pool(33);
    let qw = N_HEADS * GEOM.head_dim;
    let q = random_f32(&mut rng(34), 4 * qw, 1.0);
    let bt = vec![PageRef::new(4, 1), PageRef::new(6, 5)];
    let mut generations = vec![Generation(1); N_PAGES];
    generations[6] = Generation(6);
    let mut out = vec![-1.0f32; 4 * qw];
    let err = paged_attention_prefill_checked(
        &pool,
        &GEOM,
        LAYER,
        N_HEADS,
        0.1,
        &q,
        &bt,
        14,
        4,
        &mut out,
        &generations,
    )
    .unwrap_err();
    assert_eq!(
        err,
        KernelError::GenerationMismatch {
            seq: 0,
            index: 1,
            page: PageId(6),
            found: Generation(5),
            current: Generation(6)
        }
    );
    assert!(out.iter().all(|&v| v == -1.0));
    generations[6] = Generation(5);
    paged_attention_prefill_checked(
        &pool,
        &GEOM,
        LAYER,
        N_HEADS,
        0.1,
        &q,
        &bt,
        14,
        4,
        &mut out,
        &generations,
    )
    .unwrap();
    assert!(out.iter().all(|v| v.is_finite()));
}
