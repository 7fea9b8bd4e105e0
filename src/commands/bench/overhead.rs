//! `kvsan bench overhead`: the same workloads run three ways, interleaved —
//!
//! | variant | binary | hook target |
//! | --- | --- | --- |
//! | `off`   | release build                        | none |
//! | `debug` | release build `--features sanitize`  | in-process sanitizer; the KV kernels check its kernel shadow |
//! | `shim`  | the `off` binary, `LD_PRELOAD=libkvsan_shim.so` | the shim's C hook table |
//!
//! The binaries are built outside the shipped CLI: `scripts/bench-overhead`
//! builds each variant in its own target directory under `target/bench/`
//! (so they do not overwrite each other and rebuild incrementally) and
//! passes them as `--bin-off`, `--bin-debug`, `--shim`. Rounds run `off debug shim off debug shim …` per workload
//! after a warm-up round, each run a child process (`kvsan bench workload`)
//! whose peak RSS and CPU time (user + system) come from `wait4` and whose
//! checks come from the sanitizer's summary line on its stderr (`kvsan: N
//! violations; M checks`). Ratios are per round, so machine drift between
//! rounds cancels; each pair's ratios carry the bootstrap 95 % confidence
//! interval of their median (`ci95`). With `--budget SECS`, rounds go on
//! past `--rounds` until every pair's CPU-time ratio is known to ±1 % (the
//! interval's half-width) or the budget is spent.
//!
//! `--count paired` alternates the variants inside one process per round
//! ([`paired`]): the per-process differences in CPU time, far larger on a
//! shared machine than the overhead measured, cancel in each ratio.
//!
//! `--count instructions` runs each variant once more per counted workload
//! under cachegrind ([`super::instructions`]): instruction counts and their
//! ratios, repeatable on any machine, with the instructions spent in the
//! sanitizer's and the shim's code.

use std::ffi::OsString;
use std::fmt::Write as _;
use std::path::PathBuf;

use anyhow::{Context, bail};
use serde::Serialize;
use serde_json::json;

use super::child;
use super::instructions;

mod paired;
use super::kernel::{self, KernelCheck, Spread, median};
use super::plot;
use super::workload::Measured;

/// Arguments of `kvsan bench overhead`.
#[derive(clap::Args, Debug)]
pub struct Args {
    /// Measured rounds after the warm-up, at least (each runs every variant
    /// once per workload).
    #[arg(long, default_value_t = 5)]
    pub rounds: usize,
    /// Seconds to go on with more rounds after `--rounds`, until every
    /// pair's CPU-time ratio has a 95 % interval within ±1 % (default: no
    /// more rounds).
    #[arg(long, value_name = "SECS")]
    pub budget: Option<u64>,
    /// What to measure: `time` (interleaved rounds: elapsed and CPU time,
    /// tokens/s, TTFT, TPOT, peak RSS), `paired` (CPU time of the variants
    /// alternated inside one process per round) and/or `instructions` (one
    /// run per variant under Valgrind's cachegrind).
    #[arg(long, value_enum, value_delimiter = ',', default_values_t = [Count::Time])]
    pub count: Vec<Count>,
    /// Segments of a `paired` round (one process) on SmolLM2: each serves
    /// one wave of requests with every variant. The synthetic workloads,
    /// whose waves are far shorter, serve 4 times as many.
    #[arg(long, default_value_t = 30)]
    pub segments: usize,
    /// One round of the synthetic-model workload only, no warm-up (a smoke check).
    #[arg(long)]
    pub quick: bool,
    /// Print the JSON on stdout (the table goes to stderr).
    #[arg(long)]
    pub json: bool,
    /// Where `overhead.json` and `overhead.svg` go (default: `target/bench/` under the current directory).
    #[arg(long)]
    pub out: Option<PathBuf>,
    /// Variants to run (`off` always runs: ratios are to it).
    #[arg(long, value_enum, value_delimiter = ',', default_values_t = [Variant::Off, Variant::Debug, Variant::Shim])]
    pub variants: Vec<Variant>,
    /// Run this binary: `off` with no hooks, `debug`
    /// with the in-process sanitizer (and so its kernel-shadow checks) attached at run time
    /// (what `--features sanitize` selects at compile time), `shim` needs
    /// `--shim`.
    #[arg(long)]
    pub no_build: bool,
    /// The release binary for `off` (and `shim`).
    #[arg(long)]
    pub bin_off: Option<PathBuf>,
    /// The release binary built with `--features sanitize`, for `debug`.
    #[arg(long)]
    pub bin_debug: Option<PathBuf>,
    /// The release `libkvsan_shim.so`, for `shim`.
    #[arg(long)]
    pub shim: Option<PathBuf>,
    /// GGUF model for the SmolLM2 workloads (default: SmolLM2-135M, fetched on first use).
    #[arg(long)]
    pub model: Option<PathBuf>,
    /// Requests per SmolLM2 workload run.
    #[arg(long, default_value_t = 64)]
    pub requests: usize,
    /// Kernel threads of each timed run (`KVSAN_THREADS`; default: one per
    /// core). With 1, a run's CPU time is its work: no worker spins at a
    /// barrier waiting for another that the machine's other load delayed.
    #[arg(long, value_name = "N")]
    pub threads: Option<std::num::NonZeroUsize>,
}

