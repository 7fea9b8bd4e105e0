//! The audit's probes, phase by phase: determinism, noninterference with
//! canaries, limits, prefix-cache timing. Each phase spends requests from
//! the one budget and stops, saying so, when it is spent.

use std::time::Duration;

use rand::{RngExt, SeedableRng};
use rand_chacha::ChaCha8Rng;

use super::Pattern;
use super::client::{Client, Completion, FirstToken, Stop};
use super::found::{Determinism, Finding, Found, LimitProbe, Rule, Timing};
use super::ks::{self, Ks};

/// Who sends what: the victim's key, and the probe's (the other tenant's).
pub struct Keys<'a> {
    pub victim: Option<&'a str>,
    pub probe: Option<&'a str>,
}

const WORDS: &[&str] = &[
    "river", "garden", "copper", "lantern", "orbit", "meadow", "signal", "harbor", "pencil",
    "thunder", "marble", "velvet", "canyon", "ember", "falcon", "glacier", "hollow", "island",
    "jasmine", "kettle", "ladder", "mirror", "nectar", "oyster", "pepper", "quartz", "ribbon",
    "saddle", "timber", "umbrella", "violet", "walnut", "yonder", "zephyr", "anchor", "bramble",
];

/// Text and canaries made up by the audit, from one seed.
pub struct Texts {
    rng: ChaCha8Rng,
}

impl Texts {
    pub fn new(seed: u64) -> Texts {
        Texts {
            rng: ChaCha8Rng::seed_from_u64(seed),
        }
    }

    /// `n` random words.
    pub fn words(&mut self, n: usize) -> String {
        (0..n)
            .map(|_| WORDS[self.rng.random_range(0..WORDS.len())])
            .collect::<Vec<_>>()
            .join(" ")
    }

    /// `items` in a random order.
    pub fn shuffle<T>(&mut self, items: &mut [T]) {
        for i in (1..items.len()).rev() {
            items.swap(i, self.rng.random_range(0..=i));
        }
    }

    /// A fresh canary secret: 16 decimal digits. Every canary is as many
    /// tokens as every other in the tokenizers that split digits alike
    /// whatever their values (one by one, or in groups of three), so the
    /// victims' batch shapes do not change with the canary.
    pub fn canary(&mut self) -> String {
        format!(
            "{:016}",
            self.rng.random_range(0..10_000_000_000_000_000u64)
        )
    }
}

/// `n` tokens' worth of one short word (one token in the tokenizers of
/// every model family tried: GPT-2/Llama-3 BPE, SentencePiece).
pub fn filler(n: usize) -> String {
    " the".repeat(n)
}

/// A victim prompt carrying `canary`, about `tokens` tokens long: the
/// canary, and a fixed bag of words in an order drawn from it — so that
/// everything the victim sends changes with the canary (its KV differs
/// at nearly every position) while its length in tokens does not
/// (tokenizers that split text into words first count a word alike
/// wherever it stands).
pub(super) fn victim_prompt(canary: &str, tokens: usize) -> String {
    let mut rng = ChaCha8Rng::seed_from_u64(canary.parse().unwrap_or(0));
    // The code sentences are about 12 tokens each; a word is about 1.4
    // (measured with a Llama-3-style BPE) — so the prompt stays under
    // `tokens` wherever that estimate holds.
    let n = (tokens.saturating_sub(24) * 10 / 14).max(4);
    let mut words: Vec<&str> = WORDS.iter().copied().cycle().take(n).collect();
    for i in (1..words.len()).rev() {
        words.swap(i, rng.random_range(0..=i));
    }
    format!(
        "The secret code is {canary}. {}. Remember the secret code {canary}.",
        words.join(" ")
    )
}

pub(super) fn hash(text: &str) -> String {
    format!("{:016x}", xxhash_rust::xxh3::xxh3_64(text.as_bytes()))
}

/// Phase 1: identical greedy requests, sequential and concurrent.
pub async fn determinism(
    client: &Client,
    keys: &Keys<'_>,
    texts: &mut Texts,
    concurrency: usize,
    found: &mut Found,
) -> Result<(), Stop> {
    let prompt = texts.words(40);
    let mut sequential = Vec::new();
    for _ in 0..3 {
        sequential.push(ok_or_stop(client.complete(keys.victim, &prompt, 12).await)?);
    }
    let mut concurrent = Vec::new();
    for c in futures_util::future::join_all(
        (0..concurrency).map(|_| client.complete(keys.victim, &prompt, 12)),
    )
    .await
    {
        concurrent.push(ok_or_stop(c)?);
    }
    found.determinism = Determinism::of(&sequential, &concurrent);
    let outputs: Vec<&Completion> = sequential.iter().chain(&concurrent).collect();
    let served = outputs.iter().filter(|c| c.served_text()).count();
    if served < outputs.len() {
        found.notes.push(format!(
            "determinism: {} of {} identical requests were not answered with text (status {})",
            outputs.len() - served,
            outputs.len(),
            outputs
                .iter()
                .find(|c| !c.served_text())
                .map_or(0, |c| c.status)
        ));
    }
    let d = &found.determinism;
    if !d.deterministic {
        found.notes.push(if d.deterministic_one_at_a_time {
            format!(
                "the server is not deterministic with other requests in flight: {} identical greedy \
                 requests gave {} distinct outputs, the {} sent one at a time agreed; comparisons of \
                 requests sent one at a time count, the others are skipped and only quoted canaries \
                 count there",
                d.requests,
                d.distinct_outputs,
                sequential.len()
            )
        } else {
            format!(
                "the server is not deterministic: {} identical greedy requests gave {} distinct \
                 outputs; output comparisons are skipped and only quoted canaries count",
                d.requests, d.distinct_outputs
            )
        });
    }
    Ok(())
}

/// Victims per probe and shape, each with its own canary: a leak that
/// maps two canaries to one output still shows among three.
pub(super) const CANARIES: usize = 3;

/// A fixed request of the probe's key, whose greedy output must not change
/// with anything another request sends.
struct Probe {
    name: &'static str,
    prompt: String,
    max_tokens: usize,
}

/// About `tokens` tokens of made-up words (a word is about 1.4 tokens).
pub(super) fn words_for(texts: &mut Texts, tokens: usize) -> String {
    texts.words((tokens * 10 / 14).max(4))
}

