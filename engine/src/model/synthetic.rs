//! The synthetic model: random weights from a seed, any small geometry,
//! run by the same forward pass as a real model — for fast tests.

use kvsan_kernels::DType;
use rand::{RngExt, SeedableRng};
use rand_chacha::ChaCha8Rng;

use crate::EngineError;
use crate::model::Model;
use crate::model::config::ModelConfig;
use crate::model::weights::{LayerWeights, Matrix, Weights};

/// The shape and seed of a synthetic model.
#[derive(Clone, Debug, PartialEq)]
pub struct SyntheticSpec {
    /// Seed of the weights.
    pub seed: u64,
    /// Transformer blocks.
    pub n_layers: usize,
    /// Embedding width (a multiple of 32 for quantized weights).
    pub d_model: usize,
    /// Query heads.
    pub n_heads: usize,
    /// Key/value heads.
    pub n_kv_heads: usize,
    /// Feed-forward width (a multiple of 32 for quantized weights).
    pub ffn_dim: usize,
    /// Vocabulary size.
    pub vocab_size: usize,
    /// Context window.
    pub context_length: usize,
    /// Element type of the matrices.
    pub dtype: DType,
}

impl Default for SyntheticSpec {
    /// A tiny model: 2 layers, width 64, 4 heads over 2 KV heads, 256 tokens.
    fn default() -> Self {
        SyntheticSpec {
            seed: 0x006b_7673_616e,
            n_layers: 2,
            d_model: 64,
            n_heads: 4,
            n_kv_heads: 2,
            ffn_dim: 128,
            vocab_size: 256,
            context_length: 4096,
            dtype: DType::Q8_0,
        }
    }
}

impl SyntheticSpec {
    /// Builds the model.
    ///
    /// # Errors
    /// [`EngineError::ModelInvalid`] when the geometry is inconsistent (heads
    /// that do not divide the width, widths that are not whole blocks of
    /// `dtype`).
    pub fn build(&self) -> Result<Model, EngineError> {
        let invalid = |what: String| EngineError::ModelInvalid {
            path: "<synthetic>".into(),
            what,
        };
        if self.n_heads == 0 || !self.d_model.is_multiple_of(self.n_heads) {
            return Err(invalid(format!(
                "width {} is not a multiple of {} heads",
                self.d_model, self.n_heads
            )));
        }
        let head_dim = self.d_model / self.n_heads;
        let config = ModelConfig {
            n_layers: self.n_layers,
            d_model: self.d_model,
            n_heads: self.n_heads,
            n_kv_heads: self.n_kv_heads,
            head_dim,
            ffn_dim: self.ffn_dim,
            vocab_size: self.vocab_size,
            context_length: self.context_length,
            rope_base: 10_000.0,
            rope_dim: head_dim,
            rms_eps: 1e-5,
        };
        config.validate().map_err(invalid)?;
        for (what, cols) in [
            ("width", self.d_model),
            ("feed-forward width", self.ffn_dim),
        ] {
            if self.dtype.row_bytes(cols).is_none() {
                return Err(invalid(format!(
                    "{what} {cols} is not a whole number of {} blocks of {}",
                    self.dtype,
                    self.dtype.block_elems()
                )));
            }
        }
        let mut rng = ChaCha8Rng::seed_from_u64(self.seed);
        let mut mat = |rows: usize, cols: usize| {
            let scale = 1.0 / (cols as f32).sqrt();
            let v: Vec<f32> = (0..rows * cols)
                .map(|_| rng.random_range(-scale..scale) * 1.7)
                .collect();
            Matrix::quantized(self.dtype, rows, cols, &v)
        };
        let (d, qd, kvd, f) = (
            config.d_model,
            config.q_dim(),
            config.kv_dim(),
            config.ffn_dim,
        );
        let token_embd = mat(config.vocab_size, d);
        let mut layers = Vec::with_capacity(config.n_layers);
        for _ in 0..config.n_layers {
            layers.push(LayerWeights {
                attn_norm: vec![1.0; d],
                wq: mat(qd, d),
                wk: mat(kvd, d),
                wv: mat(kvd, d),
                wo: mat(d, qd),
                ffn_norm: vec![1.0; d],
                w_gate: mat(f, d),
                w_up: mat(f, d),
                w_down: mat(d, f),
            });
        }
        let output = mat(config.vocab_size, d);
        let weights = Weights::owned(token_embd, vec![1.0; d], Some(output), layers);
        Ok(Model::from_parts(config, weights))
    }
}
