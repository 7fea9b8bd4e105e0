//! The plain C functions (`shim/include/kvsan.h`) for engines that annotate
//! their own KV pool — in C, C++, or Python through ctypes.
//!
//! Conventions, every function:
//!
//! - returns an `int32_t` status: `KVSAN_OK` (0) or a negative
//!   `KVSAN_ERR_*` code; a checked call returns `KVSAN_OK` and writes its
//!   verdict (`code` 0 continue, 1 abort the request) to `verdict_out`;
//! - validates every argument before acting: null or misaligned pointers,
//!   struct sizes other than this library's, event and role codes, a
//!   non-zero reserved field are refused and nothing changes;
//! - never unwinds into the caller (a panic is `KVSAN_ERR_INTERNAL`);
//! - on failure prints the error (the first 16 of a run) and keeps it as
//!   the calling thread's last error (`kvsan_last_error`).

use std::ffi::{CString, c_char};
use std::sync::OnceLock;

use kvsan_sanitizer::abi::{
    ABI_VERSION, AbiStatus, KVSAN_OK, KvsanKernelAccess, KvsanKernelShadow, KvsanManifest,
    KvsanOwner, KvsanPageRef, KvsanPoolGeometry, KvsanRange, KvsanVerdict, STATUSES,
    version_compatible,
};
use kvsan_sanitizer::{Verdict, ViolationKind};

use crate::attach::{Attach, attach, sanitizer};
use crate::calls;
use crate::error::ShimError;
use crate::guard::{guarded, record, refused_calls, with_last_error};

/// Runs `body` for `call` and writes its verdict to `verdict_out`.
///
/// # Safety
/// - `verdict_out` is null or writable for one `KvsanVerdict`.
unsafe fn checked(
    call: &'static str,
    verdict_out: *mut KvsanVerdict,
    body: impl FnOnce() -> Result<Verdict, ShimError>,
) -> AbiStatus {
    let result = guarded(call, || {
        if verdict_out.is_null() {
            return Err(ShimError::Null {
                call,
                argument: "verdict_out",
            });
        }
        body()
    });
    match result {
        Ok(v) => {
            // SAFETY: non-null (checked in the guarded body) and writable
            // by the caller's contract; unaligned-safe.
            unsafe { verdict_out.write_unaligned(v.into()) };
            KVSAN_OK
        }
        Err(e) => record(&e),
    }
}

/// Runs `body` for `call`, returning its status.
fn status(call: &'static str, body: impl FnOnce() -> Result<(), ShimError>) -> AbiStatus {
    match guarded(call, body) {
        Ok(()) => KVSAN_OK,
        Err(e) => record(&e),
    }
}

fn check_size(
    call: &'static str,
    argument: &'static str,
    type_name: &'static str,
    given: usize,
    expected: usize,
) -> Result<(), ShimError> {
    if given == expected {
        Ok(())
    } else {
        Err(ShimError::Size {
            call,
            argument,
            type_name,
            given,
            expected,
        })
    }
}

fn null(call: &'static str, argument: &'static str) -> ShimError {
    ShimError::Null { call, argument }
}

/// The library's ABI version, `major << 16 | minor`.
#[unsafe(no_mangle)]
pub extern "C" fn kvsan_abi_version() -> u32 {
    ABI_VERSION
}

/// `KVSAN_OK` if a caller built against `caller_version` (the header's
/// `KVSAN_ABI_VERSION`) can use this library, else `KVSAN_ERR_VERSION`.
#[unsafe(no_mangle)]
pub extern "C" fn kvsan_check_version(caller_version: u32) -> AbiStatus {
    status("kvsan_check_version", || {
        if version_compatible(caller_version) {
            Ok(())
        } else {
            Err(ShimError::Version {
                caller: caller_version,
                library: ABI_VERSION,
            })
        }
    })
}

/// 1 if the library attached at load (its options parsed), else 0.
#[unsafe(no_mangle)]
pub extern "C" fn kvsan_attached() -> i32 {
    std::panic::catch_unwind(|| i32::from(matches!(attach(), Attach::Attached(_)))).unwrap_or(0)
}

