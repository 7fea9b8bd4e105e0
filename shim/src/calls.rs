//! The operations behind both faces of the library — the hook table and the
//! plain C functions — on the process's sanitizer, with their C arguments
//! checked and converted first. Both faces give the same verdicts for the
//! same calls, and the same verdicts as the engine's in-process adapter:
//! an error is API misuse (the call could not be checked), a violation is a
//! verdict.

use std::ops::Range;

use kvsan_sanitizer::abi::{
    KVSAN_POOL_REPORTS_LANDING, KvsanKernelAccess, KvsanKernelShadow, KvsanManifest, KvsanOwner,
    KvsanPageLanding, KvsanPageRef, KvsanPoolGeometry, KvsanRange, event_from_code, role_from_code,
};
use kvsan_sanitizer::layouts::{Addresses, Array, Batch, DeviceArray, Host, MapBuffers};
use kvsan_sanitizer::{
    Generation, Landing, Manifest, NodeRole, Owner, PageId, PageLanding, PageRef, PoolGeometry,
    PoolId, Sanitizer, TierBlockId, Verdict,
};

use crate::attach::{sanitizer, say};
use crate::buffers::{CArray, CPointers, device_ordinal};
use crate::error::ShimError;

fn sanitizer_error(
    call: &'static str,
) -> impl FnOnce(kvsan_sanitizer::SanitizerError) -> ShimError {
    move |source| ShimError::Sanitizer { call, source }
}

/// The owner of a C owner; the reserved field must be 0.
fn owner(call: &'static str, owner: KvsanOwner) -> Result<Owner, ShimError> {
    if owner.reserved != 0 {
        return Err(ShimError::InvalidArgument {
            call,
            argument: "owner.reserved",
            value: owner.reserved.into(),
            allowed: "0",
        });
    }
    Ok(owner.into())
}

fn range(r: KvsanRange) -> Range<u32> {
    r.into()
}

/// Checks that `ptr` is non-null (when `len` > 0) and aligned for `T`.
fn check_array<T>(
    call: &'static str,
    argument: &'static str,
    ptr: *const T,
    len: usize,
) -> Result<(), ShimError> {
    if len == 0 {
        return Ok(());
    }
    if ptr.is_null() {
        return Err(ShimError::Null { call, argument });
    }
    if !ptr.cast::<u8>().addr().is_multiple_of(align_of::<T>()) {
        return Err(ShimError::Misaligned {
            call,
            argument,
            address: ptr.addr(),
            align: align_of::<T>(),
        });
    }
    Ok(())
}

/// The C array `ptr[0..len]`.
///
/// # Safety
/// - `ptr` is null, or points to `len` readable `T`s that stay unchanged
///   for `'a`.
pub(crate) unsafe fn slice<'a, T>(
    call: &'static str,
    argument: &'static str,
    ptr: *const T,
    len: usize,
) -> Result<&'a [T], ShimError> {
    check_array(call, argument, ptr, len)?;
    if len == 0 {
        return Ok(&[]);
    }
    // SAFETY: non-null and aligned (checked), `len` readable elements (the
    // caller's contract).
    Ok(unsafe { std::slice::from_raw_parts(ptr, len) })
}

/// The row owners of a batch, each checked as [`owner`] checks one.
///
/// # Safety
/// - as [`slice`] for `rows` owners.
unsafe fn row_owners(
    call: &'static str,
    owners: *const KvsanOwner,
    rows: usize,
) -> Result<Vec<Owner>, ShimError> {
    // SAFETY: the caller's contract on `owners`.
    let given = unsafe { slice(call, "owners", owners, rows) }?;
    given.iter().map(|&o| owner(call, o)).collect()
}

/// A batch check's arrays, as the kernels take them.
pub(crate) struct BatchArrays {
    pub owners: *const KvsanOwner,
    pub rows: usize,
}

/// The C pointers of a host batch check as slices, each checked by
/// [`slice`] for the length its C function gives it.
struct CSlices {
    call: &'static str,
}

