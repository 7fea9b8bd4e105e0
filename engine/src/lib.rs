//! kvsan-engine: a GGUF Llama-family inference engine whose KV pool reports
//! every page event to kvsan's sanitizer hooks.
#![warn(missing_docs)]

pub mod chat;
pub mod engine;
pub mod error;
pub mod faults;
pub mod fetch;
pub mod gguf;
pub mod hooks;
pub mod kv_access;
pub mod kv_pool;
pub mod model;
pub mod node;
pub mod request;
pub mod sampler;
pub mod scheduler;
pub mod tokenizer;
pub mod transport;

pub use error::EngineError;
