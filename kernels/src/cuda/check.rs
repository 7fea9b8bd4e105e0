//! The standalone check kernels (`check.cu`): the buffers an engine hands
//! its own attention or store kernel — FlashAttention's block table,
//! FlashInfer's paged CSR, SGLang's `req_to_token`, vLLM's `slot_mapping` —
//! checked where they lie on the device, against the device kernel shadow,
//! just before the engine launches its kernel. The host side here checks
//! the buffers' lengths (never their contents: those the kernel reads) and
//! decodes the per-row records the kernels write into [`EngineRefusal`]s.
//!
//! The same rules as the sanitizer's host-side batch checks
//! (`Sanitizer::check_block_table` and its neighbours): a row's entries are
//! read where the engine's kernel reads them (past a row's stride is the
//! next row's entry), each page at the generation its record holds now, and
//! a row whose buffers the engine's kernel could not use at all (an entry
//! past its buffer, a page outside the pool, a negative length) is reported
//! as such before any of its pages is checked. Two differences, both of
//! what the device can see: a shared page read by a request that is not its
//! holding owner comes back as [`EngineFinding::Arbitrate`] (the sharer
//! table is the host's), and a reader that has itself ended is caught only
//! on the pages it owns (`terminal-request-activity`: the device has the
//! pages' records, not the requests').

use std::convert::Infallible;
use std::marker::PhantomData;
use std::mem::ManuallyDrop;
use std::ops::Range;
use std::sync::Arc;

use cudarc::driver::{CudaFunction, CudaSlice, CudaStream, CudaView, LaunchConfig, PushKernelArg};
use kvsan_ids::{Generation, PageId, PageRef};
use kvsan_sanitizer::ViolationKind;
use kvsan_sanitizer::layouts::{Array, Batch, BatchLayout, Buffers, Extent, MapBuffers};

use super::error::CudaError;
use super::shadow::CudaKernelShadow;
use super::source::{
    CHECK_BLOCK_TABLE_KERNEL, CHECK_LANES, CHECK_PAGED_CSR_KERNEL, CHECK_REQ_TO_TOKEN_KERNEL,
    CHECK_SLOT_MAPPING_KERNEL, CHECK_THREADS, REFUSAL_WORDS, REFUSED_ARBITRATE, REFUSED_BAD_INPUT,
    REFUSED_FOREIGN_READ, REFUSED_FOREIGN_WRITE, REFUSED_GENERATION_MISMATCH, REFUSED_NONE,
    REFUSED_OUTSIDE_POOL, REFUSED_OUTSIDE_TABLE, REFUSED_READ_DURING_TRANSFER,
    REFUSED_READ_FREE_PAGE, REFUSED_STALE_READ, REFUSED_TERMINAL, REFUSED_WRITE_AFTER_FREE,
};

/// What the device words hold for "none" (`KVSAN_NONE`).
const NONE: u32 = u32::MAX;

/// Most blocks of one check launch (rows beyond are taken grid-stride).
const CHECK_BLOCKS: u64 = 1024;

/// How an [`EngineBatch`] holds its buffers: views of the engine's own
/// device allocations (a raw device pointer becomes one with cudarc's
/// `CudaStream::upgrade_device_ptr`).
#[derive(Debug)]
pub struct Views<'a>(PhantomData<&'a ()>);

impl<'a> Buffers for Views<'a> {
    type I32 = CudaView<'a, i32>;
    type I64 = CudaView<'a, i64>;
}

/// An engine's kernel arguments, as device buffers: a layout of the
/// sanitizer's list (`kvsan_sanitizer::for_each_batch_layout!`, the same
/// buffers its host checks take). Row `r` belongs to `owners[r]` of
/// [`super::CudaKernels::check_engine_batch`].
///
/// The rules, as the sanitizer's host-side batch checks have them: a row's
/// entries are read where the engine's kernel reads them (past a row's
/// stride is the next row's entry); each page is taken at the generation
/// its shadow record holds now (the buffers carry no generations), so a
/// stale or reused buffer shows as `foreign-read` or `read-free-page`; a
/// row whose buffers no kernel could use is reported as such
/// ([`EngineFinding::OutsideBuffer`], [`EngineFinding::OutsidePool`],
/// [`EngineFinding::BadInput`]) before any of its pages is checked.
pub type EngineBatch<'a> = Batch<Views<'a>>;

