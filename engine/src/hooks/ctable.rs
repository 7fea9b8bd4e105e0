//! The C hook table: how a release engine finds a sanitizer it was not built
//! with (the NVTX injection pattern). A library loaded with `LD_PRELOAD`
//! exports a getter named [`HOOK_TABLE_SYMBOL`]; at start-up the engine looks
//! it up with `dlsym(RTLD_DEFAULT, …)`, calls it once, validates the table it
//! returns and, if the table is sound, sends every hook through it. Without
//! the library the lookup returns null and nothing is attached.
//!
//! ```text
//!  const KvsanHookTable *kvsan_hook_table_v1(void);   // the exported getter
//!
//!  KvsanHookTable (96 bytes on LP64, #[repr(C)], version 1.0)
//!  offset size
//!  +----+----+---------------------------------------------------------------+
//!  |  0 |  4 | size            u32  sizeof the table as the library built it  |
//!  |  4 |  2 | version_major   u16  1; another major is not attached          |
//!  |  6 |  2 | version_minor   u16  0; a newer minor only appends fields      |
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
//!  +----+----+---------------------------------------------------------------+
//!  every hook returns KvsanVerdict by value:
//!  +----+----+---------------------------------------------------------------+
//!  |  0 |  4 | code         u32  0 continue, 1 abort the request, 2 error    |
//!  |  4 |  4 | kind         u32  index into ViolationKind::ALL (code 1)      |
//!  |  8 |  8 | violation_id u64  the id the library's report names (code 1)  |
//!  +----+----+---------------------------------------------------------------+
//!
//!  KvsanOwner       { u64 request; u32 tenant; u32 reserved (0) }       16 bytes
//!  KvsanPageRef     { u32 page; u32 generation }                          8 bytes
//!  KvsanRange       { u32 start; u32 end }   (half-open)                  8 bytes
//!  KvsanPoolGeometry{ u32 pages, page_slots, layers, role (0 unified,
//!                     1 prefill, 2 decode); u64 bytes_per_slot;
//!                     const u8 *node; size_t node_len (UTF-8) }          32 bytes
//!  KvsanManifest    { KvsanOwner request; u32 src_pool, dst_pool;
//!                     const KvsanPageRef *src_pages; size_t src_len;
//!                     const KvsanPageRef *dst_pages; size_t dst_len;
//!                     u32 first_token, tokens; KvsanRange layers;
//!                     u64 checksum }                                     72 bytes
//!  request events:  0 queued 1 admitted 2 prefilling 3 transferring
//!                   4 decoding 5 finished 6 rejected 7 aborted
//! ```
//!
//! Rules of the table:
//!
//! - `size` comes first so the engine can read it before trusting anything
//!   else. A table smaller than the engine's [`KvsanHookTable`], a null table,
//!   a null hook, or another major version is not attached: the engine says
//!   so loudly (stderr and the log) and runs without hooks — never a crash.
//!   A larger table (a newer minor version) is attached; the engine uses the
//!   fields it knows.
//! - Hooks may be called from several threads at once, for the rest of the
//!   process; the table, `ctx` and the functions must stay valid that long.
//! - `pool_register` returns code 0 and writes the pool id, or refuses the
//!   pool with any other code (its pages then go unchecked).
//! - Code 2 (error) means the library could not check the call (an unknown
//!   pool, a page out of range): the engine logs and counts it and the request
//!   goes on, as with the in-process sanitizer.
//! - **Unknown verdicts fail closed.** Code 1 with a `kind` this engine does
//!   not know (a newer library), or a code other than 0, 1, 2, still aborts
//!   the request: the library found something and continuing could let a leak
//!   through. The violation id is kept (the library's report has the real
//!   kind); the kind the engine shows is the one the hook's own check is
//!   named after ([`fallback_kind`]: `stale-read` for `read`,
//!   `write-after-free` for `transfer_recv`, …), and the raw index is logged.

use std::ffi::{CStr, c_void};
use std::ops::Range;
use std::sync::atomic::{AtomicU64, Ordering};

use kvsan_sanitizer::{
    Generation, Manifest, NodeRole, Owner, PageId, PageRef, PoolGeometry, PoolId, RequestEvent,
    RequestId, TenantId, Verdict, ViolationId, ViolationKind,
};

use super::{HookSettings, KvHooks};
use crate::EngineError;

