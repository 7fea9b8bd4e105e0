//! `kvsan generate`: one completion from the engine.

use std::io::Write;
use std::path::PathBuf;

use kvsan_engine::chat::{ChatMessage, ChatTemplate};
use kvsan_engine::generate::{GenerateOptions, StopReason, generate};
use kvsan_engine::model::Model;
use kvsan_engine::sampler::SamplingParams;
use kvsan_engine::tokenizer::Tokenizer;
use serde_json::json;

use super::model_arg;

/// Arguments of `kvsan generate`.
#[derive(clap::Args, Debug)]
pub struct Args {
    /// The prompt text.
    #[arg(long)]
    pub prompt: String,
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
}

/// Runs the command.
pub fn run(args: &Args) -> anyhow::Result<()> {
    let path = model_arg::resolve(args.model.as_deref())?;
    let model = Model::load(&path)?;
    let gguf = model
        .weights()
        .file()
        .expect("a loaded model keeps its file");
    let tokenizer = Tokenizer::from_gguf(gguf)?;
    let prompt_text = if args.chat {
        ChatTemplate::from_gguf(gguf)?.render(&[ChatMessage::user(args.prompt.as_str())], true)
    } else {
        args.prompt.clone()
    };
    let prompt_ids = tokenizer.encode(&prompt_text)?;
    let sampling = SamplingParams {
        temperature: args.temperature,
        top_k: args.top_k,
        top_p: args.top_p,
        seed: args.seed,
    };
    sampling.validate()?;
    let opts = GenerateOptions {
        max_tokens: args.max_tokens,
        sampling,
        stop_tokens: tokenizer.eos_id().into_iter().collect(),
        ..GenerateOptions::default()
    };
    let mut stream = tokenizer.stream_decoder();
    let mut stdout = std::io::stdout().lock();
    let out = generate(&model, &prompt_ids, &opts, |id| {
        if !args.json {
            let piece = stream.push(&tokenizer, id);
            // A closed stdout (a pipe to `head`) stops the output, not the run.
            let _ = stdout
                .write_all(piece.as_bytes())
                .and_then(|()| stdout.flush());
        }
    })?;
    let prompt_tps = out.prompt_tokens_per_s(prompt_ids.len());
    let decode_tps = out.decode_tokens_per_s();
    if args.json {
        let obj = json!({
            "prompt_ids": prompt_ids,
            "ids": out.ids,
            "text": tokenizer.decode(&out.ids),
            "finish_reason": match out.stop { StopReason::Stop => "stop", StopReason::Length => "length" },
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
            out.ids.len()
        );
    }
    Ok(())
}
