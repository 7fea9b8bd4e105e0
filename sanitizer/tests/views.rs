//! Each node's view of a request (`request_event_at`): a cancel one node
//! reports ends the request there, not on its peer until the peer reports
//! its own end; page leaks are judged on the ending node's pages; activity
//! in a pool is judged by that pool's node's view, or by the process's view
//! once that has ended the request.

mod common;

use common::*;
use kvsan_sanitizer::{RequestEvent, RequestState, ViolationKind};

#[test]
fn a_cancel_at_decode_does_not_end_the_request_for_prefill_before_it_is_told() {
    let f = fixture();
    for (pool, e) in [
        (f.decode, RequestEvent::Queued),
        (f.decode, RequestEvent::Admitted),
        (f.prefill, RequestEvent::Queued),
        (f.prefill, RequestEvent::Admitted),
        (f.prefill, RequestEvent::Prefilling),
    ] {
        assert!(f.san.request_event_at(pool, A, e).unwrap().is_continue());
    }
    let src = f.alloc(f.prefill, 0, A, 1);
    let dst = f.alloc(f.decode, 3, A, 1);
    // Decode cancels: it frees its page, then ends the request in its view.
    f.free(f.decode, A, dst, 2);
    let v = f
        .san
        .request_event_at(f.decode, A, RequestEvent::Aborted)
        .unwrap();
    assert!(
        v.is_continue(),
        "no page-leak: prefill's page is prefill's business"
    );
    // Prefill, not told yet, goes on: computes and ships.
    f.write_all(f.prefill, A, src, 0..SLOTS, 3);
    let more = f.alloc(f.prefill, 1, A, 3);
    assert!(
        f.san
            .request_event_at(f.prefill, A, RequestEvent::Transferring)
            .unwrap()
            .is_continue()
    );
    let m = manifest(A, &[src], &[dst], 0, SLOTS);
    assert!(f.san.transfer_send(f.prefill, &m).unwrap().is_continue());
    // The cancel arrives: prefill frees and ends the request in its view.
    f.free(f.prefill, A, src, 4);
    f.free(f.prefill, A, more, 4);
    let v = f
        .san
        .request_event_at(f.prefill, A, RequestEvent::Aborted)
        .unwrap();
    assert!(v.is_continue());
    assert_eq!(f.san.violation_count(), 0, "{}", f.out.text());
}

#[test]
fn work_after_the_node_doing_it_was_told_is_terminal_activity() {
    let f = fixture();
    assert!(
        f.san
            .request_event_at(f.decode, A, RequestEvent::Admitted)
            .unwrap()
            .is_continue()
    );
    let src = f.alloc(f.prefill, 0, A, 1);
    f.write_all(f.prefill, A, src, 0..SLOTS, 1);
    let dst = f.alloc(f.decode, 3, A, 1);
    f.free(f.decode, A, dst, 2);
    assert!(
        f.san
            .request_event_at(f.decode, A, RequestEvent::Aborted)
            .unwrap()
            .is_continue()
    );
    // Decode committing what it cancelled (fault commit-after-abort).
    let v = f.san.transfer_commit(f.decode, A, &[dst], 1).unwrap();
    assert_eq!(v.kind(), Some(ViolationKind::TerminalRequestActivity));
    // Prefill, once told, allocating for it again.
    f.free(f.prefill, A, src, 3);
    assert!(
        f.san
            .request_event_at(f.prefill, A, RequestEvent::Aborted)
            .unwrap()
            .is_continue()
    );
    let (v, _) = f
        .san
        .alloc(f.prefill, kvsan_sanitizer::PageId(1), A, 4)
        .unwrap();
    assert_eq!(v.kind(), Some(ViolationKind::TerminalRequestActivity));
    assert_eq!(f.san.violation_count(), 2);
}

#[test]
fn a_node_ending_a_request_while_holding_its_own_pages_leaks_them() {
    let f = fixture();
    for pool in [f.decode, f.prefill] {
        assert!(
            f.san
                .request_event_at(pool, A, RequestEvent::Admitted)
                .unwrap()
                .is_continue()
        );
    }
    let held = f.alloc(f.prefill, 0, A, 1);
    let _other = f.alloc(f.decode, 3, A, 1);
    // Prefill's view ends with prefill's page held: a leak of that page only.
    let v = f
        .san
        .request_event_at(f.prefill, A, RequestEvent::Finished)
        .unwrap();
    assert_eq!(v.kind(), Some(ViolationKind::PageLeak));
    let text = f.out.text();
    assert!(
        text.contains(&format!("1 page reference(s): pool 1 {held}")),
        "{text}"
    );
}

#[test]
fn the_process_view_still_governs_every_pool() {
    let f = fixture();
    let page = f.alloc(f.prefill, 0, A, 1);
    f.free(f.prefill, A, page, 2);
    assert!(f.san.request_event(A, RequestEvent::Aborted).is_continue());
    let (v, _) = f
        .san
        .alloc(f.decode, kvsan_sanitizer::PageId(2), A, 3)
        .unwrap();
    assert_eq!(v.kind(), Some(ViolationKind::TerminalRequestActivity));
    let v = f
        .san
        .request_event_at(f.decode, A, RequestEvent::Admitted)
        .unwrap();
    assert_eq!(v.kind(), Some(ViolationKind::TerminalRequestActivity));
    assert_eq!(f.san.request_state(A.request), Some(RequestState::Aborted));
}

#[test]
fn a_pool_no_one_registered_is_an_error_not_a_view() {
    let f = fixture();
    let err = f
        .san
        .request_event_at(kvsan_sanitizer::PoolId(7), A, RequestEvent::Queued)
        .unwrap_err()
        .to_string();
    assert!(err.contains("unknown pool 7"), "{err}");
}
