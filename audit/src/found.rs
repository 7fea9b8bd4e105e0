//! What the audit found: the kinds of finding (one SARIF rule each), the
//! findings with their evidence, and what each phase measured — the
//! record every phase writes into and the report reads.

use serde::Serialize;

use super::Pattern;
use super::client::{Completion, Stop};
use super::ks::Ks;

/// A kind of finding: one SARIF rule each.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize)]
#[serde(rename_all = "kebab-case")]
pub enum Rule {
    /// A probe's output changed with another tenant's canary.
    OutputDependsOnOtherRequest,
    /// A probe's output quoted a canary another request sent.
    CanaryQuoted,
    /// A prompt over the context got a 2xx with text.
    OversizePromptServed,
    /// A limit probe got a 5xx, or a 2xx whose usage passes the context.
    LimitNotClean,
    /// One key's prompt sped up another key's first token.
    CrossKeyPrefixCache,
    /// A long prompt the server accepted was answered as if it had not
    /// been computed (its own pattern not continued).
    LongPromptNotComputed,
    /// Requests on another key's prefixes were answered first.
    CrossKeySchedulingOrder,
    /// A prefix cached under one `cache_salt` served a request with
    /// another salt.
    SaltNotIsolating,
    /// A prefix cached under one key's `cache_salt` served another key
    /// sending that salt.
    SaltSharedAcrossKeys,
}

impl Rule {
    pub const ALL: [Rule; 9] = [
        Rule::OutputDependsOnOtherRequest,
        Rule::CanaryQuoted,
        Rule::OversizePromptServed,
        Rule::LimitNotClean,
        Rule::CrossKeyPrefixCache,
        Rule::LongPromptNotComputed,
        Rule::CrossKeySchedulingOrder,
        Rule::SaltNotIsolating,
        Rule::SaltSharedAcrossKeys,
    ];

    pub fn id(self) -> &'static str {
        match self {
            Rule::OutputDependsOnOtherRequest => "output-depends-on-other-request",
            Rule::CanaryQuoted => "canary-quoted",
            Rule::OversizePromptServed => "oversize-prompt-served",
            Rule::LimitNotClean => "limit-not-clean",
            Rule::CrossKeyPrefixCache => "cross-key-prefix-cache",
            Rule::LongPromptNotComputed => "long-prompt-not-computed",
            Rule::CrossKeySchedulingOrder => "cross-key-scheduling-order",
            Rule::SaltNotIsolating => "salt-not-isolating",
            Rule::SaltSharedAcrossKeys => "salt-shared-across-keys",
        }
    }

    pub fn description(self) -> &'static str {
        match self {
            Rule::OutputDependsOnOtherRequest => {
                "a probe's greedy output changed when only another request's canary changed: one request's KV reached another's output"
            }
            Rule::CanaryQuoted => {
                "a probe's output quoted a canary secret that only another request sent"
            }
            Rule::OversizePromptServed => {
                "a prompt longer than the context the server holds was answered with 200 and text instead of a 4xx"
            }
            Rule::LimitNotClean => {
                "a request at or past a limit got a 5xx, or a 200 whose usage passes the context"
            }
            Rule::CrossKeyPrefixCache => {
                "a prefix sent with one API key sped up the first token of the same prefix sent with another key: the prefix cache is shared across keys"
            }
            Rule::LongPromptNotComputed => {
                "a long prompt the server accepted was answered as if it had not been computed: the pattern it repeats, continued at a short length, was not continued"
            }
            Rule::CrossKeySchedulingOrder => {
                "requests on prefixes another key had just sent were answered before requests on fresh prefixes sent at the same time: the scheduling order shows another tenant's prompts"
            }
            Rule::SaltNotIsolating => {
                "a prefix cached under one cache_salt sped up or was reported cached for a request with another salt: the salt does not isolate"
            }
            Rule::SaltSharedAcrossKeys => {
                "a prefix cached under one key's cache_salt served another key that sent the same salt: whoever learns a salt shares its cache"
            }
        }
    }
}