impl<'a> MapBuffers<'a, CPointers, Host<'a>> for CSlices {
    type Error = ShimError;
    fn i32(&mut self, array: Array, from: &'a CArray<i32>) -> Result<&'a [i32], ShimError> {
        // SAFETY: `CSlices` is made only by `check_batch`, whose caller
        // promises each pointer holds its length's values.
        unsafe { slice(self.call, array.name, from.ptr, from.len) }
    }
    fn i64(&mut self, array: Array, from: &'a CArray<i64>) -> Result<&'a [i64], ShimError> {
        // SAFETY: as for `i32`.
        unsafe { slice(self.call, array.name, from.ptr, from.len) }
    }
}

/// A batch check over host buffers (`kvsan_check_*`): the owners, then each
/// buffer in list order, checked as [`slice`] checks one, then the
/// sanitizer's host check of the layout.
///
/// # Safety
/// - `rows.owners` as [`row_owners`];
/// - every pointer of `batch` as [`slice`] for the length it carries.
pub(crate) unsafe fn check_batch(
    call: &'static str,
    pool: u32,
    rows: BatchArrays,
    batch: &Batch<CPointers>,
    layers: KvsanRange,
    step: u64,
) -> Result<Vec<Verdict>, ShimError> {
    // SAFETY: the caller's contract on `owners`.
    let owners = unsafe { row_owners(call, rows.owners, rows.rows) }?;
    let host = batch.try_map(&mut CSlices { call })?;
    san()?
        .check_batch(PoolId(pool), &owners, &host, range(layers), step)
        .map_err(sanitizer_error(call))
}

/// A batch check over device buffers (`kvsan_check_*_device`): the owners
/// checked as the host checks check them, each device address non-null
/// (when its length is not 0) and aligned for its values, then
/// [`crate::device::check`] (feature `cuda`).
///
/// # Safety
/// - `rows.owners` as [`row_owners`];
/// - every address in `batch` is a live device allocation of device
///   `device` holding the values its length says (the header's contract).
pub(crate) unsafe fn check_device(
    call: &'static str,
    pool: u32,
    device: i32,
    rows: BatchArrays,
    batch: &Batch<Addresses>,
    layers: KvsanRange,
    step: u64,
) -> Result<Vec<Verdict>, ShimError> {
    // SAFETY: the caller's contract on `owners`.
    let owners = unsafe { row_owners(call, rows.owners, rows.rows) }?;
    let ordinal = device_ordinal(call, device)?;
    for (argument, DeviceArray { address, len }, size) in batch.device_arrays() {
        if len == 0 {
            continue;
        }
        if address == 0 {
            return Err(ShimError::Null { call, argument });
        }
        if !address.is_multiple_of(size as u64) {
            return Err(ShimError::Misaligned {
                call,
                argument,
                address: address as usize,
                align: size,
            });
        }
    }
    let san = san()?;
    #[cfg(feature = "cuda")]
    {
        // SAFETY: the caller's contract on the addresses.
        unsafe {
            crate::device::check(
                call,
                san,
                pool,
                ordinal,
                &owners,
                batch,
                range(layers),
                step,
            )
        }
    }
    #[cfg(not(feature = "cuda"))]
    {
        let _ = (san, pool, ordinal, owners, layers, step);
        Err(ShimError::Device {
            call,
            reason: "this library was built without the `cuda` feature".into(),
        })
    }
}

/// A C block table as the sanitizer's `PageRef`s (one layout, asserted in
/// `kvsan_sanitizer::abi`).
///
/// # Safety
/// - `ptr` is null, or points to `len` readable `KvsanPageRef`s that stay
///   unchanged for `'a`.
unsafe fn page_refs<'a>(
    call: &'static str,
    argument: &'static str,
    ptr: *const KvsanPageRef,
    len: usize,
) -> Result<&'a [PageRef], ShimError> {
    // SAFETY: the caller's contract on `ptr`; `PageRef` has
    // `KvsanPageRef`'s layout.
    unsafe { slice(call, argument, ptr.cast::<PageRef>(), len) }
}