/// Registers a pool and writes its id.
///
/// # Safety
/// - `geometry` is null or points to a readable `KvsanPoolGeometry` of
///   `geometry_size` bytes whose `node`/`node_len` are readable;
/// - `pool_out` is null or writable.
#[unsafe(no_mangle)]
pub unsafe extern "C" fn kvsan_pool_register(
    geometry: *const KvsanPoolGeometry,
    geometry_size: usize,
    pool_out: *mut u32,
) -> AbiStatus {
    const CALL: &str = "kvsan_pool_register";
    status(CALL, || {
        if pool_out.is_null() {
            return Err(null(CALL, "pool_out"));
        }
        if geometry.is_null() {
            return Err(null(CALL, "geometry"));
        }
        check_size(
            CALL,
            "geometry_size",
            "KvsanPoolGeometry",
            geometry_size,
            size_of::<KvsanPoolGeometry>(),
        )?;
        // SAFETY: readable for its size (checked equal to ours) by the
        // caller's contract.
        let g = unsafe { calls::geometry(CALL, geometry) }?;
        let id = calls::pool_register(CALL, g)?;
        // SAFETY: non-null, writable by the caller's contract.
        unsafe { pool_out.write_unaligned(id.0) };
        Ok(())
    })
}

/// A request enters state `event` (0 queued, 1 admitted, 2 prefilling,
/// 3 transferring, 4 decoding, 5 finished, 6 rejected, 7 aborted).
///
/// # Safety
/// - `verdict_out` is null or writable.
#[unsafe(no_mangle)]
pub unsafe extern "C" fn kvsan_request_event(
    owner: KvsanOwner,
    event: u32,
    verdict_out: *mut KvsanVerdict,
) -> AbiStatus {
    const CALL: &str = "kvsan_request_event";
    // SAFETY: the caller's contract on `verdict_out`.
    unsafe {
        checked(CALL, verdict_out, || {
            calls::request_event(CALL, owner, event)
        })
    }
}

/// A request enters state `event` as the node that owns `pool` sees it: a
/// disaggregated engine reports each node's events this way, so a cancel
/// one node reports does not end the request for its peer before the peer
/// is told (it reports its own end then).
///
/// # Safety
/// - `verdict_out` is null or writable.
#[unsafe(no_mangle)]
pub unsafe extern "C" fn kvsan_request_event_at(
    pool: u32,
    owner: KvsanOwner,
    event: u32,
    verdict_out: *mut KvsanVerdict,
) -> AbiStatus {
    const CALL: &str = "kvsan_request_event_at";
    // SAFETY: the caller's contract on `verdict_out`.
    unsafe {
        checked(CALL, verdict_out, || {
            calls::request_event_at(CALL, pool, owner, event)
        })
    }
}

/// The engine took page `page` of `pool` from its free list for `owner`;
/// writes the page's new `KvsanPageRef` (its tag for the block table).
///
/// # Safety
/// - `page_out` and `verdict_out` are null or writable.
#[unsafe(no_mangle)]
pub unsafe extern "C" fn kvsan_alloc(
    pool: u32,
    owner: KvsanOwner,
    page: u32,
    step: u64,
    page_out: *mut KvsanPageRef,
    verdict_out: *mut KvsanVerdict,
) -> AbiStatus {
    const CALL: &str = "kvsan_alloc";
    let body = || {
        if page_out.is_null() {
            return Err(null(CALL, "page_out"));
        }
        let (verdict, generation) = calls::alloc(CALL, pool, owner, page, step)?;
        // SAFETY: non-null, writable by the caller's contract.
        unsafe {
            page_out.write_unaligned(KvsanPageRef {
                page,
                generation: generation.0,
            });
        };
        Ok(verdict)
    };
    // SAFETY: the caller's contract on `verdict_out`.
    unsafe { checked(CALL, verdict_out, body) }
}

/// `owner` returns `page` to `pool`.
///
/// # Safety
/// - `verdict_out` is null or writable.
#[unsafe(no_mangle)]
pub unsafe extern "C" fn kvsan_free(
    pool: u32,
    owner: KvsanOwner,
    page: KvsanPageRef,
    step: u64,
    verdict_out: *mut KvsanVerdict,
) -> AbiStatus {
    const CALL: &str = "kvsan_free";
    // SAFETY: the caller's contract on `verdict_out`.
    unsafe {
        checked(CALL, verdict_out, || {
            calls::free(CALL, pool, owner, page, step)
        })
    }
}

