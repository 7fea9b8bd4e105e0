//! The one list of batch layouts: the buffers an engine hands its
//! attention or store kernel, each layout written once, with the buffers in
//! the order the C functions take them (compiler-rt's `.inc` lists, as
//! [`crate::hooks`] is for the hooks).
//!
//! ```text
//!                    for_each_batch_layout! (this file)
//!                                  │
//!        ┌─────────────────────────┼──────────────────────────────┐
//!   BatchLayout, Batch<K>     the shim's kvsan_check_*      kvsan-kernels' check
//!   (here; the host checks    and kvsan_check_*_device      launches (EngineBatch =
//!   dispatch on them)         exports, and their calls      Batch<Views>)
//! ```
//!
//! One entry a layout:
//!
//! ```text
//!  /// what the kernel reads (or stores)
//!  Variant = check_name, reads | stores, export(kvsan_check_name, kvsan_check_name_device) (
//!      /// what the buffer holds
//!      buffer: [i32; rows | offsets | own_length],
//!      scalar: usize,
//!  );
//! ```
//!
//! A buffer of `rows` has one value per row, one of `offsets` one more than
//! the rows; any other length is the buffer's own, passed as a `size_t`
//! right after it. A scalar is a `size_t`. Both C functions take `pool`
//! (the device one then `device`), `owners` and `rows`, the layout's
//! arguments in list order, then `layers`, `step` and `verdicts_out`; the
//! host function takes each buffer as a pointer, the device one as a
//! device address (`uint64_t`).
//!
//! Generated from the list: [`BatchLayout`] (the one layout enum) with its
//! C parameters ([`BatchLayout::params`]), [`Batch`] (a layout's buffers,
//! held as [`Buffers`] says: host slices, C pointers, device addresses or
//! device views) with [`Batch::try_map`]; in `kvsan-shim` the eight C
//! exports. Written by hand and checked against the list by a test
//! (`tests/shim_header_declares_the_listed_hooks.rs`): the C header's
//! prototypes; the Python package's signatures are checked against the
//! header (`python/tests/test_abi_matches_the_header.py`).

use std::marker::PhantomData;
use std::ops::Range;

use crate::error::SanitizerError;
use crate::ids::{Owner, PoolId};
use crate::sanitizer::Sanitizer;
use crate::violation::Verdict;

/// Calls `m!` with every layout of the list; see the [module
/// documentation](crate::layouts) for the entries.
#[macro_export]
macro_rules! for_each_batch_layout {
    ($m:ident) => {
        $m! {
            /// A padded block table (vLLM, FlashAttention): row `r` reads
            /// `seq_lens[r]` tokens through the entries from
            /// `block_table[r × stride]` on (page indices), one page per
            /// `page_slots` tokens.
            BlockTable = check_block_table, reads,
                export(kvsan_check_block_table, kvsan_check_block_table_device) (
                /// Page indices, rows of `stride` entries.
                block_table: [i32; table_len],
                /// Entries per row.
                stride: usize,
                /// Tokens each row reads.
                seq_lens: [i32; rows],
            );

            /// Pages in CSR form (FlashInfer): row `r` reads the pages
            /// `indices[indptr[r]..indptr[r + 1]]`, all full but the last,
            /// which holds `last_page_len[r]` tokens.
            PagedCsr = check_paged_csr, reads,
                export(kvsan_check_paged_csr, kvsan_check_paged_csr_device) (
                /// `rows + 1` offsets into `indices`.
                indptr: [i32; offsets],
                /// Page indices.
                indices: [i32; nnz],
                /// Per row: tokens in its last page.
                last_page_len: [i32; rows],
            );

            /// A token-level table (SGLang): row `r` reads `seq_lens[r]`
            /// tokens at the locations (page × page_slots + slot)
            /// `req_to_token[req_indices[r] × stride ..]`.
            ReqToToken = check_req_to_token, reads,
                export(kvsan_check_req_to_token, kvsan_check_req_to_token_device) (
                /// Locations, rows of `stride` per request slot.
                req_to_token: [i32; table_len],
                /// Locations per request slot.
                stride: usize,
                /// Per row: its request slot.
                req_indices: [i32; rows],
                /// Tokens each row reads.
                seq_lens: [i32; rows],
            );

            /// A store kernel's slots (vLLM's `reshape_and_cache`): the
            /// tokens `query_start_loc[r]..[r + 1]` are row `r`'s; token
            /// `t` stores at location `slot_mapping[t]` (page × page_slots
            /// + slot; −1: padding, not stored). Each slot stored is
            /// checked as a write and recorded written.
            SlotMapping = check_slot_mapping, stores,
                export(kvsan_check_slot_mapping, kvsan_check_slot_mapping_device) (
                /// `rows + 1` offsets into `slot_mapping`.
                query_start_loc: [i32; offsets],
                /// Per token: its location, or −1.
                slot_mapping: [i64; tokens],
            );
        }
    };
}

