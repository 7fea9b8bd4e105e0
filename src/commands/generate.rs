//! `kvsan generate`: one completion from the engine.

use std::io::Write;
use std::path::PathBuf;

use std::sync::Arc;
use std::time::Instant;

use anyhow::Context;
use kvsan_engine::chat::{ChatMessage, ChatTemplate};
use kvsan_engine::engine::Engine;
use kvsan_engine::model::Model;
use kvsan_engine::request::{Event, FinishReason, Request};
use kvsan_engine::sampler::SamplingParams;
use kvsan_engine::tokenizer::Tokenizer;
use kvsan_sanitizer::TenantId;
use serde_json::json;

use super::model_arg;

/// Arguments of `kvsan generate`.
#[derive(clap::Args, Debug)]
pub struct Args {
    /// The prompt text.
    #[arg(
        long,
        required_unless_present = "prompt_file",
        conflicts_with = "prompt_file"
    )]
    pub prompt: Option<String>,
    /// Read the prompt text from a file.
    #[arg(long)]
    pub prompt_file: Option<PathBuf>,
    /// GGUF model file (default: SmolLM2-135M-Instruct Q4_1, fetched on first use).
    #[arg(long)]
    pub model: Option<PathBuf>,
    /// Most tokens to generate.
    #[arg(long, default_value_t = 64)]
    pub max_tokens: usize,
    /// Sampling temperature; 0 is greedy.
    #[arg(long, default_value_t = 0.0, allow_negative_numbers = true)]
    pub temperature: f32,
    /// Keep the k most likely tokens (0: all).
    #[arg(long, default_value_t = 0)]
    pub top_k: usize,
    /// Keep the most likely tokens up to this probability mass.
    #[arg(long, default_value_t = 1.0, allow_negative_numbers = true)]
    pub top_p: f32,
    /// Seed of the sampler.
    #[arg(long, default_value_t = 0)]
    pub seed: u64,
    /// Wrap the prompt as a user message in the model's chat template.
    #[arg(long)]
    pub chat: bool,
    /// Print one JSON object instead of streaming text.
    #[arg(long)]
    pub json: bool,
    /// One node (`unified`) or a prefill and a decode node with separate pools (`disagg`).
    #[arg(long, value_enum, default_value_t = Topology::Unified)]
    pub topology: Topology,
    /// Engine settings.
    #[command(flatten)]
    pub engine: super::engine_args::EngineArgs,
    /// Tenant the request is billed to.
    #[arg(long, default_value_t = 0)]
    pub tenant: u32,
}

/// The engine's topology.
#[derive(clap::ValueEnum, Clone, Copy, Debug, PartialEq, Eq)]
pub enum Topology {
    /// One node, one pool.
    Unified,
    /// A prefill node and a decode node, linked in-process.
    Disagg,
}

/// Runs the command.
pub fn run(args: &Args) -> anyhow::Result<()> {
    let path = model_arg::resolve(args.model.as_deref())?;
    let model = Arc::new(Model::load(&path)?);
    let gguf = model
        .weights()
        .file()
        .expect("a loaded model keeps its file");
    let tokenizer = Tokenizer::from_gguf(gguf)?;
    let text = match (&args.prompt, &args.prompt_file) {
        (Some(p), _) => p.clone(),
        (None, Some(f)) => std::fs::read_to_string(f)
            .with_context(|| format!("cannot read the prompt file {}", f.display()))?,
        (None, None) => unreachable!("clap requires --prompt or --prompt-file"),
    };
    let prompt_text = if args.chat {
        ChatTemplate::from_gguf(gguf)?.render(&[ChatMessage::user(text.as_str())], true)
    } else {
        text
    };
    let prompt_ids = tokenizer.encode(&prompt_text)?;
    let sampling = SamplingParams {
        temperature: args.temperature,
        top_k: args.top_k,
        top_p: args.top_p,
        seed: args.seed,
    };
    sampling.validate()?;
    let cfg = args.engine.config()?;
    let engine = match args.topology {
        Topology::Unified => Engine::unified(model.clone(), &cfg)?,
        Topology::Disagg => Engine::disaggregated(model.clone(), &cfg)?,
    };
    let started = Instant::now();
    let handle = engine.submit(Request {
        tenant: TenantId(args.tenant),
        prompt: prompt_ids.clone(),
        max_tokens: args.max_tokens,
        sampling,
        stop_tokens: tokenizer.eos_id().into_iter().collect(),
        cache_salt: Default::default(),
    });
    let mut stream = tokenizer.stream_decoder();
    let mut stdout = std::io::stdout().lock();
    let mut ids = Vec::new();
    let (mut first_at, mut last_at) = (None, started);
    let reason = loop {
        match handle.events.recv() {
            Ok(Event::Token(id)) => {
                last_at = Instant::now();
                first_at.get_or_insert(last_at);
                ids.push(id);
                if !args.json {
                    let piece = stream.push(&tokenizer, id);
                    // A closed stdout (a pipe to `head`) stops the output, not the run.
                    let _ = stdout
                        .write_all(piece.as_bytes())
                        .and_then(|()| stdout.flush());
                }
            }
            Ok(Event::Finished { reason, .. }) => break reason,
            Ok(Event::Error(e)) => return Err(e.into()),
            Err(_) => anyhow::bail!("the engine stopped before the request ended"),
        }
    };
    cfg.hooks.print_summary();
    let first_at = first_at.unwrap_or(last_at);
    let prompt_tps = prompt_ids.len() as f64 / (first_at - started).as_secs_f64().max(1e-9);
    let decode_tps =
        ids.len().saturating_sub(1) as f64 / (last_at - first_at).as_secs_f64().max(1e-9);
    if args.json {
        let obj = json!({
            "prompt_ids": prompt_ids,
            "ids": ids,
            "text": tokenizer.decode(&ids),
            "finish_reason": match reason { FinishReason::Stop => "stop", FinishReason::Length => "length" },
            "prompt_tokens_per_s": prompt_tps,
            "decode_tokens_per_s": decode_tps,
        });
        writeln!(stdout, "{obj}")?;
    } else {
        let tail = stream.finish();
        writeln!(stdout, "{tail}")?;
        eprintln!(
            "kvsan: {} prompt tokens at {prompt_tps:.1} tokens/s, {} generated at {decode_tps:.1} tokens/s",
            prompt_ids.len(),
            ids.len()
        );
    }
    Ok(())
}
