//! `kvsan bench`: the whole-engine overhead comparison (`overhead`) and the
//! workload it runs in each built variant (`workload`, hidden).
//!
//! | file | what lives there |
//! | --- | --- |
//! | `bench/overhead.rs` | builds the variants, interleaves the rounds, table, JSON, plot |
//! | `bench/workload.rs` | one serving workload, measured from the client's side |
//! | `bench/child.rs` | a workload run as a child process, its peak RSS from `wait4` |
//! | `bench/kernel.rs` | checked vs unchecked paged attention on CPU |
//! | `bench/plot.rs` | the SVG of the ratios and their spread |

mod child;
mod kernel;
pub mod overhead;
mod plot;
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
    /// One workload in this process, one JSON object of metrics on stdout.
    #[command(hide = true)]
    Workload(workload::Args),
}

impl Args {
    /// Whether errors are to be printed as JSON.
    pub fn json(&self) -> bool {
        match &self.what {
            Bench::Overhead(a) => a.json,
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
        Bench::Workload(a) => workload::run(a),
    }
}
