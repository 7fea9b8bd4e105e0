//! Every violation kind: a test that provokes it (and compares its report with
//! the golden file `tests/golden/<kind>.txt`), and a test showing that the
//! legal neighbour of the provoking sequence passes.

mod common;

use common::*;
use kvsan_sanitizer::{
    PageId, PageRef, PageState, RequestEvent, TierBlockId, TierBlockState, Verdict, ViolationKind,
};

/// Asserts `v` aborts with `kind`, that exactly one violation was recorded,
/// and that its report matches the golden file.
fn assert_provoked(f: &Fixture, v: Verdict, kind: ViolationKind) {
    assert_eq!(v.kind(), Some(kind), "verdict {v:?}\n{}", f.out.text());
    let recorded = f.san.violations();
    assert_eq!(recorded.len(), 1, "{recorded:?}");
    assert_eq!(recorded[0].kind, kind);
    assert_eq!(f.san.count(kind), 1);
    let text = f.out.text();
    assert!(
        text.contains(&format!("kvsan: ERROR: {}", kind.name())),
        "{text}"
    );
    assert_golden(kind.name(), &text);
}

fn assert_clean(f: &Fixture, v: Verdict) {
    assert!(v.is_continue(), "verdict {v:?}\n{}", f.out.text());
    assert_eq!(f.san.violation_count(), 0, "{}", f.out.text());
    assert!(f.out.text().is_empty());
}

// ---------------------------------------------------------------- stale-read

/// The incident: request 7 gets page 3 after request 4 freed it, writes one
/// token (the placeholder), then attention reads the whole page.
fn recycled_page(f: &Fixture) -> PageRef {
    let old = f.alloc(f.decode, 3, A, 10);
    f.write_all(f.decode, A, old, 0..SLOTS, 11);
    f.free(f.decode, A, old, 30);
    let new = f.alloc(f.decode, 3, B, 41);
    f.write_all(f.decode, B, new, 0..1, 42);
    new
}

#[test]
fn reading_slots_a_recycled_page_still_holds_from_another_request_is_stale_read() {
    let f = fixture();
    let page = recycled_page(&f);
    let v = f.san.read(f.decode, B, &[page], 16, ALL, 43).unwrap();
    assert_provoked(&f, v, ViolationKind::StaleRead);
}

#[test]
fn reading_only_the_slots_the_owner_wrote_passes() {
    let f = fixture();
    let page = recycled_page(&f);
    let v = f.san.read(f.decode, B, &[page], 1, ALL, 43).unwrap();
    assert_clean(&f, v);
}

#[test]
fn reading_a_layer_the_owner_has_not_written_yet_is_stale_read_but_earlier_layers_pass() {
    let f = fixture();
    let page = f.alloc(f.decode, 0, A, 1);
    assert!(
        f.san
            .write(f.decode, A, page, 0..4, 0..10, 2)
            .unwrap()
            .is_continue()
    );
    assert!(
        f.san
            .read(f.decode, A, &[page], 4, 0..10, 3)
            .unwrap()
            .is_continue()
    );
    let v = f.san.read(f.decode, A, &[page], 4, 0..11, 3).unwrap();
    assert_eq!(v.kind(), Some(ViolationKind::StaleRead));
}

// -------------------------------------------------------------- foreign-read

fn written_page(f: &Fixture) -> PageRef {
    let page = f.alloc(f.decode, 2, A, 1);
    f.write_all(f.decode, A, page, 0..SLOTS, 2);
    page
}

#[test]
fn reading_another_requests_page_is_foreign_read() {
    let f = fixture();
    let page = written_page(&f);
    let v = f.san.read(f.decode, B, &[page], 16, ALL, 3).unwrap();
    assert_provoked(&f, v, ViolationKind::ForeignRead);
}

#[test]
fn reading_a_page_shared_by_the_prefix_cache_passes() {
    let f = fixture();
    let page = written_page(&f);
    assert!(f.san.share(f.decode, page, A2).unwrap().is_continue());
    let v = f.san.read(f.decode, A2, &[page], 16, ALL, 3).unwrap();
    assert_clean(&f, v);
}

// ------------------------------------------------------- generation-mismatch

fn reallocated(f: &Fixture) -> (PageRef, PageRef) {
    let old = f.alloc(f.decode, 5, A, 1);
    f.write_all(f.decode, A, old, 0..SLOTS, 2);
    f.free(f.decode, A, old, 3);
    let new = f.alloc(f.decode, 5, B, 4);
    f.write_all(f.decode, B, new, 0..SLOTS, 5);
    (old, new)
}

#[test]
fn reading_through_a_stale_block_table_is_generation_mismatch() {
    let f = fixture();
    let (old, _) = reallocated(&f);
    let v = f.san.read(f.decode, A, &[old], 16, ALL, 6).unwrap();
    assert_provoked(&f, v, ViolationKind::GenerationMismatch);
}

#[test]
fn reading_through_the_current_tag_passes() {
    let f = fixture();
    let (_, new) = reallocated(&f);
    let v = f.san.read(f.decode, B, &[new], 16, ALL, 6).unwrap();
    assert_clean(&f, v);
}

#[test]
fn writing_through_a_stale_tag_is_generation_mismatch() {
    let f = fixture();
    let (old, _) = reallocated(&f);
    let v = f.san.write(f.decode, A, old, 0..1, ALL, 6).unwrap();
    assert_eq!(v.kind(), Some(ViolationKind::GenerationMismatch));
}

// ------------------------------------------------------------ read-free-page

#[test]
fn reading_a_freed_page_is_read_free_page() {
    let f = fixture();
    let page = written_page(&f);
    f.free(f.decode, A, page, 3);
    let v = f.san.read(f.decode, A, &[page], 16, ALL, 4).unwrap();
    assert_provoked(&f, v, ViolationKind::ReadFreePage);
}

