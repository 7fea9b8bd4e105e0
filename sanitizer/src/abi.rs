//! The C ABI of the sanitizer: the `#[repr(C)]` types, constants and
//! function types that a library (the LD_PRELOAD shim) and an engine share,
//! and their conversions to and from this crate's types.
//!
//! Two users speak it: an engine that looks up the hook table a preloaded
//! library exports (the NVTX injection pattern), and an engine written in C,
//! C++ or Python that calls the library's plain C functions. The C header
//! `shim/include/kvsan.h` declares the same layout; a test compiles it and
//! compares every size and offset with these types. The hook table's
//! function pointers are those of the list of hooks ([`crate::hooks`]), in
//! its order; each function type below is checked, at compile time, to
//! take the arguments the list gives its hooks.
//!
//! ```text
//!  const KvsanHookTable *kvsan_hook_table_v1(void);   // the exported getter
//!
//!  KvsanHookTable (192 bytes on LP64, #[repr(C)], version 1.6; a 1.5
//!  table ends after transfer_verify, 152 bytes; a 1.2 to
//!  1.4 table ends after declare_salt, 136 bytes (1.3 and 1.4 added C
//!  functions, not hooks); a 1.1 table after request_event_at, 120 bytes; a
//!  1.0 table before kernel_shadow, 96 bytes)
//!  offset size
//!  +----+----+---------------------------------------------------------------+
//!  |  0 |  4 | size            u32  sizeof the table as the library built it  |
//!  |  4 |  2 | version_major   u16  1; another major is not attached          |
//!  |  6 |  2 | version_minor   u16  6; a newer minor only appends fields      |
//!  |  8 |  4 | flags           u32  bit 0 KVSAN_FLAG_POISON: poison freed pages|
//!  | 12 |  4 | quarantine_pages u32 freed pages held back before reuse       |
//!  | 16 |  8 | ctx             void* passed as first argument to every hook  |
//!  | 24 |  8 | pool_register   (ctx, const KvsanPoolGeometry*, u32 *pool_out) |
//!  | 32 |  8 | request_event   (ctx, KvsanOwner, u32 event)                   |
//!  | 40 |  8 | alloc           (ctx, u32 pool, KvsanOwner, KvsanPageRef, u64 step)
//!  | 48 |  8 | free            (ctx, u32 pool, KvsanOwner, KvsanPageRef, u64 step)
//!  | 56 |  8 | write           (ctx, u32 pool, KvsanOwner, KvsanPageRef,      |
//!  |    |    |                  KvsanRange slots, KvsanRange layers, u64 step)|
//!  | 64 |  8 | read            (ctx, u32 pool, KvsanOwner, const KvsanPageRef*,|
//!  |    |    |                  size_t n, u64 tokens, KvsanRange layers, u64 step)
//!  | 72 |  8 | transfer_send   (ctx, u32 pool, const KvsanManifest*)          |
//!  | 80 |  8 | transfer_recv   (ctx, u32 pool, const KvsanManifest*)          |
//!  | 88 |  8 | transfer_commit (ctx, u32 pool, KvsanOwner, const KvsanPageRef*,|
//!  |    |    |                  size_t n, u64 committed_tokens)               |
//!  | 96 |  8 | kernel_shadow   (ctx, u32 pool, KvsanKernelShadow *out)   1.1  |
//!  |104 |  8 | kernel_refusal  (ctx, u32 pool, KvsanOwner,               1.1  |
//!  |    |    |                  const KvsanKernelAccess*, u64 step)           |
//!  |112 |  8 | request_event_at (ctx, u32 pool, KvsanOwner, u32 event)   1.1  |
//!  |120 |  8 | share           (ctx, u32 pool, KvsanPageRef, KvsanOwner) 1.2  |
//!  |128 |  8 | declare_salt    (ctx, KvsanOwner, u64 salt)               1.2  |
//!  |136 |  8 | transfer_land   (ctx, u32 pool, const KvsanPageLanding*)  1.5  |
//!  |144 |  8 | transfer_verify (ctx, u32 pool, const KvsanPageLanding*)  1.5  |
//!  |152 |  8 | tier_store      (ctx, u32 pool, KvsanOwner, KvsanPageRef,  1.6  |
//!  |    |    |                  u32 tier, u64 block, u64 step)                |
//!  |160 |  8 | tier_store_done (ctx, u32 tier, u64 block, u64 digest,    1.6  |
//!  |    |    |                  u32 stored)                                   |
//!  |168 |  8 | tier_load       (ctx, u32 pool, KvsanOwner, KvsanPageRef,  1.6  |
//!  |    |    |                  u32 tier, u64 block, u64 step)                |
//!  |176 |  8 | tier_verify     (ctx, u32 pool, KvsanOwner, KvsanPageRef,  1.6  |
//!  |    |    |                  u32 tier, u64 block, u64 digest)              |
//!  |184 |  8 | tier_release    (ctx, u32 tier, u64 block)                1.6  |
//!  +----+----+---------------------------------------------------------------+
//!  every hook returns KvsanVerdict by value:
//!  +----+----+---------------------------------------------------------------+
//!  |  0 |  4 | code         u32  0 continue, 1 abort the request, 2 error    |
//!  |  4 |  4 | kind         u32  the kind's ABI code (code 1; see below)     |
//!  |  8 |  8 | violation_id u64  the id the library's report names (code 1)  |
//!  +----+----+---------------------------------------------------------------+
//!
//!  KvsanOwner       { u64 request; u32 tenant; u32 reserved (0) }       16 bytes
//!  KvsanPageRef     { u32 page; u32 generation }                          8 bytes
//!  KvsanRange       { u32 start; u32 end }   (half-open)                  8 bytes
//!  KvsanPoolGeometry{ u32 pages, page_slots, layers, role (0 unified,
//!                     1 prefill, 2 decode; | 0x100 KVSAN_POOL_REPORTS_LANDING);
//!                     u64 bytes_per_slot;
//!                     const u8 *node; size_t node_len (UTF-8) }          40 bytes
//!  KvsanManifest    { KvsanOwner request; u32 src_pool, dst_pool;
//!                     const KvsanPageRef *src_pages; size_t src_len;
//!                     const KvsanPageRef *dst_pages; size_t dst_len;
//!                     u32 first_token, tokens; KvsanRange layers;
//!                     u64 checksum }                                     80 bytes
//!  KvsanPageLanding { KvsanOwner request; KvsanPageRef page;
//!                     u64 first_token; KvsanRange slots, layers;
//!                     u64 sent_digest, landed_digest }                   64 bytes
//!  KvsanKernelShadow{ u32 size, layout_version, pages, page_slots, layers,
//!                     record_size, stride_words, reserved;
//!                     const void *records; const u64 *bits;
//!                     u64 *counters }                                    56 bytes
//!  KvsanKernelAccess{ u32 op (0 read, 1 store, 2 poison), layer;
//!                     KvsanPageRef page; KvsanRange slots;
//!                     u32 entry, reserved }                              32 bytes
//!  request events:  0 queued 1 admitted 2 prefilling 3 transferring
//!                   4 decoding 5 finished 6 rejected 7 aborted
//! ```
//!
//! `share` gives a request (or the prefix cache itself, with the reserved
//! request id `KVSAN_PREFIX_CACHE_REQUEST`, [`RequestId::PREFIX_CACHE`]) a
//! read-only reference to a page, released with `free`; `declare_salt`
//! sets a request's cache salt before it takes pages. A 1.1 library has
//! neither: an engine then shares pages unchecked.
//!
//! `transfer_recv` reserves a transfer's destination pages; `transfer_land`
//! checks each copy of received KV into a page before it writes (only then
//! are its slots written) and `transfer_verify` compares the receiver's
//! digest of what a page holds with the sender's. An engine that calls
//! them sets `KVSAN_POOL_REPORTS_LANDING` in its pool's `role`; for a pool
//! without it (an engine built before 1.5) `transfer_recv` marks the
//! manifest's slots written, as before, and where the bytes land is not
//! checked.
//!
//! The tier hooks follow a page's KV out of its pool and back (see
//! `kvsan_sanitizer::tier`): `tier_store` when a store into a tier block
//! starts reading a page, `tier_store_done` when it completed or failed,
//! `tier_load` before a copy of the block into a page (only then are its
//! slots written), `tier_verify` with the digest of what landed, and
//! `tier_release` when the tier lets go of the block. A 1.5 library has
//! none: an engine's tiers then go unchecked.
//!
//! `request_event` moves the whole process's view of a request;
//! `request_event_at` moves the view of the node that owns `pool` only, so
//! a cancel decode reports does not end prefill's view before prefill is
//! told — the kvsan engine reports every event this way.
//!
//! `read` and `write` are the checks of an engine that calls them itself
//! (the plain C functions do the same). An engine that can let its kernels
//! check every access in place asks `kernel_shadow` for a pool's records and
//! bits once, checks each page its kernels touch against them, and calls
//! `kernel_refusal` (the cold path: report and verdict) for an access that
//! does not pass — the kvsan engine does so and calls neither `read` nor
//! `write`.
//!
//! The rules an engine applies to a table (validation, fail-closed verdicts)
//! are the engine's; the library's side is: `size` first and accurate, every
//! hook non-null, hooks callable from any thread for the rest of the process,
//! code 2 (error) for a call it could not check (an unknown pool, a page out
//! of range) — never undefined behaviour.
//!
//! The plain C functions of the library return an [`AbiStatus`] code
//! (`KVSAN_OK` or a negative `KVSAN_ERR_*`); [`status_of`] maps a
//! [`SanitizerError`] to its code.

