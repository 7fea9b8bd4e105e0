//! The scheduling-order channel: whether requests whose prompt another key
//! just sent are answered before requests of fresh prompts sent beside
//! them. A scheduler that serves cached prefixes first (longest prefix
//! first) or a cache that skips their prefill lets a tenant learn, from
//! which of its own requests come back first, what another tenant sent —
//! without a clock precise enough for the timing test.
//!
//! ```text
//!  a round:  the warming key sends 4 prefixes (1 token each); then the
//!            probing key sends 8 requests in a burst, 10 ms apart, in a
//!            shuffled order: 4 on those prefixes, 4 on fresh prefixes of
//!            the same length
//!  measure:  the places each request gained between the order it was
//!            sent in and the order its first token came back in (a
//!            first-come-first-served server without a cache moves no
//!            one; a cache hit overtakes the requests sent just before)
//!  test:     the places the requests on warmed prefixes gained, against
//!            the same labels shuffled within each round (stratified
//!            one-sided permutation test, 20,000 draws from a fixed seed);
//!            also reported: the share of (warmed, fresh) pairs of a
//!            round the warmed one won
//!  arms:     6 rounds each: same key (the control: a cache must show) and
//!            other key (a hit there is a finding)
//! ```
//!
//! Every request of a round has a prefix of its own: a prefix the probing
//! key had sent itself would be found in a cache it may legally share
//! with itself, and would show an order across keys that is not one.

use super::client::{Client, Stop};
use super::found::{Finding, Found, Order, Rule};
use super::probes::{Keys, Texts, ok_or_stop};
use std::time::Duration;

use rand::{RngExt, SeedableRng};
use rand_chacha::ChaCha8Rng;

/// Rounds per arm.
const ROUNDS: usize = 6;
/// Requests of a round on a warmed prefix (as many are on fresh ones).
const SHARING: usize = 4;
/// Draws of the permutation test.
const DRAWS: usize = 20_000;
/// The p-value under which an order is reported.
const ALPHA: f64 = 0.01;

/// Between two sends of a burst: long enough that they reach the server
/// in the order sent, far shorter than a prefill.
const STAGGER_MS: u64 = 10;
/// First tokens this close came back from one step of the server (the
/// client reads them in an order of its own): a tie. Ties depend on the
/// labels no more than the order does, so the test stays exact; they only
/// make it see a step shared by a warmed and a fresh request.
const TIE_MS: f64 = 5.0;

/// One round's answers in the order sent: whether each request was on a
/// warmed prefix, and when its first token came from the burst's start
/// (milliseconds; refused ones are left out).
type Round = Vec<(bool, f64)>;

/// The phase: the same-key control, then the other key.
pub async fn scheduling_order(
    client: &Client,
    keys: &Keys<'_>,
    texts: &mut Texts,
    context: Option<usize>,
    found: &mut Found,
) -> Result<(), Stop> {
    // Prefixes as long as the timing test's, so that a hit saves as much.
    let words = (context.unwrap_or(2048) * 3 / 10).clamp(64, 1500);
    let mut same = arm(client, keys.victim, keys.victim, texts, words).await?;
    let cache_seen = same.p < ALPHA && same.places_gained > 0.0;
    same.verdict = if cache_seen {
        "requests on a prefix the key sent before are answered first: the order shows the cache"
            .into()
    } else {
        "no order seen (not evidence of isolation)".into()
    };
    found.order.push(same);
    if keys.probe == keys.victim {
        found
            .notes
            .push("scheduling order across keys needs --other-api-key; not run".into());
        return Ok(());
    }
    let mut other = arm(client, keys.victim, keys.probe, texts, words).await?;
    other.name = "other key";
    let shared = other.p < ALPHA && other.places_gained > 0.0;
    other.verdict = match (shared, cache_seen) {
        (true, _) => "answered first on the other key's prefixes (finding)".into(),
        (false, true) => {
            "no order across keys while the same key shows one: isolated by key".into()
        }
        (false, false) => "no order across keys, but none with one key either: inconclusive".into(),
    };
    if shared {
        found.findings.push(Finding {
            rule: Rule::CrossKeySchedulingOrder,
            message: format!(
                "requests on prefixes another key had just sent overtook requests on fresh prefixes sent \
                 with them: {:.2} places gained each on average (chance 0, permutation p = {:.2e}, \
                 {} rounds)",
                other.places_gained,
                other.p,
                other.rounds
            ),
            evidence: serde_json::json!({
                "places_gained": other.places_gained, "share_first": other.share_first,
                "p_value": other.p, "pairs": other.pairs,
                "rounds": other.rounds,
            }),
        });
    }
    found.order.push(other);
    Ok(())
}

