//! `libkvsan_shim.so`: the kvsan sanitizer behind a C ABI.
//!
//! Two ways in, one sanitizer per process:
//!
//! ```text
//!  release engine, unmodified ──dlsym(RTLD_DEFAULT, "kvsan_hook_table_v1")──▶ table.rs ─┐
//!  C / C++ / Python engine  ──kvsan_pool_register, kvsan_read, … (kvsan.h)──▶ api.rs  ──┤
//!                                                                                       ▼
//!                                       calls.rs (checks arguments) ──▶ kvsan_sanitizer::Sanitizer
//! ```
//!
//! | module | what lives there |
//! | --- | --- |
//! | `attach` | load-time constructor, `KVSAN_OPTIONS`, banner, sanitizer started at first use, exit summary |
//! | `table` | the versioned hook table the engine looks up |
//! | `api` | the plain C functions of `include/kvsan.h` |
//! | `calls` | argument checks and the operations both faces share |
//! | `guard` | panics caught at the boundary, refused calls printed and kept |
//! | `error` | `ShimError` and its status codes |
//!
//! The layout of every type is [`kvsan_sanitizer::abi`]; the header
//! `include/kvsan.h` declares the same, and a test compiles it with a C
//! compiler and compares sizes and offsets.
#![warn(missing_docs)]

pub mod api;
mod attach;
mod calls;
pub mod error;
mod guard;
pub mod table;

pub use error::ShimError;