/// What `--count` measures.
#[derive(clap::ValueEnum, Clone, Copy, Debug, PartialEq, Eq)]
pub enum Count {
    /// Elapsed and CPU time, over interleaved rounds.
    Time,
    /// CPU time of the variants alternated inside one process per round.
    Paired,
    /// Instructions executed, under cachegrind.
    Instructions,
}

/// One of the three ways the workload runs.
#[derive(clap::ValueEnum, Clone, Copy, Debug, PartialEq, Eq, Serialize)]
#[serde(rename_all = "kebab-case")]
pub enum Variant {
    /// Release build without the sanitizer.
    Off,
    /// Debug-build mode: `--features sanitize`.
    Debug,
    /// The `off` binary under `LD_PRELOAD` of the shim.
    Shim,
}

impl Variant {
    const ALL: [Variant; 3] = [Variant::Off, Variant::Debug, Variant::Shim];

    /// The stable name.
    pub fn name(self) -> &'static str {
        match self {
            Variant::Off => "off",
            Variant::Debug => "debug",
            Variant::Shim => "shim",
        }
    }

    /// The hook target the workload must report for this variant.
    fn expected_hooks(self) -> &'static str {
        match self {
            Variant::Off => "none",
            Variant::Debug => "in-process sanitizer",
            Variant::Shim => "C hook table",
        }
    }

    /// The target for the time ratio to `off` on the SmolLM2 mix.
    fn target(self) -> Option<f64> {
        match self {
            Variant::Off => None,
            Variant::Debug => Some(1.03),
            Variant::Shim => Some(1.02),
        }
    }
}

/// How to start one variant's workload.
struct Prepared {
    variant: Variant,
    program: PathBuf,
    /// `--attach` value for the workload.
    attach: &'static str,
    env: Vec<(String, OsString)>,
}

/// A workload: a name and the `bench workload` arguments.
struct Workload {
    name: &'static str,
    model: &'static str,
    topology: &'static str,
    args: Vec<String>,
    /// A short run of the same setup: the timed rounds' warm-up; for the
    /// counted workloads, the baseline whose instructions (process start,
    /// model load, the first request) are subtracted.
    short_args: Vec<String>,
}

/// One run's figures.
#[derive(Clone, Debug, Serialize)]
struct Run {
    tokens_per_s: f64,
    ttft_p50_ms: f64,
    ttft_p99_ms: f64,
    tpot_p50_ms: f64,
    peak_rss_bytes: u64,
    checks: u64,
    seconds: f64,
    /// CPU time of the whole child (user + system).
    cpu_seconds: f64,
    output_tokens: usize,
    prompt_tokens: usize,
}

/// A variant's figures on a workload: medians over rounds, and every round.
#[derive(Clone, Debug, Serialize)]
struct VariantReport {
    name: &'static str,
    workload: &'static str,
    tokens_per_s: f64,
    ttft_p50_ms: f64,
    ttft_p99_ms: f64,
    tpot_p50_ms: f64,
    peak_rss_bytes: u64,
    checks: u64,
    cpu_seconds: f64,
    rounds: Vec<Run>,
}

/// A pair's ratios on a workload.
#[derive(Clone, Debug, Serialize)]
struct RatioReport {
    pair: String,
    workload: &'static str,
    /// Time ratio: `off` tokens/s ÷ variant tokens/s (above 1: slower).
    tokens_per_s: Spread,
    /// Variant TTFT p50 ÷ `off` TTFT p50.
    ttft_p50: Spread,
    /// Variant TPOT p50 ÷ `off` TPOT p50.
    tpot_p50: Spread,
    /// Variant CPU seconds ÷ `off` CPU seconds, same work (the figure least
    /// moved by other processes on the machine).
    cpu_time: Spread,
    /// Whether `cpu_time`'s 95 % interval is within ±1 % of its median.
    resolved_to_1pct: bool,
    /// The target for the time ratios, where the issue sets one (SmolLM2 mix).
    target: Option<f64>,
}