/// Phase 2: does a probe's output depend on another request's canary?
///
/// Probes of four shapes (short, long enough to take a long prefill chunk,
/// a long answer crossing many pages, over the limit) each follow victims
/// of three shapes, three canaries each. Then the patterns of a loaded
/// server: victims and probes in flight together; a probe retried after its
/// client abandoned it mid-request; a prompt sent twice at once; a request
/// extending a probe's prompt while the probe answers; a probe going on
/// beside a victim that has just left; a victim abandoned while a probe
/// answers; a probe arriving just after a waiting victim was abandoned.
pub async fn noninterference(
    client: &Client,
    keys: &Keys<'_>,
    texts: &mut Texts,
    context: Option<usize>,
    pool: Option<usize>,
    found: &mut Found,
) -> Result<(), Stop> {
    let ctx = context.unwrap_or(2048);
    // What the server can hold: the smaller of the context and the pool.
    let hold = pool.map_or(ctx, |p| p.min(ctx));
    let oversize = match pool {
        Some(p) if p < ctx => filler(p + 16),
        _ => filler(ctx * 3 / 2),
    };
    let probes = [
        Probe {
            name: "short probe",
            prompt: texts.words(12),
            max_tokens: 8,
        },
        Probe {
            name: "long probe",
            prompt: words_for(texts, hold * 2 / 5),
            max_tokens: 8,
        },
        Probe {
            name: "long-answer probe",
            prompt: texts.words(12),
            max_tokens: hold / 2,
        },
        Probe {
            name: "oversize probe",
            prompt: oversize,
            max_tokens: 8,
        },
    ];
    let shapes = [
        ("short victim", 40usize),
        ("long victim", hold * 3 / 5),
        ("near-limit victim", hold * 9 / 10),
    ];
    if found.runs(Pattern::Sequential) {
        sequential(client, keys, texts, &probes, &shapes, found).await?;
    }
    // Without the concurrent pattern's control rounds, the determinism
    // phase's verdict under load says whether outputs may be compared.
    let stable = if found.runs(Pattern::Concurrent) {
        let stable = concurrent(client, keys, texts, &probes, &shapes, found).await?;
        found.go_on()?;
        stable
    } else {
        found.determinism.deterministic
    };
    if found.runs(Pattern::Resent) {
        for how in [Resend::RetriedAfterAbandon, Resend::TwiceAtOnce] {
            resent_after_victim(client, keys, texts, hold, how, found).await?;
            found.go_on()?;
        }
    }
    if found.runs(Pattern::Extended) {
        extended_while_answering(client, keys, texts, &probes[2], stable, found).await?;
        found.go_on()?;
    }
    if found.runs(Pattern::SideBySide) {
        side_by_side(client, keys, texts, hold, stable, found).await?;
        found.go_on()?;
    }
    if found.runs(Pattern::AbandonedBesideAnswer) {
        abandoned_beside_answer(client, keys, texts, &probes[2], hold, stable, found).await?;
        found.go_on()?;
    }
    if found.runs(Pattern::AbandonedThenTaken) {
        abandoned_then_taken(client, keys, texts, hold, stable, found).await?;
    }
    Ok(())
}

/// One victim request carrying `canary`, `tokens` long: the time it took.
async fn victim(
    client: &Client,
    keys: &Keys<'_>,
    canary: &str,
    shape: &str,
    tokens: usize,
    found: &mut Found,
) -> Result<Duration, Stop> {
    let start = std::time::Instant::now();
    let v = ok_or_stop(
        client
            .complete(keys.victim, &victim_prompt(canary, tokens), 4)
            .await,
    )?;
    if !v.served_text() && v.status >= 500 {
        found
            .notes
            .push(format!("{shape}: the victim request got {}", v.status));
    }
    Ok(start.elapsed())
}

/// Victims and probes one at a time: each probe after a victim of each
/// shape, with a new canary each time.
async fn sequential(
    client: &Client,
    keys: &Keys<'_>,
    texts: &mut Texts,
    probes: &[Probe; 4],
    shapes: &[(&str, usize); 3],
    found: &mut Found,
) -> Result<(), Stop> {
    let deterministic = found.determinism.deterministic_one_at_a_time;
    for probe in probes {
        for &(shape, tokens) in shapes {
            let mut outs: Vec<(String, Completion)> = Vec::new();
            for _ in 0..CANARIES {
                let canary = texts.canary();
                victim(client, keys, &canary, shape, tokens, found).await?;
                let o = ok_or_stop(
                    client
                        .complete(keys.probe, &probe.prompt, probe.max_tokens)
                        .await,
                )?;
                outs.push((canary, o));
            }
            found.noninterference_pairs += 1;
            judge(found, probe.name, shape, "sequential", &outs, deterministic);
            found.go_on()?;
        }
    }
    Ok(())
}