/// The geometry at `g`.
///
/// # Safety
/// - `g` is null or points to a readable `KvsanPoolGeometry` whose
///   `node`/`node_len` describe readable bytes (or `node_len` is 0).
unsafe fn geometry(
    call: &'static str,
    g: *const KvsanPoolGeometry,
) -> Result<(PoolGeometry, Landing), ShimError> {
    if g.is_null() {
        return Err(ShimError::Null {
            call,
            argument: "geometry",
        });
    }
    // SAFETY: non-null and readable by the caller's contract; read
    // unaligned since nothing about the caller's memory is trusted.
    let g = unsafe { g.read_unaligned() };
    if role_from_code(g.role & !KVSAN_POOL_REPORTS_LANDING).is_none() {
        return Err(ShimError::InvalidArgument {
            call,
            argument: "geometry.role",
            value: g.role.into(),
            allowed: "0 unified, 1 prefill, 2 decode, each | 0x100 (KVSAN_POOL_REPORTS_LANDING)",
        });
    }
    if g.node.is_null() && g.node_len > 0 {
        return Err(ShimError::Null {
            call,
            argument: "geometry.node",
        });
    }
    let landing = g.landing();
    // SAFETY: `node`/`node_len` are readable by the caller's contract (or
    // empty); the role was checked, so `None` means a name that is not UTF-8.
    unsafe { g.to_geometry() }
        .map(|geometry| (geometry, landing))
        .ok_or(ShimError::InvalidArgument {
            call,
            argument: "geometry.node (bytes that are not UTF-8; length)",
            value: g.node_len as u64,
            allowed: "a UTF-8 name",
        })
}

/// The manifest at `m`.
///
/// # Safety
/// - `m` is null or points to a readable `KvsanManifest` whose two block
///   tables are readable for their lengths (or have length 0).
unsafe fn manifest(call: &'static str, m: *const KvsanManifest) -> Result<Manifest, ShimError> {
    if m.is_null() {
        return Err(ShimError::Null {
            call,
            argument: "manifest",
        });
    }
    // SAFETY: non-null and readable by the caller's contract.
    let m = unsafe { m.read_unaligned() };
    owner(call, m.request)?;
    check_array(call, "manifest.src_pages", m.src_pages, m.src_len)?;
    check_array(call, "manifest.dst_pages", m.dst_pages, m.dst_len)?;
    // SAFETY: both tables are non-null (or empty) and aligned (checked) and
    // readable for their lengths by the caller's contract.
    unsafe { m.to_manifest() }.ok_or(ShimError::Null {
        call,
        argument: "manifest.src_pages or manifest.dst_pages",
    })
}

fn san() -> Result<&'static Sanitizer, ShimError> {
    sanitizer()
}

// One function a hook of the list (`kvsan_sanitizer::for_each_hook!`), by
// its name, with its C arguments after the name of the function called
// (for messages); the table's hooks and the `kvsan_*` exports are generated
// around them. A pointer argument makes the function `unsafe`: it is null or
// valid as the header says for that argument.

/// Registers the pool at `geometry` and writes its id; says so on stderr
/// (which processes are sanitized is then visible in a staging log).
///
/// # Safety
/// - `geometry` as in [`geometry`];
/// - `pool_out` is null or writable.
pub(crate) unsafe fn pool_register(
    call: &'static str,
    geometry: *const KvsanPoolGeometry,
    pool_out: *mut u32,
) -> Result<Verdict, ShimError> {
    if pool_out.is_null() {
        return Err(ShimError::Null {
            call,
            argument: "pool_out",
        });
    }
    // SAFETY: the caller's contract on `geometry`.
    let (g, landing) = unsafe { self::geometry(call, geometry) }?;
    let s = san()?;
    let (node, role, pages, slots, layers) =
        (g.node.clone(), g.role, g.pages, g.page_slots, g.layers);
    let id = s
        .pool_register_with(g, landing)
        .map_err(sanitizer_error(call))?;
    // A receiving pool whose engine reports no landing is checked less:
    // say so once, where the operator reads the shim's lines.
    let unchecked_landing = if landing == Landing::Manifest && role == NodeRole::Decode {
        "; received KV is taken as written from its manifest (the engine reports no landing, ABI < 1.5): where it lands is NOT checked"
    } else {
        ""
    };
    say(format_args!(
        "kvsan: shadowing {id} (node {node:?}, role {}, {pages} pages x {slots} slots x {layers} layers){unchecked_landing}",
        role.name()
    ));
    // SAFETY: non-null, writable by the caller's contract.
    unsafe { pool_out.write_unaligned(id.0) };
    Ok(Verdict::Continue)
}

/// The request event of a C event code.
fn event(call: &'static str, code: u32) -> Result<kvsan_sanitizer::RequestEvent, ShimError> {
    event_from_code(code).ok_or(ShimError::InvalidArgument {
        call,
        argument: "event",
        value: code.into(),
        allowed: "0 queued .. 7 aborted",
    })
}