/// A variant's instruction count on a counted workload.
#[derive(Clone, Debug, Serialize)]
struct CountedReport {
    name: &'static str,
    workload: &'static str,
    /// Instructions of the serving: the whole run's less the baseline's.
    instructions: u64,
    /// Of which, in each place's code ([`instructions::Counted::inside`]).
    inside: std::collections::BTreeMap<&'static str, u64>,
    /// The whole run, and its baseline (the first request alone).
    run: instructions::Counted,
    baseline: instructions::Counted,
    checks: u64,
}

/// A pair's instruction ratio on a counted workload.
#[derive(Clone, Debug, Serialize)]
struct CountedRatio {
    pair: String,
    workload: &'static str,
    /// Variant serving instructions ÷ `off` serving instructions.
    instructions: f64,
    /// The same for the whole runs, fixed costs included.
    whole_run_instructions: f64,
    target: Option<f64>,
}

/// The checks count in a sanitizer summary line (`kvsan: … ; M checks`),
/// the last such line of `stderr`.
pub fn parse_checks(stderr: &str) -> Option<u64> {
    stderr.lines().rev().find_map(|line| {
        let line = line.trim();
        let rest = line.strip_prefix("kvsan: ")?;
        let before = rest.strip_suffix(" checks")?;
        before.rsplit(' ').next()?.replace(',', "").parse().ok()
    })
}

/// The programs and environments of the variants to run: the prebuilt
/// files given (`scripts/bench-overhead` builds them), or this binary with
/// `--no-build`.
fn prepare(args: &Args, variants: &[Variant]) -> anyhow::Result<Vec<Prepared>> {
    const BUILD: &str = "scripts/bench-overhead builds the three variants and passes them; \
                         or give --no-build to run this binary";
    let this = std::env::current_exe().context("locating this binary")?;
    let off = match (&args.bin_off, args.no_build) {
        (Some(p), _) => p.clone(),
        (None, true) => this.clone(),
        (None, false) => bail!("the off variant needs --bin-off PATH ({BUILD})"),
    };
    let mut prepared = Vec::new();
    for &variant in variants {
        let (program, attach, env) = match variant {
            Variant::Off => (
                off.clone(),
                if args.no_build && args.bin_off.is_none() {
                    "none"
                } else {
                    "environment"
                },
                Vec::new(),
            ),
            Variant::Debug => match (&args.bin_debug, args.no_build) {
                (Some(p), _) => (p.clone(), "environment", Vec::new()),
                (None, true) => (this.clone(), "in-process", Vec::new()),
                (None, false) => bail!(
                    "the debug variant needs --bin-debug PATH, a build with --features sanitize ({BUILD})"
                ),
            },
            Variant::Shim => {
                let Some(lib) = &args.shim else {
                    bail!(
                        "the shim variant needs --shim PATH, a built libkvsan_shim.so ({BUILD}); \
                         or leave it out: --variants off,debug"
                    )
                };
                let lib = std::fs::canonicalize(lib)
                    .with_context(|| format!("the shim library {}", lib.display()))?;
                (
                    off.clone(),
                    "environment",
                    vec![("LD_PRELOAD".to_string(), lib.into_os_string())],
                )
            }
        };
        if !program.is_file() {
            bail!(
                "the {} variant's binary {} does not exist",
                variant.name(),
                program.display()
            );
        }
        let mut env = env;
        if let Some(n) = args.threads {
            env.push(("KVSAN_THREADS".to_string(), n.to_string().into()));
        }
        prepared.push(Prepared {
            variant,
            program,
            attach,
            env,
        });
    }
    Ok(prepared)
}

/// Strings of `v`.
fn strings(v: &[&str]) -> Vec<String> {
    v.iter().map(ToString::to_string).collect()
}

/// The synthetic model's workload `name` on `topology`: `requests` requests
/// and `extra` arguments, `warmup` requests to warm up.
fn synthetic(
    topology: &'static str,
    name: &'static str,
    requests: &str,
    warmup: &str,
    extra: &[&str],
) -> Workload {
    let args = |n: &str| {
        let mut a = strings(&[
            "--model-kind",
            "synthetic",
            "--topology",
            topology,
            "--requests",
            n,
        ]);
        a.extend(strings(extra));
        a
    };
    Workload {
        name,
        model: "synthetic (2 layers, width 32, 2 heads / 1 KV head, FFN 64)",
        topology,
        args: args(requests),
        short_args: args(warmup),
    }
}

/// The `bench workload` arguments of SmolLM2 on `topology` (with
/// `--model` when given).
fn smollm2_args(args: &Args, topology: &str) -> Vec<String> {
    let mut a = strings(&["--model-kind", "smollm2", "--topology", topology]);
    if let Some(m) = &args.model {
        a.push("--model".into());
        a.push(m.display().to_string());
    }
    a
}

