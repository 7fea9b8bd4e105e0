//! `kvsan`: the command-line interface.

use clap::Parser;

/// kvsan — a KV-cache memory sanitizer for LLM inference engines.
#[derive(Parser, Debug)]
#[command(name = "kvsan", version, about, long_about = None)]
struct Cli {}

fn main() {
    let _cli = Cli::parse();
}
