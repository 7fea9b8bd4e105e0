//! Paged attention and the KV store over an f16 KV page pool, for a whole
//! batch, through exactly the arrays an attention backend takes: the
//! batch's block-table array (rows × width `PageRef`s), per-row sequence
//! lengths, the rows' query spans (CSR) and the per-token store slot
//! mapping. Every page a kernel touches is asked of a [`KvGuard`] first.
//!
//! ```text
//!  pool = n_pages × page_elems f16            page_elems = n_layers·2·page_slots·n_kv_heads·head_dim
//!  page p:
//!  ┌ layer 0 ─────────────────────────────┬ layer 1 ───── … ┐
//!  │ K: slot 0 [kvh 0 | kvh 1 | …]        │                 │   one slot row = n_kv_heads·head_dim
//!  │    slot 1 …  slot page_slots-1       │                 │
//!  │ V: slot 0 …  slot page_slots-1       │                 │
//!  └──────────────────────────────────────┴──────────────── ┘
//!
//!  KvBatch (what the kernels receive)
//!   block_tables  [row 0: e0 e1 e2 … e(width-1)][row 1: …]…   PageRef per entry, row-major
//!   seq_lens      [row 0][row 1]…                              tokens row r attends over
//!   query_start   [0, n0, n0+n1, …]                            row r's new tokens (CSR)
//!   store_slots   [token 0][token 1]…                          (PageRef, slot) or PADDING
//!
//!  row r, its i-th new token (of n):  position seq_lens[r] - n + i,
//!    attends causally to positions 0 ..= that position;
//!  position t of row r lives in block_tables[r·width + t / page_slots], slot t % page_slots
//!    (the flat index: an entry past the row's width is the next row's, as on a device)
//! ```
//!
//! Query head `h` reads KV head `h / (n_heads / n_kv_heads)` (grouped-query
//! attention). Scores are `scale · q·k` with `q` rounded to f16 first (as
//! llama.cpp does for an f16 cache); the softmax is online over blocks of 16
//! keys and the weighted sum of V accumulated in f32 ([`crate::flash`]).
//!
//! A query of 512 keys or more takes its keys in segments of 256 whose
//! partial softmaxes are merged, whether it is a decode row (a task per
//! segment) or in a prompt's tile (passes of the tile's task), so a query's
//! output is the same bits however the prompt was chunked.
//!
//! Each attention task (a row's chunk of queries, or a segment of a long
//! decode row's keys, over every KV head) asks the guard about every page it
//! is about to read, with the slots it reads of it, before reading any; the store asks before each token's K and V go
//! in. A page outside the pool is never touched. A refused row stops: its
//! output is zero and its later stores are skipped.

use half::f16;
use kvsan_ids::{Generation, PageId, PageRef};

use crate::Exec;
use crate::error::KernelError;
use crate::flash::{Keys, RowState, Rows, attend_rows};
use crate::guard::{Access, KvGuard};
use crate::isa::Isa;
use crate::threads::SharedMut;

/// Shape of the paged KV pool.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct KvGeometry {
    /// Token slots per page.
    pub page_slots: usize,
    /// Transformer layers (each page holds every layer of its slots).
    pub n_layers: usize,
    /// KV heads per layer.
    pub n_kv_heads: usize,
    /// Values per head.
    pub head_dim: usize,
}

impl KvGeometry {
    /// Values of one slot's K (or V) for one layer: `n_kv_heads × head_dim`.
    #[must_use]
    pub fn slot_width(&self) -> usize {
        self.n_kv_heads * self.head_dim
    }

    /// f16 values per page.
    #[must_use]
    pub fn page_elems(&self) -> usize {
        self.n_layers * 2 * self.page_slots * self.slot_width()
    }

    /// Index in the pool of the first value of (page, layer, K=0/V=1, slot).
    #[must_use]
    pub fn offset(&self, page: PageId, layer: usize, kv: usize, slot: usize) -> usize {
        page.0 as usize * self.page_elems()
            + ((layer * 2 + kv) * self.page_slots + slot) * self.slot_width()
    }

