//! Engines outside Rust annotate their own KV pool through the shim's C
//! ABI: a C program compiled here against `kvsan.h` and linked with
//! `libkvsan_shim.so`, and the Python (ctypes) example, each play a request
//! lifecycle where a recycled page is read beyond what its new owner wrote:
//! the stale read gets the abort verdict and a report, the neighbour's legal
//! read continues. Malformed calls are refused with error codes and the
//! process does not crash; a bad `KVSAN_OPTIONS` refuses to attach, loudly,
//! and the program runs on.

mod shim_common;

use std::process::Command;

fn assert_toy_pool_outcome(stdout: &str, stderr: &str) {
    assert!(stdout.contains("victim read: continue"), "{stdout}");
    assert!(
        stdout.contains("probe read: abort stale-read KV-"),
        "{stdout}"
    );
    assert!(stdout.contains("neighbour read: continue"), "{stdout}");
    assert!(stdout.contains("violations: 1"), "{stdout}");
    assert!(stderr.contains("kvsan: attached (pid "), "{stderr}");
    // The report: summary line with the reader and the page owner, history.
    assert!(
        stderr.contains(
            "kvsan: ERROR: stale-read in request 2 (tenant 9) reading pool 0 page 0@gen 2"
        ),
        "{stderr}"
    );
    assert!(
        stderr.contains("alloc   gen 1    request 1 (tenant 7)"),
        "{stderr}"
    );
    assert!(
        stderr.contains("SUMMARY: kvsan: stale-read in request 2 (tenant 9)"),
        "{stderr}"
    );
    // The exit summary, once.
    let last = stderr.lines().last().unwrap_or_default();
    assert!(
        last.starts_with("kvsan: 1 violation (stale-read: 1)"),
        "last line: {last}"
    );
    assert_eq!(stderr.matches("kvsan: ERROR:").count(), 1, "{stderr}");
}

#[test]
fn a_c_engine_gets_the_stale_read_verdict_and_report_and_its_neighbour_passes() {
    let exe = shim_common::compile_c(
        &shim_common::repo().join("shim/examples/toy_pool.c"),
        "toy_pool",
    );
    let out = Command::new(&exe)
        .env_remove("KVSAN_OPTIONS")
        .output()
        .expect("run the toy pool");
    let (stdout, stderr) = shim_common::texts(&out);
    assert!(out.status.success(), "{stdout}\n{stderr}");
    assert_toy_pool_outcome(&stdout, &stderr);
}

#[test]
fn the_python_example_gets_the_stale_read_verdict_and_report_and_its_neighbour_passes() {
    let out = Command::new("python3")
        .arg(shim_common::repo().join("examples/python/toy_pool.py"))
        .arg(shim_common::shim_library())
        .env_remove("KVSAN_OPTIONS")
        .output()
        .expect("run python3 (needed for the ctypes example)");
    let (stdout, stderr) = shim_common::texts(&out);
    assert!(out.status.success(), "{stdout}\n{stderr}");
    assert_toy_pool_outcome(&stdout, &stderr);
    assert!(
        stdout.contains("refused: kvsan_request_event: KVSAN_ERR_INVALID_ARGUMENT"),
        "{stdout}"
    );
}

#[test]
fn malformed_c_calls_return_error_codes_and_the_process_runs_on() {
    let exe = shim_common::compile_c(
        &shim_common::repo().join("shim/tests/c/malformed_calls.c"),
        "malformed_calls",
    );
    let out = Command::new(&exe)
        .env_remove("KVSAN_OPTIONS")
        .output()
        .expect("run the malformed-call program");
    let (stdout, stderr) = shim_common::texts(&out);
    assert!(out.status.success(), "{stdout}\n{stderr}");
    assert!(stdout.contains(" checked, 0 failed"), "{stdout}");
    // Refused calls are said, then only counted; no violation came of them.
    assert!(
        stderr.contains(
            "kvsan: call refused (status -1): `kvsan_pool_register`: argument `geometry` is null"
        ),
        "{stderr}"
    );
    assert!(
        stderr.contains("kvsan: further refused calls are only counted"),
        "{stderr}"
    );
    assert!(
        stderr
            .lines()
            .last()
            .unwrap_or_default()
            .starts_with("kvsan: 0 violations"),
        "{stderr}"
    );
}