use std::ffi::{CStr, c_void};
use std::ops::Range;

use crate::hooks::Hook;
use crate::kernel_shadow::{
    AccessOp, KERNEL_SHADOW_LAYOUT, KernelAccess, KernelCounters, KernelShadow,
};
use crate::shadow::{BitLayout, PageShadow};
use crate::sync::AtomicU64;
use crate::{
    Generation, Landing, Manifest, NodeRole, Owner, PageId, PageLanding, PageRef, PoolGeometry,
    PoolId, RequestEvent, RequestId, SanitizerError, TenantId, Verdict, ViolationKind,
};

/// The exported getter the engine looks up: `const KvsanHookTable *kvsan_hook_table_v1(void)`.
pub const HOOK_TABLE_SYMBOL: &CStr = c"kvsan_hook_table_v1";
/// The table's major version (another major is not compatible).
pub const HOOK_TABLE_VERSION_MAJOR: u16 = 1;
/// The table's minor version (a newer minor only appends fields), which
/// is also the C ABI's: 3 added the batch checks over device buffers and
/// `KVSAN_ERR_DEVICE`; 4 the NVTX registration of an engine's pool
/// (`kvsan_nvtx_*`, [`KvsanNvtxPlane`]), neither a table field; 5 the
/// landing hooks `transfer_land` and `transfer_verify`
/// ([`KvsanPageLanding`]) and [`KVSAN_POOL_REPORTS_LANDING`]; 6 the tier
/// hooks `tier_store`, `tier_store_done`, `tier_load`, `tier_verify` and
/// `tier_release`.
pub const HOOK_TABLE_VERSION_MINOR: u16 = 6;
/// Bit of [`KvsanPoolGeometry::role`]: the engine reports where received KV
/// lands (`transfer_land`, `transfer_verify`), so `transfer_recv` only
/// reserves the destination pages ([`crate::Landing::Reported`]). Without
/// it the pool is [`crate::Landing::Manifest`].
pub const KVSAN_POOL_REPORTS_LANDING: u32 = 0x100;
/// `flags` bit: poison-fill freed pages.
pub const KVSAN_FLAG_POISON: u32 = 1;
/// Verdict code: go on.
pub const KVSAN_VERDICT_CONTINUE: u32 = 0;
/// Verdict code: abort the request the call concerns.
pub const KVSAN_VERDICT_ABORT: u32 = 1;
/// Verdict code: the library could not check the call (misuse); go on.
pub const KVSAN_VERDICT_ERROR: u32 = 2;

