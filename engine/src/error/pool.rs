//! What can go wrong allocating the KV pool or returning a page to it.

/// A KV pool that cannot be allocated, or a page that cannot be returned to it.
#[derive(Debug, thiserror::Error)]
#[non_exhaustive]
pub enum PoolError {
    /// A KV pool of this size cannot be allocated.
    #[error("a KV pool of {pages} pages of {page_bytes} bytes cannot be allocated")]
    TooLarge {
        /// Pages asked for.
        pages: usize,
        /// Bytes per page.
        page_bytes: usize,
    },

    /// A page was returned to the pool that is not out of it at that generation.
    #[error("page {page}@gen {generation} cannot be freed: {}", match current {
        Some(g) if *g == *generation => "it is already free".to_string(),
        Some(g) => format!("its current generation is {g}"),
        None => "it is outside the pool".to_string(),
    })]
    BadFree {
        /// The page.
        page: u32,
        /// The generation the caller holds.
        generation: u32,
        /// The page's current generation (`None`: no such page).
        current: Option<u32>,
    },
}
