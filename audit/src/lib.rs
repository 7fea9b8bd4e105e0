//! `kvsan audit`: a black-box isolation audit of an OpenAI-compatible
//! server, from outside — for engines that cannot be rebuilt or preloaded.
//!
//! ```text
//!  discover   GET /v1/models: the model, its context (max_model_len)
//!  1 determinism      identical greedy requests, sequential and concurrent
//!  2 noninterference  a length sweep: probes at lengths from a page to
//!                     just under the context, each after victims with
//!                     canaries (a band of lengths whose answers depend on
//!                     them is a finding); victim prompts with made-up
//!                     canaries (short, long, near the limit), then probes
//!                     from the other key
//!                     (short, long, a long answer, oversize), three times
//!                     with only the canary changed; then a loaded
//!                     server's patterns: victims and probes in flight
//!                     together, a request retried after its client
//!                     abandoned it, one prompt sent twice at once, a
//!                     request extending a probe's prompt mid-answer,
//!                     a probe going on beside a victim that just left,
//!                     a victim abandoned while a probe answers
//!  3 limits           prompts under, at, just over and far over the
//!                     context; max_tokens pushing past it
//!  4 prefix timing    a repeated prefix's time to first token against
//!                     fresh ones: same key (a hit must show), other key
//!                     (a hit is a finding); two-sample KS test
//!  5 order            bursts of requests, half on prefixes just warmed:
//!                     answered first more often than chance (permutation
//!                     test) with the same key (the control), with the
//!                     other key (a finding)
//!  6 salt             cache_salt: the same key and salt hit (the control),
//!                     another salt or another key sending the salt must not
//! ```
//!
//! Exit status, like a linter's: 0 nothing found, 1 findings, 2 the audit
//! could not run (the server unreachable, bad arguments).

mod client;
mod found;
mod ks;
mod order;
mod probes;
mod report;
mod salt;
mod sweep;

use std::path::PathBuf;
use std::time::Duration;

use anyhow::Context;

use self::client::{Client, Stop};
use self::found::Found;
use self::probes::{Keys, Texts};
use self::report::Report;

/// Arguments of `kvsan audit`.
#[derive(clap::Args, Debug)]
pub struct Args {
    /// The server's base URL (`http://host:port`; `/v1/...` is appended).
    #[arg(long, value_name = "URL")]
    pub base_url: String,
    /// API key of the victim tenant (`Authorization: Bearer`).
    #[arg(long, value_name = "KEY")]
    pub api_key: Option<String>,
    /// API key of another tenant, for the cross-tenant probes and timing
    /// (without it, probes use `--api-key` and test across requests only).
    #[arg(long, value_name = "KEY")]
    pub other_api_key: Option<String>,
    /// Model to ask for (default: the first `/v1/models` lists).
    #[arg(long)]
    pub model: Option<String>,
    /// Context length in tokens (default: `max_model_len` from `/v1/models`;
    /// without either, the limit probes are skipped).
    #[arg(long, value_name = "TOKENS")]
    pub context_length: Option<usize>,
    /// A smaller limit the server enforces on a prompt, in tokens (a KV pool
    /// smaller than the context): probed like the context, and the
    /// noninterference probe's oversize prompt goes just over it.
    #[arg(long, value_name = "TOKENS")]
    pub pool_limit: Option<usize>,
    /// Requests the audit may send at most.
    #[arg(long, value_name = "REQUESTS", default_value_t = 600)]
    pub budget: usize,
    /// Identical requests sent at once in the determinism phase.
    #[arg(long, default_value_t = 3)]
    pub concurrency: usize,
    /// Seconds one request may take.
    #[arg(long, value_name = "SECS", default_value_t = 120)]
    pub timeout: u64,
    /// Timed requests per arm of each prefix-cache comparison (the prefix
    /// timing and the salt assertions).
    #[arg(long, default_value_t = 12)]
    pub timing_samples: usize,
    /// The server documents that a `cache_salt` is shared by every key
    /// that sends it (vLLM's rule): another key's hit on a salt is then
    /// reported, not a finding.
    #[arg(long)]
    pub salts_shared_across_keys: bool,
    /// Print the report as JSON on stdout.
    #[arg(long)]
    pub json: bool,
    /// Also write the findings as SARIF 2.1.0 to FILE.
    #[arg(long, value_name = "FILE")]
    pub sarif: Option<PathBuf>,
    /// Stop at the first finding, between one probe pattern and the next,
    /// instead of running every phase (the report says what did not run).
    #[arg(long)]
    pub fail_fast: bool,
    /// Seed of the made-up text and canaries (default: from the clock).
    #[arg(long)]
    pub seed: Option<u64>,
    /// The phases to run after the determinism phase, which always runs
    /// first (every comparison allows for what it measures).
    #[arg(
        long,
        value_enum,
        value_delimiter = ',',
        default_values_t = Phase::ALL
    )]
    pub phases: Vec<Phase>,
    /// The noninterference phase's probe patterns to run (default: every
    /// one); to re-run the pattern that made a finding, or to look at one
    /// fault. The report names those not run.
    #[arg(
        long,
        value_enum,
        value_delimiter = ',',
        default_values_t = Pattern::ALL
    )]
    pub patterns: Vec<Pattern>,
}

