//! The host side of the batch kernels: what a launch checks against
//! ([`ReadCheck`], [`StoreCheck`]), the arrays it uploads — built from a
//! [`KvBatch`] and checked first — and the per-row refusal records the
//! kernels write, decoded back into [`CudaRefusal`]s.
//!
//! A refusal comes back as the CPU kernels' guards keep it, a
//! [`Refusal`] (row, access, `PageRef`, reason), with what the device check
//! said next to it:
//!
//! ```text
//!  device code                 Refusal.reason              CudaRefusal.check
//!  entry outside the array     Outside { pages }           None      (page: PageRef::default())
//!  page/slot outside the pool  Outside { pages }           None
//!  generations mode mismatch   Generation { current }      Refused(generation-mismatch)
//!  shadow mode, a failed check Checked                     Refused(kind), kind as
//!                                                          KernelShadow::check_read / store
//!  shadow mode, shared page    Checked                     Arbitrate (the host decides)
//! ```

use kvsan_ids::{Generation, PageRef, RequestId};
use kvsan_sanitizer::{Check, ViolationKind};

use super::error::CudaError;
use super::shadow::CudaKernelShadow;
use super::source::{
    MODE_GENERATIONS, MODE_SHADOW, REFUSAL_WORDS, REFUSED_ARBITRATE, REFUSED_FOREIGN_READ,
    REFUSED_FOREIGN_WRITE, REFUSED_GENERATION_MISMATCH, REFUSED_NONE, REFUSED_OUTSIDE_POOL,
    REFUSED_OUTSIDE_TABLE, REFUSED_READ_DURING_TRANSFER, REFUSED_READ_FREE_PAGE,
    REFUSED_STALE_READ, REFUSED_TERMINAL, REFUSED_WRITE_AFTER_FREE,
};
use crate::attention::KvBatch;
use crate::error::KernelError;
use crate::guard::{Access, Reason, Refusal, RowLedger};

/// Most rows of one launch (the grid's x dimension).
pub(crate) const MAX_ROWS: usize = i32::MAX as usize;

/// Most blocks per row of the store kernel (each takes every n-th token).
const MAX_TOKEN_BLOCKS: usize = 256;

/// What the decode kernel checks before it reads any byte of a page.
#[derive(Clone, Copy, Debug)]
pub enum ReadCheck<'a> {
    /// The bounds only (a release build): an entry outside the block-table
    /// array or a page outside the pool is refused, anything else is read.
    Bounds,
    /// And each `PageRef`'s generation against the pool's generation array
    /// (the CPU kernels' [`crate::GenerationChecked`]).
    Generations,
    /// And the device copy of the sanitizer's kernel shadow, for each row's
    /// owner, as [`kvsan_sanitizer::KernelShadow::check_read`] decides.
    Shadow {
        /// The device shadow (of the pool's geometry).
        shadow: &'a CudaKernelShadow,
        /// Per row: the request whose row it is.
        owners: &'a [RequestId],
    },
}

/// What the store kernel checks before it writes a token's K and V.
#[derive(Debug)]
pub enum StoreCheck<'a> {
    /// The bounds only: a page or slot outside the pool is refused.
    Bounds,
    /// And each store slot's generation against the pool's generation array.
    Generations,
    /// And the device shadow, as [`kvsan_sanitizer::KernelShadow::store`]
    /// decides; each store made sets its written bit in the device shadow
    /// (bring them back with [`CudaKernelShadow::download_written`]).
    Shadow {
        /// The device shadow (of the pool's geometry).
        shadow: &'a mut CudaKernelShadow,
        /// Per row: the request whose row it is.
        owners: &'a [RequestId],
    },
}

/// One row's refused access on the device: the [`Refusal`] the CPU
/// kernels' guard would keep for it, and what the device check said (see
/// the module doc for the mapping).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct CudaRefusal {
    /// Row, access, `PageRef` and reason, as the CPU guards record them.
    pub refusal: Refusal,
    /// The check's answer: [`Check::Refused`] with the violation kind the
    /// fast path saw, or [`Check::Arbitrate`] (a shared page read by a
    /// request that is not its holding owner: only the host's sharer table
    /// can say; the row was not read). `None` for a bounds refusal.
    pub check: Option<Check>,
    /// The page's generation in what was checked (the pool's generation
    /// array or the device shadow); `None` for a bounds refusal.
    pub current: Option<Generation>,
    /// For a `stale-read`: the first slot of the read not written for the layer.
    pub first_unwritten: Option<u32>,
}

