//! kvsan-kernels: the compute of the kvsan engine. Knows nothing of requests.
//!
//! CPU kernels for a Llama-family forward pass, numerically close to
//! llama.cpp's CPU backend: quantized matrix products ([`matmul`]), the
//! element-wise operations ([`ops`]), and the KV store and paged attention
//! over an f16 KV page pool for a whole batch ([`attention`]), which ask a
//! [`guard::KvGuard`] before every page they touch (the pool's generation
//! array, or the sanitizer's kernel shadow). Each kernel has an AVX2 path
//! (attention an AVX-512 one too) chosen at run time ([`isa`]) and a
//! portable one, and runs on a thread pool built for many small jobs
//! ([`threads`]).
#![warn(missing_docs)]

pub mod attention;
#[cfg(target_arch = "x86_64")]
mod avx2;
#[cfg(feature = "cuda")]
pub mod cuda;
pub mod dtype;
pub mod error;
mod flash;
pub mod guard;
pub mod isa;
pub mod matmul;
pub mod ops;
pub mod quant;
pub mod threads;

pub use attention::{KvBatch, KvGeometry, StoreSlot, attend, store_kv};
pub use dtype::DType;
pub use error::KernelError;
pub use guard::{GenerationChecked, KvGuard, RowLedger, Unchecked};
pub use isa::Isa;
pub use matmul::{WeightMatrix, dequantize_row, matmul, matmul_with};
pub use ops::{embedding, rms_norm, rope_inplace, softmax_inplace, swiglu};
pub use threads::ThreadPool;

/// Where a kernel runs: a thread pool and an instruction-set path.
#[derive(Clone, Copy, Debug)]
pub struct Exec<'a> {
    /// The pool whose threads run the kernel's tasks.
    pub pool: &'a ThreadPool,
    /// The instruction set (falls back to portable where unavailable).
    pub isa: Isa,
}

impl Exec<'static> {
    /// The global pool ([`threads::global`]) with the detected instruction set.
    #[must_use]
    pub fn global() -> Exec<'static> {
        Exec {
            pool: threads::global(),
            isa: Isa::detected(),
        }
    }
}
