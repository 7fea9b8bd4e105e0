//! The audit's report: text for people, JSON for programs, SARIF 2.1.0 for
//! code-scanning tools (one rule per finding kind, the evidence in each
//! result). No prompt text appears beyond the canaries the audit made up.

use std::fmt::Write as _;

use serde::Serialize;
use serde_json::{Value, json};

use super::found::{Found, Rule};

/// What an audit of one server found.
#[derive(Debug, Serialize)]
pub struct Report {
    pub base_url: String,
    pub model: String,
    pub context_length: Option<usize>,
    pub requests_sent: usize,
    pub budget: usize,
    pub budget_spent: bool,
    /// The server stopped answering and the audit stopped early.
    pub unresponsive: bool,
    pub cross_tenant: bool,
    #[serde(flatten)]
    pub found: Found,
}

impl Report {
    /// The human report.
    pub fn text(&self) -> String {
        let mut t = String::new();
        let _ = writeln!(
            t,
            "kvsan audit of {} (model {}, context {}): {} requests of a budget of {}{}",
            self.base_url,
            self.model,
            self.context_length
                .map_or_else(|| "unknown".to_string(), |c| c.to_string()),
            self.requests_sent,
            self.budget,
            if self.budget_spent {
                " (spent: the audit stopped early)"
            } else if self.unresponsive {
                " (the server stopped answering: the audit stopped early)"
            } else {
                ""
            }
        );
        let d = &self.found.determinism;
        let _ = writeln!(
            t,
            "  determinism: {} identical greedy requests, {} distinct output(s): {}",
            d.requests,
            d.distinct_outputs,
            if d.deterministic {
                "deterministic"
            } else if d.deterministic_one_at_a_time {
                "NOT deterministic with other requests in flight (one at a time: deterministic)"
            } else {
                "NOT deterministic"
            }
        );
        // Nothing to say when the phase was not run (or stopped before its
        // first comparison, which a note says).
        if self.found.noninterference_pairs > 0 {
            let _ = writeln!(
                t,
                "  noninterference: {} probe/victim comparisons ({})",
                self.found.noninterference_pairs,
                if self.cross_tenant {
                    "probe and victim on different keys"
                } else {
                    "one key: cross-request only"
                }
            );
        }
        if !self.found.coherence.is_empty() {
            let points: Vec<String> = self
                .found
                .coherence
                .iter()
                .map(|p| {
                    let tokens = p
                        .prompt_tokens
                        .map_or_else(|| format!("~{}", p.target_tokens), |t| t.to_string());
                    let how = if p.continued {
                        "continued"
                    } else if (200..300).contains(&p.status) {
                        "NOT continued"
                    } else {
                        "refused"
                    };
                    format!("{tokens} {how}")
                })
                .collect();
            let _ = writeln!(
                t,
                "  coherence at length (a repeated sentence): {}",
                points.join(", ")
            );
        }
        if !self.found.length_sweep.is_empty() {
            let points: Vec<String> = self
                .found
                .length_sweep
                .iter()
                .map(|p| {
                    let tokens = p
                        .prompt_tokens
                        .map_or_else(|| format!("~{}", p.target_tokens), |t| t.to_string());
                    format!("{tokens} {}", p.outcome)
                })
                .collect();
            let _ = writeln!(
                t,
                "  length sweep ({} lengths, probe tokens and outcome): {}",
                points.len(),
                points.join(", ")
            );
        }
        for l in &self.found.limits {
            let _ = writeln!(t, "  limit: {:<28} {}", l.name, l.outcome);
        }
        for tm in &self.found.timing {
            let _ = writeln!(
                t,
                "  prefix timing, {}: hit {:.1} ms vs miss {:.1} ms (effect {:.1} ms), KS D = {:.2}, p = {:.2e}, {} samples, {} requests: {}",
                tm.name,
                tm.hit_median_ms,
                tm.miss_median_ms,
                tm.effect_ms,
                tm.ks.d,
                tm.ks.p,
                tm.samples,
                tm.requests,
                tm.verdict
            );
        }
        for o in &self.found.order {
            let _ = writeln!(
                t,
                "  scheduling order, {}: a request on a warmed prefix gained {:.2} places (chance 0), permutation p = {:.2e}, answered first in {:.0} % of {} pairs, {} rounds, {} requests: {}",
                o.name,
                o.places_gained,
                o.p,
                o.share_first * 100.0,
                o.pairs,
                o.rounds,
                o.requests,
                o.verdict
            );
        }
        for a in &self.found.salt {
            let tm = &a.timing;
            let cached = match (a.cached_hit, a.cached_miss) {
                (Some(h), Some(m)) => format!(", cached_tokens {h:.0} vs {m:.0}"),
                _ => String::new(),
            };
            let _ = writeln!(
                t,
                "  cache_salt, {}: hit {:.1} ms vs miss {:.1} ms, KS p = {:.2e}{cached}, {} samples: {}",
                a.name, tm.hit_median_ms, tm.miss_median_ms, tm.ks.p, tm.samples, a.verdict
            );
        }
        for n in &self.found.notes {
            let _ = writeln!(t, "  note: {n}");
        }
        if self.found.findings.is_empty() {
            let _ = writeln!(t, "no findings");
        } else {
            let _ = writeln!(t, "{} finding(s):", self.found.findings.len());
            for f in &self.found.findings {
                let _ = writeln!(t, "  [{}] {}", f.rule.id(), f.message);
            }
        }
        t
    }

    /// SARIF 2.1.0.
    pub fn sarif(&self) -> Value {
        let rules: Vec<Value> = Rule::ALL
            .iter()
            .map(|r| {
                json!({
                    "id": r.id(),
                    "shortDescription": {"text": r.description()},
                    "defaultConfiguration": {"level": "error"},
                })
            })
            .collect();
        let results: Vec<Value> = self
            .found
            .findings
            .iter()
            .map(|f| {
                json!({
                    "ruleId": f.rule.id(),
                    "ruleIndex": Rule::ALL.iter().position(|r| *r == f.rule),
                    "level": "error",
                    "message": {"text": f.message},
                    "locations": [{"physicalLocation": {"artifactLocation": {"uri": self.base_url}}}],
                    "properties": {"evidence": f.evidence},
                })
            })
            .collect();
        json!({
            "$schema": "https://json.schemastore.org/sarif-2.1.0.json",
            "version": "2.1.0",
            "runs": [{
                "tool": {"driver": {
                    "name": "kvsan audit",
                    "version": env!("CARGO_PKG_VERSION"),
                    "rules": rules,
                }},
                "results": results,
                "properties": {
                    "model": self.model,
                    "requests_sent": self.requests_sent,
                    "deterministic": self.found.determinism.deterministic,
                    "deterministic_one_at_a_time": self.found.determinism.deterministic_one_at_a_time,
                },
            }],
        })
    }
}