impl CudaRefusal {
    /// The violation kind of a refused check; `None` for a bounds refusal or
    /// one left to the host's arbitration.
    #[must_use]
    pub fn kind(&self) -> Option<ViolationKind> {
        match self.check {
            Some(Check::Refused(kind)) => Some(kind),
            _ => None,
        }
    }
}

/// What the decode kernel returns.
#[derive(Clone, Debug, Default, PartialEq)]
pub struct DecodeOutput {
    /// `rows × n_heads × head_dim` values, row-major; zero for a refused
    /// row and for a row the ledger had stopped.
    pub out: Vec<f32>,
    /// The refusals of this launch, by row (each also given to the ledger).
    pub refusals: Vec<CudaRefusal>,
}

fn shape(what: String) -> CudaError {
    CudaError::Kernel(KernelError::BatchShape { what })
}

fn to_u32(what: &'static str, value: usize) -> Result<u32, CudaError> {
    u32::try_from(value).map_err(|_| CudaError::TooLarge {
        what,
        value,
        limit: u32::MAX as usize,
    })
}

/// The shape checks of the CPU kernels ([`KvBatch::validate`]), and a row
/// count one launch can take.
fn check_batch(batch: &KvBatch<'_>) -> Result<(), CudaError> {
    let rows = batch.rows();
    if rows.checked_mul(batch.width).is_none() {
        return Err(shape(format!(
            "{rows} rows × width {} entries overflow",
            batch.width
        )));
    }
    batch.validate()?;
    if rows > MAX_ROWS {
        return Err(CudaError::TooLarge {
            what: "rows in one launch",
            value: rows,
            limit: MAX_ROWS,
        });
    }
    Ok(())
}

/// Per row: 1 if it still runs, 0 if the ledger has stopped it.
fn row_live(rows: usize, ledger: &RowLedger) -> Vec<u32> {
    (0..rows).map(|r| u32::from(ledger.live(r))).collect()
}

/// A device buffer may not be empty: one word of padding where it would be.
fn non_empty<T: Copy>(mut words: Vec<T>, pad: T) -> Vec<T> {
    if words.is_empty() {
        words.push(pad);
    }
    words
}

/// The decode kernel's arrays.
#[derive(Debug)]
pub(crate) struct DecodeArrays {
    /// Two words (page, generation) per entry; at least one word (a device
    /// buffer is never empty).
    pub block_tables: Vec<u32>,
    /// Entries in the block-table array (`rows × width`).
    pub n_entries: u64,
    /// Entries per row.
    pub width: u32,
    /// Per row.
    pub seq_lens: Vec<u32>,
    /// Per row: 1 to run, 0 stopped.
    pub row_live: Vec<u32>,
}

/// Checks a decode batch's shapes — the CPU kernels' rules, and one query
/// per row — and builds its arrays. The pages are not looked at: the
/// kernel checks each as it is about to read it.
pub(crate) fn decode_arrays(
    batch: &KvBatch<'_>,
    ledger: &RowLedger,
) -> Result<DecodeArrays, CudaError> {
    check_batch(batch)?;
    let rows = batch.rows();
    if let Some(r) = (0..rows).find(|&r| batch.queries(r).len() != 1) {
        return Err(shape(format!(
            "row {r} has {} new tokens; the decode kernel takes exactly one per row",
            batch.queries(r).len()
        )));
    }
    let width = to_u32("block-table width", batch.width)?;
    let mut block_tables = Vec::with_capacity(2 * batch.block_tables.len());
    for entry in batch.block_tables {
        block_tables.extend([entry.page.0, entry.generation.0]);
    }
    Ok(DecodeArrays {
        block_tables: non_empty(block_tables, 0),
        n_entries: batch.block_tables.len() as u64,
        width,
        seq_lens: batch.seq_lens.to_vec(),
        row_live: row_live(rows, ledger),
    })
}

