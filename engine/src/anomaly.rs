//! The anomaly monitor: what a node can tell about a request at its first
//! token, with or without a sanitizer attached.
//!
//! The incident's signature was a first token computed from one token of KV
//! for a prompt of 1,100: the prompt had been replaced by a placeholder,
//! prefill computed and sent KV for the placeholder, and decode committed
//! the whole reservation as if it held the prompt. Two things a node sees
//! give that away without any shadow state:
//!
//! - **`short-kv`**: the KV positions this node computed (unified) or
//!   received in accepted transfers (decode) for the request, counted over
//!   every layer, are fewer than its prompt's tokens when the first token
//!   is emitted. Counted from what the kernels computed and what the
//!   transfers carried — not from the node's own bookkeeping of
//!   `computed`, which is exactly what a bug like the incident's gets wrong.
//! - **`fast-first-token`**: the request's service time on the node, per
//!   prompt token it had to compute, is far below what the node has needed
//!   for any such prompt lately: less than 1/[`FAST_FACTOR`] of the
//!   minimum over the last [`WINDOW`] unflagged prompts with at least
//!   [`MIN_TIMED_PROMPT`] tokens to compute, once [`WARM_UP`] have been
//!   seen.
//!
//!   The service time is what the node's own work and the prompt's
//!   computation can explain: the time from the request's arrival on the
//!   node to its first token, less the time it waited in this node's queue
//!   (arrival to admission) and, on a decode node, in the prefill node's
//!   queue (which prefill reports with its completion). Queueing is left
//!   out because under saturation it is most of a first token's time and
//!   varies from one request to the next: a request that happened not to
//!   queue would look fast next to the ones that did. The tokens counted
//!   are the prompt's less those found in the prefix cache, which cost
//!   nothing to compute. What is left — batching alongside other requests,
//!   transfers, the node's loop — only makes a first token slower than the
//!   node's fastest, so an honest request is not flagged; a prompt whose KV
//!   was never computed is.
//!
//! A flagged request is counted ([`AnomalyCounts`], the `/metrics`
//! `kvsan:anomalies_total{kind}`) and logged with its id, tenant and
//! numbers (never its text); with [`AnomalyAction::Abort`] it is also ended
//! with an [`ErrorKind::Anomaly`] error before its first token leaves.

use std::collections::VecDeque;
use std::ops::Range;
use std::time::{Duration, Instant};

use bitvec::vec::BitVec;
use kvsan_sanitizer::Owner;

use crate::request::{ErrorKind, RequestError};

/// What a node does with a flagged request.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub enum AnomalyAction {
    /// Count it and log it; the request goes on.
    #[default]
    Log,
    /// Count it, log it, and end the request with an error before its
    /// first token.
    Abort,
}

/// What was seen.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum AnomalyKind {
    /// The first token came with KV for fewer positions than the prompt.
    ShortKv,
    /// The first token came far faster per prompt token than the node can
    /// compute.
    FastFirstToken,
}

impl AnomalyKind {
    /// Every kind, in counter order.
    pub const ALL: [AnomalyKind; 2] = [AnomalyKind::ShortKv, AnomalyKind::FastFirstToken];

    /// The stable kebab-case name (a metric label, a log field).
    #[must_use]
    pub const fn name(self) -> &'static str {
        match self {
            AnomalyKind::ShortKv => "short-kv",
            AnomalyKind::FastFirstToken => "fast-first-token",
        }
    }
}

/// Requests flagged since start, by kind.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct AnomalyCounts {
    /// [`AnomalyKind::ShortKv`].
    pub short_kv: u64,
    /// [`AnomalyKind::FastFirstToken`].
    pub fast_first_token: u64,
}

impl AnomalyCounts {
    /// The count of `kind`.
    #[must_use]
    pub const fn of(&self, kind: AnomalyKind) -> u64 {
        match kind {
            AnomalyKind::ShortKv => self.short_kv,
            AnomalyKind::FastFirstToken => self.fast_first_token,
        }
    }

    /// All kinds together.
    #[must_use]
    pub const fn total(&self) -> u64 {
        self.short_kv + self.fast_first_token
    }

    fn add(&mut self, kind: AnomalyKind) {
        match kind {
            AnomalyKind::ShortKv => self.short_kv += 1,
            AnomalyKind::FastFirstToken => self.fast_first_token += 1,
        }
    }
}

/// The prompt positions whose KV a node holds for one request, per layer:
/// what its forward passes computed or its accepted transfers carried.
#[derive(Debug, Default)]
pub(crate) struct KvCoverage {
    /// One row of `prompt` bits per layer, layer-major; empty until the
    /// first record.
    bits: BitVec,
    layers: usize,
    prompt: usize,
}

