//! What a KV transfer claims to carry, checked on both ends.
//!
//! The sender calls `transfer_send` before it ships (are the source slots
//! written by the sender?); the receiver calls `transfer_recv` when a
//! transfer arrives (are the destination pages still reserved by this
//! request? they become Receiving), `transfer_land` for each copy that puts
//! received KV into a page (is it one of the request's Receiving pages? only
//! then are the copied slots written), `transfer_verify` for each
//! destination page once the bytes are there (does the KV found where it
//! landed match the sender's digest for those tokens?), and
//! `transfer_commit` before decode starts reading (did enough arrive?).
//!
//! The written map of a received page is set by what landed, not by the
//! manifest: on a pool whose engine reports its landings
//! ([`Landing::Reported`], the default) `transfer_recv` marks nothing
//! written; `transfer_land` marks the slots a copy wrote and
//! `transfer_verify` the slots whose digest matched (the only evidence where
//! no copy is visible, as after an RDMA WRITE). An engine built before the
//! landing hooks registers its pool as [`Landing::Manifest`]: its
//! `transfer_recv` marks the manifest's slots written, as it always did.
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

/// How received KV becomes written in a pool, as its engine reports it.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Hash, Serialize)]
#[serde(rename_all = "kebab-case")]
pub enum Landing {
    /// The engine reports every copy of received KV (`transfer_land`) or
    /// verifies what landed (`transfer_verify`): only those slots count as
    /// written.
    #[default]
    Reported,
    /// The engine reports no landing (a C engine built before ABI 1.5):
    /// `transfer_recv` marks the manifest's slots written. Where the bytes
    /// really land is not checked.
    Manifest,
}

/// One destination page of a transfer: what a copy is about to write into
/// it (`transfer_land`), or what was found there once the bytes landed
/// (`transfer_verify`).
///
/// ```text
///  tokens first_token .. first_token + slots.len() of request, layers
///  land in page.page (tag page.generation), slots slots.start..slots.end
///  sent_digest:   the sender's digest of that KV, keyed by the token range
///  landed_digest: the receiver's digest of the KV in those slots now
/// ```
#[derive(Clone, Debug, PartialEq, Eq, Serialize)]
pub struct PageLanding {
    /// The request whose KV lands.
    pub request: Owner,
    /// The page written, through the tag the writer holds for it.
    pub page: PageRef,
    /// The token position that lands in `slots.start`.
    pub first_token: u64,
    /// The slots written.
    pub slots: Range<u32>,
    /// The layers written.
    pub layers: Range<u32>,
    /// The sender's digest of the KV of these tokens (`transfer_verify`;
    /// opaque to the sanitizer, which never sees KV bytes).
    pub sent_digest: u64,
    /// The receiver's digest of what its page holds in these slots now.
    pub landed_digest: u64,
}

impl PageLanding {
    /// The token positions landing: `first_token..first_token + slots.len()`.
    #[must_use]
    pub fn token_range(&self) -> Range<u64> {
        self.first_token
            ..self.first_token + u64::from(self.slots.end.saturating_sub(self.slots.start))
    }
}
