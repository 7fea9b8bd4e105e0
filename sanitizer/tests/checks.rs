//! `Sanitizer::checks`: every hook call with valid arguments is counted, by
//! hook; reads count the block-table pages they check; the summary line
//! gives the total.

mod common;

use common::*;
use kvsan_sanitizer::Checks;

#[test]
fn checks_are_counted_per_hook_with_the_pages_each_read_checks() {
    let f = fixture();
    assert_eq!(f.san.checks(), Checks::default());
    let p0 = f.alloc(f.prefill, 0, A, 1);
    let p1 = f.alloc(f.prefill, 1, A, 1);
    f.write_all(f.prefill, A, p0, 0..SLOTS, 2);
    f.write_all(f.prefill, A, p1, 0..3, 2);
    // Tokens 0..SLOTS + 3 span both pages; tokens 0..2 only the first.
    let tokens = SLOTS as usize + 3;
    assert!(
        f.san
            .read(f.prefill, A, &[p0, p1], tokens, ALL, 3)
            .unwrap()
            .is_continue()
    );
    assert!(
        f.san
            .read(f.prefill, A, &[p0, p1], 2, ALL, 4)
            .unwrap()
            .is_continue()
    );
    let d0 = f.alloc(f.decode, 0, A, 5);
    let d1 = f.alloc(f.decode, 1, A, 5);
    let m = manifest(A, &[p0, p1], &[d0, d1], 0, tokens as u32);
    assert!(f.san.transfer_send(f.prefill, &m).unwrap().is_continue());
    assert!(f.receive(f.decode, &m).unwrap().is_continue());
    assert!(
        f.san
            .transfer_commit(f.decode, A, &[d0, d1], tokens)
            .unwrap()
            .is_continue()
    );
    f.free(f.prefill, A, p0, 6);

    let c = f.san.checks();
    assert_eq!(
        c,
        Checks {
            read_calls: 2,
            read_pages: 3,
            writes: 2,
            // Send, receive, commit, and a landing and a verification of
            // each of the two pages received.
            transfers: 7,
            allocs: 4,
            frees: 1,
            ..Checks::default()
        }
    );
    assert_eq!(c.total(), 3 + 2 + 7 + 4 + 1);
    assert_eq!(f.san.summary(), "kvsan: 0 violations; 17 checks");
}

#[test]
fn a_hook_refused_as_misuse_is_not_counted() {
    let f = fixture();
    let page = f.alloc(f.decode, 0, A, 1);
    // Slot range beyond the page: an API error, not a check.
    assert!(
        f.san
            .write(f.decode, A, page, 0..SLOTS + 1, ALL, 2)
            .is_err()
    );
    assert_eq!(f.san.checks().writes, 0);
    assert_eq!(f.san.checks().allocs, 1);
}

#[test]
fn kernel_checks_are_counted_per_pool_and_in_the_summary() {
    let f = fixture();
    let page = f.alloc(f.decode, 0, A, 1);
    let shadow = f.san.kernel_shadow(f.decode).unwrap();
    for layer in 0..LAYERS {
        assert_eq!(
            shadow.store(A.request, page, layer, 0, 2),
            kvsan_sanitizer::Check::Ok
        );
    }
    shadow.count(0, u64::from(LAYERS));
    for layer in 0..LAYERS {
        assert_eq!(
            shadow.check_read(A.request, page, layer, 1),
            kvsan_sanitizer::Check::Ok
        );
    }
    shadow.count(u64::from(LAYERS), 0);
    let c = f.san.checks();
    assert_eq!(c.kernel_stores, u64::from(LAYERS));
    assert_eq!(c.kernel_read_pages, u64::from(LAYERS));
    assert_eq!(c.total(), 1 + 2 * u64::from(LAYERS));
}