/// The short workloads of the counted and paired runs: the synthetic model
/// unified and disaggregated (`synthetic` requests, `synthetic_short` in
/// the short run, then `small`), and SmolLM2 unified (`smollm2`, its short
/// run `smollm2_short`).
fn short_workloads(
    synthetic_requests: &str,
    synthetic_short: &str,
    small: &[String],
    smollm2: Vec<String>,
    smollm2_short: Vec<String>,
) -> Vec<Workload> {
    let with = |mut w: Workload| {
        w.args.extend_from_slice(small);
        w.short_args.extend_from_slice(small);
        w
    };
    vec![
        with(synthetic(
            "unified",
            "synthetic-unified",
            synthetic_requests,
            synthetic_short,
            &[],
        )),
        with(synthetic(
            "disagg",
            "synthetic-disagg",
            synthetic_requests,
            synthetic_short,
            &[],
        )),
        Workload {
            name: "smollm2-unified",
            model: "SmolLM2-135M Q4_1",
            topology: "unified",
            args: smollm2,
            short_args: smollm2_short,
        },
    ]
}

fn workloads(args: &Args) -> Vec<Workload> {
    let s = strings;
    let synthetic = |topology, name| synthetic(topology, name, "64", "8", &[]);
    if args.quick {
        return vec![synthetic("unified", "synthetic-unified")];
    }
    let requests = args.requests.to_string();
    let smollm2 = |topology: &'static str, name: &'static str| {
        let mut a = smollm2_args(args, topology);
        // Warm-up: load the model into the page cache, start the threads.
        let mut warm = a.clone();
        warm.extend(s(&["--requests", "2"]));
        a.extend(["--requests".to_string(), requests.clone()]);
        Workload {
            name,
            model: "SmolLM2-135M Q4_1",
            topology,
            args: a,
            short_args: warm,
        }
    };
    vec![
        smollm2("unified", "smollm2-unified"),
        smollm2("disagg", "smollm2-disagg"),
        synthetic("unified", "synthetic-unified"),
        synthetic("disagg", "synthetic-disagg"),
    ]
}

/// The arguments of `p`'s workload child.
fn child_args(p: &Prepared, workload_args: &[String]) -> Vec<String> {
    let mut a = vec![
        "bench".to_string(),
        "workload".to_string(),
        "--attach".to_string(),
        p.attach.to_string(),
    ];
    a.extend_from_slice(workload_args);
    a
}

/// Runs one workload under one variant.
fn run_one(p: &Prepared, workload_args: &[String]) -> anyhow::Result<Run> {
    let done = child::run(&p.program, &child_args(p, workload_args), &p.env)?;
    measured(p, &done)
}

/// What a finished workload child of `p` measured, checked to have run
/// under `p`'s hook target.
fn measured(p: &Prepared, done: &child::Finished) -> anyhow::Result<Run> {
    let line = done
        .stdout
        .lines()
        .rev()
        .find(|l| l.trim_start().starts_with('{'))
        .with_context(|| {
            format!(
                "the {} workload printed no JSON; stdout: {}",
                p.variant.name(),
                done.stdout
            )
        })?;
    let m: Measured = serde_json::from_str(line).context("the workload's JSON")?;
    if m.hooks != p.variant.expected_hooks() {
        bail!(
            "the {} variant ran with hook target `{}`, not `{}` ({} {:?})",
            p.variant.name(),
            m.hooks,
            p.variant.expected_hooks(),
            p.program.display(),
            p.env
        );
    }
    let checks = match (p.variant, parse_checks(&done.stderr)) {
        (Variant::Off, c) => c.unwrap_or(0),
        (_, Some(c)) => c,
        (v, None) => bail!(
            "the {} variant printed no sanitizer summary with a checks count on stderr:\n{}",
            v.name(),
            done.stderr
        ),
    };
    Ok(Run {
        tokens_per_s: m.tokens_per_s,
        ttft_p50_ms: m.ttft_p50_ms,
        ttft_p99_ms: m.ttft_p99_ms,
        tpot_p50_ms: m.tpot_p50_ms,
        peak_rss_bytes: done.peak_rss_bytes,
        checks,
        seconds: m.seconds,
        cpu_seconds: done.cpu_seconds,
        output_tokens: m.output_tokens,
        prompt_tokens: m.prompt_tokens,
    })
}

fn med(runs: &[Run], f: impl Fn(&Run) -> f64) -> f64 {
    let mut v: Vec<f64> = runs.iter().map(f).collect();
    v.sort_by(f64::total_cmp);
    median(&v)
}

