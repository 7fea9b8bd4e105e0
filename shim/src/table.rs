//! The hook table a release engine looks up at start-up with
//! `dlsym(RTLD_DEFAULT, "kvsan_hook_table_v1")` (layout in
//! [`kvsan_sanitizer::abi`]). Every hook checks its arguments, calls the
//! process's sanitizer through [`crate::calls`] and returns its verdict;
//! a call it cannot check returns code 2 (error) and is recorded, a panic
//! inside is caught and is code 2 too. `ctx` is unused (the sanitizer is
//! the process's).

use std::ffi::c_void;
use std::ptr;
use std::sync::OnceLock;

use kvsan_sanitizer::Verdict;
use kvsan_sanitizer::abi::{
    HOOK_TABLE_VERSION_MAJOR, HOOK_TABLE_VERSION_MINOR, KVSAN_FLAG_POISON, KvsanHookTable,
    KvsanKernelAccess, KvsanKernelShadow, KvsanManifest, KvsanOwner, KvsanPageRef,
    KvsanPoolGeometry, KvsanRange, KvsanVerdict,
};

use crate::attach::{Attach, attach};
use crate::calls;
use crate::error::ShimError;
use crate::guard::{guarded, record};

/// The table, built once; its `ctx` is null, so sharing it is sound.
struct Table(KvsanHookTable);

// SAFETY: the table is immutable once built and its `ctx` is null; its
// function pointers are plain functions callable from any thread.
unsafe impl Sync for Table {}
// SAFETY: as for `Sync`.
unsafe impl Send for Table {}

static TABLE: OnceLock<Table> = OnceLock::new();

fn build(options: &kvsan_sanitizer::Options) -> Table {
    Table(KvsanHookTable {
        size: size_of::<KvsanHookTable>() as u32,
        version_major: HOOK_TABLE_VERSION_MAJOR,
        version_minor: HOOK_TABLE_VERSION_MINOR,
        flags: if options.poison { KVSAN_FLAG_POISON } else { 0 },
        quarantine_pages: options.quarantine_pages,
        ctx: ptr::null_mut(),
        pool_register: Some(pool_register),
        request_event: Some(request_event),
        alloc: Some(alloc),
        free: Some(free),
        write: Some(write),
        read: Some(read),
        transfer_send: Some(transfer_send),
        transfer_recv: Some(transfer_recv),
        transfer_commit: Some(transfer_commit),
        kernel_shadow: Some(kernel_shadow),
        kernel_refusal: Some(kernel_refusal),
        request_event_at: Some(request_event_at),
    })
}

/// The exported getter: the table, valid for the rest of the process, or
/// null when the library refused to attach at load (the engine then runs
/// without hooks and says so).
#[unsafe(no_mangle)]
pub extern "C" fn kvsan_hook_table_v1() -> *const KvsanHookTable {
    std::panic::catch_unwind(|| match attach() {
        Attach::Attached(options) => ptr::from_ref(&TABLE.get_or_init(|| build(options)).0),
        Attach::Refused(_) => ptr::null(),
    })
    .unwrap_or(ptr::null())
}

fn verdict(result: Result<Verdict, ShimError>) -> KvsanVerdict {
    match result {
        Ok(v) => v.into(),
        Err(e) => {
            record(&e);
            KvsanVerdict::ERROR
        }
    }
}

/// # Safety
/// `g` as in [`calls::geometry`]; `pool_out` null or writable.
unsafe extern "C" fn pool_register(
    _ctx: *mut c_void,
    g: *const KvsanPoolGeometry,
    pool_out: *mut u32,
) -> KvsanVerdict {
    const CALL: &str = "pool_register";
    verdict(guarded(CALL, || {
        if pool_out.is_null() {
            return Err(ShimError::Null {
                call: CALL,
                argument: "pool_out",
            });
        }
        // SAFETY: the engine passes a geometry borrowing its node name.
        let g = unsafe { calls::geometry(CALL, g) }?;
        let id = calls::pool_register(CALL, g)?;
        // SAFETY: non-null; the engine passes a writable u32.
        unsafe { pool_out.write_unaligned(id.0) };
        Ok(Verdict::Continue)
    }))
}

extern "C" fn request_event(_ctx: *mut c_void, owner: KvsanOwner, event: u32) -> KvsanVerdict {
    verdict(guarded("request_event", || {
        calls::request_event("request_event", owner, event)
    }))
}

extern "C" fn request_event_at(
    _ctx: *mut c_void,
    pool: u32,
    owner: KvsanOwner,
    event: u32,
) -> KvsanVerdict {
    verdict(guarded("request_event_at", || {
        calls::request_event_at("request_event_at", pool, owner, event)
    }))
}

