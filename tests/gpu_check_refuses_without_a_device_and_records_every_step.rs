//! `scripts/gpu-check`, what can be tested without a GPU: its arguments,
//! its refusal on a machine with no NVIDIA GPU (exit 3, a JSON record and a
//! summary saying why), and, with a stand-in `nvidia-smi` and a bundle of
//! stand-in binaries, the record it writes of each step (run, skipped,
//! failed) and of the benchmark.

use std::fs;
use std::os::unix::fs::PermissionsExt;
use std::path::{Path, PathBuf};
use std::process::{Command, Output};

fn repo() -> PathBuf {
    PathBuf::from(env!("CARGO_MANIFEST_DIR"))
}

fn scratch(name: &str) -> PathBuf {
    let dir = std::env::temp_dir().join(format!("kvsan-gpu-check-{}-{name}", std::process::id()));
    let _ = fs::remove_dir_all(&dir);
    fs::create_dir_all(&dir).unwrap();
    dir
}

fn script(path: &Path, body: &str) {
    fs::write(path, format!("#!/bin/sh\n{body}\n")).unwrap();
    fs::set_permissions(path, fs::Permissions::from_mode(0o755)).unwrap();
}

/// Runs the script with `fake_bin` first on PATH (where a stand-in
/// `nvidia-smi` decides whether there is a GPU).
fn gpu_check(fake_bin: &Path, args: &[&str]) -> Output {
    let path = format!(
        "{}:{}",
        fake_bin.display(),
        std::env::var("PATH").unwrap_or_default()
    );
    Command::new("bash")
        .arg(repo().join("scripts/gpu-check"))
        .args(args)
        .env("PATH", path)
        .env_remove("NVRTC_LIB_DIR")
        // Neither compute-sanitizer nor a Python with torch, wherever this
        // runs: those steps are skipped with the reason.
        .env("GPU_CHECK_SANITIZER", "/nonexistent/compute-sanitizer")
        .env("GPU_CHECK_PYTHON", "/nonexistent/python3")
        .output()
        .expect("run scripts/gpu-check")
}

fn record(out: &Path) -> serde_json::Value {
    let text = fs::read_to_string(out.join("gpu-check.json")).expect("gpu-check.json written");
    serde_json::from_str(&text).expect("gpu-check.json is JSON")
}

fn step<'a>(record: &'a serde_json::Value, name: &str) -> &'a serde_json::Value {
    record["steps"]
        .as_array()
        .expect("steps")
        .iter()
        .find(|s| s["name"] == name)
        .unwrap_or_else(|| panic!("no step {name} in {record}"))
}

#[test]
fn bad_arguments_are_refused_with_the_usage() {
    let bin = scratch("args");
    for (args, says) in [
        (&[][..], "no output folder given"),
        (&["a", "b"][..], "one output folder, not two"),
        (&["--bogus", "x"][..], "unknown option --bogus"),
        (&["--prebuilt"][..], "--prebuilt needs a folder"),
        (&["--bundle", "x", "--prebuilt", "y"][..], "not both"),
    ] {
        let out = gpu_check(&bin, args);
        let stderr = String::from_utf8_lossy(&out.stderr);
        assert_eq!(out.status.code(), Some(2), "{args:?}: {stderr}");
        assert!(stderr.contains(says), "{args:?}: {stderr}");
        assert!(stderr.contains("usage: scripts/gpu-check"), "{stderr}");
    }
    let help = gpu_check(&bin, &["--help"]);
    assert_eq!(help.status.code(), Some(0));
    assert!(String::from_utf8_lossy(&help.stderr).contains("nvtx-memcheck"));
}

#[test]
fn without_a_gpu_it_refuses_and_says_why_in_its_record() {
    let bin = scratch("nogpu-bin");
    // A driver's nvidia-smi that finds no GPU (as on a machine without one).
    script(
        &bin.join("nvidia-smi"),
        "echo 'No devices were found' >&2; exit 6",
    );
    let out_dir = scratch("nogpu-out");
    let out = gpu_check(&bin, &[out_dir.to_str().unwrap()]);
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert_eq!(out.status.code(), Some(3), "{stderr}");
    assert!(stderr.contains("refused: no NVIDIA GPU here"), "{stderr}");
    let rec = record(&out_dir);
    assert_eq!(rec["status"], "refused");
    assert!(
        rec["reason"].as_str().unwrap().contains("no NVIDIA GPU"),
        "{rec}"
    );
    for name in [
        "device",
        "cuda-tests",
        "python-device",
        "nvtx-memcheck",
        "nvtx-initcheck",
        "bench",
    ] {
        assert_eq!(step(&rec, name)["status"], "not-run", "{name}");
    }
    assert!(rec["bench"].is_null());
    let summary = fs::read_to_string(out_dir.join("summary.txt")).unwrap();
    assert!(summary.starts_with("kvsan gpu-check: refused"), "{summary}");
}

