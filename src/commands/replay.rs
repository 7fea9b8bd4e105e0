//! `kvsan replay incident`: the 2026 cross-tenant KV leak, re-created at
//! small scale in the real engine (SmolLM2, disaggregated), three times:
//!
//! 1. `unsanitized` — the `reject-as-placeholder` fault, no sanitizer: tenant
//!    B's oversize prompt is rejected into a one-token placeholder, admitted
//!    anyway, and decode attends over pages still holding tenant A's KV.
//!    The leak is established by noninterference (B's output changes when
//!    only A's secret changes) and by looking for A's secret in B's output.
//! 2. `sanitized` — the same fault with the sanitizer attached: B is aborted,
//!    the report names the cause.
//! 3. `fault-off` — a correct engine: B is cleanly rejected.

use std::io::Write;
use std::path::PathBuf;
use std::sync::Arc;

use anyhow::Context;
use kvsan_engine::engine::{Engine, EngineConfig};
use kvsan_engine::faults::{self, Fault};
use kvsan_engine::hooks::Hooks;
use kvsan_engine::model::{AttentionCheck, Model};
use kvsan_engine::request::{Request, RequestError};
use kvsan_engine::sampler::SamplingParams;
use kvsan_engine::tokenizer::Tokenizer;
use kvsan_sanitizer::{Options, ReportBuffer, Sanitizer, TenantId};
use serde_json::json;

use super::model_arg;

/// Arguments of `kvsan replay`.
#[derive(clap::Args, Debug)]
pub struct Args {
    /// What to replay.
    #[command(subcommand)]
    pub what: Replay,
    /// Print one JSON object per run, one per line.
    #[arg(long, global = true)]
    pub json: bool,
}

/// A replayable leak.
#[derive(clap::Subcommand, Debug)]
pub enum Replay {
    /// The reject-as-placeholder leak in disaggregated serving, on SmolLM2:
    /// without the sanitizer, with it, and with the bug fixed.
    Incident {
        /// GGUF model file (default: SmolLM2-135M-Instruct Q4_1, fetched on first use).
        #[arg(long)]
        model: Option<PathBuf>,
    },
    /// One fault's leak-oracle scenario (victim of tenant A, probe of tenant
    /// B, bystander of tenant C) on the synthetic model, once, with the
    /// hooks this process chose (none in a release build, the in-process
    /// sanitizer with `--features sanitize`, the shim's under `LD_PRELOAD`).
    Fault(super::fault::Args),
}

/// The deployment of the replay: context 8,192, prefill pool 1,024 tokens,
/// decode pool 8,192.
const CONTEXT: usize = 8192;
const PREFILL_POOL: usize = 1024;
const DECODE_POOL: usize = 8192;
/// Tenant B's prompt length: over the prefill pool.
const PROBE_TOKENS: usize = 1100;
/// Tokens generated for tenant B.
const PROBE_NEW_TOKENS: usize = 24;

/// Made-up secrets: the unsanitized run is done once with each, so that only
/// tenant A's data differs between the two.
const SECRETS: [&str; 2] = ["ZEBRA-7431", "MANGO-2290"];

struct Scenario {
    model: Arc<Model>,
    tokenizer: Tokenizer,
    probe: Vec<u32>,
}

/// What tenant B got in one run.
struct Outcome {
    text: Option<String>,
    error: Option<RequestError>,
}

impl Scenario {
    /// Tenant A's long prompt holding `secret`, as many whole sentences as
    /// fit in the prefill pool (with room for its answer).
    fn victim(&self, secret: &str) -> anyhow::Result<Vec<u32>> {
        let sentence = format!("The vault access code is {secret}. ");
        let mut text = String::new();
        let mut ids = Vec::new();
        loop {
            text.push_str(&sentence);
            let next = self.tokenizer.encode(&text)?;
            if next.len() > PREFILL_POOL - 64 {
                break;
            }
            ids = next;
        }
        Ok(ids)
    }