fn report_variant(name: &'static str, workload: &'static str, runs: Vec<Run>) -> VariantReport {
    VariantReport {
        name,
        workload,
        tokens_per_s: med(&runs, |r| r.tokens_per_s),
        ttft_p50_ms: med(&runs, |r| r.ttft_p50_ms),
        ttft_p99_ms: med(&runs, |r| r.ttft_p99_ms),
        tpot_p50_ms: med(&runs, |r| r.tpot_p50_ms),
        peak_rss_bytes: med(&runs, |r| r.peak_rss_bytes as f64) as u64,
        checks: med(&runs, |r| r.checks as f64) as u64,
        cpu_seconds: med(&runs, |r| r.cpu_seconds),
        rounds: runs,
    }
}

fn ratio(off: &[Run], v: &[Run], f: impl Fn(&Run, &Run) -> f64) -> Spread {
    Spread::of(off.iter().zip(v).map(|(o, v)| f(o, v)).collect())
}

fn fmt_bytes(b: u64) -> String {
    format!("{:.1} MiB", b as f64 / (1024.0 * 1024.0))
}

fn table(
    variants: &[VariantReport],
    ratios: &[RatioReport],
    kernel: &KernelCheck,
    rounds: usize,
) -> String {
    let mut t = String::new();
    let _ = writeln!(
        t,
        "{:<18} {:<6} {:>10} {:>10} {:>10} {:>10} {:>8} {:>11} {:>12}",
        "workload",
        "variant",
        "tokens/s",
        "TTFT p50",
        "TTFT p99",
        "TPOT p50",
        "CPU s",
        "peak RSS",
        "checks"
    );
    for v in variants {
        let _ = writeln!(
            t,
            "{:<18} {:<6} {:>10.1} {:>8.1}ms {:>8.1}ms {:>8.2}ms {:>8.2} {:>11} {:>12}",
            v.workload,
            v.name,
            v.tokens_per_s,
            v.ttft_p50_ms,
            v.ttft_p99_ms,
            v.tpot_p50_ms,
            v.cpu_seconds,
            fmt_bytes(v.peak_rss_bytes),
            v.checks
        );
    }
    let _ = writeln!(
        t,
        "\nratios to off over {rounds} round(s): median [95 % interval] (CPU time: variant ÷ off; \
         tokens/s: off ÷ variant; above 1 is slower):"
    );
    let _ = writeln!(
        t,
        "{:<18} {:<10} {:>24} {:>6} {:>24} {:>24} {:>24} {:>7}",
        "workload",
        "pair",
        "CPU time",
        "±1 %",
        "tokens/s (elapsed)",
        "TTFT p50",
        "TPOT p50",
        "target"
    );
    let spread = |s: &Spread| format!("{:.3} [{:.3}, {:.3}]", s.median, s.ci95[0], s.ci95[1]);
    for r in ratios {
        let _ = writeln!(
            t,
            "{:<18} {:<10} {:>24} {:>6} {:>24} {:>24} {:>24} {:>7}",
            r.workload,
            r.pair,
            spread(&r.cpu_time),
            if r.resolved_to_1pct { "yes" } else { "no" },
            spread(&r.tokens_per_s),
            spread(&r.ttft_p50),
            spread(&r.tpot_p50),
            r.target.map_or("-".to_string(), |t| format!("≤{t:.2}"))
        );
    }
    let _ = writeln!(
        t,
        "\nin-kernel check alone ({}): unchecked {:.1} µs, checked {:.1} µs, ratio {}",
        kernel.shape,
        kernel.unchecked_us,
        kernel.checked_us,
        spread(&kernel.ratio)
    );
    t
}

/// What the timed rounds found.
struct Timed {
    workloads: Vec<Workload>,
    variants: Vec<VariantReport>,
    ratios: Vec<RatioReport>,
    rounds: usize,
    kernel: KernelCheck,
}

/// Half-width of the 95 % interval, relative to the median, below which a
/// ratio is resolved.
const RESOLUTION: f64 = 0.01;

/// The ratio reports of the rounds run so far: `runs[workload][variant][round]`.
fn ratio_reports(
    workloads: &[Workload],
    prepared: &[Prepared],
    runs: &[Vec<Vec<Run>>],
) -> Vec<RatioReport> {
    let mut out = Vec::new();
    for (wi, w) in workloads.iter().enumerate() {
        let off = &runs[wi][0];
        for (vi, p) in prepared.iter().enumerate().skip(1) {
            let v = &runs[wi][vi];
            let cpu_time = ratio(off, v, |o, v| v.cpu_seconds / o.cpu_seconds);
            out.push(RatioReport {
                pair: format!("{}/off", p.variant.name()),
                workload: w.name,
                tokens_per_s: ratio(off, v, |o, v| o.tokens_per_s / v.tokens_per_s),
                ttft_p50: ratio(off, v, |o, v| v.ttft_p50_ms / o.ttft_p50_ms),
                tpot_p50: ratio(off, v, |o, v| v.tpot_p50_ms / o.tpot_p50_ms),
                resolved_to_1pct: cpu_time.values.len() > 1
                    && cpu_time.ci95_half_width() <= RESOLUTION,
                cpu_time,
                target: if w.name.starts_with("smollm2") {
                    p.variant.target()
                } else {
                    None
                },
            });
        }
    }
    out
}

