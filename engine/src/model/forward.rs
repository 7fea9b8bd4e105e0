//! The Llama forward pass over the paged KV pool, for a batch of sequences
//! that each bring a chunk of new tokens (a prefill chunk, or one decode
//! token).
//!
//! ```text
//!  tokens of all chunks ──embed──▶ x [T × d]
//!  per layer:  xn = rmsnorm(x)            q,k,v = xn·Wq, xn·Wk, xn·Wv   (all T at once)
//!              rope(q,k) at each token's position
//!              K,V of token t ──▶ pool[block_table[pos / page_slots]][layer][slot = pos % page_slots]
//!              attention per chunk through its block table (decode chunks batched)
//!              x += attn·Wo ;  x += down(silu(xn·Wg) ⊙ xn·Wu)
//!  logits for the tokens that asked for them: rmsnorm(x)·Wout
//! ```

use kvsan_kernels::Exec;
use kvsan_kernels::attention::{self, DecodeSeq};
use kvsan_kernels::matmul::matmul;
use kvsan_kernels::ops;
use kvsan_sanitizer::PageRef;

use crate::EngineError;
use crate::faults::{self, Fault};
use crate::kv_pool::KvPool;
use crate::model::Model;

/// Chunks of more new tokens than this take the long-chunk KV store path
/// (the path fault `skip-layer-write` breaks).
pub const LONG_CHUNK_TOKENS: usize = 64;

/// The layers whose K/V a chunk of `chunk_tokens` new tokens stores in the
/// pool: what [`Model::forward`] writes and what the node reports to the
/// write hook, so the two never disagree.
///
/// Fault `skip-layer-write`: the long-chunk store path's layer loop stops
/// one layer short, so a long prefill chunk leaves the last layer's slots
/// holding whatever the page's previous owner wrote there.
#[must_use]
pub fn stored_layers(n_layers: usize, chunk_tokens: usize) -> std::ops::Range<usize> {
    if faults::active(Fault::SkipLayerWrite) && chunk_tokens > LONG_CHUNK_TOKENS {
        return 0..n_layers.saturating_sub(1);
    }
    0..n_layers
}

/// Which logits a chunk wants back.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Logits {
    /// None (a prefill chunk that is not the prompt's last).
    None,
    /// The chunk's last token (the next-token distribution).
    Last,
    /// Every token of the chunk (scoring, teacher forcing).
    All,
}

/// One sequence's share of a forward step.
#[derive(Clone, Copy, Debug)]
pub struct SeqChunk<'a> {
    /// The new tokens.
    pub tokens: &'a [u32],
    /// Position of `tokens[0]` in the sequence (tokens before it are in the pool).
    pub start_pos: usize,
    /// The sequence's pages, covering at least `start_pos + tokens.len()` positions.
    pub block_table: &'a [PageRef],
    /// Which logits to return.
    pub logits: Logits,
}

/// How attention reads the pool.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum AttentionCheck {
    /// Plain kernels (release builds).
    Unchecked,
    /// Kernels that compare every `PageRef`'s generation with the pool's
    /// before reading the page (debug builds).
    Generations,
}

/// Scratch for one step; sized for `t` tokens.
struct Scratch {
    x: Vec<f32>,
    xn: Vec<f32>,
    q: Vec<f32>,
    k: Vec<f32>,
    v: Vec<f32>,
    att: Vec<f32>,
    proj: Vec<f32>,
    gate: Vec<f32>,
    up: Vec<f32>,
}