/// The exported getter the engine looks up: `const KvsanHookTable *kvsan_hook_table_v1(void)`.
pub const HOOK_TABLE_SYMBOL: &CStr = c"kvsan_hook_table_v1";
/// The table's major version this engine speaks.
pub const HOOK_TABLE_VERSION_MAJOR: u16 = 1;
/// The table's minor version this engine was built with.
pub const HOOK_TABLE_VERSION_MINOR: u16 = 0;
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

/// What every hook returns.
#[repr(C)]
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct KvsanVerdict {
    /// [`KVSAN_VERDICT_CONTINUE`], [`KVSAN_VERDICT_ABORT`] or [`KVSAN_VERDICT_ERROR`].
    pub code: u32,
    /// With code 1: the index of the kind in [`ViolationKind::ALL`].
    pub kind: u32,
    /// With code 1: the violation's id.
    pub violation_id: u64,
}

/// `pool_register`: code 0 and `*pool_out` set, or a refusal.
pub type PoolRegisterFn = unsafe extern "C" fn(
    ctx: *mut c_void,
    geometry: *const KvsanPoolGeometry,
    pool_out: *mut u32,
) -> KvsanVerdict;
/// `request_event`.
pub type RequestEventFn =
    unsafe extern "C" fn(ctx: *mut c_void, owner: KvsanOwner, event: u32) -> KvsanVerdict;
/// `alloc` and `free`.
pub type PageFn = unsafe extern "C" fn(
    ctx: *mut c_void,
    pool: u32,
    owner: KvsanOwner,
    page: KvsanPageRef,
    step: u64,
) -> KvsanVerdict;
/// `write`.
pub type WriteFn = unsafe extern "C" fn(
    ctx: *mut c_void,
    pool: u32,
    owner: KvsanOwner,
    page: KvsanPageRef,
    slots: KvsanRange,
    layers: KvsanRange,
    step: u64,
) -> KvsanVerdict;
/// `read`.
pub type ReadFn = unsafe extern "C" fn(
    ctx: *mut c_void,
    pool: u32,
    owner: KvsanOwner,
    table: *const KvsanPageRef,
    table_len: usize,
    tokens: u64,
    layers: KvsanRange,
    step: u64,
) -> KvsanVerdict;
/// `transfer_send` and `transfer_recv`.
pub type TransferFn = unsafe extern "C" fn(
    ctx: *mut c_void,
    pool: u32,
    manifest: *const KvsanManifest,
) -> KvsanVerdict;
/// `transfer_commit`.
pub type CommitFn = unsafe extern "C" fn(
    ctx: *mut c_void,
    pool: u32,
    owner: KvsanOwner,
    table: *const KvsanPageRef,
    table_len: usize,
    committed_tokens: u64,
) -> KvsanVerdict;

/// The versioned hook table (layout in the module documentation). A null
/// function pointer makes the table invalid.
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
    /// See [`KvHooks::pool_register`].
    pub pool_register: Option<PoolRegisterFn>,
    /// See [`KvHooks::request_event`].
    pub request_event: Option<RequestEventFn>,
    /// See [`KvHooks::alloc`].
    pub alloc: Option<PageFn>,
    /// See [`KvHooks::free`].
    pub free: Option<PageFn>,
    /// See [`KvHooks::write`].
    pub write: Option<WriteFn>,
    /// See [`KvHooks::read`].
    pub read: Option<ReadFn>,
    /// See [`KvHooks::transfer_send`].
    pub transfer_send: Option<TransferFn>,
    /// See [`KvHooks::transfer_recv`].
    pub transfer_recv: Option<TransferFn>,
    /// See [`KvHooks::transfer_commit`].
    pub transfer_commit: Option<CommitFn>,
}

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
                kind: kind.index() as u32,
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
    /// The C view of `g`, borrowing its node name.
    #[must_use]
    pub fn borrow(g: &PoolGeometry) -> KvsanPoolGeometry {
        KvsanPoolGeometry {
            pages: g.pages,
            page_slots: g.page_slots,
            layers: g.layers,
            role: role_code(g.role),
            bytes_per_slot: g.bytes_per_slot,
            node: g.node.as_ptr(),
            node_len: g.node.len(),
        }
    }

    /// The Rust geometry; `None` for an unknown role or a name that is not
    /// UTF-8.
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
            role: role_from_code(self.role)?,
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

