//! The `cache_salt` assertions (vLLM's field: a request shares cached
//! prompt pages only with requests of the same salt), each paired with a
//! visible hit: "another salt, no reuse" also holds when nothing is cached
//! at all, so no arm says "isolated" unless the same key and salt hit.
//!
//! ```text
//!  arm                     warmed with        timed with         a hit is
//!  same key, same salt     victim key, S      victim key, S      the control (must show)
//!  same key, other salt    victim key, S      victim key, S'     salt-not-isolating
//!  same key, no salt       victim key, S      victim key, none   salt-not-isolating
//!  other key, same salt    victim key, S      other key, S       salt-shared-across-keys
//!                                                                (a note instead with
//!                                                                --salts-shared-across-keys)
//! ```
//!
//! A hit is seen by time to first token (two-sample KS test, as the
//! prefix-timing phase) or by `usage.prompt_tokens_details.cached_tokens`
//! where the server reports it (more on the warmed prefixes than on fresh
//! ones). The salts are made up per audit and never printed.

use super::client::{Client, Stop};
use super::found::{Finding, Found, Rule, SaltArm, Timing};
use super::probes::{Arm, Keys, Sender, Texts, median, ok_or_stop, timing_arm};

/// The KS p-value under which a timing difference is a hit.
const ALPHA: f64 = 0.01;

/// Runs the arms; the server's refusal of `cache_salt` skips them with a
/// note.
pub async fn salt_assertions(
    client: &Client,
    keys: &Keys<'_>,
    texts: &mut Texts,
    context: Option<usize>,
    samples: usize,
    salts_shared_across_keys: bool,
    found: &mut Found,
) -> Result<(), Stop> {
    let words = (context.unwrap_or(2048) * 3 / 10).clamp(64, 1500);
    let salt = format!("kvsan-audit-{}", texts.canary());
    let other_salt = format!("kvsan-audit-{}", texts.canary());
    let taken = ok_or_stop(
        client
            .first_token(keys.victim, &texts.words(8), Some(&salt), true)
            .await,
    )?;
    if taken.is_none() {
        found.notes.push(
            "the server refused a streamed request with cache_salt (and stream_options.include_usage): \
             salt assertions not run"
                .into(),
        );
        return Ok(());
    }
    let warm = Sender {
        key: keys.victim,
        salt: Some(&salt),
        usage: true,
    };
    let control = judge(
        "same key, same salt",
        timing_arm(client, warm, warm, texts, words, samples).await?,
    );
    let seen = control.hit;
    found.salt.push(SaltArm {
        verdict: if seen {
            "hit: a salted prefix is reused with its salt".into()
        } else {
            "no hit with the same key and salt: nothing below can show isolation".into()
        },
        ..control
    });
    for (name, salt, who) in [
        (
            "same key, other salt",
            Some(other_salt.as_str()),
            "another salt",
        ),
        ("same key, no salt", None, "no salt"),
    ] {
        let other = Sender {
            key: keys.victim,
            salt,
            usage: true,
        };
        let mut arm = judge(
            name,
            timing_arm(client, warm, other, texts, words, samples).await?,
        );
        arm.verdict = verdict(arm.hit, seen, who, "isolated by salt");
        if arm.hit {
            found.findings.push(finding(
                Rule::SaltNotIsolating,
                &format!(
                    "a prefix cached under one cache_salt served the same key's request with {who}"
                ),
                &arm,
            ));
        }
        found.salt.push(arm);
    }
    if keys.probe == keys.victim {
        found
            .notes
            .push("cache_salt across keys needs --other-api-key; not run".into());
        return Ok(());
    }
    let thief = Sender {
        key: keys.probe,
        salt: Some(&salt),
        usage: true,
    };
    let mut arm = judge(
        "other key, same salt",
        timing_arm(client, warm, thief, texts, words, samples).await?,
    );
    arm.verdict = verdict(
        arm.hit,
        seen,
        "the other key",
        "a salt is not shared across keys",
    );
    if arm.hit && salts_shared_across_keys {
        arm.verdict =
            "hit: another key sending the salt shares its cache, as the server documents \
                       (--salts-shared-across-keys)"
                .into();
    } else if arm.hit {
        found.findings.push(finding(
            Rule::SaltSharedAcrossKeys,
            "a prefix cached under one key's cache_salt served another key that sent the same salt",
            &arm,
        ));
    }
    found.salt.push(arm);
    Ok(())
}

