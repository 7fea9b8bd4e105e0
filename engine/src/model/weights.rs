//! The model's weights: borrowed from a memory-mapped GGUF file, or owned
//! (the synthetic model), behind one accessor so the forward pass has one
//! code path for both.

use kvsan_kernels::DType;
use kvsan_kernels::matmul::WeightMatrix;
use kvsan_kernels::quant;

use crate::EngineError;
use crate::gguf::{GgufError, GgufFile};
use crate::model::config::ModelConfig;

/// Where a matrix's bytes live.
#[derive(Debug)]
enum Bytes {
    /// Index into the GGUF file's tensor table.
    Mapped(usize),
    /// Bytes owned by the model.
    Owned(Vec<u8>),
}

/// One weight matrix: `rows` outputs × `cols` inputs, GGML row layout.
#[derive(Debug)]
pub struct Matrix {
    dtype: DType,
    rows: usize,
    cols: usize,
    bytes: Bytes,
}

impl Matrix {
    /// An owned matrix of `dtype` quantized from `values` (`rows × cols`, row-major).
    ///
    /// # Panics
    /// If `values.len() != rows * cols` or `cols` is not a whole number of
    /// blocks of `dtype` (a programming error in the synthetic model).
    #[must_use]
    pub fn quantized(dtype: DType, rows: usize, cols: usize, values: &[f32]) -> Matrix {
        assert_eq!(values.len(), rows * cols, "matrix values");
        let row_bytes = dtype.row_bytes(cols).expect("cols are whole blocks");
        let mut data = vec![0u8; rows * row_bytes];
        for (src, dst) in values
            .chunks_exact(cols)
            .zip(data.chunks_exact_mut(row_bytes))
        {
            quant::quantize_row(dtype, src, dst).expect("row geometry checked above");
        }
        Matrix {
            dtype,
            rows,
            cols,
            bytes: Bytes::Owned(data),
        }
    }

    /// Element type.
    #[must_use]
    pub fn dtype(&self) -> DType {
        self.dtype
    }

    /// Rows (outputs).
    #[must_use]
    pub fn rows(&self) -> usize {
        self.rows
    }

    /// Columns (inputs).
    #[must_use]
    pub fn cols(&self) -> usize {
        self.cols
    }
}

/// The weights of one transformer block.
#[derive(Debug)]
pub struct LayerWeights {
    /// RMSNorm gain before attention.
    pub attn_norm: Vec<f32>,
    /// Query projection (`n_heads·head_dim × d_model`).
    pub wq: Matrix,
    /// Key projection (`n_kv_heads·head_dim × d_model`).
    pub wk: Matrix,
    /// Value projection (`n_kv_heads·head_dim × d_model`).
    pub wv: Matrix,
    /// Attention output projection (`d_model × n_heads·head_dim`).
    pub wo: Matrix,
    /// RMSNorm gain before the feed-forward block.
    pub ffn_norm: Vec<f32>,
    /// SwiGLU gate (`ffn_dim × d_model`).
    pub w_gate: Matrix,
    /// SwiGLU up (`ffn_dim × d_model`).
    pub w_up: Matrix,
    /// Feed-forward down projection (`d_model × ffn_dim`).
    pub w_down: Matrix,
}

/// All weights of a model.
#[derive(Debug)]
pub struct Weights {
    file: Option<GgufFile>,
    /// Token embedding (`vocab × d_model`).
    pub token_embd: Matrix,
    /// Final RMSNorm gain.
    pub output_norm: Vec<f32>,
    /// Output projection; `None` when tied to the token embedding.
    pub output: Option<Matrix>,
    /// The transformer blocks.
    pub layers: Vec<LayerWeights>,
}

impl Weights {
    /// Weights owned in memory (the synthetic model).
    #[must_use]
    pub fn owned(
        token_embd: Matrix,
        output_norm: Vec<f32>,
        output: Option<Matrix>,
        layers: Vec<LayerWeights>,
    ) -> Weights {
        Weights {
            file: None,
            token_embd,
            output_norm,
            output,
            layers,
        }
    }