/// Which hook a verdict came from (for [`fallback_kind`] and logs).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
#[non_exhaustive]
pub enum Hook {
    /// `pool_register`.
    PoolRegister,
    /// `request_event`.
    RequestEvent,
    /// `alloc`.
    Alloc,
    /// `free`.
    Free,
    /// `write`.
    Write,
    /// `read`.
    Read,
    /// `transfer_send`.
    TransferSend,
    /// `transfer_recv`.
    TransferRecv,
    /// `transfer_commit`.
    TransferCommit,
}

impl Hook {
    /// The hook's name in the table.
    #[must_use]
    pub const fn name(self) -> &'static str {
        match self {
            Hook::PoolRegister => "pool_register",
            Hook::RequestEvent => "request_event",
            Hook::Alloc => "alloc",
            Hook::Free => "free",
            Hook::Write => "write",
            Hook::Read => "read",
            Hook::TransferSend => "transfer_send",
            Hook::TransferRecv => "transfer_recv",
            Hook::TransferCommit => "transfer_commit",
        }
    }
}

/// The kind shown for an abort whose kind index (or code) this engine does
/// not know: the violation the hook's own main check is named after.
#[must_use]
pub const fn fallback_kind(hook: Hook) -> ViolationKind {
    match hook {
        Hook::PoolRegister | Hook::RequestEvent => ViolationKind::IllegalTransition,
        Hook::Alloc => ViolationKind::DoubleAlloc,
        Hook::Free => ViolationKind::DoubleFree,
        Hook::Write => ViolationKind::ForeignWrite,
        Hook::Read => ViolationKind::StaleRead,
        Hook::TransferSend => ViolationKind::UnwrittenTransfer,
        Hook::TransferRecv => ViolationKind::WriteAfterFree,
        Hook::TransferCommit => ViolationKind::ShortTransfer,
    }
}

/// [`KvHooks`] through a validated C hook table.
#[derive(Debug)]
pub struct CTableHooks {
    table: KvsanHookTable,
    /// The minor version the library declared.
    minor: u16,
    errors: AtomicU64,
}

// SAFETY: the table's contract (module documentation) is that its hooks may
// be called from any thread, concurrently, with its `ctx`, for the rest of
// the process; the engine only copies the table and calls through it.
unsafe impl Send for CTableHooks {}
// SAFETY: as for `Send`: every hook is `&self` and the contract makes
// concurrent calls through the shared `ctx` sound.
unsafe impl Sync for CTableHooks {}

/// Errors logged in full before the adapter only counts them.
const LOGGED_ERRORS: u64 = 16;

fn rejected(what: String) -> EngineError {
    EngineError::HookTable { what }
}

impl CTableHooks {
    /// Looks up `symbol` with `dlsym(RTLD_DEFAULT, …)`, calls it as a
    /// [`HookTableGetter`] and validates the table. `None` when the symbol is
    /// absent (no library: nothing to attach), or when the table is rejected
    /// — then a line naming what was wrong goes to stderr and the log.
    #[must_use]
    pub fn from_symbol(symbol: &CStr) -> Option<CTableHooks> {
        // SAFETY: RTLD_DEFAULT is a valid pseudo-handle and `symbol` is a
        // NUL-terminated string that outlives the call.
        let address = unsafe { libc::dlsym(libc::RTLD_DEFAULT, symbol.as_ptr()) };
        if address.is_null() {
            tracing::debug!(symbol = ?symbol, "kvsan: no hook table exported");
            return None;
        }
        // SAFETY: a library exporting this name promises (module
        // documentation) that it is a `HookTableGetter`; a function pointer
        // and a data pointer have one size on the platforms dlsym serves.
        let getter: HookTableGetter = unsafe { std::mem::transmute(address) };
        // SAFETY: the getter takes no arguments and returns a table pointer
        // valid for the rest of the process (or null), per the contract.
        let table = unsafe { getter() };
        // SAFETY: the pointer comes from the library's getter, which promises
        // a table of at least its declared `size` bytes, or null.
        match unsafe { CTableHooks::from_raw(table) } {
            Ok(hooks) => Some(hooks),
            Err(e) => {
                eprintln!(
                    "kvsan: hook table `{}` not attached: {e}",
                    symbol.to_string_lossy()
                );
                tracing::error!(symbol = ?symbol, "kvsan: hook table not attached: {e}");
                None
            }
        }
    }