    /// Whole pages in a pool slice of `pool_len` values.
    #[must_use]
    pub fn n_pages(&self, pool_len: usize) -> usize {
        pool_len / self.page_elems().max(1)
    }
}

/// Where one token's K and V are stored: a page (with the generation it
/// was handed out at) and a slot — or nowhere ([`StoreSlot::PADDING`]).
#[repr(C)]
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub struct StoreSlot {
    /// The page.
    pub page: PageRef,
    /// The slot.
    pub slot: u32,
}

impl StoreSlot {
    /// A padding token's slot (`-1` in a flat slot mapping): nothing is stored.
    pub const PADDING: StoreSlot = StoreSlot {
        page: PageRef {
            page: PageId(u32::MAX),
            generation: Generation(u32::MAX),
        },
        slot: u32::MAX,
    };

    /// Whether this is [`StoreSlot::PADDING`].
    #[inline]
    #[must_use]
    pub fn is_padding(&self) -> bool {
        *self == StoreSlot::PADDING
    }
}

/// The KV arrays of one batch, as the kernels take them (layout in the
/// module doc).
#[derive(Clone, Copy, Debug)]
pub struct KvBatch<'a> {
    /// `rows × width` block-table entries, row-major.
    pub block_tables: &'a [PageRef],
    /// Entries per row of `block_tables`.
    pub width: usize,
    /// Per row: the tokens attention reads (context and the row's new tokens).
    pub seq_lens: &'a [u32],
    /// `rows + 1` offsets: row `r`'s new tokens are
    /// `query_start[r]..query_start[r + 1]` of the step's tokens.
    pub query_start: &'a [u32],
    /// Per token: where its K and V are stored.
    pub store_slots: &'a [StoreSlot],
}

impl KvBatch<'_> {
    /// Rows of the batch.
    #[must_use]
    pub fn rows(&self) -> usize {
        self.seq_lens.len()
    }

    /// Tokens of the step.
    #[must_use]
    pub fn tokens(&self) -> usize {
        self.store_slots.len()
    }

    /// Row `r`'s new tokens.
    #[inline]
    #[must_use]
    pub fn queries(&self, r: usize) -> std::ops::Range<usize> {
        self.query_start[r] as usize..self.query_start[r + 1] as usize
    }

    /// Checks the arrays' shapes against each other (not their contents:
    /// those are what the guard checks as they are used).
    ///
    /// # Errors
    /// [`KernelError::BatchShape`] naming the array and what it should be.
    pub fn validate(&self) -> Result<(), KernelError> {
        let bad = |what: String| Err(KernelError::BatchShape { what });
        let rows = self.rows();
        if self.query_start.len() != rows + 1 {
            return bad(format!(
                "query_start has {} offsets for {rows} rows (rows + 1 needed)",
                self.query_start.len()
            ));
        }
        if self.query_start.windows(2).any(|w| w[0] > w[1]) || self.query_start[0] != 0 {
            return bad("query_start does not rise from 0".into());
        }
        if self.query_start[rows] as usize != self.store_slots.len() {
            return bad(format!(
                "query_start ends at {} but there are {} store slots",
                self.query_start[rows],
                self.store_slots.len()
            ));
        }
        if self.block_tables.len() != rows * self.width {
            return bad(format!(
                "block_tables has {} entries, {rows} rows × width {} needed",
                self.block_tables.len(),
                self.width
            ));
        }
        if let Some(r) = (0..rows).find(|&r| self.queries(r).len() > self.seq_lens[r] as usize) {
            return bad(format!(
                "row {r} has {} new tokens but a sequence length of {}",
                self.queries(r).len(),
                self.seq_lens[r]
            ));
        }
        Ok(())
    }
}