#[test]
fn reading_before_the_free_passes() {
    let f = fixture();
    let page = written_page(&f);
    let v = f.san.read(f.decode, A, &[page], 16, ALL, 3).unwrap();
    assert_clean(&f, v);
    f.free(f.decode, A, page, 4);
}

// ------------------------------------------------------- cross-domain-share

/// `prefix_share=tenant` (the default): request 7 of tenant 2 is handed a
/// page request 4 of tenant 1 filled.
#[test]
fn sharing_a_page_across_tenants_is_cross_domain_share() {
    let f = fixture();
    let page = written_page(&f);
    let v = f.san.share(f.decode, page, B).unwrap();
    assert_provoked(&f, v, ViolationKind::CrossDomainShare);
    let info = f.san.page_info(f.decode, page.page).unwrap();
    assert!(!info.shared, "a refused share adds no sharer");
    assert_eq!(
        f.san.read(f.decode, B, &[page], 16, ALL, 4).unwrap().kind(),
        Some(ViolationKind::ForeignRead),
        "nor does it let the sharer read"
    );
}

#[test]
fn sharing_a_page_within_its_tenant_passes() {
    let f = fixture();
    let page = written_page(&f);
    let v = f.san.share(f.decode, page, A2).unwrap();
    assert_clean(&f, v);
}

#[test]
fn under_the_salt_policy_only_the_writers_salt_shares() {
    let f = fixture_with("prefix_share=salt");
    // Salts are declared before the pages are taken.
    f.san.declare_salt(A, 0xfeed);
    f.san.declare_salt(A2, 0xbeef);
    f.san.declare_salt(B, 0xfeed);
    let page = written_page(&f);
    // Another tenant with the same salt shares, as vLLM's cache_salt does.
    assert!(f.san.share(f.decode, page, B).unwrap().is_continue());
    // The writer's own tenant with another salt does not.
    let v = f.san.share(f.decode, page, A2).unwrap();
    assert_eq!(v.kind(), Some(ViolationKind::CrossDomainShare));
    let text = f.out.text();
    assert!(text.contains("different salts"), "{text}");
    assert!(
        !text.contains("feed") && !text.contains("beef") && !text.contains("65261"),
        "a report never shows a salt: {text}"
    );
    // A request without a salt does not share a salted page.
    let c = kvsan_sanitizer::Owner::new(12, 3);
    let v = f.san.share(f.decode, page, c).unwrap();
    assert_eq!(v.kind(), Some(ViolationKind::CrossDomainShare));
}

/// A salt narrows sharing under the default `tenant` policy too: a page
/// written with a salt is shared only within its tenant and with the same
/// salt (vLLM's `cache_salt` inside one API key).
#[test]
fn under_the_tenant_policy_a_salt_narrows_sharing_within_the_tenant() {
    let f = fixture();
    f.san.declare_salt(A, 0xfeed);
    f.san.declare_salt(A2, 0xbeef);
    let same_salt = kvsan_sanitizer::Owner::new(11, A.tenant.0);
    f.san.declare_salt(same_salt, 0xfeed);
    let unsalted = kvsan_sanitizer::Owner::new(12, A.tenant.0);
    let other_tenant = kvsan_sanitizer::Owner::new(13, 2);
    f.san.declare_salt(other_tenant, 0xfeed);
    let page = written_page(&f);
    assert!(
        f.san
            .share(f.decode, page, same_salt)
            .unwrap()
            .is_continue()
    );
    let v = f.san.share(f.decode, page, A2).unwrap();
    assert_eq!(v.kind(), Some(ViolationKind::CrossDomainShare));
    let v = f.san.share(f.decode, page, unsalted).unwrap();
    assert_eq!(v.kind(), Some(ViolationKind::CrossDomainShare));
    let v = f.san.share(f.decode, page, other_tenant).unwrap();
    assert_eq!(v.kind(), Some(ViolationKind::CrossDomainShare));
    let text = f.out.text();
    for said in [
        "prefix_share=tenant: the page was written for the sharer's tenant 1, but the page and the sharer carry different salts",
        "prefix_share=tenant: the page was written for the sharer's tenant 1, but the page carries a salt, the sharer declared none",
        "prefix_share=tenant: the page was written for tenant 1, the sharer is tenant 2",
    ] {
        assert!(text.contains(said), "missing {said:?}: {text}");
    }
    assert!(
        !text.contains("feed") && !text.contains("beef") && !text.contains("65261"),
        "a report never shows a salt: {text}"
    );
}

/// Its legal neighbour: unsalted requests of one tenant share unsalted
/// pages, and a salted request does not take an unsalted page.
#[test]
fn under_the_tenant_policy_unsalted_requests_of_the_tenant_share_unsalted_pages() {
    let f = fixture();
    let page = written_page(&f);
    assert!(f.san.share(f.decode, page, A2).unwrap().is_continue());
    assert_eq!(f.san.violation_count(), 0, "{}", f.out.text());
    let salted = kvsan_sanitizer::Owner::new(11, A.tenant.0);
    f.san.declare_salt(salted, 0xfeed);
    let v = f.san.share(f.decode, page, salted).unwrap();
    assert_eq!(v.kind(), Some(ViolationKind::CrossDomainShare));
    assert!(
        f.out
            .text()
            .contains("but the page carries no salt, the sharer declared one"),
        "{}",
        f.out.text()
    );
}

