//! kvsan-engine: a GGUF Llama-family inference engine whose KV pool reports
//! every page event to kvsan's sanitizer hooks, and whose KV kernels check
//! every store and attention read against the sanitizer's kernel shadow.
//!
//! | module | what lives there |
//! | --- | --- |
//! | `gguf`, `tokenizer`, `chat`, `sampler` | the model file, text ↔ tokens, the chat template, sampling |
//! | `model` | configuration, weights, the forward pass (`forward.rs`), the synthetic model |
//! | `kv_pool` | pages, generations, the free list, quarantine, poison |
//! | `tier` | the host-memory KV tier: a preempted request's pages stored out of the pool and loaded back, each copy digested |
//! | `kv_access` | the one way the forward pass reaches the pool: the step's batch arrays and the guard its kernels check with |
//! | `node` | the nodes (unified, prefill, decode), each request's state machine on a node (`lifecycle.rs`: the one place a request's state is set, every move checked legal, its lifecycle event reported once), the step executor (`executor.rs`: a node's pool, model and lifecycle; pages for a step and one forward pass over its batch), the step loop the nodes share (`step_loop.rs`: plan, execute, apply each row's outcome), the batch builder (`batch.rs`), the scheduler (`scheduler.rs`: continuous batching, chunked prefill, preemption), admission, sequences |
//! | `anomaly` | the anomaly monitor: a first token that came with KV for fewer positions than the prompt (`short-kv`), or far faster per prompt token than the node computes (`fast-first-token`) — with or without a sanitizer |
//! | `hooks` | the dispatch to a sanitizer: none, in-process, or a C hook table |
//! | `transport` | prefill ↔ decode messages and links: in-process, TCP (authenticated with a peer key), RDMA |
//! | `engine` | the serving engine a client submits to |
//! | `faults` | fail points (feature `faults`): which production bug each re-creates, and the switch that turns it on |
//! | `scenario` | each fault's leak-oracle scenario (feature `faults`): the script, the victim, what the sanitizer must report |
//! | `error` | [`EngineError`], which wraps each subsystem's own type, each in a file of `error/` named after its subsystem: `GgufError`, `TokenizerError` (the chat template's too), `FetchError`, `PoolError`, `WireError`, `RdmaError` (feature `rdma`); each subsystem re-exports its own, and imports it from here, never the other way |
#![warn(missing_docs)]

pub mod anomaly;
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
pub mod prefix_cache;
pub mod request;
pub mod sampler;
#[cfg(feature = "faults")]
pub mod scenario;
pub mod tier;
pub mod tokenizer;
pub mod transport;

pub use error::EngineError;
/// The scheduler's settings are part of the engine's configuration.
pub use node::scheduler;
