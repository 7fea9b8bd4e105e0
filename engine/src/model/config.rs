//! Model hyper-parameters, read from a GGUF file's `{arch}.*` keys.

use crate::EngineError;
use crate::gguf::GgufFile;

/// Architectures whose GGUF layout this engine runs (Llama-family: pre-norm,
/// RMSNorm, RoPE in GGML "normal" mode, SwiGLU, grouped-query attention).
pub const SUPPORTED_ARCHITECTURES: &[&str] = &["llama"];

/// The shape of a Llama-family model.
#[derive(Clone, Debug, PartialEq)]
pub struct ModelConfig {
    /// Transformer blocks.
    pub n_layers: usize,
    /// Embedding width.
    pub d_model: usize,
    /// Query heads.
    pub n_heads: usize,
    /// Key/value heads (grouped-query attention when fewer than `n_heads`).
    pub n_kv_heads: usize,
    /// Width of one head.
    pub head_dim: usize,
    /// Hidden width of the feed-forward block.
    pub ffn_dim: usize,
    /// Vocabulary size (rows of the token embedding).
    pub vocab_size: usize,
    /// Context window the model was trained for, in tokens.
    pub context_length: usize,
    /// RoPE frequency base.
    pub rope_base: f32,
    /// Dimensions of each head that RoPE rotates.
    pub rope_dim: usize,
    /// RMSNorm epsilon.
    pub rms_eps: f32,
}

impl ModelConfig {
    /// Reads the configuration of a Llama-family model from `file`.
    ///
    /// # Errors
    /// [`EngineError::ModelUnsupported`] for another architecture or RoPE
    /// scaling; [`EngineError::Gguf`] naming the key when one is missing or
    /// has the wrong type; [`EngineError::ModelInvalid`] for inconsistent values.
    pub fn from_gguf(file: &GgufFile) -> Result<ModelConfig, EngineError> {
        let arch = file.architecture()?;
        if !SUPPORTED_ARCHITECTURES.contains(&arch) {
            return Err(EngineError::ModelUnsupported {
                path: file.path().to_path_buf(),
                what: format!(
                    "architecture '{arch}' (supported: {})",
                    SUPPORTED_ARCHITECTURES.join(", ")
                ),
            });
        }
        let key = |k: &str| format!("{arch}.{k}");
        if let Some(kind) = file.get_str_opt(&key("rope.scaling.type"))?
            && kind != "none"
        {
            let factor = file
                .get_f32_opt(&key("rope.scaling.factor"))?
                .unwrap_or(1.0);
            if factor != 1.0 {
                return Err(EngineError::ModelUnsupported {
                    path: file.path().to_path_buf(),
                    what: format!(
                        "RoPE scaling '{kind}' with factor {factor} (only unscaled RoPE)"
                    ),
                });
            }
        }
        let d_model = file.get_usize(&key("embedding_length"))?;
        let n_heads = file.get_usize(&key("attention.head_count"))?;
        let n_kv_heads = match file.get_u32_opt(&key("attention.head_count_kv"))? {
            Some(n) => n as usize,
            None => n_heads,
        };
        let head_dim = match file.get_u32_opt(&key("attention.key_length"))? {
            Some(n) => n as usize,
            None if n_heads > 0 => d_model / n_heads,
            None => 0,
        };
        let rope_dim = match file.get_u32_opt(&key("rope.dimension_count"))? {
            Some(n) => n as usize,
            None => head_dim,
        };
        let vocab_size = file.tensor("token_embd.weight")?.n_rows();
        let config = ModelConfig {
            n_layers: file.get_usize(&key("block_count"))?,
            d_model,
            n_heads,
            n_kv_heads,
            head_dim,
            ffn_dim: file.get_usize(&key("feed_forward_length"))?,
            vocab_size,
            context_length: file.get_usize(&key("context_length"))?,
            rope_base: file
                .get_f32_opt(&key("rope.freq_base"))?
                .unwrap_or(10_000.0),
            rope_dim,
            rms_eps: file.get_f32(&key("attention.layer_norm_rms_epsilon"))?,
        };
        config
            .validate()
            .map_err(|what| EngineError::ModelInvalid {
                path: file.path().to_path_buf(),
                what,
            })?;
        Ok(config)
    }

    /// Checks that the values fit together; the message names the values.
    ///
    /// # Errors
    /// A description of the first inconsistency.
    pub fn validate(&self) -> Result<(), String> {
        let positive = [
            ("block_count", self.n_layers),
            ("embedding_length", self.d_model),
            ("attention.head_count", self.n_heads),
            ("attention.head_count_kv", self.n_kv_heads),
            ("head dimension", self.head_dim),
            ("feed_forward_length", self.ffn_dim),
            ("vocabulary size", self.vocab_size),
            ("context_length", self.context_length),
        ];
        if let Some((name, _)) = positive.iter().find(|(_, v)| *v == 0) {
            return Err(format!("{name} is 0"));
        }
        if !self.n_heads.is_multiple_of(self.n_kv_heads) {
            return Err(format!(
                "head_count {} is not a multiple of head_count_kv {}",
                self.n_heads, self.n_kv_heads
            ));
        }
        if !self.rope_dim.is_multiple_of(2) || self.rope_dim > self.head_dim {
            return Err(format!(
                "rope dimension {} must be even and at most the head dimension {}",
                self.rope_dim, self.head_dim
            ));
        }
        if !(self.rms_eps > 0.0 && self.rms_eps < 1.0) {
            return Err(format!("RMS epsilon {} is outside (0, 1)", self.rms_eps));
        }
        if !(self.rope_base > 1.0 && self.rope_base.is_finite()) {
            return Err(format!(
                "RoPE base {} must be finite and > 1",
                self.rope_base
            ));
        }
        Ok(())
    }

    /// Width of all query heads together.
    #[must_use]
    pub fn q_dim(&self) -> usize {
        self.n_heads * self.head_dim
    }

    /// Width of all key (or value) heads together.
    #[must_use]
    pub fn kv_dim(&self) -> usize {
        self.n_kv_heads * self.head_dim
    }
}
