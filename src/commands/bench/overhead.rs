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
//! whose peak RSS comes from `wait4` and whose checks come from the
//! sanitizer's summary line on its stderr (`kvsan: N violations; M checks`).
//! Ratios are per round, so machine drift between rounds cancels.

use std::ffi::OsString;
use std::fmt::Write as _;
use std::path::PathBuf;

use anyhow::{Context, bail};
use serde::Serialize;
use serde_json::json;

use super::child;
use super::kernel::{self, KernelCheck, Spread, median};
use super::plot;
use super::workload::Measured;

/// Arguments of `kvsan bench overhead`.
#[derive(clap::Args, Debug)]
pub struct Args {
    /// Measured rounds after the warm-up (each runs every variant once per workload).
    #[arg(long, default_value_t = 5)]
    pub rounds: usize,
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
    warmup_args: Vec<String>,
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
    /// The target for the tokens/s ratio, where the issue sets one (SmolLM2 mix).
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
        prepared.push(Prepared {
            variant,
            program,
            attach,
            env,
        });
    }
    Ok(prepared)
}

fn workloads(args: &Args) -> Vec<Workload> {
    let s = |v: &[&str]| v.iter().map(ToString::to_string).collect::<Vec<_>>();
    let synthetic = |topology: &'static str, name: &'static str| Workload {
        name,
        model: "synthetic (2 layers, width 32, 2 heads / 1 KV head, FFN 64)",
        topology,
        args: s(&[
            "--model-kind",
            "synthetic",
            "--topology",
            topology,
            "--requests",
            "64",
        ]),
        warmup_args: s(&[
            "--model-kind",
            "synthetic",
            "--topology",
            topology,
            "--requests",
            "8",
        ]),
    };
    if args.quick {
        return vec![synthetic("unified", "synthetic-unified")];
    }
    let requests = args.requests.to_string();
    let smollm2 = |topology: &'static str, name: &'static str| {
        let mut a = s(&["--model-kind", "smollm2", "--topology", topology]);
        if let Some(m) = &args.model {
            a.push("--model".into());
            a.push(m.display().to_string());
        }
        // Warm-up: load the model into the page cache, start the threads.
        let mut warm = a.clone();
        warm.extend(s(&["--requests", "2"]));
        a.extend(["--requests".to_string(), requests.clone()]);
        Workload {
            name,
            model: "SmolLM2-135M Q4_1",
            topology,
            args: a,
            warmup_args: warm,
        }
    };
    vec![
        smollm2("unified", "smollm2-unified"),
        smollm2("disagg", "smollm2-disagg"),
        synthetic("unified", "synthetic-unified"),
        synthetic("disagg", "synthetic-disagg"),
    ]
}

