//! Batch checks over the buffers an engine hands its attention and store
//! kernels — the kernels' own arguments, not a second description of them.
//! An engine that cannot change its kernels (FlashAttention, FlashInfer,
//! Triton) passes kvsan the same buffers, with the request of each row,
//! just before the launch:
//!
//! | layout | engines | buffers |
//! | --- | --- | --- |
//! | padded block table | vLLM, FlashAttention | `block_table[rows × stride]`, `seq_lens[rows]` |
//! | paged CSR | FlashInfer | `indptr[rows + 1]`, `indices[nnz]`, `last_page_len[rows]` |
//! | token table | SGLang | `req_to_token[reqs × stride]`, `req_indices[rows]`, `seq_lens[rows]` |
//! | store slots | vLLM's `reshape_and_cache` | `query_start_loc[rows + 1]`, `slot_mapping[tokens]` (−1: padding) |
//!
//! Each entry is read where the kernel reads it — a row whose length runs
//! past its `stride` reads the next row's entries, and those are checked as
//! that row's reads — and a page index is taken at the page's current
//! generation (these buffers carry no tags), so a stale or reused buffer
//! shows as a read of pages another request holds (`foreign-read`) or that
//! are free (`read-free-page`). Reads are checked as [`Sanitizer::read`]
//! checks them; a store slot as [`Sanitizer::write`] does (and is recorded
//! written). Each row gets its own verdict. An entry the kernel could not
//! use at all — outside the buffer or the pool, a negative length, offsets
//! that go backwards — is a [`SanitizerError::BadBatch`] naming the row;
//! every row's buffers are looked at before any is checked, so such a call
//! reports and records nothing.

use std::ops::Range;

use super::Sanitizer;
use crate::error::SanitizerError;
use crate::ids::{Owner, PageId, PageRef, PoolId};
use crate::pool::ShadowPool;
use crate::violation::Verdict;

impl Sanitizer {
    /// Attention over a padded block table: row `r` (of request
    /// `owners[r]`) reads `seq_lens[r]` tokens through the entries from
    /// `block_table[r × stride]` on, for `layers`.
    ///
    /// # Errors
    /// Unknown pool, bad layers; [`SanitizerError::BadBatch`] for arrays of
    /// the wrong length, a negative length, an entry past the buffer, or a
    /// page index outside the pool.
    #[allow(clippy::too_many_arguments)]
    pub fn check_block_table(
        &self,
        pool: PoolId,
        owners: &[Owner],
        block_table: &[i32],
        stride: usize,
        seq_lens: &[i32],
        layers: Range<u32>,
        step: u64,
    ) -> Result<Vec<Verdict>, SanitizerError> {
        const LAYOUT: &str = "block table";
        let shadow = self.pool(pool)?;
        same_rows(LAYOUT, owners.len(), "seq_lens", seq_lens.len())?;
        let ps = shadow.geometry.page_slots as usize;
        let mut rows = Vec::with_capacity(owners.len());
        for (row, &len) in seq_lens.iter().enumerate() {
            let tokens = count(LAYOUT, row, "seq_lens", len)?;
            let entries = tokens.div_ceil(ps);
            // A length past the buffer fails below; never allocate for it.
            let mut table = Vec::with_capacity(entries.min(block_table.len()));
            for entry in 0..entries {
                let at = row.saturating_mul(stride).saturating_add(entry);
                let Some(&index) = block_table.get(at) else {
                    return Err(bad(
                        LAYOUT,
                        row,
                        format!(
                            "{tokens} tokens read {entries} entries; entry {entry} is at index {at} (row × stride {stride} + entry), past the buffer's {} entries",
                            block_table.len()
                        ),
                    ));
                };
                table.push(current(shadow, LAYOUT, row, i64::from(index))?);
            }
            rows.push((table, tokens));
        }
        self.read_rows(pool, owners, &rows, &layers, step)
    }

    /// Attention over pages in CSR form (FlashInfer): row `r` reads the
    /// pages `indices[indptr[r]..indptr[r + 1]]`, all of them full but the
    /// last, which holds `last_page_len[r]` tokens.
    ///
    /// # Errors
    /// As [`Sanitizer::check_block_table`]; also offsets that go backwards
    /// or a `last_page_len` outside `1..=page_slots` for a row with pages.
    #[allow(clippy::too_many_arguments)]
    pub fn check_paged_csr(
        &self,
        pool: PoolId,
        owners: &[Owner],
        indptr: &[i32],
        indices: &[i32],
        last_page_len: &[i32],
        layers: Range<u32>,
        step: u64,
    ) -> Result<Vec<Verdict>, SanitizerError> {
        const LAYOUT: &str = "paged CSR";
        let shadow = self.pool(pool)?;
        same_rows(LAYOUT, owners.len() + 1, "indptr", indptr.len())?;
        same_rows(LAYOUT, owners.len(), "last_page_len", last_page_len.len())?;
        let ps = shadow.geometry.page_slots as usize;
        let mut rows = Vec::with_capacity(owners.len());
        for row in 0..owners.len() {
            let span = offsets(LAYOUT, row, "indptr", indptr[row], indptr[row + 1])?;
            let Some(pages) = indices.get(span.clone()) else {
                return Err(bad(
                    LAYOUT,
                    row,
                    format!(
                        "pages {}..{} are past the {} indices",
                        span.start,
                        span.end,
                        indices.len()
                    ),
                ));
            };
            let last = count(LAYOUT, row, "last_page_len", last_page_len[row])?;
            if !pages.is_empty() && !(1..=ps).contains(&last) {
                return Err(bad(
                    LAYOUT,
                    row,
                    format!("last_page_len {last} is outside 1..={ps} (slots of a page)"),
                ));
            }
            let tokens =
                pages.len().saturating_sub(1) * ps + if pages.is_empty() { 0 } else { last };
            let table = pages
                .iter()
                .map(|&i| current(shadow, LAYOUT, row, i64::from(i)))
                .collect::<Result<Vec<_>, _>>()?;
            rows.push((table, tokens));
        }
        self.read_rows(pool, owners, &rows, &layers, step)
    }

