//! kvsan-kernels: the compute of the kvsan engine. Knows nothing of requests.
#![warn(missing_docs)]

#[cfg(feature = "cuda")]
pub mod cuda;
pub mod dtype;

pub use dtype::DType;
