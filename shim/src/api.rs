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
    ABI_VERSION, AbiStatus, KVSAN_OK, KvsanHookTable, KvsanKernelAccess, KvsanKernelShadow,
    KvsanManifest, KvsanNvtxPlane, KvsanOwner, KvsanPageLanding, KvsanPageRef, KvsanPoolGeometry,
    KvsanRange, KvsanVerdict, STATUSES, version_compatible,
};
use kvsan_sanitizer::{Verdict, ViolationKind};

use crate::attach::{Attach, attach, sanitizer};
use crate::buffers::{CArray, CPointers};
use crate::calls;
use crate::error::ShimError;
use crate::guard::{guarded, record, refused_calls, with_last_error};
use crate::table::kvsan_hook_table_v1;
use kvsan_sanitizer::Batch;
use kvsan_sanitizer::layouts::{Addresses, DeviceArray};

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

/// A sized pointer argument: a struct the caller also passes the size of.
trait StructPointer {
    /// The struct.
    type Struct;
    fn is_null(&self) -> bool;
}

impl<T> StructPointer for *const T {
    type Struct = T;
    fn is_null(&self) -> bool {
        <*const T>::is_null(*self)
    }
}

impl<T> StructPointer for *mut T {
    type Struct = T;
    fn is_null(&self) -> bool {
        <*mut T>::is_null(*self)
    }
}

/// Refuses a null `pointer` (argument `argument`) and a `size` (argument
/// `size_argument`) other than this library's size of its struct.
fn sized<P: StructPointer>(
    call: &'static str,
    argument: &'static str,
    pointer: &P,
    size_argument: &'static str,
    size: usize,
) -> Result<(), ShimError> {
    if pointer.is_null() {
        return Err(null(call, argument));
    }
    let type_name = std::any::type_name::<P::Struct>();
    check_size(
        call,
        size_argument,
        type_name.rsplit("::").next().unwrap_or(type_name),
        size,
        size_of::<P::Struct>(),
    )
}