/// Attention of consecutive queries over KV heads `kv` (`q`: queries ×
/// the `group` query heads of each of them × `head_dim`), query `i` over
/// positions `0..lens[i]` of the pages in `pages` (already asked of the
/// guard), into `out` (the same shape). Each block of K and V is read and
/// converted once for all the queries and heads that attend to it (a tile
/// of queries over blocks of keys, [`crate::flash`]).
///
/// A query of fewer than [`SPLIT_MIN_KEYS`] keys takes one pass over its
/// keys; a longer one, the segments a long decode row is split into, each
/// its own pass, merged as [`merge_parts`] merges them. So each query's
/// result is the same bits alone, in any tile, and as a decode row —
/// however the scheduler chunked its prompt.
#[allow(clippy::too_many_arguments)]
fn attend_queries(
    isa: Isa,
    pool: &[f16],
    geom: &KvGeometry,
    layer: usize,
    pages: &[PageId],
    lens: &[usize],
    scale: f32,
    group: usize,
    kv: std::ops::Range<usize>,
    q: &[f32],
    out: &mut [f32],
) {
    let hd = geom.head_dim;
    let per_query = group * kv.len();
    let rows = q.len() / hd;
    let heads: Vec<usize> = (0..rows)
        .map(|r| kv.start + r % per_query / group)
        .collect();
    let row_lens: Vec<usize> = (0..rows).map(|r| lens[r / per_query]).collect();
    let keys = keys_of(pool, geom, layer, pages, 0);
    // Lengths grow along the tile: the short queries come first.
    let short = lens.partition_point(|&l| l < SPLIT_MIN_KEYS) * per_query;
    if short > 0 {
        let len = row_lens[short - 1];
        let mut state = RowState::new(short, hd);
        let (q, heads, lens) = (&q[..short * hd], &heads[..short], &row_lens[..short]);
        attend_rows(isa, &keys, 0, len, scale, q, heads, lens, &mut state);
        for (r, o) in out[..short * hd].chunks_exact_mut(hd).enumerate() {
            state.write_out(r, o);
        }
    }
    let long = rows - short;
    if long == 0 {
        return;
    }
    let seg_keys = segment_keys(geom.page_slots);
    let len = row_lens[rows - 1];
    let w = hd + 3;
    // The thread's buffer, kept between calls: a long tile's parts are
    // megabytes, which a fresh allocation would fault in every time.
    let mut parts = PARTS_SCRATCH.with(|s| std::mem::take(&mut *s.borrow_mut()));
    parts.resize(len.div_ceil(seg_keys) * long * w, 0.0);
    let (q, heads, lens) = (&q[short * hd..], &heads[short..], &row_lens[short..]);
    let mut state = RowState::new(long, hd);
    let mut tile = Rows::new(&keys, q, heads, lens);
    for (s, part) in parts.chunks_exact_mut(long * w).enumerate() {
        let t0 = s * seg_keys;
        state.reset();
        tile.fold(isa, &keys, t0, (t0 + seg_keys).min(len), scale, &mut state);
        write_parts(&state, hd, part);
    }
    for (r, o) in out[short * hd..].chunks_exact_mut(hd).enumerate() {
        merge_row(&parts[r * w..], long * w, lens[r].div_ceil(seg_keys), o);
    }
    PARTS_SCRATCH.with(|s| *s.borrow_mut() = parts);
}

thread_local! {
    static PARTS_SCRATCH: std::cell::RefCell<Vec<f32>> = const { std::cell::RefCell::new(Vec::new()) };
}

/// The K and V of `layer` in `pages` (position `base` at the first slot of
/// `pages[0]`), as [`crate::flash`] reads them.
fn keys_of<'a>(
    pool: &'a [f16],
    geom: &KvGeometry,
    layer: usize,
    pages: &'a [PageId],
    base: usize,
) -> Keys<'a> {
    Keys {
        pool,
        pages,
        base,
        page_elems: geom.page_elems(),
        page_slots: geom.page_slots,
        n_kv_heads: geom.n_kv_heads,
        head_dim: geom.head_dim,
        layer_at: geom.offset(PageId(0), layer, 0, 0),
    }
}

fn assert_heads(geom: &KvGeometry, layer: usize, n_heads: usize) -> usize {
    assert!(layer < geom.n_layers, "layer {layer} of {}", geom.n_layers);
    assert!(
        geom.n_kv_heads > 0 && n_heads.is_multiple_of(geom.n_kv_heads),
        "{n_heads} query heads cannot share {} KV heads",
        geom.n_kv_heads
    );
    n_heads / geom.n_kv_heads
}