    /// Validates the table at `table` and copies the part this engine knows.
    ///
    /// # Errors
    /// [`EngineError::HookTable`] naming what is wrong: a null pointer, a
    /// `size` smaller than this engine's table, a major version other than
    /// [`HOOK_TABLE_VERSION_MAJOR`], a null hook.
    ///
    /// # Safety
    /// - `table` is null, or points to readable memory of at least 4 bytes
    ///   holding the table's `size`, and of at least `size` bytes in all;
    /// - if the table passes validation, its hooks may be called with its
    ///   `ctx` from any thread, concurrently, for the rest of the process.
    pub unsafe fn from_raw(table: *const KvsanHookTable) -> Result<CTableHooks, EngineError> {
        if table.is_null() {
            return Err(rejected("the table pointer is null".into()));
        }
        // SAFETY: non-null, and the caller guarantees the first 4 bytes are
        // readable; read unaligned since nothing is trusted yet.
        let size = unsafe { table.cast::<u32>().read_unaligned() };
        let need = size_of::<KvsanHookTable>();
        if (size as usize) < need {
            return Err(rejected(format!(
                "its size is {size} bytes; this engine's version {HOOK_TABLE_VERSION_MAJOR}.{HOOK_TABLE_VERSION_MINOR} table needs at least {need}"
            )));
        }
        // SAFETY: at least `size` ≥ size_of::<KvsanHookTable>() bytes are
        // readable; unaligned in case the library packed it oddly.
        let copy = unsafe { table.read_unaligned() };
        if copy.version_major != HOOK_TABLE_VERSION_MAJOR {
            return Err(rejected(format!(
                "its version is {}.{}; this engine speaks major version {HOOK_TABLE_VERSION_MAJOR}",
                copy.version_major, copy.version_minor
            )));
        }
        let hooks: [(&str, bool); 9] = [
            ("pool_register", copy.pool_register.is_none()),
            ("request_event", copy.request_event.is_none()),
            ("alloc", copy.alloc.is_none()),
            ("free", copy.free.is_none()),
            ("write", copy.write.is_none()),
            ("read", copy.read.is_none()),
            ("transfer_send", copy.transfer_send.is_none()),
            ("transfer_recv", copy.transfer_recv.is_none()),
            ("transfer_commit", copy.transfer_commit.is_none()),
        ];
        if let Some((name, _)) = hooks.iter().find(|(_, null)| *null) {
            return Err(rejected(format!("its `{name}` hook is null")));
        }
        Ok(CTableHooks {
            minor: copy.version_minor,
            table: copy,
            errors: AtomicU64::new(0),
        })
    }

    /// The library's declared version `(major, minor)`.
    #[must_use]
    pub fn version(&self) -> (u16, u16) {
        (self.table.version_major, self.minor)
    }

    /// Calls the library reported as errors (code 2) since start.
    #[must_use]
    pub fn errors(&self) -> u64 {
        self.errors.load(Ordering::Relaxed)
    }

    /// The engine's verdict for the library's `v` from `hook`.
    #[inline]
    fn verdict(&self, hook: Hook, v: KvsanVerdict) -> Verdict {
        match v.code {
            KVSAN_VERDICT_CONTINUE => Verdict::Continue,
            KVSAN_VERDICT_ABORT => match ViolationKind::ALL.get(v.kind as usize) {
                Some(&kind) => Verdict::Abort {
                    violation: ViolationId(v.violation_id),
                    kind,
                },
                None => self.unknown(hook, v),
            },
            KVSAN_VERDICT_ERROR => {
                let n = self.errors.fetch_add(1, Ordering::Relaxed);
                if n < LOGGED_ERRORS {
                    tracing::error!(
                        hook = hook.name(),
                        "kvsan: the hook table could not check a call"
                    );
                }
                Verdict::Continue
            }
            _ => self.unknown(hook, v),
        }
    }

    #[cold]
    #[inline(never)]
    fn unknown(&self, hook: Hook, v: KvsanVerdict) -> Verdict {
        let kind = fallback_kind(hook);
        tracing::error!(
            hook = hook.name(),
            code = v.code,
            kind_index = v.kind,
            violation = v.violation_id,
            shown_as = kind.name(),
            "kvsan: the hook table returned a verdict this engine does not know; aborting the request"
        );
        Verdict::Abort {
            violation: ViolationId(v.violation_id),
            kind,
        }
    }
}