/// One finding and its evidence.
#[derive(Clone, Debug, Serialize)]
pub struct Finding {
    pub rule: Rule,
    pub message: String,
    pub evidence: serde_json::Value,
}

/// What the determinism phase measured.
#[derive(Clone, Debug, Default, Serialize)]
pub struct Determinism {
    pub requests: usize,
    /// Distinct outputs among the identical requests.
    pub distinct_outputs: usize,
    /// Every identical request answered alike, one at a time and at once.
    pub deterministic: bool,
    /// The identical requests sent one after another answered alike: the
    /// comparisons of requests sent one at a time count even on a server
    /// whose outputs change with what else it batches.
    pub deterministic_one_at_a_time: bool,
}

impl Determinism {
    /// What `sequential` (sent one after another) and `concurrent` (sent
    /// at once) answers to one greedy request say.
    pub(super) fn of(sequential: &[Completion], concurrent: &[Completion]) -> Self {
        // How many different texts `outs` answered.
        let count_distinct = |outs: &[&Completion]| {
            let mut texts: Vec<&str> = outs.iter().map(|c| c.text.as_str()).collect();
            texts.sort_unstable();
            texts.dedup();
            texts.len()
        };
        let all: Vec<&Completion> = sequential.iter().chain(concurrent).collect();
        let served: Vec<&Completion> = all.iter().copied().filter(|c| c.served_text()).collect();
        let one_at_a_time: Vec<&Completion> =
            sequential.iter().filter(|c| c.served_text()).collect();
        let distinct = count_distinct(&served);
        Determinism {
            requests: all.len(),
            distinct_outputs: distinct,
            deterministic: !served.is_empty() && distinct == 1,
            deterministic_one_at_a_time: !one_at_a_time.is_empty()
                && count_distinct(&one_at_a_time) == 1,
        }
    }
}

/// One limit probe.
#[derive(Clone, Debug, Serialize)]
pub struct LimitProbe {
    pub name: &'static str,
    pub prompt_words: usize,
    pub max_tokens: usize,
    pub status: u16,
    pub prompt_tokens: Option<u64>,
    pub completion_tokens: Option<u64>,
    pub outcome: String,
}

/// One prefix-cache timing comparison.
#[derive(Clone, Debug, Serialize)]
pub struct Timing {
    pub name: &'static str,
    pub samples: usize,
    pub hit_median_ms: f64,
    pub miss_median_ms: f64,
    pub effect_ms: f64,
    pub ks: Ks,
    pub requests: usize,
    pub verdict: String,
}

/// Everything the phases found.
#[derive(Debug, Default, Serialize)]
pub struct Found {
    pub determinism: Determinism,
    pub noninterference_pairs: usize,
    /// The noninterference phase's length sweep, by probe length.
    pub length_sweep: Vec<SweepPoint>,
    /// Coherence at length: whether a prompt repeating one sentence was
    /// answered with the sentence, by length.
    pub coherence: Vec<CoherencePoint>,
    pub limits: Vec<LimitProbe>,
    pub timing: Vec<Timing>,
    /// The scheduling-order channel, by arm.
    pub order: Vec<Order>,
    /// The `cache_salt` assertions, by arm.
    pub salt: Vec<SaltArm>,
    pub findings: Vec<Finding>,
    pub notes: Vec<String>,
    /// `--fail-fast`: [`Found::go_on`] stops the audit once a finding is made.
    #[serde(skip)]
    pub fail_fast: bool,
    /// The noninterference patterns `--patterns` leaves out.
    #[serde(skip)]
    pub patterns_left_out: Vec<Pattern>,
}

impl Found {
    /// Whether the noninterference pattern `p` runs (every one unless
    /// `--patterns` leaves it out).
    pub fn runs(&self, p: Pattern) -> bool {
        !self.patterns_left_out.contains(&p)
    }