    /// A runs, then B; returns B's outcome.
    fn run(&self, secret: &str, fault: bool, hooks: Hooks) -> anyhow::Result<Outcome> {
        faults::set(if fault {
            &[Fault::RejectAsPlaceholder]
        } else {
            &[]
        })
        .map_err(anyhow::Error::msg)?;
        let check = if hooks.is_attached() {
            AttentionCheck::Generations
        } else {
            AttentionCheck::Unchecked
        };
        let cfg = EngineConfig {
            context: Some(CONTEXT),
            prefill_pool_tokens: Some(PREFILL_POOL),
            decode_pool_tokens: Some(DECODE_POOL),
            allow_pool_smaller_than_context: true,
            check,
            hooks,
            ..EngineConfig::default()
        };
        let engine = Engine::disaggregated(self.model.clone(), &cfg)?;
        let greedy = |tenant, prompt, max_tokens| Request {
            tenant: TenantId(tenant),
            prompt,
            max_tokens,
            sampling: SamplingParams::greedy(),
            stop_tokens: self.tokenizer.eos_id().into_iter().collect(),
            cache_salt: Default::default(),
        };
        // Tenant A's prompt and answer fill at least the pages tenant B's
        // reservation will take back (the free list is a stack).
        let victim = self.victim(secret)?;
        let answer = PROBE_TOKENS.saturating_sub(victim.len()) + 16;
        let mut a = greedy(1, victim, answer);
        a.stop_tokens.clear();
        engine
            .submit(a)
            .wait()
            .map_err(|e| anyhow::anyhow!("tenant A's request failed: {e}"))?;
        let b = engine
            .submit(greedy(2, self.probe.clone(), PROBE_NEW_TOKENS))
            .wait();
        faults::set(&[]).map_err(anyhow::Error::msg)?;
        Ok(match b {
            Ok(out) => Outcome {
                text: Some(self.tokenizer.decode(&out.tokens)),
                error: None,
            },
            Err(e) => Outcome {
                text: None,
                error: Some(e),
            },
        })
    }
}

/// Runs the command.
pub fn run(args: &Args) -> anyhow::Result<()> {
    match &args.what {
        Replay::Incident { model } => incident(model.as_deref(), args.json),
        Replay::Fault(fault) => super::fault::run(fault, args.json),
    }
}