/// The prefix cache shares `page` read-only with `sharer`.
///
/// # Safety
/// - `verdict_out` is null or writable.
#[unsafe(no_mangle)]
pub unsafe extern "C" fn kvsan_share(
    pool: u32,
    page: KvsanPageRef,
    sharer: KvsanOwner,
    verdict_out: *mut KvsanVerdict,
) -> AbiStatus {
    const CALL: &str = "kvsan_share";
    // SAFETY: the caller's contract on `verdict_out`.
    unsafe { checked(CALL, verdict_out, || calls::share(CALL, pool, page, sharer)) }
}

/// `owner` computed KV into `slots` × `layers` of `page`.
///
/// # Safety
/// - `verdict_out` is null or writable.
#[unsafe(no_mangle)]
pub unsafe extern "C" fn kvsan_write(
    pool: u32,
    owner: KvsanOwner,
    page: KvsanPageRef,
    slots: KvsanRange,
    layers: KvsanRange,
    step: u64,
    verdict_out: *mut KvsanVerdict,
) -> AbiStatus {
    const CALL: &str = "kvsan_write";
    // SAFETY: the caller's contract on `verdict_out`.
    unsafe {
        checked(CALL, verdict_out, || {
            calls::write(CALL, pool, owner, page, slots, layers, step)
        })
    }
}

/// Attention of `owner` is about to read the first `tokens` positions of
/// the block table `table[0..table_len]` for `layers`.
///
/// # Safety
/// - `table` is null or readable for `table_len` entries;
/// - `verdict_out` is null or writable.
#[unsafe(no_mangle)]
#[allow(clippy::too_many_arguments)]
pub unsafe extern "C" fn kvsan_read(
    pool: u32,
    owner: KvsanOwner,
    table: *const KvsanPageRef,
    table_len: usize,
    tokens: u64,
    layers: KvsanRange,
    step: u64,
    verdict_out: *mut KvsanVerdict,
) -> AbiStatus {
    const CALL: &str = "kvsan_read";
    let body = || {
        // SAFETY: the caller's contract on `table`.
        let table = unsafe { calls::page_refs(CALL, "table", table, table_len) }?;
        calls::read(CALL, pool, owner, table, tokens, layers, step)
    };
    // SAFETY: the caller's contract on `verdict_out`.
    unsafe { checked(CALL, verdict_out, body) }
}

/// Describes pool `pool`'s kernel shadow into `out` (`out_size` must be
/// `sizeof(KvsanKernelShadow)`): the page records and written bits an
/// engine's kernels check each KV access against in place, and the two
/// check counters they bump. The memory is the library's, valid for the
/// rest of the process; records and bits are only read and updated with
/// atomic operations (`kvsan.h` documents the layout).
///
/// # Safety
/// - `out` is null or writable for `out_size` bytes.
#[unsafe(no_mangle)]
pub unsafe extern "C" fn kvsan_kernel_shadow(
    pool: u32,
    out: *mut KvsanKernelShadow,
    out_size: usize,
) -> AbiStatus {
    const CALL: &str = "kvsan_kernel_shadow";
    status(CALL, || {
        check_size(
            CALL,
            "out_size",
            "KvsanKernelShadow",
            out_size,
            size_of::<KvsanKernelShadow>(),
        )?;
        if out.is_null() {
            return Err(null(CALL, "out"));
        }
        let raw = calls::kernel_shadow(CALL, pool)?;
        // SAFETY: non-null, writable for a whole description by the
        // caller's contract (its size was checked).
        unsafe { out.write_unaligned(raw) };
        Ok(())
    })
}

/// The cold path of a kernel access that did not pass its in-place check
/// against the kernel shadow: `owner`'s batch row was about to make
/// `access` (`access_size` must be `sizeof(KvsanKernelAccess)`) at `step`.
/// The access is checked against the whole shadow (sharers included) and a
/// violation is reported; the verdict says whether the kernel may go on.
///
/// # Safety
/// - `access` is null or readable for `access_size` bytes;
/// - `verdict_out` is null or writable.
#[unsafe(no_mangle)]
pub unsafe extern "C" fn kvsan_kernel_refusal(
    pool: u32,
    owner: KvsanOwner,
    access: *const KvsanKernelAccess,
    access_size: usize,
    step: u64,
    verdict_out: *mut KvsanVerdict,
) -> AbiStatus {
    const CALL: &str = "kvsan_kernel_refusal";
    let body = || {
        check_size(
            CALL,
            "access_size",
            "KvsanKernelAccess",
            access_size,
            size_of::<KvsanKernelAccess>(),
        )?;
        // SAFETY: the caller's contract on `access`.
        let access = unsafe { calls::kernel_access(CALL, access) }?;
        calls::kernel_refusal(CALL, pool, owner, &access, step)
    };
    // SAFETY: the caller's contract on `verdict_out`.
    unsafe { checked(CALL, verdict_out, body) }
}