/// `ROUNDS` rounds: `warm_key` warms the prefixes, `probe_key` sends the
/// round at once.
async fn arm(
    client: &Client,
    warm_key: Option<&str>,
    probe_key: Option<&str>,
    texts: &mut Texts,
    words: usize,
) -> Result<Order, Stop> {
    let before = client.sent();
    let mut rounds: Vec<Round> = Vec::new();
    for r in 0..ROUNDS {
        let mut requests: Vec<(bool, String)> = Vec::new();
        for _ in 0..SHARING {
            let prefix = texts.words(words);
            ok_or_stop(
                client
                    .complete(warm_key, &format!("{prefix} warm"), 1)
                    .await,
            )?;
            requests.push((true, prefix));
        }
        requests.extend((0..SHARING).map(|_| (false, texts.words(words))));
        texts.shuffle(&mut requests);
        let prompts: Vec<String> = requests
            .iter()
            .enumerate()
            .map(|(i, (_, prefix))| format!("{prefix} question {r}.{i}"))
            .collect();
        let answers =
            futures_util::future::join_all(prompts.iter().enumerate().map(|(i, p)| async move {
                let sent = Duration::from_millis(STAGGER_MS * i as u64);
                tokio::time::sleep(sent).await;
                let first = client.time_to_first_token(probe_key, p).await;
                first.map(|t| t.map(|t| sent + t))
            }))
            .await;
        let mut round = Round::new();
        for ((sharing, _), answer) in requests.iter().zip(answers) {
            if let Some(t) = ok_or_stop(answer)? {
                round.push((*sharing, t.as_secs_f64() * 1000.0));
            }
        }
        rounds.push(round);
    }
    let (share_first, pairs) = share_first(&rounds);
    let warmed = rounds.iter().flatten().filter(|(s, _)| *s).count();
    Ok(Order {
        name: "same key",
        rounds: rounds.len(),
        pairs,
        share_first,
        places_gained: if warmed == 0 {
            0.0
        } else {
            gained(&rounds) / warmed as f64
        },
        p: permutation_p(&rounds, DRAWS),
        requests: client.sent() - before,
        verdict: String::new(),
    })
}

/// Pairs of (sharing, fresh) requests of one round the sharing one won,
/// ties half: the Mann–Whitney U summed over rounds.
fn wins(rounds: &[Round]) -> (f64, usize) {
    let mut u = 0.0;
    let mut pairs = 0;
    for round in rounds {
        for (_, s) in round.iter().filter(|(sharing, _)| *sharing) {
            for (_, f) in round.iter().filter(|(sharing, _)| !*sharing) {
                pairs += 1;
                u += if (s - f).abs() <= TIE_MS {
                    0.5
                } else if s < f {
                    1.0
                } else {
                    0.0
                };
            }
        }
    }
    (u, pairs)
}

/// The places the requests on warmed prefixes gained, summed over rounds:
/// for each, the place it was sent in less the place its first token came
/// back in (ties, within `TIE_MS`, share their places).
fn gained(rounds: &[Round]) -> f64 {
    let mut total = 0.0;
    for round in rounds {
        for (sent, (sharing, t)) in round.iter().enumerate() {
            if !*sharing {
                continue;
            }
            let before = round.iter().filter(|(_, u)| *u < t - TIE_MS).count() as f64;
            let tied = round
                .iter()
                .filter(|(_, u)| (u - t).abs() <= TIE_MS)
                .count() as f64
                - 1.0;
            total += sent as f64 - (before + tied / 2.0);
        }
    }
    total
}

