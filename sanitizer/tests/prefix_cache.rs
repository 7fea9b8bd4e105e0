//! The prefix cache as a page holder ([`RequestId::PREFIX_CACHE`]): it
//! takes a read-only reference with `share` when it registers a full page
//! (with the writer's tenant) and drops it with `free` when it evicts the
//! page; in between, the page outlives its writer's reference and is shared
//! with the requests that hit the cache. Each behaviour has a test that
//! provokes the violation and one that shows the legal neighbour.

mod common;

use common::*;
use kvsan_sanitizer::{
    Owner, PageRef, PageState, RequestEvent, RequestId, SanitizerError, TenantId, Verdict,
    ViolationKind,
};

/// The cache holding pages that requests of tenant 1 (`A`, `A2`) wrote.
const CACHE: Owner = Owner {
    request: RequestId::PREFIX_CACHE,
    tenant: TenantId(1),
};

/// Asserts `v` aborts with `kind`, that it is the only violation, and that
/// the report matches `tests/golden/<golden>.txt` and names the cache as a
/// cache, never by its reserved number.
fn assert_provoked_as(f: &Fixture, v: Verdict, kind: ViolationKind, golden: &str) {
    assert_eq!(v.kind(), Some(kind), "verdict {v:?}\n{}", f.out.text());
    let recorded = f.san.violations();
    assert_eq!(recorded.len(), 1, "{recorded:?}");
    assert_eq!(recorded[0].kind, kind);
    let text = f.out.text();
    assert!(
        !text.contains(&RequestId::PREFIX_CACHE.0.to_string()),
        "the cache is shown by name: {text}"
    );
    assert_golden(golden, &text);
}

fn assert_clean(f: &Fixture, v: Verdict) {
    assert!(v.is_continue(), "verdict {v:?}\n{}", f.out.text());
    assert_eq!(f.san.violation_count(), 0, "{}", f.out.text());
}

fn state(f: &Fixture, page: PageRef) -> PageState {
    f.san.page_info(f.decode, page.page).unwrap().state
}

/// `A` (admitted) filled page 2 of the decode pool.
fn filled(f: &Fixture) -> PageRef {
    assert!(f.san.request_event(A, RequestEvent::Admitted).is_continue());
    let page = f.alloc(f.decode, 2, A, 1);
    f.write_all(f.decode, A, page, 0..SLOTS, 2);
    page
}

/// `A` filled page 2, the cache registered it, and `A` let go of it.
fn cached_after_its_writer_let_go(f: &Fixture) -> PageRef {
    let page = filled(f);
    assert_clean(f, f.san.share(f.decode, page, CACHE).unwrap());
    f.free(f.decode, A, page, 3);
    page
}

// ------------------------------------------------------------- registering

#[test]
fn the_cache_registering_a_page_its_writer_filled_passes_and_is_no_request() {
    let f = fixture();
    let page = filled(&f);
    let tracked = f.san.tracked_requests();
    let v = f.san.share(f.decode, page, CACHE).unwrap();
    assert_clean(&f, v);
    let info = f.san.page_info(f.decode, page.page).unwrap();
    assert!(info.shared && info.owner == A);
    // No lifecycle record: the cache can never leak pages or be ended.
    assert_eq!(f.san.request_state(RequestId::PREFIX_CACHE), None);
    assert_eq!(f.san.tracked_requests(), tracked);
}

/// vLLM #37152's shape at registration: a page handed to the cache before
/// its owner's step filled it.
#[test]
fn the_cache_registering_a_half_written_page_is_unwritten_share() {
    let f = fixture();
    let page = f.alloc(f.decode, 2, A, 1);
    f.write_all(f.decode, A, page, 0..10, 2);
    let v = f.san.share(f.decode, page, CACHE).unwrap();
    assert_provoked_as(
        &f,
        v,
        ViolationKind::UnwrittenShare,
        "prefix-cache-unwritten-share",
    );
    assert!(
        !f.san.page_info(f.decode, page.page).unwrap().shared,
        "a refused registration adds no holder"
    );
}

/// LMCache #4991's shape: a store that has not completed is registered.
#[test]
fn the_cache_registering_a_page_whose_transfer_is_not_committed_is_read_during_transfer() {
    let f = fixture();
    let (dst, _) = received(&f);
    let v = f.san.share(f.decode, dst, CACHE).unwrap();
    assert_eq!(v.kind(), Some(ViolationKind::ReadDuringTransfer));
    let text = f.out.text();
    assert!(
        text.contains("read-during-transfer in prefix cache (tenant 1) sharing"),
        "{text}"
    );
}

