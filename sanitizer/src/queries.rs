//! The one list of the library's other C functions: versions and state,
//! counts and names, and the NVTX registration — what is neither a hook
//! ([`crate::hooks`]) nor a batch check ([`crate::layouts`]). Each is
//! written by hand in the shim; the list is how the compiler and the tests
//! hold the three together:
//!
//! - the shim checks each listed function has the listed Rust signature
//!   (`kvsan-shim`'s `api.rs`, a function-pointer constant per entry);
//! - `tests/shim_header_declares_the_listed_hooks.rs` checks `kvsan.h`
//!   declares each with the listed C types, and declares no `kvsan_*`
//!   function outside the three lists;
//! - `python/tests/test_abi_matches_the_header.py` checks the Python
//!   package's signatures against the header.
//!
//! A consumer is a `macro_rules!` macro `m` called as `for_each_query!(m)`;
//! it gets one `name(args) -> Return;` item a function, with `args` as
//! `arg: Type`. Type names resolve where the consumer expands: the C types
//! from [`crate::abi`], `c_char` from `std::ffi`.

/// Calls `m!` with every function of the list; see the [module
/// documentation](crate::queries).
#[macro_export]
macro_rules! for_each_query {
    ($m:ident) => {
        $m! {
            // Version and state.
            kvsan_abi_version() -> u32;
            kvsan_check_version(caller_version: u32) -> AbiStatus;
            kvsan_attached() -> i32;
            kvsan_hook_table_v1() -> *const KvsanHookTable;
            // Results and diagnostics.
            kvsan_violation_count(count_out: *mut u64) -> AbiStatus;
            kvsan_violation_count_of(kind: u32, count_out: *mut u64) -> AbiStatus;
            kvsan_check_count(count_out: *mut u64) -> AbiStatus;
            kvsan_summary(buf: *mut c_char, buf_len: usize, len_out: *mut usize) -> AbiStatus;
            kvsan_last_error(buf: *mut c_char, buf_len: usize) -> usize;
            kvsan_refused_calls() -> u64;
            kvsan_violation_kind_name(kind: u32) -> *const c_char;
            kvsan_status_name(status: AbiStatus) -> *const c_char;
            // NVTX registration for compute-sanitizer (since ABI 1.4).
            kvsan_nvtx_describe_pool(
                pool: u32,
                device: i32,
                planes: *const KvsanNvtxPlane,
                n_planes: usize,
                plane_size: usize
            ) -> AbiStatus;
            kvsan_nvtx_bind(pool: u32, requests: *const u64, n_requests: usize) -> AbiStatus;
            kvsan_nvtx_unbind(pool: u32) -> AbiStatus;
            kvsan_nvtx_forget_pool(pool: u32) -> AbiStatus;
        }
    };
}