#[test]
fn under_the_global_policy_any_request_shares_and_under_off_none_does() {
    let f = fixture_with("prefix_share=global");
    let page = written_page(&f);
    assert!(f.san.share(f.decode, page, B).unwrap().is_continue());
    assert_eq!(f.san.violation_count(), 0);

    let f = fixture_with("prefix_share=off");
    let page = written_page(&f);
    let v = f.san.share(f.decode, page, A2).unwrap();
    assert_eq!(v.kind(), Some(ViolationKind::CrossDomainShare));
    assert!(
        f.out.text().contains("prefix_share=off"),
        "{}",
        f.out.text()
    );
}

// ----------------------------------------------------------- unwritten-share

/// vLLM #37152's shape: a page is handed to a second request before its
/// owner's step wrote it (here: slots 0..10 of 16 written).
#[test]
fn sharing_a_page_its_owner_has_not_filled_is_unwritten_share() {
    let f = fixture();
    let page = f.alloc(f.decode, 2, A, 1);
    f.write_all(f.decode, A, page, 0..10, 2);
    let v = f.san.share(f.decode, page, A2).unwrap();
    assert_provoked(&f, v, ViolationKind::UnwrittenShare);
}

#[test]
fn a_page_written_for_every_layer_but_one_is_unwritten_share_and_filled_it_passes() {
    let f = fixture();
    let page = f.alloc(f.decode, 2, A, 1);
    let v = f
        .san
        .write(f.decode, A, page, 0..SLOTS, 0..LAYERS - 1, 2)
        .unwrap();
    assert!(v.is_continue());
    let v = f.san.share(f.decode, page, A2).unwrap();
    assert_eq!(v.kind(), Some(ViolationKind::UnwrittenShare));
    let v = f
        .san
        .write(f.decode, A, page, 0..SLOTS, LAYERS - 1..LAYERS, 3)
        .unwrap();
    assert!(v.is_continue());
    assert!(f.san.share(f.decode, page, A2).unwrap().is_continue());
}

/// LMCache #4991's shape: a store (an incoming transfer) that has not
/// completed must not be found by a lookup.
#[test]
fn sharing_a_page_whose_transfer_is_not_committed_is_read_during_transfer() {
    let f = fixture();
    let (dst, _) = received(&f);
    let v = f.san.share(f.decode, dst, A2).unwrap();
    assert_eq!(v.kind(), Some(ViolationKind::ReadDuringTransfer));
    assert!(f.out.text().contains("not committed"), "{}", f.out.text());
}

// ------------------------------------------------------ read-during-transfer

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
fn reading_before_the_transfer_is_committed_is_read_during_transfer() {
    let f = fixture();
    let (dst, _) = received(&f);
    let v = f.san.read(f.decode, A, &[dst], 16, ALL, 3).unwrap();
    assert_provoked(&f, v, ViolationKind::ReadDuringTransfer);
}

#[test]
fn reading_after_the_commit_passes() {
    let f = fixture();
    let (dst, _) = received(&f);
    assert!(
        f.san
            .transfer_commit(f.decode, A, &[dst], 16)
            .unwrap()
            .is_continue()
    );
    let v = f.san.read(f.decode, A, &[dst], 16, ALL, 3).unwrap();
    assert_clean(&f, v);
    assert_eq!(
        f.san.page_info(f.decode, dst.page).unwrap().state,
        PageState::Owned
    );
}

// ------------------------------------------------------------- foreign-write

#[test]
fn writing_into_a_shared_prefix_page_is_foreign_write() {
    let f = fixture();
    let page = written_page(&f);
    assert!(f.san.share(f.decode, page, A2).unwrap().is_continue());
    let v = f.san.write(f.decode, A2, page, 3..4, ALL, 3).unwrap();
    assert_provoked(&f, v, ViolationKind::ForeignWrite);
}

/// The prefix cache as a holder of a page its owner filled.
const CACHE: kvsan_sanitizer::Owner = kvsan_sanitizer::Owner {
    request: kvsan_sanitizer::RequestId::PREFIX_CACHE,
    tenant: kvsan_sanitizer::TenantId(1),
};

/// A page other holders read is read-only to its owner too: a write would
/// change KV that a later request takes from the cache as the prefix's.
#[test]
fn the_owner_writing_a_page_the_prefix_cache_holds_is_foreign_write() {
    let f = fixture();
    let page = written_page(&f);
    assert!(f.san.share(f.decode, page, CACHE).unwrap().is_continue());
    let v = f.san.write(f.decode, A, page, 3..4, ALL, 3).unwrap();
    assert_eq!(v.kind(), Some(ViolationKind::ForeignWrite));
    assert_eq!(f.san.violations().len(), 1);
    assert_golden("foreign-write-into-a-shared-page", &f.out.text());
}

#[test]
fn the_owner_writing_before_the_cache_registers_the_page_or_after_it_left_passes() {
    let f = fixture();
    let page = written_page(&f);
    let v = f.san.write(f.decode, A, page, 3..4, ALL, 3).unwrap();
    assert_clean(&f, v);
    assert!(f.san.share(f.decode, page, CACHE).unwrap().is_continue());
    assert!(f.san.share(f.decode, page, A2).unwrap().is_continue());
    f.free(f.decode, CACHE, page, 4);
    f.free(f.decode, A2, page, 5);
    // The last sharer has left: the page is its owner's alone again.
    let v = f.san.write(f.decode, A, page, 3..4, ALL, 6).unwrap();
    assert_clean(&f, v);
}

#[test]
fn a_transfer_landing_in_a_page_the_prefix_cache_holds_is_foreign_write() {
    let f = fixture();
    let (dst, m) = received(&f);
    assert!(
        f.san
            .transfer_commit(f.decode, A, &[dst], 16)
            .unwrap()
            .is_continue()
    );
    assert!(f.san.share(f.decode, dst, CACHE).unwrap().is_continue());
    let v = f.receive(f.decode, &m).unwrap();
    assert_eq!(v.kind(), Some(ViolationKind::ForeignWrite));
    assert!(
        f.out
            .text()
            .contains("shared read-only with prefix cache (tenant 1)"),
        "{}",
        f.out.text()
    );
}