/// Stores each token's K and V of `layer` (`n_kv_heads × head_dim` f32
/// each per token, converted to f16) where the batch's store slot mapping
/// says, asking `guard` first; padding tokens and tokens of stopped rows are
/// skipped.
///
/// # Panics
/// On shape mismatches (`k`/`v` not one slot row per token, a bad
/// `query_start`, `layer` outside the geometry).
pub fn store_kv(
    pool: &mut [f16],
    geom: &KvGeometry,
    layer: usize,
    batch: &KvBatch<'_>,
    k: &[f32],
    v: &[f32],
    guard: &impl KvGuard,
) {
    let w = geom.slot_width();
    assert!(layer < geom.n_layers, "layer {layer} of {}", geom.n_layers);
    assert!(
        k.len() == batch.tokens() * w && v.len() == k.len(),
        "K/V of {}/{} values for {} tokens of width {w}",
        k.len(),
        v.len(),
        batch.tokens()
    );
    let n_pages = geom.n_pages(pool.len());
    let mut stores = 0u64;
    for row in 0..batch.rows() {
        for token in batch.queries(row) {
            let to = batch.store_slots[token];
            if to.is_padding() || !guard.live(row) {
                continue;
            }
            if to.page.page.0 as usize >= n_pages || to.slot as usize >= geom.page_slots {
                let access = Access::Store {
                    token,
                    layer,
                    slot: to.slot as usize,
                };
                guard.outside(row, access, to.page, n_pages);
                continue;
            }
            stores += 1;
            if !guard.store(row, token, to.page, to.slot as usize, layer) {
                continue;
            }
            for (kv, src) in [
                &k[token * w..(token + 1) * w],
                &v[token * w..(token + 1) * w],
            ]
            .into_iter()
            .enumerate()
            {
                let o = geom.offset(to.page.page, layer, kv, to.slot as usize);
                for (d, &s) in pool[o..o + w].iter_mut().zip(src) {
                    *d = f16::from_f32(s);
                }
            }
        }
    }
    guard.count(0, stores);
}

/// Queries per attention task of a row.
const QUERY_CHUNK: usize = 16;

/// Asks `guard` about the pages row `row` reads for positions `0..len`
/// among block-table entries `entries`: the pages (in position order) if
/// all may be read, `None` if one was refused (the row has stopped) or is
/// outside the pool.
#[allow(clippy::too_many_arguments)]
fn checked_pages(
    geom: &KvGeometry,
    n_pages: usize,
    layer: usize,
    batch: &KvBatch<'_>,
    row: usize,
    len: usize,
    entries: std::ops::Range<usize>,
    guard: &impl KvGuard,
) -> Option<Vec<PageId>> {
    let ps = geom.page_slots;
    let mut pages = Vec::with_capacity(entries.len());
    for entry in entries.clone() {
        let slots = (len - entry * ps).min(ps);
        let access = Access::Read {
            entry,
            layer,
            slots,
        };
        // The flat index: past the row's width is the next row's entry.
        let Some(&page) = batch.block_tables.get(row * batch.width + entry) else {
            guard.outside(row, access, PageRef::default(), n_pages);
            return None;
        };
        if page.page.0 as usize >= n_pages {
            guard.outside(row, access, page, n_pages);
            return None;
        }
        if !guard.read(row, entry, page, layer, slots) {
            return None;
        }
        pages.push(page.page);
    }
    guard.count(entries.len() as u64, 0);
    Some(pages)
}

/// A decode row at least this long is split across tasks by its keys,
/// whatever the batch and the threads: a row's output is the same alone
/// and in any batch. A query of a prefill tile this long is computed in
/// the same segments (in its tile's task), so it is the same bits too.
const SPLIT_MIN_KEYS: usize = 512;
/// Keys per task of a split row (rounded to whole pages).
const SPLIT_KEYS: usize = 256;

/// Keys per segment of a split row: [`SPLIT_KEYS`] rounded up to whole
/// pages of `page_slots`.
fn segment_keys(page_slots: usize) -> usize {
    SPLIT_KEYS.div_ceil(page_slots).max(1) * page_slots
}

