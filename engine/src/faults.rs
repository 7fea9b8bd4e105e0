//! Fault injection: named fail points inside the real engine code paths that
//! re-create bug classes seen in production engines, so tests and the
//! incident replay can show that without the sanitizer the bug leaks another
//! request's data, and with it the request is aborted with a report.
//!
//! Fail points exist only in builds with the `faults` feature; without it
//! [`active`] is a constant `false` and every fail point compiles away.
//! Faults are chosen at run time: `KVSAN_FAULTS=name[,name]` (read once), or
//! [`set`] (the CLI's `--inject name`).
//!
//! This module is the leaf the engine's code calls into: the names and the
//! switch. Each fail point in a production path is one call to a small
//! named seam in a `faults` module beside that code (`node/batch/faults.rs`,
//! `node/decode/faults.rs`, `prefix_cache/faults.rs`, …), which asks
//! [`active`] and is the identity, or a no-op, unless its fault is
//! injected; the paths only a fault takes live there too.
//!
//! | fault | what the engine then does wrong |
//! | --- | --- |
//! | `reject-as-placeholder` | an oversize prompt is rejected into a one-token placeholder, queued again under the request's id to drain through the batching machinery; nothing on the disaggregated admission path asks whether the request was rejected (the engine's lifecycle keeps live requests only, so to it the placeholder is a new request), so decode reserves pages for the whole prompt, prefill sends KV for one token, and decode reads its whole reservation |
//! | `free-during-transfer` | decode, cancelling a request whose KV is on its way, frees its reserved pages at once and takes the transfer in flight for one that cannot be stopped: prefill is not told, and the KV, computed later, is still received into the freed pages — by then another request's |
//! | `short-transfer` | prefill drops the last piece of a prompt whose KV goes in several pieces (an off-by-one in the piece loop), yet reports the prefill done; decode commits and reads the whole prompt |
//! | `skip-layer-write` | a prefill chunk longer than [`crate::model::forward::LONG_CHUNK_TOKENS`] takes a store path whose layer loop stops one layer short: the chunk's slots keep the page's previous owner's KV for the last layer, which attention then reads and prefill ships |
//! | `stale-block-table` | preemption frees a sequence's pages from a copy of its block table and the sequence keeps its own: on resume it recomputes and decodes through `PageRef`s to pages the free list has since handed to another request |
//! | `double-free` | a request's release frees its tail page on its own and then again with the rest of its block table, and the pool (no "already free" check) puts the page on the free list twice: the next two allocations hand the same page to two requests |
//! | `overlapping-transfer` | decode computes the destination of a KV transfer message's copy back from its end with the page count taken as `tokens / page_slots + 1`: a message ending on a page boundary is written one page early, its first page's KV landing in the physically preceding page — another request's |
//! | `commit-after-abort` | decode, cancelling a request whose KV is on its way, frees its reserved pages at once, ends the request, and leaves its record for the transfer's end to clean up (prefill is not told; the KV pieces that still come are dropped): the completion — prefill's commit of the last chunk, with the first token — finds that record and is not checked against the lifecycle, which ended the request, so decode commits the cancelled request and decodes it through the block table it had, writing its tokens' KV into pages the free list has since handed to another request |
//! | `padding-slot-wrap` | a batch of two or more rows is padded to a multiple of 4 rows (fixed batch shapes); each padding row repeats the first row (its request and last token) with slot mapping −1, which, unchecked, wraps to the pool's last slot: the first row's KV lands in the page of whichever request owns the pool's last page |
//! | `decode-length-overrun` | a decode row of a sequence past `LONG_DECODE_TOKENS` (`node/batch/faults.rs`) tokens takes the long-context path, whose attention length the batch gives as the row's pages' capacity (pages × page slots) instead of its tokens: it attends over its last page's unwritten slots, which hold the page's previous owner's KV |
//! | `block-table-row-order` | the batch's kernel rows (queries, lengths, store positions) are sorted longest-query first for the kernel's load balance, but the block-table array is written in plan order: a row whose place moved reads, and stores into, another row's pages |
//! | `slot-mapping-chunk-offset` | a prefill chunk that starts inside a page gets its store slots counted from the chunk's start (`i % page_slots`, not `(start + i) % page_slots`): its tokens' KV lands on slots its own earlier tokens hold, and its real slots stay as the page's previous owner left them, which attention then reads |
//! | `cache-register-before-write` | the prefix cache registers a page when it is allocated for a prompt chunk, keyed by the prompt tokens it is to hold, not after the step that writes them: a request admitted in the same step finds the page, and attends over its slots that the writer's next chunk has not yet written — the page's previous owner's KV |
//! | `cache-salt-dropped` | the pages a request registers after a step are keyed without its cache salt (the lookup at admission keeps it): an unsalted request of another domain finds a salted request's prompt in the cache — the prompt-caching side channel, seen in `cached_tokens` and time to first token |
//! | `cache-key-collision` | the prefix cache's extra keys concatenate the server-side and the client's salts untyped: a key's server salt `s` and another request's `cache_salt` `s` key the same pages |
//! | `cache-evict-referenced` | when no cached page is unreferenced, eviction takes the oldest cached page anyway and returns it to the pool while requests still read it: the next allocation hands it to another request, whose KV they then attend over |
//! | `cache-partial-page-shared` | the prefix cache registers a sequence's partial last page after each step and shares it without a copy: a later request with the same prefix writes its own tokens into the page's free slots, which the page's owner fills with its own answer and attends over |
//! | `cache-keeps-aborted` | a request that leaves before its prefill is done (preempted, cancelled, aborted) has its pages registered in the prefix cache under the prompt tokens they were to hold, as if the prefill had filled them: a later request with that prompt attends over slots never written for it |
//! | `descriptor-offset-dropped` | decode's copy of a KV message of whole pages (its bulk path) puts each page's piece at the base of the message's destination (its first page) with the piece's slot offset, dropping the page's own offset (ai-dynamo/nixl#883: libfabric writes at the registered region's base instead of each descriptor's offset): every piece lands in the message's first page, and the message's other pages keep their previous owner's KV, which decode then reads as the prompt's |
//! | `block-size-mismatch` | decode's copy of a KV message of whole pages (its bulk path) takes a page as holding half the slots it does (a block size mixed up between the sender's and the kernel's, vllm#28677): it writes each page's piece only up to slot `page_slots / 2` and drops the rest, so the second half of every page it receives keeps its previous owner's KV |
//! | `transfer-replayed-after-commit` | prefill keeps each request's last KV message for a retry and sends it again after the next request's KV (a write whose acknowledgement it never saw, vllm#52234, sglang#24527); decode takes a KV message for a request it no longer holds for a retry of a lost write and copies it where its manifest says — into pages the free list has since handed to the next request, over that request's prompt |
//! | `tier-load-failed-as-hit` | a preempted request's page read back from the host tier fails and the failure is swallowed (ai-dynamo/dynamo#15079: a failed disk-to-GPU onboard still counted as a hit; dynamo#8057): the load is counted done without its copy, and the request decodes on over the page as the free list left it — another request's KV |
//! | `tier-store-after-reuse` | a preempted request's pages are freed as soon as their host-tier stores are queued, and the copies are made later, as an asynchronous copy engine makes them (LMCache#4955: a store still reading its source pages when the request was preempted and the pages reused): the next owner's KV is written to the tier under the preempted request's blocks, which it loads back and attends over |
//! | `tier-two-pages-one-block` | the tier's blocks for a step's stores are counted from its free list as it was when the step began (TensorRT-LLM#8813, fixed by #9056: two device blocks offloaded into the same host block in one step — outputs contained other prompts' tokens): when one allocation evicts several cached pages down a tier, each after the first is stored into the first's block, and a later hit on the first loads the last — another tenant's prompt KV |
//! | `tier-meta-by-page-id` | the tier files a cached page's block by the pool page it was stored from, a logical id the pool hands out again (TensorRT-LLM#8830: a reused offloaded block took the wrong block's state): once the page is reused and its next owner's cached page goes down the tier too, a hit on the first entry loads the second's block — another tenant's prompt KV |
//! | `stale-batch-array` | the batch's block-table array is kept from step to step, and a row whose table has as many pages as the row held last step is taken as unchanged: when a request leaves and the next takes its row with as many pages, it stores into and reads the pages of the request that left |

