//! Whole-model speed on the default model (SmolLM2-135M Q4_1): prompt
//! processing of 512 and 2,048 tokens, decode at batch 1 and at batch 16.
//!
//! `cargo bench --bench model` prints tokens/s per run and the median of
//! `KVSAN_BENCH_RUNS` runs (default 5).
//!
//! `KVSAN_BENCH_SHAPE=KIND:N` runs one shape once and prints
//! `KIND:N <tokens/s>`: `pp:N` (a prompt of N tokens in one step), `tg:N`
//! (N decode steps after a 16-token prompt), `prefill:N` (a prompt of N
//! tokens in steps of 512), `decode:N` (32 decode steps after a prompt of
//! N tokens; N + 32 within the model's context), `batch:N` (N sequences decoding 64 steps each, after 16
//! prompt tokens each). `scripts/llamacpp-speed.py` runs llama.cpp and
//! this mode alternately, shape by shape, and reports the ratios.

mod common;

use std::time::Instant;

use kvsan_engine::fetch::ensure_default_model;
use kvsan_engine::kv_pool::KvPool;
use kvsan_engine::model::{AttentionCheck, Logits, Model, SeqChunk};
use kvsan_engine::sampler::argmax;
use kvsan_sanitizer::PageRef;

use common::{median, tokens};

const PAGE_SLOTS: usize = 16;

fn pages(pool: &mut KvPool, n_tokens: usize) -> Vec<PageRef> {
    (0..n_tokens.div_ceil(PAGE_SLOTS))
        .map(|_| pool.alloc().expect("pool sized for the run"))
        .collect()
}

/// Tokens/s of one prefill of `n` tokens in one step.
fn prompt_run(model: &Model, n: usize, seed: u64) -> f64 {
    let mut pool =
        KvPool::new(model.kv_geometry(PAGE_SLOTS), n.div_ceil(PAGE_SLOTS)).expect("pool");
    let table = pages(&mut pool, n);
    let prompt = tokens(n, seed);
    let step = [SeqChunk {
        tokens: &prompt,
        start_pos: 0,
        block_table: &table,
        logits: Logits::Last,
    }];
    let t = Instant::now();
    model
        .forward_chunks(&mut pool, &step, AttentionCheck::Unchecked)
        .expect("forward");
    n as f64 / t.elapsed().as_secs_f64()
}

/// Generated tokens/s of `batch` sequences decoding `steps` tokens each after a 16-token prompt.
fn decode_run(model: &Model, batch: usize, steps: usize, seed: u64) -> f64 {
    let prompt_len = 16;
    let per_seq = (prompt_len + steps).div_ceil(PAGE_SLOTS);
    let mut pool = KvPool::new(model.kv_geometry(PAGE_SLOTS), per_seq * batch).expect("pool");
    let tables: Vec<Vec<PageRef>> = (0..batch)
        .map(|_| pages(&mut pool, prompt_len + steps))
        .collect();
    let prompts: Vec<Vec<u32>> = (0..batch)
        .map(|b| tokens(prompt_len, seed + b as u64))
        .collect();
    let step: Vec<SeqChunk> = (0..batch)
        .map(|b| SeqChunk {
            tokens: &prompts[b],
            start_pos: 0,
            block_table: &tables[b],
            logits: Logits::Last,
        })
        .collect();
    let mut logits = model
        .forward_chunks(&mut pool, &step, AttentionCheck::Unchecked)
        .expect("prefill");
    let vocab = model.config().vocab_size;
    let t = Instant::now();
    for s in 0..steps {
        let next: Vec<u32> = logits.chunks_exact(vocab).map(argmax).collect();
        let step: Vec<SeqChunk> = (0..batch)
            .map(|b| SeqChunk {
                tokens: std::slice::from_ref(&next[b]),
                start_pos: prompt_len + s,
                block_table: &tables[b],
                logits: Logits::Last,
            })
            .collect();
        logits = model
            .forward_chunks(&mut pool, &step, AttentionCheck::Unchecked)
            .expect("decode");
    }
    (batch * steps) as f64 / t.elapsed().as_secs_f64()
}

/// Tokens/s of a prompt of `n` tokens computed in steps of `chunk`.
fn chunked_prompt_run(model: &Model, n: usize, chunk: usize, seed: u64) -> f64 {
    let mut pool =
        KvPool::new(model.kv_geometry(PAGE_SLOTS), n.div_ceil(PAGE_SLOTS)).expect("pool");
    let table = pages(&mut pool, n);
    let prompt = tokens(n, seed);
    let t = Instant::now();
    prefill(model, &mut pool, &prompt, &table, chunk);
    n as f64 / t.elapsed().as_secs_f64()
}

