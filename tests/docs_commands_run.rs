//! The documented command lines that run on any machine in seconds run as
//! shown and succeed: each shell line of README.md and `docs/*.md` that
//! compiles and runs the C example (`cc …`), runs a Python example
//! (`python3 examples/…`) or replays a fault with the debug binary
//! (`target/debug/kvsan replay …`), in bash from the repository root, with
//! `target/debug` standing for this build's own directory. The others need
//! a GPU, an RDMA NIC, a running server or a build of their own; their
//! flags are checked by the CLI's own parser (`src/docs_commands.rs`).

#![cfg(feature = "faults")]

mod docs_common;
mod shim_common;

use std::process::Command;

/// What a documented line starts with, for it to be run here.
const RUNNABLE: &[&str] = &["cc ", "python3 examples/", "target/debug/kvsan replay "];

/// The runnable shell lines of every page, each with its page and line.
fn runnable_lines() -> Vec<(String, usize, String)> {
    let mut found = Vec::new();
    for page in docs_common::pages(&shim_common::repo()) {
        let text = std::fs::read_to_string(&page).expect("a page");
        let name = page.file_name().unwrap().to_string_lossy().into_owned();
        for (line, command) in docs_common::shell_lines(&text) {
            if RUNNABLE.iter().any(|p| command.starts_with(p)) {
                found.push((name.clone(), line, command));
            }
        }
    }
    found
}

#[test]
fn the_documented_commands_that_run_anywhere_run_as_shown() {
    let lines = runnable_lines();
    // docs/python.md's C and Python examples, docs/sanitizer.md's replays.
    assert!(lines.len() >= 4, "only {lines:?}");
    shim_common::shim_library();
    let build_dir = shim_common::kvsan_bin()
        .parent()
        .expect("the binary's directory")
        .to_path_buf();
    let scratch = shim_common::scratch();
    for (page, line, command) in lines {
        let shown = command
            .replace("$PWD/target/debug", &build_dir.display().to_string())
            .replace("target/debug", &build_dir.display().to_string())
            .replace(
                "/tmp/toy_pool",
                &scratch.join("docs_toy_pool").display().to_string(),
            );
        let out = Command::new("bash")
            .args(["-c", &shown])
            .current_dir(shim_common::repo())
            .env_remove("LD_PRELOAD")
            .env_remove("KVSAN_FAULTS")
            .env_remove("KVSAN_OPTIONS")
            .output()
            .expect("run bash");
        let (stdout, stderr) = shim_common::texts(&out);
        assert!(
            out.status.success(),
            "{page}:{line}: `{command}` failed ({}):\n{stdout}\n{stderr}",
            out.status
        );
        assert!(
            !stdout.trim().is_empty(),
            "{page}:{line}: `{command}` printed nothing"
        );
    }
}