/// Each row's partial softmax from `state` into `part` (`rows × (hd + 3)`):
/// `[1, max score, sum of exp(score − max), Σ exp(score − max)·V…]`.
fn write_parts(state: &RowState, hd: usize, part: &mut [f32]) {
    let w = hd + 3;
    for (r, p) in part.chunks_exact_mut(w).enumerate() {
        p[0] = 1.0;
        p[1] = state.max[r];
        p[2] = state.sum[r];
        p[3..].copy_from_slice(state.acc_row(r, hd));
    }
}

/// One query's attention (`q`: `n_heads × head_dim`, `group` heads per KV
/// head) over the keys of block-table entries `first_entry..` (`pages`) up
/// to position `len`: for each head its partial softmax — written to `part`
/// as `[1, max score, sum of exp(score − max), Σ exp(score − max)·V…]` —
/// for [`merge_parts`] to combine with the other segments'. The same
/// block loop as [`attend_queries`].
#[allow(clippy::too_many_arguments)]
fn attend_segment(
    isa: Isa,
    pool: &[f16],
    geom: &KvGeometry,
    layer: usize,
    pages: &[PageId],
    first_entry: usize,
    len: usize,
    scale: f32,
    group: usize,
    q: &[f32],
    part: &mut [f32],
) {
    let hd = geom.head_dim;
    let ps = geom.page_slots;
    let rows = q.len() / hd;
    let t0 = first_entry * ps;
    let t1 = ((first_entry + pages.len()) * ps).min(len);
    let keys = keys_of(pool, geom, layer, pages, t0);
    let heads: Vec<usize> = (0..rows).map(|r| r / group).collect();
    let mut state = RowState::new(rows, hd);
    attend_rows(
        isa,
        &keys,
        t0,
        t1,
        scale,
        q,
        &heads,
        &vec![len; rows],
        &mut state,
    );
    write_parts(&state, hd, part);
}

/// Combines the partial softmaxes of a split row's segments (`parts`, one
/// `rows × (hd + 3)` block per segment, a row per query head) into `out`
/// (`rows × hd`); zero when a segment was not computed (the row stopped).
fn merge_parts(parts: &[f32], rows: usize, hd: usize, out: &mut [f32]) {
    let w = hd + 3;
    let seg = rows * w;
    out.fill(0.0);
    if parts.chunks_exact(seg).any(|p| p[0] != 1.0) {
        return;
    }
    let segs = parts.len() / seg;
    for (r, o) in out.chunks_exact_mut(hd).take(rows).enumerate() {
        merge_row(&parts[r * w..], seg, segs, o);
    }
}

/// One row's output from its partial softmaxes in `segs` segments: the
/// row's part of segment `s` at `parts[s * stride..]` (see
/// [`write_parts`]); `out` holds the head dimension. The one merge of
/// split rows, whether their segments were tasks of their own (decode) or
/// passes of a tile's task (prefill).
fn merge_row(parts: &[f32], stride: usize, segs: usize, out: &mut [f32]) {
    let hd = out.len();
    let part = |s: usize| &parts[s * stride..s * stride + hd + 3];
    let max = (0..segs)
        .map(|s| part(s)[1])
        .fold(f32::NEG_INFINITY, f32::max);
    let mut sum = 0.0f64;
    out.fill(0.0);
    for s in 0..segs {
        let p = part(s);
        let scale = (p[1] - max).exp();
        sum += f64::from(p[2]) * f64::from(scale);
        for (d, &x) in out.iter_mut().zip(&p[3..]) {
            *d += scale * x;
        }
    }
    let inv = (1.0 / sum) as f32;
    for d in out.iter_mut() {
        *d *= inv;
    }
}

