//! The host-memory KV tier: where a preempted request's pages go, and come
//! back from, instead of being recomputed.
//!
//! ```text
//!  blocks × page_elems f16, allocated once (--kv-offload-host-bytes)
//!  block b: one pool page's bytes, as the pool lays a page out
//!  free: the blocks no stored page holds
//! ```
//!
//! The tier copies and keeps bytes; the node decides what goes out and
//! back (`Executor::offload`, `Executor::reload`) and reports each store,
//! load and release to the hook target, which keeps each block's identity
//! (`kvsan_sanitizer::tier`). Every copy is digested (XXH3-64 of the page's
//! bytes) at the store and again where it landed.

use half::f16;

use crate::error::PoolError;

/// The engine's number for its host-memory tier in the tier hooks.
pub const HOST_TIER: u32 = 0;

/// Counters of the host tier.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct TierStats {
    /// Blocks the tier has.
    pub blocks: usize,
    /// Blocks holding a stored page now.
    pub used: usize,
    /// Pages stored since start.
    pub stores: u64,
    /// Pages loaded back since start.
    pub loads: u64,
    /// Preempted requests that came back from the tier since start.
    pub hits: u64,
}

/// A fixed number of page-sized blocks in host memory.
#[derive(Debug)]
pub(crate) struct HostTier {
    page_elems: usize,
    data: Vec<f16>,
    free: Vec<u64>,
    pub stats: TierStats,
}

impl HostTier {
    /// A tier of `bytes` (whole pages of `page_elems` f16 values); `None`
    /// when that is not one page.
    ///
    /// # Errors
    /// [`PoolError::TooLarge`] when the memory cannot be allocated.
    pub fn new(page_elems: usize, bytes: usize) -> Result<Option<HostTier>, PoolError> {
        let blocks = bytes / (page_elems * 2).max(1);
        if blocks == 0 {
            return Ok(None);
        }
        let mut data = Vec::new();
        data.try_reserve_exact(blocks * page_elems)
            .map_err(|_| PoolError::TooLarge {
                pages: blocks,
                page_bytes: page_elems * 2,
            })?;
        data.resize(blocks * page_elems, f16::ZERO);
        Ok(Some(HostTier {
            page_elems,
            data,
            free: (0..blocks as u64).rev().collect(),
            stats: TierStats {
                blocks,
                ..TierStats::default()
            },
        }))
    }

    /// Blocks no stored page holds.
    pub fn free_blocks(&self) -> usize {
        self.free.len()
    }

    /// A free block, now held.
    pub fn take(&mut self) -> Option<u64> {
        let b = self.free.pop()?;
        self.stats.used += 1;
        Some(b)
    }

    /// Block `b` is free again.
    pub fn put_back(&mut self, b: u64) {
        debug_assert!(!self.free.contains(&b), "block {b} freed twice");
        self.free.push(b);
        self.stats.used -= 1;
    }

    /// Copies `page` into block `b`; returns the digest of what the block
    /// holds now.
    pub fn store(&mut self, b: u64, page: &[f16]) -> u64 {
        let block = self.block_mut(b);
        block.copy_from_slice(page);
        digest(block)
    }

    /// Block `b`'s bytes.
    pub fn block(&self, b: u64) -> &[f16] {
        let at = b as usize * self.page_elems;
        &self.data[at..at + self.page_elems]
    }

    fn block_mut(&mut self, b: u64) -> &mut [f16] {
        let at = b as usize * self.page_elems;
        &mut self.data[at..at + self.page_elems]
    }
}

/// The digest of one page's bytes (XXH3-64), the same for a block and for
/// a page that holds what the block holds. Never printed: it is derived
/// from KV.
pub(crate) fn digest(page: &[f16]) -> u64 {
    let mut hasher = xxhash_rust::xxh3::Xxh3::new();
    crate::kv_pool::hash_f16(&mut hasher, page);
    hasher.digest()
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_block_holds_what_was_stored_and_digests_like_the_page() {
        let mut tier = HostTier::new(8, 3 * 16 + 5).unwrap().unwrap();
        assert_eq!(tier.stats.blocks, 3, "whole pages only");
        let page: Vec<f16> = (0..8).map(|i| f16::from_f32(i as f32)).collect();
        let b = tier.take().unwrap();
        let d = tier.store(b, &page);
        assert_eq!(tier.block(b), &page[..]);
        assert_eq!(d, digest(&page));
        let mut other = page.clone();
        other[3] = f16::from_f32(-1.0);
        assert_ne!(digest(&other), d);
        assert_eq!((tier.free_blocks(), tier.stats.used), (2, 1));
        tier.put_back(b);
        assert_eq!((tier.free_blocks(), tier.stats.used), (3, 0));
    }

    #[test]
    fn less_than_a_page_is_no_tier() {
        assert!(HostTier::new(8, 15).unwrap().is_none());
    }
}