/// The share of pairs the sharing request won, and the pairs (0.5 with
/// none).
fn share_first(rounds: &[Round]) -> (f64, usize) {
    let (u, pairs) = wins(rounds);
    if pairs == 0 {
        (0.5, 0)
    } else {
        (u / pairs as f64, pairs)
    }
}

/// One-sided p-value of the places gained under exchangeable labels
/// within each round: the share of `draws` relabellings (and the observed
/// one) gaining at least as many. Seeded: the same rounds give the same p.
fn permutation_p(rounds: &[Round], draws: usize) -> f64 {
    if wins(rounds).1 == 0 {
        return 1.0;
    }
    let observed = gained(rounds);
    let mut rng = ChaCha8Rng::seed_from_u64(0x6b76_7361_6e5f_6f72);
    let mut shuffled: Vec<Round> = rounds.to_vec();
    let mut at_least = 1usize;
    for _ in 0..draws {
        for (round, source) in shuffled.iter_mut().zip(rounds) {
            let mut labels: Vec<bool> = source.iter().map(|(s, _)| *s).collect();
            for i in (1..labels.len()).rev() {
                labels.swap(i, rng.random_range(0..=i));
            }
            for ((label, _), l) in round.iter_mut().zip(labels) {
                *label = l;
            }
        }
        if gained(&shuffled) >= observed - 1e-9 {
            at_least += 1;
        }
    }
    at_least as f64 / (draws + 1) as f64
}

#[cfg(test)]
mod tests {
    use super::{Round, gained, permutation_p, share_first};

    /// A round sent fresh, warmed, fresh, warmed, ...; answered in the
    /// order sent, or with each warmed request overtaking the fresh one
    /// sent just before it.
    fn round(overtaking: bool) -> Round {
        (0..8)
            .map(|i| {
                let warmed = i % 2 == 1;
                let shift = if overtaking && warmed { -1.5 } else { 0.0 };
                (warmed, 100.0 * (f64::from(i) + shift))
            })
            .collect()
    }

    #[test]
    fn warmed_requests_overtaking_are_significant_and_first_come_first_served_is_not() {
        let overtaking = vec![round(true); 4];
        assert_eq!(gained(&overtaking), 16.0, "one place each");
        assert!(permutation_p(&overtaking, 5_000) < 0.001);
        let fifo = vec![round(false); 4];
        assert_eq!(gained(&fifo), 0.0);
        assert!(permutation_p(&fifo, 5_000) > 0.3);
        // Warmed requests falling behind gain nothing significant.
        let behind: Vec<Round> = overtaking
            .iter()
            .map(|r| r.iter().map(|&(w, t)| (!w, t)).collect())
            .collect();
        assert!(gained(&behind) < 0.0);
        assert!(permutation_p(&behind, 5_000) > 0.99);
    }

    #[test]
    fn share_first_counts_pairs_and_ties_half() {
        assert_eq!(share_first(&[round(false)]), (6.0 / 16.0, 16));
        let tied: Round = vec![(true, 5.0), (false, 5.0 + super::TIE_MS)];
        assert_eq!(share_first(std::slice::from_ref(&tied)), (0.5, 1));
        assert_eq!(gained(&[tied]), -0.5, "a tie shares its two places");
    }

    #[test]
    fn rounds_without_both_kinds_give_no_pairs_and_p_one() {
        let alone: Round = vec![(true, 5.0), (true, 6.0)];
        assert_eq!(share_first(std::slice::from_ref(&alone)), (0.5, 0));
        assert_eq!(permutation_p(&[alone], 100), 1.0);
    }
}