/// A probe pattern of the noninterference phase, in the order they run.
#[derive(clap::ValueEnum, Clone, Copy, Debug, PartialEq, Eq)]
pub enum Pattern {
    /// A prompt repeating one sentence, at lengths over the whole context:
    /// answered with the sentence when the whole prompt was computed.
    Coherence,
    /// Probes at lengths spread over the context, each after a victim.
    LengthSweep,
    /// Victims and probes one at a time.
    Sequential,
    /// Victims of every shape in flight beside the probes.
    Concurrent,
    /// A long prompt abandoned and retried, or sent twice at once, after a
    /// victim.
    Resent,
    /// A probe extending another prompt while that one is answered.
    Extended,
    /// A probe taking the batch row a same-length victim has just left.
    SideBySide,
    /// A victim abandoned beside a long answer.
    AbandonedBesideAnswer,
    /// A victim abandoned, its pages then taken by a probe.
    AbandonedThenTaken,
}

impl Pattern {
    const ALL: [Pattern; 9] = [
        Pattern::Coherence,
        Pattern::LengthSweep,
        Pattern::Sequential,
        Pattern::Concurrent,
        Pattern::Resent,
        Pattern::Extended,
        Pattern::SideBySide,
        Pattern::AbandonedBesideAnswer,
        Pattern::AbandonedThenTaken,
    ];
}

/// A phase of the audit after the determinism phase.
#[derive(clap::ValueEnum, Clone, Copy, Debug, PartialEq, Eq)]
pub enum Phase {
    /// Victims with canaries, then probes from the other key.
    Noninterference,
    /// Prompts under, at and over the context and the pool limit.
    Limits,
    /// The prefix cache seen through time to first token.
    Timing,
    /// The prefix cache seen through the order of answers to a burst.
    Order,
    /// Whether `cache_salt` isolates (paired with a visible hit).
    Salt,
}

impl Phase {
    const ALL: [Phase; 5] = [
        Phase::Noninterference,
        Phase::Limits,
        Phase::Timing,
        Phase::Order,
        Phase::Salt,
    ];
}

/// How the audit ended.
pub enum Outcome {
    /// Nothing found.
    Clean,
    /// Findings, reported.
    Findings,
    /// Nothing found, but the server stopped answering before the audit
    /// was done: the audit could not run to its end.
    Incomplete,
}

