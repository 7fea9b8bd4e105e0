//! KV tiers: what a tier block carries from its page and back — the
//! written map (exactly), the owner, the prefix cache's policy — and each
//! way a block may not be loaded (a store in flight, failed or released).

mod common;

use common::*;
use kvsan_sanitizer::{
    NodeRole, Owner, PageRef, RequestEvent, RequestId, SanitizerError, TierBlockId, TierBlockState,
    Verdict, ViolationKind,
};

const DISK: u32 = 1;

fn block(n: u64) -> TierBlockId {
    TierBlockId::new(DISK, n)
}

fn continues(v: Verdict, what: &str, f: &Fixture) {
    assert!(v.is_continue(), "{what}: {v:?}\n{}", f.out.text());
}

/// `owner`'s page `page` with `slots` written for every layer, stored into
/// `b` and the store completed (digest 7).
fn offloaded(f: &Fixture, owner: Owner, page: u32, slots: std::ops::Range<u32>, b: TierBlockId) {
    let p = f.alloc(f.decode, page, owner, 1);
    f.write_all(f.decode, owner, p, slots, 2);
    continues(
        f.san.tier_store(f.decode, owner, p, b, 3).unwrap(),
        "store",
        f,
    );
    continues(f.san.tier_store_done(b, 7, true).unwrap(), "done", f);
    f.free(f.decode, owner, p, 4);
}

/// `writer`'s page 2, filled and registered in the prefix cache, then
/// evicted by the cache into `b` (the store completed): a cached page
/// moved down a tier. The writer let go of its page first when `released`.
fn evicted(f: &Fixture, writer: Owner, b: TierBlockId, released: bool) {
    let cache = Owner {
        request: RequestId::PREFIX_CACHE,
        tenant: writer.tenant,
    };
    let p = f.alloc(f.decode, 2, writer, 1);
    f.write_all(f.decode, writer, p, 0..SLOTS, 2);
    continues(f.san.share(f.decode, p, cache).unwrap(), "register", f);
    if released {
        f.free(f.decode, writer, p, 3);
    }
    continues(
        f.san.tier_store(f.decode, cache, p, b, 4).unwrap(),
        "evict",
        f,
    );
    continues(f.san.tier_store_done(b, 7, true).unwrap(), "done", f);
}

fn load(f: &Fixture, owner: Owner, page: u32, b: TierBlockId) -> (PageRef, Verdict) {
    let dst = f.alloc(f.decode, page, owner, 5);
    let v = f.san.tier_load(f.decode, owner, dst, b, 6).unwrap();
    (dst, v)
}

#[test]
fn a_load_writes_exactly_the_slots_the_store_found_written() {
    let f = fixture();
    // A preempted request had written 5 tokens of its last page.
    offloaded(&f, A, 2, 0..5, block(1));
    let (dst, v) = load(&f, A, 5, block(1));
    continues(v, "load", &f);
    continues(
        f.san.read(f.decode, A, &[dst], 5, ALL, 7).unwrap(),
        "read of the 5",
        &f,
    );
    // The sixth slot holds whatever the page held before: never written.
    let v = f.san.read(f.decode, A, &[dst], 6, ALL, 8).unwrap();
    assert_eq!(v.kind(), Some(ViolationKind::StaleRead));
}

#[test]
fn a_failed_store_is_never_loaded() {
    // dynamo#8057's class: an offload error swallowed, the block later
    // served as if it held the page.
    let f = fixture();
    let p = f.alloc(f.decode, 2, A, 1);
    f.write_all(f.decode, A, p, 0..SLOTS, 2);
    continues(
        f.san.tier_store(f.decode, A, p, block(1), 3).unwrap(),
        "store",
        &f,
    );
    continues(
        f.san.tier_store_done(block(1), 7, false).unwrap(),
        "failed",
        &f,
    );
    assert_eq!(
        f.san.tier_block_state(block(1)),
        Some(TierBlockState::Failed)
    );
    let (_, v) = load(&f, A, 5, block(1));
    assert_eq!(v.kind(), Some(ViolationKind::TierLoadUnstored));
    assert!(
        f.out.text().contains("its store failed"),
        "{}",
        f.out.text()
    );
    // A failed block holds nothing: a new store may take it.
    let q = f.alloc(f.decode, 3, A, 7);
    f.write_all(f.decode, A, q, 0..SLOTS, 8);
    continues(
        f.san.tier_store(f.decode, A, q, block(1), 9).unwrap(),
        "store",
        &f,
    );
}