/// The store kernel's arrays.
#[derive(Debug)]
pub(crate) struct StoreArrays {
    /// Three words (page, generation, slot) per token; at least one word.
    pub store_slots: Vec<u32>,
    /// `rows + 1` offsets.
    pub query_start: Vec<u32>,
    /// Per row: 1 to run, 0 stopped.
    pub row_live: Vec<u32>,
    /// Blocks per row: the most tokens of a row, at least 1, at most 256.
    pub token_blocks: u32,
}

/// Checks a batch's shapes (the CPU kernels' rules) and builds the store
/// kernel's arrays. The store slots are not looked at: the kernel checks
/// each as it is about to store.
pub(crate) fn store_arrays(
    batch: &KvBatch<'_>,
    ledger: &RowLedger,
) -> Result<StoreArrays, CudaError> {
    check_batch(batch)?;
    let rows = batch.rows();
    let mut store_slots = Vec::with_capacity(3 * batch.tokens());
    for s in batch.store_slots {
        store_slots.extend([s.page.page.0, s.page.generation.0, s.slot]);
    }
    let most = (0..rows).map(|r| batch.queries(r).len()).max().unwrap_or(0);
    Ok(StoreArrays {
        store_slots: non_empty(store_slots, u32::MAX),
        query_start: batch.query_start.to_vec(),
        row_live: row_live(rows, ledger),
        token_blocks: most.clamp(1, MAX_TOKEN_BLOCKS) as u32,
    })
}

/// Which kernel wrote a set of refusal records.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) enum Op {
    /// The decode kernel (reads).
    Read,
    /// The store kernel.
    Store,
}

impl Op {
    fn kernel(self) -> &'static str {
        match self {
            Op::Read => "kvsan_paged_attention_decode",
            Op::Store => "kvsan_store_kv",
        }
    }
}

/// Decodes the refusal records of a launch in `mode` over a pool of
/// `n_pages` pages: one per refused row, by row.
pub(crate) fn decode_refusals(
    records: &[u32],
    op: Op,
    mode: u32,
    n_pages: usize,
) -> Result<Vec<CudaRefusal>, CudaError> {
    let mut refusals = Vec::new();
    let (records, _) = records.as_chunks::<REFUSAL_WORDS>();
    for (row, &[code, index, page, generation, current, slot, slots, layer]) in
        records.iter().enumerate()
    {
        if code == REFUSED_NONE {
            continue;
        }
        let corrupt = CudaError::CorruptRefusal {
            kernel: op.kernel(),
            row,
            code,
        };
        let access = match op {
            Op::Read => Access::Read {
                entry: index as usize,
                layer: layer as usize,
                slots: slots as usize,
            },
            Op::Store => Access::Store {
                token: index as usize,
                layer: layer as usize,
                slot: slot as usize,
            },
        };
        let outside = Reason::Outside { pages: n_pages };
        let kind = |kind: ViolationKind| Ok((Reason::Checked, Some(Check::Refused(kind))));
        let shadow = mode == MODE_SHADOW;
        let (reason, check) = match (op, code) {
            (Op::Read, REFUSED_OUTSIDE_TABLE) | (_, REFUSED_OUTSIDE_POOL) => Ok((outside, None)),
            (_, REFUSED_GENERATION_MISMATCH) if mode == MODE_GENERATIONS => Ok((
                Reason::Generation {
                    current: Generation(current),
                },
                Some(Check::Refused(ViolationKind::GenerationMismatch)),
            )),
            (_, REFUSED_GENERATION_MISMATCH) if shadow => kind(ViolationKind::GenerationMismatch),
            (_, REFUSED_TERMINAL) if shadow => kind(ViolationKind::TerminalRequestActivity),
            (Op::Read, REFUSED_READ_FREE_PAGE) if shadow => kind(ViolationKind::ReadFreePage),
            (Op::Read, REFUSED_READ_DURING_TRANSFER) if shadow => {
                kind(ViolationKind::ReadDuringTransfer)
            }
            (Op::Read, REFUSED_FOREIGN_READ) if shadow => kind(ViolationKind::ForeignRead),
            (Op::Read, REFUSED_ARBITRATE) if shadow => {
                Ok((Reason::Checked, Some(Check::Arbitrate)))
            }
            (Op::Read, REFUSED_STALE_READ) if shadow => kind(ViolationKind::StaleRead),
            (Op::Store, REFUSED_WRITE_AFTER_FREE) if shadow => kind(ViolationKind::WriteAfterFree),
            (Op::Store, REFUSED_FOREIGN_WRITE) if shadow => kind(ViolationKind::ForeignWrite),
            _ => Err(corrupt),
        }?;
        refusals.push(CudaRefusal {
            refusal: Refusal {
                row,
                access,
                page: PageRef::new(page, generation),
                reason,
            },
            check,
            current: check.map(|_| Generation(current)),
            first_unwritten: (code == REFUSED_STALE_READ).then_some(slot),
        });
    }
    Ok(refusals)
}

