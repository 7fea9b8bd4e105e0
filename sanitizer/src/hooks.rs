//! The one list of hooks: every event an engine reports to the sanitizer,
//! written once, with each face it has (compiler-rt's `.inc` lists).
//!
//! ```text
//!                        for_each_hook! (this file)
//!                                 │
//!      ┌──────────────┬───────────┼────────────────┬──────────────────────┐
//!   every           table       table           export                engine
//!      │              │           │                │                     │
//!   Hook (here)   KvsanHookTable  the shim's     the shim's kvsan_*     KvHooks and the
//!                 (abi.rs)        table hooks    functions (kvsan.h)    Hooks dispatch
//! ```
//!
//! One entry a hook, in hook-table order (a newer minor version of the
//! table only appends):
//!
//! ```text
//!  /// what happened, and what the target answers
//!  Variant = name(C arguments after ctx) => kind,
//!      table(minor, FnType) | table -,
//!      export(kvsan_name, verdict | status | by_hand) | export -,
//!      engine(fn method(Rust arguments) -> Answer) | engine -;
//! ```
//!
//! - `kind`: the violation the hook's main check is named after — what an
//!   engine shows for an abort whose kind it does not know
//!   ([`Hook::main_violation`]).
//! - `table`: the hook has a field in `KvsanHookTable`; the table's minor
//!   version that added it, and the C header's name for its function type
//!   (`PageFn` for `KvsanPageFn`; the type itself, `ctx` and the C
//!   arguments returning `KvsanVerdict`, is generated as
//!   `abi::fn_of::<name>`, and hooks that share a name must share a type).
//! - `export`: the library's plain C function. `verdict`: the listed
//!   arguments, a `*_size` after each argument marked `[..._size]`, and
//!   `KvsanVerdict *verdict_out`; `status`: the same without
//!   `verdict_out` (the answer is what the call writes). `by_hand`: another
//!   signature, written out in the shim, which the list checks is there.
//! - `engine`: the method of the engine's `KvHooks` trait, with Rust types.
//!
//! Generated from the list: [`Hook`]; `KvsanHookTable`, the hooks'
//! function types and the table's version sizes ([`crate::abi`]); in
//! `kvsan-engine` the `KvHooks` trait and the `Hooks` dispatch of every
//! verdict hook; in `kvsan-shim` the table's functions and the `kvsan_*`
//! exports of the `verdict` and `status` shapes.
//!
//! Written by hand, and checked against the list by the compiler: the
//! per-hook bodies (the shim's `calls::<name>`; the engine's
//! `SanitizerHooks` and `CTableHooks` methods, the C conversions), the
//! `Hooks` methods that answer something other than a verdict, and the
//! `by_hand` exports. Written by hand and checked by a test
//! (`tests/shim_header_declares_the_listed_hooks.rs`): the C header's hook
//! table, function typedefs and `kvsan_*` prototypes.
//!
//! A consumer is a `macro_rules!` macro `m` called as
//! `for_each_hook!(face => m)`; it gets the entries that have the face, one
//! `;`-terminated item each, with the entry's doc comments first:
//!
//! ```text
//!  every   Variant = name => kind, Some(minor) | None;
//!  table   Variant = name(args), minor, FnType;
//!  export  name(args), kvsan_name, shape;
//!  engine  (fn method(args) -> Answer);
//! ```
//!
//! `args` are `arg: Type` with an optional `[size_arg]` after a pointer
//! whose struct size a plain C function is passed. Type names are resolved
//! where the consumer expands: the C types from [`crate::abi`], the Rust
//! ones from this crate's root.

use crate::violation::ViolationKind;

