//! Why a call into the library could not be carried out. Each variant maps
//! to one ABI status code ([`ShimError::status`]); the message is what
//! `kvsan_last_error` returns and what the library prints.

use kvsan_sanitizer::SanitizerError;
use kvsan_sanitizer::abi::{
    AbiStatus, KVSAN_ERR_DEVICE, KVSAN_ERR_GENERATION, KVSAN_ERR_INTERNAL,
    KVSAN_ERR_INVALID_ARGUMENT, KVSAN_ERR_NOT_ATTACHED, KVSAN_ERR_NULL, KVSAN_ERR_SIZE,
    KVSAN_ERR_VERSION, status_of,
};

/// A refused call.
#[derive(Debug, thiserror::Error)]
#[non_exhaustive]
pub enum ShimError {
    /// A required pointer argument is null.
    #[error("`{call}`: argument `{argument}` is null")]
    Null {
        /// The function called.
        call: &'static str,
        /// The null argument.
        argument: &'static str,
    },
    /// A pointer argument is not aligned for its type.
    #[error("`{call}`: argument `{argument}` at {address:#x} is not aligned to {align} bytes")]
    Misaligned {
        /// The function called.
        call: &'static str,
        /// The argument.
        argument: &'static str,
        /// Its address.
        address: usize,
        /// The alignment its type needs.
        align: usize,
    },
    /// A struct size argument differs from the struct this library knows.
    #[error("`{call}`: `{argument}` is {given} bytes; this library's {type_name} is {expected}")]
    Size {
        /// The function called.
        call: &'static str,
        /// The size argument.
        argument: &'static str,
        /// The struct.
        type_name: &'static str,
        /// The size given.
        given: usize,
        /// The size this library was built with.
        expected: usize,
    },
    /// The caller's ABI version is not compatible.
    #[error(
        "ABI version {}.{} is not supported: this library speaks {}.{} (same major, minor at most {})",
        caller >> 16, caller & 0xffff, library >> 16, library & 0xffff, library & 0xffff
    )]
    Version {
        /// The caller's `major << 16 | minor`.
        caller: u32,
        /// The library's.
        library: u32,
    },
    /// The library refused to attach at load or at its first use.
    #[error("kvsan is not attached in this process: {reason}")]
    NotAttached {
        /// Why (the options or log-file error, as reported then).
        reason: String,
    },
    /// An argument value the ABI does not define.
    #[error("`{call}`: {argument} = {value} is not allowed: {allowed}")]
    InvalidArgument {
        /// The function called.
        call: &'static str,
        /// The argument or field.
        argument: &'static str,
        /// Its value.
        value: u64,
        /// What is allowed.
        allowed: &'static str,
    },
    /// The engine's generation of a freshly allocated page is not the shadow's.
    #[error(
        "`alloc`: pool {pool} page {page}: the shadow's generation is {shadow}, the engine's {engine}; the two count allocations differently and every later check of this page would be wrong"
    )]
    Generation {
        /// The pool.
        pool: u32,
        /// The page.
        page: u32,
        /// The shadow's new generation.
        shadow: u32,
        /// The engine's.
        engine: u32,
    },
    /// The sanitizer refused the call (API misuse: unknown pool, out of range …).
    #[error("`{call}`: {source}")]
    Sanitizer {
        /// The function called.
        call: &'static str,
        /// The sanitizer's error.
        #[source]
        source: SanitizerError,
    },
    /// A check over device buffers could not run: built without the `cuda`
    /// feature, no CUDA driver, NVRTC or such device, or a CUDA failure.
    #[error("`{call}`: the device check could not run: {reason}")]
    Device {
        /// The function called.
        call: &'static str,
        /// Why.
        reason: String,
    },
    /// The NVTX registration of a pool could not be done: built without
    /// the `nvtx` feature, no driver, or (`invalid`) a description no pages
    /// fit.
    #[error("`{call}`: {reason}")]
    Nvtx {
        /// The function called.
        call: &'static str,
        /// Why.
        reason: String,
        /// The arguments were at fault (`KVSAN_ERR_INVALID_ARGUMENT`), not
        /// the library or the machine (`KVSAN_ERR_DEVICE`).
        invalid: bool,
    },
    /// The library panicked inside the call (a bug in the library); the
    /// panic was caught at the boundary.
    #[error("`{call}`: internal error (caught panic: {message})")]
    Panic {
        /// The function called.
        call: &'static str,
        /// The panic's message.
        message: String,
    },
}

impl ShimError {
    /// The ABI status code of this error.
    #[must_use]
    pub fn status(&self) -> AbiStatus {
        match self {
            ShimError::Null { .. } => KVSAN_ERR_NULL,
            ShimError::Misaligned { .. } | ShimError::InvalidArgument { .. } => {
                KVSAN_ERR_INVALID_ARGUMENT
            }
            ShimError::Size { .. } => KVSAN_ERR_SIZE,
            ShimError::Version { .. } => KVSAN_ERR_VERSION,
            ShimError::NotAttached { .. } => KVSAN_ERR_NOT_ATTACHED,
            ShimError::Generation { .. } => KVSAN_ERR_GENERATION,
            ShimError::Sanitizer { source, .. } => status_of(source),
            ShimError::Panic { .. } => KVSAN_ERR_INTERNAL,
            ShimError::Device { .. } | ShimError::Nvtx { invalid: false, .. } => KVSAN_ERR_DEVICE,
            ShimError::Nvtx { invalid: true, .. } => KVSAN_ERR_INVALID_ARGUMENT,
        }
    }
}