/// # Safety
/// - `manifest` is null or readable for `manifest_size` bytes, its tables
///   readable for their lengths;
/// - `verdict_out` is null or writable.
unsafe fn transfer(
    call: &'static str,
    manifest: *const KvsanManifest,
    manifest_size: usize,
    verdict_out: *mut KvsanVerdict,
    body: impl FnOnce(&kvsan_sanitizer::Manifest) -> Result<Verdict, ShimError>,
) -> AbiStatus {
    let checked_body = || {
        if manifest.is_null() {
            return Err(null(call, "manifest"));
        }
        check_size(
            call,
            "manifest_size",
            "KvsanManifest",
            manifest_size,
            size_of::<KvsanManifest>(),
        )?;
        // SAFETY: the caller's contract on `manifest` (its size checked
        // equal to ours).
        let m = unsafe { calls::manifest(call, manifest) }?;
        body(&m)
    };
    // SAFETY: the caller's contract on `verdict_out`.
    unsafe { checked(call, verdict_out, checked_body) }
}

/// The sender (pool `pool`) ships what `manifest` describes.
///
/// # Safety
/// - `manifest` is null or readable for `manifest_size` bytes, its tables
///   readable for their lengths;
/// - `verdict_out` is null or writable.
#[unsafe(no_mangle)]
pub unsafe extern "C" fn kvsan_transfer_send(
    pool: u32,
    manifest: *const KvsanManifest,
    manifest_size: usize,
    verdict_out: *mut KvsanVerdict,
) -> AbiStatus {
    const CALL: &str = "kvsan_transfer_send";
    // SAFETY: the caller's contract, passed on.
    unsafe {
        transfer(CALL, manifest, manifest_size, verdict_out, |m| {
            calls::transfer_send(CALL, pool, m)
        })
    }
}

/// The bytes `manifest` describes landed in the receiver's (`pool`) pages.
///
/// # Safety
/// As [`kvsan_transfer_send`].
#[unsafe(no_mangle)]
pub unsafe extern "C" fn kvsan_transfer_recv(
    pool: u32,
    manifest: *const KvsanManifest,
    manifest_size: usize,
    verdict_out: *mut KvsanVerdict,
) -> AbiStatus {
    const CALL: &str = "kvsan_transfer_recv";
    // SAFETY: the caller's contract, passed on.
    unsafe {
        transfer(CALL, manifest, manifest_size, verdict_out, |m| {
            calls::transfer_recv(CALL, pool, m)
        })
    }
}

/// The receiver starts using the first `committed_tokens` positions of
/// `table[0..table_len]`.
///
/// # Safety
/// - `table` is null or readable for `table_len` entries;
/// - `verdict_out` is null or writable.
#[unsafe(no_mangle)]
pub unsafe extern "C" fn kvsan_transfer_commit(
    pool: u32,
    owner: KvsanOwner,
    table: *const KvsanPageRef,
    table_len: usize,
    committed_tokens: u64,
    verdict_out: *mut KvsanVerdict,
) -> AbiStatus {
    const CALL: &str = "kvsan_transfer_commit";
    let body = || {
        // SAFETY: the caller's contract on `table`.
        let table = unsafe { calls::page_refs(CALL, "table", table, table_len) }?;
        calls::transfer_commit(CALL, pool, owner, table, committed_tokens)
    };
    // SAFETY: the caller's contract on `verdict_out`.
    unsafe { checked(CALL, verdict_out, body) }
}

/// Writes the violations counted so far.
///
/// # Safety
/// - `count_out` is null or writable.
#[unsafe(no_mangle)]
pub unsafe extern "C" fn kvsan_violation_count(count_out: *mut u64) -> AbiStatus {
    const CALL: &str = "kvsan_violation_count";
    status(CALL, || {
        if count_out.is_null() {
            return Err(null(CALL, "count_out"));
        }
        let n = sanitizer()?.violation_count();
        // SAFETY: non-null, writable by the caller's contract.
        unsafe { count_out.write_unaligned(n) };
        Ok(())
    })
}

