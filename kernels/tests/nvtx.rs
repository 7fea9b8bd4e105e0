//! The NVTX registration seen by NVIDIA's compute-sanitizer: the
//! `nvtx_witness` example's scenarios run under memcheck and initcheck,
//! with every kvsan check off, and the tool's error count judged — a held
//! page's accesses give none, a freed or foreign page's and a reused page
//! read before its new owner wrote it at least one.
//!
//! They need a GPU, the CUDA driver, NVRTC on the library path and
//! `compute-sanitizer` (`$COMPUTE_SANITIZER`, else on PATH), so they are
//! ignored elsewhere:
//!
//! ```text
//! cargo build -p kvsan-kernels --features nvtx --example nvtx_witness
//! cargo build -p kvsan-shim --features nvtx        # for the shim scenarios
//! KVSAN_SHIM=target/debug/libkvsan_shim.so \
//!   cargo test -p kvsan-kernels --features nvtx --test nvtx -- --ignored
//! ```
//!
//! The witness is `$NVTX_WITNESS`, else the example cargo built beside this
//! test (`target/<profile>/examples/nvtx_witness`). `scripts/gpu-check`
//! runs the same scenarios and records each count.
#![cfg(feature = "nvtx")]

use std::path::PathBuf;
use std::process::Command;

fn witness() -> PathBuf {
    if let Some(path) = std::env::var_os("NVTX_WITNESS") {
        return PathBuf::from(path);
    }
    let exe = std::env::current_exe().expect("the test's own path");
    // target/<profile>/deps/nvtx-<hash> -> target/<profile>/examples/nvtx_witness
    let profile = exe
        .parent()
        .and_then(|deps| deps.parent())
        .expect("a target directory");
    profile.join("examples/nvtx_witness")
}

/// compute-sanitizer's error count for `scenario` under `tool`.
fn errors(tool: &str, scenario: &str) -> u64 {
    let sanitizer =
        std::env::var("COMPUTE_SANITIZER").unwrap_or_else(|_| "compute-sanitizer".into());
    let witness = witness();
    assert!(
        witness.is_file(),
        "no witness at {} (build it: cargo build -p kvsan-kernels --features nvtx --example nvtx_witness)",
        witness.display()
    );
    let out = Command::new(&sanitizer)
        .args([
            "--tool",
            tool,
            "--destroy-on-device-error",
            "kernel",
            "--show-backtrace",
            "no",
            "--print-limit",
            "5",
        ])
        .arg(&witness)
        .arg(scenario)
        .output()
        .unwrap_or_else(|e| panic!("run {sanitizer}: {e}"));
    let text = format!(
        "{}{}",
        String::from_utf8_lossy(&out.stdout),
        String::from_utf8_lossy(&out.stderr)
    );
    assert!(out.status.success(), "{tool} {scenario}: {text}");
    // The shim's scenarios cannot tell (its heaps are the shim's); their
    // illegal scenario's error count says whether the tool took them.
    assert!(
        scenario.starts_with("shim-") || text.contains("NVTX tool attached: yes"),
        "{tool} {scenario}: the tool took no NVTX heap:\n{text}"
    );
    text.lines()
        .filter_map(|l| l.split("ERROR SUMMARY: ").nth(1))
        .filter_map(|rest| rest.split_whitespace().next()?.parse().ok())
        .next_back()
        .unwrap_or_else(|| panic!("{tool} {scenario}: no error summary:\n{text}"))
}

#[test]
#[ignore = "requires CUDA, NVRTC and compute-sanitizer"]
fn memcheck_sees_a_freed_or_foreign_page_and_nothing_in_a_held_one() {
    assert_eq!(errors("memcheck", "legal"), 0);
    for scenario in ["use-after-free", "store-after-free", "foreign-read"] {
        assert!(errors("memcheck", scenario) > 0, "{scenario}");
    }
}

#[test]
#[ignore = "requires CUDA, NVRTC and compute-sanitizer"]
fn initcheck_sees_a_reused_page_read_before_its_new_owner_wrote_it() {
    assert_eq!(errors("initcheck", "legal"), 0);
    assert!(errors("initcheck", "stale-read") > 0);
}

#[test]
#[ignore = "requires CUDA, NVRTC, compute-sanitizer and KVSAN_SHIM (a shim built with feature nvtx)"]
fn through_the_shims_c_abi_the_same_pages_are_seen() {
    assert!(
        std::env::var_os("KVSAN_SHIM").is_some(),
        "KVSAN_SHIM names no shim"
    );
    assert_eq!(errors("memcheck", "shim-legal"), 0);
    assert!(errors("memcheck", "shim-use-after-free") > 0);
}