/// A fault this build can inject.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
#[non_exhaustive]
pub enum Fault {
    /// The incident: an oversize prompt rejected into a one-token
    /// placeholder is admitted by the disaggregated path anyway.
    RejectAsPlaceholder,
    /// Prefill sends fewer tokens than decode reserved and committed.
    ShortTransfer,
    /// A long prefill chunk's KV store skips the last layer.
    SkipLayerWrite,
    /// Decode frees a cancelled request's pages while its transfer is in
    /// flight; the late KV lands in pages now another request's.
    FreeDuringTransfer,
    /// A preempted sequence keeps `PageRef`s to its freed pages.
    StaleBlockTable,
    /// A released sequence's tail page is freed twice and handed out twice.
    DoubleFree,
    /// A KV transfer descriptor spills into the neighbouring page.
    OverlappingTransfer,
    /// A padded batch row writes slot −1, i.e. the pool's last slot.
    PaddingSlotWrap,
    /// The completion of a request cancelled while its KV was on its way
    /// is committed anyway: the request decodes through its freed pages.
    CommitAfterAbort,
    /// A long sequence's decode attends over its pages' whole capacity.
    DecodeLengthOverrun,
    /// Kernel rows reordered without the block-table array.
    BlockTableRowOrder,
    /// A mid-page chunk's store slots counted from the chunk's start.
    SlotMappingChunkOffset,
    /// A batch block-table row kept from the previous step for a new occupant.
    StaleBatchArray,
    /// A page enters the prefix cache before the step that writes it.
    CacheRegisterBeforeWrite,
    /// A request's cache salt is left out of the keys it registers pages under.
    CacheSaltDropped,
    /// The prefix cache's two kinds of salt concatenated untyped.
    CacheKeyCollision,
    /// Eviction of a cached page that requests still hold.
    CacheEvictReferenced,
    /// A partial page shared without a copy.
    CachePartialPageShared,
    /// An unfinished prefill's pages registered in the prefix cache.
    CacheKeepsAborted,
    /// Every piece of a KV message copied to the message's first page.
    DescriptorOffsetDropped,
    /// Each received page's piece copied only up to half the page.
    BlockSizeMismatch,
    /// A request's last KV message sent again, and copied, after the
    /// request ended.
    TransferReplayedAfterCommit,
    /// A failed read of a preempted request's page from the host tier
    /// counted as a load done.
    TierLoadFailedAsHit,
    /// A preempted request's pages freed before their host-tier copies are
    /// made.
    TierStoreAfterReuse,
    /// Several stores of one step handed one tier block.
    TierTwoPagesOneBlock,
    /// Cached pages' tier blocks filed by the pool page they came from.
    TierMetaByPageId,
}

