//! API misuse: calls the sanitizer cannot interpret. These are errors of the
//! caller's bookkeeping of the sanitizer itself (an unregistered pool, a page
//! index past the pool), distinct from [`Violation`](crate::Violation)s, which
//! are findings about the engine's KV accesses.

use std::path::PathBuf;

/// Why a sanitizer call could not be carried out.
#[derive(Debug, thiserror::Error)]
#[non_exhaustive]
pub enum SanitizerError {
    /// The pool id was never returned by `pool_register`.
    #[error("unknown pool {pool}: {registered} pools are registered")]
    UnknownPool {
        /// The pool asked for.
        pool: u32,
        /// How many pools exist (valid ids are `0..registered`).
        registered: u32,
    },
    /// More pools than the sanitizer can hold.
    #[error("cannot register another pool: the limit is {limit} pools")]
    TooManyPools {
        /// The limit.
        limit: u32,
    },
    /// A page index past the end of the pool.
    #[error("page {page} is out of range for pool {pool}, which has {pages} pages")]
    PageOutOfRange {
        /// The pool.
        pool: u32,
        /// The page asked for.
        page: u32,
        /// Pages in the pool.
        pages: u32,
    },
    /// A slot range that does not fit a page.
    #[error(
        "slot range {start}..{end} is out of range for pool {pool}: a page has {page_slots} slots"
    )]
    SlotOutOfRange {
        /// The pool.
        pool: u32,
        /// Range start.
        start: u32,
        /// Range end (exclusive).
        end: u32,
        /// Slots per page.
        page_slots: u32,
    },
    /// A layer range that does not fit the pool.
    #[error(
        "layer range {start}..{end} is out of range for pool {pool}, which has {layers} layers"
    )]
    LayerOutOfRange {
        /// The pool.
        pool: u32,
        /// Range start.
        start: u32,
        /// Range end (exclusive).
        end: u32,
        /// Layers in the pool.
        layers: u32,
    },
    /// A token count larger than the block table can hold.
    #[error(
        "{tokens} tokens do not fit a block table of {pages} pages in pool {pool} (capacity {capacity} slots)"
    )]
    TokensBeyondTable {
        /// The pool.
        pool: u32,
        /// Tokens asked for (end of the token range).
        tokens: u64,
        /// Pages in the block table.
        pages: u64,
        /// `pages × page_slots`.
        capacity: u64,
    },
    /// A call that only a request may make, made with the prefix cache's
    /// reserved id ([`crate::RequestId::PREFIX_CACHE`]): the cache holds
    /// pages through `share` and `free` only.
    #[error(
        "request id {request} is reserved for the prefix cache, which holds pages through share and free only; it may not {what}"
    )]
    ReservedRequest {
        /// The reserved id.
        request: u64,
        /// What it tried (`allocate a page`).
        what: &'static str,
    },
    /// A pool geometry that cannot be shadowed.
    #[error("invalid pool geometry: {field} = {value}, allowed: {limit}")]
    BadGeometry {
        /// The field.
        field: &'static str,
        /// Its value.
        value: u64,
        /// What is allowed.
        limit: &'static str,
    },
    /// An option name not in the options table.
    #[error("KVSAN_OPTIONS: unknown option `{key}`; known options: {known}")]
    UnknownOption {
        /// The key given.
        key: String,
        /// Every known option name.
        known: String,
    },
    /// An option value its type does not accept.
    #[error("KVSAN_OPTIONS: bad value `{value}` for option `{key}`; allowed: {allowed}")]
    BadOptionValue {
        /// The option.
        key: String,
        /// The value given.
        value: String,
        /// What the option accepts.
        allowed: String,
    },
    /// `self_test=1` provoked a violation kind and did not get it back
    /// (or a legal step of its scenario was refused): the checks are not
    /// working, and the sanitizer refuses to start.
    #[error(
        "KVSAN_OPTIONS self_test=1: {kind} was provoked and not caught ({found}); refusing to start"
    )]
    SelfTest {
        /// The kind provoked.
        kind: &'static str,
        /// What came back instead.
        found: String,
    },
    /// An options item without `=`.
    #[error("KVSAN_OPTIONS: `{item}` is not of the form key=value")]
    MalformedOption {
        /// The item.
        item: String,
    },
    /// A kernel argument buffer a kernel could not use as given
    /// ([`crate::Sanitizer::check_block_table`] and the other batch checks).
    #[error("{layout} batch, row {row}: {what}")]
    BadBatch {
        /// The buffer layout (`block table`, `paged CSR`, …).
        layout: &'static str,
        /// The row (0 for an array of the wrong length).
        row: usize,
        /// What is wrong, with the values and the limit.
        what: String,
    },
    /// A tier store was said to complete or fail where none is in flight.
    #[error("tier {tier} block {block}: no store into it is in flight (it is {state})")]
    TierBlockNotStoring {
        /// The tier.
        tier: u32,
        /// The block.
        block: u64,
        /// What the block is: `stored`, `failed`, or `unknown`.
        state: &'static str,
    },
    /// A tier block loaded into a pool whose pages have another shape than
    /// the page it was stored from.
    #[error(
        "tier {tier} block {block} holds a page of {} slots x {} layers; pool {pool} has pages of {} slots x {} layers",
        stored.0, stored.1, pool_shape.0, pool_shape.1
    )]
    TierGeometry {
        /// The tier.
        tier: u32,
        /// The block.
        block: u64,
        /// The pool loaded into.
        pool: u32,
        /// The stored page's slots and layers.
        stored: (u32, u32),
        /// The pool's slots and layers per page.
        pool_shape: (u32, u32),
    },
    /// The report log file could not be opened.
    #[error("cannot open kvsan log file {path}")]
    LogFile {
        /// The file (with the `.<pid>` suffix).
        path: PathBuf,
        /// The I/O error.
        #[source]
        source: std::io::Error,
    },
}
