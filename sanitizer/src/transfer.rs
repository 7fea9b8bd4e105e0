//! What a KV transfer claims to carry, checked on both ends.
//!
//! The sender calls `transfer_send` before it ships (are the source slots
//! written by the sender?), the receiver calls `transfer_recv` when bytes have
//! landed (are the destination pages still reserved by this request?), and
//! `transfer_commit` before decode starts reading (did enough arrive?).
//!
//! ```text
//!  Manifest
//!  +-----------------------------------------------------------------+
//!  | request: Owner (request u64, tenant u32)                        |
//!  | src_pool: PoolId | src_pages: [PageRef; n]  block table, token 0 |
//!  | dst_pool: PoolId | dst_pages: [PageRef; m]  block table, token 0 |
//!  | first_token: u32 | tokens: u32   -> tokens first..first+tokens   |
//!  | layers: start..end                                              |
//!  | checksum: u64    (over the shipped bytes; the sanitizer never     |
//!  |                   sees KV bytes, it carries the engine's sum)     |
//!  +-----------------------------------------------------------------+
//!
//!  token t lives in block-table entry t / page_slots, slot t % page_slots
//!  (each side with its own pool's page_slots):
//!
//!   tokens       0 ........ 15 | 16 ........ 31 | 32 ... 37
//!   dst_pages    [ page 9@gen 3 ][ page 4@gen 7 ][ page 12@gen 1 ]
//!                               ^ first_token=20, tokens=18: slots 4..16 of
//!                                 page 4 and 0..6 of page 12
//! ```

use std::ops::Range;

use serde::Serialize;

use crate::ids::{Owner, PageRef, PoolId};

/// What a KV transfer carries: which request, from which pages to which,
/// which tokens and layers, and the engine's checksum of the bytes.
#[derive(Clone, Debug, PartialEq, Eq, Serialize)]
pub struct Manifest {
    /// The request whose KV moves (the same request id on both nodes).
    pub request: Owner,
    /// The sender's pool.
    pub src_pool: PoolId,
    /// The sender's block table, from token 0.
    pub src_pages: Vec<PageRef>,
    /// The receiver's pool.
    pub dst_pool: PoolId,
    /// The receiver's block table (the pages it reserved), from token 0.
    pub dst_pages: Vec<PageRef>,
    /// First token position carried.
    pub first_token: u32,
    /// Number of tokens carried.
    pub tokens: u32,
    /// Layers carried.
    pub layers: Range<u32>,
    /// The engine's checksum of the carried bytes (opaque to the sanitizer).
    pub checksum: u64,
}

impl Manifest {
    /// The token positions carried: `first_token..first_token + tokens`.
    #[must_use]
    pub fn token_range(&self) -> Range<u64> {
        u64::from(self.first_token)..u64::from(self.first_token) + u64::from(self.tokens)
    }
}

/// Splits the token range `tokens` over a block table of `page_slots`-slot
/// pages: `(table index, slot range)` for each page touched.
pub(crate) fn pages_of(
    tokens: Range<u64>,
    page_slots: u32,
) -> impl Iterator<Item = (usize, Range<u32>)> {
    crate::block_table::entry_slots(tokens, page_slots)
}