/// Copies `text` into `buf[0..buf_len]`, truncated and NUL-terminated;
/// returns `text`'s full length.
///
/// # Safety
/// - `buf` is null or writable for `buf_len` bytes.
unsafe fn copy_out(text: &str, buf: *mut c_char, buf_len: usize) -> usize {
    if !buf.is_null() && buf_len > 0 {
        let n = text.len().min(buf_len - 1);
        // SAFETY: `buf` is writable for `buf_len` > `n` bytes by the
        // caller's contract; `text` is readable for `n` bytes; the two do
        // not overlap (`text` is this library's).
        unsafe {
            std::ptr::copy_nonoverlapping(text.as_ptr().cast::<c_char>(), buf, n);
            buf.add(n).write(0);
        }
    }
    text.len()
}

/// The summary line (`kvsan: N violations (kind: n, …)`) into
/// `buf[0..buf_len]` (truncated, NUL-terminated); its full length in
/// `*len_out` (a larger buffer is needed when it is `>= buf_len`).
///
/// # Safety
/// - `buf` is null or writable for `buf_len` bytes;
/// - `len_out` is null or writable.
#[unsafe(no_mangle)]
pub unsafe extern "C" fn kvsan_summary(
    buf: *mut c_char,
    buf_len: usize,
    len_out: *mut usize,
) -> AbiStatus {
    const CALL: &str = "kvsan_summary";
    status(CALL, || {
        if len_out.is_null() {
            return Err(null(CALL, "len_out"));
        }
        if buf.is_null() && buf_len > 0 {
            return Err(null(CALL, "buf"));
        }
        let summary = sanitizer()?.summary();
        // SAFETY: the caller's contract on `buf` and `len_out`.
        unsafe { len_out.write_unaligned(copy_out(&summary, buf, buf_len)) };
        Ok(())
    })
}

/// The message of the calling thread's last refused call into
/// `buf[0..buf_len]` (truncated, NUL-terminated); returns its full length,
/// 0 if no call of this thread was refused.
///
/// # Safety
/// - `buf` is null or writable for `buf_len` bytes.
#[unsafe(no_mangle)]
pub unsafe extern "C" fn kvsan_last_error(buf: *mut c_char, buf_len: usize) -> usize {
    std::panic::catch_unwind(|| {
        // SAFETY: the caller's contract on `buf`.
        with_last_error(|text| unsafe { copy_out(text, buf, buf_len) })
    })
    .unwrap_or(0)
}

/// Calls refused since load, all threads.
#[unsafe(no_mangle)]
pub extern "C" fn kvsan_refused_calls() -> u64 {
    refused_calls()
}

fn c_names(names: impl Iterator<Item = &'static str>) -> Vec<CString> {
    names.map(|n| CString::new(n).unwrap_or_default()).collect()
}

/// The stable name of the violation kind whose ABI code is `kind`
/// (`"stale-read"`), a static NUL-terminated string, or null for a code
/// this library does not define.
#[unsafe(no_mangle)]
pub extern "C" fn kvsan_violation_kind_name(kind: u32) -> *const c_char {
    static NAMES: OnceLock<Vec<CString>> = OnceLock::new();
    std::panic::catch_unwind(|| {
        let names = NAMES.get_or_init(|| c_names(ViolationKind::ALL.iter().map(|k| k.name())));
        ViolationKind::from_code(kind)
            .and_then(|k| names.get(k.index()))
            .map_or(std::ptr::null(), |n| n.as_ptr())
    })
    .unwrap_or(std::ptr::null())
}

/// The C name of status `status` (`"KVSAN_ERR_NULL"`), a static
/// NUL-terminated string, or null for a code this library does not define.
#[unsafe(no_mangle)]
pub extern "C" fn kvsan_status_name(status: AbiStatus) -> *const c_char {
    static NAMES: OnceLock<Vec<CString>> = OnceLock::new();
    std::panic::catch_unwind(|| {
        let names = NAMES.get_or_init(|| c_names(STATUSES.iter().map(|&(_, n)| n)));
        STATUSES
            .iter()
            .position(|&(code, _)| code == status)
            .map_or(std::ptr::null(), |i| names[i].as_ptr())
    })
    .unwrap_or(std::ptr::null())
}