    /// Attention over a token-level table (SGLang): row `r` reads
    /// `seq_lens[r]` tokens whose locations (page × page_slots + slot) are
    /// `req_to_token[req_indices[r] × stride ..]`.
    ///
    /// # Errors
    /// As [`Sanitizer::check_block_table`]; also a negative location.
    #[allow(clippy::too_many_arguments)]
    pub fn check_req_to_token(
        &self,
        pool: PoolId,
        owners: &[Owner],
        req_to_token: &[i32],
        stride: usize,
        req_indices: &[i32],
        seq_lens: &[i32],
        layers: Range<u32>,
        step: u64,
    ) -> Result<Vec<Verdict>, SanitizerError> {
        const LAYOUT: &str = "req_to_token";
        let shadow = self.pool(pool)?;
        self.check_layers(shadow, &layers)?;
        same_rows(LAYOUT, owners.len(), "req_indices", req_indices.len())?;
        same_rows(LAYOUT, owners.len(), "seq_lens", seq_lens.len())?;
        let mut rows = Vec::with_capacity(owners.len());
        for row in 0..owners.len() {
            let req = count(LAYOUT, row, "req_indices", req_indices[row])?;
            let tokens = count(LAYOUT, row, "seq_lens", seq_lens[row])?;
            let base = req.saturating_mul(stride);
            let locations = (0..tokens).map(|t| {
                let at = base.saturating_add(t);
                match req_to_token.get(at) {
                    Some(&loc) => Ok((t, i64::from(loc))),
                    None => Err(bad(
                        LAYOUT,
                        row,
                        format!(
                            "token {t} of request slot {req} is at index {at} (req × stride {stride} + token), past the buffer's {} entries",
                            req_to_token.len()
                        ),
                    )),
                }
            });
            rows.push((runs(shadow, LAYOUT, row, locations)?, tokens));
        }
        let mut verdicts = Vec::with_capacity(owners.len());
        for (&owner, (runs, tokens)) in owners.iter().zip(&rows) {
            verdicts.push(self.read_runs(shadow, owner, *tokens, runs, &layers, step)?);
        }
        Ok(verdicts)
    }

    /// A store kernel's slots: the tokens `query_start_loc[r]..[r + 1]`
    /// belong to row `r`, and token `t`'s KV goes to location
    /// `slot_mapping[t]` (page × page_slots + slot; −1 is padding, not
    /// stored), for `layers`. Each slot is checked and recorded as
    /// [`Sanitizer::write`] does.
    ///
    /// # Errors
    /// As [`Sanitizer::check_block_table`]; also a negative location other
    /// than −1.
    pub fn check_slot_mapping(
        &self,
        pool: PoolId,
        owners: &[Owner],
        query_start_loc: &[i32],
        slot_mapping: &[i64],
        layers: Range<u32>,
        step: u64,
    ) -> Result<Vec<Verdict>, SanitizerError> {
        const LAYOUT: &str = "slot_mapping";
        let shadow = self.pool(pool)?;
        same_rows(
            LAYOUT,
            owners.len() + 1,
            "query_start_loc",
            query_start_loc.len(),
        )?;
        self.check_layers(shadow, &layers)?;
        let mut rows = Vec::with_capacity(owners.len());
        for row in 0..owners.len() {
            let span = offsets(
                LAYOUT,
                row,
                "query_start_loc",
                query_start_loc[row],
                query_start_loc[row + 1],
            )?;
            let Some(slots) = slot_mapping.get(span.clone()) else {
                return Err(bad(
                    LAYOUT,
                    row,
                    format!(
                        "tokens {}..{} are past the {} slots",
                        span.start,
                        span.end,
                        slot_mapping.len()
                    ),
                ));
            };
            let stored = slots
                .iter()
                .enumerate()
                .filter(|&(_, &loc)| loc != -1)
                .map(|(t, &loc)| Ok((span.start + t, loc)));
            rows.push(runs(shadow, LAYOUT, row, stored)?);
        }
        let mut verdicts = Vec::with_capacity(owners.len());
        for (&owner, runs) in owners.iter().zip(rows) {
            let mut verdict = Verdict::Continue;
            for run in runs {
                let v = self.write(pool, owner, run.page, run.slots, layers.clone(), step)?;
                if !v.is_continue() {
                    verdict = v;
                    break;
                }
            }
            verdicts.push(verdict);
        }
        Ok(verdicts)
    }

