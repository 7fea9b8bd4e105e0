//! The noninterference phase's length sweep: probes at lengths spread over
//! the whole context, each after victims with canaries, so that any prompt
//! length the server accepts is probed for output that depends on another
//! key's prompt — without being told where a limit lies. A pool smaller
//! than the context (the incident's configuration) serves prompts between
//! the two without computing them; probes there answer from whatever KV
//! their pages still hold.
//!
//! ```text
//!  lengths: a page (16), 32, 64, ... below the context,
//!           and 1/2, 2/3, 3/4, 7/8 of it and just under it
//!  each:    3 x (victim with a new canary, then the probe of that length)
//!           victims half as long as the probe: a victim is computed
//!           wherever a probe is served uncomputed, as long as the pool
//!           holds half the probe (a band's lower end, at least)
//!  finding: a band of consecutive lengths whose probes quote a canary or
//!           answer differently as only the canary changes
//! ```
//!
//! Coherence at length needs no other request: a prompt that repeats one
//! sentence is answered with the sentence by a model that computed it (the
//! sentence is picked among a few so that the model continues it at a
//! short length); a longer one the server accepts and answers otherwise
//! was not computed from its own text (`long-prompt-not-computed`).

use super::client::{Client, Completion, Stop};
use super::found::{CoherencePoint, Finding, Found, Rule, SweepPoint};
use super::probes::{self, CANARIES, Keys, Texts, hash, ok_or_stop, victim_prompt, words_for};

/// The shortest length probed: about a page of KV.
const PAGE: usize = 16;

/// Sentences a prompt of the coherence probe repeats; the first the model
/// continues at a short length is used.
const SENTENCES: [&str; 3] = [
    "The cat sat on the mat.",
    "The river glows under violet thunder.",
    "Walnut timber saddle ribbon quartz.",
];

/// `sentence` repeated to about `tokens` tokens (a word is about 1.4).
fn repeated(sentence: &str, tokens: usize) -> String {
    let words = sentence.split_whitespace().count().max(1);
    let reps = (tokens * 10 / 14 / words).max(1);
    vec![sentence; reps].join(" ")
}

/// Whether `answer` goes on with `sentence` (its first two words).
fn continues(answer: &str, sentence: &str) -> bool {
    let want: Vec<&str> = sentence.split_whitespace().take(2).collect();
    let got: Vec<&str> = answer.split_whitespace().take(2).collect();
    !got.is_empty()
        && want.iter().zip(&got).all(|(w, g)| {
            g.trim_matches(|c: char| !c.is_alphanumeric())
                .eq_ignore_ascii_case(w.trim_matches(|c: char| !c.is_alphanumeric()))
        })
}

/// Coherence at length: one sentence the model continues at 32 tokens,
/// repeated to every length of the ladder; an accepted prompt answered
/// otherwise is a finding (one per band of consecutive lengths).
pub async fn coherence(
    client: &Client,
    key: Option<&str>,
    ctx: usize,
    found: &mut Found,
) -> Result<(), Stop> {
    let short = (2 * PAGE).min(ctx / 2).max(8);
    let mut chosen = None;
    for sentence in SENTENCES {
        let c = ok_or_stop(client.complete(key, &repeated(sentence, short), 8).await)?;
        if c.served_text() && continues(&c.text, sentence) {
            chosen = Some(sentence);
            break;
        }
    }
    let Some(sentence) = chosen else {
        found.notes.push(format!(
            "coherence at length not judged: the model continued none of {} repeated sentences at {short} tokens",
            SENTENCES.len()
        ));
        return Ok(());
    };
    let mut band: Vec<u64> = Vec::new();
    // From the length the sentence was continued at: shorter prompts hold
    // too few repetitions to be a pattern.
    for target in lengths(ctx).into_iter().filter(|&l| l >= short) {
        let c = ok_or_stop(client.complete(key, &repeated(sentence, target), 8).await)?;
        let point = CoherencePoint {
            target_tokens: target,
            prompt_tokens: c.prompt_tokens,
            status: c.status,
            continued: c.served_text() && continues(&c.text, sentence),
        };
        if c.served_text() && !point.continued {
            band.push(point.prompt_tokens.unwrap_or(target as u64));
        } else {
            not_computed(found, &mut band, sentence);
        }
        found.coherence.push(point);
    }
    not_computed(found, &mut band, sentence);
    Ok(())
}

/// One finding for a band of consecutive lengths answered without the
/// sentence; the band is emptied.
fn not_computed(found: &mut Found, band: &mut Vec<u64>, sentence: &str) {
    let (Some(&low), Some(&high)) = (band.first(), band.last()) else {
        return;
    };
    found.findings.push(Finding {
        rule: Rule::LongPromptNotComputed,
        message: format!(
            "prompts of {low}–{high} tokens repeating one sentence were served but not answered with it, \
             as shorter ones were: the server answers prompts of these lengths without computing them"
        ),
        evidence: serde_json::json!({
            "probe": "coherence at length", "band_tokens": [low, high], "lengths": band.clone(),
            "sentence_hash": hash(sentence),
        }),
    });
    band.clear();
}