impl KvCoverage {
    /// Records KV for positions `first..first + tokens` in `layers`, of a
    /// request whose prompt is `prompt` tokens in a model of `n_layers`
    /// (positions past the prompt and layers past the model are not the
    /// prompt's KV, and are not counted).
    pub fn record(
        &mut self,
        first: usize,
        tokens: usize,
        layers: Range<usize>,
        prompt: usize,
        n_layers: usize,
    ) {
        if self.bits.is_empty() {
            self.layers = n_layers;
            self.prompt = prompt;
            self.bits = BitVec::repeat(false, n_layers * prompt);
        }
        let positions = first.min(self.prompt)..first.saturating_add(tokens).min(self.prompt);
        for layer in layers.start..layers.end.min(self.layers) {
            let row = layer * self.prompt;
            self.bits[row + positions.start..row + positions.end].fill(true);
        }
    }

    /// Prompt positions held in every layer.
    pub fn positions(&self) -> usize {
        if self.bits.is_empty() {
            return 0;
        }
        let mut all = self.bits[..self.prompt].to_bitvec();
        for layer in 1..self.layers {
            let row = layer * self.prompt;
            all &= &self.bits[row..row + self.prompt];
        }
        all.count_ones()
    }

    /// Forgets everything (the request's pages were freed: preemption).
    pub fn clear(&mut self) {
        *self = KvCoverage::default();
    }
}

/// Prompts shorter than this are not timed: their first token is
/// dominated by a step's fixed cost, not by their tokens.
pub const MIN_TIMED_PROMPT: usize = 64;
/// Timed prompts remembered.
pub const WINDOW: usize = 256;
/// Timed prompts seen before the time check flags anything.
pub const WARM_UP: usize = 32;
/// How many times faster than the node's fastest recent first token (per
/// computed token) a first token must come to be flagged.
pub const FAST_FACTOR: f64 = 8.0;

/// The service time of a request whose first token came at `first_token`:
/// the time since its arrival on the node, less the time it waited in this
/// node's queue (from `arrived` to `admitted`, its latest admission; nothing
/// when it was never admitted) and in the prefill node's (`peer_queued`, as
/// prefill reported it).
///
/// ```text
///  unified  arrived ── queued ──▶ admitted ── chunks of the prompt ─────────────────▶ first token
///  decode   arrived ── queued ──▶ admitted (pages reserved) ── order ─▶ prefill:
///                                 prefill arrived ── queued ──▶ admitted ── compute, KV ─▶ first token
///           ╰──── left out ─────╯                    ╰── left out ──╯
///                                                    (peer_queued)
/// ```
///
/// Every difference saturates: clocks of two nodes are never compared (the
/// peer sends a duration, not an instant), and a peer that reports more
/// queueing than there was time makes the service zero, not negative.
pub(crate) fn service_time(
    arrived: Instant,
    admitted: Option<Instant>,
    peer_queued: Duration,
    first_token: Instant,
) -> Duration {
    let queued = admitted.map_or(Duration::ZERO, |a| a.saturating_duration_since(arrived));
    first_token
        .saturating_duration_since(arrived)
        .saturating_sub(queued)
        .saturating_sub(peer_queued)
}

/// A request's numbers at its first token.
#[derive(Clone, Copy, Debug)]
pub(crate) struct FirstToken {
    pub owner: Owner,
    pub prompt_tokens: usize,
    /// Prompt tokens whose KV came from the prefix cache: shared, not
    /// computed for this request.
    pub cached_tokens: usize,
    /// Prompt positions with KV in every layer ([`KvCoverage::positions`]).
    pub kv_tokens: usize,
    /// From the request's arrival on the node to its first token, less the
    /// time it waited in queues, this node's and the prefill node's
    /// ([`service_time`]).
    pub service: Duration,
}

impl FirstToken {
    /// Prompt tokens computed for this request (the prompt's, less those
    /// found in the prefix cache).
    fn computed_tokens(&self) -> usize {
        self.prompt_tokens.saturating_sub(self.cached_tokens)
    }
}

/// One node's monitor.
#[derive(Debug)]
pub(crate) struct Monitor {
    action: AnomalyAction,
    /// Seconds of service per computed token of the last [`WINDOW`]
    /// unflagged timed prompts.
    recent: VecDeque<f64>,
    counts: AnomalyCounts,
}