/// Whether to run round `rounds + 1` after `--rounds`: while `unresolved`
/// ratios (of kind `what`) are not resolved and `--budget` lasts, saying so.
fn another_round(
    args: &Args,
    started: std::time::Instant,
    rounds: usize,
    unresolved: usize,
    what: &str,
) -> bool {
    match args.budget.map(std::time::Duration::from_secs) {
        Some(b) if unresolved > 0 && started.elapsed() < b => {
            eprintln!(
                "kvsan bench: {unresolved} {what} ratio(s) not yet within ±1 %: round {} ({:.0} s of the {} s budget spent)",
                rounds + 1,
                started.elapsed().as_secs_f64(),
                b.as_secs()
            );
            true
        }
        _ => false,
    }
}

/// Interleaved rounds: `--rounds` of them, then more while `--budget`
/// lasts and a pair's CPU-time ratio is not resolved.
fn timed(args: &Args, prepared: &[Prepared]) -> anyhow::Result<Timed> {
    let started = std::time::Instant::now();
    let workloads = workloads(args);
    let min_rounds = if args.quick { 1 } else { args.rounds };
    if !args.quick {
        eprintln!("kvsan bench: warm-up round");
        for w in &workloads {
            for p in prepared {
                run_one(p, &w.short_args)
                    .with_context(|| format!("warm-up of {} on {}", p.variant.name(), w.name))?;
            }
        }
    }
    // runs[workload][variant][round]
    let mut runs: Vec<Vec<Vec<Run>>> = vec![vec![Vec::new(); prepared.len()]; workloads.len()];
    let mut rounds = 0;
    loop {
        if rounds >= min_rounds {
            let unresolved = ratio_reports(&workloads, prepared, &runs)
                .iter()
                .filter(|r| !r.resolved_to_1pct)
                .count();
            if !another_round(args, started, rounds, unresolved, "CPU-time") {
                break;
            }
        }
        rounds += 1;
        for (wi, w) in workloads.iter().enumerate() {
            for (vi, p) in prepared.iter().enumerate() {
                let r = run_one(p, &w.args).with_context(|| {
                    format!("round {rounds} of {} on {}", p.variant.name(), w.name)
                })?;
                eprintln!(
                    "kvsan bench: round {rounds:<3} {:<18} {:<5} {:>9.1} tokens/s  {:>6.1} s  {:>6.1} CPU s  {} checks",
                    w.name,
                    p.variant.name(),
                    r.tokens_per_s,
                    r.seconds,
                    r.cpu_seconds,
                    r.checks
                );
                runs[wi][vi].push(r);
            }
        }
    }
    let kernel = if args.quick {
        kernel::measure(3, 5)
    } else {
        kernel::measure(9, 50)
    };
    let ratios = ratio_reports(&workloads, prepared, &runs);
    let mut variants = Vec::new();
    for (wi, w) in workloads.iter().enumerate() {
        for (vi, p) in prepared.iter().enumerate() {
            variants.push(report_variant(
                p.variant.name(),
                w.name,
                runs[wi][vi].clone(),
            ));
        }
    }
    Ok(Timed {
        workloads,
        variants,
        ratios,
        rounds,
        kernel,
    })
}

/// The workloads counted under cachegrind: deterministic (one request in
/// flight, fixed seeds) and short (Valgrind runs them ~50× slower). Each
/// one's baseline is its first request alone, so what is compared is the
/// serving of the requests after it, without the process's fixed cost.
fn counted_workloads(args: &Args) -> Vec<Workload> {
    let shape = |prompt_max: &str, new_min: &str, new_max: &str| {
        strings(&[
            "--in-flight",
            "1",
            "--prompt-min",
            "16",
            "--prompt-max",
            prompt_max,
            "--new-min",
            new_min,
            "--new-max",
            new_max,
        ])
    };
    let with = |mut w: Workload, extra: &[String]| {
        w.args.extend_from_slice(extra);
        w.short_args.extend_from_slice(extra);
        w
    };
    if args.quick {
        // A smoke check, even of a debug build.
        let w = synthetic("unified", "synthetic-unified", "2", "1", &[]);
        return vec![with(w, &shape("64", "4", "8"))];
    }
    let mut smollm2 = smollm2_args(args, "unified");
    smollm2.extend(shape("24", "2", "4"));
    let requests = |n: &str| strings(&["--requests", n]);
    short_workloads(
        "8",
        "1",
        &shape("256", "16", "32"),
        [smollm2.clone(), requests("3")].concat(),
        [smollm2, requests("1")].concat(),
    )
}

