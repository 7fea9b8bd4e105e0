//! The kernel shadow: the in-place checks the store and attention kernels
//! make, what they refuse, and what the cold path then reports.

mod common;

use common::*;
use kvsan_sanitizer::kernel_shadow::KERNEL_SHADOW_LAYOUT;
use kvsan_sanitizer::{
    AccessOp, Check, KernelAccess, KernelShadow, PageRef, RequestEvent, Verdict, ViolationKind,
};

fn read_access(page: PageRef, layer: u32, n: u32) -> KernelAccess {
    KernelAccess {
        op: AccessOp::Read,
        page,
        entry: 0,
        layer,
        slots: 0..n,
    }
}

/// The fast path refuses with `kind`, and the cold path reports the same kind.
fn refused_and_reported(
    f: &Fixture,
    who: kvsan_sanitizer::Owner,
    page: PageRef,
    kind: ViolationKind,
) {
    let shadow = f.san.kernel_shadow(f.decode).unwrap();
    assert_eq!(
        shadow.check_read(who.request, page, 0, 4),
        Check::Refused(kind)
    );
    let v = f
        .san
        .kernel_refusal(f.decode, who, &read_access(page, 0, 4), 9)
        .unwrap();
    assert_eq!(v.kind(), Some(kind), "{}", f.out.text());
    assert!(f.out.text().contains(kind.name()));
}

#[test]
fn a_store_marks_exactly_its_slot_and_layer_written() {
    let f = fixture();
    let page = f.alloc(f.decode, 1, A, 1);
    let shadow = f.san.kernel_shadow(f.decode).unwrap();
    assert_eq!(shadow.store(A.request, page, 7, 3, 2), Check::Ok);
    assert_eq!(
        shadow.check_read(A.request, page, 7, 3),
        Check::Refused(ViolationKind::StaleRead)
    );
    for slot in 0..3 {
        assert_eq!(shadow.store(A.request, page, 7, slot, 2), Check::Ok);
    }
    assert_eq!(shadow.check_read(A.request, page, 7, 4), Check::Ok);
    assert_eq!(
        shadow.check_read(A.request, page, 6, 1),
        Check::Refused(ViolationKind::StaleRead),
        "another layer stays unwritten"
    );
    assert_eq!(f.san.violation_count(), 0);
}

#[test]
fn reading_slots_the_owner_never_wrote_in_this_generation_is_refused_as_stale_read() {
    let f = fixture();
    let old = f.alloc(f.decode, 3, B, 1);
    f.write_all(f.decode, B, old, 0..SLOTS, 2);
    f.free(f.decode, B, old, 3);
    let page = f.alloc(f.decode, 3, A, 4);
    f.write_all(f.decode, A, page, 0..1, 5);
    refused_and_reported(&f, A, page, ViolationKind::StaleRead);
}

#[test]
fn reading_another_requests_page_is_refused_as_foreign_read() {
    let f = fixture();
    let page = f.alloc(f.decode, 3, B, 1);
    f.write_all(f.decode, B, page, 0..SLOTS, 2);
    refused_and_reported(&f, A, page, ViolationKind::ForeignRead);
}

#[test]
fn reading_through_a_stale_tag_is_refused_as_generation_mismatch() {
    let f = fixture();
    let old = f.alloc(f.decode, 3, A, 1);
    f.write_all(f.decode, A, old, 0..SLOTS, 2);
    f.free(f.decode, A, old, 3);
    let now = f.alloc(f.decode, 3, A, 4);
    f.write_all(f.decode, A, now, 0..SLOTS, 5);
    refused_and_reported(&f, A, old, ViolationKind::GenerationMismatch);
}

#[test]
fn reading_a_freed_page_is_refused_as_read_free_page() {
    let f = fixture();
    let page = f.alloc(f.decode, 3, A, 1);
    f.write_all(f.decode, A, page, 0..SLOTS, 2);
    f.free(f.decode, A, page, 3);
    refused_and_reported(&f, A, page, ViolationKind::ReadFreePage);
}

#[test]
fn reading_a_page_still_receiving_is_refused_as_read_during_transfer() {
    let f = fixture();
    let src = f.alloc(f.prefill, 0, A, 1);
    f.write_all(f.prefill, A, src, 0..SLOTS, 2);
    let dst = f.alloc(f.decode, 3, A, 1);
    let m = manifest(A, &[src], &[dst], 0, SLOTS);
    assert!(f.receive(f.decode, &m).unwrap().is_continue());
    refused_and_reported(&f, A, dst, ViolationKind::ReadDuringTransfer);
}

