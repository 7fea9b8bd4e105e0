//! How a prefill node and a decode node talk: the messages, and the links
//! that carry them (in-process channels, TCP between processes, RDMA).
//!
//! ```text
//!  decode node                                   prefill node
//!  -----------                                   ------------
//!  admit, reserve pages for the prompt
//!  ToPrefill::Prefill {owner, prompt, dst_pages} ─────────▶ admit, compute the prompt's KV
//!                                      ◀──────── ToDecode::Kv {manifest, bytes}   (RDMA WRITE semantics:
//!  transfer_recv: bytes land in dst pages                    the bytes go into the pages decode reserved)
//!                                      ◀──────── ToDecode::PrefillDone {first token, time queued}
//!  transfer_commit, decode
//! ```
//!
//! A link that breaks delivers [`Inbound::Disconnected`] to its receiver;
//! every request that needed the peer is then aborted with a transport error.
//!
//! Between processes the links come and go: the decode node accepts prefill
//! nodes for as long as it runs ([`accept`]), and a prefill node dials its
//! decode node again after each drop ([`reconnect`]).

pub mod accept;
pub mod in_process;
pub mod peer_auth;
#[cfg(feature = "rdma")]
pub mod rdma;
pub mod reconnect;
pub mod tcp;
pub mod wire;

use kvsan_sanitizer::{Manifest, Owner, PageRef, PoolId, RequestId};

use crate::request::RequestError;
use crate::sampler::SamplingParams;

/// A prefill order: compute `prompt`'s KV and push it into `dst_pages`.
#[derive(Clone, Debug, PartialEq)]
pub struct PrefillOrder {
    /// The request (same id on both nodes).
    pub owner: Owner,
    /// The prompt's token ids.
    pub prompt: Vec<u32>,
    /// How the first token is chosen.
    pub sampling: SamplingParams,
    /// The decode node's pool.
    pub dst_pool: PoolId,
    /// The pages decode reserved, from token 0 (cover the whole prompt).
    pub dst_pages: Vec<PageRef>,
    /// The request's prefix-cache salt (the prefill node's cache keys it).
    pub cache_salt: crate::request::CacheSalt,
}

/// Decode → prefill.
#[derive(Clone, Debug, PartialEq)]
pub enum ToPrefill {
    /// Compute and push a prompt's KV.
    Prefill(PrefillOrder),
    /// Stop working on a request (the client cancelled, or decode aborted it).
    Cancel {
        /// The request.
        request: RequestId,
    },
}

/// What a node announces when a link comes up.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct NodeInfo {
    /// Tokens its pool can hold (pages × page slots).
    pub pool_tokens: usize,
    /// Token slots per page (must be equal on both nodes).
    pub page_slots: usize,
    /// Layers of the model (must be equal).
    pub n_layers: usize,
    /// Values of one slot's K (or V) for one layer (must be equal).
    pub kv_dim: usize,
    /// The model's context window.
    pub context_length: usize,
}

/// The bytes of a KV transfer.
#[derive(Clone, Debug, PartialEq)]
pub enum KvPayload {
    /// The bytes travel with the message, in the order
    /// [`KvPool::pack_slots`](crate::kv_pool::KvPool::pack_slots) writes; the
    /// receiver writes them into its pages.
    Bytes(Vec<u8>),
    /// The bytes were already written into the receiver's pages by the
    /// network (RDMA WRITE); the message is the completion notice.
    Landed,
}

/// The registered range of a decode pool that a link's peer writes KV into
/// directly (RDMA WRITE): the decode node believes [`KvPayload::Landed`]
/// only on a link set up with its own pool's range. A link without one
/// (in-process, TCP) carries the bytes in the message.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct LandingZone {
    /// The registered address of the pool's first byte.
    pub(crate) addr: u64,
    /// Registered bytes.
    pub(crate) len: u64,
    /// The remote key the peer's writes carry.
    pub(crate) rkey: u32,
}

/// KV moving from prefill to decode.
#[derive(Clone, Debug, PartialEq)]
pub struct KvTransfer {
    /// What the transfer claims to carry.
    pub manifest: Manifest,
    /// The bytes.
    pub payload: KvPayload,
    /// The sender's landing digest of each destination page's piece, in
    /// [`kv_slices`] order ([`landing_digest`]): the receiver compares each
    /// with its own digest of what the page holds once the bytes are there.
    pub digests: Vec<u64>,
}

