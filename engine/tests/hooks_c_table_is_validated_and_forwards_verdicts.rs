//! The C hook table path without a shim: tables built in this test, their
//! functions forwarding to an in-process `Sanitizer` through the C types, are
//! validated by `CTableHooks::from_raw` and then drive the same checks.

use std::ffi::c_void;
use std::sync::Arc;

use kvsan_engine::hooks::ctable::{
    CTableHooks, HOOK_TABLE_V1_0_SIZE, HOOK_TABLE_V1_1_SIZE, HOOK_TABLE_VERSION_MAJOR,
    KVSAN_FLAG_POISON, KVSAN_VERDICT_ABORT, KVSAN_VERDICT_CONTINUE, KvsanHookTable,
    KvsanKernelAccess, KvsanKernelShadow, KvsanManifest, KvsanOwner, KvsanPageRef,
    KvsanPoolGeometry, KvsanRange, KvsanVerdict, event_from_code, slice_or_empty,
};
use kvsan_engine::hooks::{HookTarget, Hooks, Verdict};
use kvsan_sanitizer::{
    AccessOp, Check, Generation, KernelAccess, NodeRole, Options, Owner, PageId, PageRef,
    PoolGeometry, PoolId, RequestEvent, RequestId, Sanitizer, TenantId, TierBlockId, ViolationKind,
};

/// # Safety
/// `ctx` is the `Sanitizer` the table was built with.
unsafe fn san<'a>(ctx: *mut c_void) -> &'a Sanitizer {
    // SAFETY: every table of this test carries a pointer to a live Sanitizer.
    unsafe { &*ctx.cast::<Sanitizer>() }
}

fn out(r: Result<Verdict, kvsan_sanitizer::SanitizerError>) -> KvsanVerdict {
    r.map_or(KvsanVerdict::ERROR, KvsanVerdict::from)
}

unsafe extern "C" fn pool_register(
    ctx: *mut c_void,
    g: *const KvsanPoolGeometry,
    pool_out: *mut u32,
) -> KvsanVerdict {
    // SAFETY: the engine passes a geometry borrowing its node name and a writable id.
    let Some(geometry) = (unsafe { (*g).to_geometry() }) else {
        return KvsanVerdict::ERROR;
    };
    // SAFETY: as above.
    let landing = unsafe { (*g).landing() };
    // SAFETY: see `san`.
    match unsafe { san(ctx) }.pool_register_with(geometry, landing) {
        Ok(id) => {
            // SAFETY: the engine hands a writable u32.
            unsafe { *pool_out = id.0 };
            KvsanVerdict::CONTINUE
        }
        Err(_) => KvsanVerdict::ERROR,
    }
}

unsafe extern "C" fn request_event(
    ctx: *mut c_void,
    owner: KvsanOwner,
    event: u32,
) -> KvsanVerdict {
    let Some(event) = event_from_code(event) else {
        return KvsanVerdict::ERROR;
    };
    // SAFETY: see `san`.
    unsafe { san(ctx) }
        .request_event(owner.into(), event)
        .into()
}

unsafe extern "C" fn alloc(
    ctx: *mut c_void,
    pool: u32,
    owner: KvsanOwner,
    page: KvsanPageRef,
    step: u64,
) -> KvsanVerdict {
    // SAFETY: see `san`.
    match unsafe { san(ctx) }.alloc(PoolId(pool), PageId(page.page), owner.into(), step) {
        Ok((v, _)) => v.into(),
        Err(_) => KvsanVerdict::ERROR,
    }
}

unsafe extern "C" fn free(
    ctx: *mut c_void,
    pool: u32,
    owner: KvsanOwner,
    page: KvsanPageRef,
    step: u64,
) -> KvsanVerdict {
    // SAFETY: see `san`.
    out(unsafe { san(ctx) }.free(PoolId(pool), owner.into(), page.into(), step))
}

unsafe extern "C" fn write(
    ctx: *mut c_void,
    pool: u32,
    owner: KvsanOwner,
    page: KvsanPageRef,
    slots: KvsanRange,
    layers: KvsanRange,
    step: u64,
) -> KvsanVerdict {
    // SAFETY: see `san`.
    out(unsafe { san(ctx) }.write(
        PoolId(pool),
        owner.into(),
        page.into(),
        slots.into(),
        layers.into(),
        step,
    ))
}