#[test]
fn a_load_while_the_store_is_in_flight_is_tier_load_unstored() {
    let f = fixture();
    let p = f.alloc(f.decode, 2, A, 1);
    f.write_all(f.decode, A, p, 0..SLOTS, 2);
    continues(
        f.san.tier_store(f.decode, A, p, block(1), 3).unwrap(),
        "store",
        &f,
    );
    let (_, v) = load(&f, A, 5, block(1));
    assert_eq!(v.kind(), Some(ViolationKind::TierLoadUnstored));
    assert!(
        f.out.text().contains("has not completed"),
        "{}",
        f.out.text()
    );
}

#[test]
fn a_released_block_is_never_loaded() {
    let f = fixture();
    offloaded(&f, A, 2, 0..SLOTS, block(1));
    assert!(f.san.tier_release(block(1)).is_continue());
    assert_eq!(f.san.tier_block_state(block(1)), None);
    let (_, v) = load(&f, A, 5, block(1));
    assert_eq!(v.kind(), Some(ViolationKind::TierLoadUnstored));
}

#[test]
fn two_pages_stored_into_one_block_in_flight_is_tier_block_aliased() {
    let f = fixture();
    let p = f.alloc(f.decode, 2, A, 1);
    let q = f.alloc(f.decode, 3, A, 1);
    f.write_all(f.decode, A, p, 0..SLOTS, 2);
    f.write_all(f.decode, A, q, 0..SLOTS, 2);
    continues(
        f.san.tier_store(f.decode, A, p, block(1), 3).unwrap(),
        "store",
        &f,
    );
    // The same request, the same step: still two pages in one block.
    let v = f.san.tier_store(f.decode, A, q, block(1), 3).unwrap();
    assert_eq!(v.kind(), Some(ViolationKind::TierBlockAliased));
}

#[test]
fn a_prefix_cache_block_is_loaded_by_whom_the_policy_allows() {
    let f = fixture();
    // A's page registered in the prefix cache, then evicted to disk by
    // the cache.
    evicted(&f, A, block(1), true);
    // A hit of another request of A's tenant: allowed.
    let (_, v) = load(&f, A2, 5, block(1));
    continues(v, "A2's hit", &f);
    // Another tenant's: kept apart (prefix_share=tenant).
    let (_, v) = load(&f, B, 6, block(1));
    assert_eq!(v.kind(), Some(ViolationKind::TierForeignLoad));
    let text = f.out.text();
    assert!(text.contains("prefix_share=tenant"), "{text}");
}

#[test]
fn under_prefix_share_global_any_request_may_load_a_cached_block() {
    let f = fixture_with("prefix_share=global");
    evicted(&f, A, block(1), false);
    let (_, v) = load(&f, B, 6, block(1));
    continues(v, "B's hit", &f);
    // A request's own (not cached) block stays its own, whatever the policy.
    offloaded(&f, A, 3, 0..SLOTS, block(2));
    let (_, v) = load(&f, B, 7, block(2));
    assert_eq!(v.kind(), Some(ViolationKind::TierForeignLoad));
}

#[test]
fn a_cached_block_keeps_its_writers_salt() {
    let f = fixture();
    let salted = Owner::new(11, 1);
    f.san.declare_salt(salted, 0x5a17);
    evicted(&f, salted, block(1), false);
    // Same tenant, no salt: kept apart.
    let (_, v) = load(&f, A2, 5, block(1));
    assert_eq!(v.kind(), Some(ViolationKind::TierForeignLoad));
    assert!(!f.out.text().contains("5a17"), "salts are never printed");
}