/// An arm's record: a hit by time or by the cached tokens reported.
fn judge(name: &'static str, arm: Arm) -> SaltArm {
    let floats = |v: &[u64]| v.iter().map(|&n| n as f64).collect::<Vec<f64>>();
    let reported = |v: &[u64]| (!v.is_empty()).then(|| median(&floats(v)));
    let (cached_hit, cached_miss) = (reported(&arm.cached_hit), reported(&arm.cached_miss));
    let by_time = arm.timing.ks.p < ALPHA && arm.timing.effect_ms > 0.0;
    let by_count = matches!((cached_hit, cached_miss), (Some(h), Some(m)) if h > m);
    SaltArm {
        name,
        timing: Timing { name, ..arm.timing },
        cached_hit,
        cached_miss,
        hit: by_time || by_count,
        verdict: String::new(),
    }
}

fn verdict(hit: bool, control_hit: bool, who: &str, isolated: &str) -> String {
    match (hit, control_hit) {
        (true, _) => format!("hit with {who} (finding)"),
        (false, true) => format!("no hit with {who} while the same salt hits: {isolated}"),
        (false, false) => {
            format!("no hit with {who}, but none with the same key and salt either: inconclusive")
        }
    }
}

fn finding(rule: Rule, what: &str, arm: &SaltArm) -> Finding {
    let t = &arm.timing;
    let cached = match (arm.cached_hit, arm.cached_miss) {
        (Some(h), Some(m)) => {
            format!("; cached_tokens median {h:.0} against {m:.0} on fresh prefixes")
        }
        _ => String::new(),
    };
    Finding {
        rule,
        message: format!(
            "{what}: first token {:.1} ms faster (KS D = {:.2}, p = {:.2e}){cached}",
            t.effect_ms, t.ks.d, t.ks.p
        ),
        evidence: serde_json::json!({
            "arm": arm.name, "ks_d": t.ks.d, "p_value": t.ks.p, "effect_ms": t.effect_ms,
            "samples": t.samples, "cached_tokens_hit": arm.cached_hit,
            "cached_tokens_miss": arm.cached_miss,
        }),
    }
}

#[cfg(test)]
mod tests {
    use super::{judge, verdict};
    use crate::found::Timing;
    use crate::ks::Ks;
    use crate::probes::Arm;

    fn arm(p: f64, effect_ms: f64, cached_hit: &[u64], cached_miss: &[u64]) -> Arm {
        Arm {
            timing: Timing {
                name: "",
                samples: 8,
                hit_median_ms: 10.0,
                miss_median_ms: 10.0 + effect_ms,
                effect_ms,
                ks: Ks { d: 0.5, p },
                requests: 24,
                verdict: String::new(),
            },
            cached_hit: cached_hit.to_vec(),
            cached_miss: cached_miss.to_vec(),
        }
    }

    #[test]
    fn a_hit_is_seen_by_time_or_by_the_cached_tokens_and_otherwise_not() {
        assert!(judge("a", arm(0.001, 30.0, &[], &[])).hit, "by time");
        assert!(
            !judge("a", arm(0.001, -30.0, &[], &[])).hit,
            "slower is no hit"
        );
        assert!(!judge("a", arm(0.2, 30.0, &[], &[])).hit, "not significant");
        let counted = judge("a", arm(0.2, 0.0, &[96, 96, 0], &[0, 0, 0]));
        assert!(counted.hit, "by cached_tokens");
        assert_eq!(
            (counted.cached_hit, counted.cached_miss),
            (Some(96.0), Some(0.0))
        );
        assert!(!judge("a", arm(0.2, 0.0, &[0, 0], &[0, 0])).hit);
        assert!(
            !judge("a", arm(0.2, 0.0, &[96], &[])).hit,
            "one side unreported"
        );
    }

    #[test]
    fn no_arm_says_isolated_without_the_controls_hit() {
        assert!(verdict(false, true, "x", "isolated").contains("isolated"));
        assert!(verdict(false, false, "x", "isolated").contains("inconclusive"));
        assert!(verdict(true, false, "x", "isolated").contains("finding"));
    }
}