/// Attention of every row's new tokens over its pages for `layer`: `q` and
/// `out` are `tokens × n_heads × head_dim`. Each task (a row's chunk of up
/// to 16 queries, or a segment of a long decode row's keys, over every KV
/// head — one KV head each when the batch is a single chunk) asks `guard`
/// about each page it is about to read; a stopped row's output is zero.
///
/// # Panics
/// On shape mismatches (see [`KvBatch::validate`], `q`/`out` lengths, heads
/// that do not divide into KV heads, `layer` outside the geometry).
#[allow(clippy::too_many_arguments)]
pub fn attend(
    exec: Exec,
    pool: &[f16],
    geom: &KvGeometry,
    layer: usize,
    n_heads: usize,
    scale: f32,
    batch: &KvBatch<'_>,
    q: &[f32],
    out: &mut [f32],
    guard: &impl KvGuard,
) {
    let group = assert_heads(geom, layer, n_heads);
    if let Err(e) = batch.validate() {
        panic!("attend: {e}");
    }
    let hd = geom.head_dim;
    let qw = n_heads * hd;
    assert_eq!(q.len(), batch.tokens() * qw, "query of {} values", q.len());
    assert_eq!(out.len(), q.len(), "attention output length");
    let n_pages = geom.n_pages(pool.len());
    let isa = exec.isa.or_portable();
    // Tasks: (row, first query of the chunk, its block-table entries). A
    // long decode row is split by its keys (flash-decoding), so the
    // threads share its reads even alone.
    let mut chunks: Vec<(usize, usize)> = Vec::new();
    let mut work = 0usize;
    for row in 0..batch.rows() {
        let queries = batch.queries(row);
        work += queries.len() * batch.seq_lens[row] as usize;
        chunks.extend(queries.step_by(QUERY_CHUNK).map(|first| (row, first)));
    }
    let ps = geom.page_slots;
    // (chunk, entries, index among its segments, segments)
    let mut units: Vec<(usize, std::ops::Range<usize>, usize, usize)> = Vec::new();
    for (c, &(row, first)) in chunks.iter().enumerate() {
        let queries = batch.queries(row);
        let last = (first + QUERY_CHUNK).min(queries.end);
        let seq_len = batch.seq_lens[row] as usize;
        let len = seq_len - queries.len() + (last - queries.start);
        let entries = len.div_ceil(ps);
        if last - first == 1 && len >= SPLIT_MIN_KEYS {
            let per = segment_keys(ps) / ps;
            let segs = entries.div_ceil(per);
            for (i, e0) in (0..entries).step_by(per).enumerate() {
                units.push((c, e0..(e0 + per).min(entries), i, segs));
            }
        } else {
            units.push((c, 0..entries, 0, 1));
        }
    }
    // Each split unit's partial softmaxes, every head, in unit order (a
    // split chunk's segments are consecutive).
    let part_w = n_heads * (hd + 3);
    let part_at: Vec<usize> = units
        .iter()
        .scan(0usize, |n, u| {
            let at = *n * part_w;
            *n += usize::from(u.3 > 1);
            Some(at)
        })
        .collect();
    let split_units = units.iter().filter(|u| u.3 > 1).count();
    let mut parts = vec![0.0f32; split_units * part_w];
    let outp = SharedMut::new(out);
    let partp = SharedMut::new(&mut parts);
    // One task per unit, every KV head: a block's K and V slot rows are
    // read whole, in pool order, and each page is asked about once. A batch
    // of one unit (one short row) is split by KV heads instead, so the
    // threads share it; the split depends on the batch alone.
    let nkv = geom.n_kv_heads;
    let per_unit = if units.len() == 1 { nkv } else { 1 };
    let task = |t: usize| {
        let (u, g) = (t / per_unit, t % per_unit);
        let kv = if per_unit == 1 { 0..nkv } else { g..g + 1 };
        let (c, entries, _, segs) = &units[u];
        let (row, first) = chunks[*c];
        let queries = batch.queries(row);
        let last = (first + QUERY_CHUNK).min(queries.end);
        let seq_len = batch.seq_lens[row] as usize;
        let start_pos = seq_len - queries.len();
        let lens = |i: usize| start_pos + (i - queries.start) + 1;
        let len = lens(last - 1);
        let pages = if guard.live(row) {
            checked_pages(
                geom,
                n_pages,
                layer,
                batch,
                row,
                len,
                entries.clone(),
                guard,
            )
        } else {
            None
        };
        if *segs > 1 {
            // SAFETY: unit u alone writes its part.
            let part = unsafe { partp.slice(part_at[u], part_w) };
            match &pages {
                Some(pages) => attend_segment(
                    isa,
                    pool,
                    geom,
                    layer,
                    pages,
                    entries.start,
                    len,
                    scale,
                    group,
                    &q[first * qw..(first + 1) * qw],
                    part,
                ),
                None => part.fill(0.0),
            }
            return;
        }
        let width = kv.len() * group * hd;
        let h0 = kv.start * group * hd;
        let at = |i: usize| i * qw + h0;
        let mut tile = vec![0.0f32; (last - first) * width];
        if let Some(pages) = &pages {
            let mut q_tile = Vec::with_capacity(tile.len());
            for i in first..last {
                q_tile.extend_from_slice(&q[at(i)..at(i) + width]);
            }
            let lens: Vec<usize> = (first..last).map(lens).collect();
            attend_queries(
                isa, pool, geom, layer, pages, &lens, scale, group, kv, &q_tile, &mut tile,
            );
        }
        for (i, o) in (first..last).zip(tile.chunks_exact(width)) {
            // SAFETY: task (unit, heads) alone writes these heads of the
            // queries of its chunk.
            unsafe { outp.slice(at(i), width) }.copy_from_slice(o);
        }
    };
    let tasks = units.len() * per_unit;
    if work * qw < 32_768 {
        (0..tasks).for_each(task);
    } else {
        exec.pool.run(tasks, task);
    }
    // Split rows: their segments' parts merged, in segment order.
    let mut u = 0;
    while u < units.len() {
        let (c, _, _, segs) = units[u];
        if segs > 1 {
            let (_, first) = chunks[c];
            merge_parts(
                &parts[part_at[u]..part_at[u] + segs * part_w],
                n_heads,
                hd,
                &mut out[first * qw..(first + 1) * qw],
            );
        }
        u += segs;
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// A tile of queries gives each query, bit for bit, what the query
    /// alone gives (the same dots, softmax and sums in the same order).
    #[test]
    fn a_tile_of_queries_is_bit_identical_to_each_query_alone() {
        let geom = KvGeometry {
            page_slots: 16,
            n_layers: 2,
            n_kv_heads: 2,
            head_dim: 64,
        };
        let pages: Vec<PageId> = [5u32, 0, 3, 7].into_iter().map(PageId).collect();
        let mut x = 7u64;
        let mut next = move || {
            x = x.wrapping_mul(6_364_136_223_846_793_005).wrapping_add(1);
            ((x >> 40) as f32 / (1u64 << 24) as f32) - 0.5
        };
        let pool: Vec<f16> = (0..8 * geom.page_elems())
            .map(|_| f16::from_f32(next()))
            .collect();
        let (group, hd) = (3, geom.head_dim);
        let w = group * geom.n_kv_heads * hd;
        // Four queries of a prefill at positions 45..49: each attends to
        // itself and everything before it. The tile scores from transposed
        // keys where the CPU has AVX-512, a query alone from each key's
        // lanes: the same bits either way.
        let lens = [46, 47, 48, 49];
        let q: Vec<f32> = (0..lens.len() * w).map(|_| next()).collect();
        for isa in Isa::all_available() {
            let mut tile = vec![0.0f32; q.len()];
            attend_queries(
                isa,
                &pool,
                &geom,
                1,
                &pages,
                &lens,
                0.125,
                group,
                0..geom.n_kv_heads,
                &q,
                &mut tile,
            );
            for (i, &n) in lens.iter().enumerate() {
                let mut alone = vec![0.0f32; w];
                attend_queries(
                    isa,
                    &pool,
                    &geom,
                    1,
                    &pages,
                    &[n],
                    0.125,
                    group,
                    0..geom.n_kv_heads,
                    &q[i * w..(i + 1) * w],
                    &mut alone,
                );
                let same = alone
                    .iter()
                    .zip(&tile[i * w..(i + 1) * w])
                    .all(|(a, b)| a.to_bits() == b.to_bits());
                assert!(same, "query {i} on {isa:?}");
            }
        }
    }
}