impl Model {
    /// Runs one step over `chunks`, writing their K/V into `pool` and
    /// returning the requested logits, chunk by chunk, `vocab_size` values per
    /// token (for `Logits::All` every token of the chunk, for `Last` one).
    ///
    /// # Errors
    /// [`EngineError::InvalidBatch`] naming the chunk for a token id outside the
    /// vocabulary, a position past the context, or a block table that does not
    /// cover the chunk; [`EngineError::Attention`] when a checked kernel
    /// refuses a stale page reference.
    pub fn forward(
        &self,
        pool: &mut KvPool,
        chunks: &[SeqChunk<'_>],
        check: AttentionCheck,
    ) -> Result<Vec<f32>, EngineError> {
        let c = &self.config;
        self.validate_chunks(pool, chunks)?;
        let t_total: usize = chunks.iter().map(|ch| ch.tokens.len()).sum();
        if t_total == 0 {
            return Ok(Vec::new());
        }
        let (d, qd, kvd) = (c.d_model, c.q_dim(), c.kv_dim());
        let mut s = Scratch {
            x: vec![0.0; t_total * d],
            xn: vec![0.0; t_total * d],
            q: vec![0.0; t_total * qd],
            k: vec![0.0; t_total * kvd],
            v: vec![0.0; t_total * kvd],
            att: vec![0.0; t_total * qd],
            proj: vec![0.0; t_total * d],
            gate: vec![0.0; t_total * c.ffn_dim],
            up: vec![0.0; t_total * c.ffn_dim],
        };
        let tokens: Vec<u32> = chunks
            .iter()
            .flat_map(|ch| ch.tokens.iter().copied())
            .collect();
        let positions: Vec<usize> = chunks
            .iter()
            .flat_map(|ch| ch.start_pos..ch.start_pos + ch.tokens.len())
            .collect();
        let w = &self.weights;
        ops::embedding(&w.view(&w.token_embd), &tokens, &mut s.x);

        for (layer, lw) in w.layers.iter().enumerate() {
            ops::rms_norm(&s.x, &lw.attn_norm, c.rms_eps, &mut s.xn);
            matmul(&w.view(&lw.wq), &s.xn, t_total, &mut s.q);
            matmul(&w.view(&lw.wk), &s.xn, t_total, &mut s.k);
            matmul(&w.view(&lw.wv), &s.xn, t_total, &mut s.v);
            ops::rope_inplace(
                &mut s.q,
                c.n_heads,
                c.head_dim,
                c.rope_dim,
                &positions,
                c.rope_base,
            );
            ops::rope_inplace(
                &mut s.k,
                c.n_kv_heads,
                c.head_dim,
                c.rope_dim,
                &positions,
                c.rope_base,
            );
            self.store_kv(pool, chunks, layer, &s.k, &s.v);
            self.attend(pool, chunks, layer, &s.q, &mut s.att, check)?;
            matmul(&w.view(&lw.wo), &s.att, t_total, &mut s.proj);
            add_inplace(&mut s.x, &s.proj);

            ops::rms_norm(&s.x, &lw.ffn_norm, c.rms_eps, &mut s.xn);
            matmul(&w.view(&lw.w_gate), &s.xn, t_total, &mut s.gate);
            matmul(&w.view(&lw.w_up), &s.xn, t_total, &mut s.up);
            ops::swiglu(&mut s.gate, &s.up);
            matmul(&w.view(&lw.w_down), &s.gate, t_total, &mut s.proj);
            add_inplace(&mut s.x, &s.proj);
        }
        Ok(self.logits(chunks, &s.x))
    }

    fn validate_chunks(&self, pool: &KvPool, chunks: &[SeqChunk<'_>]) -> Result<(), EngineError> {
        let c = &self.config;
        let geom = pool.geometry();
        if geom.n_layers != c.n_layers
            || geom.n_kv_heads != c.n_kv_heads
            || geom.head_dim != c.head_dim
        {
            return Err(EngineError::InvalidBatch {
                chunk: 0,
                what: format!(
                    "KV pool geometry ({} layers, {} KV heads, head dim {}) does not fit the model ({}, {}, {})",
                    geom.n_layers,
                    geom.n_kv_heads,
                    geom.head_dim,
                    c.n_layers,
                    c.n_kv_heads,
                    c.head_dim
                ),
            });
        }
        for (i, ch) in chunks.iter().enumerate() {
            let end = ch.start_pos + ch.tokens.len();
            if let Some(&bad) = ch.tokens.iter().find(|&&t| t as usize >= c.vocab_size) {
                return Err(EngineError::InvalidBatch {
                    chunk: i,
                    what: format!(
                        "token id {bad} is outside the vocabulary of {}",
                        c.vocab_size
                    ),
                });
            }
            if end > c.context_length {
                return Err(EngineError::InvalidBatch {
                    chunk: i,
                    what: format!(
                        "positions up to {end} exceed the model's context of {} tokens",
                        c.context_length
                    ),
                });
            }
            if ch.block_table.len() * geom.page_slots < end {
                return Err(EngineError::InvalidBatch {
                    chunk: i,
                    what: format!(
                        "block table of {} pages × {} slots does not cover {end} positions",
                        ch.block_table.len(),
                        geom.page_slots
                    ),
                });
            }
            if let Some(bad) = ch
                .block_table
                .iter()
                .find(|r| r.page.0 as usize >= pool.n_pages())
            {
                return Err(EngineError::InvalidBatch {
                    chunk: i,
                    what: format!("{bad} is outside the pool of {} pages", pool.n_pages()),
                });
            }
        }
        Ok(())
    }

    /// Writes each new token's K and V of `layer` into its sequence's pages
    /// (for the chunks whose [`stored_layers`] include `layer`).
    fn store_kv(
        &self,
        pool: &mut KvPool,
        chunks: &[SeqChunk<'_>],
        layer: usize,
        k: &[f32],
        v: &[f32],
    ) {
        let kvd = self.config.kv_dim();
        let geom = *pool.geometry();
        let mut t = 0;
        for ch in chunks {
            if !stored_layers(self.config.n_layers, ch.tokens.len()).contains(&layer) {
                t += ch.tokens.len();
                continue;
            }
            for pos in ch.start_pos..ch.start_pos + ch.tokens.len() {
                let page = ch.block_table[pos / geom.page_slots].page;
                let slot = pos % geom.page_slots;
                let (kr, vr) = (&k[t * kvd..(t + 1) * kvd], &v[t * kvd..(t + 1) * kvd]);
                attention::kv_write(pool.data_mut(), &geom, page, slot, layer, kr, vr);
                t += 1;
            }
        }
    }

    /// Attention of every chunk's queries over its pages; decode chunks (one
    /// token) go through the batched decode kernel together.
    fn attend(
        &self,
        pool: &KvPool,
        chunks: &[SeqChunk<'_>],
        layer: usize,
        q: &[f32],
        att: &mut [f32],
        check: AttentionCheck,
    ) -> Result<(), EngineError> {
        let c = &self.config;
        let qd = c.q_dim();
        let scale = 1.0 / (c.head_dim as f32).sqrt();
        let geom = pool.geometry();
        let generations = match check {
            AttentionCheck::Unchecked => None,
            AttentionCheck::Generations => Some(pool.generations()),
        };
        let mut decode = Vec::new();
        let mut decode_rows = Vec::new();
        let mut t = 0;
        for ch in chunks {
            let n = ch.tokens.len();
            if n == 1 {
                decode.push(DecodeSeq {
                    q: &q[t * qd..(t + 1) * qd],
                    block_table: ch.block_table,
                    seq_len: ch.start_pos + 1,
                });
                decode_rows.push(t);
            } else if n > 1 {
                attention::prefill_impl(
                    Exec::global(),
                    pool.data(),
                    geom,
                    layer,
                    c.n_heads,
                    scale,
                    &q[t * qd..(t + n) * qd],
                    ch.block_table,
                    ch.start_pos,
                    n,
                    &mut att[t * qd..(t + n) * qd],
                    generations,
                )?;
            }
            t += n;
        }
        if !decode.is_empty() {
            let mut out = vec![0.0f32; decode.len() * qd];
            attention::decode_impl(
                Exec::global(),
                pool.data(),
                geom,
                layer,
                c.n_heads,
                scale,
                &decode,
                &mut out,
                generations,
            )?;
            for (i, &row) in decode_rows.iter().enumerate() {
                att[row * qd..(row + 1) * qd].copy_from_slice(&out[i * qd..(i + 1) * qd]);
            }
        }
        Ok(())
    }

    /// Final norm and output projection for the tokens that asked for logits.
    fn logits(&self, chunks: &[SeqChunk<'_>], x: &[f32]) -> Vec<f32> {
        let c = &self.config;
        let d = c.d_model;
        let mut rows = Vec::new();
        let mut t = 0;
        for ch in chunks {
            let n = ch.tokens.len();
            match ch.logits {
                Logits::None => {}
                Logits::Last if n > 0 => rows.push(t + n - 1),
                Logits::Last => {}
                Logits::All => rows.extend(t..t + n),
            }
            t += n;
        }
        if rows.is_empty() {
            return Vec::new();
        }
        let mut h = Vec::with_capacity(rows.len() * d);
        for &r in &rows {
            h.extend_from_slice(&x[r * d..(r + 1) * d]);
        }
        let mut hn = vec![0.0; h.len()];
        ops::rms_norm(&h, &self.weights.output_norm, c.rms_eps, &mut hn);
        let mut logits = vec![0.0; rows.len() * c.vocab_size];
        let out = self.weights.output_matrix();
        matmul(&self.weights.view(out), &hn, rows.len(), &mut logits);
        logits
    }
}

fn add_inplace(x: &mut [f32], y: &[f32]) {
    for (a, b) in x.iter_mut().zip(y) {
        *a += b;
    }
}