/// Runs the audit.
///
/// # Errors
/// The audit could not run: bad arguments, the server unreachable or
/// refusing the key, a SARIF file that cannot be written.
pub fn run(args: &Args) -> anyhow::Result<Outcome> {
    for (flag, value) in [
        ("--budget", args.budget),
        ("--concurrency", args.concurrency),
        ("--timing-samples", args.timing_samples),
    ] {
        if value == 0 {
            anyhow::bail!("{flag} 0: must be at least 1");
        }
    }
    let rt = tokio::runtime::Builder::new_multi_thread()
        .worker_threads(2)
        .enable_all()
        .build()
        .context("starting the HTTP runtime")?;
    let report = rt.block_on(audit(args))?;
    if args.json {
        println!("{}", serde_json::to_string(&report)?);
    } else {
        print!("{}", report.text());
    }
    if let Some(path) = &args.sarif {
        std::fs::write(path, serde_json::to_string_pretty(&report.sarif())? + "\n")
            .with_context(|| format!("writing {}", path.display()))?;
    }
    Ok(if !report.found.findings.is_empty() {
        Outcome::Findings
    } else if report.unresponsive {
        Outcome::Incomplete
    } else {
        Outcome::Clean
    })
}

async fn audit(args: &Args) -> anyhow::Result<Report> {
    let progress = indicatif::ProgressBar::new(args.budget as u64);
    progress.set_style(
        indicatif::ProgressStyle::with_template("kvsan audit {bar:30} {pos}/{len} requests {msg}")
            .unwrap_or_else(|_| indicatif::ProgressStyle::default_bar()),
    );
    let mut client = Client::new(
        &args.base_url,
        Duration::from_secs(args.timeout),
        args.budget,
        progress.clone(),
    )?;
    let served_context = client
        .discover(args.api_key.as_deref(), args.model.as_deref())
        .await?;
    let context = args.context_length.or(served_context);
    let keys = Keys {
        victim: args.api_key.as_deref(),
        probe: args.other_api_key.as_deref().or(args.api_key.as_deref()),
    };
    let seed = args.seed.unwrap_or_else(|| {
        std::time::SystemTime::now()
            .duration_since(std::time::UNIX_EPOCH)
            .map_or(0, |d| d.as_nanos() as u64)
    });
    let mut texts = Texts::new(seed);
    let mut found = Found {
        fail_fast: args.fail_fast,
        patterns_left_out: left_out(&Pattern::ALL, &args.patterns),
        ..Found::default()
    };
    let plan = Plan {
        context,
        pool: args.pool_limit,
        concurrency: args.concurrency,
        samples: args.timing_samples,
        salts_shared_across_keys: args.salts_shared_across_keys,
        phases: args.phases.clone(),
    };
    let phases = run_phases(&client, &keys, &mut texts, &plan, &mut found).await;
    let budget_spent = matches!(phases, Err(Stop::Budget(_)));
    let unresponsive = matches!(phases, Err(Stop::Unresponsive(_)));
    if let Err(stop) = phases {
        found.notes.push(stop.to_string());
    }
    let skipped = left_out(&Phase::ALL, &args.phases);
    if !skipped.is_empty() {
        found
            .notes
            .push(format!("phases not run (--phases): {}", names(&skipped)));
    }
    if !found.patterns_left_out.is_empty() && args.phases.contains(&Phase::Noninterference) {
        let note = format!(
            "noninterference patterns not run (--patterns): {}",
            names(&found.patterns_left_out)
        );
        found.notes.push(note);
    }
    if context.is_none() && args.phases.contains(&Phase::Limits) {
        found.notes.push(
            "the server gave no context length (max_model_len) and --context-length was not given: limit probes skipped"
                .into(),
        );
    }
    progress.finish_and_clear();
    Ok(Report {
        base_url: args.base_url.clone(),
        model: client.model.clone(),
        context_length: context,
        requests_sent: client.sent(),
        budget: args.budget,
        budget_spent,
        unresponsive,
        cross_tenant: args.other_api_key.is_some(),
        found,
    })
}

/// The values of `all` that `chosen` leaves out, in order.
fn left_out<T: Copy + PartialEq>(all: &[T], chosen: &[T]) -> Vec<T> {
    all.iter()
        .copied()
        .filter(|v| !chosen.contains(v))
        .collect()
}