/// Calls `m!` with the hooks that have `face` (`every`, `table`, `export`
/// or `engine`); see the [module documentation](crate::hooks) for what a
/// consumer gets.
#[macro_export]
macro_rules! for_each_hook {
    ($face:ident => $m:ident) => {
        $crate::for_each_hook! { @select $face $m []
            /// A pool was created, with this geometry. The target answers the
            /// id it knows the pool by, or refuses the pool (its pages then
            /// go unchecked).
            PoolRegister = pool_register(
                geometry: *const KvsanPoolGeometry [geometry_size],
                pool_out: *mut u32
            ) => IllegalTransition,
                table(0, PoolRegisterFn),
                export(kvsan_pool_register, status),
                engine(fn pool_register(geometry: &PoolGeometry) -> Option<PoolId>);

            /// A request entered the state `event` (0 queued … 7 aborted), in
            /// the whole process's view.
            RequestEvent = request_event(owner: KvsanOwner, event: u32) => IllegalTransition,
                table(0, RequestEventFn),
                export(kvsan_request_event, verdict),
                engine -;

            /// `page` was taken from the free list for `owner`: a new
            /// generation of it.
            Alloc = alloc(pool: u32, owner: KvsanOwner, page: KvsanPageRef, step: u64)
                => DoubleAlloc,
                table(0, PageFn),
                export(kvsan_alloc, by_hand),
                engine(fn alloc(pool: PoolId, owner: Owner, page: PageRef, step: u64) -> Verdict);

            /// `owner` returns `page` to the pool.
            Free = free(pool: u32, owner: KvsanOwner, page: KvsanPageRef, step: u64)
                => DoubleFree,
                table(0, PageFn),
                export(kvsan_free, verdict),
                engine(fn free(pool: PoolId, owner: Owner, page: PageRef, step: u64) -> Verdict);

            /// `owner` computed KV into `slots` × `layers` of `page` (an engine
            /// that reports its accesses; the kvsan engine checks in its
            /// kernels instead).
            Write = write(
                pool: u32,
                owner: KvsanOwner,
                page: KvsanPageRef,
                slots: KvsanRange,
                layers: KvsanRange,
                step: u64
            ) => ForeignWrite,
                table(0, WriteFn),
                export(kvsan_write, verdict),
                engine -;

            /// Attention of `owner` is about to read the first `tokens`
            /// positions of the block table `table[0..table_len]` for
            /// `layers` (an engine that reports its accesses).
            Read = read(
                pool: u32,
                owner: KvsanOwner,
                table: *const KvsanPageRef,
                table_len: usize,
                tokens: u64,
                layers: KvsanRange,
                step: u64
            ) => StaleRead,
                table(0, ReadFn),
                export(kvsan_read, verdict),
                engine -;

            /// The sender (pool `pool`) ships what `manifest` describes.
            TransferSend = transfer_send(pool: u32, manifest: *const KvsanManifest [manifest_size])
                => UnwrittenTransfer,
                table(0, TransferFn),
                export(kvsan_transfer_send, verdict),
                engine(fn transfer_send(pool: PoolId, manifest: &Manifest) -> Verdict);

            /// A transfer of what `manifest` describes arrives at the
            /// receiver's (pool `pool`) pages, which it reserves for it.
            TransferRecv = transfer_recv(pool: u32, manifest: *const KvsanManifest [manifest_size])
                => WriteAfterFree,
                table(0, TransferFn),
                export(kvsan_transfer_recv, verdict),
                engine(fn transfer_recv(pool: PoolId, manifest: &Manifest) -> Verdict);

            /// The receiver starts using the first `committed_tokens`
            /// positions of its block table `table`.
            TransferCommit = transfer_commit(
                pool: u32,
                owner: KvsanOwner,
                table: *const KvsanPageRef,
                table_len: usize,
                committed_tokens: u64
            ) => ShortTransfer,
                table(0, CommitFn),
                export(kvsan_transfer_commit, verdict),
                engine(fn transfer_commit(
                    pool: PoolId,
                    owner: Owner,
                    table: &[PageRef],
                    committed_tokens: usize
                ) -> Verdict);

            /// Where pool `pool`'s kernel shadow lives: the page records and
            /// written bits an engine's kernels check every KV store and
            /// attention read against in place. None from a target that has
            /// none (KV accesses then go unchecked by it).
            KernelShadow = kernel_shadow(pool: u32, out: *mut KvsanKernelShadow [out_size])
                => StaleRead,
                table(1, KernelShadowFn),
                export(kvsan_kernel_shadow, status),
                engine(fn kernel_shadow(pool: PoolId) -> Option<KernelShadowHandle>);

            /// The cold path of a kernel access its in-place check did not
            /// pass: the access as the kernel was about to make it, by the
            /// batch row of `owner`, at `step`. Checked against the whole
            /// shadow (sharers included) and reported; the verdict says
            /// whether the kernel may go on (a legal shared read, or
            /// `on_violation=report`).
            KernelRefusal = kernel_refusal(
                pool: u32,
                owner: KvsanOwner,
                access: *const KvsanKernelAccess [access_size],
                step: u64
            ) => StaleRead,
                table(1, KernelRefusalFn),
                export(kvsan_kernel_refusal, verdict),
                engine(#[cold] fn kernel_refusal(
                    pool: PoolId,
                    owner: Owner,
                    access: &KernelAccess,
                    step: u64
                ) -> Verdict);

            /// A request entered the state `event`, as the node that owns
            /// `pool` sees it: each node of a disaggregated deployment has its
            /// own view of a request (`kvsan_sanitizer::Scope`), so a cancel
            /// one node reports does not end the request for its peer before
            /// the peer is told.
            RequestEventAt = request_event_at(pool: u32, owner: KvsanOwner, event: u32)
                => IllegalTransition,
                table(1, RequestEventAtFn),
                export(kvsan_request_event_at, verdict),
                engine(fn request_event(pool: PoolId, owner: Owner, event: RequestEvent) -> Verdict);

            /// The prefix cache shares `page` read-only with `sharer`: a
            /// request that got a cache hit, or the cache itself
            /// (`RequestId::PREFIX_CACHE` with the writer's tenant) taking
            /// the reference that keeps a page it registers. The sharer
            /// lets go with `free`. Not `Continue`: the page must not be
            /// shared (or registered).
            Share = share(pool: u32, page: KvsanPageRef, sharer: KvsanOwner) => GenerationMismatch,
                table(2, ShareFn),
                export(kvsan_share, verdict),
                engine(fn share(pool: PoolId, page: PageRef, sharer: Owner) -> Verdict);

            /// `owner` declares its cache salt (hashed; 0: none) before it
            /// takes pages: a salt narrows sharing under `prefix_share=tenant`
            /// and `=salt`.
            DeclareSalt = declare_salt(owner: KvsanOwner, salt: u64) => CrossDomainShare,
                table(2, DeclareSaltFn),
                export(kvsan_declare_salt, verdict),
                engine(fn declare_salt(owner: Owner, salt: u64) -> Verdict);

            /// A copy is about to put received KV into one destination page
            /// (pool `pool`): the page, slots, layers and tokens it writes.
            /// Only on `Continue` may it write; only then do the slots count
            /// as written.
            TransferLand = transfer_land(
                pool: u32,
                landing: *const KvsanPageLanding [landing_size]
            ) => MisdirectedTransfer,
                table(5, LandingFn),
                export(kvsan_transfer_land, verdict),
                engine(fn transfer_land(pool: PoolId, landing: &PageLanding) -> Verdict);

            /// Received KV is in one destination page (pool `pool`): the
            /// receiver's digest of what the page holds there against the
            /// sender's digest of those tokens.
            TransferVerify = transfer_verify(
                pool: u32,
                landing: *const KvsanPageLanding [landing_size]
            ) => TransferDigestMismatch,
                table(5, LandingFn),
                export(kvsan_transfer_verify, verdict),
                engine(fn transfer_verify(pool: PoolId, landing: &PageLanding) -> Verdict);

            /// A store of `page` into block `block` of tier `tier` (host
            /// memory, disk: the engine's numbers) starts, for `owner` (a
            /// preempted request, or the prefix cache moving a cached page
            /// down a tier). The block takes the page's identity: owner,
            /// salt, generation, written slots.
            TierStore = tier_store(
                pool: u32,
                owner: KvsanOwner,
                page: KvsanPageRef,
                tier: u32,
                block: u64,
                step: u64
            ) => TierBlockAliased,
                table(6, TierPageFn),
                export(kvsan_tier_store, verdict),
                engine(fn tier_store(
                    pool: PoolId,
                    owner: Owner,
                    page: PageRef,
                    block: TierBlockId,
                    step: u64
                ) -> Verdict);

            /// The store into the block completed (`stored` 1: the tier
            /// holds the page's KV, `digest` the engine's digest of it) or
            /// failed (`stored` 0: the block is never loaded).
            TierStoreDone = tier_store_done(tier: u32, block: u64, digest: u64, stored: u32)
                => TierStoreSourceReused,
                table(6, TierStoreDoneFn),
                export(kvsan_tier_store_done, verdict),
                engine(fn tier_store_done(block: TierBlockId, digest: u64, stored: bool) -> Verdict);

            /// A load of the block is about to copy it into `page` for
            /// `owner`. Only on `Continue` may it write; then the slots the
            /// store found written count as written.
            TierLoad = tier_load(
                pool: u32,
                owner: KvsanOwner,
                page: KvsanPageRef,
                tier: u32,
                block: u64,
                step: u64
            ) => TierLoadUnstored,
                table(6, TierPageFn),
                export(kvsan_tier_load, verdict),
                engine(fn tier_load(
                    pool: PoolId,
                    owner: Owner,
                    page: PageRef,
                    block: TierBlockId,
                    step: u64
                ) -> Verdict);

            /// The loaded KV is in `page`: `digest`, the engine's digest of
            /// what the page holds, against the store's.
            TierVerify = tier_verify(
                pool: u32,
                owner: KvsanOwner,
                page: KvsanPageRef,
                tier: u32,
                block: u64,
                digest: u64
            ) => TierDigestMismatch,
                table(6, TierVerifyFn),
                export(kvsan_tier_verify, verdict),
                engine(fn tier_verify(
                    pool: PoolId,
                    owner: Owner,
                    page: PageRef,
                    block: TierBlockId,
                    digest: u64
                ) -> Verdict);

            /// The tier let go of the block (evicted, its memory reused): it
            /// may not be loaded again.
            TierRelease = tier_release(tier: u32, block: u64) => TierLoadUnstored,
                table(6, TierReleaseFn),
                export(kvsan_tier_release, verdict),
                engine(fn tier_release(block: TierBlockId) -> Verdict);
        }
    };

    // The selection, one entry a step: an entry with the face asked for is
    // appended to the consumer's input, in its shape; any other is passed over.
    (@select $face:ident $m:ident [$($done:tt)*]) => { $m! { $($done)* } };
    (@select every $m:ident [$($done:tt)*]
        $(#[$doc:meta])* $variant:ident = $name:ident $args:tt => $kind:ident,
        table($minor:literal, $fn:ident), export $export:tt, engine $engine:tt;
        $($rest:tt)*
    ) => {
        $crate::for_each_hook! { @select every $m
            [$($done)* $(#[$doc])* $variant = $name => $kind, Some($minor);] $($rest)* }
    };
    (@select every $m:ident [$($done:tt)*]
        $(#[$doc:meta])* $variant:ident = $name:ident $args:tt => $kind:ident,
        table -, export $export:tt, engine $engine:tt;
        $($rest:tt)*
    ) => {
        $crate::for_each_hook! { @select every $m
            [$($done)* $(#[$doc])* $variant = $name => $kind, None;] $($rest)* }
    };
    (@select table $m:ident [$($done:tt)*]
        $(#[$doc:meta])* $variant:ident = $name:ident $args:tt => $kind:ident,
        table($minor:literal, $fn:ident), export $export:tt, engine $engine:tt;
        $($rest:tt)*
    ) => {
        $crate::for_each_hook! { @select table $m
            [$($done)* $(#[$doc])* $variant = $name $args, $minor, $fn;] $($rest)* }
    };
    (@select export $m:ident [$($done:tt)*]
        $(#[$doc:meta])* $variant:ident = $name:ident $args:tt => $kind:ident,
        table $table:tt, export($export:ident, $shape:ident), engine $engine:tt;
        $($rest:tt)*
    ) => {
        $crate::for_each_hook! { @select export $m
            [$($done)* $(#[$doc])* $name $args, $export, $shape;] $($rest)* }
    };
    (@select engine $m:ident [$($done:tt)*]
        $(#[$doc:meta])* $variant:ident = $name:ident $args:tt => $kind:ident,
        table $table:tt, export $export:tt, engine($($method:tt)+);
        $($rest:tt)*
    ) => {
        $crate::for_each_hook! { @select engine $m
            [$($done)* $(#[$doc])* ($($method)+);] $($rest)* }
    };
    (@select $face:ident $m:ident [$($done:tt)*]
        $(#[$doc:meta])* $variant:ident = $name:ident $args:tt => $kind:ident,
        table $table:tt, export $export:tt, engine $engine:tt;
        $($rest:tt)*
    ) => {
        $crate::for_each_hook! { @select $face $m [$($done)*] $($rest)* }
    };
}

macro_rules! define_hooks {
    ($($(#[$doc:meta])* $variant:ident = $name:ident => $kind:ident, $minor:expr;)*) => {
        /// A hook of the list ([`for_each_hook!`]).
        #[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
        #[non_exhaustive]
        pub enum Hook {
            $(
                #[doc = concat!("`", stringify!($name), "`.")]
                #[doc = ""]
                $(#[$doc])*
                $variant,
            )*
        }

        impl Hook {
            /// Every hook, in list (and hook-table) order.
            pub const ALL: &'static [Hook] = &[$(Hook::$variant),*];

            /// The hook's name: its field in the hook table, and its plain C
            /// function without the `kvsan_` prefix.
            #[must_use]
            pub const fn name(self) -> &'static str {
                match self { $(Hook::$variant => stringify!($name),)* }
            }

            /// The hook table's minor version that added the hook; `None`
            /// for a hook that is a plain C function only.
            #[must_use]
            pub const fn table_minor(self) -> Option<u16> {
                match self { $(Hook::$variant => $minor,)* }
            }

            /// The violation the hook's main check is named after: the kind
            /// an engine shows for an abort whose kind (or code) it does not
            /// know — `stale-read` for `read`, `write-after-free` for
            /// `transfer_recv`, ….
            #[must_use]
            pub const fn main_violation(self) -> ViolationKind {
                match self { $(Hook::$variant => ViolationKind::$kind,)* }
            }
        }
    };
}

for_each_hook!(every => define_hooks);

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn hook_names_are_distinct_snake_case() {
        for (i, a) in Hook::ALL.iter().enumerate() {
            assert!(
                a.name()
                    .bytes()
                    .all(|b| b.is_ascii_lowercase() || b == b'_'),
                "{a:?}"
            );
            for b in &Hook::ALL[i + 1..] {
                assert_ne!(a.name(), b.name());
            }
        }
    }
}
