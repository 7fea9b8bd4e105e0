//! The engine flags `generate` and `serve` share: pool sizes, page size,
//! step limits, `--prefix-cache`, `--inject` (fault injection, builds with
//! `faults`) and `--anomaly`.
//!
//! The prefix cache's policy is also the sanitizer's rule for shares:
//!
//! ```text
//!  hook target            what checks each share                  --prefix-cache salt|global
//!  in-process sanitizer   KVSAN_OPTIONS' prefix_share             without prefix_share in KVSAN_OPTIONS:
//!  (feature `sanitize`)   (default tenant)                        the engine's policy (said at start)
//!  preloaded shim         the library's own KVSAN_OPTIONS         a note at start: set prefix_share to match
//! ```

use anyhow::Context;
use kvsan_engine::anomaly::AnomalyAction;
use kvsan_engine::engine::EngineConfig;
use kvsan_engine::faults::{self, Fault};
use kvsan_engine::hooks::{HookTarget, Hooks};
use kvsan_engine::model::AttentionCheck;
use kvsan_engine::prefix_cache::PrefixCachePolicy;
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
    /// Which requests may share the prompt pages the prefix cache keeps
    /// (nodes that compute prompts: unified, prefill). `tenant` (the
    /// default): one API key's tenant, and one cache salt when salted;
    /// `salt`: one cache salt across tenants (unsalted requests share among
    /// themselves, as in vLLM); `global`: every request — another tenant's
    /// prompt then shows in time to first token and `cached_tokens`;
    /// `off`: no cache.
    #[arg(long, value_name = "POLICY", value_parser = prefix_cache_parser())]
    pub prefix_cache: Option<PrefixCachePolicy>,
    /// Bytes of host memory per node for the KV of preempted requests: their
    /// pages go there and come back when they run again, instead of being
    /// recomputed (0, the default: recompute). Whole pages; the sanitizer
    /// checks each store and load.
    #[arg(long, value_name = "BYTES", default_value_t = 0)]
    pub kv_offload_host_bytes: usize,
    /// A directory for each node's disk KV tier (one file per node, removed
    /// when it stops): the prefix cache's evicted pages go there and come
    /// back on a hit, and preempted requests' pages when the host tier is
    /// full. Needs --kv-offload-disk-bytes.
    #[arg(long, value_name = "DIR", requires = "kv_offload_disk_bytes")]
    pub kv_offload_dir: Option<std::path::PathBuf>,
    /// Bytes of each node's disk KV tier file (whole pages).
    #[arg(long, value_name = "BYTES", requires = "kv_offload_dir")]
    pub kv_offload_disk_bytes: Option<usize>,
}

/// The policy without `--prefix-cache`.
pub const DEFAULT_PREFIX_CACHE: PrefixCachePolicy = PrefixCachePolicy::Tenant;

/// `--prefix-cache`'s values, listed in `--help` and in the error of a bad one.
fn prefix_cache_parser() -> impl clap::builder::TypedValueParser<Value = PrefixCachePolicy> {
    use clap::builder::TypedValueParser;
    clap::builder::PossibleValuesParser::new(PrefixCachePolicy::ALL.map(PrefixCachePolicy::name))
        .map(|name| {
            name.parse::<PrefixCachePolicy>()
                .expect("a possible value is a policy's name")
        })
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
    /// on a bad `KVSAN_OPTIONS` in a debug build; the in-process sanitizer
    /// checking shares as the module's table says) and the injected faults
    /// switched on. Says at start what `--prefix-cache global` opens and
    /// which rule a sanitizer checks shares against when it is not the
    /// engine's.
    ///
    /// # Errors
    /// A bad `KVSAN_OPTIONS`, or `--inject` in a build without fail points.
    pub fn config(&self) -> anyhow::Result<EngineConfig> {
        if !self.inject.is_empty() {
            faults::set(&self.inject).map_err(anyhow::Error::msg)?;
            let names: Vec<&str> = self.inject.iter().map(|f| f.name()).collect();
            eprintln!("kvsan: injecting faults: {}", names.join(","));
        }
        let prefix_cache = self.prefix_cache();
        let hooks = hooks_for(prefix_cache)?;
        say_prefix_cache(prefix_cache, &hooks);
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
                chunk_tokens: None,
            },
            check,
            hooks,
            anomaly: match self.anomaly {
                Anomaly::Log => AnomalyAction::Log,
                Anomaly::Abort => AnomalyAction::Abort,
            },
            prefix_cache,
            kv_offload_host_bytes: self.kv_offload_host_bytes,
            kv_offload_dir: self.kv_offload_dir.clone(),
            kv_offload_disk_bytes: self.kv_offload_disk_bytes.unwrap_or(0),
        })
    }

    /// The prefix-cache policy: `--prefix-cache`, else [`DEFAULT_PREFIX_CACHE`].
    #[must_use]
    pub fn prefix_cache(&self) -> PrefixCachePolicy {
        self.prefix_cache.unwrap_or(DEFAULT_PREFIX_CACHE)
    }
}

