//! Greedy generation of the default model against llama.cpp's
//! (`tests/data/smollm2-q4_1-llamacpp.json`, the `greedy` list).
//!
//! Two checks per prompt:
//! - teacher-forced: with llama.cpp's tokens as the context, our arg-max at
//!   every step must be llama.cpp's token — except at a near tie: a step where
//!   llama.cpp's top-2 margin plus our margin the other way is below
//!   [`NEAR_TIE`] (float summation order decides such a step);
//! - free-running: our greedy generation (chunked prefill, then decode steps)
//!   through the engine must equal llama.cpp's for at least the first 32 tokens, or up to a step
//!   that the teacher-forced check showed to be such a near tie.

use kvsan_engine::fetch::ensure_default_model;
use std::sync::Arc;

use kvsan_engine::engine::{Engine, EngineConfig};
use kvsan_engine::kv_pool::KvPool;
use kvsan_engine::model::{AttentionCheck, Logits, Model, SeqChunk};
use kvsan_engine::request::Request;
use kvsan_engine::sampler::SamplingParams;
use kvsan_engine::scheduler::SchedulerConfig;
use kvsan_sanitizer::TenantId;
use serde_json::Value;

/// A step may differ from llama.cpp only when the two implementations' logit
/// gaps between the two candidate tokens add up to less than this.
///
/// Why this size: activations are quantized to 8 bits before every matrix
/// product (as llama.cpp does), so any two valid evaluation orders drift
/// apart. Measured on the golden prompts, the top-2 margin of this engine and
/// that of the same weights evaluated with f32 activations differ by 0.08
/// logits (median) and up to 0.59; this engine and llama.cpp differ by 0.10
/// (median) and up to 0.57. Confident steps have margins of 2 to 10 logits.
const NEAR_TIE: f32 = 0.6;
/// Tokens that must match exactly unless a near tie comes first.
const STRICT_PREFIX: usize = 32;

struct Golden {
    prompt: String,
    prompt_ids: Vec<u32>,
    ids: Vec<u32>,
    margins: Vec<f32>,
}

fn ids(v: &Value) -> Vec<u32> {
    v.as_array()
        .expect("id list")
        .iter()
        .map(|i| u32::try_from(i.as_u64().expect("id")).expect("u32 id"))
        .collect()
}

fn golden() -> Vec<Golden> {
    let json: Value =
        serde_json::from_str(include_str!("data/smollm2-q4_1-llamacpp.json")).expect("golden json");
    json["greedy"]
        .as_array()
        .expect("greedy list")
        .iter()
        .map(|g| Golden {
            prompt: g["prompt"].as_str().expect("prompt").to_owned(),
            prompt_ids: ids(&g["prompt_ids"]),
            ids: ids(&g["ids"]),
            margins: g["top1_top2_logit_margin"]
                .as_array()
                .expect("margins")
                .iter()
                .map(|m| m.as_f64().expect("margin") as f32)
                .collect(),
        })
        .collect()
}

fn model() -> Model {
    let path = ensure_default_model(&mut |line| eprintln!("{line}")).expect("default model");
    Model::load(path).expect("default model loads")
}

fn argmax(row: &[f32]) -> u32 {
    let mut best = 0;
    for (i, &v) in row.iter().enumerate() {
        if v > row[best] {
            best = i;
        }
    }
    best as u32
}

/// Our logits for every step of llama.cpp's continuation, with its tokens as context.
fn teacher_forced_logits(model: &Model, g: &Golden) -> Vec<Vec<f32>> {
    let tokens: Vec<u32> = g.prompt_ids.iter().chain(&g.ids).copied().collect();
    let page_slots = 16;
    let mut pool = KvPool::new(
        model.kv_geometry(page_slots),
        tokens.len().div_ceil(page_slots),
    )
    .expect("pool");
    let table: Vec<_> = (0..pool.n_pages())
        .map(|_| pool.alloc().expect("page"))
        .collect();
    let step = [SeqChunk {
        tokens: &tokens,
        start_pos: 0,
        block_table: &table,
        logits: Logits::All,
    }];
    let logits = model
        .forward_chunks(&mut pool, &step, AttentionCheck::Generations)
        .expect("forward");
    let vocab = model.config().vocab_size;
    (0..g.ids.len())
        .map(|i| {
            let row = g.prompt_ids.len() - 1 + i;
            logits[row * vocab..(row + 1) * vocab].to_vec()
        })
        .collect()
}

/// Steps where we pick another token than llama.cpp; panics unless each is a near tie.
fn near_tie_steps(g: &Golden, logits: &[Vec<f32>]) -> Vec<usize> {
    let mut ties = Vec::new();
    for (i, row) in logits.iter().enumerate() {
        let ours = argmax(row);
        let theirs = g.ids[i];
        if ours == theirs {
            continue;
        }
        let our_gap = row[ours as usize] - row[theirs as usize];
        assert!(
            g.margins[i] + our_gap < NEAR_TIE,
            "prompt {:?} step {i}: we pick {ours}, llama.cpp {theirs}; llama.cpp's margin {} \
             and ours {our_gap} — not a near tie",
            g.prompt,
            g.margins[i]
        );
        ties.push(i);
    }
    ties
}

#[test]
fn teacher_forced_argmax_equals_llamacpp_except_near_ties() {
    let model = model();
    let mut total_ties = 0;
    for g in golden() {
        let logits = teacher_forced_logits(&model, &g);
        let ties = near_tie_steps(&g, &logits);
        eprintln!(
            "{:?}: {} steps, near ties at {ties:?}",
            g.prompt,
            g.ids.len()
        );
        total_ties += ties.len();
    }
    // A handful of ties is float noise; many would mean a real numeric drift.
    let steps: usize = golden().iter().map(|g| g.ids.len()).sum();
    assert!(
        total_ties * 25 <= steps,
        "{total_ties} near-tie flips in {steps} steps"
    );
}

#[test]
fn greedy_generation_equals_llamacpp_for_the_first_32_tokens() {
    let model = Arc::new(model());
    // A step budget of 7 tokens: several prefill chunks, then decode steps.
    let cfg = EngineConfig {
        context: Some(4096),
        scheduler: SchedulerConfig {
            step_tokens: 7,
            max_running: 1,
            chunk_tokens: None,
        },
        ..EngineConfig::default()
    };
    let engine = Engine::unified(model.clone(), &cfg).expect("engine");
    for g in golden() {
        let request = Request {
            tenant: TenantId(0),
            prompt: g.prompt_ids.clone(),
            max_tokens: g.ids.len(),
            sampling: SamplingParams::greedy(),
            stop_tokens: vec![2],
            cache_salt: Default::default(),
        };
        let ids = engine.submit(request).wait().expect("generation").tokens;
        let first_diff = ids.iter().zip(&g.ids).position(|(a, b)| a != b);
        match first_diff {
            None => assert_eq!(ids.len(), g.ids.len(), "{:?}: length", g.prompt),
            Some(k) if k >= STRICT_PREFIX => {}
            Some(k) => {
                let logits = teacher_forced_logits(&model, &g);
                let ties = near_tie_steps(&g, &logits);
                assert!(
                    ties.first() == Some(&k),
                    "{:?}: differs from llama.cpp at token {k} (ours {:?}, theirs {:?}), \
                     which is not a near tie",
                    g.prompt,
                    &ids[..=k],
                    &g.ids[..=k]
                );
            }
        }
    }
}