#[test]
fn writing_into_another_requests_page_is_foreign_write() {
    let f = fixture();
    let page = written_page(&f);
    let v = f.san.write(f.decode, B, page, 3..4, ALL, 3).unwrap();
    assert_eq!(v.kind(), Some(ViolationKind::ForeignWrite));
}

#[test]
fn the_owner_writing_its_page_passes() {
    let f = fixture();
    let page = written_page(&f);
    let v = f.san.write(f.decode, A, page, 3..4, ALL, 3).unwrap();
    assert_clean(&f, v);
}

#[test]
fn a_transfer_landing_in_a_page_another_request_holds_is_foreign_write() {
    let f = fixture();
    let src = f.alloc(f.prefill, 0, A, 1);
    f.write_all(f.prefill, A, src, 0..SLOTS, 2);
    let dst = f.alloc(f.decode, 6, B, 1);
    let v = f
        .san
        .transfer_recv(f.decode, &manifest(A, &[src], &[dst], 0, 16))
        .unwrap();
    assert_eq!(v.kind(), Some(ViolationKind::ForeignWrite));
}

// ---------------------------------------------------------- write-after-free

#[test]
fn a_late_transfer_into_a_freed_reservation_is_write_after_free() {
    let f = fixture();
    let src = f.alloc(f.prefill, 0, A, 1);
    f.write_all(f.prefill, A, src, 0..SLOTS, 2);
    let dst = f.alloc(f.decode, 6, A, 1);
    f.free(f.decode, A, dst, 2);
    let v = f
        .san
        .transfer_recv(f.decode, &manifest(A, &[src], &[dst], 0, 16))
        .unwrap();
    assert_provoked(&f, v, ViolationKind::WriteAfterFree);
}

#[test]
fn a_compute_write_into_a_freed_page_is_write_after_free() {
    let f = fixture();
    let page = written_page(&f);
    f.free(f.decode, A, page, 3);
    let v = f.san.write(f.decode, A, page, 0..1, ALL, 4).unwrap();
    assert_eq!(v.kind(), Some(ViolationKind::WriteAfterFree));
}

#[test]
fn a_transfer_landing_before_the_free_passes() {
    let f = fixture();
    let (dst, _) = received(&f);
    assert!(
        f.san
            .transfer_commit(f.decode, A, &[dst], 16)
            .unwrap()
            .is_continue()
    );
    f.free(f.decode, A, dst, 9);
    assert_clean(&f, Verdict::Continue);
}

// -------------------------------------------------------------- double-alloc

#[test]
fn allocating_an_allocated_page_is_double_alloc() {
    let f = fixture();
    let page = f.alloc(f.decode, 1, A, 1);
    let (v, generation) = f.san.alloc(f.decode, PageId(1), B, 2).unwrap();
    assert_eq!(generation, page.generation, "the page keeps its generation");
    assert_eq!(f.san.page_info(f.decode, PageId(1)).unwrap().owner, A);
    assert_provoked(&f, v, ViolationKind::DoubleAlloc);
}

#[test]
fn allocating_a_quarantined_page_passes_with_the_next_generation() {
    let f = fixture();
    let page = f.alloc(f.decode, 1, A, 1);
    f.free(f.decode, A, page, 2);
    assert_eq!(
        f.san.page_info(f.decode, PageId(1)).unwrap().state,
        PageState::Quarantined
    );
    let (v, generation) = f.san.alloc(f.decode, PageId(1), B, 3).unwrap();
    assert_eq!(generation, page.generation.next());
    assert_clean(&f, v);
}

// --------------------------------------------------------------- double-free

#[test]
fn freeing_a_page_twice_is_double_free() {
    let f = fixture();
    let page = written_page(&f);
    f.free(f.decode, A, page, 3);
    let v = f.san.free(f.decode, A, page, 4).unwrap();
    assert_provoked(&f, v, ViolationKind::DoubleFree);
}

#[test]
fn freeing_through_a_stale_generation_is_double_free() {
    let f = fixture();
    let (old, _) = reallocated(&f);
    let v = f.san.free(f.decode, A, old, 6).unwrap();
    assert_eq!(v.kind(), Some(ViolationKind::DoubleFree));
    assert_eq!(f.san.page_info(f.decode, old.page).unwrap().owner, B);
}

#[test]
fn owner_and_sharer_each_freeing_once_passes_and_releases_at_the_last() {
    let f = fixture();
    let page = written_page(&f);
    assert!(f.san.share(f.decode, page, A2).unwrap().is_continue());
    f.free(f.decode, A, page, 3);
    let info = f.san.page_info(f.decode, page.page).unwrap();
    assert_eq!(info.state, PageState::Owned, "a sharer still holds it");
    assert!(info.owner_released);
    assert!(
        f.san
            .read(f.decode, A2, &[page], 16, ALL, 4)
            .unwrap()
            .is_continue()
    );
    f.free(f.decode, A2, page, 5);
    assert_eq!(
        f.san.page_info(f.decode, page.page).unwrap().state,
        PageState::Quarantined
    );
    assert_clean(&f, Verdict::Continue);
}

// -------------------------------------------------------------- foreign-free

#[test]
fn freeing_another_requests_page_is_foreign_free() {
    let f = fixture();
    let page = written_page(&f);
    let v = f.san.free(f.decode, B, page, 3).unwrap();
    assert_provoked(&f, v, ViolationKind::ForeignFree);
    assert_eq!(
        f.san.page_info(f.decode, page.page).unwrap().state,
        PageState::Owned
    );
}