fn table_of(ptr: *const KvsanPageRef, len: usize) -> Option<Vec<PageRef>> {
    // SAFETY: the engine passes its block table as pointer and length.
    unsafe { slice_or_empty(ptr, len) }.map(|t| t.iter().map(|&p| p.into()).collect())
}

unsafe extern "C" fn read(
    ctx: *mut c_void,
    pool: u32,
    owner: KvsanOwner,
    table: *const KvsanPageRef,
    len: usize,
    tokens: u64,
    layers: KvsanRange,
    step: u64,
) -> KvsanVerdict {
    let Some(table) = table_of(table, len) else {
        return KvsanVerdict::ERROR;
    };
    // SAFETY: see `san`.
    out(unsafe { san(ctx) }.read(
        PoolId(pool),
        owner.into(),
        &table,
        tokens as usize,
        layers.into(),
        step,
    ))
}

unsafe extern "C" fn transfer(
    ctx: *mut c_void,
    pool: u32,
    m: *const KvsanManifest,
) -> KvsanVerdict {
    // SAFETY: the engine passes a manifest borrowing its block tables.
    let Some(m) = (unsafe { (*m).to_manifest() }) else {
        return KvsanVerdict::ERROR;
    };
    // SAFETY: see `san`.
    out(unsafe { san(ctx) }.transfer_send(PoolId(pool), &m))
}

unsafe extern "C" fn commit(
    ctx: *mut c_void,
    pool: u32,
    owner: KvsanOwner,
    table: *const KvsanPageRef,
    len: usize,
    committed: u64,
) -> KvsanVerdict {
    let Some(table) = table_of(table, len) else {
        return KvsanVerdict::ERROR;
    };
    // SAFETY: see `san`.
    out(unsafe { san(ctx) }.transfer_commit(PoolId(pool), owner.into(), &table, committed as usize))
}

unsafe extern "C" fn kernel_shadow(
    ctx: *mut c_void,
    pool: u32,
    out: *mut KvsanKernelShadow,
) -> KvsanVerdict {
    // SAFETY: see `san`.
    match unsafe { san(ctx) }.kernel_shadow(PoolId(pool)) {
        Ok(view) => {
            // SAFETY: the engine hands a writable description.
            unsafe { out.write(view.to_raw()) };
            KvsanVerdict::CONTINUE
        }
        Err(_) => KvsanVerdict::ERROR,
    }
}

unsafe extern "C" fn kernel_refusal(
    ctx: *mut c_void,
    pool: u32,
    owner: KvsanOwner,
    access: *const KvsanKernelAccess,
    step: u64,
) -> KvsanVerdict {
    // SAFETY: the engine passes the access, alive for the call.
    let Some(access) = (unsafe { *access }).to_access() else {
        return KvsanVerdict::ERROR;
    };
    // SAFETY: see `san`.
    out(unsafe { san(ctx) }.kernel_refusal(PoolId(pool), owner.into(), &access, step))
}

unsafe extern "C" fn request_event_at(
    ctx: *mut c_void,
    pool: u32,
    owner: KvsanOwner,
    event: u32,
) -> KvsanVerdict {
    let Some(event) = event_from_code(event) else {
        return KvsanVerdict::ERROR;
    };
    // SAFETY: see `san`.
    out(unsafe { san(ctx) }.request_event_at(PoolId(pool), owner.into(), event))
}

unsafe extern "C" fn share(
    ctx: *mut c_void,
    pool: u32,
    page: KvsanPageRef,
    sharer: KvsanOwner,
) -> KvsanVerdict {
    // SAFETY: see `san`.
    out(unsafe { san(ctx) }.share(PoolId(pool), page.into(), sharer.into()))
}

unsafe extern "C" fn declare_salt(ctx: *mut c_void, owner: KvsanOwner, salt: u64) -> KvsanVerdict {
    // SAFETY: see `san`.
    unsafe { san(ctx) }.declare_salt(owner.into(), salt);
    KvsanVerdict::CONTINUE
}

