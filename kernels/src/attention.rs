//! Paged attention over an f16 KV page pool, read only through block tables
//! of [`PageRef`]s.
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
//!  token position t of a sequence lives in page block_table[t / page_slots], slot t % page_slots
//! ```
//!
//! Query head `h` reads KV head `h / (n_heads / n_kv_heads)` (grouped-query
//! attention). Scores are `scale · q·k` with `q` rounded to f16 first (as
//! llama.cpp does for an f16 cache), softmax in f32 with an f64 sum, and the
//! weighted sum of V accumulated in f32.
//!
//! The checked variants compare every `PageRef`'s generation with the pool's
//! generation array before reading anything and refuse on a mismatch; the
//! unchecked ones still verify block-table length and page range (cheap: one
//! pass over the pages to be read) and panic rather than read out of bounds.

use half::f16;
use kvsan_sanitizer::{Generation, PageId, PageRef};

use crate::Exec;
use crate::error::KernelError;
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

/// Stores one token's K and V (`n_kv_heads × head_dim` f32 each, converted to
/// f16) into `slot` of `page` for `layer`.
///
/// # Panics
/// If the page is outside the pool, `slot`/`layer` outside the geometry, or
/// `k`/`v` not `slot_width()` long.
pub fn kv_write(
    pool: &mut [f16],
    geom: &KvGeometry,
    page: PageId,
    slot: usize,
    layer: usize,
    k: &[f32],
    v: &[f32],
) {
    let w = geom.slot_width();
    assert!(
        slot < geom.page_slots,
        "slot {slot} of a page of {} slots",
        geom.page_slots
    );
    assert!(layer < geom.n_layers, "layer {layer} of {}", geom.n_layers);
    assert!(
        k.len() == w && v.len() == w,
        "K/V of {}/{} values, slot width {w}",
        k.len(),
        v.len()
    );
    let n_pages = geom.n_pages(pool.len());
    assert!(
        (page.0 as usize) < n_pages,
        "page {} of a pool of {n_pages} pages",
        page.0
    );
    for (kv, src) in [k, v].into_iter().enumerate() {
        let o = geom.offset(page, layer, kv, slot);
        for (d, &s) in pool[o..o + w].iter_mut().zip(src) {
            *d = f16::from_f32(s);
        }
    }
}

/// One sequence of a batched decode step.
#[derive(Clone, Copy, Debug)]
pub struct DecodeSeq<'a> {
    /// The new token's query: `n_heads × head_dim`.
    pub q: &'a [f32],
    /// The sequence's pages, in token order.
    pub block_table: &'a [PageRef],
    /// Tokens to attend over (including the new one, already written).
    pub seq_len: usize,
}

/// Checks that `block_table` covers `seq_len` tokens with pages inside the
/// pool and, with `generations`, at the pages' current generations.
fn check_table(
    geom: &KvGeometry,
    n_pages: usize,
    seq: usize,
    block_table: &[PageRef],
    seq_len: usize,
    generations: Option<&[Generation]>,
) -> Result<(), KernelError> {
    let pages_needed = seq_len.div_ceil(geom.page_slots);
    if block_table.len() < pages_needed {
        return Err(KernelError::BlockTableTooShort {
            seq,
            seq_len,
            pages_needed,
            block_table_len: block_table.len(),
        });
    }
    let limit = generations.map_or(n_pages, |g| g.len().min(n_pages));
    for (index, r) in block_table[..pages_needed].iter().enumerate() {
        let p = r.page.0 as usize;
        if p >= limit {
            return Err(KernelError::PageOutOfRange {
                seq,
                index,
                page: r.page,
                n_pages: limit,
            });
        }
        if let Some(g) = generations
            && g[p] != r.generation
        {
            return Err(KernelError::GenerationMismatch {
                seq,
                index,
                page: r.page,
                found: r.generation,
                current: g[p],
            });
        }
    }
    Ok(())
}

#[inline]
fn dot_qk(isa: Isa, q: &[f32], k: &[f16]) -> f32 {
    match isa {
        #[cfg(target_arch = "x86_64")]
        Isa::Avx2 => {
            // SAFETY: `isa` is available (callers pass `or_portable()`), and
            // q and k are both head_dim long.
            unsafe { crate::avx2::dot_f32_f16(q, k) }
        }
        _ => q.iter().zip(k).map(|(&a, &b)| a * b.to_f32()).sum(),
    }
}

#[inline]
fn axpy(isa: Isa, out: &mut [f32], a: f32, v: &[f16]) {
    match isa {
        #[cfg(target_arch = "x86_64")]
        Isa::Avx2 => {
            // SAFETY: `isa` is available and out and v are both head_dim long.
            unsafe { crate::avx2::axpy_f16(out, a, v) }
        }
        _ => {
            for (o, &x) in out.iter_mut().zip(v) {
                *o += a * x.to_f32();
            }
        }
    }
}

