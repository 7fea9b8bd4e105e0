//! The Llama forward pass over the paged KV pool, for one step's batch of
//! rows that each bring new tokens (a prefill chunk, or one decode token).
//!
//! ```text
//!  the step's tokens ──embed──▶ x [T × d]
//!  per layer:  xn = rmsnorm(x)            q,k,v = xn·Wq, xn·Wk, xn·Wv   (all T at once)
//!              rope(q,k) at each token's position
//!              kv.store(layer, k, v)      K,V of token t ──▶ its store slot (page, slot)
//!              kv.attend(layer, q)        every row over its pages, through the batch's block-table array
//!              x += attn·Wo ;  x += down(silu(xn·Wg) ⊙ xn·Wu)
//!  logits for the rows that ask for them: rmsnorm(x)·Wout
//! ```
//!
//! The pool is reached only through [`KvAccess`], which runs the batch KV
//! kernels with the step's guard (see [`crate::kv_access`]).

use kvsan_kernels::matmul::matmul;
use kvsan_kernels::ops;

use kvsan_kernels::error::KernelError;
use kvsan_kernels::guard::{Access, Reason, Refusal};
use kvsan_sanitizer::PoolId;

use crate::EngineError;
use crate::hooks::Hooks;
use crate::kv_access::{AttentionCheck, KvAccess, Logits, RowFault, SeqChunk, StepBatch};
use crate::kv_pool::KvPool;
use crate::model::Model;