#[test]
fn reading_a_page_held_by_a_request_that_ended_is_refused_as_terminal_activity() {
    let f = fixture();
    let page = f.alloc(f.decode, 3, A, 1);
    f.write_all(f.decode, A, page, 0..SLOTS, 2);
    // Aborted while still holding the page (a page-leak, reported here).
    let _ = f.san.request_event(A, RequestEvent::Aborted);
    let shadow = f.san.kernel_shadow(f.decode).unwrap();
    assert_eq!(
        shadow.check_read(A.request, page, 0, 4),
        Check::Refused(ViolationKind::TerminalRequestActivity)
    );
    let v = f
        .san
        .kernel_refusal(f.decode, A, &read_access(page, 0, 4), 9)
        .unwrap();
    assert_eq!(v.kind(), Some(ViolationKind::TerminalRequestActivity));
}

#[test]
fn a_sharers_read_is_arbitrated_and_passes_on_the_cold_path_without_a_report() {
    let f = fixture();
    let page = f.alloc(f.decode, 3, A2, 1);
    f.write_all(f.decode, A2, page, 0..SLOTS, 2);
    assert!(f.san.share(f.decode, page, A).unwrap().is_continue());
    let shadow = f.san.kernel_shadow(f.decode).unwrap();
    assert_eq!(shadow.check_read(A.request, page, 0, 4), Check::Arbitrate);
    let v = f
        .san
        .kernel_refusal(f.decode, A, &read_access(page, 0, 4), 9)
        .unwrap();
    assert_eq!(v, Verdict::Continue);
    assert_eq!(f.san.violation_count(), 0, "{}", f.out.text());
    // A request that holds no share is still refused.
    let c = kvsan_sanitizer::Owner::new(99, 9);
    assert_eq!(shadow.check_read(c.request, page, 0, 4), Check::Arbitrate);
    let v = f
        .san
        .kernel_refusal(f.decode, c, &read_access(page, 0, 4), 9)
        .unwrap();
    assert_eq!(v.kind(), Some(ViolationKind::ForeignRead));
}

#[test]
fn stores_into_pages_the_writer_does_not_hold_are_refused_and_set_no_bit() {
    let f = fixture();
    let page = f.alloc(f.decode, 3, B, 1);
    let shadow = f.san.kernel_shadow(f.decode).unwrap();
    assert_eq!(
        shadow.store(A.request, page, 0, 0, 2),
        Check::Refused(ViolationKind::ForeignWrite)
    );
    assert_eq!(
        shadow.check_read(B.request, page, 0, 1),
        Check::Refused(ViolationKind::StaleRead),
        "the refused store set nothing"
    );
    let store = KernelAccess {
        op: AccessOp::Store,
        page,
        entry: 0,
        layer: 0,
        slots: 0..1,
    };
    let v = f.san.kernel_refusal(f.decode, A, &store, 2).unwrap();
    assert_eq!(v.kind(), Some(ViolationKind::ForeignWrite));
    f.free(f.decode, B, page, 3);
    assert_eq!(
        shadow.store(B.request, page, 0, 0, 4),
        Check::Refused(ViolationKind::WriteAfterFree)
    );
}

/// The owner's store into its own page while the prefix cache holds it:
/// refused in the kernel, refused again on the cold path as
/// `foreign-write`, naming the holders; the legal neighbour is the same
/// store once the cache has let go.
#[test]
fn the_owners_store_into_a_page_the_prefix_cache_holds_is_refused_as_foreign_write() {
    let f = fixture();
    let page = f.alloc(f.decode, 3, A, 1);
    f.write_all(f.decode, A, page, 0..SLOTS, 2);
    let cache = kvsan_sanitizer::Owner {
        request: kvsan_sanitizer::RequestId::PREFIX_CACHE,
        tenant: A.tenant,
    };
    assert!(f.san.share(f.decode, page, cache).unwrap().is_continue());
    let shadow = f.san.kernel_shadow(f.decode).unwrap();
    assert_eq!(
        shadow.store(A.request, page, 0, 5, 3),
        Check::Refused(ViolationKind::ForeignWrite)
    );
    let store = KernelAccess {
        op: AccessOp::Store,
        page,
        entry: 5,
        layer: 0,
        slots: 5..6,
    };
    let v = f.san.kernel_refusal(f.decode, A, &store, 3).unwrap();
    assert_eq!(v.kind(), Some(ViolationKind::ForeignWrite));
    let text = f.out.text();
    assert!(
        text.contains(
            "into the writer's own page while it is shared read-only with prefix cache (tenant 1)"
        ),
        "{text}"
    );
    assert!(
        text.contains("shared with                           prefix cache (tenant 1)"),
        "{text}"
    );
    // The cache evicts it: the owner may write its page again.
    assert!(f.san.free(f.decode, cache, page, 4).unwrap().is_continue());
    assert_eq!(shadow.store(A.request, page, 0, 5, 5), Check::Ok);
    assert_eq!(f.san.violation_count(), 1);
}

