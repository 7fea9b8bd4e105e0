//! The sanitizer's memory does not grow with the requests served: a request
//! that has ended and holds no page leaves the live map; the last
//! `ended_requests` of them are remembered, so activity after their end is
//! still caught; older ones are forgotten.

mod common;

use common::*;
use kvsan_sanitizer::{Owner, PageId, RequestEvent, RequestState, ViolationKind};

fn serve_one(f: &Fixture, who: Owner, page: u32, step: u64) {
    assert!(
        f.san
            .request_event_at(f.decode, who, RequestEvent::Queued)
            .unwrap()
            .is_continue()
    );
    assert!(
        f.san
            .request_event_at(f.decode, who, RequestEvent::Admitted)
            .unwrap()
            .is_continue()
    );
    let p = f.alloc(f.decode, page, who, step);
    f.write_all(f.decode, who, p, 0..SLOTS, step);
    f.free(f.decode, who, p, step);
    let v = f
        .san
        .request_event_at(f.decode, who, RequestEvent::Finished)
        .unwrap();
    assert!(v.is_continue(), "{v:?}");
}

#[test]
fn an_ended_request_leaves_the_live_map_and_its_late_activity_is_still_caught() {
    let f = fixture_with("quarantine_pages=0:ended_requests=2");
    serve_one(&f, A, 0, 1);
    assert_eq!(f.san.tracked_requests(), (0, 1));
    assert_eq!(f.san.request_state(A.request), Some(RequestState::Finished));
    // A late allocation for it is judged against its end.
    let (v, _) = f.san.alloc(f.decode, PageId(1), A, 2).unwrap();
    assert_eq!(v.kind(), Some(ViolationKind::TerminalRequestActivity));
}

#[test]
fn only_the_last_ended_requests_are_remembered() {
    let f = fixture_with("quarantine_pages=0:ended_requests=2");
    for r in 1..=3u64 {
        serve_one(&f, Owner::new(r, 1), 0, r);
    }
    assert_eq!(f.san.tracked_requests(), (0, 2));
    assert_eq!(
        f.san.request_state(kvsan_sanitizer::RequestId(1)),
        None,
        "forgotten"
    );
    assert_eq!(
        f.san.request_state(kvsan_sanitizer::RequestId(3)),
        Some(RequestState::Finished)
    );
    // What is given up: request 1's late activity is a new request's now.
    let (v, _) = f
        .san
        .alloc(f.decode, PageId(1), Owner::new(1, 1), 9)
        .unwrap();
    assert!(v.is_continue());
}

#[test]
fn a_hundred_thousand_requests_leave_nothing_behind_but_the_remembered_ones() {
    let f = fixture_with("quarantine_pages=0:ended_requests=1000:print_limit=1");
    for r in 0..100_000u64 {
        serve_one(&f, Owner::new(r + 1, (r % 6) as u32), (r % 8) as u32, r);
    }
    assert_eq!(f.san.tracked_requests(), (0, 1000));
    assert_eq!(f.san.violation_count(), 0);
}

#[test]
fn a_request_that_ends_holding_a_page_stays_live_until_the_page_is_freed() {
    let f = fixture_with("quarantine_pages=0");
    assert!(
        f.san
            .request_event_at(f.decode, A, RequestEvent::Admitted)
            .unwrap()
            .is_continue()
    );
    let p = f.alloc(f.decode, 0, A, 1);
    let v = f
        .san
        .request_event_at(f.decode, A, RequestEvent::Aborted)
        .unwrap();
    assert_eq!(v.kind(), Some(ViolationKind::PageLeak));
    assert_eq!(f.san.tracked_requests(), (1, 0));
    let v = f.san.free(f.decode, A, p, 2).unwrap();
    assert!(v.is_continue());
    assert_eq!(f.san.tracked_requests(), (0, 1));
}