/// How a batch's buffers are held between the engine's device addresses
/// and the check: cudarc slices over the engine's own allocations, never
/// freed by kvsan ([`super::CudaKernels::borrow_batch`]).
#[derive(Debug)]
pub struct Borrowed;

impl Buffers for Borrowed {
    type I32 = ManuallyDrop<CudaSlice<i32>>;
    type I64 = ManuallyDrop<CudaSlice<i64>>;
}

/// The [`Borrowed`] buffers of `batch` as the check kernel's views.
#[must_use]
pub fn views(batch: &Batch<Borrowed>) -> EngineBatch<'_> {
    struct AsViews;
    impl<'a> MapBuffers<'a, Borrowed, Views<'a>> for AsViews {
        type Error = Infallible;
        fn i32(
            &mut self,
            _: Array,
            from: &'a ManuallyDrop<CudaSlice<i32>>,
        ) -> Result<CudaView<'a, i32>, Infallible> {
            Ok(from.as_view())
        }
        fn i64(
            &mut self,
            _: Array,
            from: &'a ManuallyDrop<CudaSlice<i64>>,
        ) -> Result<CudaView<'a, i64>, Infallible> {
            Ok(from.as_view())
        }
    }
    let Ok(views) = batch.try_map(&mut AsViews);
    views
}

/// The kernel that checks `layout`.
#[must_use]
pub fn check_kernel(layout: BatchLayout) -> &'static str {
    match layout {
        BatchLayout::BlockTable => CHECK_BLOCK_TABLE_KERNEL,
        BatchLayout::PagedCsr => CHECK_PAGED_CSR_KERNEL,
        BatchLayout::ReqToToken => CHECK_REQ_TO_TOKEN_KERNEL,
        BatchLayout::SlotMapping => CHECK_SLOT_MAPPING_KERNEL,
    }
}

/// The per-row buffers of `batch` must have one entry per row (offsets:
/// one more).
pub(super) fn check_rows(batch: &EngineBatch<'_>, rows: usize) -> Result<(), CudaError> {
    struct Lengths {
        rows: usize,
    }
    impl<'a> MapBuffers<'_, Views<'a>, ()> for Lengths {
        type Error = CudaError;
        fn i32(&mut self, array: Array, from: &CudaView<'a, i32>) -> Result<(), CudaError> {
            self.check(array, from.len())
        }
        fn i64(&mut self, array: Array, from: &CudaView<'a, i64>) -> Result<(), CudaError> {
            self.check(array, from.len())
        }
    }
    impl Lengths {
        fn check(&self, array: Array, len: usize) -> Result<(), CudaError> {
            if matches!(array.extent, Extent::Own(_)) {
                return Ok(());
            }
            let expected = array.extent.len(self.rows, len);
            if len == expected {
                Ok(())
            } else {
                Err(CudaError::Length {
                    what: array.name,
                    len,
                    expected,
                })
            }
        }
    }
    batch.try_map(&mut Lengths { rows }).map(|_| ())
}

/// What a check kernel found in one row.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum EngineFinding {
    /// An entry (index: the row's entry, or the token) past the end of its
    /// buffer: the engine's kernel would read outside it.
    OutsideBuffer,
    /// A page index outside the pool (`page`: the index, truncated to 32
    /// bits), as an entry or a location's page.
    OutsidePool {
        /// The page index.
        page: u32,
    },
    /// A value the engine's kernel could not use: a negative length or
    /// location (other than a store's −1), offsets that go backwards, a
    /// last page length outside `1..=page_slots`.
    BadInput,
    /// A checked access refused by the device shadow, with its kind.
    Refused(ViolationKind),
    /// A shared page read by a request that is not its holding owner: only
    /// the host's sharer table can say (`Check::Arbitrate`).
    Arbitrate,
}