    /// Whether the audit goes on to its next probe pattern: always, unless
    /// `--fail-fast` was given and a finding has been made.
    ///
    /// # Errors
    /// [`Stop::FirstFinding`] then.
    pub fn go_on(&self) -> Result<(), Stop> {
        if self.fail_fast && !self.findings.is_empty() {
            Err(Stop::FirstFinding)
        } else {
            Ok(())
        }
    }
}

/// What one length of the sweep gave.
#[derive(Clone, Debug, Serialize)]
pub struct SweepPoint {
    /// The probe's length the audit aimed at, in tokens.
    pub target_tokens: usize,
    /// The probe's length as the server counted it (`usage.prompt_tokens`).
    pub prompt_tokens: Option<u64>,
    /// The length the victims before it aimed at.
    pub victim_tokens: usize,
    /// `quoted`, `differs`, `same`, `refused` (the server declined the
    /// probe: not a finding), `not compared` (outputs not comparable).
    pub outcome: &'static str,
}

impl SweepPoint {
    pub(super) fn depends(&self) -> bool {
        matches!(self.outcome, "quoted" | "differs")
    }

    /// The probe's length as measured where the server said, else aimed at.
    pub(super) fn tokens(&self) -> u64 {
        self.prompt_tokens.unwrap_or(self.target_tokens as u64)
    }
}

/// What one length of the coherence probe gave.
#[derive(Clone, Debug, Serialize)]
pub struct CoherencePoint {
    pub target_tokens: usize,
    pub prompt_tokens: Option<u64>,
    pub status: u16,
    /// The answer began with the repeated sentence.
    pub continued: bool,
}

/// One arm of the scheduling-order test.
#[derive(Clone, Debug, Serialize)]
pub struct Order {
    /// `same key` (the control) or `other key`.
    pub name: &'static str,
    pub rounds: usize,
    /// (sharing, fresh) pairs of one round compared.
    pub pairs: usize,
    /// The share of those pairs the sharing request answered first (ties
    /// count half): 0.5 is chance.
    pub share_first: f64,
    /// Places a request on a warmed prefix gained, on average, between
    /// the order sent and the order answered (the test's statistic; 0 is
    /// chance).
    pub places_gained: f64,
    /// One-sided permutation p-value of `places_gained` under "the order
    /// does not follow the warmed prefixes".
    pub p: f64,
    pub requests: usize,
    pub verdict: String,
}

/// One arm of the `cache_salt` assertions: a prefix warmed with one key
/// and salt, timed with a key and salt.
#[derive(Clone, Debug, Serialize)]
pub struct SaltArm {
    /// `same key, same salt` (the control), `same key, other salt`,
    /// `other key, same salt`.
    pub name: &'static str,
    /// The timing of the warmed prefix against fresh ones.
    pub timing: Timing,
    /// Median `cached_tokens` the server reported on the warmed prefixes
    /// and on the fresh ones (absent where it reports none).
    pub cached_hit: Option<f64>,
    pub cached_miss: Option<f64>,
    /// A hit was seen: by `cached_tokens`, or by time.
    pub hit: bool,
    pub verdict: String,
}

#[cfg(test)]
mod tests {
    use super::*;

    fn with_finding(fail_fast: bool) -> Found {
        let mut found = Found {
            fail_fast,
            ..Found::default()
        };
        found.findings.push(Finding {
            rule: Rule::CanaryQuoted,
            message: "a probe quoted a canary".into(),
            evidence: serde_json::Value::Null,
        });
        found
    }

    #[test]
    fn fail_fast_stops_once_a_finding_is_made_and_not_before() {
        let clean = Found {
            fail_fast: true,
            ..Found::default()
        };
        assert!(clean.go_on().is_ok());
        assert!(matches!(
            with_finding(true).go_on(),
            Err(Stop::FirstFinding)
        ));
    }

    #[test]
    fn without_fail_fast_a_finding_does_not_stop_the_audit() {
        assert!(with_finding(false).go_on().is_ok());
    }
}