#[test]
fn a_sharer_freeing_its_share_passes_and_the_owner_keeps_the_page() {
    let f = fixture();
    let page = written_page(&f);
    assert!(f.san.share(f.decode, page, A2).unwrap().is_continue());
    f.free(f.decode, A2, page, 3);
    let info = f.san.page_info(f.decode, page.page).unwrap();
    assert_eq!(info.state, PageState::Owned);
    assert!(!info.shared && !info.owner_released);
    assert_clean(&f, Verdict::Continue);
}

// ------------------------------------------------- terminal-request-activity

#[test]
fn a_rejected_request_that_allocates_is_terminal_request_activity() {
    let f = fixture();
    assert!(f.san.request_event(B, RequestEvent::Queued).is_continue());
    assert!(f.san.request_event(B, RequestEvent::Rejected).is_continue());
    let (v, _) = f.san.alloc(f.decode, PageId(3), B, 41).unwrap();
    assert_provoked(&f, v, ViolationKind::TerminalRequestActivity);
}

#[test]
fn a_rejected_request_admitted_anyway_is_terminal_request_activity() {
    let f = fixture();
    assert!(f.san.request_event(B, RequestEvent::Rejected).is_continue());
    let v = f.san.request_event(B, RequestEvent::Admitted);
    assert_eq!(v.kind(), Some(ViolationKind::TerminalRequestActivity));
    assert_eq!(
        f.san.request_state(B.request),
        Some(kvsan_sanitizer::RequestState::Rejected)
    );
}

#[test]
fn an_aborted_request_that_reads_sends_or_writes_is_terminal_request_activity() {
    let f = fixture();
    let page = f.alloc(f.prefill, 0, A, 1);
    f.write_all(f.prefill, A, page, 0..SLOTS, 2);
    f.free(f.prefill, A, page, 3);
    let page = f.alloc(f.prefill, 1, A, 4);
    f.write_all(f.prefill, A, page, 0..SLOTS, 5);
    // Aborting while holding the page: a leak, and the page is marked terminal.
    let v = f.san.request_event(A, RequestEvent::Aborted);
    assert_eq!(v.kind(), Some(ViolationKind::PageLeak));
    for v in [
        f.san.read(f.prefill, A, &[page], 16, ALL, 6).unwrap(),
        f.san.write(f.prefill, A, page, 0..1, ALL, 6).unwrap(),
        f.san
            .transfer_send(f.prefill, &manifest(A, &[page], &[], 0, 16))
            .unwrap(),
    ] {
        assert_eq!(v.kind(), Some(ViolationKind::TerminalRequestActivity));
    }
    // Freeing is cleanup, not activity.
    f.free(f.prefill, A, page, 7);
}

/// `commit-after-abort` as a decode node with a sanitizer of its own sees
/// it: the completion of a request cancelled while its KV was on its way is
/// committed through the block table of its freed pages.
#[test]
fn an_aborted_request_that_commits_is_terminal_request_activity() {
    let f = fixture();
    let dst = f.alloc(f.decode, 3, A, 1);
    f.free(f.decode, A, dst, 2);
    assert!(f.san.request_event(A, RequestEvent::Aborted).is_continue());
    let v = f.san.transfer_commit(f.decode, A, &[dst], 16).unwrap();
    assert_eq!(v.kind(), Some(ViolationKind::TerminalRequestActivity));
    let text = f.out.text();
    assert!(
        text.contains("an aborted request commits 16 received tokens"),
        "{text}"
    );
}

#[test]
fn an_admitted_request_that_allocates_passes() {
    let f = fixture();
    assert!(f.san.request_event(B, RequestEvent::Queued).is_continue());
    assert!(f.san.request_event(B, RequestEvent::Admitted).is_continue());
    let (v, _) = f.san.alloc(f.decode, PageId(3), B, 41).unwrap();
    assert_clean(&f, v);
}

// ------------------------------------------------------------ short-transfer

/// Decode reserved two pages for a 20-token prompt; prefill computed and sent
/// one token (the placeholder).
fn short(f: &Fixture) -> Vec<PageRef> {
    let src = f.alloc(f.prefill, 0, B, 1);
    f.write_all(f.prefill, B, src, 0..1, 2);
    let dst = vec![f.alloc(f.decode, 3, B, 1), f.alloc(f.decode, 4, B, 1)];
    let m = manifest(B, &[src], &dst, 0, 1);
    assert!(f.san.transfer_send(f.prefill, &m).unwrap().is_continue());
    assert!(f.receive(f.decode, &m).unwrap().is_continue());
    dst
}

#[test]
fn committing_more_tokens_than_arrived_is_short_transfer() {
    let f = fixture();
    let dst = short(&f);
    let v = f.san.transfer_commit(f.decode, B, &dst, 20).unwrap();
    assert_provoked(&f, v, ViolationKind::ShortTransfer);
}

#[test]
fn committing_the_tokens_that_arrived_passes() {
    let f = fixture();
    let dst = short(&f);
    let v = f.san.transfer_commit(f.decode, B, &dst, 1).unwrap();
    assert_clean(&f, v);
}

// -------------------------------------------------------- unwritten-transfer

#[test]
fn sending_slots_the_sender_never_wrote_is_unwritten_transfer() {
    let f = fixture();
    let src = f.alloc(f.prefill, 0, B, 1);
    f.write_all(f.prefill, B, src, 0..1, 2);
    let dst = [f.alloc(f.decode, 3, B, 1), f.alloc(f.decode, 4, B, 1)];
    let src2 = f.alloc(f.prefill, 1, B, 1);
    let v = f
        .san
        .transfer_send(f.prefill, &manifest(B, &[src, src2], &dst, 0, 20))
        .unwrap();
    assert_provoked(&f, v, ViolationKind::UnwrittenTransfer);
}

