//! The hook table a release engine looks up at start-up with
//! `dlsym(RTLD_DEFAULT, "kvsan_hook_table_v1")` (layout in
//! [`kvsan_sanitizer::abi`]; its hooks are generated from the list,
//! `kvsan_sanitizer::for_each_hook!`). Every hook checks its arguments,
//! calls the process's sanitizer through `calls::<hook>` and returns its verdict;
//! a call it cannot check returns code 2 (error) and is recorded, a panic
//! inside is caught and is code 2 too. `ctx` is unused (the sanitizer is
//! the process's).

use std::ffi::c_void;
use std::ptr;
use std::sync::OnceLock;

use kvsan_sanitizer::Verdict;
use kvsan_sanitizer::abi::{
    HOOK_TABLE_VERSION_MAJOR, HOOK_TABLE_VERSION_MINOR, KVSAN_FLAG_POISON, KvsanHookTable,
    KvsanKernelAccess, KvsanKernelShadow, KvsanManifest, KvsanOwner, KvsanPageLanding,
    KvsanPageRef, KvsanPoolGeometry, KvsanRange, KvsanVerdict,
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

/// The table's hooks and the table, from the list of hooks: each hook runs
/// its `calls::<name>` on its arguments, guarded.
macro_rules! hook_table {
    ($(
        $(#[$doc:meta])*
        $variant:ident = $name:ident($($arg:ident: $ty:ty $([$size:ident])?),*), $minor:literal, $fn:ident;
    )*) => {
        /// The hooks the table points to.
        mod hooks {
            use super::*;

            $(
                $(#[$doc])*
                ///
                /// # Safety
                /// - Every pointer argument is null or valid for the call as
                ///   the hook table's contract says (`kvsan_sanitizer::abi`).
                #[allow(clippy::too_many_arguments, unused_unsafe)]
                pub(super) unsafe extern "C" fn $name(
                    _ctx: *mut c_void,
                    $($arg: $ty),*
                ) -> KvsanVerdict {
                    verdict(guarded(stringify!($name), || {
                        // SAFETY: the pointer arguments, as the engine passes
                        // them, meet the function's contract (above).
                        unsafe { calls::$name(stringify!($name), $($arg),*) }
                    }))
                }
            )*
        }

        fn build(options: &kvsan_sanitizer::Options) -> Table {
            Table(KvsanHookTable {
                size: size_of::<KvsanHookTable>() as u32,
                version_major: HOOK_TABLE_VERSION_MAJOR,
                version_minor: HOOK_TABLE_VERSION_MINOR,
                flags: if options.poison { KVSAN_FLAG_POISON } else { 0 },
                quarantine_pages: options.quarantine_pages,
                ctx: ptr::null_mut(),
                $($name: Some(hooks::$name),)*
            })
        }
    };
}

kvsan_sanitizer::for_each_hook!(table => hook_table);

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
