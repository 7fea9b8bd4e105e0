//! The prefill node's fail points: the KV it ships. Each seam is the
//! identity (or a no-op) unless its fault is injected; without the
//! `faults` feature every one compiles away.

use super::TRANSFER_TOKENS;
use crate::faults::{Fault, active};
use crate::transport::{KvTransfer, Link, ToDecode};

/// The prompt tokens whose KV goes to decode: all `prompt_len`.
///
/// Fault `short-transfer`: the last piece of a prompt whose KV goes in
/// several pieces is dropped (an off-by-one in the piece loop).
pub(super) fn short_transfer(prompt_len: usize) -> usize {
    if active(Fault::ShortTransfer) && prompt_len > TRANSFER_TOKENS {
        return (prompt_len - 1) / TRANSFER_TOKENS * TRANSFER_TOKENS;
    }
    prompt_len
}

/// Fault `transfer-replayed-after-commit`: KV messages kept for a retry of
/// a write whose acknowledgement never came. Empty without the fault.
#[derive(Default)]
pub(super) struct Retry {
    /// The last message of the request shipped last.
    kept: Option<KvTransfer>,
    /// The last message of the request being shipped.
    pending: Option<KvTransfer>,
}

/// Nothing: a message sent is forgotten.
///
/// Fault `transfer-replayed-after-commit`: the request's last message
/// (`last`: `transfer` is it) is kept for a retry.
pub(super) fn keep_for_retry(retry: &mut Retry, transfer: &KvTransfer, last: bool) {
    retry.pending = (active(Fault::TransferReplayedAfterCommit) && last).then(|| transfer.clone());
}

/// Nothing: a request shipped and ended has nothing more to send.
///
/// Fault `transfer-replayed-after-commit`: the previous request's last
/// message goes again, as the retry of a write never acknowledged, and the
/// request just shipped keeps its own for the next time.
pub(super) fn replay_for_retry(retry: &mut Retry, link: &dyn Link<ToDecode>) {
    if let Some(kept) = std::mem::replace(&mut retry.kept, retry.pending.take()) {
        let _ = link.send(ToDecode::Kv(kept));
    }
}