unsafe extern "C" fn tier_store(
    ctx: *mut c_void,
    pool: u32,
    owner: KvsanOwner,
    page: KvsanPageRef,
    tier: u32,
    block: u64,
    step: u64,
) -> KvsanVerdict {
    let block = TierBlockId::new(tier, block);
    // SAFETY: see `san`.
    out(unsafe { san(ctx) }.tier_store(PoolId(pool), owner.into(), page.into(), block, step))
}

unsafe extern "C" fn tier_store_done(
    ctx: *mut c_void,
    tier: u32,
    block: u64,
    digest: u64,
    stored: u32,
) -> KvsanVerdict {
    // SAFETY: see `san`.
    out(unsafe { san(ctx) }.tier_store_done(TierBlockId::new(tier, block), digest, stored == 1))
}

unsafe extern "C" fn tier_load(
    ctx: *mut c_void,
    pool: u32,
    owner: KvsanOwner,
    page: KvsanPageRef,
    tier: u32,
    block: u64,
    step: u64,
) -> KvsanVerdict {
    let block = TierBlockId::new(tier, block);
    // SAFETY: see `san`.
    out(unsafe { san(ctx) }.tier_load(PoolId(pool), owner.into(), page.into(), block, step))
}

unsafe extern "C" fn tier_verify(
    ctx: *mut c_void,
    pool: u32,
    owner: KvsanOwner,
    page: KvsanPageRef,
    tier: u32,
    block: u64,
    digest: u64,
) -> KvsanVerdict {
    let block = TierBlockId::new(tier, block);
    // SAFETY: see `san`.
    out(unsafe { san(ctx) }.tier_verify(PoolId(pool), owner.into(), page.into(), block, digest))
}

unsafe extern "C" fn tier_release(ctx: *mut c_void, tier: u32, block: u64) -> KvsanVerdict {
    // SAFETY: see `san`.
    KvsanVerdict::from(unsafe { san(ctx) }.tier_release(TierBlockId::new(tier, block)))
}

/// A version-1.2 table forwarding to `sanitizer`.
fn forwarding_table(sanitizer: &Arc<Sanitizer>) -> KvsanHookTable {
    KvsanHookTable {
        size: size_of::<KvsanHookTable>() as u32,
        version_major: HOOK_TABLE_VERSION_MAJOR,
        version_minor: 2,
        flags: KVSAN_FLAG_POISON,
        quarantine_pages: 3,
        ctx: Arc::as_ptr(sanitizer).cast_mut().cast(),
        pool_register: Some(pool_register),
        request_event: Some(request_event),
        alloc: Some(alloc),
        free: Some(free),
        write: Some(write),
        read: Some(read),
        transfer_send: Some(transfer),
        transfer_recv: Some(transfer),
        transfer_commit: Some(commit),
        kernel_shadow: Some(kernel_shadow),
        kernel_refusal: Some(kernel_refusal),
        request_event_at: Some(request_event_at),
        share: Some(share),
        declare_salt: Some(declare_salt),
        // A 1.2 library has no landing hooks: the engine registers its
        // pools as reporting none.
        transfer_land: None,
        transfer_verify: None,
        // Nor tier hooks: the engine's tier calls continue unchecked.
        tier_store: None,
        tier_store_done: None,
        tier_load: None,
        tier_verify: None,
        tier_release: None,
    }
}

/// A landing hook of a library that checks no landing.
unsafe extern "C" fn no_landing(
    _: *mut c_void,
    _: u32,
    _: *const kvsan_engine::hooks::ctable::KvsanPageLanding,
) -> KvsanVerdict {
    KvsanVerdict::CONTINUE
}

/// A version-1.6 table forwarding every hook, tiers included, to
/// `sanitizer` (the landing hooks are left out: the pools of these tests
/// report no landing).
fn tier_table(sanitizer: &Arc<Sanitizer>) -> KvsanHookTable {
    KvsanHookTable {
        version_minor: 6,
        transfer_land: Some(no_landing),
        transfer_verify: Some(no_landing),
        tier_store: Some(tier_store),
        tier_store_done: Some(tier_store_done),
        tier_load: Some(tier_load),
        tier_verify: Some(tier_verify),
        tier_release: Some(tier_release),
        ..forwarding_table(sanitizer)
    }
}

fn sanitizer() -> Arc<Sanitizer> {
    Arc::new(Sanitizer::with_writer(Options::default(), std::io::sink()))
}

