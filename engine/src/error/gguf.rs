//! What can be wrong with a GGUF file's contents: its header, metadata and
//! tensor table. Every variant names the file; most name the byte offset,
//! key or tensor, and the limit the value broke.
//!
//! Failing to open, read or map the file is an [`EngineError::Io`](crate::EngineError::Io).

use std::path::PathBuf;

/// A GGUF file that cannot be read as one: what the metadata and tensor
/// accessors return, and what [`GgufFile::open`](crate::gguf::GgufFile::open)
/// wraps in [`EngineError::Gguf`](crate::EngineError::Gguf).
#[derive(Debug, thiserror::Error)]
#[non_exhaustive]
pub enum GgufError {
    /// The file does not start with the GGUF magic bytes.
    #[error("{path}: not a GGUF file: expected magic \"GGUF\" (47 47 55 46), found {found:02x?}")]
    BadMagic {
        /// The file.
        path: PathBuf,
        /// The first bytes of the file (fewer than 4 when the file is shorter).
        found: Vec<u8>,
    },

    /// The GGUF version is not one this reader understands.
    #[error("{path}: GGUF version {version} is not supported (expected 2 or 3)")]
    UnsupportedVersion {
        /// The file.
        path: PathBuf,
        /// The version the header declares.
        version: u32,
    },

    /// The file ends before a structure that the header promised.
    #[error(
        "{path}: truncated GGUF: reading {what} at byte {offset} needs {needed} bytes, only {available} remain"
    )]
    Truncated {
        /// The file.
        path: PathBuf,
        /// What was being read (`tensor count`, `key of metadata entry 3`, …).
        what: String,
        /// Byte offset of the read in the file.
        offset: u64,
        /// Bytes the read needs.
        needed: u64,
        /// Bytes left in the file from `offset`.
        available: u64,
    },

    /// A structurally invalid value: a count, length or type id that cannot be
    /// right (it exceeds what remains of the file, overflows, or is unknown).
    #[error("{path}: corrupt GGUF at byte {offset}: {what}")]
    Corrupt {
        /// The file.
        path: PathBuf,
        /// Byte offset of the bad value in the file.
        offset: u64,
        /// What is wrong, with the bad value and the limit it broke.
        what: String,
    },

    /// A tensor has a GGML type this engine has no kernels for.
    #[error(
        "{path}: tensor '{tensor}' has GGML type id {type_id}, which is not supported (supported: F32=0, F16=1, Q4_0=2, Q4_1=3, Q8_0=8, Q4_K=12, Q6_K=14)"
    )]
    UnknownTensorType {
        /// The file.
        path: PathBuf,
        /// The tensor's name.
        tensor: String,
        /// The GGML type id found in the tensor table.
        type_id: u32,
    },

    /// A tensor's shape, offset or size is inconsistent with the file.
    #[error("{path}: tensor '{tensor}': {what}")]
    BadTensor {
        /// The file.
        path: PathBuf,
        /// The tensor's name.
        tensor: String,
        /// What is wrong, with the values and the limit.
        what: String,
    },

    /// A metadata key the caller needs is absent.
    #[error("{path}: metadata key '{key}' is missing (expected {expected})")]
    MissingKey {
        /// The file.
        path: PathBuf,
        /// The key.
        key: String,
        /// The type the caller expected.
        expected: &'static str,
    },

    /// A metadata key holds a value of the wrong type (or out of range for it).
    #[error("{path}: metadata key '{key}' holds {found}, expected {expected}")]
    KeyType {
        /// The file.
        path: PathBuf,
        /// The key.
        key: String,
        /// The type the caller expected.
        expected: &'static str,
        /// What the file holds.
        found: String,
    },

    /// A tensor the caller needs is absent.
    #[error("{path}: tensor '{tensor}' is missing")]
    MissingTensor {
        /// The file.
        path: PathBuf,
        /// The tensor's name.
        tensor: String,
    },
}