/// What the counted runs found.
struct CountedRuns {
    workloads: Vec<Workload>,
    variants: Vec<CountedReport>,
    ratios: Vec<CountedRatio>,
}

/// Each variant once per counted workload, under cachegrind.
fn counted(
    args: &Args,
    prepared: &[Prepared],
    out_dir: &std::path::Path,
) -> anyhow::Result<CountedRuns> {
    let workloads = counted_workloads(args);
    let mut variants = Vec::new();
    let mut ratios = Vec::new();
    for w in &workloads {
        let mut off: Option<(u64, u64)> = None;
        for p in prepared {
            let count = |args: &[String], what: &str| {
                let profile = out_dir.join(format!(
                    "cachegrind.{}.{}.{what}.out",
                    w.name,
                    p.variant.name()
                ));
                instructions::count(&p.program, &child_args(p, args), &p.env, &profile)
                    .with_context(|| {
                        format!("counting {} on {} ({what})", p.variant.name(), w.name)
                    })
            };
            let (done, run) = count(&w.args, "run")?;
            let checks = measured(p, &done)?.checks;
            let (_, baseline) = count(&w.short_args, "baseline")?;
            let serving = run.instructions.saturating_sub(baseline.instructions);
            let inside = run
                .inside
                .iter()
                .map(|(k, v)| (*k, v.saturating_sub(baseline.inside[k])))
                .collect::<std::collections::BTreeMap<_, _>>();
            eprintln!(
                "kvsan bench: counted {:<18} {:<5} {:>14} instructions serving ({} run, {} baseline; {} in the sanitizer, {} in the shim)",
                w.name,
                p.variant.name(),
                serving,
                run.instructions,
                baseline.instructions,
                inside["sanitizer"],
                inside["shim"]
            );
            match off {
                None => off = Some((serving, run.instructions)),
                Some((off_serving, off_run)) => ratios.push(CountedRatio {
                    pair: format!("{}/off", p.variant.name()),
                    workload: w.name,
                    instructions: serving as f64 / off_serving.max(1) as f64,
                    whole_run_instructions: run.instructions as f64 / off_run.max(1) as f64,
                    target: if w.name.starts_with("smollm2") {
                        p.variant.target()
                    } else {
                        None
                    },
                }),
            }
            variants.push(CountedReport {
                name: p.variant.name(),
                workload: w.name,
                instructions: serving,
                inside,
                run,
                baseline,
                checks,
            });
        }
    }
    Ok(CountedRuns {
        workloads,
        variants,
        ratios,
    })
}

fn counted_table(c: &CountedRuns) -> String {
    let mut t = String::new();
    let _ = writeln!(
        t,
        "\ninstructions serving (cachegrind: a run less its first request alone; KVSAN_THREADS=1, one request in flight):"
    );
    let _ = writeln!(
        t,
        "{:<18} {:<6} {:>16} {:>14} {:>12} {:>14} {:>12}",
        "workload",
        "variant",
        "instructions",
        "in sanitizer",
        "in shim",
        "in kernel guard",
        "checks"
    );
    for v in &c.variants {
        let _ = writeln!(
            t,
            "{:<18} {:<6} {:>16} {:>14} {:>12} {:>14} {:>12}",
            v.workload,
            v.name,
            v.instructions,
            v.inside["sanitizer"],
            v.inside["shim"],
            v.inside["kernel_guard"],
            v.checks
        );
    }
    for r in &c.ratios {
        let _ = writeln!(
            t,
            "{:<18} {:<10} instruction ratio {:.4} (whole runs {:.4}){}",
            r.workload,
            r.pair,
            r.instructions,
            r.whole_run_instructions,
            r.target
                .map_or(String::new(), |t| format!("  (target ≤{t:.2})"))
        );
    }
    t
}

