//! `kvsan tokenize`: the token ids of a text.

use std::path::PathBuf;

use kvsan_engine::gguf::GgufFile;
use kvsan_engine::tokenizer::Tokenizer;
use serde_json::json;

use super::model_arg;

/// Arguments of `kvsan tokenize`.
#[derive(clap::Args, Debug)]
pub struct Args {
    /// The text to tokenize (special tokens such as `<|im_start|>` are parsed).
    #[arg(long)]
    pub text: String,
    /// GGUF model file (default: SmolLM2-135M-Instruct Q4_1, fetched on first use).
    #[arg(long)]
    pub model: Option<PathBuf>,
    /// Print one JSON object `{"ids": [...], "tokens": [...]}`.
    #[arg(long)]
    pub json: bool,
}

/// Runs the command.
pub fn run(args: &Args) -> anyhow::Result<()> {
    let path = model_arg::resolve(args.model.as_deref())?;
    let tokenizer = Tokenizer::from_gguf(&GgufFile::open(&path)?)?;
    let ids = tokenizer.encode(&args.text)?;
    if args.json {
        let tokens: Vec<&str> = ids
            .iter()
            .map(|&id| tokenizer.token_str(id).unwrap_or(""))
            .collect();
        println!("{}", json!({ "ids": ids, "tokens": tokens }));
    } else {
        let line: Vec<String> = ids.iter().map(u32::to_string).collect();
        println!("{}", line.join(" "));
    }
    Ok(())
}
