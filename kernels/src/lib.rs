//! kvsan-kernels: the compute of the kvsan engine. Knows nothing of requests.
#![warn(missing_docs)]

pub mod dtype;

pub use dtype::DType;
