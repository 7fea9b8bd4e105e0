//! The forward pass over the paged KV pool, on the synthetic model: the same
//! logits whatever the chunking and page placement, and the checked kernels
//! refusing a stale page reference.

use kvsan_engine::EngineError;
use kvsan_engine::kv_pool::KvPool;
use kvsan_engine::model::{AttentionCheck, Logits, Model, SeqChunk, SyntheticSpec};
use kvsan_kernels::error::KernelError;
use kvsan_sanitizer::PageRef;

fn model() -> Model {
    SyntheticSpec::default().build().expect("synthetic model")
}

fn prompt(n: usize) -> Vec<u32> {
    (0..n).map(|i| ((i * 37 + 11) % 256) as u32).collect()
}

/// Logits of the last token after feeding `tokens` in chunks of `chunk`.
fn last_logits(
    model: &Model,
    pool: &mut KvPool,
    table: &[PageRef],
    tokens: &[u32],
    chunk: usize,
) -> Vec<f32> {
    let mut out = Vec::new();
    let mut pos = 0;
    for part in tokens.chunks(chunk) {
        let step = [SeqChunk {
            tokens: part,
            start_pos: pos,
            block_table: table,
            logits: Logits::Last,
        }];
        out = model
            .forward_chunks(pool, &step, AttentionCheck::Generations)
            .expect("forward");
        pos += part.len();
    }
    out
}

fn assert_same(a: &[f32], b: &[f32], what: &str) {
    assert_eq!(a.len(), b.len(), "{what}: lengths");
    let worst = a
        .iter()
        .zip(b)
        .map(|(x, y)| (x - y).abs())
        .fold(0.0f32, f32::max);
    // The kernels do the same arithmetic per token whatever the batch,
    // chunking or page placement: the logits are bit for bit equal.
    assert!(worst == 0.0, "{what}: logits differ by up to {worst}");
}

#[test]
fn chunked_prefill_and_token_by_token_decode_give_the_same_logits() {
    let model = model();
    let tokens = prompt(45);
    let mut results = Vec::new();
    for chunk in [45, 16, 7, 1] {
        let mut pool = KvPool::new(model.kv_geometry(8), 8).expect("pool");
        let table: Vec<_> = (0..6).map(|_| pool.alloc().expect("page")).collect();
        results.push((
            chunk,
            last_logits(&model, &mut pool, &table, &tokens, chunk),
        ));
    }
    for (chunk, logits) in &results[1..] {
        assert_same(
            &results[0].1,
            logits,
            &format!("chunk {chunk} vs whole prompt"),
        );
    }
}

#[test]
fn page_placement_does_not_change_the_logits() {
    let model = model();
    let tokens = prompt(30);
    let mut pool = KvPool::new(model.kv_geometry(4), 32).expect("pool");
    let contiguous: Vec<_> = (0..8).map(|_| pool.alloc().expect("page")).collect();
    let a = last_logits(&model, &mut pool, &contiguous, &tokens, 30);
    // Take the rest, keep every third page: a scattered, out-of-order table.
    let rest: Vec<_> = (0..24).map(|_| pool.alloc().expect("page")).collect();
    let scattered: Vec<_> = rest.iter().rev().step_by(3).copied().collect();
    let b = last_logits(&model, &mut pool, &scattered, &tokens, 30);
    assert_same(&a, &b, "scattered pages");
}

#[test]
fn batched_sequences_get_the_logits_they_get_alone() {
    let model = model();
    let (p1, p2) = (prompt(20), prompt(9));
    let mut pool = KvPool::new(model.kv_geometry(4), 16).expect("pool");
    let t1: Vec<_> = (0..6).map(|_| pool.alloc().expect("page")).collect();
    let t2: Vec<_> = (0..3).map(|_| pool.alloc().expect("page")).collect();
    let alone1 = last_logits(&model, &mut pool, &t1, &p1, 20);
    let alone2 = last_logits(&model, &mut pool, &t2, &p2, 9);
    // Same prompts again, prefilled together in one step with other pages.
    let u1: Vec<_> = (0..6).map(|_| pool.alloc().expect("page")).collect();
    let u2: Vec<_> = (0..1).map(|_| pool.alloc().expect("page")).collect();
    let mut u2 = u2;
    u2.extend(&t2[1..]);
    let step = [
        SeqChunk {
            tokens: &p1,
            start_pos: 0,
            block_table: &u1,
            logits: Logits::Last,
        },
        SeqChunk {
            tokens: &p2,
            start_pos: 0,
            block_table: &u2,
            logits: Logits::Last,
        },
    ];
    let both = model
        .forward_chunks(&mut pool, &step, AttentionCheck::Unchecked)
        .expect("forward");
    let vocab = model.config().vocab_size;
    assert_same(&both[..vocab], &alone1, "sequence 1 in a batch");
    assert_same(&both[vocab..], &alone2, "sequence 2 in a batch");
}