/// A lifecycle event by C code, in the whole process's view.
pub(crate) fn request_event(
    call: &'static str,
    o: KvsanOwner,
    code: u32,
) -> Result<Verdict, ShimError> {
    let o = owner(call, o)?;
    Ok(san()?.request_event(o, event(call, code)?))
}

/// A lifecycle event by C code, in the view of the node that owns `pool`.
pub(crate) fn request_event_at(
    call: &'static str,
    pool: u32,
    o: KvsanOwner,
    code: u32,
) -> Result<Verdict, ShimError> {
    let o = owner(call, o)?;
    san()?
        .request_event_at(PoolId(pool), o, event(call, code)?)
        .map_err(sanitizer_error(call))
}

/// Allocation of page index `page`; returns the verdict and the page's new
/// generation (`kvsan_alloc`, whose caller learns the generation from it).
pub(crate) fn alloc_page(
    call: &'static str,
    pool: u32,
    o: KvsanOwner,
    page: u32,
    step: u64,
) -> Result<(Verdict, Generation), ShimError> {
    let o = owner(call, o)?;
    let san = san()?;
    let out = san
        .alloc(PoolId(pool), PageId(page), o, step)
        .map_err(sanitizer_error(call))?;
    crate::nvtx::touched(san, pool, page);
    Ok(out)
}

/// Allocation of `page` by an engine that counts generations itself (the
/// hook table): a generation other than the shadow's is misuse, as in the
/// engine's in-process adapter.
pub(crate) fn alloc(
    call: &'static str,
    pool: u32,
    o: KvsanOwner,
    page: KvsanPageRef,
    step: u64,
) -> Result<Verdict, ShimError> {
    let (verdict, generation) = alloc_page(call, pool, o, page.page, step)?;
    if generation.0 != page.generation && verdict.is_continue() {
        return Err(ShimError::Generation {
            pool,
            page: page.page,
            shadow: generation.0,
            engine: page.generation,
        });
    }
    Ok(verdict)
}

/// A free.
pub(crate) fn free(
    call: &'static str,
    pool: u32,
    o: KvsanOwner,
    page: KvsanPageRef,
    step: u64,
) -> Result<Verdict, ShimError> {
    let o = owner(call, o)?;
    let san = san()?;
    let out = san
        .free(PoolId(pool), o, page.into(), step)
        .map_err(sanitizer_error(call))?;
    crate::nvtx::touched(san, pool, page.page);
    Ok(out)
}

/// A read-only share of `page` with `sharer` (prefix cache).
pub(crate) fn share(
    call: &'static str,
    pool: u32,
    page: KvsanPageRef,
    sharer: KvsanOwner,
) -> Result<Verdict, ShimError> {
    let sharer = owner(call, sharer)?;
    san()?
        .share(PoolId(pool), page.into(), sharer)
        .map_err(sanitizer_error(call))
}

/// `owner`'s cache salt, declared before it takes pages.
pub(crate) fn declare_salt(
    call: &'static str,
    owner_in: KvsanOwner,
    salt: u64,
) -> Result<Verdict, ShimError> {
    let who = owner(call, owner_in)?;
    san()?.declare_salt(who, salt);
    Ok(Verdict::Continue)
}

/// A write of `slots` × `layers`.
pub(crate) fn write(
    call: &'static str,
    pool: u32,
    o: KvsanOwner,
    page: KvsanPageRef,
    slots: KvsanRange,
    layers: KvsanRange,
    step: u64,
) -> Result<Verdict, ShimError> {
    let o = owner(call, o)?;
    san()?
        .write(
            PoolId(pool),
            o,
            page.into(),
            range(slots),
            range(layers),
            step,
        )
        .map_err(sanitizer_error(call))
}

fn tokens(call: &'static str, argument: &'static str, tokens: u64) -> Result<usize, ShimError> {
    usize::try_from(tokens).map_err(|_| ShimError::InvalidArgument {
        call,
        argument,
        value: tokens,
        allowed: "at most SIZE_MAX",
    })
}

/// A read of the first `n` tokens of `table[0..table_len]` for `layers`.
///
/// # Safety
/// - `table` as in [`page_refs`].
#[allow(clippy::too_many_arguments)]
pub(crate) unsafe fn read(
    call: &'static str,
    pool: u32,
    o: KvsanOwner,
    table: *const KvsanPageRef,
    table_len: usize,
    n: u64,
    layers: KvsanRange,
    step: u64,
) -> Result<Verdict, ShimError> {
    // SAFETY: the caller's contract on `table`.
    let table = unsafe { page_refs(call, "table", table, table_len) }?;
    let o = owner(call, o)?;
    let n = tokens(call, "tokens", n)?;
    san()?
        .read(PoolId(pool), o, table, n, range(layers), step)
        .map_err(sanitizer_error(call))
}