impl Fault {
    /// Every fault.
    pub const ALL: [Fault; 26] = [
        Fault::RejectAsPlaceholder,
        Fault::FreeDuringTransfer,
        Fault::ShortTransfer,
        Fault::SkipLayerWrite,
        Fault::StaleBlockTable,
        Fault::DoubleFree,
        Fault::PaddingSlotWrap,
        Fault::OverlappingTransfer,
        Fault::CommitAfterAbort,
        Fault::DecodeLengthOverrun,
        Fault::BlockTableRowOrder,
        Fault::SlotMappingChunkOffset,
        Fault::StaleBatchArray,
        Fault::CacheRegisterBeforeWrite,
        Fault::CacheSaltDropped,
        Fault::CacheKeyCollision,
        Fault::CacheEvictReferenced,
        Fault::CachePartialPageShared,
        Fault::CacheKeepsAborted,
        Fault::DescriptorOffsetDropped,
        Fault::BlockSizeMismatch,
        Fault::TransferReplayedAfterCommit,
        Fault::TierLoadFailedAsHit,
        Fault::TierStoreAfterReuse,
        Fault::TierTwoPagesOneBlock,
        Fault::TierMetaByPageId,
    ];

    /// The stable name (`KVSAN_FAULTS`, `--inject`).
    #[must_use]
    pub fn name(self) -> &'static str {
        match self {
            Fault::RejectAsPlaceholder => "reject-as-placeholder",
            Fault::FreeDuringTransfer => "free-during-transfer",
            Fault::ShortTransfer => "short-transfer",
            Fault::StaleBlockTable => "stale-block-table",
            Fault::SkipLayerWrite => "skip-layer-write",
            Fault::DoubleFree => "double-free",
            Fault::OverlappingTransfer => "overlapping-transfer",
            Fault::PaddingSlotWrap => "padding-slot-wrap",
            Fault::CommitAfterAbort => "commit-after-abort",
            Fault::DecodeLengthOverrun => "decode-length-overrun",
            Fault::BlockTableRowOrder => "block-table-row-order",
            Fault::SlotMappingChunkOffset => "slot-mapping-chunk-offset",
            Fault::StaleBatchArray => "stale-batch-array",
            Fault::CacheRegisterBeforeWrite => "cache-register-before-write",
            Fault::CacheSaltDropped => "cache-salt-dropped",
            Fault::CacheKeyCollision => "cache-key-collision",
            Fault::CacheEvictReferenced => "cache-evict-referenced",
            Fault::CachePartialPageShared => "cache-partial-page-shared",
            Fault::CacheKeepsAborted => "cache-keeps-aborted",
            Fault::DescriptorOffsetDropped => "descriptor-offset-dropped",
            Fault::BlockSizeMismatch => "block-size-mismatch",
            Fault::TransferReplayedAfterCommit => "transfer-replayed-after-commit",
            Fault::TierLoadFailedAsHit => "tier-load-failed-as-hit",
            Fault::TierStoreAfterReuse => "tier-store-after-reuse",
            Fault::TierTwoPagesOneBlock => "tier-two-pages-one-block",
            Fault::TierMetaByPageId => "tier-meta-by-page-id",
        }
    }

    /// The fault named `name`.
    #[must_use]
    pub fn from_name(name: &str) -> Option<Fault> {
        Fault::ALL.into_iter().find(|f| f.name() == name)
    }

    #[cfg(feature = "faults")]
    fn bit(self) -> u32 {
        1 << (self as u32)
    }
}

