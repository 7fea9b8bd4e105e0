//! The model: configuration, weights and the forward pass.

pub mod config;
pub mod forward;
pub mod synthetic;
pub mod weights;

use std::path::Path;

use kvsan_kernels::attention::KvGeometry;

pub use crate::kv_access::{AttentionCheck, Logits, SeqChunk};
pub use config::ModelConfig;
pub use synthetic::SyntheticSpec;
pub use weights::Weights;

use crate::EngineError;
use crate::gguf::GgufFile;

/// A Llama-family model ready to run.
#[derive(Debug)]
pub struct Model {
    config: ModelConfig,
    weights: Weights,
}

impl Model {
    /// Loads a GGUF model (memory-mapped).
    ///
    /// # Errors
    /// Any [`EngineError`] of [`GgufFile::open`], [`ModelConfig::from_gguf`] or
    /// [`Weights::from_gguf`], each naming the file and the bad key or tensor.
    pub fn load(path: impl AsRef<Path>) -> Result<Model, EngineError> {
        let file = GgufFile::open(path)?;
        let config = ModelConfig::from_gguf(&file)?;
        let weights = Weights::from_gguf(file, &config)?;
        Ok(Model { config, weights })
    }

    /// A model from parts (the synthetic model).
    #[must_use]
    pub fn from_parts(config: ModelConfig, weights: Weights) -> Model {
        Model { config, weights }
    }

    /// The model's configuration.
    #[must_use]
    pub fn config(&self) -> &ModelConfig {
        &self.config
    }

    /// The model's weights.
    #[must_use]
    pub fn weights(&self) -> &Weights {
        &self.weights
    }

    /// The KV page geometry of this model with `page_slots` tokens per page.
    #[must_use]
    pub fn kv_geometry(&self, page_slots: usize) -> KvGeometry {
        KvGeometry {
            page_slots,
            n_layers: self.config.n_layers,
            n_kv_heads: self.config.n_kv_heads,
            head_dim: self.config.head_dim,
        }
    }
}