/// Runs one workload under one variant.
fn run_one(p: &Prepared, workload_args: &[String]) -> anyhow::Result<Run> {
    let mut a = vec![
        "bench".to_string(),
        "workload".to_string(),
        "--attach".to_string(),
        p.attach.to_string(),
    ];
    a.extend_from_slice(workload_args);
    let done = child::run(&p.program, &a, &p.env)?;
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
        "{:<18} {:<6} {:>10} {:>10} {:>10} {:>10} {:>11} {:>12}",
        "workload", "variant", "tokens/s", "TTFT p50", "TTFT p99", "TPOT p50", "peak RSS", "checks"
    );
    for v in variants {
        let _ = writeln!(
            t,
            "{:<18} {:<6} {:>10.1} {:>8.1}ms {:>8.1}ms {:>8.2}ms {:>11} {:>12}",
            v.workload,
            v.name,
            v.tokens_per_s,
            v.ttft_p50_ms,
            v.ttft_p99_ms,
            v.tpot_p50_ms,
            fmt_bytes(v.peak_rss_bytes),
            v.checks
        );
    }
    let _ = writeln!(
        t,
        "\nratios to off over {rounds} round(s), min / median / max (tokens/s: off ÷ variant, above 1 is slower):"
    );
    let _ = writeln!(
        t,
        "{:<18} {:<10} {:>26} {:>26} {:>26} {:>7}",
        "workload", "pair", "tokens/s (time)", "TTFT p50", "TPOT p50", "target"
    );
    let spread = |s: &Spread| format!("{:.3} / {:.3} / {:.3}", s.min, s.median, s.max);
    for r in ratios {
        let _ = writeln!(
            t,
            "{:<18} {:<10} {:>26} {:>26} {:>26} {:>7}",
            r.workload,
            r.pair,
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

/// Runs the command.
///
/// # Errors
/// A build that fails, a workload that fails or runs under the wrong hook
/// target, or output that cannot be written.
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
    let workloads = workloads(args);
    let rounds = if args.quick { 1 } else { args.rounds };

    if !args.quick {
        eprintln!("kvsan bench: warm-up round");
        for w in &workloads {
            for p in &prepared {
                run_one(p, &w.warmup_args)
                    .with_context(|| format!("warm-up of {} on {}", p.variant.name(), w.name))?;
            }
        }
    }
    // runs[workload][variant][round]
    let mut runs: Vec<Vec<Vec<Run>>> = vec![vec![Vec::new(); prepared.len()]; workloads.len()];
    for round in 0..rounds {
        for (wi, w) in workloads.iter().enumerate() {
            for (vi, p) in prepared.iter().enumerate() {
                let r = run_one(p, &w.args).with_context(|| {
                    format!("round {} of {} on {}", round + 1, p.variant.name(), w.name)
                })?;
                eprintln!(
                    "kvsan bench: round {}/{rounds} {:<18} {:<5} {:>9.1} tokens/s  {:>6.1} s  {} checks",
                    round + 1,
                    w.name,
                    p.variant.name(),
                    r.tokens_per_s,
                    r.seconds,
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

    let mut variant_reports = Vec::new();
    let mut ratio_reports = Vec::new();
    for (wi, w) in workloads.iter().enumerate() {
        let off = &runs[wi][0];
        for (vi, p) in prepared.iter().enumerate() {
            if vi > 0 {
                let v = &runs[wi][vi];
                ratio_reports.push(RatioReport {
                    pair: format!("{}/off", p.variant.name()),
                    workload: w.name,
                    tokens_per_s: ratio(off, v, |o, v| o.tokens_per_s / v.tokens_per_s),
                    ttft_p50: ratio(off, v, |o, v| v.ttft_p50_ms / o.ttft_p50_ms),
                    tpot_p50: ratio(off, v, |o, v| v.tpot_p50_ms / o.tpot_p50_ms),
                    target: if w.name.starts_with("smollm2") {
                        p.variant.target()
                    } else {
                        None
                    },
                });
            }
            variant_reports.push(report_variant(
                p.variant.name(),
                w.name,
                runs[wi][vi].clone(),
            ));
        }
    }

    let out_dir = args
        .out
        .clone()
        .unwrap_or_else(|| PathBuf::from("target").join("bench"));
    std::fs::create_dir_all(&out_dir).with_context(|| format!("creating {}", out_dir.display()))?;
    let json_path = out_dir.join("overhead.json");
    let svg_path = out_dir.join("overhead.svg");
    let doc = json!({
        "machine": super::machine(),
        "rounds": rounds,
        "quick": args.quick,
        "workloads": workloads.iter().map(|w| json!({
            "name": w.name,
            "model": w.model,
            "topology": w.topology,
            "args": w.args,
        })).collect::<Vec<_>>(),
        "variants": variant_reports,
        "ratios": ratio_reports,
        "kernel_check": kernel,
        "json": json_path,
        "plot": svg_path,
    });
    let text = serde_json::to_string_pretty(&doc)?;
    std::fs::write(&json_path, format!("{text}\n"))
        .with_context(|| format!("writing {}", json_path.display()))?;
    let columns: Vec<plot::Column<'_>> = ratio_reports
        .iter()
        .map(|r| plot::Column {
            workload: r.workload,
            pair: &r.pair,
            min: r.tokens_per_s.min,
            median: r.tokens_per_s.median,
            max: r.tokens_per_s.max,
            target: r.target,
        })
        .collect();
    let title = format!("kvsan overhead: time ratio to the unsanitized build, {rounds} round(s)");
    std::fs::write(&svg_path, plot::svg(&title, &columns))
        .with_context(|| format!("writing {}", svg_path.display()))?;

    let t = table(&variant_reports, &ratio_reports, &kernel, rounds);
    if args.json {
        eprint!("{t}");
        println!("{}", serde_json::to_string(&doc)?);
    } else {
        print!("{t}");
        println!("\nwrote {} and {}", json_path.display(), svg_path.display());
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