/// A refused row of a check launch.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct EngineRefusal {
    /// The row.
    pub row: usize,
    /// What was found.
    pub finding: EngineFinding,
    /// Block table and CSR: the row's entry; token table and store slots:
    /// the token. `None` for a length or offsets.
    pub index: Option<u32>,
    /// The page of a checked access, at the generation its record held.
    pub page: Option<PageRef>,
    /// A stale read: the first slot not written; a token's read or a
    /// store: its slot.
    pub slot: Option<u32>,
    /// The layer of a refused read.
    pub layer: Option<u32>,
}

impl EngineRefusal {
    /// The violation kind of a refused check, if it was one.
    #[must_use]
    pub fn kind(&self) -> Option<ViolationKind> {
        match self.finding {
            EngineFinding::Refused(kind) => Some(kind),
            _ => None,
        }
    }
}

/// Whether a store check with `record` set may now mark its slots written:
/// only when no row's buffers were unusable. Like the host's
/// `check_slot_mapping`, a batch the store kernel could not run records
/// nothing — and the device cannot see every row before it records one, so
/// a recording check is launched twice: first to look (`record` off), then,
/// if this says so, to record.
#[must_use]
pub fn may_record(first_pass: &[EngineRefusal]) -> bool {
    !first_pass.iter().any(|r| {
        matches!(
            r.finding,
            EngineFinding::OutsideBuffer
                | EngineFinding::OutsidePool { .. }
                | EngineFinding::BadInput
        )
    })
}

fn some(word: u32) -> Option<u32> {
    (word != NONE).then_some(word)
}

/// Decodes the records of a check launch over `layout`: one
/// [`EngineRefusal`] per refused row, by row.
///
/// # Errors
/// [`CudaError::CorruptRefusal`] for a code the layout's kernel does not
/// write.
pub fn decode_engine_refusals(
    records: &[u32],
    layout: BatchLayout,
) -> Result<Vec<EngineRefusal>, CudaError> {
    let mut out = Vec::new();
    let (records, _) = records.as_chunks::<REFUSAL_WORDS>();
    for (row, &[code, index, page, generation, _current, slot, _slots, layer]) in
        records.iter().enumerate()
    {
        if code == REFUSED_NONE {
            continue;
        }
        let refused = |kind| EngineFinding::Refused(kind);
        let finding = match (layout.stores(), code) {
            (_, REFUSED_OUTSIDE_TABLE) => EngineFinding::OutsideBuffer,
            (_, REFUSED_OUTSIDE_POOL) => EngineFinding::OutsidePool { page },
            (_, REFUSED_BAD_INPUT) => EngineFinding::BadInput,
            (_, REFUSED_GENERATION_MISMATCH) => refused(ViolationKind::GenerationMismatch),
            (_, REFUSED_TERMINAL) => refused(ViolationKind::TerminalRequestActivity),
            (false, REFUSED_READ_FREE_PAGE) => refused(ViolationKind::ReadFreePage),
            (false, REFUSED_READ_DURING_TRANSFER) => refused(ViolationKind::ReadDuringTransfer),
            (false, REFUSED_FOREIGN_READ) => refused(ViolationKind::ForeignRead),
            (false, REFUSED_STALE_READ) => refused(ViolationKind::StaleRead),
            (false, REFUSED_ARBITRATE) => EngineFinding::Arbitrate,
            (true, REFUSED_WRITE_AFTER_FREE) => refused(ViolationKind::WriteAfterFree),
            (true, REFUSED_FOREIGN_WRITE) => refused(ViolationKind::ForeignWrite),
            _ => {
                return Err(CudaError::CorruptRefusal {
                    kernel: check_kernel(layout),
                    row,
                    code,
                });
            }
        };
        let checked = matches!(
            finding,
            EngineFinding::Refused(_) | EngineFinding::Arbitrate
        );
        out.push(EngineRefusal {
            row,
            finding,
            index: some(index),
            page: checked.then_some(PageRef {
                page: PageId(page),
                generation: Generation(generation),
            }),
            slot: some(slot),
            layer: some(layer),
        });
    }
    Ok(out)
}