/// Victims of every shape and two probes in flight together: the
/// long-answer probe sent with the victims, the short probe sent when they
/// are done while the long answer goes on. Rounds with new canaries, and
/// the first round's canaries twice more as the control: a server whose
/// probes' outputs change between identical rounds is nondeterministic
/// under load, and then only quoted canaries count. Returns whether the
/// control rounds agreed.
async fn concurrent(
    client: &Client,
    keys: &Keys<'_>,
    texts: &mut Texts,
    probes: &[Probe; 4],
    shapes: &[(&str, usize); 3],
    found: &mut Found,
) -> Result<bool, Stop> {
    let sets: Vec<Vec<String>> = (0..CANARIES)
        .map(|_| shapes.iter().map(|_| texts.canary()).collect())
        .collect();
    // Set 0, 1, 0, 2, 0: the control rounds interleaved with the others.
    let order = [0, 1, 0, 2, 0];
    let (long_answer, short) = (&probes[2], &probes[0]);
    let mut rounds: Vec<(usize, Completion, Completion)> = Vec::new();
    for &set in &order {
        let prompts: Vec<String> = shapes
            .iter()
            .zip(&sets[set])
            .map(|((_, tokens), canary)| victim_prompt(canary, *tokens))
            .collect();
        let victims = prompts.iter().map(|p| client.complete(keys.victim, p, 4));
        let (answer, (victims, later)) = futures_util::future::join(
            client.complete(keys.probe, &long_answer.prompt, long_answer.max_tokens),
            async {
                let v = futures_util::future::join_all(victims).await;
                let later = client
                    .complete(keys.probe, &short.prompt, short.max_tokens)
                    .await;
                (v, later)
            },
        )
        .await;
        for v in victims {
            ok_or_stop(v)?;
        }
        rounds.push((set, ok_or_stop(answer)?, ok_or_stop(later)?));
    }
    let text = |c: &Completion| c.text.clone();
    let control_agrees = |pick: fn(&(usize, Completion, Completion)) -> &Completion| {
        let mut controls = rounds.iter().filter(|r| r.0 == 0).map(|r| text(pick(r)));
        let first = controls.next();
        controls.all(|t| Some(t) == first)
    };
    let stable =
        found.determinism.deterministic && control_agrees(|r| &r.1) && control_agrees(|r| &r.2);
    if found.determinism.deterministic && !stable {
        found.notes.push(
            "the probes' outputs changed between identical rounds under load: the server is \
             not deterministic with other requests in flight; concurrent comparisons are \
             skipped and only quoted canaries count"
                .into(),
        );
    }
    // One output per canary set (the first round of each) for the
    // comparison; every round for the quotes.
    for (name, pick) in [
        (
            long_answer.name,
            (|r: &(usize, Completion, Completion)| &r.1) as fn(&_) -> &Completion,
        ),
        (short.name, |r| &r.2),
    ] {
        let outs: Vec<(String, Completion)> = sets
            .iter()
            .enumerate()
            .filter_map(|(set, canaries)| {
                let r = rounds.iter().find(|r| r.0 == set)?;
                Some((canaries.join(" "), pick(r).clone()))
            })
            .collect();
        let quotes: Vec<(String, Completion)> = rounds
            .iter()
            .flat_map(|r| sets[r.0].iter().map(move |c| (c.clone(), pick(r).clone())))
            .collect();
        found.noninterference_pairs += 1;
        if !quoted(
            found,
            name,
            "mix of victims of every shape",
            "concurrent",
            &quotes,
        ) {
            judge(
                found,
                name,
                "mix of victims of every shape",
                "concurrent",
                &outs,
                stable,
            );
        }
    }
    Ok(stable)
}

/// How the probe's key sends a new long prompt after a victim.
#[derive(Clone, Copy)]
enum Resend {
    /// Sent, abandoned mid-request (a client timing out) and sent again
    /// (its retry): a server that keeps or caches the abandoned request's
    /// pages as if they were computed answers the retry from the victim's
    /// KV.
    RetriedAfterAbandon,
    /// Sent twice at once (two users of one system prompt): a server that
    /// shares a page of the prompt before its writer has filled it answers
    /// from the victim's KV.
    TwiceAtOnce,
}

/// After a victim, the probe's key sends a new long prompt as `how` says;
/// the other key then sends the same prompt. The probe's answers must be
/// the other key's fresh answer, whatever the victim's canary.
async fn resent_after_victim(
    client: &Client,
    keys: &Keys<'_>,
    texts: &mut Texts,
    hold: usize,
    how: Resend,
    found: &mut Found,
) -> Result<(), Stop> {
    for round in 0..CANARIES {
        let canary = texts.canary();
        let took = victim(client, keys, &canary, "long victim", hold * 3 / 5, found).await?;
        let prompt = words_for(texts, hold * 2 / 5);
        let (probe, mode, answers) = match how {
            Resend::RetriedAfterAbandon => {
                // Abandoned at a sixth, a third and half of the victim's
                // time: from early in the prompt's prefill to about its end.
                let after = took * (round as u32 + 1) / 6;
                client.abandon(keys.probe, &prompt, 8, after).await?;
                let retry = ok_or_stop(client.complete(keys.probe, &prompt, 8).await)?;
                (
                    "retried long probe",
                    "retried after its client abandoned it",
                    vec![retry],
                )
            }
            Resend::TwiceAtOnce => {
                let (a, b) = futures_util::future::join(
                    client.complete(keys.probe, &prompt, 8),
                    client.complete(keys.probe, &prompt, 8),
                )
                .await;
                (
                    "twin long probe",
                    "sent twice at once",
                    vec![ok_or_stop(a)?, ok_or_stop(b)?],
                )
            }
        };
        let fresh = ok_or_stop(client.complete(keys.victim, &prompt, 8).await)?;
        for answer in answers {
            fresh_pair(found, probe, mode, canary.clone(), answer, fresh.clone());
        }
    }
    Ok(())
}

/// The longest wait for the long-answer probe's first token before its
/// prompt is extended anyway.
const EXTEND_AFTER_MS: u64 = 20_000;

/// While the long-answer probe answers, the probe's key sends a request
/// that extends the probe's prompt with a canary (a conversation's next
/// turn): the probe's answer must not change with that canary. A server
/// that shares the probe's partly filled last page lets the other request
/// write into the probe's answer slots. The extension is sent when the
/// probe's first token has come back — mid-answer however slow the server
/// is — and at the latest after `EXTEND_AFTER_MS`.
///
/// Each round has a legal neighbour at the same moment: a request of the
/// same shape extending another prompt, which shares nothing with the
/// probe. Where the probe answers as alone beside every neighbour (the
/// server's outputs do not change with what runs beside them, shown in this
/// very timing), an answer that differs from it beside the extension of its
/// own prompt is a finding. This does not lean on the concurrent phase's
/// control rounds, which a server that lets requests write into each
/// other's pages makes disagree under load.
async fn extended_while_answering(
    client: &Client,
    keys: &Keys<'_>,
    texts: &mut Texts,
    probe: &Probe,
    stable: bool,
    found: &mut Found,
) -> Result<(), Stop> {
    const OWN: &str = "request extending its prompt";
    const OTHER: &str = "request extending another prompt";
    let alone = ok_or_stop(
        client
            .complete(keys.probe, &probe.prompt, probe.max_tokens)
            .await,
    )?;
    let another = texts.words(probe.prompt.split(' ').count());
    let mut extended = Vec::new();
    let mut beside = Vec::new();
    for _ in 0..CANARIES {
        let canary = texts.canary();
        for (base, outs) in [(&probe.prompt, &mut extended), (&another, &mut beside)] {
            let next_turn = format!("{base} {}", victim_prompt(&canary, 40));
            let answer = answer_while_sent(client, keys.probe, probe, &next_turn).await?;
            outs.push((canary.clone(), answer));
        }
    }
    found.noninterference_pairs += 1;
    if quoted(found, probe.name, OWN, "concurrent", &extended)
        || quoted(found, probe.name, OTHER, "concurrent", &beside)
    {
        return Ok(());
    }
    let invariant = found.determinism.deterministic
        && alone.served_text()
        && beside
            .iter()
            .all(|(_, o)| o.served_text() && o.text == alone.text);
    if !invariant {
        if found.determinism.deterministic {
            found.notes.push(format!(
                "the {}'s output beside a {OTHER} was not its answer alone: not compared with it",
                probe.name
            ));
        }
        judge(found, probe.name, OWN, "concurrent", &extended, stable);
        return Ok(());
    }
    differs_from_alone(
        found,
        [probe.name, OWN, "concurrent"],
        &alone,
        &extended,
        &format!("while beside a {OTHER} at the same moment it answered as alone in every round"),
    );
    Ok(())
}