    /// Weights borrowed from `file`, checked against `config`.
    ///
    /// # Errors
    /// [`GgufError::MissingTensor`] for an absent tensor;
    /// [`GgufError::BadTensor`] naming the tensor when its shape or type
    /// does not fit the configuration.
    pub fn from_gguf(file: GgufFile, config: &ModelConfig) -> Result<Weights, EngineError> {
        let c = config;
        let token_embd = matrix(&file, "token_embd.weight", c.vocab_size, c.d_model)?;
        let output_norm = vector(&file, "output_norm.weight", c.d_model)?;
        let output = match file.tensor("output.weight") {
            Ok(_) => Some(matrix(&file, "output.weight", c.vocab_size, c.d_model)?),
            Err(GgufError::MissingTensor { .. }) => None,
            Err(e) => return Err(e.into()),
        };
        let mut layers = Vec::with_capacity(c.n_layers);
        for l in 0..c.n_layers {
            let name = |t: &str| format!("blk.{l}.{t}.weight");
            layers.push(LayerWeights {
                attn_norm: vector(&file, &name("attn_norm"), c.d_model)?,
                wq: matrix(&file, &name("attn_q"), c.q_dim(), c.d_model)?,
                wk: matrix(&file, &name("attn_k"), c.kv_dim(), c.d_model)?,
                wv: matrix(&file, &name("attn_v"), c.kv_dim(), c.d_model)?,
                wo: matrix(&file, &name("attn_output"), c.d_model, c.q_dim())?,
                ffn_norm: vector(&file, &name("ffn_norm"), c.d_model)?,
                w_gate: matrix(&file, &name("ffn_gate"), c.ffn_dim, c.d_model)?,
                w_up: matrix(&file, &name("ffn_up"), c.ffn_dim, c.d_model)?,
                w_down: matrix(&file, &name("ffn_down"), c.d_model, c.ffn_dim)?,
            });
        }
        Ok(Weights {
            file: Some(file),
            token_embd,
            output_norm,
            output,
            layers,
        })
    }

    /// The kernel view of `m`.
    #[must_use]
    pub fn view<'a>(&'a self, m: &'a Matrix) -> WeightMatrix<'a> {
        let data: &[u8] = match &m.bytes {
            Bytes::Owned(v) => v,
            Bytes::Mapped(i) => {
                let file = self.file.as_ref().expect("mapped matrix without its file");
                file.tensor_data(&file.tensors()[*i])
            }
        };
        WeightMatrix {
            dtype: m.dtype,
            rows: m.rows,
            cols: m.cols,
            data,
        }
    }

    /// The output projection (the token embedding when tied).
    #[must_use]
    pub fn output_matrix(&self) -> &Matrix {
        self.output.as_ref().unwrap_or(&self.token_embd)
    }

    /// The GGUF file the weights come from, if any.
    #[must_use]
    pub fn file(&self) -> Option<&GgufFile> {
        self.file.as_ref()
    }
}

fn bad_tensor(file: &GgufFile, tensor: &str, what: String) -> GgufError {
    GgufError::BadTensor {
        path: file.path().to_path_buf(),
        tensor: tensor.to_string(),
        what,
    }
}

/// A 2-D weight tensor of `rows × cols`, validated against the kernels' geometry.
fn matrix(file: &GgufFile, name: &str, rows: usize, cols: usize) -> Result<Matrix, GgufError> {
    let info = file.tensor(name)?;
    if info.dims().len() != 2 || info.row_len() != cols || info.n_rows() != rows {
        return Err(bad_tensor(
            file,
            name,
            format!(
                "shape {:?}, expected [{cols}, {rows}] (row length, rows)",
                info.dims()
            ),
        ));
    }
    let data = file.tensor_data(info);
    WeightMatrix::new(info.dtype(), rows, cols, data)
        .map_err(|e| bad_tensor(file, name, e.to_string()))?;
    let index = file
        .tensors()
        .iter()
        .position(|t| t.name() == name)
        .expect("tensor found by name above");
    Ok(Matrix {
        dtype: info.dtype(),
        rows,
        cols,
        bytes: Bytes::Mapped(index),
    })
}

/// A 1-D tensor of `len` values, dequantized to f32.
fn vector(file: &GgufFile, name: &str, len: usize) -> Result<Vec<f32>, GgufError> {
    let info = file.tensor(name)?;
    if info.dims().len() != 1 || info.row_len() != len {
        return Err(bad_tensor(
            file,
            name,
            format!("shape {:?}, expected [{len}]", info.dims()),
        ));
    }
    let mut out = vec![0.0; len];
    let w = WeightMatrix::new(info.dtype(), 1, len, file.tensor_data(info))
        .map_err(|e| bad_tensor(file, name, e.to_string()))?;
    kvsan_kernels::matmul::dequantize_row(&w, 0, &mut out);
    Ok(out)
}
