//! The engine flags `generate` and `serve` share: pool sizes, page size,
//! step limits, `--inject` (fault injection, builds with `faults`) and
//! `--anomaly`.

use anyhow::Context;
use kvsan_engine::anomaly::AnomalyAction;
use kvsan_engine::engine::EngineConfig;
use kvsan_engine::faults::{self, Fault};
use kvsan_engine::hooks::Hooks;
use kvsan_engine::model::AttentionCheck;
use kvsan_engine::scheduler::SchedulerConfig;

/// Engine flags.
#[derive(clap::Args, Debug, Clone)]
pub struct EngineArgs {
    /// Token slots per KV page (equal on prefill and decode nodes).
    #[arg(long, default_value_t = 16)]
    pub page_slots: usize,
    /// Context window served (default: the model's).
    #[arg(long)]
    pub context: Option<usize>,
    /// Tokens of the unified node's KV pool (default: one full context).
    #[arg(long)]
    pub pool_tokens: Option<usize>,
    /// Tokens of the prefill node's KV pool (default: one full context).
    #[arg(long)]
    pub prefill_pool_tokens: Option<usize>,
    /// Tokens of the decode node's KV pool (default: one full context).
    #[arg(long)]
    pub decode_pool_tokens: Option<usize>,
    /// Start even when a pool cannot hold one full-context request; such
    /// requests are rejected one by one, naming the pool's limit.
    #[arg(long)]
    pub allow_pool_smaller_than_context: bool,
    /// Tokens computed per step at most (decode tokens and prefill chunks).
    #[arg(long, default_value_t = SchedulerConfig::default().step_tokens)]
    pub step_tokens: usize,
    /// Requests running at once at most, per node.
    #[arg(long, default_value_t = SchedulerConfig::default().max_running)]
    pub max_running: usize,
    /// Inject faults (comma-separated or repeated; replaces `KVSAN_FAULTS`).
    /// Only builds with `--features faults` have the fail points.
    #[arg(long, value_name = "FAULT", value_delimiter = ',', value_parser = parse_fault)]
    pub inject: Vec<Fault>,
    /// What the anomaly monitor does with a request whose first token came
    /// with KV for fewer positions than its prompt, or far faster per
    /// prompt token than the node computes: count and log it, or also
    /// abort it.
    #[arg(long, value_enum, default_value_t = Anomaly::Log)]
    pub anomaly: Anomaly,
}

/// `--anomaly`.
#[derive(clap::ValueEnum, Clone, Copy, Debug, PartialEq, Eq)]
pub enum Anomaly {
    /// Count (`kvsan:anomalies_total`) and log the request; it goes on.
    Log,
    /// Count, log, and end the request with an `anomaly` error before its
    /// first token leaves.
    Abort,
}

impl EngineArgs {
    /// The engine configuration, with the process's hooks (refusing to start
    /// on a bad `KVSAN_OPTIONS` in a debug build) and the injected faults
    /// switched on.
    ///
    /// # Errors
    /// A bad `KVSAN_OPTIONS`, or `--inject` in a build without fail points.
    pub fn config(&self) -> anyhow::Result<EngineConfig> {
        if !self.inject.is_empty() {
            faults::set(&self.inject).map_err(anyhow::Error::msg)?;
            let names: Vec<&str> = self.inject.iter().map(|f| f.name()).collect();
            eprintln!("kvsan: injecting faults: {}", names.join(","));
        }
        let hooks = Hooks::from_environment().context("the sanitizer cannot start")?;
        let check = if hooks.is_attached() {
            AttentionCheck::Generations
        } else {
            AttentionCheck::Unchecked
        };
        Ok(EngineConfig {
            page_slots: self.page_slots,
            context: self.context,
            pool_tokens: self.pool_tokens,
            prefill_pool_tokens: self.prefill_pool_tokens,
            decode_pool_tokens: self.decode_pool_tokens,
            allow_pool_smaller_than_context: self.allow_pool_smaller_than_context,
            scheduler: SchedulerConfig {
                step_tokens: self.step_tokens,
                max_running: self.max_running,
            },
            check,
            hooks,
            anomaly: match self.anomaly {
                Anomaly::Log => AnomalyAction::Log,
                Anomaly::Abort => AnomalyAction::Abort,
            },
        })
    }
}

/// One fault name (clap value parser).
///
/// # Errors
/// The unknown name, with the known ones.
pub fn parse_fault(name: &str) -> Result<Fault, String> {
    let mut list = faults::parse(name)?;
    match (list.pop(), list.is_empty()) {
        (Some(f), true) => Ok(f),
        _ => Err(format!("expected one fault name, got '{name}'")),
    }
}