impl Monitor {
    /// A monitor that does `action` with what it flags, with nothing
    /// timed yet.
    pub fn new(action: AnomalyAction) -> Monitor {
        Monitor {
            action,
            recent: VecDeque::with_capacity(WINDOW),
            counts: AnomalyCounts::default(),
        }
    }

    /// Requests flagged so far.
    pub fn counts(&self) -> AnomalyCounts {
        self.counts
    }

    /// Checks a request at its first token on node `node`. The error to end
    /// it with when it is flagged and the action is to abort.
    pub fn first_token(&mut self, node: &str, seen: FirstToken) -> Option<RequestError> {
        let mut flagged: Vec<(AnomalyKind, String)> = Vec::new();
        if seen.kv_tokens < seen.prompt_tokens {
            flagged.push((
                AnomalyKind::ShortKv,
                format!(
                    "the first token came with KV for {} of the prompt's {} tokens",
                    seen.kv_tokens, seen.prompt_tokens
                ),
            ));
        }
        let computed = seen.computed_tokens();
        if computed >= MIN_TIMED_PROMPT {
            let per_token = seen.service.as_secs_f64() / computed as f64;
            match self.floor() {
                Some(floor) if per_token < floor / FAST_FACTOR => flagged.push((
                    AnomalyKind::FastFirstToken,
                    format!(
                        "the first token came after {:.1} µs of service per computed prompt \
                         token ({computed} of {} tokens computed); this node's fastest lately \
                         is {:.1} µs",
                        per_token * 1e6,
                        seen.prompt_tokens,
                        floor * 1e6
                    ),
                )),
                _ if flagged.is_empty() => self.remember(per_token),
                _ => {}
            }
        }
        if flagged.is_empty() {
            return None;
        }
        for (kind, what) in &flagged {
            self.counts.add(*kind);
            tracing::warn!(
                node,
                request = seen.owner.request.0,
                tenant = seen.owner.tenant.0,
                prompt_tokens = seen.prompt_tokens,
                cached_tokens = seen.cached_tokens,
                kv_tokens = seen.kv_tokens,
                service_us = u64::try_from(seen.service.as_micros()).unwrap_or(u64::MAX),
                "anomaly {}: {what}",
                kind.name()
            );
        }
        (self.action == AnomalyAction::Abort).then(|| {
            let (kind, what) = &flagged[0];
            RequestError::new(
                ErrorKind::Anomaly,
                format!(
                    "aborted by the anomaly monitor on the {node} node: {} ({what})",
                    kind.name()
                ),
            )
        })
    }

    /// The fastest remembered time per computed token, once enough were
    /// seen.
    ///
    /// The minimum, not a low percentile: with queueing left out of the
    /// service time, the window's minimum is the node's real fastest — a
    /// prompt computed with little else in the batch — and nothing honest
    /// comes in far below it. A percentile of a saturated window is
    /// inflated, since most of its requests were computed in full batches
    /// and took longer per token than the node can when it is quiet; a
    /// quiet moment then looked like an anomaly. An honest fast prompt
    /// lowers the bar for the next, which only errs toward not flagging;
    /// the prompts this check is for (KV never computed) come in orders of
    /// magnitude below any honest time, not a factor of a few.
    fn floor(&self) -> Option<f64> {
        if self.recent.len() < WARM_UP {
            return None;
        }
        self.recent.iter().copied().min_by(f64::total_cmp)
    }

    /// Remembers an unflagged timed prompt's time per computed token,
    /// forgetting the oldest beyond [`WINDOW`].
    fn remember(&mut self, per_token: f64) {
        if self.recent.len() == WINDOW {
            self.recent.pop_front();
        }
        self.recent.push_back(per_token);
    }
}

#[cfg(test)]
mod tests {
    use kvsan_sanitizer::{RequestId, TenantId};

    use super::*;

    fn owner() -> Owner {
        Owner {
            request: RequestId(7),
            tenant: TenantId(2),
        }
    }

    fn seen(prompt_tokens: usize, kv_tokens: usize, micros_per_token: u64) -> FirstToken {
        FirstToken {
            owner: owner(),
            prompt_tokens,
            cached_tokens: 0,
            kv_tokens,
            service: Duration::from_micros(micros_per_token * prompt_tokens as u64),
        }
    }