/// Whether the sanitizer's default rule for shares (`prefix_share=tenant`)
/// would report the legal shares of `policy`: `salt` and `global` share
/// across tenants; `tenant` is the rule itself and `off` shares nothing.
fn shares_across_tenants(policy: PrefixCachePolicy) -> bool {
    matches!(policy, PrefixCachePolicy::Salt | PrefixCachePolicy::Global)
}

/// The `prefix_share` that `KVSAN_OPTIONS` sets, if it sets one (the last
/// item wins, as in [`Options::parse`]).
fn prefix_share_in_options() -> Option<String> {
    let text = std::env::var(kvsan_sanitizer::options::OPTIONS_ENV).ok()?;
    text.split(':')
        .filter_map(|item| item.split_once('='))
        .filter(|(key, _)| key.trim() == "prefix_share")
        .map(|(_, value)| value.trim().to_string())
        .next_back()
}

/// The process's hook target ([`Hooks::from_environment_with`]): an
/// in-process sanitizer checks shares against the engine's `policy` when
/// the policy shares across tenants and `KVSAN_OPTIONS` sets no
/// `prefix_share` (otherwise every legal cross-tenant share would be
/// reported); a `prefix_share` the operator sets wins.
///
/// # Errors
/// A bad `KVSAN_OPTIONS`, or a report log file that cannot be opened.
fn hooks_for(policy: PrefixCachePolicy) -> anyhow::Result<Hooks> {
    let defaults = if shares_across_tenants(policy) {
        format!("prefix_share={}", policy.share_option())
    } else {
        String::new()
    };
    Hooks::from_environment_with(&defaults).context("the sanitizer cannot start")
}

/// What the operator is told at start about the prefix cache: `global`'s
/// side channel, and which rule the sanitizer checks shares against when
/// it is not the engine's own.
fn say_prefix_cache(policy: PrefixCachePolicy, hooks: &Hooks) {
    if policy == PrefixCachePolicy::Global {
        let warning = "--prefix-cache global: every request may share another tenant's cached prompt pages, so prompts become observable across tenants through time to first token and usage.prompt_tokens_details.cached_tokens (the prompt-caching side channel); use tenant (the default) or salt to keep tenants apart";
        eprintln!("kvsan: WARNING: {warning}");
        tracing::warn!("{warning}");
    }
    let explicit = prefix_share_in_options();
    let note = match (hooks.target(), explicit.as_deref()) {
        (HookTarget::InProcess, Some(share)) if share != policy.share_option() => Some(format!(
            "the in-process sanitizer checks shares against KVSAN_OPTIONS' prefix_share={share}, not --prefix-cache {policy}"
        )),
        (HookTarget::InProcess, None) if shares_across_tenants(policy) => Some(format!(
            "the in-process sanitizer checks shares against --prefix-cache {policy} (prefix_share={policy}; KVSAN_OPTIONS sets none)"
        )),
        (HookTarget::CTable, share) if shares_across_tenants(policy) => Some(match share {
            Some(s) if s == policy.share_option() => format!(
                "the preloaded sanitizer checks shares against its KVSAN_OPTIONS' prefix_share={s}, as --prefix-cache {policy} shares"
            ),
            Some(s) => format!(
                "the preloaded sanitizer checks shares against its KVSAN_OPTIONS' prefix_share={s}, not --prefix-cache {policy}: set prefix_share={policy} to match"
            ),
            None => format!(
                "the preloaded sanitizer checks shares against its KVSAN_OPTIONS' prefix_share, not set (tenant): --prefix-cache {policy}'s cross-tenant shares will be reported; set prefix_share={policy} to match"
            ),
        }),
        _ => None,
    };
    if let Some(note) = note {
        eprintln!("kvsan: {note}");
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