extern "C" fn alloc(
    _ctx: *mut c_void,
    pool: u32,
    owner: KvsanOwner,
    page: KvsanPageRef,
    step: u64,
) -> KvsanVerdict {
    verdict(guarded("alloc", || {
        calls::alloc_expecting("alloc", pool, owner, page, step)
    }))
}

extern "C" fn free(
    _ctx: *mut c_void,
    pool: u32,
    owner: KvsanOwner,
    page: KvsanPageRef,
    step: u64,
) -> KvsanVerdict {
    verdict(guarded("free", || {
        calls::free("free", pool, owner, page, step)
    }))
}

extern "C" fn write(
    _ctx: *mut c_void,
    pool: u32,
    owner: KvsanOwner,
    page: KvsanPageRef,
    slots: KvsanRange,
    layers: KvsanRange,
    step: u64,
) -> KvsanVerdict {
    verdict(guarded("write", || {
        calls::write("write", pool, owner, page, slots, layers, step)
    }))
}

/// # Safety
/// `table` null or readable for `table_len` entries.
#[allow(clippy::too_many_arguments)]
unsafe extern "C" fn read(
    _ctx: *mut c_void,
    pool: u32,
    owner: KvsanOwner,
    table: *const KvsanPageRef,
    table_len: usize,
    tokens: u64,
    layers: KvsanRange,
    step: u64,
) -> KvsanVerdict {
    verdict(guarded("read", || {
        // SAFETY: the engine passes its block table, alive for the call.
        let table = unsafe { calls::page_refs("read", "table", table, table_len) }?;
        calls::read("read", pool, owner, table, tokens, layers, step)
    }))
}

/// # Safety
/// `m` as in [`calls::manifest`].
unsafe extern "C" fn transfer_send(
    _ctx: *mut c_void,
    pool: u32,
    m: *const KvsanManifest,
) -> KvsanVerdict {
    verdict(guarded("transfer_send", || {
        // SAFETY: the engine passes a manifest borrowing its block tables.
        let m = unsafe { calls::manifest("transfer_send", m) }?;
        calls::transfer_send("transfer_send", pool, &m)
    }))
}

/// # Safety
/// `m` as in [`calls::manifest`].
unsafe extern "C" fn transfer_recv(
    _ctx: *mut c_void,
    pool: u32,
    m: *const KvsanManifest,
) -> KvsanVerdict {
    verdict(guarded("transfer_recv", || {
        // SAFETY: as in `transfer_send`.
        let m = unsafe { calls::manifest("transfer_recv", m) }?;
        calls::transfer_recv("transfer_recv", pool, &m)
    }))
}

/// # Safety
/// `table` null or readable for `table_len` entries.
unsafe extern "C" fn transfer_commit(
    _ctx: *mut c_void,
    pool: u32,
    owner: KvsanOwner,
    table: *const KvsanPageRef,
    table_len: usize,
    committed_tokens: u64,
) -> KvsanVerdict {
    verdict(guarded("transfer_commit", || {
        // SAFETY: as in `read`.
        let table = unsafe { calls::page_refs("transfer_commit", "table", table, table_len) }?;
        calls::transfer_commit("transfer_commit", pool, owner, table, committed_tokens)
    }))
}

/// # Safety
/// `out` null or writable for one `KvsanKernelShadow`.
unsafe extern "C" fn kernel_shadow(
    _ctx: *mut c_void,
    pool: u32,
    out: *mut KvsanKernelShadow,
) -> KvsanVerdict {
    const CALL: &str = "kernel_shadow";
    verdict(guarded(CALL, || {
        if out.is_null() {
            return Err(ShimError::Null {
                call: CALL,
                argument: "out",
            });
        }
        let raw = calls::kernel_shadow(CALL, pool)?;
        // SAFETY: non-null; the engine passes a writable description.
        unsafe { out.write_unaligned(raw) };
        Ok(Verdict::Continue)
    }))
}

/// # Safety
/// `access` null or readable for one `KvsanKernelAccess`.
unsafe extern "C" fn kernel_refusal(
    _ctx: *mut c_void,
    pool: u32,
    owner: KvsanOwner,
    access: *const KvsanKernelAccess,
    step: u64,
) -> KvsanVerdict {
    const CALL: &str = "kernel_refusal";
    verdict(guarded(CALL, || {
        // SAFETY: the engine passes the access it refused, alive for the call.
        let access = unsafe { calls::kernel_access(CALL, access) }?;
        calls::kernel_refusal(CALL, pool, owner, &access, step)
    }))
}
