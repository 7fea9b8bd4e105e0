//! `kvsan`: the command-line interface.

mod commands;
#[cfg(test)]
mod docs_commands;
mod output;

use std::process::ExitCode;

use clap::{Parser, Subcommand};

/// kvsan — a KV-cache memory sanitizer for LLM inference engines, and the
/// engine it wraps.
#[derive(Parser, Debug)]
#[command(name = "kvsan", version, about, long_about = None)]
struct Cli {
    #[command(subcommand)]
    command: Command,
}

#[derive(Subcommand, Debug)]
enum Command {
    /// Generate a completion for a prompt.
    Generate(commands::generate::Args),
    /// Print the token ids of a text.
    Tokenize(commands::tokenize::Args),
    /// Serve requests as a unified, prefill, decode or disaggregated node.
    Serve(commands::serve::Args),
    /// Replay a known leak in the real engine: without the sanitizer, with
    /// it, and with the bug fixed (needs a build with `--features faults`).
    Replay(commands::replay::Args),
    /// Measure the sanitizer's overhead on the whole engine.
    Bench(commands::bench::Args),
    /// Audit an OpenAI-compatible server from outside for cross-request
    /// leaks, limits that are not enforced and a prefix cache shared across
    /// keys. Exit status: 0 nothing found, 1 findings, 2 the audit could
    /// not run.
    Audit(commands::audit::Args),
}

/// `kvsan audit`'s exit status, like a linter's: 0 nothing found, 1
/// findings, 2 the audit could not run.
fn audit(args: &commands::audit::Args) -> ExitCode {
    match commands::audit::run(args) {
        Ok(commands::audit::Outcome::Clean) => ExitCode::SUCCESS,
        Ok(commands::audit::Outcome::Findings) => ExitCode::from(1),
        Ok(commands::audit::Outcome::Incomplete) => ExitCode::from(2),
        Err(err) => {
            output::print_error(&err, args.json);
            ExitCode::from(2)
        }
    }
}

fn main() -> ExitCode {
    let cli = Cli::parse();
    let (json, result) = match cli.command {
        Command::Generate(args) => (args.json, commands::generate::run(&args)),
        Command::Tokenize(args) => (args.json, commands::tokenize::run(&args)),
        Command::Serve(args) => (false, commands::serve::run(&args)),
        Command::Replay(args) => (args.json, commands::replay::run(&args)),
        Command::Bench(args) => (args.json(), commands::bench::run(&args)),
        Command::Audit(args) => return audit(&args),
    };
    match result {
        Ok(()) => ExitCode::SUCCESS,
        Err(err) => {
            output::print_error(&err, json);
            ExitCode::FAILURE
        }
    }
}
