//! The batch builder: from a step's plan to the arrays the KV kernels take.
//!
//! ```text
//!  plan: (sequence, n new tokens) …
//!    │
//!    ▼  one kernel row per planned sequence (plus padding rows, fault only)
//!  block_tables  rows × width, kept from step to step: a row still holding
//!                the same block table (same epoch) only appends its new
//!                entries; a row given to another table is refilled
//!  seq_lens      start + n                        (what attention reads)
//!  query_start   CSR over the step's tokens
//!  positions     start .. start + n               (RoPE)
//!  store_slots   block_tables[row·width + pos / page_slots], slot pos % page_slots
//!                — computed from the block-table array itself, as a device
//!                  engine computes its slot mapping
//! ```
//!
//! The width is fixed for the node (the pages of a full context), so rows
//! keep their place and the host cost per step grows with the pages added,
//! not with the context.
//!
//! The fail points of the gap between a plan and a kernel's arguments are
//! calls into this module's `faults` seams, where that gap is: a decode
//! length taken from the pages instead of the tokens, kernel rows reordered
//! without their block-table rows, a slot mapping that forgets a chunk's
//! offset in its page, a block-table row kept from the previous step,
//! padding rows whose slot `-1` wraps. The kernels and their checks take
//! whatever this builds.

use kvsan_kernels::StoreSlot;
use kvsan_sanitizer::{BlockTable, Owner, PageId, PageRef};

use crate::kv_access::{Logits, StepBatch};
use crate::kv_pool::KvPool;

mod faults;

/// A block-table entry no page holds (past a row's pages).
const NO_PAGE: PageRef = PageRef {
    page: PageId(u32::MAX),
    generation: kvsan_sanitizer::Generation(0),
};

/// One planned row: whose, which pages, which new tokens from which position.
pub(crate) struct PlannedRow<'a> {
    pub owner: Owner,
    pub table: &'a BlockTable,
    pub tokens: &'a [u32],
    pub start: usize,
    pub logits: Logits,
}

/// What one block-table row of the array holds now.
#[derive(Clone, Copy, Debug, Default)]
struct RowCache {
    /// The epoch of the table copied there (0: none).
    epoch: u64,
    /// Entries copied from it.
    copied: usize,
}

/// The node's batch arrays, kept from step to step.
#[derive(Debug)]
pub(crate) struct BatchBuilder {
    batch: StepBatch,
    cache: Vec<RowCache>,
    /// For each kernel row, the planned row it came from (`None`: padding).
    plan_rows: Vec<Option<usize>>,
}

impl BatchBuilder {
    /// Arrays whose rows hold `width` entries (a full context's pages).
    pub fn new(width: usize) -> BatchBuilder {
        BatchBuilder {
            batch: StepBatch {
                width: width.max(1),
                ..StepBatch::default()
            },
            cache: Vec::new(),
            plan_rows: Vec::new(),
        }
    }

    /// Forgets what the rows hold (the node went idle).
    pub fn reset(&mut self) {
        self.cache.clear();
        self.batch.block_tables.fill(NO_PAGE);
    }

    /// The arrays last built.
    pub fn last(&self) -> &StepBatch {
        &self.batch
    }

    /// The planned row each kernel row came from (`None` for padding).
    pub fn plan_rows(&self) -> &[Option<usize>] {
        &self.plan_rows
    }

    /// The arrays for `rows` (in plan order) over `pool`.
    pub fn build(&mut self, rows: &[PlannedRow<'_>], pool: &KvPool) {
        let ps = pool.page_slots();
        let widest = rows.iter().map(|r| r.table.len()).max().unwrap_or(0);
        if widest > self.batch.width {
            // Never for a table within the context; relaid out if it happens.
            self.batch.width = widest;
            self.cache.clear();
        }
        // Kernel rows follow the plan, each with its own block table.
        let order = faults::block_table_row_order(rows);
        let width = self.batch.width;
        let b = &mut self.batch;
        b.tokens.clear();
        b.positions.clear();
        b.seq_lens.clear();
        b.query_start.clear();
        b.query_start.push(0);
        b.store_slots.clear();
        b.owners.clear();
        b.logits.clear();
        // Rows past the batch are dropped with what they held.
        b.block_tables.resize(rows.len() * width, NO_PAGE);
        self.cache.truncate(rows.len());
        self.cache.resize(rows.len(), RowCache::default());
        self.plan_rows.clear();
        for (r, &(p, table)) in order.iter().enumerate() {
            fill_row(
                &mut b.block_tables[r * width..(r + 1) * width],
                &mut self.cache[r],
                table,
            );
            let row = &rows[p];
            let n = row.tokens.len();
            let seq_len = faults::decode_length_overrun(row, row.start + n);
            let counted_from = faults::slot_mapping_chunk_offset(row, ps);
            for (i, &token) in row.tokens.iter().enumerate() {
                let pos = row.start + i;
                let entry = pos / ps;
                let page = if entry < width {
                    b.block_tables[r * width + entry]
                } else {
                    NO_PAGE
                };
                b.tokens.push(token);
                b.positions.push(pos);
                b.store_slots.push(StoreSlot {
                    page,
                    slot: ((counted_from + i) % ps) as u32,
                });
            }
            b.seq_lens.push(seq_len as u32);
            b.query_start.push(b.tokens.len() as u32);
            b.owners.push(row.owner);
            b.logits.push(row.logits);
            self.plan_rows.push(Some(p));
        }
        faults::padding_slot_wrap(self, rows, pool);
    }
}

/// Brings block-table row `row` up to `table`: the new entries if it holds
/// the same table, else all of it (and clears what the last table left
/// past its end).
fn fill_row(row: &mut [PageRef], cache: &mut RowCache, table: &BlockTable) {
    let pages = table.pages();
    if faults::stale_batch_array(cache, table) {
        return;
    }
    if cache.epoch == table.epoch() && cache.copied <= pages.len() {
        row[cache.copied..pages.len()].copy_from_slice(&pages[cache.copied..]);
    } else {
        row[..pages.len()].copy_from_slice(pages);
        let stale_end = cache.copied.min(row.len());
        if stale_end > pages.len() {
            row[pages.len()..stale_end].fill(NO_PAGE);
        }
    }
    *cache = RowCache {
        epoch: table.epoch(),
        copied: pages.len(),
    };
}