/// How a [`Batch`] holds its buffers of `int32_t` and of `int64_t`.
pub trait Buffers {
    /// A buffer of `int32_t`.
    type I32: std::fmt::Debug;
    /// A buffer of `int64_t`.
    type I64: std::fmt::Debug;
}

/// Buffers in host memory, as slices.
#[derive(Debug)]
pub struct Host<'a>(PhantomData<&'a ()>);

impl<'a> Buffers for Host<'a> {
    type I32 = &'a [i32];
    type I64 = &'a [i64];
}

/// Buffers in host memory, owned (copies of device buffers).
#[derive(Debug)]
pub struct Owned;

impl Buffers for Owned {
    type I32 = Vec<i32>;
    type I64 = Vec<i64>;
}

/// A device buffer: its device address (a `CUdeviceptr`) and length in
/// values.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct DeviceArray {
    /// The device address.
    pub address: u64,
    /// Values (not bytes).
    pub len: usize,
}

/// Buffers in device memory, as addresses (what a C function over device
/// buffers is given).
#[derive(Debug)]
pub struct Addresses;

impl Buffers for Addresses {
    type I32 = DeviceArray;
    type I64 = DeviceArray;
}

impl Batch<Addresses> {
    /// Each buffer: its name, address, length in values and value size.
    #[must_use]
    pub fn device_arrays(&self) -> Vec<(&'static str, DeviceArray, usize)> {
        struct Collect(Vec<(&'static str, DeviceArray, usize)>);
        impl MapBuffers<'_, Addresses, ()> for Collect {
            type Error = std::convert::Infallible;
            fn i32(&mut self, array: Array, from: &DeviceArray) -> Result<(), Self::Error> {
                self.0.push((array.name, *from, 4));
                Ok(())
            }
            fn i64(&mut self, array: Array, from: &DeviceArray) -> Result<(), Self::Error> {
                self.0.push((array.name, *from, 8));
                Ok(())
            }
        }
        let mut collect = Collect(Vec::new());
        let Ok(_) = self.try_map(&mut collect);
        collect.0
    }
}

/// No buffers: a layout's scalars only (what a [`MapBuffers`] that only
/// looks at each buffer maps to).
impl Buffers for () {
    type I32 = ();
    type I64 = ();
}

impl Batch<Owned> {
    /// The copies as slices.
    #[must_use]
    pub fn as_host(&self) -> Batch<Host<'_>> {
        struct AsSlices;
        impl<'a> MapBuffers<'a, Owned, Host<'a>> for AsSlices {
            type Error = std::convert::Infallible;
            fn i32(&mut self, _: Array, from: &'a Vec<i32>) -> Result<&'a [i32], Self::Error> {
                Ok(from)
            }
            fn i64(&mut self, _: Array, from: &'a Vec<i64>) -> Result<&'a [i64], Self::Error> {
                Ok(from)
            }
        }
        let Ok(host) = self.try_map(&mut AsSlices);
        host
    }
}

/// How long a buffer of the list is.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Extent {
    /// One value per row.
    Rows,
    /// One value per row and one more (offsets).
    Offsets,
    /// Its own length, the C argument of this name right after it.
    Own(&'static str),
}

impl Extent {
    /// The values a buffer of this extent holds for `rows` rows; `own` for
    /// [`Extent::Own`].
    #[must_use]
    pub fn len(self, rows: usize, own: usize) -> usize {
        match self {
            Extent::Rows => rows,
            Extent::Offsets => rows.saturating_add(1),
            Extent::Own(_) => own,
        }
    }
}

/// One buffer of a layout: its C argument name and length.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Array {
    /// The C argument.
    pub name: &'static str,
    /// How long it is.
    pub extent: Extent,
}