    /// Each row's read through its table, once every row's buffers were
    /// found usable.
    fn read_rows(
        &self,
        pool: PoolId,
        owners: &[Owner],
        rows: &[(Vec<PageRef>, usize)],
        layers: &Range<u32>,
        step: u64,
    ) -> Result<Vec<Verdict>, SanitizerError> {
        owners
            .iter()
            .zip(rows)
            .map(|(&owner, (table, tokens))| {
                self.read(pool, owner, table, *tokens, layers.clone(), step)
            })
            .collect()
    }

    /// Reads of `runs` by `owner` (a row of `tokens` tokens), as
    /// [`Sanitizer::read`] checks a block table's pages.
    fn read_runs(
        &self,
        shadow: &ShadowPool,
        owner: Owner,
        tokens: usize,
        runs: &[Run],
        layers: &Range<u32>,
        step: u64,
    ) -> Result<Verdict, SanitizerError> {
        self.checks.read(runs.len() as u64);
        if let Some(verdict) = self.terminal_reader(shadow.id, owner, tokens, step) {
            return Ok(verdict);
        }
        let ps = shadow.geometry.page_slots as usize;
        for run in runs {
            let needed = shadow.layout.needed(run.slots.clone(), layers);
            if let Some(verdict) = self.read_page(
                shadow,
                owner,
                run.first_token / ps.max(1),
                run.page,
                run.slots.clone(),
                layers,
                &needed,
                Some(step),
            )? {
                return Ok(verdict);
            }
        }
        Ok(Verdict::Continue)
    }
}

/// Consecutive tokens in consecutive slots of one page.
#[derive(Debug)]
struct Run {
    first_token: usize,
    page: PageRef,
    slots: Range<u32>,
}

/// Groups `(token, location)` pairs into runs, each location checked to be
/// a slot of the pool.
fn runs(
    shadow: &ShadowPool,
    layout: &'static str,
    row: usize,
    locations: impl Iterator<Item = Result<(usize, i64), SanitizerError>>,
) -> Result<Vec<Run>, SanitizerError> {
    let ps = i64::from(shadow.geometry.page_slots);
    let mut out: Vec<Run> = Vec::new();
    for item in locations {
        let (token, loc) = item?;
        if loc < 0 {
            return Err(bad(
                layout,
                row,
                format!("token {token} has location {loc}: not a slot of the pool"),
            ));
        }
        let (page, slot) = (loc / ps, (loc % ps) as u32);
        if let Some(last) = out.last_mut()
            && i64::from(last.page.page.0) == page
            && last.slots.end == slot
        {
            last.slots.end += 1;
            continue;
        }
        out.push(Run {
            first_token: token,
            page: current(shadow, layout, row, page)?,
            slots: slot..slot + 1,
        });
    }
    Ok(out)
}

/// The page at `index` with its current generation.
fn current(
    shadow: &ShadowPool,
    layout: &'static str,
    row: usize,
    index: i64,
) -> Result<PageRef, SanitizerError> {
    let pages = shadow.geometry.pages;
    let page = u32::try_from(index)
        .ok()
        .filter(|&p| p < pages)
        .ok_or_else(|| {
            bad(
                layout,
                row,
                format!("page index {index} is outside the pool's {pages} pages"),
            )
        })?;
    let view = shadow.page(PageId(page))?;
    Ok(PageRef {
        page: PageId(page),
        generation: view.rec.load().generation(),
    })
}

fn bad(layout: &'static str, row: usize, what: String) -> SanitizerError {
    SanitizerError::BadBatch { layout, row, what }
}

/// `array` must have `want` entries (one per row, or rows + 1 offsets).
fn same_rows(
    layout: &'static str,
    want: usize,
    array: &'static str,
    len: usize,
) -> Result<(), SanitizerError> {
    if want == len {
        return Ok(());
    }
    Err(SanitizerError::BadBatch {
        layout,
        row: 0,
        what: format!("`{array}` has {len} entries, the batch needs {want}"),
    })
}

/// A length or index from an `i32` buffer: never negative.
fn count(
    layout: &'static str,
    row: usize,
    array: &'static str,
    value: i32,
) -> Result<usize, SanitizerError> {
    usize::try_from(value).map_err(|_| bad(layout, row, format!("`{array}` is {value}")))
}

/// The row's span from two offsets of `array`.
fn offsets(
    layout: &'static str,
    row: usize,
    array: &'static str,
    start: i32,
    end: i32,
) -> Result<Range<usize>, SanitizerError> {
    let (a, b) = (
        count(layout, row, array, start)?,
        count(layout, row, array, end)?,
    );
    if b < a {
        return Err(bad(
            layout,
            row,
            format!("`{array}` goes backwards: {a} then {b}"),
        ));
    }
    Ok(a..b)
}