#[test]
fn sending_only_written_slots_passes() {
    let f = fixture();
    let src = f.alloc(f.prefill, 0, B, 1);
    f.write_all(f.prefill, B, src, 0..1, 2);
    let dst = [f.alloc(f.decode, 3, B, 1)];
    let v = f
        .san
        .transfer_send(f.prefill, &manifest(B, &[src], &dst, 0, 1))
        .unwrap();
    assert_clean(&f, v);
}

// ----------------------------------------------------------------- page-leak

#[test]
fn finishing_while_holding_pages_is_page_leak() {
    let f = fixture();
    assert!(f.san.request_event(A, RequestEvent::Admitted).is_continue());
    let page = written_page(&f);
    let _kept = f.alloc(f.decode, 6, A, 3);
    assert!(f.san.request_event(A, RequestEvent::Decoding).is_continue());
    f.free(f.decode, A, page, 4);
    let v = f.san.request_event(A, RequestEvent::Finished);
    assert_provoked(&f, v, ViolationKind::PageLeak);
}

#[test]
fn finishing_after_freeing_every_page_and_share_passes() {
    let f = fixture();
    assert!(f.san.request_event(A, RequestEvent::Admitted).is_continue());
    let page = written_page(&f);
    let other = f.alloc(f.decode, 6, A2, 3);
    f.write_all(f.decode, A2, other, 0..SLOTS, 3);
    assert!(f.san.share(f.decode, other, A).unwrap().is_continue());
    assert!(f.san.request_event(A, RequestEvent::Decoding).is_continue());
    f.free(f.decode, A, page, 4);
    f.free(f.decode, A, other, 4);
    let v = f.san.request_event(A, RequestEvent::Finished);
    assert_clean(&f, v);
}

// -------------------------------------------------------- illegal-transition

#[test]
fn transferring_before_admission_is_illegal_transition() {
    let f = fixture();
    assert!(f.san.request_event(A, RequestEvent::Queued).is_continue());
    let v = f.san.request_event(A, RequestEvent::Transferring);
    assert_provoked(&f, v, ViolationKind::IllegalTransition);
}

#[test]
fn transferring_after_admission_passes() {
    let f = fixture();
    assert!(f.san.request_event(A, RequestEvent::Queued).is_continue());
    assert!(f.san.request_event(A, RequestEvent::Admitted).is_continue());
    let v = f.san.request_event(A, RequestEvent::Transferring);
    assert_clean(&f, v);
}

#[test]
fn every_kind_has_a_golden_report() {
    for kind in ViolationKind::ALL {
        let path = std::path::Path::new(env!("CARGO_MANIFEST_DIR"))
            .join("tests/golden")
            .join(format!("{}.txt", kind.name()));
        assert!(path.exists(), "missing golden report {}", path.display());
    }
}

// --------------------------------------------------------------- poison-read

/// The engine found the poison fill in attention output and traced it to
/// slot 5 of a page whose owner wrote every slot: the shadow and the memory
/// disagree (something poisoned a page its owner still holds).
#[test]
fn poison_reaching_attention_output_through_a_written_slot_is_poison_read() {
    let f = fixture_with("poison=1");
    let page = written_page(&f);
    let access = kvsan_sanitizer::KernelAccess {
        op: kvsan_sanitizer::AccessOp::Poison,
        page,
        entry: 0,
        layer: 3,
        slots: 5..6,
    };
    let v = f.san.kernel_refusal(f.decode, A, &access, 9).unwrap();
    assert_provoked(&f, v, ViolationKind::PoisonRead);
}

/// Its legal neighbour: the same read, with nothing poisoned, is a kernel
/// read the shadow passes — no report (the engine only raises a poison
/// finding when the output is NaN).
#[test]
fn a_kernel_read_of_written_slots_passes_without_a_report() {
    let f = fixture_with("poison=1");
    let page = written_page(&f);
    let shadow = f.san.kernel_shadow(f.decode).unwrap();
    assert_eq!(
        shadow.check_read(A.request, page, 3, 6),
        kvsan_sanitizer::Check::Ok
    );
    assert_clean(&f, Verdict::Continue);
}

// ------------------------------------------------------ misdirected-transfer

/// A transfer of request A's 16 tokens arrives for its reserved page 6;
/// request B holds page 5, the page just before it.
fn arrived(f: &Fixture) -> (kvsan_sanitizer::Manifest, PageRef) {
    let src = f.alloc(f.prefill, 0, A, 1);
    f.write_all(f.prefill, A, src, 0..SLOTS, 2);
    let other = f.alloc(f.decode, 5, B, 1);
    f.write_all(f.decode, B, other, 0..SLOTS, 2);
    let dst = f.alloc(f.decode, 6, A, 1);
    let m = manifest(A, &[src], &[dst], 0, 16);
    assert!(f.san.transfer_send(f.prefill, &m).unwrap().is_continue());
    assert!(f.san.transfer_recv(f.decode, &m).unwrap().is_continue());
    (m, other)
}

#[test]
fn a_copy_of_received_kv_into_another_requests_page_is_misdirected_transfer() {
    let f = fixture();
    let (m, other) = arrived(&f);
    // The copy computes its destination one page early.
    let landing = kvsan_sanitizer::PageLanding {
        page: other,
        ..landing_of(&m, 0, 0..SLOTS)
    };
    let v = f.san.transfer_land(f.decode, &landing).unwrap();
    assert_provoked(&f, v, ViolationKind::MisdirectedTransfer);
    // Refused before it wrote: B's page is B's, as it was.
    let info = f.san.page_info(f.decode, other.page).unwrap();
    assert_eq!(info.state, PageState::Owned);
}