/// A request and its tenant.
#[repr(C)]
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct KvsanOwner {
    /// The request id.
    pub request: u64,
    /// The tenant id.
    pub tenant: u32,
    /// Zero.
    pub reserved: u32,
}

/// A block-table entry: page and the generation it was handed out at.
#[repr(C)]
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct KvsanPageRef {
    /// Page index in its pool.
    pub page: u32,
    /// The page's generation when it was allocated.
    pub generation: u32,
}

/// A half-open range `start..end`.
#[repr(C)]
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct KvsanRange {
    /// First index.
    pub start: u32,
    /// One past the last index.
    pub end: u32,
}

/// Where one plane of a pool's pages lies in device memory, for the
/// pool's NVTX registration (`kvsan_nvtx_describe_pool`, since 1.4): page
/// `p` is `[base + p·page_stride, base + p·page_stride + page_bytes)`. A
/// page in several tensors (a K and a V tensor per layer) is several planes.
#[repr(C)]
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct KvsanNvtxPlane {
    /// Device address of page 0.
    pub base: u64,
    /// Bytes from one page to the next.
    pub page_stride: u64,
    /// Bytes of one page in this plane.
    pub page_bytes: u64,
}

/// A pool's shape ([`PoolGeometry`]).
#[repr(C)]
#[derive(Clone, Copy, Debug)]
pub struct KvsanPoolGeometry {
    /// Pages in the pool.
    pub pages: u32,
    /// Token slots per page.
    pub page_slots: u32,
    /// Layers.
    pub layers: u32,
    /// 0 unified, 1 prefill, 2 decode.
    pub role: u32,
    /// Bytes of KV per slot per layer.
    pub bytes_per_slot: u64,
    /// The node's name, UTF-8, not NUL-terminated.
    pub node: *const u8,
    /// Bytes of `node`.
    pub node_len: usize,
}

/// A KV transfer's claim ([`Manifest`]), arrays as pointer and length.
#[repr(C)]
#[derive(Clone, Copy, Debug)]
pub struct KvsanManifest {
    /// The request whose KV moves.
    pub request: KvsanOwner,
    /// The sender's pool.
    pub src_pool: u32,
    /// The receiver's pool.
    pub dst_pool: u32,
    /// The sender's block table, from token 0.
    pub src_pages: *const KvsanPageRef,
    /// Entries of `src_pages`.
    pub src_len: usize,
    /// The receiver's block table, from token 0.
    pub dst_pages: *const KvsanPageRef,
    /// Entries of `dst_pages`.
    pub dst_len: usize,
    /// First token carried.
    pub first_token: u32,
    /// Tokens carried.
    pub tokens: u32,
    /// Layers carried.
    pub layers: KvsanRange,
    /// The engine's checksum of the bytes.
    pub checksum: u64,
}

/// One destination page of a transfer ([`PageLanding`]).
#[repr(C)]
#[derive(Clone, Copy, Debug)]
pub struct KvsanPageLanding {
    /// The request whose KV lands.
    pub request: KvsanOwner,
    /// The page written, through the writer's tag.
    pub page: KvsanPageRef,
    /// The token position landing in `slots.start`.
    pub first_token: u64,
    /// The slots written.
    pub slots: KvsanRange,
    /// The layers written.
    pub layers: KvsanRange,
    /// The sender's digest of these tokens' KV (`transfer_verify`).
    pub sent_digest: u64,
    /// The receiver's digest of what the slots hold now (`transfer_verify`).
    pub landed_digest: u64,
}

impl KvsanPageLanding {
    /// The C view of `l`.
    #[must_use]
    pub fn borrow(l: &PageLanding) -> KvsanPageLanding {
        KvsanPageLanding {
            request: l.request.into(),
            page: l.page.into(),
            first_token: l.first_token,
            slots: l.slots.clone().into(),
            layers: l.layers.clone().into(),
            sent_digest: l.sent_digest,
            landed_digest: l.landed_digest,
        }
    }

    /// The Rust landing.
    #[must_use]
    pub fn to_landing(&self) -> PageLanding {
        PageLanding {
            request: self.request.into(),
            page: self.page.into(),
            first_token: self.first_token,
            slots: self.slots.into(),
            layers: self.layers.into(),
            sent_digest: self.sent_digest,
            landed_digest: self.landed_digest,
        }
    }
}

/// Where a pool's kernel shadow lives ([`crate::kernel_shadow`]): the
/// library's page records, written bits and kernel check counters, which an
/// engine's kernels read (and its store kernels update) in place.
#[repr(C)]
#[derive(Clone, Copy, Debug)]
pub struct KvsanKernelShadow {
    /// `size_of::<KvsanKernelShadow>()` as the library was built.
    pub size: u32,
    /// [`crate::kernel_shadow::KERNEL_SHADOW_LAYOUT`].
    pub layout_version: u32,
    /// Pages in the pool.
    pub pages: u32,
    /// Token slots per page.
    pub page_slots: u32,
    /// Layers.
    pub layers: u32,
    /// Bytes of one page record (32).
    pub record_size: u32,
    /// Bit words per page: `ceil(layers × page_slots / 64)`.
    pub stride_words: u32,
    /// Zero.
    pub reserved: u32,
    /// `pages` records of `record_size` bytes.
    pub records: *const c_void,
    /// `pages × stride_words` u64 words; bit `layer × page_slots + slot` of
    /// a page's words is set when the owner wrote that slot of that layer.
    pub bits: *const u64,
    /// Two u64 counters: pages read-checked, stores checked.
    pub counters: *mut u64,
}

