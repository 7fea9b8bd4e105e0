//! A C engine with a host-memory KV tier of its own (`shim/tests/c/tier_blocks.c`)
//! reports each store into a tier block, its completion, each load back into a
//! page and the digest of what landed through kvsan.h (ABI 1.6): a request's
//! page stored and loaded back is read as written (its unstored slot is not);
//! two pages in one block, another request's block, KV that is not what was
//! stored, a source page reused while its store was in flight and a block
//! released or never completed are each caught with their kind, and the
//! digests never appear in a report.

mod shim_common;

use std::process::Command;

/// The digests the program passes (`DIGEST`, `OTHER_DIGEST`).
const DIGESTS: [u64; 2] = [0x7e17d16e57, 0xbadd16e57];

#[test]
fn a_c_engines_tier_keeps_each_pages_identity_through_the_block() {
    let exe = shim_common::compile_c(
        &shim_common::repo().join("shim/tests/c/tier_blocks.c"),
        "tier_blocks",
    );
    let out = Command::new(&exe)
        .env_remove("KVSAN_OPTIONS")
        .output()
        .expect("run the tier program");
    let (stdout, stderr) = shim_common::texts(&out);
    assert!(out.status.success(), "{stdout}\n{stderr}");
    for line in [
        "A store page 0 into block 5: continue",
        "A store done: continue",
        "A load block 5: continue",
        "A verify: continue",
        "A read 3 tokens: continue",
        "A read 4 tokens: stale-read",
        "B store into block 5: tier-block-aliased",
        "B load block 5: tier-foreign-load",
        "A verify, other digest: tier-digest-mismatch",
        "B store done after reuse: tier-store-source-reused",
        "B load block 6: tier-load-unstored",
        "A load released block 5: tier-load-unstored",
        "store done with stored = 2: KVSAN_ERR_INVALID_ARGUMENT",
        "violations: 7",
        "failures: 0",
    ] {
        assert!(stdout.contains(line), "missing {line:?}\n{stdout}");
    }
    assert_eq!(stderr.matches("kvsan: ERROR:").count(), 7, "{stderr}");
    for summary in [
        "kvsan: ERROR: tier-block-aliased in request 2 (tenant 8) storing to a tier pool 0 page 2@gen 1",
        "kvsan: ERROR: tier-foreign-load in request 2 (tenant 8) loading from a tier pool 0 page 2@gen 1",
        "kvsan: ERROR: tier-store-source-reused in request 2 (tenant 8) completing a tier store pool 0 page 3@gen 1 owned by request 1",
    ] {
        assert!(stderr.contains(summary), "missing {summary:?}\n{stderr}");
    }
    for digest in DIGESTS {
        for shown in [
            format!("{digest:x}"),
            format!("{digest:X}"),
            digest.to_string(),
        ] {
            assert!(!stderr.contains(&shown), "{shown} in\n{stderr}");
        }
    }
}