/// One argument of a layout, in list (and C) order.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Param {
    /// A buffer of `int32_t` or `int64_t` (`value`: `int32_t` or
    /// `int64_t`).
    Array {
        /// The buffer.
        array: Array,
        /// Its C value type.
        value: &'static str,
    },
    /// A `size_t`.
    Scalar(&'static str),
}

/// Converts each buffer of a [`Batch`] (borrowed for `'a`) from one
/// holding to another ([`Batch::try_map`]): C pointers to slices, device
/// addresses to views, device buffers to host copies.
pub trait MapBuffers<'a, K: Buffers, L: Buffers> {
    /// Why a buffer cannot be converted.
    type Error;
    /// A buffer of `int32_t`.
    ///
    /// # Errors
    /// As the conversion says.
    fn i32(&mut self, array: Array, from: &'a K::I32) -> Result<L::I32, Self::Error>;
    /// A buffer of `int64_t`.
    ///
    /// # Errors
    /// As the conversion says.
    fn i64(&mut self, array: Array, from: &'a K::I64) -> Result<L::I64, Self::Error>;
}

#[doc(hidden)]
#[macro_export]
macro_rules! __batch_field_type {
    ($k:ident, [i32; $n:ident]) => {
        <$k as $crate::layouts::Buffers>::I32
    };
    ($k:ident, [i64; $n:ident]) => {
        <$k as $crate::layouts::Buffers>::I64
    };
    ($k:ident, usize) => {
        usize
    };
}

#[doc(hidden)]
#[macro_export]
macro_rules! __batch_extent {
    (rows) => {
        $crate::layouts::Extent::Rows
    };
    (offsets) => {
        $crate::layouts::Extent::Offsets
    };
    ($own:ident) => {
        $crate::layouts::Extent::Own(stringify!($own))
    };
}

#[doc(hidden)]
#[macro_export]
macro_rules! __batch_param {
    ($field:ident, [$v:ident; $n:ident]) => {
        $crate::layouts::Param::Array {
            array: $crate::layouts::Array {
                name: stringify!($field),
                extent: $crate::__batch_extent!($n),
            },
            value: $crate::__batch_c_value!($v),
        }
    };
    ($field:ident, usize) => {
        $crate::layouts::Param::Scalar(stringify!($field))
    };
}

#[doc(hidden)]
#[macro_export]
macro_rules! __batch_c_value {
    (i32) => {
        "int32_t"
    };
    (i64) => {
        "int64_t"
    };
}

#[doc(hidden)]
#[macro_export]
macro_rules! __batch_map_field {
    ($f:ident, $field:ident, [$v:ident; $n:ident]) => {
        $f.$v(
            $crate::layouts::Array {
                name: stringify!($field),
                extent: $crate::__batch_extent!($n),
            },
            $field,
        )?
    };
    ($f:ident, $field:ident, usize) => {
        *$field
    };
}

macro_rules! define_layouts {
    ($(
        $(#[$doc:meta])*
        $variant:ident = $name:ident, $access:ident, export($host:ident, $device:ident) (
            $($(#[$fdoc:meta])* $field:ident: $spec:tt),* $(,)?
        );
    )*) => {
        /// A batch layout of the list ([`for_each_batch_layout!`]).
        #[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
        pub enum BatchLayout {
            $($(#[$doc])* $variant,)*
        }

        impl BatchLayout {
            /// Every layout, in list order.
            pub const ALL: &'static [BatchLayout] = &[$(BatchLayout::$variant),*];

            /// The layout's host check: the [`Sanitizer`] method, and
            /// without `kvsan_` and `_device` its C functions
            /// (`check_block_table`, …).
            #[must_use]
            pub const fn check(self) -> &'static str {
                match self { $(BatchLayout::$variant => stringify!($name),)* }
            }

            /// Whether the kernel stores KV (checked as writes, recorded
            /// written) rather than reads it.
            #[must_use]
            pub const fn stores(self) -> bool {
                match self { $(BatchLayout::$variant => stores!($access),)* }
            }

            /// The host C function and the device one.
            #[must_use]
            pub const fn exports(self) -> (&'static str, &'static str) {
                match self {
                    $(BatchLayout::$variant => (stringify!($host), stringify!($device)),)*
                }
            }

            /// The layout's own arguments, in C order (after `rows`, before
            /// `layers`; an [`Extent::Own`] buffer's length follows it).
            #[must_use]
            pub fn params(self) -> &'static [Param] {
                match self {
                    $(BatchLayout::$variant => &[$($crate::__batch_param!($field, $spec)),*],)*
                }
            }
        }

        /// A layout's buffers, held as `K` says ([`Host`] slices, a C
        /// function's pointers, device addresses or views).
        pub enum Batch<K: Buffers> {
            $(
                $(#[$doc])*
                $variant {
                    $($(#[$fdoc])* $field: $crate::__batch_field_type!(K, $spec),)*
                },
            )*
        }

        impl<K: Buffers> std::fmt::Debug for Batch<K> {
            fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
                match self {
                    $(Batch::$variant { $($field),* } => f
                        .debug_struct(stringify!($variant))
                        $(.field(stringify!($field), $field))*
                        .finish(),)*
                }
            }
        }

        impl<K: Buffers> Batch<K> {
            /// The layout.
            #[must_use]
            pub fn layout(&self) -> BatchLayout {
                match self { $(Batch::$variant { .. } => BatchLayout::$variant,)* }
            }

            /// The same buffers held as `L`: each converted by `f`, in list
            /// order; scalars copied.
            ///
            /// # Errors
            /// The first buffer `f` does not convert.
            pub fn try_map<'a, L: Buffers, M: MapBuffers<'a, K, L>>(
                &'a self,
                f: &mut M,
            ) -> Result<Batch<L>, M::Error> {
                Ok(match self {
                    $(Batch::$variant { $($field),* } => Batch::$variant {
                        $($field: $crate::__batch_map_field!(f, $field, $spec),)*
                    },)*
                })
            }
        }

        impl Sanitizer {
            /// The host check of `batch`'s layout: one verdict per row of
            /// `owners` (see the layouts' own checks,
            /// [`Sanitizer::check_block_table`] and the others).
            ///
            /// # Errors
            /// As the layout's check.
            pub fn check_batch(
                &self,
                pool: PoolId,
                owners: &[Owner],
                batch: &Batch<Host<'_>>,
                layers: Range<u32>,
                step: u64,
            ) -> Result<Vec<Verdict>, SanitizerError> {
                match batch {
                    $(Batch::$variant { $($field),* } => {
                        self.$name(pool, owners, $(*$field,)* layers, step)
                    })*
                }
            }
        }
    };
}

macro_rules! stores {
    (stores) => {
        true
    };
    (reads) => {
        false
    };
}

for_each_batch_layout!(define_layouts);