impl<'a> KernelShadow<'a> {
    /// The C description of this view (the memory stays the sanitizer's).
    #[cfg(not(loom))]
    #[must_use]
    pub fn to_raw(&self) -> KvsanKernelShadow {
        KvsanKernelShadow {
            size: size_of::<KvsanKernelShadow>() as u32,
            layout_version: KERNEL_SHADOW_LAYOUT,
            pages: self.records.len() as u32,
            page_slots: self.layout.page_slots,
            layers: self.layout.layers,
            record_size: size_of::<PageShadow>() as u32,
            stride_words: self.layout.stride as u32,
            reserved: 0,
            records: self.records.as_ptr().cast(),
            bits: self.bits.as_ptr().cast(),
            counters: std::ptr::from_ref(self.counters).cast_mut().cast(),
        }
    }

    /// The view a [`KvsanKernelShadow`] describes, after checking that it
    /// describes this build's layout.
    ///
    /// # Errors
    /// What does not match (size, layout version, record size, words per
    /// page, a null pointer, zero pages).
    ///
    /// # Safety
    /// - `records`, `bits` and `counters` point to the records, bit words
    ///   and counters of a live sanitizer pool of the described geometry,
    ///   which stay allocated (and are only accessed atomically) for `'a`.
    #[cfg(not(loom))]
    pub unsafe fn from_raw(raw: &KvsanKernelShadow) -> Result<KernelShadow<'a>, &'static str> {
        if raw.size as usize != size_of::<KvsanKernelShadow>() {
            return Err("descriptor size differs from this build's");
        }
        if raw.layout_version != KERNEL_SHADOW_LAYOUT {
            return Err("kernel-shadow layout version differs from this build's");
        }
        if raw.record_size as usize != size_of::<PageShadow>() {
            return Err("page record size differs from this build's");
        }
        let layout = BitLayout::new(raw.page_slots, raw.layers);
        if raw.stride_words as usize != layout.stride || raw.page_slots == 0 || raw.layers == 0 {
            return Err("bit layout differs from the geometry");
        }
        if raw.pages == 0 || raw.records.is_null() || raw.bits.is_null() || raw.counters.is_null() {
            return Err("null pointer or no pages");
        }
        let pages = raw.pages as usize;
        // SAFETY: the caller guarantees the three pointers address the live
        // arrays of a pool of `pages` pages with this layout, for 'a; the
        // sizes and layout were checked above. Atomics have the layout of
        // their integers.
        unsafe {
            Ok(KernelShadow {
                records: std::slice::from_raw_parts(raw.records.cast::<PageShadow>(), pages),
                bits: std::slice::from_raw_parts(
                    raw.bits.cast::<AtomicU64>(),
                    pages * layout.stride,
                ),
                layout,
                counters: &*raw.counters.cast::<KernelCounters>(),
            })
        }
    }
}

/// A kernel access the fast path did not pass ([`crate::KernelAccess`]).
#[repr(C)]
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct KvsanKernelAccess {
    /// 0 read, 1 store, 2 poison reached attention output.
    pub op: u32,
    /// The layer.
    pub layer: u32,
    /// The `PageRef` the kernel used.
    pub page: KvsanPageRef,
    /// Read: `0..n`; store, poison: `s..s + 1`.
    pub slots: KvsanRange,
    /// Read, poison: the block-table entry; store: the token position.
    pub entry: u32,
    /// Zero.
    pub reserved: u32,
}

impl KvsanKernelAccess {
    /// The C view of `a`.
    #[must_use]
    pub fn borrow(a: &KernelAccess) -> KvsanKernelAccess {
        KvsanKernelAccess {
            op: a.op as u32,
            layer: a.layer,
            page: a.page.into(),
            slots: a.slots.clone().into(),
            entry: a.entry,
            reserved: 0,
        }
    }

    /// The Rust access; `None` for an unknown op code.
    #[must_use]
    pub fn to_access(&self) -> Option<KernelAccess> {
        Some(KernelAccess {
            op: AccessOp::from_code(self.op)?,
            page: self.page.into(),
            entry: self.entry,
            layer: self.layer,
            slots: self.slots.into(),
        })
    }
}

/// What every hook returns.
#[repr(C)]
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct KvsanVerdict {
    /// [`KVSAN_VERDICT_CONTINUE`], [`KVSAN_VERDICT_ABORT`] or [`KVSAN_VERDICT_ERROR`].
    pub code: u32,
    /// With code 1: the kind's ABI code ([`ViolationKind::code`], written
    /// beside each kind, never reused).
    pub kind: u32,
    /// With code 1: the violation's id.
    pub violation_id: u64,
}

// The C header's names for the hooks' function types (`KvsanPageFn` …);
// each is the list's type of the hooks named after it (checked below).

/// `pool_register`: code 0 and `*pool_out` set, or a refusal.
pub type PoolRegisterFn = fn_of::pool_register;
/// `request_event`.
pub type RequestEventFn = fn_of::request_event;
/// `alloc` and `free`.
pub type PageFn = fn_of::alloc;
/// `write`.
pub type WriteFn = fn_of::write;
/// `read`.
pub type ReadFn = fn_of::read;
/// `transfer_send` and `transfer_recv`.
pub type TransferFn = fn_of::transfer_send;
/// `transfer_commit`.
pub type CommitFn = fn_of::transfer_commit;
/// `kernel_shadow`: code 0 and `*out` filled, or a refusal (the pool is
/// unknown).
pub type KernelShadowFn = fn_of::kernel_shadow;
/// `kernel_refusal`.
pub type KernelRefusalFn = fn_of::kernel_refusal;
/// `request_event_at`: the event as the node that owns `pool` sees it.
pub type RequestEventAtFn = fn_of::request_event_at;
/// `share`: a read-only reference to a page for a request or the prefix
/// cache.
pub type ShareFn = fn_of::share;
/// `declare_salt`: a request's cache salt, before it takes pages.
pub type DeclareSaltFn = fn_of::declare_salt;
/// `transfer_land` and `transfer_verify`: one destination page of a
/// transfer.
pub type LandingFn = fn_of::transfer_land;
/// `tier_store` and `tier_load`: a page and a tier block.
pub type TierPageFn = fn_of::tier_store;
/// `tier_store_done`: a store completed or failed.
pub type TierStoreDoneFn = fn_of::tier_store_done;
/// `tier_verify`: the digest of what a load put in a page.
pub type TierVerifyFn = fn_of::tier_verify;
/// `tier_release`: the tier let go of a block.
pub type TierReleaseFn = fn_of::tier_release;

