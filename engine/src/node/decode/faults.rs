//! The decode node's fail points: admission, the cancel of a request whose
//! KV is on its way, and where a received KV message is copied. Each seam
//! is the identity (or a no-op) unless its fault is injected; without the
//! `faults` feature every one compiles away. The paths only a fault takes
//! (a placeholder's admission, a late landing, a lazy cancel and its
//! commit) live here too.

use std::ops::Range;

use crossbeam_channel::Sender;
use kvsan_sanitizer::{Manifest, Owner, PageId, PageRef};

use super::{DecodeNode, Record};
use crate::faults::{Fault, active};
use crate::node::sequence::Sequence;
use crate::node::step_loop::{self, fail, fail_in_place, new_sequence};
use crate::request::{Event, Request, RequestError};
use crate::transport::KvPayload;

/// The token a rejected prompt is replaced by under `reject-as-placeholder`.
const PLACEHOLDER_TOKEN: u32 = 0;

/// A copy of an admitted `request` kept in case it is refused: none.
///
/// Fault `reject-as-placeholder`: the copy, for the placeholder.
pub(super) fn keep_rejected(request: &Request) -> Option<Request> {
    active(Fault::RejectAsPlaceholder).then(|| request.clone())
}

/// Whether a request refused with `refusal` is admitted after all: no.
///
/// Fault `reject-as-placeholder` (the incident): a prompt rejected for the
/// prefill node's size becomes a one-token placeholder, queued again under
/// the request's id so it can drain through the batching machinery.
/// Nothing on this path asks whether the request was rejected: the
/// rejection ended the lifecycle's record of it, so to the lifecycle, which
/// keeps live requests only, the placeholder is a new request, and the
/// disaggregated admission takes it like any queued one. Pages are reserved
/// for the whole prompt, prefill computes one token, and decode commits the
/// whole reservation.
pub(super) fn reject_as_placeholder(
    node: &mut DecodeNode,
    owner: Owner,
    refusal: &RequestError,
    kept: Option<Request>,
    events: &Sender<Event>,
) -> bool {
    let over_prefill = refusal
        .rejection
        .as_ref()
        .is_some_and(|r| r.node == "prefill");
    let Some(request) = kept.filter(|_| over_prefill) else {
        return false;
    };
    let page_slots = node.core.pool.page_slots();
    match new_sequence(owner, request, page_slots, Some(events.clone())) {
        Ok(mut seq) => {
            seq.placeholder = true;
            if let Some(seq) = step_loop::queue(&mut node.core, seq) {
                node.queue_for_pages(seq);
            }
        }
        Err(e) => tracing::error!(node = %node.core.name, "placeholder: {}", e.message),
    }
    true
}

/// The prompt prefill is ordered to compute for `seq`: `prompt`, its own.
///
/// Fault `reject-as-placeholder`: a placeholder's one token.
pub(super) fn placeholder_prompt(seq: &Sequence, prompt: Vec<u32>) -> Vec<u32> {
    if seq.placeholder {
        return vec![PLACEHOLDER_TOKEN];
    }
    prompt
}

/// Whether a KV message for a request this node no longer holds is copied
/// anyway: no, it is dropped.
///
/// Fault `transfer-replayed-after-commit`: one for this node's pool is
/// taken for the retry of a lost write.
pub(super) fn transfer_replayed_after_commit(node: &DecodeNode, manifest: &Manifest) -> bool {
    active(Fault::TransferReplayedAfterCommit) && manifest.dst_pool == node.core.pool_id
}

/// Faults `free-during-transfer`, `transfer-replayed-after-commit`: the KV
/// of a request this node no longer holds lands after all, in the
/// destination pages the request held, which the free list may have handed
/// to another request since (the late DMA of an unfenced transfer, a
/// replayed write). The hook sees it first; on its abort verdict nothing is
/// written (the request has already ended, so there is nobody to fail).
pub(super) fn land_late(
    node: &mut DecodeNode,
    manifest: &Manifest,
    payload: &KvPayload,
    digests: &[u64],
) {
    let id = manifest.request.request;
    let mut verdict = node.core.hooks.transfer_recv(node.core.pool_id, manifest);
    node.core.stats.transfers += 1;
    if verdict.is_continue() {
        verdict = node.land(manifest, payload, digests);
    }
    if !verdict.is_continue() {
        tracing::warn!(node = %node.core.name, request = id.0, "late KV transfer refused");
    }
}

/// The current generation of `page`: a copy lands in the page as it is now.
fn now(node: &DecodeNode, page: PageId) -> PageRef {
    PageRef {
        page,
        generation: node.core.pool.generations()[page.0 as usize],
    }
}

/// Whether `manifest` covers whole pages: the bulk path of the faults
/// `descriptor-offset-dropped` and `block-size-mismatch`.
fn whole_pages(node: &DecodeNode, manifest: &Manifest) -> bool {
    let ps = node.core.pool.page_slots();
    let first = manifest.first_token as usize;
    first.is_multiple_of(ps) && (first + manifest.tokens as usize).is_multiple_of(ps)
}

