//! A C engine's decode node built against ABI 1.5 (`shim/tests/c/transfer_landing.c`)
//! registers its pool with `KVSAN_POOL_REPORTS_LANDING` and reports each copy of
//! received KV before it writes (`kvsan_transfer_land`) and what each page holds
//! once the bytes are there (`kvsan_transfer_verify`): a copy aimed at another
//! request's page is `misdirected-transfer`, KV that is not what the sender sent
//! is `transfer-digest-mismatch`, and a transfer committed with nothing reported
//! landed is `short-transfer` — the manifest alone marks nothing written. A pool
//! registered without the bit, as by an engine built before 1.5, takes the
//! manifest as written, and the shim says once, at its registration, that where
//! received KV lands is not checked there.

mod shim_common;

use std::process::Command;

/// The digests the program passes (`SENT_DIGEST`, `OTHER_DIGEST`).
const DIGESTS: [u64; 2] = [0x5e17d16e57, 0xbadd16e57];

#[test]
fn a_c_engine_reporting_landings_gets_misdirected_and_mismatched_kv_caught() {
    let exe = shim_common::compile_c(
        &shim_common::repo().join("shim/tests/c/transfer_landing.c"),
        "transfer_landing",
    );
    let out = Command::new(&exe)
        .env_remove("KVSAN_OPTIONS")
        .output()
        .expect("run the transfer-landing program");
    let (stdout, stderr) = shim_common::texts(&out);
    assert!(out.status.success(), "{stdout}\n{stderr}");
    for line in [
        // (a) every copy where the manifest says
        "A recv: continue",
        "A land page 0: continue",
        "A land page 1: continue",
        "A verify page 0: continue",
        "A verify page 1: continue",
        "A commit: continue",
        "A read: continue",
        // (b) refused before it wrote: B's own transfer then goes through
        "A's KV into B's page: misdirected-transfer",
        "B land: continue",
        "B verify: continue",
        "B commit: continue",
        // (c)
        "C land: continue",
        "C verify, other digest: transfer-digest-mismatch",
        // (d)
        "D commit, nothing landed: short-transfer",
        // (e)
        "E recv (before 1.5): continue",
        "E commit (before 1.5): continue",
        "E read (before 1.5): continue",
        "violations: 3 (misdirected-transfer: 1, transfer-digest-mismatch: 1)",
    ] {
        assert!(stdout.contains(line), "missing {line:?}\n{stdout}");
    }
    // One report per violation, naming the request, the page and who holds it.
    assert_eq!(stderr.matches("kvsan: ERROR:").count(), 3, "{stderr}");
    for summary in [
        "kvsan: ERROR: misdirected-transfer in request 1 (tenant 7) landing pool 0 page 2@gen 1 owned by request 2",
        "kvsan: ERROR: transfer-digest-mismatch in request 3 (tenant 7) verifying pool 0 page 3@gen 1",
        "kvsan: ERROR: short-transfer in request 4 (tenant 7) committing pool 0 page 4@gen 1",
    ] {
        assert!(stderr.contains(summary), "missing {summary:?}\n{stderr}");
    }
    // The digests are the engine's: no report shows one, in any base.
    for digest in DIGESTS {
        for shown in [
            format!("{digest:x}"),
            format!("{digest:X}"),
            digest.to_string(),
        ] {
            assert!(!stderr.contains(&shown), "{shown} in\n{stderr}");
        }
    }
    // Only the pool that reports no landing is said to be checked less.
    let unchecked: Vec<&str> = stderr
        .lines()
        .filter(|l| l.contains("NOT checked"))
        .collect();
    assert_eq!(unchecked.len(), 1, "{stderr}");
    assert!(
        unchecked[0].starts_with("kvsan: shadowing pool 1 (node \"decode-before-1.5\"")
            && unchecked[0].contains("the engine reports no landing, ABI < 1.5"),
        "{}",
        unchecked[0]
    );
    let last = stderr.lines().last().unwrap_or_default();
    assert!(
        last.starts_with("kvsan: 3 violations (")
            && last.contains("misdirected-transfer: 1")
            && last.contains("transfer-digest-mismatch: 1")
            && last.contains("short-transfer: 1"),
        "last line: {last}"
    );
}