fn rejection(table: *const KvsanHookTable) -> String {
    // SAFETY: `table` is null or points to a whole table of this test.
    match unsafe { CTableHooks::from_raw(table) } {
        Ok(_) => panic!("table accepted"),
        Err(e) => e.to_string(),
    }
}

#[test]
fn a_null_table_is_not_attached() {
    assert!(rejection(std::ptr::null()).contains("null"));
}

#[test]
fn a_table_smaller_than_the_engine_knows_is_not_attached() {
    let s = sanitizer();
    let mut t = forwarding_table(&s);
    t.size = 24;
    let e = rejection(&t);
    assert!(e.contains("size is 24 bytes"), "{e}");
    assert!(e.contains(&HOOK_TABLE_V1_0_SIZE.to_string()), "{e}");
}

#[test]
fn a_version_1_0_table_is_attached_without_a_kernel_shadow() {
    let s = sanitizer();
    let mut t = forwarding_table(&s);
    t.size = HOOK_TABLE_V1_0_SIZE as u32;
    t.version_minor = 0;
    // Past its size the engine reads nothing: these must not be used.
    t.kernel_shadow = None;
    t.kernel_refusal = None;
    t.request_event_at = None;
    t.share = None;
    t.declare_salt = None;
    // SAFETY: a whole table on the stack (larger than its declared size).
    let hooks = Hooks::c_table(unsafe { CTableHooks::from_raw(&t) }.expect("attached"));
    let pool = hooks.pool_register(&geometry(), PoolId(99));
    assert!(hooks.kernel_shadow(pool).is_none());
}

#[test]
fn a_version_1_1_table_with_a_null_kernel_hook_is_not_attached() {
    let s = sanitizer();
    let mut t = forwarding_table(&s);
    t.size = HOOK_TABLE_V1_1_SIZE as u32;
    t.version_minor = 1;
    t.kernel_refusal = None;
    let e = rejection(&t);
    assert!(e.contains("`kernel_refusal`"), "{e}");
}

#[test]
fn a_version_1_2_table_with_a_null_share_hook_is_not_attached() {
    let s = sanitizer();
    let mut t = forwarding_table(&s);
    t.share = None;
    let e = rejection(&t);
    assert!(e.contains("`share`"), "{e}");
}

/// A 1.1 library (no share hooks) is attached; the engine's shares then
/// continue unchecked, without a call past the table's end.
#[test]
fn a_version_1_1_table_is_attached_and_its_shares_continue_unchecked() {
    let s = Arc::new(Sanitizer::with_writer(
        Options::parse("prefix_share=off").unwrap(),
        std::io::sink(),
    ));
    let mut t = forwarding_table(&s);
    t.size = HOOK_TABLE_V1_1_SIZE as u32;
    t.version_minor = 1;
    // Past its size the engine reads nothing: a call through these would
    // be a bug (and under prefix_share=off a violation).
    t.share = Some(share);
    t.declare_salt = Some(declare_salt);
    // SAFETY: a whole table on the stack (larger than its declared size),
    // its ctx the live sanitizer `s`.
    let hooks = Hooks::c_table(unsafe { CTableHooks::from_raw(&t) }.expect("attached"));
    let pool = hooks.pool_register(&geometry(), PoolId(99));
    let owner = Owner {
        request: RequestId(1),
        tenant: TenantId(7),
    };
    let page = PageRef {
        page: PageId(0),
        generation: Generation(1),
    };
    assert!(hooks.alloc(pool, owner, page, 1).is_continue());
    let other = Owner {
        request: RequestId(2),
        tenant: TenantId(7),
    };
    assert!(hooks.declare_salt(other, 5).is_continue());
    assert!(hooks.share(pool, page, other).is_continue());
    assert_eq!(s.violation_count(), 0);
    assert!(
        !s.page_info(pool, page.page).unwrap().shared,
        "never called"
    );
}

#[test]
fn without_a_target_share_and_declare_salt_continue() {
    let hooks = Hooks::none();
    let owner = Owner {
        request: RequestId::PREFIX_CACHE,
        tenant: TenantId(1),
    };
    let page = PageRef {
        page: PageId(0),
        generation: Generation(1),
    };
    assert!(hooks.share(PoolId(0), page, owner).is_continue());
    assert!(hooks.declare_salt(owner, 9).is_continue());
}