/// The hook of a validated table (validation rejected every null one).
macro_rules! hook {
    ($self:ident . $name:ident) => {
        match $self.table.$name {
            Some(f) => f,
            None => unreachable!(concat!(
                "validated table has a null `",
                stringify!($name),
                "`"
            )),
        }
    };
}

impl KvHooks for CTableHooks {
    fn pool_register(&self, geometry: &PoolGeometry) -> Option<PoolId> {
        let g = KvsanPoolGeometry::borrow(geometry);
        let mut id = u32::MAX;
        // SAFETY: the table was validated; `g` and its node name outlive the
        // call; `id` is a writable u32.
        let v = unsafe { hook!(self.pool_register)(self.table.ctx, &g, &mut id) };
        (v.code == KVSAN_VERDICT_CONTINUE).then_some(PoolId(id))
    }

    fn request_event(&self, owner: Owner, event: RequestEvent) -> Verdict {
        // SAFETY: validated table; arguments by value.
        let v =
            unsafe { hook!(self.request_event)(self.table.ctx, owner.into(), event_code(event)) };
        self.verdict(Hook::RequestEvent, v)
    }

    fn alloc(&self, pool: PoolId, owner: Owner, page: PageRef, step: u64) -> Verdict {
        // SAFETY: validated table; arguments by value.
        let v =
            unsafe { hook!(self.alloc)(self.table.ctx, pool.0, owner.into(), page.into(), step) };
        self.verdict(Hook::Alloc, v)
    }

    fn free(&self, pool: PoolId, owner: Owner, page: PageRef, step: u64) -> Verdict {
        // SAFETY: validated table; arguments by value.
        let v =
            unsafe { hook!(self.free)(self.table.ctx, pool.0, owner.into(), page.into(), step) };
        self.verdict(Hook::Free, v)
    }

    #[inline]
    fn write(
        &self,
        pool: PoolId,
        owner: Owner,
        page: PageRef,
        slots: Range<u32>,
        layers: Range<u32>,
        step: u64,
    ) -> Verdict {
        // SAFETY: validated table; arguments by value.
        let v = unsafe {
            hook!(self.write)(
                self.table.ctx,
                pool.0,
                owner.into(),
                page.into(),
                slots.into(),
                layers.into(),
                step,
            )
        };
        self.verdict(Hook::Write, v)
    }

    #[inline]
    fn read(
        &self,
        pool: PoolId,
        owner: Owner,
        table: &[PageRef],
        tokens: usize,
        layers: Range<u32>,
        step: u64,
    ) -> Verdict {
        // SAFETY: validated table; `table` is `table.len()` PageRefs, which
        // have KvsanPageRef's layout (asserted at compile time), alive for
        // the call.
        let v = unsafe {
            hook!(self.read)(
                self.table.ctx,
                pool.0,
                owner.into(),
                table.as_ptr().cast(),
                table.len(),
                tokens as u64,
                layers.into(),
                step,
            )
        };
        self.verdict(Hook::Read, v)
    }

    fn transfer_send(&self, pool: PoolId, manifest: &Manifest) -> Verdict {
        let m = KvsanManifest::borrow(manifest);
        // SAFETY: validated table; `m` borrows `manifest`'s tables, alive
        // for the call.
        let v = unsafe { hook!(self.transfer_send)(self.table.ctx, pool.0, &m) };
        self.verdict(Hook::TransferSend, v)
    }

    fn transfer_recv(&self, pool: PoolId, manifest: &Manifest) -> Verdict {
        let m = KvsanManifest::borrow(manifest);
        // SAFETY: as in `transfer_send`.
        let v = unsafe { hook!(self.transfer_recv)(self.table.ctx, pool.0, &m) };
        self.verdict(Hook::TransferRecv, v)
    }

    fn transfer_commit(
        &self,
        pool: PoolId,
        owner: Owner,
        table: &[PageRef],
        committed_tokens: usize,
    ) -> Verdict {
        // SAFETY: validated table; `table` as in `read`.
        let v = unsafe {
            hook!(self.transfer_commit)(
                self.table.ctx,
                pool.0,
                owner.into(),
                table.as_ptr().cast(),
                table.len(),
                committed_tokens as u64,
            )
        };
        self.verdict(Hook::TransferCommit, v)
    }

    fn settings(&self) -> HookSettings {
        HookSettings {
            poison: self.table.flags & KVSAN_FLAG_POISON != 0,
            quarantine_pages: self.table.quarantine_pages,
        }
    }
}