/// Parses a comma-separated fault list.
///
/// # Errors
/// A message naming the unknown fault and the known ones.
pub fn parse(list: &str) -> Result<Vec<Fault>, String> {
    list.split(',')
        .map(str::trim)
        .filter(|s| !s.is_empty())
        .map(|name| {
            Fault::from_name(name).ok_or_else(|| {
                let known: Vec<&str> = Fault::ALL.iter().map(|f| f.name()).collect();
                format!("unknown fault '{name}' (known: {})", known.join(", "))
            })
        })
        .collect()
}

#[cfg(feature = "faults")]
mod state {
    use std::sync::OnceLock;
    use std::sync::atomic::{AtomicU32, Ordering};

    use super::Fault;

    static ACTIVE: AtomicU32 = AtomicU32::new(0);
    static FROM_ENV: OnceLock<()> = OnceLock::new();

    fn init() {
        FROM_ENV.get_or_init(|| {
            if let Ok(list) = std::env::var("KVSAN_FAULTS") {
                match super::parse(&list) {
                    Ok(faults) => {
                        for f in faults {
                            ACTIVE.fetch_or(f.bit(), Ordering::Relaxed);
                        }
                    }
                    Err(e) => tracing::error!("KVSAN_FAULTS: {e}; no fault injected"),
                }
            }
        });
    }

    pub fn active(f: Fault) -> bool {
        init();
        ACTIVE.load(Ordering::Relaxed) & f.bit() != 0
    }

    pub fn set(faults: &[Fault]) {
        init();
        let bits = faults.iter().fold(0, |b, f| b | f.bit());
        ACTIVE.store(bits, Ordering::Relaxed);
    }
}

/// Whether fault `f` is injected (always `false` without the `faults` feature).
#[inline]
#[must_use]
pub fn active(f: Fault) -> bool {
    #[cfg(feature = "faults")]
    {
        state::active(f)
    }
    #[cfg(not(feature = "faults"))]
    {
        let _ = f;
        false
    }
}

/// Replaces the injected faults (after `KVSAN_FAULTS` was read).
///
/// # Errors
/// Without the `faults` feature, a message saying the build has no fail points.
pub fn set(faults: &[Fault]) -> Result<(), String> {
    #[cfg(feature = "faults")]
    {
        state::set(faults);
        Ok(())
    }
    #[cfg(not(feature = "faults"))]
    {
        if faults.is_empty() {
            Ok(())
        } else {
            Err("this build has no fault injection (build with --features faults)".into())
        }
    }
}