/// Prefill → decode.
#[derive(Clone, Debug, PartialEq)]
pub enum ToDecode {
    /// The prefill node's capacity, sent first on every link.
    Hello(NodeInfo),
    /// KV for some of a request's tokens.
    Kv(KvTransfer),
    /// All of the prompt's KV was sent; `first_token` is the first generated token.
    PrefillDone {
        /// The request.
        request: RequestId,
        /// The token prefill sampled after the prompt.
        first_token: u32,
        /// Prompt tokens whose KV prefill found in its prefix cache.
        cached_tokens: u32,
        /// Microseconds the request waited in prefill's queue before prefill
        /// admitted it: decode's anomaly monitor times only the rest. A
        /// duration, not an instant, so the two nodes' clocks are never
        /// compared.
        queued_us: u64,
    },
    /// Prefill refused or failed the request.
    PrefillFailed {
        /// The request.
        request: RequestId,
        /// Why (a rejection names the prefill pool's limit).
        error: RequestError,
    },
}

/// What a node's inbox receives.
#[derive(Clone, Debug, PartialEq)]
pub enum Inbound<M> {
    /// A message from the peer.
    Message(M),
    /// The link to the peer broke; no more messages will come on it.
    Disconnected {
        /// What happened (for logs).
        reason: String,
    },
}

/// A link's failure to send.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[error("link to {peer} is down: {reason}")]
pub struct LinkDown {
    /// The peer (`prefill`, `decode`, an address).
    pub peer: String,
    /// What happened.
    pub reason: String,
}

/// The sending half of a link carrying messages of type `M`.
pub trait Link<M>: Send + Sync {
    /// Sends `msg`; an error means the peer will not get it.
    ///
    /// # Errors
    /// [`LinkDown`] when the link is broken.
    fn send(&self, msg: M) -> Result<(), LinkDown>;
}

/// The pages and slots a manifest carries, in wire order: `(block-table
/// index, slot range)` for every page its token range touches.
///
/// The bytes of a transfer ([`KvPayload::Bytes`]) follow this order:
///
/// ```text
///  for (index, slots lo..hi) in kv_slices(manifest, page_slots)
///    for layer in manifest.layers
///      K of slots lo..hi: (hi-lo) × kv_dim × f16 little-endian  (contiguous in the page)
///      V of slots lo..hi: (hi-lo) × kv_dim × f16 little-endian
/// ```
#[must_use]
pub fn kv_slices(manifest: &Manifest, page_slots: usize) -> Vec<(usize, std::ops::Range<usize>)> {
    kvsan_sanitizer::block_table::entry_slots(manifest.token_range(), page_slots as u32)
        .map(|(entry, slots)| (entry, slots.start as usize..slots.end as usize))
        .collect()
}

/// Bytes of a transfer's payload for `manifest`.
#[must_use]
pub fn kv_payload_len(manifest: &Manifest, kv_dim: usize) -> usize {
    let layers = manifest.layers.end.saturating_sub(manifest.layers.start) as usize;
    manifest.tokens as usize * layers * 2 * kv_dim * 2
}

/// The checksum a manifest carries: XXH3-64 of the payload bytes.
#[must_use]
pub fn kv_checksum(bytes: &[u8]) -> u64 {
    xxhash_rust::xxh3::xxh3_64(bytes)
}

/// The seed of a piece's landing digest: its token range and layers, so a
/// piece that lands in another page's place (or in another request's) does
/// not match by accident.
#[must_use]
pub fn landing_seed(first_token: usize, tokens: usize, layers: &std::ops::Range<usize>) -> u64 {
    let mut key = [0u8; 32];
    for (i, v) in [first_token, tokens, layers.start, layers.end]
        .into_iter()
        .enumerate()
    {
        key[i * 8..i * 8 + 8].copy_from_slice(&(v as u64).to_le_bytes());
    }
    xxhash_rust::xxh3::xxh3_64(&key)
}

/// The landing digest of one piece of a transfer: XXH3-64, seeded by
/// [`landing_seed`], of the piece's bytes in wire order (the sender's, over
/// what it packs; the receiver's,
/// [`KvPool::landing_digest`](crate::kv_pool::KvPool::landing_digest), over
/// what its page holds).
#[must_use]
pub fn landing_digest(bytes: &[u8], seed: u64) -> u64 {
    xxhash_rust::xxh3::xxh3_64_with_seed(bytes, seed)
}

/// The sender's landing digests of a transfer: one per destination piece,
/// in [`kv_slices`] order, over `bytes` (the payload, in wire order, with
/// `kv_dim` elements per slot of K or V). Bytes shorter than the manifest
/// needs give the digests of what there is.
#[must_use]
pub fn landing_digests(
    manifest: &Manifest,
    page_slots: usize,
    kv_dim: usize,
    bytes: &[u8],
) -> Vec<u64> {
    let layers = manifest.layers.start as usize..manifest.layers.end as usize;
    let slot_bytes = layers.len() * 2 * kv_dim * 2;
    let mut at = 0;
    kv_slices(manifest, page_slots)
        .into_iter()
        .map(|(idx, slots)| {
            let end = (at + slots.len() * slot_bytes).min(bytes.len());
            let piece = &bytes[at.min(end)..end];
            at = end;
            landing_digest(
                piece,
                landing_seed(idx * page_slots + slots.start, slots.len(), &layers),
            )
        })
        .collect()
}