/// Runs the command.
///
/// # Errors
/// A build that fails, a workload that fails or runs under the wrong hook
/// target, Valgrind missing for `--count instructions`, or output that
/// cannot be written.
pub fn run(args: &Args) -> anyhow::Result<()> {
    if args.rounds == 0 {
        bail!("--rounds must be at least 1");
    }
    let mut variants: Vec<Variant> = Variant::ALL
        .into_iter()
        .filter(|v| *v == Variant::Off || args.variants.contains(v))
        .collect();
    variants.dedup();
    let prepared = prepare(args, &variants)?;
    let out_dir = args
        .out
        .clone()
        .unwrap_or_else(|| PathBuf::from("target").join("bench"));
    std::fs::create_dir_all(&out_dir).with_context(|| format!("creating {}", out_dir.display()))?;
    let json_path = out_dir.join("overhead.json");
    let svg_path = out_dir.join("overhead.svg");

    let timed = if args.count.contains(&Count::Time) {
        Some(timed(args, &prepared)?)
    } else {
        None
    };
    let paired = if args.count.contains(&Count::Paired) {
        Some(paired::paired(args, &prepared)?)
    } else {
        None
    };
    let counted = if args.count.contains(&Count::Instructions) {
        Some(counted(args, &prepared, &out_dir)?)
    } else {
        None
    };

    let describe = |ws: &[Workload]| {
        ws.iter()
            .map(|w| json!({"name": w.name, "model": w.model, "topology": w.topology, "args": w.args}))
            .collect::<Vec<_>>()
    };
    let mut doc = json!({
        "machine": super::machine(),
        "quick": args.quick,
        "json": json_path,
    });
    let mut text = String::new();
    if let Some(t) = &timed {
        doc["rounds"] = json!(t.rounds);
        doc["budget_s"] = json!(args.budget);
        doc["threads"] = json!(args.threads);
        doc["workloads"] = json!(describe(&t.workloads));
        doc["variants"] = json!(t.variants);
        doc["ratios"] = json!(t.ratios);
        doc["kernel_check"] = json!(t.kernel);
        doc["plot"] = json!(svg_path);
        text.push_str(&table(&t.variants, &t.ratios, &t.kernel, t.rounds));
    }
    if let Some(p) = &paired {
        doc["paired"] = json!({
            "workloads": describe(&p.workloads),
            "rounds": p.rounds,
            "segments": p
                .workloads
                .iter()
                .zip(&p.segments)
                .map(|(w, n)| (w.name.to_string(), json!(n)))
                .collect::<serde_json::Map<_, _>>(),
            "budget_s": args.budget,
            "threads": args.threads.map_or(1, std::num::NonZeroUsize::get),
            "variants": p.variants,
            "ratios": p.ratios,
        });
        doc["plot"] = json!(svg_path);
        text.push_str(&paired::table(p));
    }
    let column = |workload, pair, s: &Spread, target| plot::Column {
        workload,
        pair,
        low: s.ci95[0],
        median: s.median,
        high: s.ci95[1],
        target,
    };
    let mut columns = Vec::new();
    let mut what = Vec::new();
    if let Some(t) = &timed {
        columns.extend(
            t.ratios
                .iter()
                .map(|r| column(r.workload, &r.pair, &r.cpu_time, r.target)),
        );
        what.push(format!("{} round(s) of separate processes", t.rounds));
    }
    if let Some(p) = &paired {
        columns.extend(
            p.ratios
                .iter()
                .map(|r| column(r.workload, &r.label, &r.cpu_time, r.target)),
        );
        what.push(format!("{} process(es) of alternated segments", p.rounds));
    }
    if !columns.is_empty() {
        let title = format!(
            "kvsan overhead: CPU-time ratio to the unsanitized build, median and 95 % interval; {}",
            what.join("; ")
        );
        std::fs::write(&svg_path, plot::svg(&title, &columns))
            .with_context(|| format!("writing {}", svg_path.display()))?;
    }
    if let Some(c) = &counted {
        doc["instructions"] = json!({
            "workloads": describe(&c.workloads),
            "variants": c.variants,
            "ratios": c.ratios,
        });
        text.push_str(&counted_table(c));
    }
    let pretty = serde_json::to_string_pretty(&doc)?;
    std::fs::write(&json_path, format!("{pretty}\n"))
        .with_context(|| format!("writing {}", json_path.display()))?;
    if args.json {
        eprint!("{text}");
        println!("{}", serde_json::to_string(&doc)?);
    } else {
        print!("{text}");
        let plot = if timed.is_some() || paired.is_some() {
            format!(" and {}", svg_path.display())
        } else {
            String::new()
        };
        println!("\nwrote {}{plot}", json_path.display());
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn checks_come_from_the_last_summary_line() {
        let err = "kvsan shim loaded\nkvsan: 0 violations; 12 checks\nnoise\nkvsan: 1 violation (double-free: 1); 3456 checks\n";
        assert_eq!(parse_checks(err), Some(3456));
        assert_eq!(parse_checks("kvsan: 0 violations\n"), None);
        assert_eq!(parse_checks(""), None);
    }
}