/// An `output-depends-on-other-request` finding when served outputs of
/// `rounds` (each with its canary) differ from the probe's answer `alone`;
/// `why` says what makes the answer alone the reference; the probe, the
/// victim's shape and the mode name the pattern. Whether a finding was made.
fn differs_from_alone(
    found: &mut Found,
    [probe, shape, mode]: [&str; 3],
    alone: &Completion,
    rounds: &[(String, Completion)],
    why: &str,
) -> bool {
    let differ: Vec<&(String, Completion)> = rounds
        .iter()
        .filter(|(_, o)| o.served_text() && o.text != alone.text)
        .collect();
    if differ.is_empty() {
        return false;
    }
    found.findings.push(Finding {
        rule: Rule::OutputDependsOnOtherRequest,
        message: format!(
            "the {probe}'s greedy output ({mode}, with a {shape}) differs from its answer alone \
             in {} of {} rounds, {why}",
            differ.len(),
            rounds.len()
        ),
        evidence: serde_json::json!({
            "probe": probe, "victim": shape, "mode": mode,
            "canaries": differ.iter().map(|(c, _)| c).collect::<Vec<_>>(),
            "output_hashes": differ.iter().map(|(_, o)| hash(&o.text)).collect::<Vec<_>>(),
            "alone_output_hash": hash(&alone.text),
        }),
    });
    true
}

/// The probe's answer, with `beside` sent by `key` when the answer's first
/// token comes back (or after `EXTEND_AFTER_MS`).
async fn answer_while_sent(
    client: &Client,
    key: Option<&str>,
    probe: &Probe,
    beside: &str,
) -> Result<Completion, Stop> {
    let (under_way, told) = tokio::sync::oneshot::channel();
    let (answer, other) = futures_util::future::join(
        client.complete_telling(key, &probe.prompt, probe.max_tokens, under_way),
        async {
            // Told, or the probe refused (the sender dropped), or late.
            let _ = tokio::time::timeout(Duration::from_millis(EXTEND_AFTER_MS), told).await;
            client.complete(key, beside, 4).await
        },
    )
    .await;
    ok_or_stop(other)?;
    ok_or_stop(answer)
}

/// Rounds of one side-by-side pairing: canary sets 0, 1, 0, 2 — the
/// pattern's own control (set 0 twice) beside two changes of canary.
const SIDE_BY_SIDE_ROUNDS: [usize; 4] = [0, 1, 0, 2];

/// A victim and a probe answered side by side: sent together, the victim
/// first, the victim's answer the shorter. When the victim leaves, the
/// probe goes on in the batch the victim has just left, with pages the
/// victim has just freed nearby — where a server that keeps its batch
/// arrays from step to step, or pads a batch into a slot it does not own,
/// hands the probe the victim's KV. Two pairings: a probe whose prompt is
/// as long as the victim's (at the victim's end both hold as many pages,
/// whatever the page size), and a short probe beside victims that fill the
/// rest of what the server holds (the probe takes the pool's last pages),
/// at three sizes a page apart. Each pairing is its own control: the first
/// canary set comes twice, and outputs are compared only when those two
/// rounds agree; on a server shown `stable` under load each is also
/// compared with the probe's answer alone.
async fn side_by_side(
    client: &Client,
    keys: &Keys<'_>,
    texts: &mut Texts,
    hold: usize,
    stable: bool,
    found: &mut Found,
) -> Result<(), Stop> {
    // The probe's prompt of the victim's shape carries a made-up secret of
    // its own: same words, same length, another order.
    let same = victim_prompt(&texts.canary(), 40);
    let short = texts.words(12);
    let same_alone = ok_or_stop(client.complete(keys.probe, &same, 16).await)?;
    let short_alone = ok_or_stop(client.complete(keys.probe, &short, 16).await)?;
    let mut pairings = vec![(
        "same-length victim".to_string(),
        40usize,
        &same,
        &same_alone,
    )];
    for rest in [24, 40, 56] {
        let tokens = hold.saturating_sub(rest);
        pairings.push((
            format!("pool-filling victim of about {tokens} tokens"),
            tokens,
            &short,
            &short_alone,
        ));
    }
    for (shape, tokens, probe, alone) in pairings {
        let sets: Vec<String> = (0..3).map(|_| texts.canary()).collect();
        let mut rounds: Vec<(usize, Completion)> = Vec::new();
        for &set in &SIDE_BY_SIDE_ROUNDS {
            let (v, p) = futures_util::future::join(
                client.complete(keys.victim, &victim_prompt(&sets[set], tokens), 4),
                after(20, client.complete(keys.probe, probe, 16)),
            )
            .await;
            ok_or_stop(v)?;
            rounds.push((set, ok_or_stop(p)?));
        }
        let pattern = Controlled {
            probe: "side-by-side probe",
            shape: &shape,
            mode: "side by side",
            alone: Some(alone).filter(|_| stable),
        };
        judge_controlled(found, &pattern, &sets, &rounds);
    }
    Ok(())
}

