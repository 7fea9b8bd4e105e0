//! KV tiers: pages stored out of their pool (host memory, disk) and loaded
//! back, and the identity each stored block carries on the way.
//!
//! A tier block is one page's KV out of its pool, named by the engine as
//! `(tier, block)`. The sanitizer keeps, per block, what was stored there:
//!
//! ```text
//!   tier_store ──► Storing ──tier_store_done(ok)──► Stored ──tier_release──► (gone)
//!                     │                                │
//!                     └──tier_store_done(failed)──► Failed ──tier_release──► (gone)
//!
//!   Storing and Stored blocks are live: another store into one is
//!   tier-block-aliased. Only a Stored block may be loaded.
//!
//!   identity (taken when the store starts, from the source page):
//!     source      pool, page and generation the store reads
//!     storer      the request (or the prefix cache) the store is for
//!     writer      the page's owner at its allocation, and its salt
//!     cached      the page was the prefix cache's (shared, or stored by
//!                 the cache): the policy decides who may load it
//!     written     the page's written map (layers × slots), as the store
//!                 found it when it started
//!     digest      the engine's digest of what the tier holds (at done)
//! ```
//!
//! A load is a copy into a page, checked like a kernel store, that marks
//! written exactly the stored written map; the engine's digest of what
//! landed is then compared with the stored one.

use std::fmt;

use crate::ids::{Owner, PageRef, PoolId};

/// One block of a KV tier, as the engine names it.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub struct TierBlockId {
    /// The tier (the engine's number for it: host memory, disk, …).
    pub tier: u32,
    /// The block within the tier.
    pub block: u64,
}

impl TierBlockId {
    /// Block `block` of tier `tier`.
    #[must_use]
    pub const fn new(tier: u32, block: u64) -> TierBlockId {
        TierBlockId { tier, block }
    }
}

impl fmt::Display for TierBlockId {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "tier {} block {}", self.tier, self.block)
    }
}

/// Where a tier block stands, as [`crate::Sanitizer::tier_block_state`]
/// says.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum TierBlockState {
    /// A store into it started and has not completed.
    Storing,
    /// A store completed: it may be loaded.
    Stored,
    /// Its store failed, or its source page was freed or reused before the
    /// store completed: it holds nothing that may be loaded.
    Failed,
}

impl TierBlockState {
    /// The lower-case name used in reports.
    #[must_use]
    pub const fn name(self) -> &'static str {
        match self {
            TierBlockState::Storing => "storing",
            TierBlockState::Stored => "stored",
            TierBlockState::Failed => "failed",
        }
    }
}

/// What a store took from its source page when it started.
#[derive(Clone, Debug)]
pub(crate) struct Identity {
    /// The source pool.
    pub(crate) pool: PoolId,
    /// The source page, at the generation the store reads.
    pub(crate) page: PageRef,
    /// Whom the store is for.
    pub(crate) storer: Owner,
    /// The page's owner at its allocation.
    pub(crate) writer: Owner,
    /// The page's salt (0: none).
    pub(crate) salt: u64,
    /// The page was the prefix cache's: loads are judged by the policy.
    pub(crate) cached: bool,
    /// Slots per page and layers of the source pool.
    pub(crate) page_slots: u32,
    /// Layers of the source pool.
    pub(crate) layers: u32,
    /// The written map's words (the pool's bit layout).
    pub(crate) written: Box<[u64]>,
    /// The step the store started at.
    pub(crate) step: u64,
}

/// One live or failed tier block.
#[derive(Clone, Debug)]
pub(crate) struct TierBlock {
    pub(crate) state: TierBlockState,
    pub(crate) identity: Identity,
    /// The engine's digest of what the tier holds (set at a completed store).
    pub(crate) digest: u64,
    /// Why the block failed, for a report of a load of it.
    pub(crate) failure: Option<String>,
}
