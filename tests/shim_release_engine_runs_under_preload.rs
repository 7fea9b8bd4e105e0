//! The engine binary, built without feature `sanitize`, run unmodified with
//! `LD_PRELOAD=libkvsan_shim.so`: the shim attaches (banner), the engine
//! finds its hook table (target "C hook table"), registers its pools with it
//! and serves exactly what it serves without the preload, with zero
//! violations. A process that inherits the preload but registers no pool is
//! left alone, and a bad `KVSAN_OPTIONS` leaves the engine running
//! unsanitized, loudly. (CI runs the dev-profile binary; set
//! `KVSAN_SHIM_TEST_RELEASE=1` to build and run `--release` instead.)

mod serve_common;
mod shim_common;

use std::io::{BufRead, BufReader};
use std::path::PathBuf;
use std::process::{Command, Stdio};
use std::sync::OnceLock;
use std::sync::mpsc;
use std::time::Duration;

use serde_json::Value;

/// The engine binary under test: this build's, or with
/// `KVSAN_SHIM_TEST_RELEASE=1` the `--release` one, built here without
/// `sanitize` (and its shim built `--release` next to it).
fn engine() -> (PathBuf, PathBuf) {
    static RELEASE: OnceLock<(PathBuf, PathBuf)> = OnceLock::new();
    if std::env::var_os("KVSAN_SHIM_TEST_RELEASE").is_none() {
        return (
            shim_common::kvsan_bin(),
            shim_common::shim_library().to_path_buf(),
        );
    }
    RELEASE
        .get_or_init(|| {
            let bin = shim_common::kvsan_bin();
            let target = bin.parent().and_then(|p| p.parent()).expect("target dir");
            let cargo = std::env::var_os("CARGO").unwrap_or_else(|| "cargo".into());
            // Two builds: `--bin` would leave the shim's cdylib out of a
            // combined one.
            for what in [
                &["-p", "kvsan", "--bin", "kvsan"][..],
                &["-p", "kvsan-shim"],
            ] {
                let out = Command::new(&cargo)
                    .args(["build", "--release"])
                    .args(what)
                    .arg("--manifest-path")
                    .arg(shim_common::repo().join("Cargo.toml"))
                    .env("CARGO_TARGET_DIR", target)
                    .output()
                    .expect("run cargo build --release");
                assert!(
                    out.status.success(),
                    "{}",
                    String::from_utf8_lossy(&out.stderr)
                );
            }
            (
                target.join("release/kvsan"),
                target.join("release/libkvsan_shim.so"),
            )
        })
        .clone()
}

fn generate(preload: bool, options: Option<&str>) -> (Value, String) {
    let (bin, shim) = engine();
    let mut cmd = Command::new(bin);
    cmd.args([
        "generate",
        "--prompt",
        "The capital of France is",
        "--max-tokens",
        "6",
        "--topology",
        "disagg",
        "--context",
        "512",
        "--json",
    ]);
    cmd.env_remove("KVSAN_OPTIONS").env_remove("LD_PRELOAD");
    if preload {
        cmd.env("LD_PRELOAD", shim);
    }
    if let Some(o) = options {
        cmd.env("KVSAN_OPTIONS", o);
    }
    let out = cmd.output().expect("run kvsan generate");
    let (stdout, stderr) = shim_common::texts(&out);
    assert!(out.status.success(), "{stdout}\n{stderr}");
    let json: Value = serde_json::from_str(stdout.trim()).expect("one JSON object");
    (json, stderr)
}

#[test]
fn generate_under_the_preload_attaches_registers_both_pools_and_matches_the_unsanitized_run() {
    let (plain, plain_err) = generate(false, None);
    assert!(!plain_err.contains("kvsan: attached"), "{plain_err}");
    let (shimmed, err) = generate(true, None);
    assert_eq!(
        shimmed["ids"], plain["ids"],
        "the shim changed what the engine generated"
    );
    assert!(err.contains("kvsan: attached (pid "), "{err}");
    // Both pools of the disaggregated engine went through the hook table.
    assert_eq!(err.matches("kvsan: shadowing pool ").count(), 2, "{err}");
    assert!(
        err.contains("role prefill") && err.contains("role decode"),
        "{err}"
    );
    let last = err.lines().last().unwrap_or_default();
    assert!(
        last.starts_with("kvsan: 0 violations"),
        "last line: {last}\n{err}"
    );
    assert!(!err.contains("kvsan: ERROR"), "{err}");
}