/// Through a 1.6 table a tier's stores and loads are checked: a page stored
/// into a block and loaded back by its request passes; another page stored
/// into the same block, and another request's load, abort with their
/// kinds; the verdicts come back through the C types.
#[test]
fn through_the_c_table_tier_stores_and_loads_are_checked() {
    let s = sanitizer();
    let t = Box::leak(Box::new(tier_table(&s)));
    // SAFETY: a whole table, leaked for the process; ctx is `s`, kept alive below.
    let hooks = Hooks::c_table(unsafe { CTableHooks::from_raw(t) }.expect("attached"));
    let pool = hooks.pool_register(&geometry(), PoolId(99));
    let (a, b) = (
        Owner {
            request: RequestId(1),
            tenant: TenantId(7),
        },
        Owner {
            request: RequestId(2),
            tenant: TenantId(8),
        },
    );
    let page = |n, generation| PageRef {
        page: PageId(n),
        generation: Generation(generation),
    };
    let block = TierBlockId::new(0, 3);
    assert!(hooks.alloc(pool, a, page(0, 1), 1).is_continue());
    assert!(
        s.write(pool, a, page(0, 1), 0..4, 0..2, 2)
            .unwrap()
            .is_continue()
    );
    assert!(
        hooks
            .tier_store(pool, a, page(0, 1), block, 3)
            .is_continue()
    );
    assert!(hooks.tier_store_done(block, 0x77, true).is_continue());
    assert!(hooks.alloc(pool, b, page(1, 1), 4).is_continue());
    let v = hooks.tier_store(pool, b, page(1, 1), block, 5);
    assert_eq!(v.kind(), Some(ViolationKind::TierBlockAliased));
    let v = hooks.tier_load(pool, b, page(1, 1), block, 6);
    assert_eq!(v.kind(), Some(ViolationKind::TierForeignLoad));
    assert!(hooks.alloc(pool, a, page(2, 1), 7).is_continue());
    assert!(hooks.tier_load(pool, a, page(2, 1), block, 8).is_continue());
    assert!(
        hooks
            .tier_verify(pool, a, page(2, 1), block, 0x77)
            .is_continue()
    );
    assert!(hooks.tier_release(block).is_continue());
    let v = hooks.tier_load(pool, a, page(2, 1), block, 9);
    assert_eq!(v.kind(), Some(ViolationKind::TierLoadUnstored));
    assert_eq!(s.violation_count(), 3);
}

/// A 1.5 table has no tier hooks: a tier's calls continue and nothing is
/// asked of the library.
#[test]
fn a_version_1_5_table_is_attached_and_its_tier_calls_continue_unchecked() {
    let s = sanitizer();
    let mut t = tier_table(&s);
    t.version_minor = 5;
    t.size = 152;
    // SAFETY: a whole table on the stack (larger than its declared size).
    let hooks = Hooks::c_table(unsafe { CTableHooks::from_raw(&t) }.expect("attached"));
    let pool = hooks.pool_register(&geometry(), PoolId(99));
    let owner = Owner {
        request: RequestId(1),
        tenant: TenantId(7),
    };
    let page = PageRef {
        page: PageId(0),
        generation: Generation(1),
    };
    // A load of a block never stored: tier-load-unstored, were it asked.
    let block = TierBlockId::new(0, 1);
    assert!(hooks.alloc(pool, owner, page, 1).is_continue());
    assert!(hooks.tier_load(pool, owner, page, block, 2).is_continue());
    assert_eq!(s.violation_count(), 0);
}

fn geometry() -> PoolGeometry {
    PoolGeometry {
        pages: 4,
        page_slots: 4,
        layers: 2,
        bytes_per_slot: 64,
        role: NodeRole::Unified,
        node: "unified".into(),
    }
}

#[test]
fn a_table_of_another_major_version_is_not_attached() {
    let s = sanitizer();
    let mut t = forwarding_table(&s);
    t.version_major = 2;
    t.version_minor = 7;
    let e = rejection(&t);
    assert!(e.contains("version is 2.7"), "{e}");
}