/// Attention of `group` query heads (`q`, `group × head_dim`) sharing KV head
/// `kvh` over tokens `0..len` through `table` (already checked), into `out`.
#[allow(clippy::too_many_arguments)]
fn attend_group(
    isa: Isa,
    pool: &[f16],
    geom: &KvGeometry,
    layer: usize,
    kvh: usize,
    table: &[PageRef],
    len: usize,
    scale: f32,
    q: &[f32],
    out: &mut [f32],
) {
    let hd = geom.head_dim;
    let group = q.len() / hd;
    let q16: Vec<f32> = q.iter().map(|&v| f16::from_f32(v).to_f32()).collect();
    let mut scores = vec![0.0f32; group * len];
    let slots = |kv: usize| {
        (0..len).map(move |t| {
            let page = table[t / geom.page_slots].page;
            let o = geom.offset(page, layer, kv, t % geom.page_slots) + kvh * hd;
            (t, &pool[o..o + hd])
        })
    };
    for (t, k) in slots(0) {
        for h in 0..group {
            scores[h * len + t] = dot_qk(isa, &q16[h * hd..(h + 1) * hd], k) * scale;
        }
    }
    for s in scores.chunks_exact_mut(len.max(1)) {
        crate::ops::softmax_inplace(s);
    }
    out.fill(0.0);
    for (t, v) in slots(1) {
        for h in 0..group {
            axpy(isa, &mut out[h * hd..(h + 1) * hd], scores[h * len + t], v);
        }
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

/// Batched decode: each sequence's single query attends over its first
/// `seq_len` tokens through its block table. `out` is `n_seqs × n_heads × head_dim`.
/// Runs on the global pool.
///
/// # Panics
/// If a block table is too short for its `seq_len` or names a page outside
/// the pool (nothing is read then), or on shape mismatches.
pub fn paged_attention_decode(
    pool: &[f16],
    geom: &KvGeometry,
    layer: usize,
    n_heads: usize,
    scale: f32,
    seqs: &[DecodeSeq],
    out: &mut [f32],
) {
    if let Err(e) = decode_impl(
        Exec::global(),
        pool,
        geom,
        layer,
        n_heads,
        scale,
        seqs,
        out,
        None,
    ) {
        panic!("paged_attention_decode: {e}");
    }
}

/// [`paged_attention_decode`] that first compares every `PageRef` to be read
/// with `generations[page]` and refuses — reading nothing — on a mismatch.
///
/// # Errors
/// [`KernelError::GenerationMismatch`] (sequence, entry, page, both
/// generations), [`KernelError::BlockTableTooShort`], or
/// [`KernelError::PageOutOfRange`] (outside the pool or the generation array).
///
/// # Panics
/// On shape mismatches.
#[allow(clippy::too_many_arguments)]
pub fn paged_attention_decode_checked(
    pool: &[f16],
    geom: &KvGeometry,
    layer: usize,
    n_heads: usize,
    scale: f32,
    seqs: &[DecodeSeq],
    out: &mut [f32],
    generations: &[Generation],
) -> Result<(), KernelError> {
    decode_impl(
        Exec::global(),
        pool,
        geom,
        layer,
        n_heads,
        scale,
        seqs,
        out,
        Some(generations),
    )
}

/// [`paged_attention_decode_checked`] (or unchecked, with `generations` `None`)
/// on a given pool and instruction set.
///
/// # Errors
/// As [`paged_attention_decode_checked`].
///
/// # Panics
/// On shape mismatches.
#[allow(clippy::too_many_arguments)]
pub fn decode_impl(
    exec: Exec,
    pool: &[f16],
    geom: &KvGeometry,
    layer: usize,
    n_heads: usize,
    scale: f32,
    seqs: &[DecodeSeq],
    out: &mut [f32],
    generations: Option<&[Generation]>,
) -> Result<(), KernelError> {
    let group = assert_heads(geom, layer, n_heads);
    let hd = geom.head_dim;
    let qw = n_heads * hd;
    assert_eq!(
        out.len(),
        seqs.len() * qw,
        "decode output of {} values",
        out.len()
    );
    let n_pages = geom.n_pages(pool.len());
    for (i, s) in seqs.iter().enumerate() {
        assert_eq!(
            s.q.len(),
            qw,
            "sequence {i}: query of {} values, expected {qw}",
            s.q.len()
        );
        check_table(geom, n_pages, i, s.block_table, s.seq_len, generations)?;
    }
    let isa = exec.isa.or_portable();
    let nkv = geom.n_kv_heads;
    let outp = SharedMut::new(out);
    let task = |i: usize| {
        let (si, kvh) = (i / nkv, i % nkv);
        let s = &seqs[si];
        let start = si * qw + kvh * group * hd;
        // SAFETY: task (si, kvh) alone writes this head group of sequence si.
        let o = unsafe { outp.slice(start, group * hd) };
        if s.seq_len == 0 {
            o.fill(0.0);
            return;
        }
        let q = &s.q[kvh * group * hd..(kvh + 1) * group * hd];
        attend_group(
            isa,
            pool,
            geom,
            layer,
            kvh,
            s.block_table,
            s.seq_len,
            scale,
            q,
            o,
        );
    };
    let work: usize = seqs.iter().map(|s| s.seq_len).sum::<usize>() * qw;
    if work < 32_768 {
        (0..seqs.len() * nkv).for_each(task);
    } else {
        exec.pool.run(seqs.len() * nkv, task);
    }
    Ok(())
}

/// Prefill of one chunk of one sequence: `n_new` queries (`q`, `n_new ×
/// n_heads × head_dim`) at positions `start_pos..start_pos + n_new`, whose K/V
/// are already in the pool; query `i` attends causally to positions
/// `0..=start_pos + i`. `out` has the shape of `q`. Runs on the global pool.
///
/// # Panics
/// If the block table does not cover `start_pos + n_new` tokens inside the
/// pool (nothing is read then), or on shape mismatches.
#[allow(clippy::too_many_arguments)]
pub fn paged_attention_prefill(
    pool: &[f16],
    geom: &KvGeometry,
    layer: usize,
    n_heads: usize,
    scale: f32,
    q: &[f32],
    block_table: &[PageRef],
    start_pos: usize,
    n_new: usize,
    out: &mut [f32],
) {
    let r = prefill_impl(
        Exec::global(),
        pool,
        geom,
        layer,
        n_heads,
        scale,
        q,
        block_table,
        start_pos,
        n_new,
        out,
        None,
    );
    if let Err(e) = r {
        panic!("paged_attention_prefill: {e}");
    }
}

/// [`paged_attention_prefill`] that refuses — reading nothing — when a
/// `PageRef` to be read does not match `generations[page]`. Errors name
/// sequence 0 (the only sequence of the call).
///
/// # Errors
/// As [`paged_attention_decode_checked`].
///
/// # Panics
/// On shape mismatches.
#[allow(clippy::too_many_arguments)]
pub fn paged_attention_prefill_checked(
    pool: &[f16],
    geom: &KvGeometry,
    layer: usize,
    n_heads: usize,
    scale: f32,
    q: &[f32],
    block_table: &[PageRef],
    start_pos: usize,
    n_new: usize,
    out: &mut [f32],
    generations: &[Generation],
) -> Result<(), KernelError> {
    prefill_impl(
        Exec::global(),
        pool,
        geom,
        layer,
        n_heads,
        scale,
        q,
        block_table,
        start_pos,
        n_new,
        out,
        Some(generations),
    )
}

/// Prefill attention on a given pool and instruction set; checked when
/// `generations` is given.
///
/// # Errors
/// As [`paged_attention_prefill_checked`].
///
/// # Panics
/// On shape mismatches.
#[allow(clippy::too_many_arguments)]
pub fn prefill_impl(
    exec: Exec,
    pool: &[f16],
    geom: &KvGeometry,
    layer: usize,
    n_heads: usize,
    scale: f32,
    q: &[f32],
    block_table: &[PageRef],
    start_pos: usize,
    n_new: usize,
    out: &mut [f32],
    generations: Option<&[Generation]>,
) -> Result<(), KernelError> {
    let group = assert_heads(geom, layer, n_heads);
    let hd = geom.head_dim;
    let qw = n_heads * hd;
    assert_eq!(
        q.len(),
        n_new * qw,
        "prefill query of {} values for {n_new} tokens",
        q.len()
    );
    assert_eq!(out.len(), q.len(), "prefill output length");
    let n_pages = geom.n_pages(pool.len());
    check_table(
        geom,
        n_pages,
        0,
        block_table,
        start_pos + n_new,
        generations,
    )?;
    let isa = exec.isa.or_portable();
    let nkv = geom.n_kv_heads;
    let chunk = 4usize;
    let n_chunks = n_new.div_ceil(chunk);
    let outp = SharedMut::new(out);
    exec.pool.run(n_chunks * nkv, |task| {
        let (c, kvh) = (task / nkv, task % nkv);
        for i in c * chunk..((c + 1) * chunk).min(n_new) {
            let start = i * qw + kvh * group * hd;
            // SAFETY: task (c, kvh) alone writes head group kvh of queries in chunk c.
            let o = unsafe { outp.slice(start, group * hd) };
            let qs = &q[start..start + group * hd];
            attend_group(
                isa,
                pool,
                geom,
                layer,
                kvh,
                block_table,
                start_pos + i + 1,
                scale,
                qs,
                o,
            );
        }
    });
    Ok(())
}