macro_rules! define_hook_table {
    ($(
        $(#[$doc:meta])*
        $variant:ident = $name:ident($($arg:ident: $ty:ty $([$size:ident])?),*), $minor:literal, $fn:ident;
    )*) => {
        /// The versioned hook table (layout in the module documentation): a
        /// header, then one function pointer a hook of the list
        /// ([`crate::for_each_hook!`]), in its order. A null function
        /// pointer makes the table invalid.
        #[repr(C)]
        #[derive(Clone, Copy, Debug)]
        pub struct KvsanHookTable {
            /// `size_of::<KvsanHookTable>()` as the library was built.
            pub size: u32,
            /// [`HOOK_TABLE_VERSION_MAJOR`].
            pub version_major: u16,
            /// The library's minor version.
            pub version_minor: u16,
            /// [`KVSAN_FLAG_POISON`] and future flags.
            pub flags: u32,
            /// Freed pages the engine holds back before reuse.
            pub quarantine_pages: u32,
            /// Passed to every hook.
            pub ctx: *mut c_void,
            $(
                #[doc = concat!("`", stringify!($name), "` (version 1.", $minor, ").")]
                #[doc = ""]
                $(#[$doc])*
                pub $name: Option<$fn>,
            )*
        }

        /// The function type of each hook of the table, by the hook's name:
        /// `ctx`, then the hook's arguments in the list, returning a verdict.
        #[allow(non_camel_case_types)]
        pub mod fn_of {
            use super::*;

            $(
                #[doc = concat!("`", stringify!($name), "`.")]
                pub type $name =
                    unsafe extern "C" fn(ctx: *mut c_void, $($arg: $ty),*) -> KvsanVerdict;
            )*
        }

        // The type the list names for each hook is that hook's.
        $(const _: Option<$fn> = None::<fn_of::$name>;)*

        impl KvsanHookTable {
            /// Whether the table's `hook` is set (`false` for a hook that is
            /// not in the table).
            #[must_use]
            #[allow(unreachable_patterns)]
            pub const fn is_set(&self, hook: Hook) -> bool {
                match hook {
                    $(Hook::$variant => self.$name.is_some(),)*
                    _ => false,
                }
            }

            /// Where `hook`'s function pointer is in the table; `None` for a
            /// hook that is not in the table.
            #[must_use]
            #[allow(unreachable_patterns)]
            pub const fn offset_of(hook: Hook) -> Option<usize> {
                match hook {
                    $(Hook::$variant => Some(std::mem::offset_of!(KvsanHookTable, $name)),)*
                    _ => None,
                }
            }
        }
    };
}

crate::for_each_hook!(table => define_hook_table);

/// Bytes of a version `1.minor` table: the header and the hooks of minor
/// versions up to `minor` (a newer minor only appends).
#[must_use]
pub const fn hook_table_size(minor: u16) -> usize {
    let mut end = std::mem::offset_of!(KvsanHookTable, ctx) + size_of::<*mut c_void>();
    let mut i = 0;
    while i < Hook::ALL.len() {
        let hook = Hook::ALL[i];
        if let (Some(since), Some(offset)) = (hook.table_minor(), KvsanHookTable::offset_of(hook))
            && since <= minor
            && offset + HOOK_SIZE > end
        {
            end = offset + HOOK_SIZE;
        }
        i += 1;
    }
    end
}

/// Bytes of one hook's function pointer.
const HOOK_SIZE: usize = size_of::<Option<PageFn>>();

/// Size of a version 1.0 table (without the kernel hooks).
pub const HOOK_TABLE_V1_0_SIZE: usize = hook_table_size(0);
/// Size of a version 1.1 table (without the share hooks).
pub const HOOK_TABLE_V1_1_SIZE: usize = hook_table_size(1);

// The list keeps the table append-only: in table order no hook is of an
// older minor version than the one before it, and this build's table is
// exactly its version's size.
const _: () = {
    let mut i = 0;
    let mut last = (0, 0);
    while i < Hook::ALL.len() {
        let hook = Hook::ALL[i];
        if let (Some(since), Some(offset)) = (hook.table_minor(), KvsanHookTable::offset_of(hook)) {
            assert!(
                since >= last.0 && offset >= last.1,
                "a newer minor only appends"
            );
            assert!(since <= HOOK_TABLE_VERSION_MINOR);
            last = (since, offset);
        }
        i += 1;
    }
    assert!(hook_table_size(HOOK_TABLE_VERSION_MINOR) == size_of::<KvsanHookTable>());
};

/// The getter's type.
pub type HookTableGetter = unsafe extern "C" fn() -> *const KvsanHookTable;

// The engine hands `&[PageRef]` to C as `const KvsanPageRef *` without
// copying: the two must have one layout.
const _: () = {
    assert!(size_of::<PageRef>() == size_of::<KvsanPageRef>());
    assert!(align_of::<PageRef>() == align_of::<KvsanPageRef>());
    assert!(std::mem::offset_of!(PageRef, page) == std::mem::offset_of!(KvsanPageRef, page));
    assert!(
        std::mem::offset_of!(PageRef, generation) == std::mem::offset_of!(KvsanPageRef, generation)
    );
};

impl From<Owner> for KvsanOwner {
    fn from(o: Owner) -> Self {
        KvsanOwner {
            request: o.request.0,
            tenant: o.tenant.0,
            reserved: 0,
        }
    }
}

impl From<KvsanOwner> for Owner {
    fn from(o: KvsanOwner) -> Self {
        Owner {
            request: RequestId(o.request),
            tenant: TenantId(o.tenant),
        }
    }
}

impl From<PageRef> for KvsanPageRef {
    fn from(p: PageRef) -> Self {
        KvsanPageRef {
            page: p.page.0,
            generation: p.generation.0,
        }
    }
}

impl From<KvsanPageRef> for PageRef {
    fn from(p: KvsanPageRef) -> Self {
        PageRef {
            page: PageId(p.page),
            generation: Generation(p.generation),
        }
    }
}

impl From<Range<u32>> for KvsanRange {
    fn from(r: Range<u32>) -> Self {
        KvsanRange {
            start: r.start,
            end: r.end,
        }
    }
}

impl From<KvsanRange> for Range<u32> {
    fn from(r: KvsanRange) -> Self {
        r.start..r.end
    }
}

impl From<Verdict> for KvsanVerdict {
    fn from(v: Verdict) -> Self {
        match v {
            Verdict::Continue => KvsanVerdict::CONTINUE,
            Verdict::Abort { violation, kind } => KvsanVerdict {
                code: KVSAN_VERDICT_ABORT,
                kind: kind.code(),
                violation_id: violation.0,
            },
        }
    }
}

impl KvsanVerdict {
    /// Go on.
    pub const CONTINUE: KvsanVerdict = KvsanVerdict {
        code: KVSAN_VERDICT_CONTINUE,
        kind: 0,
        violation_id: 0,
    };
    /// The call could not be checked.
    pub const ERROR: KvsanVerdict = KvsanVerdict {
        code: KVSAN_VERDICT_ERROR,
        kind: 0,
        violation_id: 0,
    };
}

/// The C code of a node role (0 unified, 1 prefill, 2 decode).
#[must_use]
pub const fn role_code(role: NodeRole) -> u32 {
    match role {
        NodeRole::Unified => 0,
        NodeRole::Prefill => 1,
        NodeRole::Decode => 2,
    }
}

/// The node role of a C code.
#[must_use]
pub const fn role_from_code(code: u32) -> Option<NodeRole> {
    match code {
        0 => Some(NodeRole::Unified),
        1 => Some(NodeRole::Prefill),
        2 => Some(NodeRole::Decode),
        _ => None,
    }
}

/// The request events in C code order (the code is the index).
pub const REQUEST_EVENTS: [RequestEvent; 8] = [
    RequestEvent::Queued,
    RequestEvent::Admitted,
    RequestEvent::Prefilling,
    RequestEvent::Transferring,
    RequestEvent::Decoding,
    RequestEvent::Finished,
    RequestEvent::Rejected,
    RequestEvent::Aborted,
];

/// The C code of a request event.
#[must_use]
pub const fn event_code(event: RequestEvent) -> u32 {
    match event {
        RequestEvent::Queued => 0,
        RequestEvent::Admitted => 1,
        RequestEvent::Prefilling => 2,
        RequestEvent::Transferring => 3,
        RequestEvent::Decoding => 4,
        RequestEvent::Finished => 5,
        RequestEvent::Rejected => 6,
        RequestEvent::Aborted => 7,
    }
}

/// The request event of a C code.
#[must_use]
pub fn event_from_code(code: u32) -> Option<RequestEvent> {
    REQUEST_EVENTS.get(code as usize).copied()
}

impl KvsanPoolGeometry {
    /// The C view of `g`, borrowing its node name, for an engine that
    /// reports its landings as `landing` says.
    #[must_use]
    pub fn borrow(g: &PoolGeometry, landing: Landing) -> KvsanPoolGeometry {
        let reports = match landing {
            Landing::Reported => KVSAN_POOL_REPORTS_LANDING,
            Landing::Manifest => 0,
        };
        KvsanPoolGeometry {
            pages: g.pages,
            page_slots: g.page_slots,
            layers: g.layers,
            role: role_code(g.role) | reports,
            bytes_per_slot: g.bytes_per_slot,
            node: g.node.as_ptr(),
            node_len: g.node.len(),
        }
    }

    /// How the engine reports landings: [`KVSAN_POOL_REPORTS_LANDING`] in
    /// `role` or not.
    #[must_use]
    pub fn landing(&self) -> Landing {
        if self.role & KVSAN_POOL_REPORTS_LANDING == 0 {
            Landing::Manifest
        } else {
            Landing::Reported
        }
    }

    /// The Rust geometry (without the landing bit of `role`); `None` for an
    /// unknown role or a name that is not UTF-8.
    ///
    /// # Safety
    /// - `node` is null with `node_len` 0, or points to `node_len` readable bytes.
    #[must_use]
    pub unsafe fn to_geometry(&self) -> Option<PoolGeometry> {
        // SAFETY: the caller guarantees `node`/`node_len` describe readable
        // bytes (or an empty name).
        let node = unsafe { slice_or_empty(self.node, self.node_len) }?;
        Some(PoolGeometry {
            pages: self.pages,
            page_slots: self.page_slots,
            layers: self.layers,
            bytes_per_slot: self.bytes_per_slot,
            role: role_from_code(self.role & !KVSAN_POOL_REPORTS_LANDING)?,
            node: std::str::from_utf8(node).ok()?.to_string(),
        })
    }
}

/// `ptr[..len]`, or `None` for a null pointer with a non-zero length.
///
/// # Safety
/// - `ptr` is null, or points to `len` readable, initialised `T`s that stay
///   unchanged for the returned lifetime.
pub unsafe fn slice_or_empty<'a, T>(ptr: *const T, len: usize) -> Option<&'a [T]> {
    if len == 0 {
        return Some(&[]);
    }
    if ptr.is_null() {
        return None;
    }
    // SAFETY: non-null with `len` readable elements, by the caller's contract.
    Some(unsafe { std::slice::from_raw_parts(ptr, len) })
}

impl KvsanManifest {
    /// The C view of `m`, borrowing its block tables.
    #[must_use]
    pub fn borrow(m: &Manifest) -> KvsanManifest {
        KvsanManifest {
            request: m.request.into(),
            src_pool: m.src_pool.0,
            dst_pool: m.dst_pool.0,
            src_pages: m.src_pages.as_ptr().cast(),
            src_len: m.src_pages.len(),
            dst_pages: m.dst_pages.as_ptr().cast(),
            dst_len: m.dst_pages.len(),
            first_token: m.first_token,
            tokens: m.tokens,
            layers: m.layers.clone().into(),
            checksum: m.checksum,
        }
    }

    /// The Rust manifest; `None` if a table pointer is null with a non-zero
    /// length.
    ///
    /// # Safety
    /// - `src_pages`/`src_len` and `dst_pages`/`dst_len` each describe
    ///   readable `KvsanPageRef`s (or a length of 0).
    #[must_use]
    pub unsafe fn to_manifest(&self) -> Option<Manifest> {
        // SAFETY: the caller guarantees both pointer/length pairs.
        let (src, dst) = unsafe {
            (
                slice_or_empty(self.src_pages, self.src_len)?,
                slice_or_empty(self.dst_pages, self.dst_len)?,
            )
        };
        Some(Manifest {
            request: self.request.into(),
            src_pool: PoolId(self.src_pool),
            src_pages: src.iter().map(|&p| p.into()).collect(),
            dst_pool: PoolId(self.dst_pool),
            dst_pages: dst.iter().map(|&p| p.into()).collect(),
            first_token: self.first_token,
            tokens: self.tokens,
            layers: self.layers.into(),
            checksum: self.checksum,
        })
    }
}

/// The status a plain C function of the library returns: [`KVSAN_OK`] (0)
/// or a negative `KVSAN_ERR_*` code. A verdict (continue / abort) is not a
/// status: a checked call returns `KVSAN_OK` and writes its verdict.
pub type AbiStatus = i32;

macro_rules! abi_statuses {
    ($($name:ident = $value:literal, $text:literal;)*) => {
        $(
            #[doc = concat!($text, ".")]
            pub const $name: AbiStatus = $value;
        )*

        /// Every status code with its C name, in code order (0, -1, -2, …).
        pub const STATUSES: &[(AbiStatus, &str)] = &[$(($value, stringify!($name))),*];

        /// What a status code means, or `None` for a code this library does
        /// not define.
        #[must_use]
        pub const fn status_text(status: AbiStatus) -> Option<&'static str> {
            match status {
                $($value => Some($text),)*
                _ => None,
            }
        }
    };
}

abi_statuses! {
    KVSAN_OK = 0, "the call was carried out";
    KVSAN_ERR_NULL = -1, "a required pointer argument is null";
    KVSAN_ERR_SIZE = -2, "a struct size argument is not the size this library knows";
    KVSAN_ERR_VERSION = -3, "the caller's ABI version is not one this library speaks";
    KVSAN_ERR_NOT_ATTACHED = -4, "the library refused to attach (bad KVSAN_OPTIONS or log file); nothing is checked";
    KVSAN_ERR_UNKNOWN_POOL = -5, "the pool id was never returned by pool registration";
    KVSAN_ERR_OUT_OF_RANGE = -6, "a page, slot, layer or token range is outside the pool or block table";
    KVSAN_ERR_INVALID_ARGUMENT = -7, "an argument has a value the ABI does not define (event or role code, reserved field, non-UTF-8 name)";
    KVSAN_ERR_BAD_GEOMETRY = -8, "the pool geometry cannot be shadowed";
    KVSAN_ERR_TOO_MANY_POOLS = -9, "the pool limit is reached";
    KVSAN_ERR_GENERATION = -10, "the caller's page generation differs from the shadow's (the two count allocations differently)";
    KVSAN_ERR_INTERNAL = -11, "the library failed inside (a caught panic or an error it has no code for); it wrote a report";
    KVSAN_ERR_DEVICE = -12, "a check over device buffers could not run (no CUDA driver, NVRTC or such device, a CUDA failure, or a library built without CUDA)";
}

/// The status code of a sanitizer error.
#[must_use]
pub const fn status_of(error: &SanitizerError) -> AbiStatus {
    match error {
        SanitizerError::UnknownPool { .. } => KVSAN_ERR_UNKNOWN_POOL,
        SanitizerError::TooManyPools { .. } => KVSAN_ERR_TOO_MANY_POOLS,
        SanitizerError::PageOutOfRange { .. }
        | SanitizerError::SlotOutOfRange { .. }
        | SanitizerError::LayerOutOfRange { .. }
        | SanitizerError::TokensBeyondTable { .. }
        | SanitizerError::BadBatch { .. } => KVSAN_ERR_OUT_OF_RANGE,
        SanitizerError::BadGeometry { .. } | SanitizerError::TierGeometry { .. } => {
            KVSAN_ERR_BAD_GEOMETRY
        }
        SanitizerError::ReservedRequest { .. } | SanitizerError::TierBlockNotStoring { .. } => {
            KVSAN_ERR_INVALID_ARGUMENT
        }
        SanitizerError::UnknownOption { .. }
        | SanitizerError::BadOptionValue { .. }
        | SanitizerError::MalformedOption { .. }
        | SanitizerError::LogFile { .. }
        | SanitizerError::SelfTest { .. } => KVSAN_ERR_NOT_ATTACHED,
    }
}

/// The library's ABI version as one number: `major << 16 | minor`.
pub const ABI_VERSION: u32 =
    ((HOOK_TABLE_VERSION_MAJOR as u32) << 16) | HOOK_TABLE_VERSION_MINOR as u32;

/// Whether a caller built against ABI version `caller` (`major << 16 |
/// minor`) can use this library: the same major, and a minor no newer than
/// this library's (a newer caller may use functions this library lacks).
#[must_use]
pub const fn version_compatible(caller: u32) -> bool {
    caller >> 16 == HOOK_TABLE_VERSION_MAJOR as u32
        && (caller & 0xffff) <= HOOK_TABLE_VERSION_MINOR as u32
}

/// The violation kind a verdict's `kind` code names, or `None` for a code
/// this build does not know (a newer library's).
#[must_use]
pub const fn kind_of_code(code: u32) -> Option<ViolationKind> {
    ViolationKind::from_code(code)
}

#[cfg(not(loom))]
pub use handle::KernelShadowHandle;

#[cfg(not(loom))]
mod handle {
    use std::any::Any;
    use std::sync::Arc;

    use super::KvsanKernelShadow;
    use crate::kernel_shadow::KernelShadow;

    /// The kernel shadow of one pool as a hook target hands it to an engine:
    /// its C description ([`KvsanKernelShadow`]), checked once, kept alive with
    /// what owns the memory.
    ///
    /// It describes memory a sanitizer owns (records, written bits, counters):
    /// the sanitizer keeps it for its whole life, and `keep` holds that
    /// sanitizer (or nothing, for a preloaded library whose sanitizer lives as
    /// long as the process).
    pub struct KernelShadowHandle {
        raw: KvsanKernelShadow,
        _keep: Option<Arc<dyn Any + Send + Sync>>,
    }

    // SAFETY: the raw pointers address atomics (records, bits, counters) that
    // any thread may access; `keep` is Send + Sync.
    unsafe impl Send for KernelShadowHandle {}
    // SAFETY: as for `Send`: shared access is only atomic loads and RMWs.
    unsafe impl Sync for KernelShadowHandle {}

    impl std::fmt::Debug for KernelShadowHandle {
        fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
            f.debug_struct("KernelShadowHandle")
                .field("pages", &self.raw.pages)
                .field("page_slots", &self.raw.page_slots)
                .field("layers", &self.raw.layers)
                .finish_non_exhaustive()
        }
    }

    impl KernelShadowHandle {
        /// A handle for `raw`, after checking that it describes this build's
        /// layout.
        ///
        /// # Errors
        /// What in `raw` does not match this build's layout.
        ///
        /// # Safety
        /// - `raw` describes a live pool's kernel shadow whose memory stays
        ///   allocated while `keep` is held (or for the rest of the process).
        pub unsafe fn new(
            raw: KvsanKernelShadow,
            keep: Option<Arc<dyn Any + Send + Sync>>,
        ) -> Result<KernelShadowHandle, &'static str> {
            // SAFETY: the caller's contract; checked here once.
            unsafe { KernelShadow::from_raw(&raw) }?;
            Ok(KernelShadowHandle { raw, _keep: keep })
        }

        /// The kernels' view.
        #[must_use]
        pub fn view(&self) -> KernelShadow<'_> {
            // SAFETY: `new` checked the description; the memory lives while
            // `self` (and so `keep`) does.
            unsafe { KernelShadow::from_raw(&self.raw) }
                .expect("a checked kernel-shadow description stays valid")
        }

        /// Pages, slots per page and layers the shadow covers.
        #[must_use]
        pub fn geometry(&self) -> (u32, u32, u32) {
            (self.raw.pages, self.raw.page_slots, self.raw.layers)
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn status_codes_are_dense_negative_and_named_kvsan_err() {
        for (i, &(code, name)) in STATUSES.iter().enumerate() {
            assert_eq!(code, -(i as i32), "{name}");
            assert!(
                name == "KVSAN_OK" || name.starts_with("KVSAN_ERR_"),
                "{name}"
            );
            assert!(status_text(code).is_some());
        }
        assert_eq!(status_text(1), None);
        assert_eq!(status_text(-(STATUSES.len() as i32)), None);
    }

    #[test]
    fn only_the_same_major_and_an_older_or_equal_minor_are_compatible() {
        assert!(version_compatible(ABI_VERSION));
        assert!(version_compatible(ABI_VERSION & !0xffff));
        assert!(!version_compatible(ABI_VERSION + 1));
        assert!(!version_compatible(ABI_VERSION + (1 << 16)));
        assert!(!version_compatible(0));
    }

    #[test]
    #[cfg(target_pointer_width = "64")]
    fn each_minor_versions_table_ends_after_its_last_hook() {
        assert_eq!(HOOK_TABLE_V1_0_SIZE, 96);
        assert_eq!(HOOK_TABLE_V1_1_SIZE, 120);
        assert_eq!(hook_table_size(2), 136);
        assert_eq!(hook_table_size(4), 136);
        assert_eq!(hook_table_size(5), 152);
        assert_eq!(hook_table_size(6), 192);
        assert_eq!(hook_table_size(6), size_of::<KvsanHookTable>());
        assert_eq!(KvsanHookTable::offset_of(Hook::TransferLand), Some(136));
        assert_eq!(KvsanHookTable::offset_of(Hook::TransferVerify), Some(144));
        assert_eq!(KvsanHookTable::offset_of(Hook::Share), Some(120));
        assert_eq!(KvsanHookTable::offset_of(Hook::DeclareSalt), Some(128));
        assert_eq!(Hook::Share.table_minor(), Some(2));
        assert_eq!(Hook::DeclareSalt.table_minor(), Some(2));
    }

    #[test]
    fn a_reserved_request_is_an_invalid_argument() {
        let e = SanitizerError::ReservedRequest {
            request: RequestId::PREFIX_CACHE.0,
            what: "allocate a page",
        };
        assert_eq!(status_of(&e), KVSAN_ERR_INVALID_ARGUMENT);
    }

    #[test]
    fn c_codes_round_trip() {
        for (i, &e) in REQUEST_EVENTS.iter().enumerate() {
            assert_eq!(event_code(e) as usize, i);
            assert_eq!(event_from_code(i as u32), Some(e));
        }
        assert_eq!(event_from_code(REQUEST_EVENTS.len() as u32), None);
        for role in [NodeRole::Unified, NodeRole::Prefill, NodeRole::Decode] {
            assert_eq!(role_from_code(role_code(role)), Some(role));
        }
        assert_eq!(role_from_code(3), None);
    }

    #[test]
    fn geometry_with_a_null_name_and_a_length_is_refused() {
        let g = KvsanPoolGeometry {
            pages: 4,
            page_slots: 16,
            layers: 2,
            role: 0,
            bytes_per_slot: 64,
            node: std::ptr::null(),
            node_len: 3,
        };
        // SAFETY: a null name with a length is exactly what is refused; nothing is read.
        assert!(unsafe { g.to_geometry() }.is_none());
    }
}