    /// A request of `prompt_tokens` (none cached, all held) that waited
    /// `queued_ms` in this node's queue and took `micros_per_token` of
    /// compute per token once admitted; its numbers as a node gives them
    /// to the monitor, and its time from arrival, queueing included.
    fn through_a_queue(
        prompt_tokens: usize,
        queued_ms: u64,
        micros_per_token: u64,
    ) -> (FirstToken, Duration) {
        let arrived = Instant::now();
        let admitted = arrived + Duration::from_millis(queued_ms);
        let first = admitted + Duration::from_micros(micros_per_token * prompt_tokens as u64);
        let seen = FirstToken {
            owner: owner(),
            prompt_tokens,
            cached_tokens: 0,
            kv_tokens: prompt_tokens,
            service: service_time(arrived, Some(admitted), Duration::ZERO, first),
        };
        (seen, first - arrived)
    }

    /// A monitor past its warm-up on a saturated node: every request of
    /// its window waited 2 s in the queue, then took 200..263 µs a token.
    fn saturated() -> Monitor {
        let mut m = Monitor::new(AnomalyAction::Log);
        for i in 0..WARM_UP as u64 * 2 {
            let (seen, _) = through_a_queue(100, 2_000, 200 + i);
            assert!(m.first_token("u", seen).is_none());
        }
        m
    }

    #[test]
    fn a_first_token_with_kv_for_fewer_positions_than_the_prompt_is_flagged() {
        let mut m = Monitor::new(AnomalyAction::Log);
        assert!(m.first_token("decode", seen(1100, 1, 100)).is_none());
        assert_eq!(m.counts().short_kv, 1);
        assert_eq!(m.counts().fast_first_token, 0);
    }

    #[test]
    fn a_first_token_with_kv_for_the_whole_prompt_is_not() {
        let mut m = Monitor::new(AnomalyAction::Abort);
        assert!(m.first_token("decode", seen(1100, 1100, 100)).is_none());
        assert!(m.first_token("unified", seen(1, 1, 100)).is_none());
        assert_eq!(m.counts().total(), 0);
    }

    #[test]
    fn abort_ends_the_flagged_request_naming_the_kind_and_numbers() {
        let mut m = Monitor::new(AnomalyAction::Abort);
        let e = m
            .first_token("decode", seen(1100, 1, 100))
            .expect("aborted");
        assert_eq!(e.kind, ErrorKind::Anomaly);
        assert!(e.message.contains("short-kv"), "{}", e.message);
        assert!(
            e.message.contains("1 of the prompt's 1100"),
            "{}",
            e.message
        );
    }

    #[test]
    fn a_first_token_far_faster_per_prompt_token_than_the_node_can_compute_is_flagged() {
        let mut m = Monitor::new(AnomalyAction::Log);
        for i in 0..WARM_UP {
            // 200..263 µs a token: the node's honest range.
            assert!(
                m.first_token("u", seen(100, 100, 200 + i as u64 * 2))
                    .is_none()
            );
        }
        // Forty times faster than the fastest honest one is flagged (and,
        // flagged, not remembered)…
        let mut m = Monitor {
            action: AnomalyAction::Abort,
            ..m
        };
        let e = m.first_token("u", seen(1100, 1100, 5)).expect("aborted");
        assert_eq!(m.counts().fast_first_token, 1);
        assert!(e.message.contains("fast-first-token"), "{}", e.message);
        assert!(
            e.message.contains("1100 of 1100 tokens computed"),
            "{}",
            e.message
        );
        // …and eight times faster is still honest.
        assert!(m.first_token("u", seen(100, 100, 26)).is_none());
        assert_eq!(m.counts().fast_first_token, 1);
    }

    #[test]
    fn service_time_leaves_out_the_queues_on_this_node_and_the_peer() {
        let arrived = Instant::now();
        let ms = Duration::from_millis;
        let admitted = arrived + ms(300);
        let first = arrived + ms(1_000);
        assert_eq!(service_time(arrived, Some(admitted), ms(0), first), ms(700));
        assert_eq!(
            service_time(arrived, Some(admitted), ms(200), first),
            ms(500)
        );
        // Never admitted: nothing is known to have been queueing.
        assert_eq!(service_time(arrived, None, ms(0), first), ms(1_000));
        // A peer reporting more queueing than there was time: zero, not
        // a wrap-around.
        assert_eq!(
            service_time(arrived, Some(admitted), ms(5_000), first),
            ms(0)
        );
    }

    #[test]
    fn a_request_whose_time_is_mostly_queueing_is_not_flagged_when_its_service_is_honest() {
        let mut m = saturated();
        // It found the queue empty: its first token came after its compute
        // alone, 2 s sooner than any other's.
        let (seen, elapsed) = through_a_queue(100, 0, 210);
        assert!(m.first_token("u", seen).is_none());
        assert_eq!(m.counts().total(), 0);
        // Timed from arrival, queueing included, it came more than ten
        // times FAST_FACTOR faster than the window's fastest.
        let (_, fastest_in_window) = through_a_queue(100, 2_000, 200);
        assert!(elapsed.as_secs_f64() * FAST_FACTOR * 10.0 < fastest_in_window.as_secs_f64());
    }