/// A long victim whose client abandons it mid-request (at a quarter and
/// at half of its time alone, and early while it waits behind another long
/// prompt) while the long-answer probe decodes: the
/// victim's pages go back to the pool while its prefill, or the transfer of
/// its KV, may still be under way, and the probe's next pages come from the
/// pool. A server that lets the abandoned request's late KV land, or lets
/// it go on writing through its old block table, writes the victim's KV
/// into the probe's pages. Rounds as side by side, with their own control
/// and the probe's answer alone.
async fn abandoned_beside_answer(
    client: &Client,
    keys: &Keys<'_>,
    texts: &mut Texts,
    probe: &Probe,
    hold: usize,
    stable: bool,
    found: &mut Found,
) -> Result<(), Stop> {
    let alone = ok_or_stop(
        client
            .complete(keys.probe, &probe.prompt, probe.max_tokens)
            .await,
    )?;
    let tokens = hold * 3 / 5;
    let took = victim(client, keys, &texts.canary(), "long victim", tokens, found).await?;
    // The same filler in every round: only the abandoned victim's canary
    // changes.
    let filler = victim_prompt(&texts.canary(), tokens);
    for (shape, share, queued) in [
        ("long victim abandoned at a quarter", 4, false),
        ("long victim abandoned at half", 2, false),
        ("long victim abandoned while queued behind another", 8, true),
    ] {
        let sets: Vec<String> = (0..3).map(|_| texts.canary()).collect();
        let mut rounds: Vec<(usize, Completion)> = Vec::new();
        for &set in &SIDE_BY_SIDE_ROUNDS {
            let prompt = victim_prompt(&sets[set], tokens);
            let (answer, abandoned, filled) = futures_util::future::join3(
                client.complete(keys.probe, &probe.prompt, probe.max_tokens),
                after(
                    if queued { 240 } else { 200 },
                    client.abandon(keys.victim, &prompt, 16, took / share),
                ),
                async {
                    if !queued {
                        return None;
                    }
                    Some(after(200, client.complete(keys.victim, &filler, 1)).await)
                },
            )
            .await;
            abandoned?;
            if let Some(f) = filled {
                ok_or_stop(f)?;
            }
            rounds.push((set, ok_or_stop(answer)?));
        }
        let pattern = Controlled {
            probe: probe.name,
            shape,
            mode: "beside an abandoned request",
            alone: Some(&alone).filter(|_| stable),
        };
        judge_controlled(found, &pattern, &sets, &rounds);
    }
    Ok(())
}

/// A victim abandoned while it waits behind another prompt, and the next
/// request to come, the probe's, longer than the victim's: the victim's
/// pages go back to the pool while its prefill is still to come, and the
/// probe's prompt takes them, page for page. A server that goes on with
/// the abandoned request when its prefill ends (its completion taken for a
/// live one's) decodes it through its old block table: the victim's first
/// answer tokens write their KV into the last page of the victim's prompt,
/// which the probe's prompt fills by then. Only the victim's writes that
/// come after the probe's KV show, and how many there are depends on where
/// the victim's prompt ends in its page: three victims about a third of a
/// page apart, each with a probe some two pages longer, each in rounds as
/// side by side. The waiting is made with a filler prompt of the victim's key,
/// fresh in every round (a cached one would keep nothing waiting).
async fn abandoned_then_taken(
    client: &Client,
    keys: &Keys<'_>,
    texts: &mut Texts,
    hold: usize,
    stable: bool,
    found: &mut Found,
) -> Result<(), Stop> {
    let fill = hold / 4;
    // The filler's time alone: the victim is abandoned well before the
    // filler's prefill is done.
    let start = std::time::Instant::now();
    ok_or_stop(
        client
            .complete(keys.victim, &victim_prompt(&texts.canary(), fill), 1)
            .await,
    )?;
    let wait = (start.elapsed() / 5).max(Duration::from_millis(30));
    for victim_tokens in [40, 46, 52] {
        // The probe's prompt carries a made-up secret of its own.
        let probe = victim_prompt(&texts.canary(), victim_tokens + 32);
        let alone = ok_or_stop(client.complete(keys.probe, &probe, 16).await)?;
        let sets: Vec<String> = (0..3).map(|_| texts.canary()).collect();
        let mut rounds: Vec<(usize, Completion)> = Vec::new();
        for &set in &SIDE_BY_SIDE_ROUNDS {
            let filler = victim_prompt(&texts.canary(), fill);
            let prompt = victim_prompt(&sets[set], victim_tokens);
            let (filled, answer) = futures_util::future::join(
                client.complete(keys.victim, &filler, 1),
                after(20, async {
                    client.abandon(keys.victim, &prompt, 32, wait).await?;
                    Ok(client.complete(keys.probe, &probe, 16).await)
                }),
            )
            .await;
            ok_or_stop(filled)?;
            rounds.push((set, ok_or_stop(answer?)?));
        }
        let shape = format!("victim of about {victim_tokens} tokens abandoned while queued");
        let pattern = Controlled {
            probe: "next arriving probe",
            shape: &shape,
            mode: "after an abandoned request",
            alone: Some(&alone).filter(|_| stable),
        };
        judge_controlled(found, &pattern, &sets, &rounds);
    }
    Ok(())
}

/// A pattern run in [`SIDE_BY_SIDE_ROUNDS`] order.
struct Controlled<'a> {
    probe: &'a str,
    shape: &'a str,
    mode: &'a str,
    /// The probe's answer with nothing else in flight, on a server whose
    /// outputs do not change under load (the concurrent control rounds):
    /// every round must answer the same.
    alone: Option<&'a Completion>,
}

