//! A request as a node holds it: its tokens, pages, sampler and the channel
//! its events go to.

use std::time::{Duration, Instant};

use crossbeam_channel::Sender;
use kvsan_sanitizer::{BlockTable, Owner};

use crate::anomaly::{self, KvCoverage};
use crate::request::{CacheSalt, Event, FinishReason, RequestError};
use crate::sampler::Sampler;

/// One request on one node.
#[derive(Debug)]
pub(crate) struct Sequence {
    /// Request and tenant.
    pub owner: Owner,
    /// The prompt followed by the tokens generated so far.
    pub tokens: Vec<u32>,
    /// Length of the prompt within `tokens`.
    pub prompt_len: usize,
    /// Most tokens to generate.
    pub max_tokens: usize,
    /// Tokens that end generation.
    pub stop_tokens: Vec<u32>,
    /// Chooses each next token (its state survives preemption).
    pub sampler: Sampler,
    /// The sequence's pages, from token 0.
    pub table: BlockTable,
    /// Positions whose KV is in the pool (`tokens[..computed]`).
    pub computed: usize,
    /// Where the client's events go (`None` on a prefill node: decode answers the client).
    pub events: Option<Sender<Event>>,
    /// Order of admission (preemption takes the latest first); when it
    /// happened is `admitted`.
    pub admitted_at: u64,
    /// Fault `reject-as-placeholder`: the prompt was rejected and replaced
    /// by a one-token placeholder that is sent to prefill instead.
    pub placeholder: bool,
    /// When the request reached this node.
    pub arrived: Instant,
    /// When it was last admitted: the scheduler took it into the running
    /// batch (unified, prefill; again after a preemption, which recomputes
    /// it from then), or its pages were reserved for its prompt (decode).
    /// `None` while it has not been.
    pub admitted: Option<Instant>,
    /// Decode: how long it waited in the prefill node's queue before
    /// prefill admitted it, as prefill reported with its completion; zero
    /// elsewhere.
    pub peer_queued: Duration,
    /// The prompt KV this node computed or received for it (the anomaly
    /// monitor's count, kept apart from `computed`).
    pub kv: KvCoverage,
    /// Its prefix-cache salt.
    pub cache_salt: CacheSalt,
    /// Its prefix-cache keys on this node (the policy's domain).
    pub cache_keys: Vec<u8>,
    /// Chain hashes of its full pages, from page 0, as far as hashed.
    pub page_hashes: Vec<u64>,
    /// Prompt tokens whose KV came from the prefix cache at admission.
    pub cached_tokens: usize,
    /// Where its KV waits while it is preempted to the host tier (`None`:
    /// not preempted, or preempted by recompute).
    pub offloaded: Option<Offloaded>,
}

/// A preempted sequence's KV in a tier: block `blocks[i]` holds its page
/// `i`, together positions `0..tokens`; `kv`, its prompt KV coverage as it
/// was.
#[derive(Debug)]
pub(crate) struct Offloaded {
    pub blocks: Vec<kvsan_sanitizer::TierBlockId>,
    pub tokens: usize,
    pub kv: KvCoverage,
}

impl Sequence {
    /// Tokens generated so far.
    pub fn generated(&self) -> usize {
        self.tokens.len() - self.prompt_len
    }

    /// Positions still to compute before the next token can be sampled.
    pub fn pending(&self) -> usize {
        self.tokens.len() - self.computed
    }

    /// Positions to compute once it is back: [`Sequence::pending`], less
    /// what comes back from the host tier.
    pub fn pending_after_reload(&self) -> usize {
        self.tokens.len() - self.offloaded.as_ref().map_or(self.computed, |o| o.tokens)
    }

    /// How long it waited in this node's queue before its latest admission
    /// (zero while it has not been admitted).
    pub fn queued(&self) -> Duration {
        self.admitted.map_or(Duration::ZERO, |a| {
            a.saturating_duration_since(self.arrived)
        })
    }

    /// Its service time if its first token came now: the time since its
    /// arrival, less its queueing here and on the prefill node
    /// ([`anomaly::service_time`]).
    pub fn service_time(&self) -> Duration {
        anomaly::service_time(
            self.arrived,
            self.admitted,
            self.peer_queued,
            Instant::now(),
        )
    }

    /// Sends `event` to the client (a client that went away is not an error).
    pub fn emit(&self, event: Event) {
        if let Some(tx) = &self.events {
            let _ = tx.send(event);
        }
    }

    /// Appends a sampled token; returns how the request ends if it does.
    pub fn push_token(&mut self, token: u32) -> Option<FinishReason> {
        if self.stop_tokens.contains(&token) {
            return Some(FinishReason::Stop);
        }
        self.tokens.push(token);
        self.emit(Event::Token(token));
        (self.generated() >= self.max_tokens).then_some(FinishReason::Length)
    }

    /// Sends the final `Finished` event.
    pub fn finish(&self, reason: FinishReason) {
        self.emit(Event::Finished {
            reason,
            prompt_tokens: self.prompt_len,
            generated: self.generated(),
            cached_tokens: self.cached_tokens,
        });
    }

    /// Sends the final `Error` event.
    pub fn fail(&self, error: RequestError) {
        self.emit(Event::Error(error));
    }
}