#[test]
fn with_a_gpu_each_step_is_recorded_as_run_skipped_or_failed() {
    let bin = scratch("fake-bin");
    script(
        &bin.join("nvidia-smi"),
        r#"case "$1" in
  -L) echo 'GPU 0: Stand-in GPU (UUID: GPU-0)' ;;
  --query-gpu*) echo 'Stand-in GPU, 580.00, 1024 MiB' ;;
  *) echo 'stand-in nvidia-smi' ;;
esac"#,
    );
    let bundle = scratch("bundle");
    fs::create_dir_all(bundle.join("bin")).unwrap();
    fs::create_dir_all(bundle.join("lib")).unwrap();
    fs::write(bundle.join("commit"), "0123abc\n").unwrap();
    script(
        &bundle.join("bin/kernels-lib"),
        "echo 'test result: ok. 5 passed; 0 failed'",
    );
    // One test fails: the step fails and names it.
    script(
        &bundle.join("bin/cuda-tests"),
        "echo 'test decode_matches_cpu ... FAILED'; echo 'test result: FAILED. 17 passed; 1 failed'; exit 101",
    );
    script(
        &bundle.join("bin/gpu_bench"),
        r#"echo '{"target": "sm_90", "contexts": [{"context": 1024, "rows": 16, "decode": [{"check": "bounds", "kernel_ms": 0.5, "call_ms": 0.6, "kernel_ratio": 1.0}, {"check": "generations", "kernel_ms": 0.5, "call_ms": 0.6, "kernel_ratio": 1.0}, {"check": "shadow", "kernel_ms": 0.51, "call_ms": 0.62, "kernel_ratio": 1.02}], "block_table_check": {"kernel_ms": 0.05, "call_ms": 0.07, "host_ms": 0.02}}]}'"#,
    );
    let out_dir = scratch("gpu-out");
    let out = gpu_check(
        &bin,
        &[
            "--prebuilt",
            bundle.to_str().unwrap(),
            out_dir.to_str().unwrap(),
        ],
    );
    let stdout = String::from_utf8_lossy(&out.stdout);
    assert_eq!(out.status.code(), Some(1), "a step failed:\n{stdout}");
    let rec = record(&out_dir);
    assert_eq!(rec["status"], "failed");
    assert_eq!(rec["device"], "Stand-in GPU, 580.00, 1024 MiB");
    assert_eq!(step(&rec, "device")["status"], "passed");
    assert_eq!(step(&rec, "build")["status"], "skipped");
    assert!(
        step(&rec, "build")["detail"]
            .as_str()
            .unwrap()
            .contains("0123abc")
    );
    let cuda = step(&rec, "cuda-tests");
    assert_eq!(cuda["status"], "failed");
    assert!(
        cuda["detail"]
            .as_str()
            .unwrap()
            .contains("decode_matches_cpu"),
        "{cuda}"
    );
    assert_eq!(cuda["log"], "logs/cuda-tests.log");
    for name in ["nvtx-memcheck", "nvtx-initcheck"] {
        let s = step(&rec, name);
        assert_eq!(s["status"], "skipped", "{name}");
        assert!(s["detail"].as_str().unwrap().contains("compute-sanitizer"));
    }
    assert_eq!(step(&rec, "python-device")["status"], "skipped");
    assert_eq!(step(&rec, "bench")["status"], "passed");
    assert_eq!(rec["bench"]["contexts"][0]["context"], 1024);
    let summary = fs::read_to_string(out_dir.join("summary.txt")).unwrap();
    assert!(summary.starts_with("kvsan gpu-check: failed"), "{summary}");
    assert!(summary.contains("context   1024 x 16 rows"), "{summary}");
    assert!(summary.contains("shadow 0.510 (1.020)"), "{summary}");
}