#[test]
fn a_bad_kvsan_options_refuses_to_attach_loudly_and_the_program_runs_on() {
    let exe = shim_common::compile_c(
        &shim_common::repo().join("shim/examples/toy_pool.c"),
        "toy_pool_bad_options",
    );
    let out = Command::new(&exe)
        .env("KVSAN_OPTIONS", "on_violation=explode")
        .output()
        .expect("run the toy pool");
    let (stdout, stderr) = shim_common::texts(&out);
    // Every call is refused (the toy pool counts that as failures: exit 1),
    // but the process ran to its end: no crash, no signal.
    assert_eq!(out.status.code(), Some(1), "{stdout}\n{stderr}");
    assert!(
        stderr.contains("kvsan: NOT attached (pid ")
            && stderr.contains("bad value `explode` for option `on_violation`")
            && stderr.contains("this process runs UNSANITIZED"),
        "{stderr}"
    );
    assert!(!stderr.contains("kvsan: attached"), "{stderr}");
    assert!(stdout.contains("KVSAN_ERR_NOT_ATTACHED"), "{stdout}");
    // Nothing was shadowed, so there is no summary.
    assert!(!stderr.contains("violations"), "{stderr}");
}

/// A C engine's prefix cache: `kvsan_share` follows `prefix_share` (the
/// default `tenant`, and `salt` with `kvsan_declare_salt`), refusing a
/// share across the policy's line and one of a page not yet filled; the
/// cache itself holds pages as `KVSAN_PREFIX_CACHE_REQUEST` past their
/// writer's free and after its own eviction while a request shares them,
/// and a page it holds is read-only to its owner.
#[test]
fn a_c_prefix_cache_shares_only_what_the_policy_allows_and_only_full_pages() {
    let exe = shim_common::compile_c(
        &shim_common::repo().join("shim/tests/c/prefix_share.c"),
        "prefix_share",
    );
    for (policy, expected) in [
        (
            "tenant",
            &[
                "cache registers the full page: continue",
                "cache registers the half-written page: unwritten-share",
                "writer lets go of the cached page: continue",
                "same tenant: continue",
                "same tenant reads the shared page: continue",
                "other tenant: cross-domain-share",
                "half-written page: unwritten-share",
                "cache evicts the page a request still shares: continue",
                "same tenant reads it after the eviction: continue",
                "cache registers another page: continue",
                "writer writes the page the cache holds: foreign-write",
                "violations: 4",
            ][..],
        ),
        (
            "salt",
            &[
                "other tenant, same salt: continue",
                "same tenant, other salt: cross-domain-share",
                "violations: 1",
            ][..],
        ),
    ] {
        let out = Command::new(&exe)
            .arg(policy)
            .env("KVSAN_OPTIONS", format!("prefix_share={policy}"))
            .output()
            .expect("run the prefix-share program");
        let (stdout, stderr) = shim_common::texts(&out);
        assert!(out.status.success(), "{policy}: {stdout}\n{stderr}");
        for line in expected {
            assert!(
                stdout.contains(line),
                "{policy}: missing {line:?}\n{stdout}"
            );
        }
        // The reports name the kind and never a salt.
        assert!(
            stderr.contains("kvsan: ERROR: cross-domain-share"),
            "{stderr}"
        );
        if policy == "tenant" {
            // The cache is named as such, never by its reserved number.
            assert!(
                stderr.contains("kvsan: ERROR: unwritten-share in prefix cache (tenant 7)"),
                "{stderr}"
            );
            assert!(!stderr.contains("18446744073709551615"), "{stderr}");
        }
        assert!(
            !stderr.contains("5eed") && !stderr.contains("24301"),
            "{stderr}"
        );
    }
}

/// The batch checks over kernel argument buffers, in C: each layout passes
/// as built, and a wrong row, length, stride and slot are caught in the row
/// they hit; buffers a kernel could not use are refused naming the row.
#[test]
fn batch_checks_over_kernel_buffers_catch_a_wrong_row_length_stride_and_slot() {
    let exe = shim_common::compile_c(
        &shim_common::repo().join("shim/tests/c/batch_checks.c"),
        "batch_checks",
    );
    let out = Command::new(&exe)
        .env_remove("KVSAN_OPTIONS")
        .output()
        .expect("run the batch-check program");
    let (stdout, stderr) = shim_common::texts(&out);
    assert!(out.status.success(), "{stdout}\n{stderr}");
    for line in [
        "block table: continue, continue",
        "block table, rows swapped: foreign-read, foreign-read",
        "block table, length past what row 0 wrote: stale-read, continue",
        "block table, wrong stride: continue, foreign-read",
        "paged CSR, last page longer than written: continue, stale-read",
        "req_to_token, a slot never written: stale-read, continue",
        "slot_mapping, into A's page 0: continue, foreign-write",
        "block table, a page freed since: read-free-page, continue",
    ] {
        assert!(stdout.contains(line), "missing {line:?}\n{stdout}");
    }
    assert!(stdout.contains("violations: 12"), "{stdout}");
    assert_eq!(stderr.matches("kvsan: ERROR:").count(), 12, "{stderr}");
}
