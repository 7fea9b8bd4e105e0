//! Every `kvsan` command line shown in the README and under `docs/` is one
//! the CLI accepts: each is parsed by the real argument parser, with its
//! optional parts (`[--flag VALUE]`) included and its placeholders given
//! a value of their kind. (The commands that run in CI are run by their own
//! tests; this keeps the rest from drifting from the flags.)

use std::path::Path;

use clap::Parser;

use crate::Cli;

#[path = "../tests/docs_common/mod.rs"]
mod docs_common;

/// The `kvsan` command lines of a page's shell blocks, comments dropped,
/// each with the line it starts on.
fn commands(text: &str) -> Vec<(usize, String)> {
    let mut found = Vec::new();
    for (start, line) in docs_common::shell_lines(text) {
        let code = line.split(" #").next().unwrap_or("");
        // `$ ` prompts, `VAR=value` prefixes, `&&` chains: the kvsan part.
        for part in code.split("&&") {
            let words: Vec<&str> = part
                .split_whitespace()
                .skip_while(|w| *w == "$" || w.contains('='))
                .collect();
            if words
                .first()
                .is_some_and(|w| *w == "kvsan" || w.ends_with("/kvsan"))
            {
                found.push((start, words.join(" ")));
            }
        }
    }
    found
}

/// A value of the kind each placeholder stands for.
fn placeholder(word: &str) -> &str {
    match word {
        "N" | "K" | "S" => "8",
        "T" | "P" => "0.5",
        "M" | "PATH" | "M.gguf" => "model.gguf",
        "TEXT" => "text",
        "KEY" | "KEY2" => "key",
        other => other,
    }
}

/// The arguments of a documented command line: brackets dropped (their
/// contents kept), of `a | b` alternatives the first, placeholders filled.
fn arguments(command: &str) -> Vec<String> {
    let flat = command.replace(['[', ']'], " ");
    let mut args = Vec::new();
    let mut skip_next = false;
    for word in flat.split_whitespace() {
        if skip_next {
            skip_next = false;
            continue;
        }
        if word == "|" {
            // `--model M.gguf | --synthetic`: keep the first alternative.
            skip_next = true;
            continue;
        }
        args.push(placeholder(word).to_string());
    }
    args[0] = "kvsan".into();
    args
}

#[test]
fn every_documented_kvsan_command_parses() {
    let mut checked = 0;
    for page in docs_common::pages(Path::new(env!("CARGO_MANIFEST_DIR"))) {
        let text = std::fs::read_to_string(&page).expect("a page");
        for (line, command) in commands(&text) {
            let args = arguments(&command);
            if let Err(e) = Cli::try_parse_from(&args) {
                panic!(
                    "{}:{line}: `{command}` is not a command kvsan accepts ({args:?}):\n{e}",
                    page.display()
                );
            }
            checked += 1;
        }
    }
    // The README's and the engine, audit, sanitizer, security and shim
    // pages' commands: a page losing its blocks should not pass unseen.
    assert!(checked >= 15, "only {checked} documented commands found");
}

#[test]
fn a_command_with_a_flag_kvsan_lacks_is_refused() {
    let args = arguments("kvsan serve --role unified [--no-such-flag N]");
    assert!(Cli::try_parse_from(&args).is_err());
    let args = arguments("kvsan serve --role unified [--model M.gguf | --synthetic]");
    assert_eq!(
        args,
        [
            "kvsan",
            "serve",
            "--role",
            "unified",
            "--model",
            "model.gguf"
        ]
    );
}