#[test]
fn checked_attention_refuses_a_page_freed_and_reallocated_since() {
    let model = model();
    let mut pool = KvPool::new(model.kv_geometry(4), 2).expect("pool");
    let table: Vec<_> = (0..2).map(|_| pool.alloc().expect("page")).collect();
    let tokens = prompt(6);
    last_logits(&model, &mut pool, &table, &tokens, 6);
    // Page 1 goes back and is handed out again: the old PageRef is stale.
    pool.free(table[1]).expect("free");
    let fresh = pool.alloc().expect("realloc");
    assert_eq!(fresh.page, table[1].page);
    assert_ne!(fresh.generation, table[1].generation);
    let step = [SeqChunk {
        tokens: &[5],
        start_pos: 6,
        block_table: &table,
        logits: Logits::Last,
    }];
    let err = model
        .forward_chunks(&mut pool, &step, AttentionCheck::Generations)
        .expect_err("stale page must be refused");
    match err {
        EngineError::Attention(KernelError::GenerationMismatch {
            page,
            found,
            current,
            ..
        }) => {
            assert_eq!(page, table[1].page);
            assert_eq!((found, current), (table[1].generation, fresh.generation));
        }
        other => panic!("unexpected error: {other}"),
    }
    // The legal neighbour: the current reference is read without complaint.
    let current = [table[0], fresh];
    let step = [SeqChunk {
        block_table: &current,
        ..step[0]
    }];
    model
        .forward_chunks(&mut pool, &step, AttentionCheck::Generations)
        .expect("current refs pass");
}

#[test]
fn a_batch_the_model_cannot_run_is_an_error_naming_the_chunk() {
    let model = model();
    let mut pool = KvPool::new(model.kv_geometry(4), 4).expect("pool");
    let table: Vec<_> = (0..2).map(|_| pool.alloc().expect("page")).collect();
    let ok = prompt(3);
    let cases: [(&[u32], usize, &str); 3] = [
        (&[300], 0, "outside the vocabulary of 256"),
        (&ok, 7, "does not cover 10 positions"),
        (&ok, 4094, "exceed the model's context of 4096"),
    ];
    for (tokens, start_pos, needle) in cases {
        let step = [
            SeqChunk {
                tokens: &ok,
                start_pos: 0,
                block_table: &table,
                logits: Logits::None,
            },
            SeqChunk {
                tokens,
                start_pos,
                block_table: &table,
                logits: Logits::Last,
            },
        ];
        let err = model
            .forward_chunks(&mut pool, &step, AttentionCheck::Unchecked)
            .expect_err(needle);
        let msg = err.to_string();
        assert!(msg.contains("chunk 1") && msg.contains(needle), "{msg}");
    }
}

#[test]
fn pages_are_reused_without_being_cleared() {
    let model = model();
    let mut pool = KvPool::new(model.kv_geometry(4), 1).expect("pool");
    let page = pool.alloc().expect("page");
    last_logits(&model, &mut pool, &[page], &prompt(4), 4);
    let written: Vec<_> = pool.data().to_vec();
    pool.free(page).expect("free");
    let again = pool.alloc().expect("realloc");
    assert_eq!(again.page, page.page);
    assert_eq!(again.generation.0, page.generation.0 + 1);
    assert_eq!(pool.data(), &written[..], "reuse must not zero the page");
}

#[test]
fn freeing_a_page_twice_or_with_a_stale_generation_is_refused() {
    let model = model();
    let mut pool = KvPool::new(model.kv_geometry(4), 1).expect("pool");
    let page = pool.alloc().expect("page");
    pool.free(page).expect("first free");
    let err = pool.free(page).expect_err("double free").to_string();
    assert!(err.contains("already free"), "{err}");
    let again = pool.alloc().expect("page");
    let again = if again.page == page.page {
        again
    } else {
        pool.alloc().expect("page")
    };
    let err = pool.free(page).expect_err("stale free").to_string();
    assert!(err.contains("current generation is"), "{err}");
    pool.free(again).expect("current free");
    assert_eq!(pool.free_pages(), 1);
}