/// Computes `prompt` into the pages of `table` in steps of `chunk`
/// tokens; the last step's logits.
fn prefill(
    model: &Model,
    pool: &mut KvPool,
    prompt: &[u32],
    table: &[PageRef],
    chunk: usize,
) -> Vec<f32> {
    let mut logits = Vec::new();
    for start in (0..prompt.len()).step_by(chunk) {
        let end = (start + chunk).min(prompt.len());
        let step = [SeqChunk {
            tokens: &prompt[start..end],
            start_pos: start,
            block_table: table,
            logits: Logits::Last,
        }];
        logits = model
            .forward_chunks(pool, &step, AttentionCheck::Unchecked)
            .expect("prefill");
    }
    logits
}

/// Tokens/s of `steps` decode steps after a prompt of `context` tokens
/// (computed in steps of 512, not timed).
fn decode_at_run(model: &Model, context: usize, steps: usize, seed: u64) -> f64 {
    let n = context + steps;
    let mut pool =
        KvPool::new(model.kv_geometry(PAGE_SLOTS), n.div_ceil(PAGE_SLOTS)).expect("pool");
    let table = pages(&mut pool, n);
    let prompt = tokens(context, seed);
    let mut logits = prefill(model, &mut pool, &prompt, &table, 512);
    let t = Instant::now();
    for s in 0..steps {
        let next = argmax(&logits);
        let step = [SeqChunk {
            tokens: std::slice::from_ref(&next),
            start_pos: context + s,
            block_table: &table,
            logits: Logits::Last,
        }];
        logits = model
            .forward_chunks(&mut pool, &step, AttentionCheck::Unchecked)
            .expect("decode");
    }
    steps as f64 / t.elapsed().as_secs_f64()
}

/// `KVSAN_BENCH_SHAPE`'s one run.
fn shape_run(model: &Model, shape: &str) -> f64 {
    let (kind, n) = shape
        .split_once(':')
        .and_then(|(k, n)| Some((k, n.parse::<usize>().ok()?)))
        .unwrap_or_else(|| panic!("KVSAN_BENCH_SHAPE={shape}: want KIND:N"));
    match kind {
        "pp" => prompt_run(model, n, 1),
        "tg" => decode_run(model, 1, n, 1),
        "prefill" => chunked_prompt_run(model, n, 512, 1),
        "decode" => decode_at_run(model, n, 32, 1),
        "batch" => decode_run(model, n, 64, 1),
        _ => panic!("KVSAN_BENCH_SHAPE={shape}: KIND is pp, tg, prefill, decode or batch"),
    }
}

fn report(name: &str, runs: Vec<f64>) {
    let list: Vec<String> = runs.iter().map(|r| format!("{r:.1}")).collect();
    println!(
        "{name:<36} median {:>8.1} tokens/s   runs: {}",
        median(runs.clone()),
        list.join(" ")
    );
}

fn main() {
    // `cargo bench` passes `--bench`; a filter argument (as with `cargo test`) is ignored.
    let path = ensure_default_model(&mut |line| eprintln!("{line}")).expect("default model");
    let model = Model::load(path).expect("default model loads");
    if let Ok(shape) = std::env::var("KVSAN_BENCH_SHAPE") {
        prompt_run(&model, 64, 0); // warm-up
        println!("{shape} {:.2}", shape_run(&model, &shape));
        return;
    }
    let runs: usize = std::env::var("KVSAN_BENCH_RUNS")
        .ok()
        .and_then(|v| v.parse().ok())
        .unwrap_or(5);
    prompt_run(&model, 64, 0); // warm-up: page in the weights, start the pool
    report(
        "prompt processing, 512 tokens",
        (0..runs)
            .map(|r| prompt_run(&model, 512, r as u64))
            .collect(),
    );
    report(
        "prompt processing, 2048 tokens",
        (0..runs)
            .map(|r| prompt_run(&model, 2048, r as u64))
            .collect(),
    );
    report(
        "decode, batch 1, 128 tokens",
        (0..runs)
            .map(|r| decode_run(&model, 1, 128, r as u64))
            .collect(),
    );
    report(
        "decode, batch 16, 64 tokens each",
        (0..runs)
            .map(|r| decode_run(&model, 16, 64, r as u64))
            .collect(),
    );
}