#[test]
fn a_copy_into_the_requests_own_page_it_did_not_reserve_is_misdirected_transfer() {
    let f = fixture();
    let (m, _) = arrived(&f);
    let own = f.alloc(f.decode, 2, A, 1);
    let landing = kvsan_sanitizer::PageLanding {
        page: own,
        ..landing_of(&m, 0, 0..SLOTS)
    };
    let v = f.san.transfer_land(f.decode, &landing).unwrap();
    assert_eq!(v.kind(), Some(ViolationKind::MisdirectedTransfer));
}

#[test]
fn a_copy_into_the_reserved_page_passes_and_only_its_slots_count_as_written() {
    let f = fixture();
    let (m, _) = arrived(&f);
    let dst = m.dst_pages[0];
    // The copy writes slots 0..10 of the 16 the manifest names.
    let v = f
        .san
        .transfer_land(f.decode, &landing_of(&m, 0, 0..10))
        .unwrap();
    assert_clean(&f, v);
    assert!(
        f.san
            .transfer_commit(f.decode, A, &[dst], 10)
            .unwrap()
            .is_continue()
    );
    // Slot 10 was named by the manifest but never filled.
    let v = f.san.read(f.decode, A, &[dst], 11, ALL, 3).unwrap();
    assert_eq!(v.kind(), Some(ViolationKind::StaleRead));
}

#[test]
fn the_manifest_alone_marks_nothing_written() {
    let f = fixture();
    let (m, _) = arrived(&f);
    let v = f
        .san
        .transfer_commit(f.decode, A, &m.dst_pages, 16)
        .unwrap();
    assert_eq!(v.kind(), Some(ViolationKind::ShortTransfer));
}

#[test]
fn a_pool_whose_engine_reports_no_landing_takes_the_manifest_as_written() {
    let out = kvsan_sanitizer::ReportBuffer::default();
    let san =
        kvsan_sanitizer::Sanitizer::with_writer(kvsan_sanitizer::Options::default(), out.clone());
    let decode = san
        .pool_register_with(
            geometry(kvsan_sanitizer::NodeRole::Decode, "decode-0", 8),
            kvsan_sanitizer::Landing::Manifest,
        )
        .unwrap();
    let (v, generation) = san.alloc(decode, PageId(6), A, 1).unwrap();
    assert!(v.is_continue());
    let dst = PageRef {
        page: PageId(6),
        generation,
    };
    let mut m = manifest(A, &[], &[dst], 0, 16);
    m.dst_pool = decode;
    assert!(san.transfer_recv(decode, &m).unwrap().is_continue());
    let v = san.transfer_commit(decode, A, &[dst], 16).unwrap();
    assert!(v.is_continue(), "{}", out.text());
}

// -------------------------------------------------- transfer-digest-mismatch

#[test]
fn kv_found_where_it_landed_that_is_not_what_was_sent_is_transfer_digest_mismatch() {
    let f = fixture();
    let (m, _) = arrived(&f);
    let landing = kvsan_sanitizer::PageLanding {
        landed_digest: 0xbad,
        ..landing_of(&m, 0, 0..SLOTS)
    };
    let v = f.san.transfer_verify(f.decode, &landing).unwrap();
    assert_provoked(&f, v, ViolationKind::TransferDigestMismatch);
    // The report names the page and the token range, never the digests.
    let text = f.out.text();
    assert!(text.contains("transferred tokens 0..16"), "{text}");
    assert!(!text.contains("bad") && !text.contains("d16e57"), "{text}");
}

#[test]
fn kv_found_where_it_landed_that_matches_counts_as_written() {
    let f = fixture();
    let (m, _) = arrived(&f);
    // No copy was seen (an RDMA WRITE): the matching digest is the evidence.
    let v = f
        .san
        .transfer_verify(f.decode, &landing_of(&m, 0, 0..SLOTS))
        .unwrap();
    assert_clean(&f, v);
    let v = f
        .san
        .transfer_commit(f.decode, A, &m.dst_pages, 16)
        .unwrap();
    assert_clean(&f, v);
}

#[test]
fn kv_found_not_to_match_marks_nothing_written() {
    let f = fixture();
    let (m, _) = arrived(&f);
    let landing = kvsan_sanitizer::PageLanding {
        landed_digest: 0xbad,
        ..landing_of(&m, 0, 0..SLOTS)
    };
    let v = f.san.transfer_verify(f.decode, &landing).unwrap();
    assert_eq!(v.kind(), Some(ViolationKind::TransferDigestMismatch));
    let v = f
        .san
        .transfer_commit(f.decode, A, &m.dst_pages, 16)
        .unwrap();
    assert_eq!(v.kind(), Some(ViolationKind::ShortTransfer));
}

// ------------------------------------------------------------------- tiers

const HOST: u32 = 0;

/// Request 4's page 2, written for every layer, stored into block 9 of the
/// host tier (digest 0x51), the store completed: what a preempted request
/// left in the tier.
fn stored_in_tier(f: &Fixture) -> (PageRef, TierBlockId) {
    let page = f.alloc(f.decode, 2, A, 10);
    f.write_all(f.decode, A, page, 0..SLOTS, 11);
    let block = TierBlockId::new(HOST, 9);
    let v = f.san.tier_store(f.decode, A, page, block, 12).unwrap();
    assert!(v.is_continue(), "{v:?}");
    let v = f.san.tier_store_done(block, 0x51, true).unwrap();
    assert!(v.is_continue(), "{v:?}");
    (page, block)
}

// ------------------------------------------------------- tier-block-aliased

/// TensorRT-LLM#8813's class: two device pages offloaded into one host
/// block in one step — the second store overwrites KV the first request
/// will load back.
#[test]
fn a_store_into_a_block_that_holds_another_page_is_tier_block_aliased() {
    let f = fixture();
    let (_, block) = stored_in_tier(&f);
    let other = f.alloc(f.decode, 3, B, 20);
    f.write_all(f.decode, B, other, 0..SLOTS, 21);
    let v = f.san.tier_store(f.decode, B, other, block, 22).unwrap();
    assert_provoked(&f, v, ViolationKind::TierBlockAliased);
    // The block still holds request 4's KV.
    assert_eq!(f.san.tier_block_state(block), Some(TierBlockState::Stored));
}