#[test]
fn the_cache_registering_a_received_page_after_its_commit_passes() {
    let f = fixture();
    let (dst, _) = received(&f);
    assert!(
        f.san
            .transfer_commit(f.decode, A, &[dst], 16)
            .unwrap()
            .is_continue()
    );
    assert_clean(&f, f.san.share(f.decode, dst, CACHE).unwrap());
}

fn received(f: &Fixture) -> (PageRef, kvsan_sanitizer::Manifest) {
    let src = f.alloc(f.prefill, 0, A, 1);
    f.write_all(f.prefill, A, src, 0..SLOTS, 2);
    let dst = f.alloc(f.decode, 6, A, 1);
    let m = manifest(A, &[src], &[dst], 0, 16);
    assert!(f.san.transfer_send(f.prefill, &m).unwrap().is_continue());
    assert!(f.receive(f.decode, &m).unwrap().is_continue());
    (dst, m)
}

#[test]
fn the_cache_registering_through_a_stale_tag_or_a_freed_page_is_refused() {
    let f = fixture();
    let old = f.alloc(f.decode, 5, A, 1);
    f.write_all(f.decode, A, old, 0..SLOTS, 2);
    f.free(f.decode, A, old, 3);
    let v = f.san.share(f.decode, old, CACHE).unwrap();
    assert_eq!(v.kind(), Some(ViolationKind::ReadFreePage));
    let new = f.alloc(f.decode, 5, B, 4);
    f.write_all(f.decode, B, new, 0..SLOTS, 5);
    let v = f.san.share(f.decode, old, CACHE).unwrap();
    assert_eq!(v.kind(), Some(ViolationKind::GenerationMismatch));
    assert!(!f.san.page_info(f.decode, new.page).unwrap().shared);
}

/// The cache never reads, so its own reference is not held to the policy,
/// whatever tenant it carries; the requests it shares pages with are.
#[test]
fn the_caches_registration_is_not_held_to_the_policy_but_each_share_from_it_is() {
    let f = fixture_with("prefix_share=off");
    let page = filled(&f);
    let other_tenant = Owner {
        request: RequestId::PREFIX_CACHE,
        tenant: TenantId(5),
    };
    assert_clean(&f, f.san.share(f.decode, page, CACHE).unwrap());
    assert_clean(&f, f.san.share(f.decode, page, other_tenant).unwrap());
    let v = f.san.share(f.decode, page, A2).unwrap();
    assert_eq!(v.kind(), Some(ViolationKind::CrossDomainShare));
}

/// Pages of different writers carry different tenants in the cache's
/// owner: nothing ties the cache to one tenant.
#[test]
fn the_cache_holds_pages_of_several_tenants_at_once() {
    let f = fixture();
    let a = filled(&f);
    let b = f.alloc(f.decode, 3, B, 1);
    f.write_all(f.decode, B, b, 0..SLOTS, 2);
    let cache_b = Owner {
        request: RequestId::PREFIX_CACHE,
        tenant: B.tenant,
    };
    assert_clean(&f, f.san.share(f.decode, a, CACHE).unwrap());
    assert_clean(&f, f.san.share(f.decode, b, cache_b).unwrap());
    f.free(f.decode, A, a, 3);
    f.free(f.decode, B, b, 3);
    assert_clean(&f, f.san.free(f.decode, CACHE, a, 4).unwrap());
    assert_clean(&f, f.san.free(f.decode, cache_b, b, 4).unwrap());
    assert_eq!(state(&f, a), PageState::Quarantined);
    assert_eq!(state(&f, b), PageState::Quarantined);
}

#[test]
fn the_cache_may_not_allocate() {
    let f = fixture();
    let err = f
        .san
        .alloc(f.decode, kvsan_sanitizer::PageId(0), CACHE, 1)
        .unwrap_err();
    assert!(
        matches!(err, SanitizerError::ReservedRequest { .. }),
        "{err}"
    );
    assert!(err.to_string().contains("reserved for the prefix cache"));
    assert_eq!(state_of_page_0(&f), PageState::Free);
}

fn state_of_page_0(f: &Fixture) -> PageState {
    f.san
        .page_info(f.decode, kvsan_sanitizer::PageId(0))
        .unwrap()
        .state
}

// ------------------------------------------ after the writer let go