#[test]
fn the_first_kernel_store_of_a_generation_appears_in_the_pages_history() {
    let f = fixture();
    let page = f.alloc(f.decode, 3, A, 10);
    let shadow = f.san.kernel_shadow(f.decode).unwrap();
    for slot in 2..5 {
        for layer in 0..LAYERS {
            assert_eq!(
                shadow.store(A.request, page, layer, slot, 11 + u64::from(slot)),
                Check::Ok
            );
        }
    }
    // A report on the page shows the owner's write (its first step, the
    // slots written) after the allocation.
    let v = f
        .san
        .kernel_refusal(f.decode, B, &read_access(page, 0, 4), 20)
        .unwrap();
    assert_eq!(v.kind(), Some(ViolationKind::ForeignRead));
    let text = f.out.text();
    let alloc = text.find("alloc   gen 1    request 4").expect(&text);
    let write = text
        .find("write   gen 1    request 4 (tenant 1)  step 13  slots 2..5")
        .expect(&text);
    assert!(alloc < write, "{text}");
}

#[test]
fn the_c_description_round_trips_and_a_foreign_layout_is_refused() {
    let f = fixture();
    let page = f.alloc(f.decode, 3, A, 1);
    let shadow = f.san.kernel_shadow(f.decode).unwrap();
    let raw = shadow.to_raw();
    assert_eq!(raw.layout_version, KERNEL_SHADOW_LAYOUT);
    assert_eq!(raw.stride_words, 8, "30 layers x 16 slots = 480 bits");
    // SAFETY: `raw` describes the live pool of `f.san`, which outlives `view`.
    let view = unsafe { KernelShadow::from_raw(&raw) }.unwrap();
    assert_eq!(view.store(A.request, page, 4, 1, 2), Check::Ok);
    assert_eq!(
        shadow.check_read(A.request, page, 4, 1),
        Check::Refused(ViolationKind::StaleRead)
    );
    assert_eq!(shadow.store(A.request, page, 4, 0, 2), Check::Ok);
    assert_eq!(
        shadow.check_read(A.request, page, 4, 2),
        Check::Ok,
        "one memory, two views"
    );
    view.count(3, 1);
    assert_eq!(f.san.checks().kernel_read_pages, 3);
    for bad in [
        kvsan_sanitizer::abi::KvsanKernelShadow {
            layout_version: 99,
            ..raw
        },
        kvsan_sanitizer::abi::KvsanKernelShadow {
            record_size: 24,
            ..raw
        },
        kvsan_sanitizer::abi::KvsanKernelShadow {
            stride_words: 30,
            ..raw
        },
        kvsan_sanitizer::abi::KvsanKernelShadow { size: 8, ..raw },
        kvsan_sanitizer::abi::KvsanKernelShadow {
            bits: std::ptr::null(),
            ..raw
        },
    ] {
        // SAFETY: each is refused before any pointer is used.
        assert!(unsafe { KernelShadow::from_raw(&bad) }.is_err(), "{bad:?}");
    }
}

#[test]
fn bits_a_copy_of_the_shadow_set_come_back_only_for_the_same_generation() {
    let f = fixture();
    let page = f.alloc(f.decode, 3, A, 1);
    let shadow = f.san.kernel_shadow(f.decode).unwrap();
    let (word, owner) = shadow.record_words(page.page).unwrap();
    assert_eq!(owner, A.request.0);
    assert_eq!(word & 0xFFFF_FFFF, u64::from(page.generation.0));
    // A device store of slot 2 of layer 1 (bit 1 × 16 + 2).
    let mut bits = shadow.page_bits(page.page).unwrap();
    assert!(bits.iter().all(|&w| w == 0));
    bits[0] |= 1 << 18;
    shadow.merge_bits(page, &bits, 7);
    assert_eq!(
        shadow.check_read(A.request, page, 1, 3),
        Check::Refused(ViolationKind::StaleRead)
    );
    let mut more = shadow.page_bits(page.page).unwrap();
    more[0] |= (1 << 16) | (1 << 17);
    shadow.merge_bits(page, &more, 8);
    assert_eq!(shadow.check_read(A.request, page, 1, 3), Check::Ok);
    // Once the page is another generation's, late bits are dropped.
    f.free(f.decode, A, page, 9);
    let again = f.alloc(f.decode, 3, B, 10);
    assert_ne!(again.generation, page.generation);
    shadow.merge_bits(page, &vec![u64::MAX; bits.len()], 11);
    assert_eq!(
        shadow.check_read(B.request, again, 0, 1),
        Check::Refused(ViolationKind::StaleRead)
    );
}