/// The command-line names of `values`, comma-separated.
fn names<T: clap::ValueEnum>(values: &[T]) -> String {
    values
        .iter()
        .filter_map(|v| v.to_possible_value().map(|n| n.get_name().to_string()))
        .collect::<Vec<_>>()
        .join(", ")
}

/// What the phases are given.
struct Plan {
    context: Option<usize>,
    pool: Option<usize>,
    concurrency: usize,
    samples: usize,
    salts_shared_across_keys: bool,
    phases: Vec<Phase>,
}

async fn run_phases(
    client: &Client,
    keys: &Keys<'_>,
    texts: &mut Texts,
    plan: &Plan,
    found: &mut Found,
) -> Result<(), Stop> {
    probes::determinism(client, keys, texts, plan.concurrency, found).await?;
    if plan.phases.contains(&Phase::Noninterference) {
        // Every length the server may accept, first: a prompt served but
        // not computed (a pool smaller than the context) shows only there.
        let ctx = plan.context.unwrap_or(2048);
        if found.runs(Pattern::Coherence) {
            sweep::coherence(client, keys.probe, ctx, found).await?;
            found.go_on()?;
        }
        if found.runs(Pattern::LengthSweep) {
            sweep::length_sweep(client, keys, texts, ctx, found).await?;
            found.go_on()?;
        }
        probes::noninterference(client, keys, texts, plan.context, plan.pool, found).await?;
        found.go_on()?;
    }
    if let (true, Some(ctx)) = (plan.phases.contains(&Phase::Limits), plan.context) {
        probes::limits(client, keys.victim, ctx, plan.pool, found).await?;
        found.go_on()?;
    }
    if plan.phases.contains(&Phase::Timing) {
        probes::prefix_timing(client, keys, texts, plan.context, plan.samples, found).await?;
        found.go_on()?;
    }
    if plan.phases.contains(&Phase::Order) {
        order::scheduling_order(client, keys, texts, plan.context, found).await?;
        found.go_on()?;
    }
    if plan.phases.contains(&Phase::Salt) {
        salt::salt_assertions(
            client,
            keys,
            texts,
            plan.context,
            plan.samples,
            plan.salts_shared_across_keys,
            found,
        )
        .await?;
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use clap::Parser;

    use super::{Args, Found, Pattern, left_out, names};

    #[derive(Parser)]
    struct Cli {
        #[command(flatten)]
        args: Args,
    }

    fn parse(extra: &[&str]) -> Result<Args, clap::Error> {
        let mut argv = vec!["audit", "--base-url", "http://127.0.0.1:1"];
        argv.extend_from_slice(extra);
        Cli::try_parse_from(argv).map(|c| c.args)
    }

    #[test]
    fn every_pattern_runs_unless_patterns_names_some() {
        let all = parse(&[]).unwrap();
        assert_eq!(all.patterns, Pattern::ALL);
        assert!(Pattern::ALL.iter().all(|&p| Found::default().runs(p)));

        let some = parse(&["--patterns", "side-by-side,resent"]).unwrap();
        assert_eq!(some.patterns, [Pattern::SideBySide, Pattern::Resent]);
        let found = Found {
            patterns_left_out: left_out(&Pattern::ALL, &some.patterns),
            ..Found::default()
        };
        assert!(found.runs(Pattern::SideBySide) && found.runs(Pattern::Resent));
        assert!(!found.runs(Pattern::Sequential) && !found.runs(Pattern::Coherence));
        assert_eq!(
            names(&found.patterns_left_out),
            "coherence, length-sweep, sequential, concurrent, extended, \
             abandoned-beside-answer, abandoned-then-taken"
        );
    }

    #[test]
    fn an_unknown_pattern_is_refused_with_the_ones_there_are() {
        let err = parse(&["--patterns", "sideways"]).unwrap_err().to_string();
        assert!(err.contains("sideways"), "{err}");
        assert!(err.contains("side-by-side"), "{err}");
    }
}