#[test]
fn a_table_with_a_null_hook_is_not_attached_and_the_error_names_the_hook() {
    let s = sanitizer();
    let mut t = forwarding_table(&s);
    t.transfer_recv = None;
    let e = rejection(&t);
    assert!(e.contains("`transfer_recv`"), "{e}");
}

#[test]
fn a_larger_table_of_a_newer_minor_version_is_attached() {
    let s = sanitizer();
    #[repr(C)]
    struct Newer {
        base: KvsanHookTable,
        extra: [u64; 2],
    }
    let mut t = Newer {
        base: forwarding_table(&s),
        extra: [0; 2],
    };
    t.base.size = size_of::<Newer>() as u32;
    t.base.version_minor = 3;
    // SAFETY: `t` is a whole table of `size` bytes, its ctx a live sanitizer.
    let hooks = unsafe { CTableHooks::from_raw(&raw const t.base) }.expect("attached");
    assert_eq!(hooks.version(), (1, 3));
    assert_eq!(t.extra, [0; 2]);
}

/// A table that says 1.2 but is only as large as a 1.1 table: the engine
/// uses the 1.1 hooks it covers and reads nothing past its size.
#[test]
fn a_table_too_small_for_its_minor_version_is_used_as_far_as_its_size_goes() {
    let s = sanitizer();
    let mut t = forwarding_table(&s);
    t.size = HOOK_TABLE_V1_1_SIZE as u32;
    t.share = None;
    t.declare_salt = None;
    // SAFETY: a whole table on the stack (larger than its declared size).
    let hooks = Hooks::c_table(unsafe { CTableHooks::from_raw(&t) }.expect("attached"));
    let pool = hooks.pool_register(&geometry(), PoolId(99));
    assert!(
        hooks.kernel_shadow(pool).is_some(),
        "the 1.1 hooks are used"
    );
    let page = PageRef {
        page: PageId(0),
        generation: Generation(1),
    };
    let owner = Owner {
        request: RequestId(1),
        tenant: TenantId(7),
    };
    assert!(hooks.share(pool, page, owner).is_continue());
}

/// Through a 1.2 table the prefix cache's shares are checked: it registers
/// a filled page, the writer lets go, a request of its tenant shares it,
/// another tenant's is refused, and a page not filled is not registered.
#[test]
fn through_the_c_table_the_prefix_cache_holds_pages_and_shares_are_checked() {
    let s = sanitizer();
    let t = Box::leak(Box::new(forwarding_table(&s)));
    // SAFETY: a whole table, leaked for the process; ctx is `s`, kept alive below.
    let hooks = Hooks::c_table(unsafe { CTableHooks::from_raw(t) }.expect("attached"));
    let pool = hooks.pool_register(&geometry(), PoolId(99));
    let writer = Owner {
        request: RequestId(1),
        tenant: TenantId(7),
    };
    let cache = Owner {
        request: RequestId::PREFIX_CACHE,
        tenant: writer.tenant,
    };
    let hit = Owner {
        request: RequestId(2),
        tenant: TenantId(7),
    };
    let stranger = Owner {
        request: RequestId(3),
        tenant: TenantId(9),
    };
    for o in [writer, hit, stranger] {
        assert!(hooks.declare_salt(o, 0).is_continue());
    }
    let full = PageRef {
        page: PageId(0),
        generation: Generation(1),
    };
    let half = PageRef {
        page: PageId(1),
        generation: Generation(1),
    };
    assert!(hooks.alloc(pool, writer, full, 1).is_continue());
    assert!(hooks.alloc(pool, writer, half, 1).is_continue());
    let shadow = hooks.kernel_shadow(pool).expect("a kernel shadow");
    let view = shadow.view();
    for layer in 0..2 {
        for slot in 0..4 {
            assert_eq!(view.store(writer.request, full, layer, slot, 2), Check::Ok);
        }
        assert_eq!(view.store(writer.request, half, layer, 0, 2), Check::Ok);
    }
    assert!(hooks.share(pool, full, cache).is_continue());
    assert_eq!(
        hooks.share(pool, half, cache).kind(),
        Some(ViolationKind::UnwrittenShare)
    );
    // The writer's store into the page the cache holds is refused.
    assert_eq!(
        view.store(writer.request, full, 0, 0, 3),
        Check::Refused(ViolationKind::ForeignWrite)
    );
    assert!(hooks.free(pool, writer, full, 3).is_continue());
    assert!(hooks.share(pool, full, hit).is_continue());
    assert_eq!(view.check_read(hit.request, full, 1, 4), Check::Arbitrate);
    assert_eq!(
        hooks.share(pool, full, stranger).kind(),
        Some(ViolationKind::CrossDomainShare)
    );
    assert!(hooks.free(pool, cache, full, 4).is_continue());
    assert!(hooks.free(pool, hit, full, 5).is_continue());
    // The last holder let go: free (no quarantine by default).
    assert_eq!(
        s.page_info(pool, full.page).unwrap().state,
        kvsan_sanitizer::PageState::Free
    );
    assert_eq!(s.violation_count(), 2);
}