mod faults;
pub use self::faults::LONG_CHUNK_TOKENS;

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
    /// Runs one step over `kv`'s batch, storing its K/V and attending
    /// through `kv`, and returns the logits its rows ask for, row by row,
    /// `vocab_size` values per token (for `Logits::All` every token of the
    /// row, for `Last` one). Rows `kv` stopped still get logits (of no use).
    ///
    /// # Errors
    /// [`EngineError::InvalidBatch`] naming the row for a token id outside
    /// the vocabulary, a position past the context, or a pool geometry that
    /// does not fit the model; nothing is computed then.
    pub fn forward(&self, kv: &mut KvAccess<'_>) -> Result<Vec<f32>, EngineError> {
        let c = &self.config;
        self.validate_batch(kv)?;
        let t_total = kv.batch().tokens.len();
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
        let scale = 1.0 / (c.head_dim as f32).sqrt();
        let w = &self.weights;
        ops::embedding(&w.view(&w.token_embd), &kv.batch().tokens, &mut s.x);
        let positions = kv.batch().positions.clone();
        // Rows whose KV store a layer skips: none (a fail point may mark some).
        let mut skip = vec![false; kv.batch().rows()];

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
            faults::skip_layer_write(layer, c.n_layers, kv.batch(), &mut skip);
            kv.store(layer, &s.k, &s.v, &skip);
            kv.attend(layer, c.n_heads, scale, &s.q, &mut s.att);
            matmul(&w.view(&lw.wo), &s.att, t_total, &mut s.proj);
            add_inplace(&mut s.x, &s.proj);

            ops::rms_norm(&s.x, &lw.ffn_norm, c.rms_eps, &mut s.xn);
            matmul(&w.view(&lw.w_gate), &s.xn, t_total, &mut s.gate);
            matmul(&w.view(&lw.w_up), &s.xn, t_total, &mut s.up);
            ops::swiglu(&mut s.gate, &s.up);
            matmul(&w.view(&lw.w_down), &s.gate, t_total, &mut s.proj);
            add_inplace(&mut s.x, &s.proj);
        }
        Ok(self.logits(kv, &s.x))
    }

    /// Runs one step over `chunks` on `pool` outside a node (no hooks; the
    /// kernels checked as `check` says): the batch is built plainly from
    /// the chunks ([`StepBatch::of_chunks`]).
    ///
    /// # Errors
    /// [`EngineError::InvalidBatch`] as for [`Model::forward`] or for a block
    /// table that does not cover its chunk; [`EngineError::Attention`] for
    /// the first chunk whose access the kernels refused (a stale tag, a page
    /// outside the pool), naming the chunk as its sequence.
    pub fn forward_chunks(
        &self,
        pool: &mut KvPool,
        chunks: &[SeqChunk<'_>],
        check: AttentionCheck,
    ) -> Result<Vec<f32>, EngineError> {
        self.validate_chunks(chunks)?;
        let batch = StepBatch::of_chunks(chunks, pool.page_slots())?;
        let hooks = Hooks::none();
        let mut kv = KvAccess::new(pool, &batch, check, None, &hooks, PoolId(0), 0);
        let logits = self.forward(&mut kv)?;
        match kv.finish().into_iter().next() {
            None => Ok(logits),
            Some((_, RowFault::Generation(r) | RowFault::Outside(r))) => Err(refusal_error(&r)),
            Some((row, fault)) => Err(EngineError::InvalidBatch {
                chunk: row,
                what: format!("refused: {fault:?}"),
            }),
        }
    }

    /// Token ids and positions of `chunks` within the model.
    fn validate_chunks(&self, chunks: &[SeqChunk<'_>]) -> Result<(), EngineError> {
        let c = &self.config;
        for (i, ch) in chunks.iter().enumerate() {
            if let Some(&bad) = ch.tokens.iter().find(|&&t| t as usize >= c.vocab_size) {
                return Err(EngineError::InvalidBatch {
                    chunk: i,
                    what: format!(
                        "token id {bad} is outside the vocabulary of {}",
                        c.vocab_size
                    ),
                });
            }
            let end = ch.start_pos + ch.tokens.len();
            if end > c.context_length {
                return Err(EngineError::InvalidBatch {
                    chunk: i,
                    what: format!(
                        "positions up to {end} exceed the model's context of {} tokens",
                        c.context_length
                    ),
                });
            }
        }
        Ok(())
    }

    fn validate_batch(&self, kv: &KvAccess<'_>) -> Result<(), EngineError> {
        let c = &self.config;
        let geom = kv.geometry();
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
        let b = kv.batch();
        b.kernel_view()
            .validate()
            .map_err(|e| EngineError::InvalidBatch {
                chunk: 0,
                what: e.to_string(),
            })?;
        if b.tokens.len() != b.store_slots.len() || b.positions.len() != b.tokens.len() {
            return Err(EngineError::InvalidBatch {
                chunk: 0,
                what: format!(
                    "{} tokens, {} positions and {} store slots",
                    b.tokens.len(),
                    b.positions.len(),
                    b.store_slots.len()
                ),
            });
        }
        for r in 0..b.rows() {
            let tokens = b.row_tokens(r);
            if let Some(&bad) = b.tokens[tokens.clone()]
                .iter()
                .find(|&&t| t as usize >= c.vocab_size)
            {
                return Err(EngineError::InvalidBatch {
                    chunk: r,
                    what: format!(
                        "token id {bad} is outside the vocabulary of {}",
                        c.vocab_size
                    ),
                });
            }
            if let Some(&end) = b.positions[tokens].iter().max()
                && end >= c.context_length
            {
                return Err(EngineError::InvalidBatch {
                    chunk: r,
                    what: format!(
                        "positions up to {} exceed the model's context of {} tokens",
                        end + 1,
                        c.context_length
                    ),
                });
            }
        }
        Ok(())
    }

    /// Final norm and output projection for the tokens that asked for logits.
    fn logits(&self, kv: &KvAccess<'_>, x: &[f32]) -> Vec<f32> {
        let c = &self.config;
        let d = c.d_model;
        let b = kv.batch();
        let mut rows = Vec::new();
        for r in 0..b.rows() {
            let tokens = b.row_tokens(r);
            match b.logits[r] {
                Logits::None => {}
                Logits::Last if !tokens.is_empty() => rows.push(tokens.end - 1),
                Logits::Last => {}
                Logits::All => rows.extend(tokens),
            }
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

/// The kernel error a refusal of a plainly built batch stands for.
fn refusal_error(r: &Refusal) -> EngineError {
    let index = match r.access {
        Access::Read { entry, .. } => entry,
        Access::Store { token, .. } => token,
    };
    EngineError::Attention(match r.reason {
        Reason::Generation { current } => KernelError::GenerationMismatch {
            seq: r.row,
            index,
            page: r.page.page,
            found: r.page.generation,
            current,
        },
        Reason::Outside { pages } => KernelError::PageOutOfRange {
            seq: r.row,
            index,
            page: r.page.page,
            n_pages: pages,
        },
        Reason::Checked => KernelError::BatchShape {
            what: format!("row {} refused: {:?}", r.row, r.access),
        },
    })
}

fn add_inplace(x: &mut [f32], y: &[f32]) {
    for (a, b) in x.iter_mut().zip(y) {
        *a += b;
    }
}