/// The lengths probed for a context of `ctx` tokens, ascending.
pub fn lengths(ctx: usize) -> Vec<usize> {
    let mut out: Vec<usize> = std::iter::successors(Some(PAGE), |l| Some(l * 2))
        .take_while(|&l| l < ctx)
        .collect();
    out.extend([(1, 2), (2, 3), (3, 4), (7, 8)].map(|(n, d)| ctx * n / d));
    out.push(ctx.saturating_sub(PAGE));
    out.retain(|&l| (PAGE..ctx).contains(&l));
    out.sort_unstable();
    out.dedup();
    out
}

/// Runs the sweep; the budget stops it like any phase (the points done so
/// far stay in the report, which says which lengths were covered).
pub async fn length_sweep(
    client: &Client,
    keys: &Keys<'_>,
    texts: &mut Texts,
    ctx: usize,
    found: &mut Found,
) -> Result<(), Stop> {
    let compare = found.determinism.deterministic_one_at_a_time;
    let mut run = Vec::new();
    for target in lengths(ctx) {
        let prompt = words_for(texts, target);
        let victim_tokens = (target / 2).max(PAGE);
        let mut outs: Vec<(String, Completion)> = Vec::new();
        while outs.len() < CANARIES {
            let canary = texts.canary();
            ok_or_stop(
                client
                    .complete(keys.victim, &victim_prompt(&canary, victim_tokens), 4)
                    .await,
            )?;
            let o = ok_or_stop(client.complete(keys.probe, &prompt, 8).await)?;
            outs.push((canary, o));
        }
        found.noninterference_pairs += 1;
        let outcome = if probes::quote_in(&outs).is_some() {
            "quoted"
        } else if outs
            .iter()
            .all(|(_, o)| !o.served_text() && (400..500).contains(&o.status))
        {
            "refused"
        } else if probes::outputs_differ(&outs, compare) {
            "differs"
        } else if compare && outs.iter().all(|(_, o)| o.served_text()) {
            "same"
        } else {
            "not compared"
        };
        let point = SweepPoint {
            target_tokens: target,
            prompt_tokens: outs.iter().find_map(|(_, o)| o.prompt_tokens),
            victim_tokens,
            outcome,
        };
        if point.depends() {
            run.push((point.clone(), outs));
        } else {
            report_band(found, &mut run);
        }
        found.length_sweep.push(point);
    }
    report_band(found, &mut run);
    Ok(())
}

/// One finding for a band of consecutive lengths whose probes depended on
/// the victims' canaries; the band is emptied.
fn report_band(found: &mut Found, run: &mut Vec<(SweepPoint, Vec<(String, Completion)>)>) {
    let (Some((first, _)), Some((last, _))) = (run.first(), run.last()) else {
        return;
    };
    let (low, high) = (first.tokens(), last.tokens());
    let quoted = run.iter().any(|(p, _)| p.outcome == "quoted");
    let message = format!(
        "probes of {low}–{high} tokens {} the other key's prompt before them: prompts of these \
         lengths are served, but their answers are not computed from them alone",
        if quoted {
            "quoted a canary of"
        } else {
            "answered differently with only the canary of"
        },
    );
    let evidence = serde_json::json!({
        "probe": "length sweep",
        "band_tokens": [low, high],
        "lengths": run.iter().map(|(p, _)| p.tokens()).collect::<Vec<_>>(),
        "victim_tokens": run.iter().map(|(p, _)| p.victim_tokens).collect::<Vec<_>>(),
        "canaries": run.iter().flat_map(|(_, o)| o.iter().map(|(c, _)| c.clone())).collect::<Vec<_>>(),
        "output_hashes": run.iter().flat_map(|(_, o)| o.iter().map(|(_, c)| hash(&c.text))).collect::<Vec<_>>(),
    });
    found.findings.push(Finding {
        rule: if quoted {
            Rule::CanaryQuoted
        } else {
            Rule::OutputDependsOnOtherRequest
        },
        message,
        evidence,
    });
    run.clear();
}

#[cfg(test)]
mod tests {
    use super::{continues, lengths, repeated};

    #[test]
    fn an_answer_continues_the_sentence_when_it_starts_with_it() {
        let s = "The cat sat on the mat.";
        assert!(continues("\nThe cat sat on the mat.", s));
        assert!(continues(" the cat", s));
        assert!(!continues("--------", s));
        assert!(!continues("", s));
        assert!(!continues("\nThe dog", s));
        assert_eq!(repeated(s, 56).matches(s).count(), 6);
    }

    #[test]
    fn the_ladder_spans_a_page_to_just_under_the_context() {
        assert_eq!(
            lengths(256),
            [16, 32, 64, 128, 170, 192, 224, 240],
            "a page doubling below the context, the fractions, just under"
        );
        let l = lengths(131_072);
        assert_eq!(l.first(), Some(&16));
        assert_eq!(l.last(), Some(&(131_072 - 16)));
        assert!(l.windows(2).all(|w| w[0] < w[1]));
        assert!(
            lengths(16).is_empty(),
            "a context of one page has nothing under it"
        );
    }
}