/// The findings of a pattern run in [`SIDE_BY_SIDE_ROUNDS`] order (`rounds`
/// holds each round's canary set and the probe's output): quoted canaries
/// always; on a deterministic server, a round that answers otherwise than
/// the probe alone, or outputs changed with the canary when the two rounds
/// of the first set agree.
fn judge_controlled(
    found: &mut Found,
    pattern: &Controlled<'_>,
    sets: &[String],
    rounds: &[(usize, Completion)],
) {
    let &Controlled {
        probe, shape, mode, ..
    } = pattern;
    found.noninterference_pairs += 1;
    let quotes: Vec<(String, Completion)> = rounds
        .iter()
        .map(|(set, o)| (sets[*set].clone(), o.clone()))
        .collect();
    if quoted(found, probe, shape, mode, &quotes) {
        return;
    }
    let deterministic = found.determinism.deterministic;
    if let Some(alone) = pattern.alone.filter(|a| deterministic && a.served_text())
        && differs_from_alone(
            found,
            [probe, shape, mode],
            alone,
            &quotes,
            "on a server whose outputs do not change under load otherwise",
        )
    {
        return;
    }
    let controls_agree = rounds[0].1.text == rounds[2].1.text;
    if deterministic && !controls_agree {
        found.notes.push(format!(
            "{mode}, with a {shape}, the {probe}'s output changed between identical rounds: \
             not compared"
        ));
    }
    let outs: Vec<(String, Completion)> = [0, 1, 3]
        .iter()
        .map(|&r| (sets[rounds[r].0].clone(), rounds[r].1.clone()))
        .collect();
    judge(
        found,
        probe,
        shape,
        mode,
        &outs,
        deterministic && controls_agree,
    );
}

/// A probe's answer against the other key's fresh answer to the same
/// prompt, after a victim with `canary`: a finding when the probe quotes
/// the canary, or (on a deterministic server) answers otherwise.
fn fresh_pair(
    found: &mut Found,
    probe: &str,
    mode: &str,
    canary: String,
    probe_out: Completion,
    fresh: Completion,
) {
    found.noninterference_pairs += 1;
    if quoted(
        found,
        probe,
        "long victim",
        mode,
        &[(canary.clone(), probe_out.clone())],
    ) {
        return;
    }
    let compare = found.determinism.deterministic && probe_out.served_text() && fresh.served_text();
    if compare && probe_out.text != fresh.text {
        found.findings.push(Finding {
            rule: Rule::OutputDependsOnOtherRequest,
            message: format!(
                "the {probe}'s greedy output ({mode}, after a long victim) differs from the other key's fresh answer to the same prompt"
            ),
            evidence: serde_json::json!({
                "probe": probe, "victim": "long victim", "mode": mode, "canaries": [canary],
                "output_hashes": [hash(&probe_out.text)], "fresh_output_hash": hash(&fresh.text),
                "output_chars": [probe_out.text.chars().count()], "fresh_output_chars": fresh.text.chars().count(),
            }),
        });
    }
}

/// `request`, sent `ms` milliseconds from now.
async fn after<F: std::future::Future>(ms: u64, request: F) -> F::Output {
    tokio::time::sleep(Duration::from_millis(ms)).await;
    request.await
}

/// The canary (of those of `outs`) an output of `outs` quotes (or the
/// first half of), with that answer's status.
pub(super) fn quote_in(outs: &[(String, Completion)]) -> Option<(&String, u16)> {
    outs.iter().find_map(|(_, o)| {
        outs.iter()
            .map(|(c, _)| c)
            .find(|c| o.text.contains(&c[..8]))
            .map(|c| (c, o.status))
    })
}

/// Whether the probe's outputs in `outs` (each after a victim with its
/// canary), all served, differ: compared only where `compare`.
pub(super) fn outputs_differ(outs: &[(String, Completion)], compare: bool) -> bool {
    let mut distinct: Vec<&str> = outs
        .iter()
        .filter(|(_, o)| o.served_text())
        .map(|(_, o)| o.text.as_str())
        .collect();
    let all_served = distinct.len() == outs.len();
    distinct.sort_unstable();
    distinct.dedup();
    compare && all_served && distinct.len() > 1
}

/// A finding when a probe output quotes a canary (or its first half) of
/// the requests before or beside it; whether one did.
fn quoted(
    found: &mut Found,
    probe: &str,
    shape: &str,
    mode: &str,
    outs: &[(String, Completion)],
) -> bool {
    if let Some((canary, status)) = quote_in(outs) {
        found.findings.push(Finding {
            rule: Rule::CanaryQuoted,
            message: format!(
                "the {probe}'s output ({mode}, after a {shape}) quoted a canary only another request sent"
            ),
            evidence: serde_json::json!({"probe": probe, "victim": shape, "mode": mode, "canary": canary, "status": status}),
        });
        return true;
    }
    false
}

/// The findings of one probe's outputs, each after a victim with its canary.
fn judge(
    found: &mut Found,
    probe: &str,
    shape: &str,
    mode: &str,
    outs: &[(String, Completion)],
    compare: bool,
) {
    if quoted(found, probe, shape, mode, outs) {
        return;
    }
    if outputs_differ(outs, compare) {
        let served: Vec<&Completion> = outs.iter().map(|(_, o)| o).collect();
        found.findings.push(Finding {
            rule: Rule::OutputDependsOnOtherRequest,
            message: format!(
                "the {probe}'s greedy output ({mode}) changed when only the canary of the {shape} before it changed"
            ),
            evidence: serde_json::json!({
                "probe": probe, "victim": shape, "mode": mode,
                "canaries": outs.iter().map(|(c, _)| c).collect::<Vec<_>>(),
                "output_hashes": served.iter().map(|o| hash(&o.text)).collect::<Vec<_>>(),
                "output_chars": served.iter().map(|o| o.text.chars().count()).collect::<Vec<_>>(),
            }),
        });
    }
}