#[test]
fn an_absent_table_symbol_attaches_nothing() {
    assert!(CTableHooks::from_symbol(c"kvsan_hook_table_v1_not_exported_here").is_none());
}

#[test]
fn through_the_c_table_a_kernel_read_of_an_unwritten_slot_aborts_with_stale_read() {
    let s = sanitizer();
    let t = Box::leak(Box::new(forwarding_table(&s)));
    // SAFETY: a whole table, leaked for the process; ctx is `s`, kept alive below.
    let hooks = Hooks::c_table(unsafe { CTableHooks::from_raw(t) }.expect("attached"));
    assert_eq!(hooks.target(), HookTarget::CTable);
    assert!(hooks.poison());
    assert_eq!(hooks.quarantine_pages(), 3);
    let pool = hooks.pool_register(&geometry(), PoolId(99));
    assert_eq!(pool, PoolId(0), "the sanitizer's id, not the fallback");
    let owner = Owner {
        request: RequestId(1),
        tenant: TenantId(7),
    };
    assert!(
        hooks
            .request_event(pool, owner, RequestEvent::Admitted)
            .is_continue()
    );
    let page = PageRef {
        page: PageId(2),
        generation: Generation(1),
    };
    assert!(hooks.alloc(pool, owner, page, 1).is_continue());
    // The library's shadow memory, checked in place as the kernels do.
    let handle = hooks
        .kernel_shadow(pool)
        .expect("a 1.1 table has a kernel shadow");
    let shadow = handle.view();
    for slot in 0..2 {
        assert_eq!(shadow.store(owner.request, page, 1, slot, 1), Check::Ok);
    }
    assert_eq!(shadow.check_read(owner.request, page, 1, 2), Check::Ok);
    assert_eq!(
        shadow.check_read(owner.request, page, 1, 3),
        Check::Refused(ViolationKind::StaleRead)
    );
    let access = KernelAccess {
        op: AccessOp::Read,
        page,
        entry: 0,
        layer: 1,
        slots: 0..3,
    };
    let v = hooks.kernel_refusal(pool, owner, &access, 2);
    assert_eq!(v.kind(), Some(ViolationKind::StaleRead));
    let Verdict::Abort { violation, .. } = v else {
        panic!("abort expected")
    };
    assert_eq!(
        s.violations()[0].id,
        violation,
        "the library's violation id"
    );
    assert!(hooks.free(pool, owner, page, 3).is_continue());
    assert_eq!(
        hooks.free(pool, owner, page, 4).kind(),
        Some(ViolationKind::DoubleFree)
    );
    assert_eq!(s.violation_count(), 2);
}

unsafe extern "C" fn abort_with_unknown_kind(
    _: *mut c_void,
    _: u32,
    _: KvsanOwner,
    _: KvsanPageRef,
    _: u64,
) -> KvsanVerdict {
    KvsanVerdict {
        code: KVSAN_VERDICT_ABORT,
        kind: 9_999,
        violation_id: 42,
    }
}

unsafe extern "C" fn unknown_code(
    _: *mut c_void,
    _: u32,
    _: KvsanOwner,
    _: KvsanPageRef,
    _: u64,
) -> KvsanVerdict {
    KvsanVerdict {
        code: 77,
        kind: 0,
        violation_id: 43,
    }
}

