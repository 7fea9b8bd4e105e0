//! `kvsan replay fault NAME`: one fault's leak-oracle scenario, run once in
//! this process with the hooks it chose at start-up. Running it with two
//! victim seeds shows whether the probe's outcome depends on the victim
//! (a leak); running it under a sanitizer shows the abort.

#[cfg(feature = "faults")]
pub use self::scenario::run;
use kvsan_engine::faults::Fault;

#[cfg(not(feature = "faults"))]
/// Refuses to run: the scenarios, like the fail points they switch on,
/// are only in builds with `--features faults`.
pub fn run(args: &Args, _json: bool) -> anyhow::Result<()> {
    anyhow::bail!(
        "kvsan replay fault {}: this kvsan was built without fault injection; \
         rebuild with `--features faults`",
        args.fault.name()
    )
}

/// Arguments of `kvsan replay fault`.
#[derive(clap::Args, Debug)]
pub struct Args {
    /// The fault (see `kvsan_engine::faults`; e.g. `reject-as-placeholder`).
    #[arg(value_parser = super::engine_args::parse_fault)]
    pub fault: Fault,
    /// Chooses the victim's prompt: runs with different seeds differ only
    /// in tenant A's data.
    #[arg(long, default_value_t = 1)]
    pub seed: u32,
    /// Runs the scenario with the fault off (the correct engine).
    #[arg(long)]
    pub no_inject: bool,
}

#[cfg(feature = "faults")]
mod scenario {
    use std::io::Write;

    use kvsan_engine::engine::Output;
    use kvsan_engine::hooks::Hooks;
    use kvsan_engine::model::AttentionCheck;
    use kvsan_engine::request::RequestError;
    use kvsan_engine::scenario::{Scenario, scenario_model};
    use serde_json::{Value, json};

    use super::Args;

    /// One request's outcome as JSON: its tokens, or its error's kind,
    /// violation and rejection limit. Never prompt text.
    fn outcome(r: &Result<Output, RequestError>) -> Value {
        match r {
            Ok(out) => json!({
                "outcome": "finished",
                "tokens": out.tokens,
                "cached_tokens": out.cached_tokens,
            }),
            Err(e) => json!({
                "outcome": "error",
                "error_kind": e.kind.name(),
                "violation_id": e.violation.map(|v| v.id.to_string()),
                "violation_kind": e.violation.map(|v| v.kind.name()),
                "rejection_limit": e.rejection.as_ref().map(|r| r.limit),
                "message": e.message,
            }),
        }
    }

    fn describe(r: &Result<Output, RequestError>) -> String {
        let cached = |out: &Output| match out.cached_tokens {
            0 => String::new(),
            n => format!(" ({n} prompt tokens from the prefix cache)"),
        };
        match r {
            Ok(out) if out.tokens.len() > 16 => format!(
                "finished, {} tokens {:?} …{}",
                out.tokens.len(),
                &out.tokens[..16],
                cached(out)
            ),
            Ok(out) => format!("finished, tokens {:?}{}", out.tokens, cached(out)),
            Err(e) => e.to_string(),
        }
    }

    /// Runs the command.
    pub fn run(args: &Args, json: bool) -> anyhow::Result<()> {
        let hooks = Hooks::from_environment()?;
        let check = if hooks.is_attached() {
            AttentionCheck::Generations
        } else {
            AttentionCheck::Unchecked
        };
        let target = hooks.target().name();
        let scenario = Scenario::of(args.fault);
        let model = scenario_model()?;
        let run = scenario.run(&model, hooks.clone(), check, args.seed, !args.no_inject)?;
        hooks.print_summary();
        let mut out = std::io::stdout().lock();
        if json {
            writeln!(
                out,
                "{}",
                json!({
                    "fault": args.fault.name(),
                    "injected": !args.no_inject,
                    "seed": args.seed,
                    "hooks": target,
                    "expected_violation": scenario.expected.name(),
                    "culprit": scenario.culprit.name(),
                    "victim": outcome(&run.victim),
                    "probe": outcome(&run.probe),
                    "bystander": outcome(&run.bystander),
                })
            )?;
        } else {
            writeln!(
                out,
                "fault {} ({}), victim seed {}, hooks: {target}",
                args.fault.name(),
                if args.no_inject {
                    "not injected"
                } else {
                    "injected"
                },
                args.seed
            )?;
            writeln!(out, "  victim (tenant A):    {}", describe(&run.victim))?;
            writeln!(out, "  probe (tenant B):     {}", describe(&run.probe))?;
            writeln!(out, "  bystander (tenant C): {}", describe(&run.bystander))?;
        }
        Ok(())
    }
}
