//! `kvsan replay fault NAME` and `--inject` as a user runs them (real
//! processes, a build without the sanitizer): every fault leaks through the
//! CLI — the probe's output changes with the victim's seed — and does not
//! with the fault off; bad fault names are refused naming the known ones.
#![cfg(feature = "faults")]

use std::process::Command;

use kvsan_engine::faults::Fault;
use serde_json::Value;

fn replay(fault: Fault, seed: u32, inject: bool) -> Value {
    let mut cmd = Command::new(env!("CARGO_BIN_EXE_kvsan"));
    cmd.args(["replay", "fault", fault.name(), "--json", "--seed"])
        .arg(seed.to_string())
        .env_remove("KVSAN_FAULTS")
        .env_remove("LD_PRELOAD");
    if !inject {
        cmd.arg("--no-inject");
    }
    let out = cmd.output().expect("run kvsan");
    assert!(
        out.status.success(),
        "{}: {}",
        fault.name(),
        String::from_utf8_lossy(&out.stderr)
    );
    serde_json::from_slice(&out.stdout).expect("one JSON object")
}

#[test]
fn every_fault_leaks_through_the_cli_and_not_with_the_fault_off() {
    for fault in Fault::ALL {
        let (a, b) = (replay(fault, 1, true), replay(fault, 2, true));
        assert_eq!(a["hooks"], "none");
        assert_eq!(a["fault"], fault.name());
        assert_ne!(
            a["probe"],
            b["probe"],
            "{}: the probe must depend on the victim",
            fault.name()
        );
        let (c, d) = (replay(fault, 1, false), replay(fault, 2, false));
        assert_eq!(c["probe"], d["probe"], "{}", fault.name());
        assert_eq!(c["bystander"]["outcome"], "finished");
    }
}

#[test]
fn an_unknown_fault_is_refused_naming_the_known_ones() {
    for args in [
        &["replay", "fault", "no-such-fault"][..],
        &["generate", "--prompt", "x", "--inject", "no-such-fault"][..],
    ] {
        let out = Command::new(env!("CARGO_BIN_EXE_kvsan"))
            .args(args)
            .output()
            .expect("run kvsan");
        let stderr = String::from_utf8_lossy(&out.stderr);
        assert!(!out.status.success());
        assert!(
            stderr.contains("unknown fault 'no-such-fault'") && stderr.contains("short-transfer"),
            "{stderr}"
        );
    }
}
