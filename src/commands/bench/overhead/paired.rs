//! `kvsan bench overhead --count paired`: the variants alternated inside one
//! process, so that each ratio compares servings that share the process's
//! memory placement and the machine's moment.
//!
//! On a shared virtual machine, the same binary doing the same work takes
//! CPU time that differs by ±10–15 % from one process to the next, and
//! drifts by as much within one process over seconds, so the ratios of
//! separate processes need hundreds of rounds to resolve 1 %. Here each
//! round is one process of the `off` binary — under `LD_PRELOAD` of the
//! shim when `shim` is measured — which loads the model once, starts one
//! engine per variant (`off` with no hooks, `debug` with the in-process
//! sanitizer and the checked kernel attached at run time, what `--features
//! sanitize` selects at compile time, `shim` with the preloaded shim's hook
//! table) and then, segment by segment, serves the next wave of requests
//! (`--in-flight` of them, together) once per variant, the order rotated
//! by one from segment to segment. A wave takes milliseconds, so the
//! servings a segment compares are milliseconds apart. Each serving's CPU
//! time (user + system of the process, across it) gives a ratio per
//! segment; the interval of their median resamples the processes, then the
//! segments within each ([`Spread::of_clusters`]).

use std::ffi::OsString;
use std::fmt::Write as _;

use anyhow::{Context, bail};
use serde::Serialize;

use super::super::child;
use super::super::kernel::{Spread, median};
use super::super::workload::Alternated;
use super::{
    Args, Prepared, RESOLUTION, Variant, Workload, another_round, short_workloads, smollm2_args,
    strings, synthetic,
};

/// How many more segments a synthetic workload serves per round than
/// SmolLM2: its waves take about a twentieth of the CPU time.
const SYNTHETIC_SEGMENTS: usize = 4;

/// The workloads alternated, with their segments per round: short waves,
/// so that a process holds many segments and neighbouring servings are
/// milliseconds apart.
pub(super) fn workloads(args: &Args) -> Vec<(Workload, usize)> {
    let small = strings(&["--in-flight", "4", "--prompt-max", "256"]);
    if args.quick {
        let mut w = synthetic("unified", "synthetic-unified", "8", "8", &[]);
        w.args.extend(small);
        return vec![(w, 3)];
    }
    let mut smollm2 = smollm2_args(args, "unified");
    smollm2.extend(strings(&[
        "--requests",
        "4",
        "--in-flight",
        "4",
        "--prompt-min",
        "8",
        "--prompt-max",
        "16",
        "--new-min",
        "8",
        "--new-max",
        "8",
    ]));
    short_workloads("16", "16", &small, smollm2.clone(), smollm2)
        .into_iter()
        .map(|w| {
            let n = if w.name.starts_with("synthetic") {
                args.segments * SYNTHETIC_SEGMENTS
            } else {
                args.segments
            };
            (w, n)
        })
        .collect()
}

/// A variant's figures on a workload, over every segment of every round.
#[derive(Clone, Debug, Serialize)]
pub(super) struct PairedVariant {
    name: &'static str,
    workload: &'static str,
    /// Median CPU seconds of one serving.
    cpu_seconds: f64,
    /// Checks its hook target performed, over all its servings.
    checks: u64,
    /// CPU seconds of each serving: `[round][segment]`.
    rounds: Vec<Vec<f64>>,
}

/// A pair's CPU-time ratio on a workload.
#[derive(Clone, Debug, Serialize)]
pub(super) struct PairedRatio {
    pub(super) pair: String,
    pub(super) workload: &'static str,
    /// The pair as the plot labels it.
    #[serde(skip)]
    pub(super) label: String,
    /// Variant ÷ `off` CPU seconds per segment; the interval resamples the
    /// rounds (processes), then their segments.
    pub(super) cpu_time: Spread,
    /// Whether `cpu_time`'s 95 % interval is within ±1 % of its median.
    pub(super) resolved_to_1pct: bool,
    pub(super) target: Option<f64>,
}