/// The sender ships the manifest at `m`.
///
/// # Safety
/// - `m` as in [`manifest`].
pub(crate) unsafe fn transfer_send(
    call: &'static str,
    pool: u32,
    m: *const KvsanManifest,
) -> Result<Verdict, ShimError> {
    // SAFETY: the caller's contract on `m`.
    let m = unsafe { manifest(call, m) }?;
    san()?
        .transfer_send(PoolId(pool), &m)
        .map_err(sanitizer_error(call))
}

/// A transfer of the manifest at `m` arrives: its destination pages are
/// reserved for it.
///
/// # Safety
/// - `m` as in [`manifest`].
pub(crate) unsafe fn transfer_recv(
    call: &'static str,
    pool: u32,
    m: *const KvsanManifest,
) -> Result<Verdict, ShimError> {
    // SAFETY: the caller's contract on `m`.
    let m = unsafe { manifest(call, m) }?;
    san()?
        .transfer_recv(PoolId(pool), &m)
        .map_err(sanitizer_error(call))
}

/// The landing at `l` (one destination page of a transfer), read and
/// checked.
///
/// # Safety
/// - `l` is null or readable for one `KvsanPageLanding`.
unsafe fn landing(
    call: &'static str,
    l: *const KvsanPageLanding,
) -> Result<PageLanding, ShimError> {
    if l.is_null() {
        return Err(ShimError::Null {
            call,
            argument: "landing",
        });
    }
    // SAFETY: non-null and readable by the caller's contract.
    let l = unsafe { l.read_unaligned() };
    owner(call, l.request)?;
    Ok(l.to_landing())
}

/// A copy is about to put received KV where the landing at `l` says.
///
/// # Safety
/// - `l` as in [`landing`].
pub(crate) unsafe fn transfer_land(
    call: &'static str,
    pool: u32,
    l: *const KvsanPageLanding,
) -> Result<Verdict, ShimError> {
    // SAFETY: the caller's contract on `l`.
    let l = unsafe { landing(call, l) }?;
    san()?
        .transfer_land(PoolId(pool), &l)
        .map_err(sanitizer_error(call))
}

/// The KV of the landing at `l` is in its page: compare the digests.
///
/// # Safety
/// - `l` as in [`landing`].
pub(crate) unsafe fn transfer_verify(
    call: &'static str,
    pool: u32,
    l: *const KvsanPageLanding,
) -> Result<Verdict, ShimError> {
    // SAFETY: the caller's contract on `l`.
    let l = unsafe { landing(call, l) }?;
    san()?
        .transfer_verify(PoolId(pool), &l)
        .map_err(sanitizer_error(call))
}

/// A store of `page` into tier block (`tier`, `block`) starts, for `o`.
pub(crate) fn tier_store(
    call: &'static str,
    pool: u32,
    o: KvsanOwner,
    page: KvsanPageRef,
    tier: u32,
    block: u64,
    step: u64,
) -> Result<Verdict, ShimError> {
    let o = owner(call, o)?;
    san()?
        .tier_store(
            PoolId(pool),
            o,
            page.into(),
            TierBlockId::new(tier, block),
            step,
        )
        .map_err(sanitizer_error(call))
}

/// The store into tier block (`tier`, `block`) completed (`stored` 1, with
/// the digest of what the tier holds) or failed (`stored` 0).
pub(crate) fn tier_store_done(
    call: &'static str,
    tier: u32,
    block: u64,
    digest: u64,
    stored: u32,
) -> Result<Verdict, ShimError> {
    if stored > 1 {
        return Err(ShimError::InvalidArgument {
            call,
            argument: "stored",
            value: stored.into(),
            allowed: "0 (the store failed) or 1 (it completed)",
        });
    }
    san()?
        .tier_store_done(TierBlockId::new(tier, block), digest, stored == 1)
        .map_err(sanitizer_error(call))
}

