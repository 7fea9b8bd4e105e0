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
//! | `table` | the versioned hook table the engine looks up (its hooks generated from the list) |
//! | `api` | the plain C functions of `include/kvsan.h` (those of the list's hooks generated from it) |
//! | `calls` | argument checks, and one operation a hook of the list that both faces run |
//! | `buffers` | the device buffers of a check over GPU memory |
//! | `device` | the batch checks over CUDA device buffers (feature `cuda`) |
//! | `nvtx` | a pool's pages described to compute-sanitizer through NVTX, kept in step by alloc and free (feature `nvtx`) |
//! | `guard` | panics caught at the boundary, refused calls printed and kept |
//! | `error` | `ShimError` and its status codes |
//!
//! The hooks are one list, [`kvsan_sanitizer::for_each_hook!`]: for each,
//! the table's function and (except `kvsan_alloc`, whose C signature
//! differs and is written out in `api`) the `kvsan_*` export are generated
//! around `calls::<hook>`, written by hand. The layout of every type is
//! [`kvsan_sanitizer::abi`]; the header `include/kvsan.h` declares the same,
//! and tests compile it with a C compiler and compare sizes and offsets,
//! and compare its hook table and prototypes with the list.
#![warn(missing_docs)]

pub mod api;
mod attach;
mod buffers;
mod calls;
#[cfg(feature = "cuda")]
mod device;
pub mod error;
mod guard;
mod nvtx;
pub mod table;

pub use error::ShimError;