#[test]
fn a_store_of_a_page_the_storer_does_not_hold_is_caught() {
    let f = fixture();
    let p = f.alloc(f.decode, 2, A, 1);
    f.write_all(f.decode, A, p, 0..SLOTS, 2);
    let v = f.san.tier_store(f.decode, B, p, block(1), 3).unwrap();
    assert_eq!(v.kind(), Some(ViolationKind::ForeignRead));
    f.free(f.decode, A, p, 4);
    let v = f.san.tier_store(f.decode, A, p, block(1), 5).unwrap();
    assert_eq!(v.kind(), Some(ViolationKind::ReadFreePage));
    let again = f.alloc(f.decode, 2, B, 6);
    let v = f.san.tier_store(f.decode, A, p, block(1), 7).unwrap();
    assert_eq!(v.kind(), Some(ViolationKind::GenerationMismatch));
    assert_ne!(again.generation, p.generation);
    // None of them made the block live.
    assert_eq!(f.san.tier_block_state(block(1)), None);
}

#[test]
fn a_load_into_a_page_the_loader_does_not_hold_is_checked_like_a_store() {
    let f = fixture();
    offloaded(&f, A, 2, 0..SLOTS, block(1));
    let other = f.alloc(f.decode, 5, B, 5);
    let v = f.san.tier_load(f.decode, A, other, block(1), 6).unwrap();
    assert_eq!(v.kind(), Some(ViolationKind::ForeignWrite));
    let mine = f.alloc(f.decode, 6, A, 7);
    f.free(f.decode, A, mine, 8);
    let v = f.san.tier_load(f.decode, A, mine, block(1), 9).unwrap();
    assert_eq!(v.kind(), Some(ViolationKind::WriteAfterFree));
}

#[test]
fn a_terminal_request_moves_no_kv_through_a_tier() {
    let f = fixture();
    offloaded(&f, A, 2, 0..SLOTS, block(1));
    let dst = f.alloc(f.decode, 5, A, 5);
    assert!(f.san.request_event(A, RequestEvent::Queued).is_continue());
    // It ends holding `dst`: that is reported (page-leak), then its load.
    let v = f.san.request_event(A, RequestEvent::Aborted);
    assert_eq!(v.kind(), Some(ViolationKind::PageLeak));
    let v = f.san.tier_load(f.decode, A, dst, block(1), 6).unwrap();
    assert_eq!(v.kind(), Some(ViolationKind::TerminalRequestActivity));
}

#[test]
fn bookkeeping_a_sanitizer_cannot_follow_is_an_error_not_a_finding() {
    let f = fixture();
    let err = f.san.tier_store_done(block(3), 7, true).unwrap_err();
    assert!(
        matches!(
            err,
            SanitizerError::TierBlockNotStoring {
                state: "unknown",
                ..
            }
        ),
        "{err}"
    );
    // A block of 16-slot pages loaded into a pool of 32-slot pages.
    offloaded(&f, A, 2, 0..SLOTS, block(1));
    let mut wide = geometry(NodeRole::Decode, "decode-wide", 4);
    wide.page_slots = 32;
    let pool = f.san.pool_register(wide).unwrap();
    let (v, generation) = f.san.alloc(pool, kvsan_sanitizer::PageId(0), A, 5).unwrap();
    assert!(v.is_continue());
    let dst = PageRef {
        page: kvsan_sanitizer::PageId(0),
        generation,
    };
    let err = f.san.tier_load(pool, A, dst, block(1), 6).unwrap_err();
    assert!(
        err.to_string()
            .contains("holds a page of 16 slots x 30 layers; pool 2 has pages of 32 slots"),
        "{err}"
    );
    assert_eq!(f.san.violation_count(), 0);
}