/// A load of tier block (`tier`, `block`) is about to copy it into `page`
/// for `o`.
pub(crate) fn tier_load(
    call: &'static str,
    pool: u32,
    o: KvsanOwner,
    page: KvsanPageRef,
    tier: u32,
    block: u64,
    step: u64,
) -> Result<Verdict, ShimError> {
    let o = owner(call, o)?;
    san()?
        .tier_load(
            PoolId(pool),
            o,
            page.into(),
            TierBlockId::new(tier, block),
            step,
        )
        .map_err(sanitizer_error(call))
}

/// What a load of tier block (`tier`, `block`) put in `page` has digest
/// `digest`.
pub(crate) fn tier_verify(
    call: &'static str,
    pool: u32,
    o: KvsanOwner,
    page: KvsanPageRef,
    tier: u32,
    block: u64,
    digest: u64,
) -> Result<Verdict, ShimError> {
    let o = owner(call, o)?;
    san()?
        .tier_verify(
            PoolId(pool),
            o,
            page.into(),
            TierBlockId::new(tier, block),
            digest,
        )
        .map_err(sanitizer_error(call))
}

/// The tier let go of block (`tier`, `block`).
pub(crate) fn tier_release(
    _call: &'static str,
    tier: u32,
    block: u64,
) -> Result<Verdict, ShimError> {
    Ok(san()?.tier_release(TierBlockId::new(tier, block)))
}

/// The receiver starts using the first `committed` tokens of
/// `table[0..table_len]`.
///
/// # Safety
/// - `table` as in [`page_refs`].
pub(crate) unsafe fn transfer_commit(
    call: &'static str,
    pool: u32,
    o: KvsanOwner,
    table: *const KvsanPageRef,
    table_len: usize,
    committed: u64,
) -> Result<Verdict, ShimError> {
    // SAFETY: the caller's contract on `table`.
    let table = unsafe { page_refs(call, "table", table, table_len) }?;
    let o = owner(call, o)?;
    let committed = tokens(call, "committed_tokens", committed)?;
    san()?
        .transfer_commit(PoolId(pool), o, table, committed)
        .map_err(sanitizer_error(call))
}

/// Describes pool `pool`'s kernel shadow (the sanitizer's memory, valid
/// for the rest of the process) into `out`.
///
/// # Safety
/// - `out` is null or writable for one `KvsanKernelShadow`.
pub(crate) unsafe fn kernel_shadow(
    call: &'static str,
    pool: u32,
    out: *mut KvsanKernelShadow,
) -> Result<Verdict, ShimError> {
    if out.is_null() {
        return Err(ShimError::Null {
            call,
            argument: "out",
        });
    }
    let raw = san()?
        .kernel_shadow(PoolId(pool))
        .map_err(sanitizer_error(call))?
        .to_raw();
    // SAFETY: non-null, writable for a whole description by the caller's
    // contract.
    unsafe { out.write_unaligned(raw) };
    Ok(Verdict::Continue)
}

/// The access at `a`, checked.
///
/// # Safety
/// - `a` is null or points to a readable `KvsanKernelAccess`.
unsafe fn kernel_access(
    call: &'static str,
    a: *const KvsanKernelAccess,
) -> Result<kvsan_sanitizer::KernelAccess, ShimError> {
    if a.is_null() {
        return Err(ShimError::Null {
            call,
            argument: "access",
        });
    }
    // SAFETY: non-null and readable by the caller's contract.
    let a = unsafe { a.read_unaligned() };
    if a.reserved != 0 {
        return Err(ShimError::InvalidArgument {
            call,
            argument: "access.reserved",
            value: a.reserved.into(),
            allowed: "0",
        });
    }
    a.to_access().ok_or(ShimError::InvalidArgument {
        call,
        argument: "access.op",
        value: a.op.into(),
        allowed: "0 read, 1 store, 2 poison",
    })
}

/// The cold path of the kernel access at `access`, which did not pass its
/// in-place check.
///
/// # Safety
/// - `access` as in [`kernel_access`].
pub(crate) unsafe fn kernel_refusal(
    call: &'static str,
    pool: u32,
    o: KvsanOwner,
    access: *const KvsanKernelAccess,
    step: u64,
) -> Result<Verdict, ShimError> {
    // SAFETY: the caller's contract on `access`.
    let access = unsafe { kernel_access(call, access) }?;
    let o = owner(call, o)?;
    san()?
        .kernel_refusal(PoolId(pool), o, &access, step)
        .map_err(sanitizer_error(call))
}