/// Where the copy of a manifest's piece for block-table entry `idx` writes
/// instead of its own page: nowhere else.
///
/// Fault `overlapping-transfer`: the receiver computes where a message's KV
/// goes back from the message's end, with its page count taken as
/// `tokens / page_slots + 1` instead of rounded up. For a message that ends
/// on a page boundary the count is one too many and the destination is off
/// by one page: each page of the message is written into the physically
/// preceding page of the pool, the first of them a page the request does
/// not hold (on a reservation taken in page order, the previous
/// reservation's last page). A message touching the pool's first page is
/// left as it is (its destination would start before the pool).
pub(super) fn overlapping_transfer(
    node: &DecodeNode,
    manifest: &Manifest,
    idx: usize,
    slots: &Range<usize>,
) -> Option<(PageRef, Range<usize>)> {
    if !active(Fault::OverlappingTransfer) {
        return None;
    }
    let ps = node.core.pool.page_slots();
    let start = manifest.first_token as usize;
    let end = start + manifest.tokens as usize;
    let touched = start / ps..end.div_ceil(ps);
    let counted = manifest.tokens as usize / ps + 1;
    if counted <= touched.len() || manifest.dst_pages[touched].iter().any(|p| p.page.0 == 0) {
        return None;
    }
    let page = PageId(manifest.dst_pages[idx].page.0 - 1);
    Some((now(node, page), slots.clone()))
}

/// Where the copy of a manifest's piece writes instead of its own page:
/// nowhere else.
///
/// Fault `descriptor-offset-dropped`: a message of whole pages puts each
/// page's piece at the message's base (its first destination page) with
/// the piece's slot offset, dropping the page's own offset.
pub(super) fn descriptor_offset_dropped(
    node: &DecodeNode,
    manifest: &Manifest,
    slots: &Range<usize>,
) -> Option<(PageRef, Range<usize>)> {
    if !active(Fault::DescriptorOffsetDropped) || !whole_pages(node, manifest) {
        return None;
    }
    let ps = node.core.pool.page_slots();
    let base = manifest.dst_pages[manifest.first_token as usize / ps].page;
    Some((now(node, base), slots.clone()))
}

/// The slots the copy of a manifest's piece for block-table entry `idx`
/// writes instead of `slots`: none other.
///
/// Fault `block-size-mismatch`: a message of whole pages takes a page as
/// holding half the slots it does, so each page's piece is written only up
/// to slot `page_slots / 2`.
pub(super) fn block_size_mismatch(
    node: &DecodeNode,
    manifest: &Manifest,
    idx: usize,
    slots: &Range<usize>,
) -> Option<(PageRef, Range<usize>)> {
    if !active(Fault::BlockSizeMismatch) || !whole_pages(node, manifest) {
        return None;
    }
    let half = node.core.pool.page_slots() / 2;
    Some((
        manifest.dst_pages[idx],
        slots.start.min(half)..slots.end.min(half),
    ))
}

/// The cancel of a request whose KV is on its way, taken by the fault or
/// handed back (`Some`): handed back.
///
/// Fault `commit-after-abort`: the cancel cleans up lazily. The pages go
/// back to the free list and the client gets its answer at once; the
/// request's record, block table included, is left for the end of the
/// transfer to remove, and prefill is not told (its completion is the
/// cleanup's cue). The KV pieces still to come are dropped (`receive`),
/// the completion is not (`commit`).
pub(super) fn commit_after_abort(
    node: &mut DecodeNode,
    mut seq: Sequence,
    cancelled: RequestError,
) -> Option<(Sequence, RequestError)> {
    if !active(Fault::CommitAfterAbort) {
        return Some((seq, cancelled));
    }
    let table = seq.table.clone();
    fail_in_place(&mut node.core, &mut seq, cancelled);
    seq.table = table;
    node.records
        .insert(seq.owner.request, Record::LeftForCleanup(seq));
    None
}

/// Fault `commit-after-abort`: the completion of a request cancelled while
/// its KV was on its way is taken for a live one's. The lifecycle, which
/// ended the request at the cancel, is not asked: the record the lazy
/// cancel left, with the block table of its freed pages, is committed and
/// decodes.
pub(super) fn commit_left_for_cleanup(node: &mut DecodeNode, seq: Sequence, first_token: u32) {
    if !node.commit_hook(&seq).is_continue() {
        // Its client has its answer and its pages are not its own any
        // more: nothing to fail, nothing to free.
        tracing::warn!(node = %node.core.name, request = seq.owner.request.0, "commit of a cancelled request refused");
        return;
    }
    node.start_decoding(seq, first_token);
}

/// The cancel of a request whose KV is on its way, taken by the fault or
/// handed back (`Some`): handed back.
///
/// Fault `free-during-transfer`: the pages go back to the free list at
/// once, but the transfer in flight is taken for one that cannot be
/// stopped: prefill is not told, and its KV is still received into the
/// pages (`land_late`).
pub(super) fn free_during_transfer(
    node: &mut DecodeNode,
    seq: Sequence,
    cancelled: RequestError,
) -> Option<(Sequence, RequestError)> {
    if !active(Fault::FreeDuringTransfer) {
        return Some((seq, cancelled));
    }
    node.records.insert(
        seq.owner.request,
        Record::Unfenced(seq.table.pages().to_vec()),
    );
    fail(&mut node.core, seq, cancelled);
    None
}
