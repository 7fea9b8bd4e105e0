//! The batch builder's fail points: the gap between a plan and a kernel's
//! arguments. Each seam is the identity (or a no-op) unless its fault is
//! injected; without the `faults` feature every one compiles away.

use kvsan_sanitizer::{BlockTable, PageId, PageRef};

use super::{BatchBuilder, NO_PAGE, PlannedRow, RowCache};
use crate::faults::{Fault, active};
use crate::kv_access::Logits;
use crate::kv_pool::KvPool;
use kvsan_kernels::StoreSlot;

/// Fault `padding-slot-wrap`: a batch of two or more rows is padded to a
/// multiple of this many rows, as an engine that runs fixed batch shapes does.
pub(crate) const PAD_ROWS_TO: usize = 4;

/// Fault `decode-length-overrun`: decode rows of sequences longer than this
/// take the long-context (split-KV) path, whose length the builder takes
/// from the row's pages.
pub const LONG_DECODE_TOKENS: usize = 256;

/// For each kernel row, the planned row it runs and the block table its
/// block-table row is written from: the planned rows in order, each with
/// its own table.
///
/// Fault `block-table-row-order`: the kernel rows are sorted longest-query
/// first (for the kernel's load balance), but the block-table array is
/// still written in plan order.
pub(super) fn block_table_row_order<'a>(rows: &[PlannedRow<'a>]) -> Vec<(usize, &'a BlockTable)> {
    if !active(Fault::BlockTableRowOrder) {
        return rows
            .iter()
            .enumerate()
            .map(|(p, row)| (p, row.table))
            .collect();
    }
    let mut order: Vec<usize> = (0..rows.len()).collect();
    order.sort_by_key(|&i| std::cmp::Reverse(rows[i].tokens.len()));
    order
        .into_iter()
        .enumerate()
        .map(|(r, p)| (p, rows[r].table))
        .collect()
}

/// The length attention reads for `row`: `seq_len`, its tokens.
///
/// Fault `decode-length-overrun`: a long sequence's decode row attends over
/// its pages' whole capacity.
pub(super) fn decode_length_overrun(row: &PlannedRow<'_>, seq_len: usize) -> usize {
    if active(Fault::DecodeLengthOverrun) && row.tokens.len() == 1 && seq_len > LONG_DECODE_TOKENS {
        return row.table.capacity();
    }
    seq_len
}

/// The position `row`'s store slots are counted from: its start.
///
/// Fault `slot-mapping-chunk-offset`: a prefill chunk that starts inside a
/// page has its slots counted from the chunk's start (as if from position 0).
pub(super) fn slot_mapping_chunk_offset(row: &PlannedRow<'_>, page_slots: usize) -> usize {
    if active(Fault::SlotMappingChunkOffset)
        && row.tokens.len() > 1
        && !row.start.is_multiple_of(page_slots)
    {
        return 0;
    }
    row.start
}

/// Whether block-table row `cache` is left as it is for `table`: never,
/// the row is brought up to the table.
///
/// Fault `stale-batch-array`: a row whose table has as many pages as the
/// row held last step is taken as unchanged — even when it is another
/// request's table now.
pub(super) fn stale_batch_array(cache: &mut RowCache, table: &BlockTable) -> bool {
    if active(Fault::StaleBatchArray) && cache.copied == table.len() && cache.epoch != 0 {
        cache.epoch = table.epoch();
        return true;
    }
    false
}

/// Nothing: the batch has the planned rows only.
///
/// Fault `padding-slot-wrap`: a batch of two or more rows is padded to a
/// multiple of [`PAD_ROWS_TO`] rows. Each padding row repeats the first
/// kernel row (its request and last token) with slot mapping −1, which,
/// unchecked, is the pool's last slot, through the page as it is now.
pub(super) fn padding_slot_wrap(
    builder: &mut BatchBuilder,
    rows: &[PlannedRow<'_>],
    pool: &KvPool,
) {
    if !active(Fault::PaddingSlotWrap) || rows.len() < 2 {
        return;
    }
    let n_rows = rows.len().next_multiple_of(PAD_ROWS_TO);
    let first = &rows[builder.plan_rows[0].expect("the first kernel row is planned")];
    let token = *first.tokens.last().expect("a planned row has tokens");
    let ps = pool.page_slots();
    let last = pool.n_pages() - 1;
    let wrapped = PageRef {
        page: PageId(last as u32),
        generation: pool.generations()[last],
    };
    let width = builder.batch.width;
    let b = &mut builder.batch;
    b.block_tables.resize(n_rows * width, NO_PAGE);
    builder.cache.resize(n_rows, RowCache::default());
    for r in rows.len()..n_rows {
        let row = &mut b.block_tables[r * width..(r + 1) * width];
        row.fill(NO_PAGE);
        row[0] = wrapped;
        builder.cache[r] = RowCache::default();
        b.tokens.push(token);
        b.positions.push(ps - 1);
        b.store_slots.push(StoreSlot {
            page: wrapped,
            slot: (ps - 1) as u32,
        });
        b.seq_lens.push(ps as u32);
        b.query_start.push(b.tokens.len() as u32);
        b.owners.push(first.owner);
        b.logits.push(Logits::None);
        builder.plan_rows.push(None);
    }
}
