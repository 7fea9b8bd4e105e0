//! `kvsan bench`: the whole-engine overhead comparison (`overhead`), the
//! workload it runs in each built variant (`workload`, hidden), the
//! latency floor of `kvsan serve` (`latency`), and the memory of a long
//! run of `kvsan serve` under the shim (`soak`).
//!
//! | file | what lives there |
//! | --- | --- |
//! | `bench/overhead.rs` | the prebuilt variants run interleaved: table, JSON, plot |
//! | `bench/overhead/paired.rs` | the variants alternated inside one process per round |
//! | `bench/workload.rs` | one serving workload, measured from the client's side; or alternated over hook targets |
//! | `bench/child.rs` | a workload run as a child process, its peak RSS from `wait4` |
//! | `bench/kernel.rs` | checked vs unchecked paged attention on CPU |
//! | `bench/latency.rs` | one client, trivial requests through real `kvsan serve` processes |
//! | `bench/soak.rs` | many clients, a mixed load through `kvsan serve` under the shim, its memory sampled |
//! | `bench/server.rs` | a `kvsan serve` child process and an HTTP client of it |
//! | `bench/plot.rs` | the SVGs: ratios with their spread, curves |

mod child;
mod instructions;
mod kernel;
pub mod latency;
pub mod overhead;
mod plot;
mod server;
pub mod soak;
pub mod workload;

/// Arguments of `kvsan bench`.
#[derive(clap::Args, Debug)]
pub struct Args {
    #[command(subcommand)]
    pub what: Bench,
}

/// What to benchmark.
#[derive(clap::Subcommand, Debug)]
pub enum Bench {
    /// The same serving workloads run without the sanitizer, in debug-build
    /// mode and under the LD_PRELOAD shim, interleaved; ratios with spread.
    Overhead(overhead::Args),
    /// The latency floor of `kvsan serve`: one client, trivial requests one
    /// after another through real processes on loopback, beside the engine
    /// alone.
    Latency(latency::Args),
    /// Many requests (completions, cancels, rejections) from several
    /// clients through `kvsan serve` under the LD_PRELOAD shim: resident
    /// memory sampled as they go, violations and the sanitizer's tracked
    /// requests checked at the end.
    Soak(soak::Args),
    /// One workload in this process, one JSON object of metrics on stdout.
    #[command(hide = true)]
    Workload(workload::Args),
}

impl Args {
    /// Whether errors are to be printed as JSON.
    pub fn json(&self) -> bool {
        match &self.what {
            Bench::Overhead(a) => a.json,
            Bench::Latency(a) => a.json,
            Bench::Soak(a) => a.json,
            Bench::Workload(_) => true,
        }
    }
}

/// Runs the command.
///
/// # Errors
/// As the subcommand's.
pub fn run(args: &Args) -> anyhow::Result<()> {
    match &args.what {
        Bench::Overhead(a) => overhead::run(a),
        Bench::Latency(a) => latency::run(a),
        Bench::Soak(a) => soak::run(a),
        Bench::Workload(a) => workload::run(a),
    }
}

/// The machine a benchmark ran on: CPU model, cores, load average at start.
pub(crate) fn machine() -> serde_json::Value {
    let cpu = std::fs::read_to_string("/proc/cpuinfo")
        .ok()
        .and_then(|s| {
            s.lines()
                .find(|l| l.starts_with("model name"))
                .and_then(|l| l.split(':').nth(1))
                .map(|m| m.trim().to_string())
        })
        .unwrap_or_else(|| "unknown".into());
    let cores = std::thread::available_parallelism().map_or(0, usize::from);
    let load = std::fs::read_to_string("/proc/loadavg")
        .map(|s| s.split_whitespace().take(3).collect::<Vec<_>>().join(" "))
        .unwrap_or_default();
    serde_json::json!({ "cpu": cpu, "cores": cores, "load_average_at_start": load })
}
