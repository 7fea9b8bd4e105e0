//! The documentation's shell blocks, for the tests that check the commands
//! they show (`src/docs_commands.rs` parses every `kvsan` line with the
//! CLI's parser; `tests/docs_commands_run.rs` runs the ones that run
//! anywhere).

#![allow(dead_code)]

use std::path::{Path, PathBuf};

/// The pages: the README and every page under `docs/`.
pub fn pages(root: &Path) -> Vec<PathBuf> {
    let mut pages = vec![root.join("README.md")];
    let mut docs: Vec<PathBuf> = std::fs::read_dir(root.join("docs"))
        .expect("docs/")
        .map(|e| e.expect("a docs entry").path())
        .filter(|p| p.extension().is_some_and(|e| e == "md"))
        .collect();
    docs.sort();
    pages.extend(docs);
    pages
}

/// The lines of a page's shell blocks (`sh`, `bash`, `console`, `shell`),
/// continuation lines joined, each with the line it starts on.
pub fn shell_lines(text: &str) -> Vec<(usize, String)> {
    let mut found = Vec::new();
    let mut in_shell = false;
    let mut pending: Option<(usize, String)> = None;
    for (i, line) in text.lines().enumerate() {
        if let Some(lang) = line.trim_start().strip_prefix("```") {
            in_shell = !in_shell && matches!(lang.trim(), "sh" | "bash" | "console" | "shell");
            continue;
        }
        if !in_shell {
            continue;
        }
        let (start, mut joined) = pending.take().unwrap_or((i + 1, String::new()));
        let code = line.trim_end();
        joined.push_str(code.trim_end_matches('\\'));
        joined.push(' ');
        if code.ends_with('\\') {
            pending = Some((start, joined));
        } else {
            found.push((start, joined.trim().to_string()));
        }
    }
    found
}