#[test]
fn an_unknown_kind_or_code_still_aborts_keeping_the_violation_id() {
    let s = sanitizer();
    let mut t = forwarding_table(&s);
    t.alloc = Some(abort_with_unknown_kind);
    t.free = Some(unknown_code);
    // SAFETY: a whole table on the stack, used within this scope only.
    let hooks = Hooks::c_table(unsafe { CTableHooks::from_raw(&t) }.expect("attached"));
    let owner = Owner {
        request: RequestId(5),
        tenant: TenantId(1),
    };
    let page = PageRef {
        page: PageId(0),
        generation: Generation(1),
    };
    let v = hooks.alloc(PoolId(0), owner, page, 0);
    assert!(
        matches!(v, Verdict::Abort { violation, kind: ViolationKind::DoubleAlloc } if violation.0 == 42)
    );
    let v = hooks.free(PoolId(0), owner, page, 0);
    assert!(
        matches!(v, Verdict::Abort { violation, kind: ViolationKind::DoubleFree } if violation.0 == 43)
    );
    assert_eq!(KVSAN_VERDICT_CONTINUE, 0);
}

/// A library that refuses every tier store (as it would a store into a
/// block still holding another page).
unsafe extern "C" fn refuse_store(
    _: *mut c_void,
    _: u32,
    _: KvsanOwner,
    _: KvsanPageRef,
    _: u32,
    _: u64,
    _: u64,
) -> KvsanVerdict {
    KvsanVerdict {
        code: KVSAN_VERDICT_ABORT,
        kind: ViolationKind::TierBlockAliased.code(),
        violation_id: 77,
    }
}

/// An engine with a host tier whose library refuses its stores: each
/// request it preempts ends with that violation (its pages returned, no
/// block kept), and the others finish.
#[test]
fn a_tier_store_the_library_refuses_ends_the_preempted_request_and_the_others_finish() {
    use kvsan_engine::engine::{Engine, EngineConfig};
    use kvsan_engine::model::SyntheticSpec;
    use kvsan_engine::request::{ErrorKind, Request};
    use kvsan_engine::sampler::SamplingParams;
    use kvsan_engine::scheduler::SchedulerConfig;

    let s = sanitizer();
    let mut t = tier_table(&s);
    t.tier_store = Some(refuse_store);
    let t = Box::leak(Box::new(t));
    // SAFETY: a whole table, leaked for the process; ctx is `s`, kept alive below.
    let hooks = Hooks::c_table(unsafe { CTableHooks::from_raw(t) }.expect("attached"));
    let model = Arc::new(
        SyntheticSpec {
            context_length: 1024,
            ..SyntheticSpec::default()
        }
        .build()
        .expect("synthetic model"),
    );
    let cfg = EngineConfig {
        pool_tokens: Some(128),
        allow_pool_smaller_than_context: true,
        scheduler: SchedulerConfig {
            step_tokens: 64,
            max_running: 16,
            chunk_tokens: None,
        },
        hooks,
        kv_offload_host_bytes: 16 << 20,
        ..EngineConfig::default()
    };
    let engine = Engine::unified(model, &cfg).expect("engine");
    let handles: Vec<_> = (0..12u32)
        .map(|i| {
            engine.submit(Request {
                tenant: TenantId(1 + i % 3),
                prompt: (0..30).map(|t| (t * 7 + i) % 256).collect(),
                max_tokens: 40,
                sampling: SamplingParams::greedy(),
                stop_tokens: Vec::new(),
                cache_salt: Default::default(),
            })
        })
        .collect();
    let outcomes: Vec<_> = handles.into_iter().map(|h| h.wait()).collect();
    let refused: Vec<_> = outcomes.iter().filter_map(|o| o.as_ref().err()).collect();
    let stats = engine.stats();
    assert!(
        stats.front.preemptions > 0,
        "the pool was meant to force preemption"
    );
    assert!(!refused.is_empty(), "a preempted request ends");
    for e in &refused {
        assert_eq!(e.kind, ErrorKind::Violation, "{e:?}");
        assert_eq!(
            e.violation.map(|v| v.kind),
            Some(ViolationKind::TierBlockAliased),
            "{e:?}"
        );
    }
    assert!(outcomes.iter().any(Result::is_ok), "the others finish");
    assert_eq!(
        (stats.front.tiers[0].stores, stats.front.tiers[0].used),
        (0, 0)
    );
    assert_eq!(stats.front.free_pages, stats.front.total_pages);
}