/// What the paired rounds found.
pub(super) struct Paired {
    pub workloads: Vec<Workload>,
    /// Segments per round of each workload.
    pub segments: Vec<usize>,
    pub rounds: usize,
    pub variants: Vec<PairedVariant>,
    pub ratios: Vec<PairedRatio>,
}

/// The `--alternate` value of a variant.
fn attach(v: Variant) -> &'static str {
    match v {
        Variant::Off => "none",
        Variant::Debug => "in-process",
        Variant::Shim => "environment",
    }
}

/// `ratios[workload]` of the rounds so far: `runs[workload][round]`.
fn ratios(
    workloads: &[Workload],
    prepared: &[Prepared],
    runs: &[Vec<Alternated>],
) -> Vec<PairedRatio> {
    let mut out = Vec::new();
    for (wi, w) in workloads.iter().enumerate() {
        for (vi, p) in prepared.iter().enumerate().skip(1) {
            let clusters: Vec<Vec<f64>> = runs[wi]
                .iter()
                .map(|a| a.cpu_seconds.iter().map(|s| s[vi] / s[0]).collect())
                .collect();
            let cpu_time = Spread::of_clusters(&clusters);
            out.push(PairedRatio {
                pair: format!("{}/off", p.variant.name()),
                workload: w.name,
                label: format!("{}/off, one process", p.variant.name()),
                resolved_to_1pct: cpu_time.values.len() > 1
                    && cpu_time.ci95_half_width() <= RESOLUTION,
                cpu_time,
                target: w
                    .name
                    .starts_with("smollm2")
                    .then(|| p.variant.target())
                    .flatten(),
            });
        }
    }
    out
}

/// One round of `w`: a child process serving `segments` waves per
/// variant, checked to have used each variant's hook target.
fn one_round(
    args: &Args,
    prepared: &[Prepared],
    w: &Workload,
    segments: usize,
) -> anyhow::Result<Alternated> {
    let program = &prepared[0].program;
    let mut env: Vec<(String, OsString)> = prepared
        .iter()
        .flat_map(|p| p.env.iter().cloned())
        .filter(|(k, _)| k == "LD_PRELOAD")
        .collect();
    let threads = args.threads.map_or(1, std::num::NonZeroUsize::get);
    env.push(("KVSAN_THREADS".into(), threads.to_string().into()));
    let alternate: Vec<&str> = prepared.iter().map(|p| attach(p.variant)).collect();
    let mut a = strings(&["bench", "workload", "--alternate"]);
    a.push(alternate.join(","));
    a.extend(["--segments".to_string(), segments.to_string()]);
    a.extend_from_slice(&w.args);
    let done = child::run(program, &a, &env)?;
    let line = done
        .stdout
        .lines()
        .rev()
        .find(|l| l.trim_start().starts_with('{'))
        .with_context(|| format!("the alternating workload printed no JSON: {}", done.stdout))?;
    let got: Alternated = serde_json::from_str(line).context("the alternating workload's JSON")?;
    for (i, p) in prepared.iter().enumerate() {
        let hooks = got.hooks.get(i).map_or("", String::as_str);
        if hooks != p.variant.expected_hooks() {
            bail!(
                "the {} variant's servings ran with hook target `{hooks}`, not `{}`",
                p.variant.name(),
                p.variant.expected_hooks()
            );
        }
        let checks = got.checks.get(i).copied().unwrap_or(0);
        if (p.variant == Variant::Off) != (checks == 0) {
            bail!(
                "the {} variant's servings performed {checks} checks",
                p.variant.name()
            );
        }
    }
    if got.cpu_seconds.len() != segments
        || got
            .cpu_seconds
            .iter()
            .any(|s| s.len() != prepared.len() || s[0] <= 0.0)
    {
        bail!("the alternating workload reported {:?}", got.cpu_seconds);
    }
    Ok(got)
}