/// One check launch's arguments, checked by the caller.
pub(super) struct CheckLaunch<'a, 'b> {
    pub func: &'a CudaFunction,
    /// Mark the slots let through written (store slots only).
    pub record: bool,
    pub shadow: &'a mut CudaKernelShadow,
    pub owners: &'a CudaSlice<u64>,
    pub rows: u32,
    pub layers: Range<u32>,
    pub batch: &'a EngineBatch<'b>,
}

/// Launches the check kernel of `args.batch`'s layout, writing one record
/// per row into `refusals`.
///
/// # Safety
/// `args.rows` ≥ 1 and every per-row buffer has its rows
/// ([`check_rows`]); `owners` holds `rows` words and
/// `refusals` `REFUSAL_WORDS × rows` zeroed ones (the read checks' scratch,
/// one first-refusal word and one lane count per row, is allocated here,
/// zeroed); the layers are inside the
/// shadow's layout; every buffer lives on the shadow's context.
pub(super) unsafe fn launch_check(
    stream: &Arc<CudaStream>,
    args: CheckLaunch<'_, '_>,
    refusals: &mut CudaSlice<u32>,
) -> Result<(), CudaError> {
    // The read checks give each row CHECK_LANES threads, the store check one.
    let lanes = if args.batch.layout().stores() {
        1
    } else {
        u64::from(CHECK_LANES)
    };
    let blocks = (u64::from(args.rows) * lanes)
        .div_ceil(u64::from(CHECK_THREADS))
        .clamp(1, CHECK_BLOCKS);
    // The read checks' per-row scratch: each row's first refusal as its
    // lanes offer it, and the lanes arrived (both zeroed).
    let scratch = |what| CudaError::driver(what);
    let (firsts, arrived) = if args.batch.layout().stores() {
        (None, None)
    } else {
        let rows = args.rows as usize;
        (
            Some(
                stream
                    .alloc_zeros::<u64>(rows)
                    .map_err(scratch("allocate the check's first refusals"))?,
            ),
            Some(
                stream
                    .alloc_zeros::<u32>(rows)
                    .map_err(scratch("allocate the check's lane counts"))?,
            ),
        )
    };
    let config = LaunchConfig {
        grid_dim: (u32::try_from(blocks).unwrap_or(1), 1, 1),
        block_dim: (CHECK_THREADS, 1, 1),
        shared_mem_bytes: 0,
    };
    let shadow = args.shadow;
    let n_pages = u32::try_from(shadow.pages).map_err(|_| CudaError::TooLarge {
        what: "pages in a device kernel shadow",
        value: shadow.pages,
        limit: u32::MAX as usize,
    })?;
    let page_slots = shadow.layout.page_slots;
    let stride = u32::try_from(shadow.layout.stride).map_err(|_| CudaError::TooLarge {
        what: "written words per page",
        value: shadow.layout.stride,
        limit: u32::MAX as usize,
    })?;
    let (layer_lo, layer_hi) = (args.layers.start, args.layers.end);
    let mut launch = stream.launch_builder(args.func);
    launch
        .arg(&shadow.records)
        .arg(&mut shadow.bits)
        .arg(&n_pages)
        .arg(&page_slots)
        .arg(&stride)
        .arg(&layer_lo)
        .arg(&layer_hi)
        .arg(args.owners)
        .arg(&args.rows);
    // The layout's scalars: its table's entries, entries per row, record.
    let (entries, row_stride, record): (u64, u64, u32) = match args.batch {
        EngineBatch::BlockTable {
            block_table,
            stride,
            ..
        } => (block_table.len() as u64, *stride as u64, 0),
        EngineBatch::PagedCsr { indices, .. } => (indices.len() as u64, 0, 0),
        EngineBatch::ReqToToken {
            req_to_token,
            stride,
            ..
        } => (req_to_token.len() as u64, *stride as u64, 0),
        EngineBatch::SlotMapping { slot_mapping, .. } => {
            (slot_mapping.len() as u64, 0, u32::from(args.record))
        }
    };
    match args.batch {
        EngineBatch::BlockTable {
            block_table,
            seq_lens,
            ..
        } => launch
            .arg(block_table)
            .arg(&entries)
            .arg(&row_stride)
            .arg(seq_lens),
        EngineBatch::PagedCsr {
            indptr,
            indices,
            last_page_len,
        } => launch
            .arg(indptr)
            .arg(indices)
            .arg(&entries)
            .arg(last_page_len),
        EngineBatch::ReqToToken {
            req_to_token,
            req_indices,
            seq_lens,
            ..
        } => launch
            .arg(req_to_token)
            .arg(&entries)
            .arg(&row_stride)
            .arg(req_indices)
            .arg(seq_lens),
        EngineBatch::SlotMapping {
            query_start_loc,
            slot_mapping,
            ..
        } => launch
            .arg(query_start_loc)
            .arg(slot_mapping)
            .arg(&entries)
            .arg(&record),
    };
    if let (Some(firsts), Some(arrived)) = (&firsts, &arrived) {
        launch.arg(firsts).arg(arrived);
    }
    launch.arg(refusals);
    // SAFETY: the argument list matches the layout's kernel in check.cu in
    // order and type (buffers as device pointers, u32/u64 scalars by
    // value); the caller guarantees the lengths the kernel relies on (see
    // this function's contract); the kernel reads the engine's buffers
    // only below the lengths passed with them, and shadow words only for
    // pages below n_pages and layers below the shadow's.
    unsafe { launch.launch(config) }
        .map(|_| ())
        .map_err(CudaError::driver("launch a check kernel"))
}

