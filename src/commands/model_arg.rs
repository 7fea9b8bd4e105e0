//! `--model PATH`, or the default model, fetched on first use.

use std::path::{Path, PathBuf};

use anyhow::Context;
use kvsan_engine::fetch::ensure_default_model;

/// The model file to use: `path` if given, else the default model (fetched
/// into the cache with progress on stderr if it is not there yet).
pub fn resolve(path: Option<&Path>) -> anyhow::Result<PathBuf> {
    match path {
        Some(p) => Ok(p.to_path_buf()),
        None => ensure_default_model(&mut |line| eprintln!("{line}")).context(
            "the default model is not available (give --model PATH to use another GGUF file)",
        ),
    }
}