/// Rounds of alternated servings: `--rounds` of them, then more while
/// `--budget` lasts and a ratio is not resolved.
pub(super) fn paired(args: &Args, prepared: &[Prepared]) -> anyhow::Result<Paired> {
    if prepared[0].variant != Variant::Off {
        bail!("the paired rounds need the off variant first");
    }
    let started = std::time::Instant::now();
    let (workloads, segments): (Vec<Workload>, Vec<usize>) = workloads(args).into_iter().unzip();
    if segments.iter().any(|&n| n < 2) {
        bail!("--segments must be at least 2: one segment gives no interval within a round");
    }
    let min_rounds = if args.quick { 1 } else { args.rounds };
    let mut runs: Vec<Vec<Alternated>> = vec![Vec::new(); workloads.len()];
    let mut rounds = 0;
    loop {
        if rounds >= min_rounds {
            let unresolved = ratios(&workloads, prepared, &runs)
                .iter()
                .filter(|r| !r.resolved_to_1pct)
                .count();
            if !another_round(args, started, rounds, unresolved, "paired") {
                break;
            }
        }
        rounds += 1;
        for (wi, w) in workloads.iter().enumerate() {
            let n = segments[wi];
            let got = one_round(args, prepared, w, n)
                .with_context(|| format!("paired round {rounds} on {}", w.name))?;
            let line: Vec<String> = (1..prepared.len())
                .map(|vi| {
                    let mut r: Vec<f64> = got.cpu_seconds.iter().map(|s| s[vi] / s[0]).collect();
                    r.sort_by(f64::total_cmp);
                    format!("{}/off {:.3}", prepared[vi].variant.name(), median(&r))
                })
                .collect();
            eprintln!(
                "kvsan bench: paired round {rounds:<3} {:<18} {n} segments, median {}",
                w.name,
                line.join(", ")
            );
            runs[wi].push(got);
        }
    }
    let ratios = ratios(&workloads, prepared, &runs);
    let mut variants = Vec::new();
    for (wi, w) in workloads.iter().enumerate() {
        for (vi, p) in prepared.iter().enumerate() {
            let per_round: Vec<Vec<f64>> = runs[wi]
                .iter()
                .map(|a| a.cpu_seconds.iter().map(|s| s[vi]).collect())
                .collect();
            let mut all: Vec<f64> = per_round.iter().flatten().copied().collect();
            all.sort_by(f64::total_cmp);
            variants.push(PairedVariant {
                name: p.variant.name(),
                workload: w.name,
                cpu_seconds: median(&all),
                checks: runs[wi].iter().map(|a| a.checks[vi]).sum(),
                rounds: per_round,
            });
        }
    }
    Ok(Paired {
        workloads,
        segments,
        rounds,
        variants,
        ratios,
    })
}

/// The paired rounds' table.
pub(super) fn table(p: &Paired) -> String {
    let mut t = String::new();
    let per_round: Vec<String> = p
        .workloads
        .iter()
        .zip(&p.segments)
        .map(|(w, n)| format!("{} {n}", w.name))
        .collect();
    let _ = writeln!(
        t,
        "\nCPU time, variants alternated in one process ({} round(s); segments per round: {}): median serving of a wave, checks",
        p.rounds,
        per_round.join(", ")
    );
    for v in &p.variants {
        let _ = writeln!(
            t,
            "{:<18} {:<6} {:>9.3} CPU s {:>12} checks",
            v.workload, v.name, v.cpu_seconds, v.checks
        );
    }
    for r in &p.ratios {
        let s = &r.cpu_time;
        let _ = writeln!(
            t,
            "{:<18} {:<10} CPU time {:.3} [{:.3}, {:.3}]  ±1 %: {}{}",
            r.workload,
            r.pair,
            s.median,
            s.ci95[0],
            s.ci95[1],
            if r.resolved_to_1pct { "yes" } else { "no" },
            r.target
                .map_or(String::new(), |t| format!("  (target ≤{t:.2})"))
        );
    }
    t
}