#[test]
fn a_bad_kvsan_options_leaves_the_engine_running_unsanitized_and_says_so() {
    let (plain, _) = generate(false, None);
    let (shimmed, err) = generate(true, Some("history_depth=lots"));
    assert_eq!(shimmed["ids"], plain["ids"]);
    assert!(
        err.contains("kvsan: NOT attached (pid ") && err.contains("UNSANITIZED"),
        "{err}"
    );
    // The engine found the symbol, got no table, and said it runs without hooks.
    assert!(
        err.contains("hook table `kvsan_hook_table_v1` not attached"),
        "{err}"
    );
    assert!(!err.contains("kvsan: shadowing"), "{err}");
    assert!(!err.contains("violations"), "{err}");
}

#[test]
fn a_child_that_inherits_the_preload_but_registers_no_pool_is_left_alone() {
    let (_, shim) = engine();
    let out = Command::new("sh")
        .args(["-c", "echo child-output"])
        .env("LD_PRELOAD", shim)
        .env_remove("KVSAN_OPTIONS")
        .output()
        .expect("run sh");
    let (stdout, stderr) = shim_common::texts(&out);
    assert!(out.status.success());
    assert_eq!(stdout, "child-output\n");
    // Only the banner: no pool, no sanitizer, no summary.
    assert_eq!(stderr.lines().count(), 1, "{stderr}");
    assert!(stderr.starts_with("kvsan: attached (pid "), "{stderr}");
}

/// Kills the server on drop.
struct Server(std::process::Child);

impl Drop for Server {
    fn drop(&mut self) {
        let _ = self.0.kill();
        let _ = self.0.wait();
    }
}

#[test]
fn serve_under_the_preload_chooses_the_c_hook_table_and_serves_without_violations() {
    let (bin, shim) = engine();
    let mut child = Command::new(bin)
        .args([
            "serve",
            "--role",
            "disagg",
            "--synthetic",
            "--listen",
            "127.0.0.1:0",
        ])
        .env("LD_PRELOAD", shim)
        .env("RUST_LOG", "info")
        .env_remove("KVSAN_OPTIONS")
        .stdin(Stdio::null())
        .stdout(Stdio::null())
        .stderr(Stdio::piped())
        .spawn()
        .expect("start kvsan serve");
    let stderr = child.stderr.take().expect("piped stderr");
    let mut server = Server(child);
    let (tx, rx) = mpsc::channel();
    std::thread::spawn(move || {
        for line in BufReader::new(stderr).lines().map_while(Result::ok) {
            let _ = tx.send(line);
        }
    });
    let mut seen = Vec::new();
    let addr = loop {
        let line = rx
            .recv_timeout(Duration::from_secs(60))
            .unwrap_or_else(|e| {
                panic!("no serving line ({e}); stderr so far:\n{}", seen.join("\n"))
            });
        if let Some(addr) = line
            .split_whitespace()
            .find_map(|w| w.strip_prefix("listen="))
            .filter(|_| line.contains("kvsan: serving"))
        {
            let addr = addr.to_string();
            seen.push(line);
            break addr;
        }
        seen.push(line);
    };
    let all = seen.join("\n");
    assert!(all.contains("kvsan: attached (pid "), "{all}");
    let chosen = seen
        .iter()
        .find(|l| l.contains("kvsan hooks chosen"))
        .unwrap_or_else(|| panic!("no hooks line:\n{all}"));
    assert!(chosen.contains("C hook table"), "{chosen}");
    assert_eq!(all.matches("kvsan: shadowing pool ").count(), 2, "{all}");

    let client = serve_common::client::Client::new(&addr);
    for prompt in [
        vec![
            1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15, 16, 17, 18,
        ],
        vec![5, 4, 3],
    ] {
        client.complete(&prompt, 5).assert_finished(prompt.len(), 5);
    }
    // A clean stop (SIGTERM) ends with the shim's summary line.
    let stopped = Command::new("kill")
        .args(["-TERM", &server.0.id().to_string()])
        .status()
        .expect("run kill");
    assert!(stopped.success());
    let mut later = Vec::new();
    while let Ok(line) = rx.recv_timeout(Duration::from_secs(30)) {
        later.push(line);
    }
    let status = server.0.wait().expect("reap kvsan serve");
    let all = later.join("\n");
    assert!(status.success(), "{status}: {all}");
    assert!(!all.contains("kvsan: ERROR"), "{all}");
    let last = later.last().map(String::as_str).unwrap_or_default();
    assert!(
        last.starts_with("kvsan: 0 violations"),
        "last line: {last}\n{all}"
    );
}
