//! The one error type of the kernels crate.

use kvsan_ids::{Generation, PageId};

use crate::DType;

/// What a kernel refused to do, with the input at fault and the limit it broke.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[non_exhaustive]
pub enum KernelError {
    /// A row length that is not a whole number of blocks of its type.
    #[error("{dtype} rows need a multiple of {block_elems} columns, got {cols}")]
    ColsNotWholeBlocks {
        /// The element type.
        dtype: DType,
        /// The row length asked for.
        cols: usize,
        /// Values per block of `dtype`.
        block_elems: usize,
    },
    /// Weight data whose byte length does not match `rows × row_bytes(cols)`.
    #[error("{dtype} weight matrix of {rows}x{cols} needs {expected} bytes of data, got {actual}")]
    WeightSize {
        /// The element type.
        dtype: DType,
        /// Rows of the matrix.
        rows: usize,
        /// Values per row.
        cols: usize,
        /// Bytes the geometry needs.
        expected: usize,
        /// Bytes given.
        actual: usize,
    },
    /// Batch arrays whose shapes do not fit each other.
    #[error("KV batch arrays do not fit: {what}")]
    BatchShape {
        /// Which array, and what it should be.
        what: String,
    },
    /// A block table that does not cover the tokens to be read.
    #[error(
        "sequence {seq}: {seq_len} tokens need {pages_needed} pages but the block table has {block_table_len}"
    )]
    BlockTableTooShort {
        /// Index of the sequence in the call (0 for prefill).
        seq: usize,
        /// Tokens to attend over.
        seq_len: usize,
        /// Pages those tokens span.
        pages_needed: usize,
        /// Entries in the block table.
        block_table_len: usize,
    },
    /// A block table entry naming a page outside the pool.
    #[error(
        "sequence {seq}: block table entry {index} names page {} but the pool has {n_pages} pages",
        page.0
    )]
    PageOutOfRange {
        /// Index of the sequence in the call (0 for prefill).
        seq: usize,
        /// Position of the entry in the block table.
        index: usize,
        /// The page named.
        page: PageId,
        /// Pages in the pool (or in the generation array, if shorter).
        n_pages: usize,
    },
    /// A block table entry whose generation tag does not match the page's
    /// current generation: the page was freed and re-allocated since the
    /// reference was taken. No byte of the page was read.
    #[error(
        "sequence {seq}: block table entry {index} refers to page {} at generation {}, but the page is at generation {}",
        page.0, found.0, current.0
    )]
    GenerationMismatch {
        /// Index of the sequence in the call (0 for prefill).
        seq: usize,
        /// Position of the entry in the block table.
        index: usize,
        /// The page.
        page: PageId,
        /// The generation the block table holds.
        found: Generation,
        /// The page's current generation.
        current: Generation,
    },
}