#[test]
fn a_store_into_a_block_the_tier_released_passes() {
    let f = fixture();
    let (_, block) = stored_in_tier(&f);
    assert!(f.san.tier_release(block).is_continue());
    let other = f.alloc(f.decode, 3, B, 20);
    f.write_all(f.decode, B, other, 0..SLOTS, 21);
    let v = f.san.tier_store(f.decode, B, other, block, 22).unwrap();
    assert_clean(&f, v);
}

// ------------------------------------------------- tier-store-source-reused

/// LMCache#4955's class: a store still reading its source page when the
/// request is preempted and the page handed to another request.
#[test]
fn a_store_whose_source_page_was_reused_before_it_completed_is_caught() {
    let f = fixture();
    let page = f.alloc(f.decode, 2, A, 10);
    f.write_all(f.decode, A, page, 0..SLOTS, 11);
    let block = TierBlockId::new(HOST, 9);
    assert!(
        f.san
            .tier_store(f.decode, A, page, block, 12)
            .unwrap()
            .is_continue()
    );
    f.free(f.decode, A, page, 13);
    let reused = f.alloc(f.decode, 2, B, 14);
    f.write_all(f.decode, B, reused, 0..SLOTS, 15);
    let v = f.san.tier_store_done(block, 0x51, true).unwrap();
    assert_provoked(&f, v, ViolationKind::TierStoreSourceReused);
    // What the tier holds may be request 7's: never loaded.
    assert_eq!(f.san.tier_block_state(block), Some(TierBlockState::Failed));
}

#[test]
fn a_page_freed_after_its_store_completed_passes() {
    let f = fixture();
    let (page, block) = stored_in_tier(&f);
    f.free(f.decode, A, page, 13);
    let reused = f.alloc(f.decode, 2, B, 14);
    f.write_all(f.decode, B, reused, 0..SLOTS, 15);
    assert_eq!(f.san.tier_block_state(block), Some(TierBlockState::Stored));
    let back = f.alloc(f.decode, 5, A, 16);
    let v = f.san.tier_load(f.decode, A, back, block, 17).unwrap();
    assert_clean(&f, v);
}

// ------------------------------------------------------- tier-load-unstored

/// dynamo#15079's class: a load from a block no completed store filled,
/// counted as a hit.
#[test]
fn a_load_from_a_block_never_stored_is_tier_load_unstored() {
    let f = fixture();
    let dst = f.alloc(f.decode, 5, A, 16);
    let v = f
        .san
        .tier_load(f.decode, A, dst, TierBlockId::new(HOST, 9), 17)
        .unwrap();
    assert_provoked(&f, v, ViolationKind::TierLoadUnstored);
}

#[test]
fn a_load_from_a_completed_store_passes_and_writes_what_was_stored() {
    let f = fixture();
    let (_, block) = stored_in_tier(&f);
    let dst = f.alloc(f.decode, 5, A, 16);
    let v = f.san.tier_load(f.decode, A, dst, block, 17).unwrap();
    assert_clean(&f, v);
    let v = f.san.read(f.decode, A, &[dst], 16, ALL, 18).unwrap();
    assert_clean(&f, v);
}

// -------------------------------------------------------- tier-foreign-load

/// TensorRT-LLM#8830's class (a reused offloaded block takes the wrong
/// block's state) and a tier index keyed by a reused id: request 7 is
/// served request 4's KV.
#[test]
fn a_block_loaded_for_another_request_is_tier_foreign_load() {
    let f = fixture();
    let (_, block) = stored_in_tier(&f);
    let dst = f.alloc(f.decode, 5, B, 16);
    let v = f.san.tier_load(f.decode, B, dst, block, 17).unwrap();
    assert_provoked(&f, v, ViolationKind::TierForeignLoad);
}

#[test]
fn a_block_loaded_back_by_the_request_it_was_stored_for_passes() {
    let f = fixture();
    let (_, block) = stored_in_tier(&f);
    let dst = f.alloc(f.decode, 5, A, 16);
    let v = f.san.tier_load(f.decode, A, dst, block, 17).unwrap();
    assert_clean(&f, v);
}

// ----------------------------------------------------- tier-digest-mismatch

/// LMCache#5151's class: the KV restored is not what was stored while
/// the tier reports a full hit.
#[test]
fn kv_found_after_a_load_that_is_not_what_was_stored_is_tier_digest_mismatch() {
    let f = fixture();
    let (_, block) = stored_in_tier(&f);
    let dst = f.alloc(f.decode, 5, A, 16);
    assert!(
        f.san
            .tier_load(f.decode, A, dst, block, 17)
            .unwrap()
            .is_continue()
    );
    let v = f.san.tier_verify(f.decode, A, dst, block, 0xbad).unwrap();
    assert_provoked(&f, v, ViolationKind::TierDigestMismatch);
    // Digests are never printed.
    let text = f.out.text();
    assert!(!text.contains("bad") && !text.contains("51"), "{text}");
}

#[test]
fn kv_found_after_a_load_that_matches_the_store_passes() {
    let f = fixture();
    let (_, block) = stored_in_tier(&f);
    let dst = f.alloc(f.decode, 5, A, 16);
    assert!(
        f.san
            .tier_load(f.decode, A, dst, block, 17)
            .unwrap()
            .is_continue()
    );
    let v = f.san.tier_verify(f.decode, A, dst, block, 0x51).unwrap();
    assert_clean(&f, v);
}