    #[test]
    fn a_genuinely_fast_first_token_is_still_flagged_with_queueing_left_out() {
        let mut m = saturated();
        // KV for a 1,100-token prompt that was never computed: 5 µs a
        // token after the same 2 s in the queue the others waited…
        let (seen, _) = through_a_queue(1100, 2_000, 5);
        m.first_token("u", seen);
        assert_eq!(m.counts().fast_first_token, 1);
        // …or without queueing.
        let (seen, _) = through_a_queue(1100, 0, 5);
        m.first_token("u", seen);
        assert_eq!(m.counts().fast_first_token, 2);
    }

    #[test]
    fn the_floor_is_the_windows_fastest_not_a_low_percentile() {
        let mut m = Monitor::new(AnomalyAction::Log);
        // Two prompts computed on a quiet node, the rest in full batches
        // at five times the time per token.
        for _ in 0..2 {
            m.first_token("u", seen(100, 100, 200));
        }
        for _ in 0..WARM_UP * 2 {
            m.first_token("u", seen(100, 100, 1_000));
        }
        // Under 1/8 of the quiet node's time: flagged.
        assert!(m.first_token("u", seen(100, 100, 20)).is_none());
        assert_eq!(m.counts().fast_first_token, 1);
        // Under 1/8 of the batches' time (and of their 5th percentile), but
        // not of the quiet node's: honest.
        assert!(m.first_token("u", seen(100, 100, 100)).is_none());
        assert_eq!(m.counts().fast_first_token, 1);
    }

    #[test]
    fn time_is_per_computed_token_and_cached_tokens_cost_nothing() {
        let mut m = Monitor::new(AnomalyAction::Log);
        for _ in 0..WARM_UP {
            m.first_token("u", seen(100, 100, 200));
        }
        // 900 of 1,000 tokens found in the prefix cache, 100 computed at
        // the node's usual pace: 20 µs per prompt token, but 200 per
        // computed one.
        let cached = FirstToken {
            cached_tokens: 900,
            service: Duration::from_micros(100 * 200),
            ..seen(1000, 1000, 0)
        };
        assert!(m.first_token("u", cached).is_none());
        assert_eq!(m.counts().total(), 0);
        // Too few computed tokens to time, however fast.
        let mostly_cached = FirstToken {
            cached_tokens: 1000 - (MIN_TIMED_PROMPT - 1),
            service: Duration::ZERO,
            ..seen(1000, 1000, 0)
        };
        assert!(m.first_token("u", mostly_cached).is_none());
        assert_eq!(m.counts().total(), 0);
        // The same 100 computed tokens in a hundredth of the time are not
        // honest.
        let fast = FirstToken {
            cached_tokens: 900,
            service: Duration::from_micros(100 * 2),
            ..seen(1000, 1000, 0)
        };
        m.first_token("u", fast);
        assert_eq!(m.counts().fast_first_token, 1);
    }

    #[test]
    fn the_time_check_waits_for_its_warm_up_and_ignores_short_prompts() {
        let mut m = Monitor::new(AnomalyAction::Log);
        for _ in 0..WARM_UP - 1 {
            m.first_token("u", seen(100, 100, 200));
        }
        assert!(m.first_token("u", seen(100, 100, 1)).is_none());
        assert_eq!(m.counts().total(), 0, "not warmed up");
        assert!(
            m.first_token("u", seen(MIN_TIMED_PROMPT - 1, MIN_TIMED_PROMPT - 1, 0))
                .is_none()
        );
        assert_eq!(m.counts().total(), 0, "too short to time");
    }

    #[test]
    fn coverage_counts_positions_held_in_every_layer() {
        let mut c = KvCoverage::default();
        assert_eq!(c.positions(), 0);
        c.record(0, 16, 0..4, 40, 4);
        assert_eq!(c.positions(), 16);
        // Layers 0..2 only: positions 16..32 are not held in every layer.
        c.record(16, 16, 0..2, 40, 4);
        assert_eq!(c.positions(), 16);
        c.record(16, 16, 2..4, 40, 4);
        assert_eq!(c.positions(), 32);
        // Past the prompt: not the prompt's KV.
        c.record(32, 100, 0..4, 40, 4);
        assert_eq!(c.positions(), 40);
        c.clear();
        assert_eq!(c.positions(), 0);
    }
}