/// The `kvsan_*` functions of the list of hooks: each checks the struct
/// sizes it is given and runs `calls::<hook>`, guarded.
macro_rules! exports {
    ($(
        $(#[$doc:meta])*
        $name:ident($($arg:ident: $ty:ty $([$size:ident])?),*), $export:ident, $shape:ident;
    )*) => {
        $(export! { $shape $(#[$doc])* $name $export($($arg: $ty $([$size])?),*) })*
    };
}

/// One export, by its shape (`kvsan_sanitizer::hooks`).
macro_rules! export {
    (verdict $(#[$doc:meta])* $name:ident $export:ident($($arg:ident: $ty:ty $([$size:ident])?),*)) => {
        $(#[$doc])*
        ///
        /// Returns `KVSAN_OK` and writes the verdict to `verdict_out`, or a
        /// `KVSAN_ERR_*` code.
        ///
        /// # Safety
        /// - Every pointer argument is null or valid for the call as
        ///   `kvsan.h` says (a struct of the size its `*_size` argument gives,
        ///   a block table of `table_len` entries);
        /// - `verdict_out` is null or writable.
        #[unsafe(no_mangle)]
        #[allow(clippy::too_many_arguments, unused_unsafe)]
        pub unsafe extern "C" fn $export(
            $($arg: $ty, $($size: usize,)?)*
            verdict_out: *mut KvsanVerdict,
        ) -> AbiStatus {
            const CALL: &str = stringify!($export);
            let body = || {
                $($(sized(CALL, stringify!($arg), &$arg, stringify!($size), $size)?;)?)*
                // SAFETY: the caller's contract on the pointer arguments.
                unsafe { calls::$name(CALL, $($arg),*) }
            };
            // SAFETY: the caller's contract on `verdict_out`.
            unsafe { checked(CALL, verdict_out, body) }
        }
    };
    (status $(#[$doc:meta])* $name:ident $export:ident($($arg:ident: $ty:ty $([$size:ident])?),*)) => {
        $(#[$doc])*
        ///
        /// Returns `KVSAN_OK` once it wrote its answer, or a `KVSAN_ERR_*` code.
        ///
        /// # Safety
        /// - Every pointer argument is null or valid for the call as
        ///   `kvsan.h` says (a struct of the size its `*_size` argument gives).
        #[unsafe(no_mangle)]
        #[allow(clippy::too_many_arguments, unused_unsafe)]
        pub unsafe extern "C" fn $export($($arg: $ty, $($size: usize,)?)*) -> AbiStatus {
            const CALL: &str = stringify!($export);
            status(CALL, || {
                $($(sized(CALL, stringify!($arg), &$arg, stringify!($size), $size)?;)?)*
                // SAFETY: the caller's contract on the pointer arguments.
                unsafe { calls::$name(CALL, $($arg),*) }.map(drop)
            })
        }
    };
    (by_hand $(#[$doc:meta])* $name:ident $export:ident($($arg:ident: $ty:ty $([$size:ident])?),*)) => {
        // Another signature than the hook table's, written out in this file.
        const _: () = {
            let _ = $export;
        };
    };
}

kvsan_sanitizer::for_each_hook!(export => exports);

/// The engine took page `page` of `pool` from its free list for `owner`;
/// writes the page's new `KvsanPageRef` (its tag for the block table). The
/// list's `alloc`, with the page index in and the `PageRef` out, where the
/// hook table's engine passes the `PageRef` it counted itself.
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
        let (verdict, generation) = calls::alloc_page(CALL, pool, owner, page, step)?;
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

/// Writes the violations of kind `kind` (a `KvsanVerdict.kind` code)
/// counted so far.
///
/// # Safety
/// - `count_out` is null or writable.
#[unsafe(no_mangle)]
pub unsafe extern "C" fn kvsan_violation_count_of(kind: u32, count_out: *mut u64) -> AbiStatus {
    const CALL: &str = "kvsan_violation_count_of";
    status(CALL, || {
        if count_out.is_null() {
            return Err(null(CALL, "count_out"));
        }
        let kind = ViolationKind::from_code(kind).ok_or(ShimError::InvalidArgument {
            call: CALL,
            argument: "kind",
            value: u64::from(kind),
            allowed: "a violation kind's code (kvsan_violation_kind_name names them)",
        })?;
        let n = sanitizer()?.count(kind);
        // SAFETY: non-null, writable by the caller's contract.
        unsafe { count_out.write_unaligned(n) };
        Ok(())
    })
}

/// Writes the checks performed so far (pages read-checked, writes and
/// stores, transfers, allocations, frees).
///
/// # Safety
/// - `count_out` is null or writable.
#[unsafe(no_mangle)]
pub unsafe extern "C" fn kvsan_check_count(count_out: *mut u64) -> AbiStatus {
    const CALL: &str = "kvsan_check_count";
    status(CALL, || {
        if count_out.is_null() {
            return Err(null(CALL, "count_out"));
        }
        let n = sanitizer()?.checks().total();
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

/// Runs batch check `body` and writes its verdicts, one per row, to
/// `verdicts_out[0..rows]`.
///
/// # Safety
/// - `verdicts_out` is null or writable for `rows` `KvsanVerdict`s.
unsafe fn batch(
    call: &'static str,
    rows: usize,
    verdicts_out: *mut KvsanVerdict,
    body: impl FnOnce() -> Result<Vec<Verdict>, ShimError>,
) -> AbiStatus {
    status(call, || {
        if rows > 0 && verdicts_out.is_null() {
            return Err(null(call, "verdicts_out"));
        }
        let verdicts = body()?;
        for (i, v) in verdicts.into_iter().enumerate().take(rows) {
            // SAFETY: `i < rows`; writable by the caller's contract;
            // unaligned-safe.
            unsafe { verdicts_out.add(i).write_unaligned(v.into()) };
        }
        Ok(())
    })
}

/// The batch checks' C functions, two for each layout of
/// `kvsan_sanitizer::for_each_batch_layout!`: `kvsan_check_<layout>` over
/// host buffers and `kvsan_check_<layout>_device` over device buffers (see
/// `kvsan.h` for their contracts). Each takes `pool` (the device one then
/// `device`), `owners` and `rows`, the layout's arguments in list order (a
/// buffer whose length is its own is followed by that length), then
/// `layers`, `step` and `verdicts_out`, and writes one verdict per row.
macro_rules! batch_exports {
    ($(
        $(#[$doc:meta])*
        $variant:ident = $check:ident, $access:ident, export($host:ident, $device:ident) (
            $($(#[$fdoc:meta])* $field:ident: $spec:tt),* $(,)?
        );
    )*) => {
        $(
            batch_export! {
                [host $host $variant CPointers check_batch [] []
                    [
                        $(#[$doc])*
                        ///
                        /// # Safety
                        /// - `owners` and `verdicts_out` hold `rows` entries, and each
                        ///   buffer the values `kvsan.h` gives it (each may be null
                        ///   when its length is 0).
                    ]]
                rows [] [] $($field: $spec,)*
            }
            batch_export! {
                [device $device $variant Addresses check_device [device: i32,] [device,]
                    [
                        #[doc = concat!(
                            "[`", stringify!($host), "`] over device buffers on CUDA device ",
                            "`device`: each buffer is a device address, with its length in ",
                            "values as for the host check; see `kvsan.h`."
                        )]
                        ///
                        /// # Safety
                        /// - `owners` and `verdicts_out` hold `rows` entries (host
                        ///   memory);
                        /// - each buffer is a live device allocation on device
                        ///   `device` of the values `kvsan.h` gives it.
                    ]]
                rows [] [] $($field: $spec,)*
            }
        )*
    };
}

/// One C function of [`batch_exports!`]: its parameters and its `Batch`
/// gathered one layout argument at a time, then the function. `$how` is
/// `[host|device name Variant Buffers check [lead params] [lead args]
/// [docs]]`; `$rows` threads the one `rows` identifier through, so the
/// lengths can name it.
macro_rules! batch_export {
    // A buffer of one value per row, of offsets, of its own length; a
    // scalar.
    ($how:tt $rows:ident [$($p:tt)*] [$($f:tt)*] $field:ident: [$v:ident; rows], $($rest:tt)*) => {
        batch_export! { $how $rows
            [$($p)* $field: batch_export!(@type $how $v),]
            [$($f)* $field: batch_export!(@array $how $field, $rows),] $($rest)* }
    };
    ($how:tt $rows:ident [$($p:tt)*] [$($f:tt)*] $field:ident: [$v:ident; offsets], $($rest:tt)*) => {
        batch_export! { $how $rows
            [$($p)* $field: batch_export!(@type $how $v),]
            [$($f)* $field: batch_export!(@array $how $field, $rows.saturating_add(1)),]
            $($rest)* }
    };
    ($how:tt $rows:ident [$($p:tt)*] [$($f:tt)*] $field:ident: [$v:ident; $len:ident], $($rest:tt)*) => {
        batch_export! { $how $rows
            [$($p)* $field: batch_export!(@type $how $v), $len: usize,]
            [$($f)* $field: batch_export!(@array $how $field, $len),] $($rest)* }
    };
    ($how:tt $rows:ident [$($p:tt)*] [$($f:tt)*] $field:ident: usize, $($rest:tt)*) => {
        batch_export! { $how $rows [$($p)* $field: usize,] [$($f)* $field,] $($rest)* }
    };
    // A buffer's C type, and the buffer as its `Batch` holds it.
    (@type [host $($how:tt)*] $v:ident) => { *const $v };
    (@type [device $($how:tt)*] $v:ident) => { u64 };
    (@array [host $($how:tt)*] $field:ident, $len:expr) => { CArray { ptr: $field, len: $len } };
    (@array [device $($how:tt)*] $field:ident, $len:expr) => {
        DeviceArray { address: $field, len: $len }
    };
    // The function.
    (
        [$where:ident $name:ident $variant:ident $kind:ident $check:ident
            [$($lead:tt)*] [$($lead_arg:tt)*] [$($doc:tt)*]]
        $rows:ident [$($p:tt)*] [$($f:tt)*]
    ) => {
        $($doc)*
        #[unsafe(no_mangle)]
        #[allow(clippy::too_many_arguments)]
        pub unsafe extern "C" fn $name(
            pool: u32,
            $($lead)*
            owners: *const KvsanOwner,
            $rows: usize,
            $($p)*
            layers: KvsanRange,
            step: u64,
            verdicts_out: *mut KvsanVerdict,
        ) -> AbiStatus {
            const CALL: &str = stringify!($name);
            let arrays = calls::BatchArrays { owners, rows: $rows };
            let buffers = Batch::<$kind>::$variant { $($f)* };
            // SAFETY: the caller's contract on every pointer and address.
            unsafe {
                batch(CALL, $rows, verdicts_out, || {
                    calls::$check(CALL, pool, $($lead_arg)* arrays, &buffers, layers, step)
                })
            }
        }
    };
}

kvsan_sanitizer::for_each_batch_layout!(batch_exports);

/// Describes pool `pool`'s pages on CUDA device `device` to NVTX, for
/// compute-sanitizer; see `kvsan.h`.
///
/// # Safety
/// - `planes` is null or holds `n_planes` readable `KvsanNvtxPlane`s of
///   `plane_size` bytes each.
#[unsafe(no_mangle)]
pub unsafe extern "C" fn kvsan_nvtx_describe_pool(
    pool: u32,
    device: i32,
    planes: *const KvsanNvtxPlane,
    n_planes: usize,
    plane_size: usize,
) -> AbiStatus {
    const CALL: &str = "kvsan_nvtx_describe_pool";
    status(CALL, || {
        check_size(
            CALL,
            "plane_size",
            "KvsanNvtxPlane",
            plane_size,
            size_of::<KvsanNvtxPlane>(),
        )?;
        // SAFETY: the caller's contract on `planes`.
        let planes = unsafe { calls::slice(CALL, "planes", planes, n_planes) }?;
        crate::nvtx::describe(CALL, pool, device, planes)
    })
}

/// Binds the NVTX permissions of the requests' pages to this thread's CUDA
/// work; see `kvsan.h`.
///
/// # Safety
/// - `requests` is null or holds `n_requests` readable `u64`s.
#[unsafe(no_mangle)]
pub unsafe extern "C" fn kvsan_nvtx_bind(
    pool: u32,
    requests: *const u64,
    n_requests: usize,
) -> AbiStatus {
    const CALL: &str = "kvsan_nvtx_bind";
    status(CALL, || {
        // SAFETY: the caller's contract on `requests`.
        let requests = unsafe { calls::slice(CALL, "requests", requests, n_requests) }?;
        crate::nvtx::bind(CALL, pool, requests)
    })
}

/// Ends the pool's NVTX permissions binding on this thread.
#[unsafe(no_mangle)]
pub extern "C" fn kvsan_nvtx_unbind(pool: u32) -> AbiStatus {
    const CALL: &str = "kvsan_nvtx_unbind";
    status(CALL, || crate::nvtx::unbind(CALL, pool))
}

/// Ends the pool's NVTX description.
#[unsafe(no_mangle)]
pub extern "C" fn kvsan_nvtx_forget_pool(pool: u32) -> AbiStatus {
    const CALL: &str = "kvsan_nvtx_forget_pool";
    status(CALL, || crate::nvtx::forget(CALL, pool))
}

/// Each function of `kvsan_sanitizer::for_each_query!` is exported with the
/// listed signature: a function missing, renamed or with other types does
/// not compile.
macro_rules! listed_queries {
    ($($name:ident($($arg:ident: $ty:ty),* $(,)?) -> $ret:ty;)*) => {
        $(const _: unsafe extern "C" fn($($ty),*) -> $ret = $name;)*
    };
}

kvsan_sanitizer::for_each_query!(listed_queries);