/// Gives each refusal to the ledger (which keeps a row's first).
pub(crate) fn refuse_all(ledger: &RowLedger, refusals: &[CudaRefusal]) {
    for r in refusals {
        ledger.refuse(r.refusal);
    }
}

/// Each row's owner as the kernels take it; `rows` of them.
pub(crate) fn owner_words(owners: &[RequestId], rows: usize) -> Result<Vec<u64>, CudaError> {
    if owners.len() != rows {
        return Err(CudaError::Length {
            what: "owners (one per batch row)",
            len: owners.len(),
            expected: rows,
        });
    }
    Ok(non_empty(owners.iter().map(|o| o.0).collect(), 0))
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::attention::StoreSlot;

    fn batch<'a>(
        tables: &'a [PageRef],
        width: usize,
        lens: &'a [u32],
        starts: &'a [u32],
        slots: &'a [StoreSlot],
    ) -> KvBatch<'a> {
        KvBatch {
            block_tables: tables,
            width,
            seq_lens: lens,
            query_start: starts,
            store_slots: slots,
        }
    }

    fn record(words: [u32; REFUSAL_WORDS]) -> Vec<u32> {
        let mut all = vec![0; REFUSAL_WORDS];
        all.extend(words);
        all
    }

    #[test]
    fn decode_arrays_flatten_the_tables_and_take_the_ledgers_stopped_rows() {
        let tables = [
            PageRef::new(3, 7),
            PageRef::new(4, 8),
            PageRef::new(9, 1),
            PageRef::new(2, 2),
        ];
        let slots = [StoreSlot::PADDING, StoreSlot::PADDING];
        let b = batch(&tables, 2, &[20, 5], &[0, 1, 2], &slots);
        let ledger = RowLedger::new(2);
        ledger.refuse(Refusal {
            row: 1,
            access: Access::Read {
                entry: 0,
                layer: 0,
                slots: 1,
            },
            page: PageRef::default(),
            reason: Reason::Checked,
        });
        let a = decode_arrays(&b, &ledger).expect("a decode batch");
        assert_eq!(a.block_tables, [3, 7, 4, 8, 9, 1, 2, 2]);
        assert_eq!((a.n_entries, a.width), (4, 2));
        assert_eq!(a.seq_lens, [20, 5]);
        assert_eq!(a.row_live, [1, 0]);
    }

    #[test]
    fn a_decode_batch_needs_one_query_per_row_and_fitting_arrays() {
        let tables = [PageRef::new(0, 1); 2];
        let slots = [StoreSlot::PADDING; 3];
        let ledger = RowLedger::new(2);
        let two = batch(&tables, 1, &[4, 4], &[0, 2, 3], &slots);
        match decode_arrays(&two, &ledger) {
            Err(CudaError::Kernel(KernelError::BatchShape { what })) => {
                assert!(what.contains("row 0 has 2 new tokens"), "{what}");
            }
            other => panic!("expected a batch shape error, got {other:?}"),
        }
        let short = batch(&tables, 3, &[4, 4], &[0, 1, 2], &slots[..2]);
        assert!(matches!(
            decode_arrays(&short, &ledger),
            Err(CudaError::Kernel(KernelError::BatchShape { .. }))
        ));
        // No entries at all (width 0): a legal batch, every read refused on
        // the device; the buffer still has a word.
        let empty = batch(&[], 0, &[1], &[0, 1], &slots[..1]);
        let a = decode_arrays(&empty, &RowLedger::new(1)).expect("width 0");
        assert_eq!((a.n_entries, a.block_tables.len()), (0, 1));
    }

    #[test]
    fn store_arrays_keep_padding_and_size_the_grid_by_the_longest_row() {
        let slots = [
            StoreSlot {
                page: PageRef::new(5, 2),
                slot: 3,
            },
            StoreSlot::PADDING,
            StoreSlot {
                page: PageRef::new(6, 1),
                slot: 0,
            },
        ];
        let b = batch(&[], 0, &[2, 1], &[0, 2, 3], &slots);
        let a = store_arrays(&b, &RowLedger::new(2)).expect("store batch");
        assert_eq!(
            a.store_slots,
            [5, 2, 3, u32::MAX, u32::MAX, u32::MAX, 6, 1, 0]
        );
        assert_eq!(a.query_start, [0, 2, 3]);
        assert_eq!(a.row_live, [1, 1]);
        assert_eq!(a.token_blocks, 2);
    }

    #[test]
    fn refusal_records_decode_into_the_refusals_the_cpu_guards_keep() {
        let stale = record([REFUSED_STALE_READ, 2, 9, 4, 4, 5, 8, 1]);
        let got = decode_refusals(&stale, Op::Read, MODE_SHADOW, 12).expect("decodes");
        assert_eq!(
            got,
            [CudaRefusal {
                refusal: Refusal {
                    row: 1,
                    access: Access::Read {
                        entry: 2,
                        layer: 1,
                        slots: 8
                    },
                    page: PageRef::new(9, 4),
                    reason: Reason::Checked,
                },
                check: Some(Check::Refused(ViolationKind::StaleRead)),
                current: Some(Generation(4)),
                first_unwritten: Some(5),
            }]
        );

        let table = record([REFUSED_OUTSIDE_TABLE, 3, 0, 0, u32::MAX, u32::MAX, 2, 0]);
        let got = decode_refusals(&table, Op::Read, MODE_SHADOW, 12).expect("decodes");
        assert_eq!(got[0].refusal.page, PageRef::default());
        assert_eq!(got[0].refusal.reason, Reason::Outside { pages: 12 });
        assert_eq!((got[0].check, got[0].current), (None, None));

        let generation = record([REFUSED_GENERATION_MISMATCH, 4, 2, 6, 7, 1, 1, 0]);
        let got = decode_refusals(&generation, Op::Store, MODE_GENERATIONS, 12).expect("decodes");
        assert_eq!(
            got[0].refusal,
            Refusal {
                row: 1,
                access: Access::Store {
                    token: 4,
                    layer: 0,
                    slot: 1
                },
                page: PageRef::new(2, 6),
                reason: Reason::Generation {
                    current: Generation(7)
                },
            }
        );
        assert_eq!(got[0].kind(), Some(ViolationKind::GenerationMismatch));

        let shared = record([REFUSED_ARBITRATE, 0, 1, 1, 1, u32::MAX, 3, 0]);
        let got = decode_refusals(&shared, Op::Read, MODE_SHADOW, 12).expect("decodes");
        assert_eq!(
            (got[0].check, got[0].kind()),
            (Some(Check::Arbitrate), None)
        );
    }

    #[test]
    fn a_refusal_code_the_kernel_or_mode_cannot_write_is_an_error() {
        for (words, op, mode) in [
            (record([99, 0, 0, 0, 0, 0, 0, 0]), Op::Read, MODE_SHADOW),
            // A write refusal from the read kernel.
            (
                record([REFUSED_FOREIGN_WRITE, 0, 0, 0, 0, 0, 0, 0]),
                Op::Read,
                MODE_SHADOW,
            ),
            // A shadow check in generations mode.
            (
                record([REFUSED_STALE_READ, 0, 0, 0, 0, 0, 0, 0]),
                Op::Read,
                MODE_GENERATIONS,
            ),
            // The table is only the read kernel's.
            (
                record([REFUSED_OUTSIDE_TABLE, 0, 0, 0, 0, 0, 0, 0]),
                Op::Store,
                MODE_SHADOW,
            ),
        ] {
            match decode_refusals(&words, op, mode, 4) {
                Err(CudaError::CorruptRefusal { row: 1, .. }) => {}
                other => panic!("expected a corrupt record error, got {other:?}"),
            }
        }
    }

    #[test]
    fn owners_are_one_per_row() {
        assert_eq!(
            owner_words(&[RequestId(4), RequestId(9)], 2).expect("two rows"),
            [4, 9]
        );
        assert!(matches!(
            owner_words(&[RequestId(4)], 2),
            Err(CudaError::Length {
                len: 1,
                expected: 2,
                ..
            })
        ));
    }
}