fn incident(model: Option<&std::path::Path>, json: bool) -> anyhow::Result<()> {
    faults::set(&[]).map_err(anyhow::Error::msg)?;
    let path = model_arg::resolve(model)?;
    let model = Arc::new(Model::load(&path)?);
    let gguf = model
        .weights()
        .file()
        .context("the model has no GGUF file")?;
    let tokenizer = Tokenizer::from_gguf(gguf)?;
    let filler = "Write a short story about a lighthouse keeper and the sea. ";
    let mut probe = Vec::new();
    while probe.len() < PROBE_TOKENS {
        probe.extend(tokenizer.encode(filler)?);
    }
    probe.truncate(PROBE_TOKENS);
    let scenario = Scenario {
        model,
        tokenizer,
        probe,
    };
    let mut out = std::io::stdout().lock();

    if !json {
        writeln!(
            out,
            "kvsan replay incident: disaggregated SmolLM2, context {CONTEXT}, prefill pool {PREFILL_POOL} tokens, \
             decode pool {DECODE_POOL}; tenant A sends a long prompt holding a made-up secret, tenant B a \
             {PROBE_TOKENS}-token prompt\n"
        )?;
    }

    // 1. Unsanitized, twice: only tenant A's secret differs.
    let runs: Vec<Outcome> = SECRETS
        .iter()
        .map(|s| scenario.run(s, true, Hooks::none()))
        .collect::<anyhow::Result<_>>()?;
    let texts: Vec<&str> = runs
        .iter()
        .map(|r| r.text.as_deref().unwrap_or(""))
        .collect();
    let served = runs.iter().all(|r| r.text.is_some());
    let differs = served && texts[0] != texts[1];
    let quoted: Vec<&str> = SECRETS
        .iter()
        .zip(&texts)
        .filter(|(secret, text)| {
            let (word, digits) = secret.split_once('-').unwrap_or((secret, secret));
            text.contains(word) || text.contains(digits)
        })
        .map(|(s, _)| *s)
        .collect();
    let leaked = differs || !quoted.is_empty();
    let evidence = if !served {
        "tenant B was not served (the fault did not take the placeholder path)".to_string()
    } else {
        let mut e = if differs {
            format!(
                "noninterference broken: tenant B's output changed when only tenant A's secret changed ({} vs {})",
                SECRETS[0], SECRETS[1]
            )
        } else {
            "tenant B's output did not change with tenant A's secret".to_string()
        };
        if !quoted.is_empty() {
            e.push_str(&format!(
                "; tenant B's output quotes tenant A's secret ({})",
                quoted.join(", ")
            ));
        }
        e
    };
    let correct = scenario.run(SECRETS[0], false, Hooks::none())?;
    let correct_text = correct.error.as_ref().map_or_else(
        || correct.text.clone().unwrap_or_default(),
        ToString::to_string,
    );
    if json {
        writeln!(
            out,
            "{}",
            json!({
                "run": "unsanitized",
                "outcome": if leaked { "leaked" } else { "clean" },
                "violations": [],
                "tenant_b_text": texts[0],
                "leak_evidence": evidence,
            })
        )?;
    } else {
        writeln!(
            out,
            "== 1. unsanitized (fault reject-as-placeholder, no sanitizer)"
        )?;
        for (secret, text) in SECRETS.iter().zip(&texts) {
            writeln!(
                out,
                "  tenant A's secret {secret} → tenant B gets: {text:?}"
            )?;
        }
        writeln!(out, "  a correct engine gives tenant B: {correct_text}")?;
        writeln!(
            out,
            "  {}: {evidence}\n",
            if leaked { "LEAKED" } else { "no leak seen" }
        )?;
    }

    // 2. Sanitized.
    let sink = ReportBuffer::default();
    let sanitizer = Arc::new(Sanitizer::with_writer(
        Options::parse("report_format=text")?,
        sink.clone(),
    ));
    let sanitized = scenario.run(SECRETS[0], true, Hooks::sanitizer(sanitizer.clone()))?;
    let kinds: Vec<String> = sanitizer
        .violations()
        .iter()
        .map(|v| v.kind.name().to_string())
        .collect();
    let report = sink.text();
    let aborted = sanitized
        .error
        .as_ref()
        .is_some_and(|e| e.violation.is_some());
    if json {
        writeln!(
            out,
            "{}",
            json!({
                "run": "sanitized",
                "outcome": if aborted { "aborted" } else if sanitized.text.is_some() { "leaked" } else { "clean" },
                "violations": kinds,
                "tenant_b_text": sanitized.text,
                "leak_evidence": sanitized.error.as_ref().map(ToString::to_string),
            })
        )?;
    } else {
        writeln!(out, "== 2. sanitized (same fault, kvsan attached)")?;
        match &sanitized.error {
            Some(e) => writeln!(out, "  tenant B's request: {e}")?,
            None => writeln!(
                out,
                "  tenant B was served: {:?}",
                sanitized.text.as_deref().unwrap_or("")
            )?,
        }
        writeln!(out, "{report}")?;
        writeln!(out, "  {}\n", sanitizer.summary())?;
    }

    // 3. Fault off: the correct engine.
    let rejected = correct
        .error
        .as_ref()
        .is_some_and(|e| e.rejection.is_some());
    if json {
        writeln!(
            out,
            "{}",
            json!({
                "run": "fault-off",
                "outcome": if rejected { "rejected" } else { "clean" },
                "violations": [],
                "tenant_b_text": correct.text,
                "leak_evidence": correct.error.as_ref().map(ToString::to_string),
            })
        )?;
    } else {
        writeln!(out, "== 3. fault off (a correct engine)")?;
        writeln!(out, "  tenant B's request: {correct_text}")?;
    }
    Ok(())
}