#[test]
fn after_its_writer_let_go_a_request_of_the_same_tenant_shares_and_reads_the_page() {
    let f = fixture();
    let page = cached_after_its_writer_let_go(&f);
    let info = f.san.page_info(f.decode, page.page).unwrap();
    assert_eq!(info.state, PageState::Owned);
    assert!(info.owner_released && info.shared);
    assert_clean(&f, f.san.share(f.decode, page, A2).unwrap());
    let v = f.san.read(f.decode, A2, &[page], 16, ALL, 4).unwrap();
    assert_clean(&f, v);
}

#[test]
fn after_its_writer_let_go_a_request_of_another_tenant_is_cross_domain_share() {
    let f = fixture();
    let page = cached_after_its_writer_let_go(&f);
    let v = f.san.share(f.decode, page, B).unwrap();
    assert_provoked_as(
        &f,
        v,
        ViolationKind::CrossDomainShare,
        "prefix-cache-cross-domain-share",
    );
    assert_eq!(
        f.san.read(f.decode, B, &[page], 16, ALL, 5).unwrap().kind(),
        Some(ViolationKind::ForeignRead),
        "a refused share lets nobody read"
    );
}

#[test]
fn the_writer_ending_after_it_let_go_of_a_cached_page_leaks_nothing() {
    let f = fixture();
    let _page = cached_after_its_writer_let_go(&f);
    let v = f.san.request_event(A, RequestEvent::Finished);
    assert_clean(&f, v);
    assert_eq!(f.san.tracked_requests().0, 0, "A left the live map");
}

/// The cache's reference does not hide the writer's own: a writer that
/// ends still holding it leaks the page.
#[test]
fn the_writer_ending_while_it_still_holds_a_cached_page_is_page_leak() {
    let f = fixture();
    let page = filled(&f);
    assert_clean(&f, f.san.share(f.decode, page, CACHE).unwrap());
    let v = f.san.request_event(A, RequestEvent::Finished);
    assert_eq!(v.kind(), Some(ViolationKind::PageLeak));
    assert_eq!(f.san.violations()[0].request, A.request);
}

// ---------------------------------------------------------------- eviction

#[test]
fn the_cache_evicting_a_page_a_request_still_shares_does_not_quarantine_it() {
    let f = fixture();
    let page = cached_after_its_writer_let_go(&f);
    assert_clean(&f, f.san.share(f.decode, page, A2).unwrap());
    assert_clean(&f, f.san.free(f.decode, CACHE, page, 5).unwrap());
    let info = f.san.page_info(f.decode, page.page).unwrap();
    assert_eq!(info.state, PageState::Owned);
    assert!(info.shared);
    let v = f.san.read(f.decode, A2, &[page], 16, ALL, 6).unwrap();
    assert_clean(&f, v);
    // The last holder lets go: now it is quarantined.
    f.free(f.decode, A2, page, 7);
    assert_eq!(state(&f, page), PageState::Quarantined);
}

#[test]
fn after_the_last_holder_the_cache_lets_go_the_page_is_quarantined_and_unreadable() {
    let f = fixture();
    let page = cached_after_its_writer_let_go(&f);
    assert_clean(&f, f.san.free(f.decode, CACHE, page, 5).unwrap());
    assert_eq!(state(&f, page), PageState::Quarantined);
    let v = f.san.share(f.decode, page, A2).unwrap();
    assert_eq!(v.kind(), Some(ViolationKind::ReadFreePage));
}

#[test]
fn the_cache_evicting_a_page_its_writer_still_owns_leaves_it_to_the_writer() {
    let f = fixture();
    let page = filled(&f);
    assert_clean(&f, f.san.share(f.decode, page, CACHE).unwrap());
    assert_clean(&f, f.san.free(f.decode, CACHE, page, 3).unwrap());
    let info = f.san.page_info(f.decode, page.page).unwrap();
    assert_eq!(info.state, PageState::Owned);
    assert!(!info.shared && !info.owner_released);
    f.free(f.decode, A, page, 4);
    assert_eq!(state(&f, page), PageState::Quarantined);
}

#[test]
fn the_cache_evicting_a_page_it_does_not_hold_is_foreign_free() {
    let f = fixture();
    let page = filled(&f);
    let v = f.san.free(f.decode, CACHE, page, 3).unwrap();
    assert_eq!(v.kind(), Some(ViolationKind::ForeignFree));
    let text = f.out.text();
    assert!(
        text.contains("foreign-free in prefix cache (tenant 1) freeing"),
        "{text}"
    );
    assert_eq!(state(&f, page), PageState::Owned, "the writer keeps it");
}