#[cfg(test)]
mod tests {
    use super::*;

    fn record(words: [u32; REFUSAL_WORDS]) -> Vec<u32> {
        let mut all = vec![0; REFUSAL_WORDS];
        all.extend(words);
        all
    }

    #[test]
    fn a_refused_read_decodes_with_its_page_slot_and_layer() {
        let got = decode_engine_refusals(
            &record([REFUSED_STALE_READ, 2, 5, 9, 9, 3, 16, 1]),
            BatchLayout::BlockTable,
        )
        .expect("decodes");
        assert_eq!(
            got,
            vec![EngineRefusal {
                row: 1,
                finding: EngineFinding::Refused(ViolationKind::StaleRead),
                index: Some(2),
                page: Some(PageRef::new(5, 9)),
                slot: Some(3),
                layer: Some(1),
            }]
        );
    }

    #[test]
    fn bounds_carry_no_page_and_reads_codes_are_refused_for_stores() {
        let outside = decode_engine_refusals(
            &record([REFUSED_OUTSIDE_POOL, 4, 77, NONE, NONE, NONE, NONE, NONE]),
            BatchLayout::SlotMapping,
        )
        .expect("decodes");
        assert_eq!(outside[0].finding, EngineFinding::OutsidePool { page: 77 });
        assert_eq!((outside[0].page, outside[0].layer), (None, None));
        let err = decode_engine_refusals(
            &record([REFUSED_STALE_READ, 0, 0, 0, 0, 0, 1, NONE]),
            BatchLayout::SlotMapping,
        )
        .expect_err("a store check never reports a stale read");
        assert!(matches!(err, CudaError::CorruptRefusal { row: 1, .. }));
    }
}