/// Phase 3: prompts under, at and over the context; `max_tokens` past it.
pub async fn limits(
    client: &Client,
    key: Option<&str>,
    context: usize,
    pool: Option<usize>,
    found: &mut Found,
) -> Result<(), Stop> {
    let mut probes: Vec<(&'static str, usize, usize, bool)> = vec![
        ("half the context", context / 2, 4, false),
        ("at the context", context.saturating_sub(8), 4, false),
        ("just over the context", context + 8, 4, true),
        ("twice the context", context * 2, 4, true),
        (
            "max_tokens past the context",
            context * 9 / 10,
            context,
            false,
        ),
    ];
    if let Some(p) = pool.filter(|&p| p < context) {
        probes.extend([
            ("under the pool limit", p.saturating_sub(8), 4, false),
            ("just over the pool limit", p + 8, 4, true),
        ]);
    }
    for (name, words, max_tokens, over) in probes {
        // What the server can hold for this probe.
        let limit = if name.contains("pool") {
            pool.unwrap_or(context)
        } else {
            context
        };
        let c = ok_or_stop(client.complete(key, &filler(words), max_tokens).await)?;
        let total = c.prompt_tokens.zip(c.completion_tokens).map(|(p, n)| p + n);
        let outcome = if c.status >= 500 {
            found.findings.push(Finding {
                rule: Rule::LimitNotClean,
                message: format!("a prompt {name} got {}: {}", c.status, c.error.clone().unwrap_or_default()),
                evidence: serde_json::json!({"probe": name, "prompt_words": words, "status": c.status}),
            });
            format!("{} (server error)", c.status)
        } else if (400..500).contains(&c.status) {
            format!(
                "refused {}: {}",
                c.status,
                c.error.clone().unwrap_or_default()
            )
        } else if over
            && c.served_text()
            && (name == "twice the context" || c.prompt_tokens.is_none_or(|p| p as usize > limit))
        {
            found.findings.push(Finding {
                rule: Rule::OversizePromptServed,
                message: format!(
                    "a prompt {name} (about {words} tokens, limit {limit}) was answered {} with text",
                    c.status
                ),
                evidence: serde_json::json!({
                    "probe": name, "prompt_words": words, "limit": limit, "status": c.status,
                    "prompt_tokens": c.prompt_tokens, "completion_tokens": c.completion_tokens,
                }),
            });
            format!("{} with text (finding)", c.status)
        } else if total.is_some_and(|t| t as usize > context) {
            found.findings.push(Finding {
                rule: Rule::LimitNotClean,
                message: format!("{name}: usage says {} tokens in a context of {context}", total.unwrap_or(0)),
                evidence: serde_json::json!({"probe": name, "prompt_tokens": c.prompt_tokens, "completion_tokens": c.completion_tokens, "context": context}),
            });
            format!("{} past the context (finding)", c.status)
        } else {
            format!("served {} ({:?})", c.status, c.finish_reason)
        };
        found.limits.push(LimitProbe {
            name,
            prompt_words: words,
            max_tokens,
            status: c.status,
            prompt_tokens: c.prompt_tokens,
            completion_tokens: c.completion_tokens,
            outcome,
        });
    }
    Ok(())
}

/// Phase 4: the prefix cache seen through time to first token — with the
/// same key (a hit must be visible, or no cache is detected) and with the
/// other key (a hit there is a finding).
pub async fn prefix_timing(
    client: &Client,
    keys: &Keys<'_>,
    texts: &mut Texts,
    context: Option<usize>,
    samples: usize,
    found: &mut Found,
) -> Result<(), Stop> {
    let words = (context.unwrap_or(2048) * 3 / 10).clamp(64, 1500);
    let (victim, probe) = (Sender::key(keys.victim), Sender::key(keys.probe));
    let same = timing_arm(client, victim, victim, texts, words, samples)
        .await?
        .timing;
    let cache_seen = same.ks.p < 0.01 && same.effect_ms > 0.0;
    let same = Timing {
        verdict: if cache_seen {
            "cache detected: a repeated prefix speeds up the first token".into()
        } else {
            "no cache detected (not evidence of isolation)".into()
        },
        ..same
    };
    found.timing.push(same);
    if keys.probe == keys.victim {
        found
            .notes
            .push("prefix-cache timing across keys needs --other-api-key; not run".into());
        return Ok(());
    }
    let mut other = timing_arm(client, victim, probe, texts, words, samples)
        .await?
        .timing;
    other.name = "other key";
    let shared = other.ks.p < 0.01 && other.effect_ms > 0.0;
    other.verdict = match (shared, cache_seen) {
        (true, _) => "hit across keys (finding)".into(),
        (false, true) => "no hit across keys while the same key hits: isolated by key".into(),
        (false, false) => {
            "no hit across keys, but no cache was seen with one key either: inconclusive".into()
        }
    };
    if shared {
        found.findings.push(Finding {
            rule: Rule::CrossKeyPrefixCache,
            message: format!(
                "a prefix warmed with one key made the other key's first token {:.1} ms faster (KS D = {:.2}, p = {:.2e})",
                other.effect_ms, other.ks.d, other.ks.p
            ),
            evidence: serde_json::json!({"ks_d": other.ks.d, "p_value": other.ks.p, "effect_ms": other.effect_ms, "samples": other.samples}),
        });
    }
    found.timing.push(other);
    Ok(())
}

/// Who sends a timed request: a key, the `cache_salt` it sends, and
/// whether it asks for the stream's usage (`cached_tokens`).
#[derive(Clone, Copy)]
pub(super) struct Sender<'a> {
    pub key: Option<&'a str>,
    pub salt: Option<&'a str>,
    pub usage: bool,
}

impl<'a> Sender<'a> {
    /// `key`, unsalted, asking for nothing more.
    pub fn key(key: Option<&'a str>) -> Self {
        Sender {
            key,
            salt: None,
            usage: false,
        }
    }
}

/// A timing arm, and the `cached_tokens` its timed requests reported
/// (salted requests ask for them).
pub(super) struct Arm {
    pub timing: Timing,
    pub cached_hit: Vec<u64>,
    pub cached_miss: Vec<u64>,
}

