//! Pool geometry: what `pool_register` is told about a KV page pool.

use serde::{Deserialize, Serialize};

use crate::error::SanitizerError;

/// The most token slots a page may hold (history events store slot indices in 16 bits).
pub const MAX_PAGE_SLOTS: u32 = 4096;

/// What a node does in the serving topology.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, Serialize, Deserialize)]
#[serde(rename_all = "kebab-case")]
pub enum NodeRole {
    /// One node computes prefill and decode.
    Unified,
    /// A prefill node: computes the prompt's KV and ships it.
    Prefill,
    /// A decode node: reserves pages, receives KV, generates.
    Decode,
}

impl NodeRole {
    /// The lower-case name used in reports.
    #[must_use]
    pub const fn name(self) -> &'static str {
        match self {
            NodeRole::Unified => "unified",
            NodeRole::Prefill => "prefill",
            NodeRole::Decode => "decode",
        }
    }
}

/// The shape of one KV page pool on one node.
///
/// A page holds `page_slots` token slots for each of `layers` layers; one slot
/// of one layer (K and V for every KV head) takes `bytes_per_slot` bytes, so a
/// page is `page_slots × layers × bytes_per_slot` bytes of KV.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct PoolGeometry {
    /// Number of pages in the pool.
    pub pages: u32,
    /// Token slots per page.
    pub page_slots: u32,
    /// Transformer layers (each page holds every layer of its slots).
    pub layers: u32,
    /// Bytes of KV for one token slot in one layer (K and V, all KV heads).
    pub bytes_per_slot: u64,
    /// What the node owning the pool does.
    pub role: NodeRole,
    /// The node's name, shown in reports and history (`decode-0`).
    pub node: String,
}

impl PoolGeometry {
    /// Bytes of KV one page holds: `page_slots × layers × bytes_per_slot`.
    #[must_use]
    pub fn page_bytes(&self) -> u64 {
        u64::from(self.page_slots) * u64::from(self.layers) * self.bytes_per_slot
    }

    /// Checks that every dimension is usable.
    ///
    /// # Errors
    /// [`SanitizerError::BadGeometry`] naming the field, its value and the limit.
    pub fn validate(&self) -> Result<(), SanitizerError> {
        let bad = |field: &'static str, value: u64, limit: &'static str| {
            Err(SanitizerError::BadGeometry {
                field,
                value,
                limit,
            })
        };
        if self.pages == 0 {
            return bad("pages", 0, "at least 1");
        }
        if self.page_slots == 0 || self.page_slots > MAX_PAGE_SLOTS {
            return bad("page_slots", self.page_slots.into(), "1 to 4096");
        }
        if self.layers == 0 || self.layers > 65_536 {
            return bad("layers", self.layers.into(), "1 to 65536");
        }
        Ok(())
    }
}
