//! The batch checks over kernel argument buffers, from Rust: the legal
//! buffers pass, a wrong row is caught in that row, and a buffer a kernel
//! could not use reports nothing. (Every layout's wrong row, length, stride
//! and slot are in the C test `shim/tests/c/batch_checks.c`.)

mod common;

use common::*;
use kvsan_sanitizer::{SanitizerError, ViolationKind};

/// A's pages 0 (full) and 1 (2 slots); B's page 2 (full).
fn pages(f: &Fixture) {
    let a0 = f.alloc(f.decode, 0, A, 1);
    f.write_all(f.decode, A, a0, 0..SLOTS, 1);
    let a1 = f.alloc(f.decode, 1, A, 1);
    f.write_all(f.decode, A, a1, 0..2, 1);
    let b2 = f.alloc(f.decode, 2, B, 1);
    f.write_all(f.decode, B, b2, 0..SLOTS, 1);
}

#[test]
fn a_block_table_as_built_passes_and_a_row_pointing_at_another_requests_page_is_foreign_read() {
    let f = fixture();
    pages(&f);
    let owners = [A, B];
    let v = f
        .san
        .check_block_table(f.decode, &owners, &[0, 1, 2, -1], 2, &[18, 16], ALL, 2)
        .unwrap();
    assert!(v.iter().all(|v| v.is_continue()), "{v:?}\n{}", f.out.text());
    let v = f
        .san
        .check_block_table(f.decode, &owners, &[0, 1, 0, -1], 2, &[18, 16], ALL, 2)
        .unwrap();
    assert!(v[0].is_continue());
    assert_eq!(v[1].kind(), Some(ViolationKind::ForeignRead));
    assert_eq!(f.san.violation_count(), 1);
}

#[test]
fn a_buffer_no_kernel_could_use_is_refused_naming_the_row_and_reports_nothing() {
    let f = fixture();
    pages(&f);
    let owners = [A, B];
    // Row 0 alone would be a foreign read; row 1's page index is past the pool.
    let err = f
        .san
        .check_block_table(f.decode, &owners, &[2, 1, 99, -1], 2, &[18, 16], ALL, 2)
        .unwrap_err();
    assert!(
        matches!(err, SanitizerError::BadBatch { row: 1, .. }),
        "{err}"
    );
    assert!(err.to_string().contains("page index 99"), "{err}");
    assert_eq!(f.san.violation_count(), 0, "{}", f.out.text());
    let err = f
        .san
        .check_paged_csr(f.decode, &owners, &[0, 2], &[0, 1], &[2, 4], ALL, 2)
        .unwrap_err();
    assert!(
        err.to_string()
            .contains("`indptr` has 2 entries, the batch needs 3"),
        "{err}"
    );
}

#[test]
fn a_length_far_past_the_buffer_is_refused_without_allocating_for_it() {
    let f = fixture();
    pages(&f);
    let err = f
        .san
        .check_block_table(f.decode, &[A], &[0, 1], 2, &[i32::MAX], ALL, 2)
        .unwrap_err();
    assert!(
        matches!(err, SanitizerError::BadBatch { row: 0, .. }),
        "{err}"
    );
    assert!(
        err.to_string().contains("past the buffer's 2 entries"),
        "{err}"
    );
}