/// Times `samples` requests of `probe` on a prefix warmed just before by
/// `warm` against as many on fresh prefixes, interleaved. Each sample has
/// a prefix of its own: a prefix `probe` had sent before would be found
/// in a cache it may legally share with itself, and would show a hit
/// across keys (or salts) that is not one.
pub(super) async fn timing_arm(
    client: &Client,
    warm: Sender<'_>,
    probe: Sender<'_>,
    texts: &mut Texts,
    words: usize,
    samples: usize,
) -> Result<Arm, Stop> {
    let before = client.sent();
    let (mut hit, mut miss) = (Vec::new(), Vec::new());
    let (mut cached_hit, mut cached_miss) = (Vec::new(), Vec::new());
    for i in 0..samples {
        let prefix = texts.words(words);
        let warming = format!("{prefix} warm");
        match warm.salt {
            None => {
                ok_or_stop(client.complete(warm.key, &warming, 1).await)?;
            }
            Some(salt) => {
                ok_or_stop(
                    client
                        .first_token(warm.key, &warming, Some(salt), false)
                        .await,
                )?;
            }
        }
        let suffix = format!(" question {i}");
        let fresh = texts.words(words);
        for (start, times, cached) in [
            (&prefix, &mut hit, &mut cached_hit),
            (&fresh, &mut miss, &mut cached_miss),
        ] {
            let prompt = format!("{start}{suffix}");
            if let Some(t) = ok_or_stop(
                client
                    .first_token(probe.key, &prompt, probe.salt, probe.usage)
                    .await,
            )? {
                times.push(ms(t.after));
                cached.extend(t.cached_tokens);
            }
        }
    }
    let (hm, mm) = (median(&hit), median(&miss));
    let ks = if hit.is_empty() || miss.is_empty() {
        Ks { d: 0.0, p: 1.0 }
    } else {
        ks::two_sample(&hit, &miss)
    };
    Ok(Arm {
        timing: Timing {
            name: "same key",
            samples: hit.len().min(miss.len()),
            hit_median_ms: hm,
            miss_median_ms: mm,
            effect_ms: mm - hm,
            ks,
            requests: client.sent() - before,
            verdict: String::new(),
        },
        cached_hit,
        cached_miss,
    })
}

fn ms(d: Duration) -> f64 {
    d.as_secs_f64() * 1000.0
}

pub(super) fn median(v: &[f64]) -> f64 {
    if v.is_empty() {
        return f64::NAN;
    }
    let mut s = v.to_vec();
    s.sort_by(f64::total_cmp);
    let n = s.len();
    if n % 2 == 1 {
        s[n / 2]
    } else {
        (s[n / 2 - 1] + s[n / 2]) / 2.0
    }
}

/// A request's answer, a spent budget (ends the phase), or a failed request
/// (its error kept as a 599 answer: no status came back).
pub(super) fn ok_or_stop<T: Default + From<Failed>>(r: anyhow::Result<T>) -> Result<T, Stop> {
    match r {
        Ok(v) => Ok(v),
        Err(e) => match e.downcast::<Stop>() {
            Ok(spent) => Err(spent),
            Err(e) => Ok(T::from(Failed(e.to_string()))),
        },
    }
}

/// A request that got no answer (connection refused mid-audit, timeout).
pub struct Failed(pub String);

impl From<Failed> for Completion {
    fn from(f: Failed) -> Completion {
        Completion {
            status: 599,
            error: Some(f.0),
            ..Completion::default()
        }
    }
}

impl From<Failed> for Option<Duration> {
    fn from(_: Failed) -> Option<Duration> {
        None
    }
}

impl From<Failed> for Option<FirstToken> {
    fn from(_: Failed) -> Option<FirstToken> {
        None
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn out(canary: &str, text: &str) -> (String, Completion) {
        (
            canary.to_string(),
            Completion {
                status: 200,
                text: text.to_string(),
                ..Completion::default()
            },
        )
    }

    #[test]
    fn a_server_that_differs_only_under_load_is_deterministic_one_at_a_time() {
        let answers =
            |texts: &[&str]| -> Vec<Completion> { texts.iter().map(|t| out("", t).1).collect() };
        let alike = Determinism::of(&answers(&["a", "a", "a"]), &answers(&["a", "a"]));
        assert!(alike.deterministic && alike.deterministic_one_at_a_time);
        assert_eq!((alike.requests, alike.distinct_outputs), (5, 1));
        let under_load = Determinism::of(&answers(&["a", "a", "a"]), &answers(&["a", "b"]));
        assert!(!under_load.deterministic && under_load.deterministic_one_at_a_time);
        assert_eq!(under_load.distinct_outputs, 2);
        let never = Determinism::of(&answers(&["a", "b", "a"]), &answers(&["a", "a"]));
        assert!(!never.deterministic && !never.deterministic_one_at_a_time);
        let refused = Determinism::of(&[Completion::default()], &[]);
        assert!(!refused.deterministic && !refused.deterministic_one_at_a_time);
    }

    #[test]
    fn victims_differ_with_the_canary_in_order_only_so_their_length_does_not() {
        let mut texts = Texts::new(3);
        let (a, b) = (texts.canary(), texts.canary());
        assert_eq!(a.len(), 16);
        assert!(a.bytes().all(|c| c.is_ascii_digit()), "{a}");
        let (va, vb) = (victim_prompt(&a, 120), victim_prompt(&b, 120));
        assert_ne!(
            va.replace(&a, ""),
            vb.replace(&b, ""),
            "the words' order follows the canary"
        );
        let bag = |v: &str| {
            let mut w: Vec<String> = v
                .split_whitespace()
                .map(|w| w.trim_end_matches('.').to_string())
                .collect();
            w.sort();
            w
        };
        assert_eq!(
            bag(&va.replace(&a, "C")),
            bag(&vb.replace(&b, "C")),
            "the same words"
        );
        assert!(va.contains(&a) && vb.contains(&b));
    }

    #[test]
    fn a_probe_quoting_half_a_canary_is_a_finding_naming_that_canary() {
        let mut found = Found::default();
        let outs = [
            out("0123456789abcdef", "nothing here"),
            out("fedcba9876543210", "the code 01234567 leaked"),
        ];
        judge(&mut found, "probe", "victim", "sequential", &outs, true);
        assert_eq!(found.findings.len(), 1);
        assert_eq!(found.findings[0].rule, Rule::CanaryQuoted);
        assert_eq!(found.findings[0].evidence["canary"], "0123456789abcdef");
    }

    #[test]
    fn outputs_that_change_with_the_canary_are_a_finding_only_on_a_deterministic_server() {
        let outs = [
            out("0123456789abcdef", "moon"),
            out("fedcba9876543210", "universe"),
        ];
        let mut found = Found::default();
        judge(&mut found, "probe", "victim", "sequential", &outs, true);
        assert_eq!(found.findings[0].rule, Rule::OutputDependsOnOtherRequest);
        let mut found = Found::default();
        judge(&mut found, "probe", "victim", "sequential", &outs, false);
        assert!(found.findings.is_empty());
        let same = [
            out("0123456789abcdef", "moon"),
            out("fedcba9876543210", "moon"),
        ];
        judge(&mut found, "probe", "victim", "sequential", &same, true);
        assert!(found.findings.is_empty());
    }
}
