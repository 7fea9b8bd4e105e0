//! The one way the forward pass reaches KV memory.
//!
//! A step's [`StepBatch`] holds exactly what the KV kernels receive — the
//! batch's block-table array, per-row sequence lengths, the rows' query
//! spans, the per-token store slot mapping (padding rows included) — and
//! each row's owner. [`KvAccess`] pairs it with the pool and a guard, and is
//! all the forward pass gets: it stores K/V and runs attention through the
//! batch kernels, and every page they touch is checked, in the kernel, with
//! the kernel's own arguments:
//!
//! ```text
//!  StepBatch ──▶ store_kv(layer) ──┐
//!            └─▶ attend(layer) ────┤ per page touched: guard
//!                                  ├─ sanitizer attached: its kernel shadow
//!                                  │  (owner, generation, written slots of the layer)
//!                                  ├─ debug build, no sanitizer: the pool's generations
//!                                  └─ release build: the pool's bounds only
//!  a refusal ─▶ cold path (KvHooks::kernel_refusal: report, verdict) ─▶ the row stops
//! ```
//!
//! Nothing describes the accesses a second time: the hooks are not told
//! "request X will read these pages"; the kernels ask about the pages they
//! are reading. The host-side work per step is O(rows) (the guard's row
//! ledger); the checks cost one record and one bit word per page touched.
//!
//! With poison on (freed pages filled with NaN), attention output that
//! turns NaN is traced to the poisoned slot it came from and reported as
//! `poison-read`: poison never becomes an answer.

use std::sync::Mutex;
use std::sync::atomic::{AtomicBool, Ordering};

use half::f16;
use kvsan_kernels::guard::{Access, Reason, Refusal};
use kvsan_kernels::{
    Exec, GenerationChecked, KvBatch, KvGeometry, KvGuard, RowLedger, StoreSlot, Unchecked,
};
use kvsan_sanitizer::{
    AccessOp, Check, KernelAccess, KernelShadow, Owner, PageRef, PoolId, Verdict,
};

use crate::EngineError;
use crate::hooks::Hooks;
use crate::kv_pool::{KvPool, POISON_F16_BITS};

/// Which logits a row wants back.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Logits {
    /// None (a prefill chunk that is not the prompt's last, a padding row).
    None,
    /// The row's last token (the next-token distribution).
    Last,
    /// Every token of the row (scoring, teacher forcing).
    All,
}

/// How the kernels check the pages they touch.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum AttentionCheck {
    /// Plain kernels (release builds): only the pool's bounds.
    Unchecked,
    /// Every `PageRef` compared with the pool's generation array before the
    /// page is touched (debug builds). With a sanitizer attached, its
    /// kernel shadow is checked instead (generation, owner, written slots).
    Generations,
}

/// One step's batch: the kernels' arrays and each row's owner and logits.
#[derive(Clone, Debug, Default)]
pub struct StepBatch {
    /// The step's tokens, row after row.
    pub tokens: Vec<u32>,
    /// Each token's position in its sequence.
    pub positions: Vec<usize>,
    /// `rows × width` block-table entries, row-major.
    pub block_tables: Vec<PageRef>,
    /// Entries per row.
    pub width: usize,
    /// Per row: the tokens attention reads.
    pub seq_lens: Vec<u32>,
    /// `rows + 1` offsets of each row's tokens.
    pub query_start: Vec<u32>,
    /// Per token: where its K and V go.
    pub store_slots: Vec<StoreSlot>,
    /// Per row: the request whose row it is.
    pub owners: Vec<Owner>,
    /// Per row: which logits it wants.
    pub logits: Vec<Logits>,
}

impl StepBatch {
    /// The arrays as the kernels take them.
    #[must_use]
    pub fn kernel_view(&self) -> KvBatch<'_> {
        KvBatch {
            block_tables: &self.block_tables,
            width: self.width,
            seq_lens: &self.seq_lens,
            query_start: &self.query_start,
            store_slots: &self.store_slots,
        }
    }

    /// Rows.
    #[must_use]
    pub fn rows(&self) -> usize {
        self.owners.len()
    }

    /// Row `r`'s tokens.
    #[must_use]
    pub fn row_tokens(&self, r: usize) -> std::ops::Range<usize> {
        self.query_start[r] as usize..self.query_start[r + 1] as usize
    }
}

/// One sequence's share of a step, for a batch built outside a node
/// (tools, tests, benchmarks): `tokens` new tokens from `start_pos`, its
/// pages, the logits it wants.
#[derive(Clone, Copy, Debug)]
pub struct SeqChunk<'a> {
    /// The new tokens.
    pub tokens: &'a [u32],
    /// Position of `tokens[0]` in the sequence.
    pub start_pos: usize,
    /// The sequence's pages, covering `start_pos + tokens.len()` positions.
    pub block_table: &'a [PageRef],
    /// Which logits to return.
    pub logits: Logits,
}

impl StepBatch {
    /// The batch of `chunks` over `page_slots`-slot pages, built plainly:
    /// one row per chunk, its block table as its row, its store slots from
    /// that row, owners numbered from 1.
    ///
    /// # Errors
    /// [`EngineError::InvalidBatch`] naming the chunk whose block table does
    /// not cover its positions.
    pub fn of_chunks(chunks: &[SeqChunk<'_>], page_slots: usize) -> Result<StepBatch, EngineError> {
        let width = chunks
            .iter()
            .map(|c| c.block_table.len())
            .max()
            .unwrap_or(0)
            .max(1);
        let mut b = StepBatch {
            width,
            query_start: vec![0],
            ..StepBatch::default()
        };
        for (i, c) in chunks.iter().enumerate() {
            let end = c.start_pos + c.tokens.len();
            if c.block_table.len() * page_slots < end {
                return Err(EngineError::InvalidBatch {
                    chunk: i,
                    what: format!(
                        "block table of {} pages × {page_slots} slots does not cover {end} positions",
                        c.block_table.len()
                    ),
                });
            }
            let row = b.block_tables.len();
            b.block_tables.extend_from_slice(c.block_table);
            b.block_tables
                .resize(row + width, PageRef::new(u32::MAX, 0));
            for (t, &token) in c.tokens.iter().enumerate() {
                let pos = c.start_pos + t;
                b.tokens.push(token);
                b.positions.push(pos);
                b.store_slots.push(StoreSlot {
                    page: b.block_tables[row + pos / page_slots],
                    slot: (pos % page_slots) as u32,
                });
            }
            b.seq_lens.push(end as u32);
            b.query_start.push(b.tokens.len() as u32);
            b.owners.push(Owner::new(i as u64 + 1, 0));
            b.logits.push(c.logits);
        }
        Ok(b)
    }
}

/// Why a row stopped.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum RowFault {
    /// The attached target's verdict on a refused access.
    Violation(Verdict),
    /// The pool's generation check refused a tag (no sanitizer attached).
    Generation(Refusal),
    /// A page or entry outside the pool or the block-table array.
    Outside(Refusal),
    /// Attention output turned NaN and no slot the row read holds poison.
    Nan {
        /// The layer.
        layer: usize,
    },
}

/// The sanitizer's cold path for one step: verdicts by row, and the rows
/// whose first violation was reported and let go on (`on_violation=report`).
struct ColdPath<'a> {
    hooks: &'a Hooks,
    pool: PoolId,
    step: u64,
    owners: &'a [Owner],
    verdicts: Mutex<Vec<(usize, Verdict)>>,
    reported: Box<[AtomicBool]>,
}

impl ColdPath<'_> {
    /// Hands a refused (or shared) access to the target; `false` stops the
    /// row. One row's accesses reach the target one at a time (the KV heads
    /// of a row run as separate tasks and may refuse the same page at once),
    /// and none after the row has stopped, so one fault is reported once.
    #[cold]
    #[inline(never)]
    fn decide(&self, ledger: &RowLedger, row: usize, access: KernelAccess, fast: Check) -> bool {
        let mut verdicts = self
            .verdicts
            .lock()
            .unwrap_or_else(std::sync::PoisonError::into_inner);
        if !ledger.live(row) {
            return false;
        }
        if self.reported(row) {
            return true;
        }
        let verdict = self
            .hooks
            .kernel_refusal(self.pool, self.owners[row], &access, self.step);
        if verdict.is_continue() {
            // A sharer's legal read passes and stays checked; a reported
            // violation the options let go on is not reported again for this
            // row in this step.
            if matches!(fast, Check::Refused(_)) {
                self.reported[row].store(true, Ordering::Relaxed);
            }
            return true;
        }
        let refusal = Refusal {
            row,
            access: match access.op {
                AccessOp::Store => Access::Store {
                    token: access.entry as usize,
                    layer: access.layer as usize,
                    slot: access.slots.start as usize,
                },
                AccessOp::Read | AccessOp::Poison => Access::Read {
                    entry: access.entry as usize,
                    layer: access.layer as usize,
                    slots: access.slots.end as usize,
                },
            },
            page: access.page,
            reason: Reason::Checked,
        };
        verdicts.push((row, verdict));
        ledger.refuse(refusal);
        false
    }

    fn reported(&self, row: usize) -> bool {
        self.reported[row].load(Ordering::Relaxed)
    }
}

/// The sanitizer's kernel shadow as a guard.
struct ShadowGuard<'a> {
    ledger: &'a RowLedger,
    shadow: KernelShadow<'a>,
    cold: &'a ColdPath<'a>,
}

impl ShadowGuard<'_> {
    /// The fast path's answer `fast` for `row`: legal, already reported for
    /// this step, or the cold path's decision on `access`.
    #[inline]
    fn settle(&self, row: usize, fast: Check, access: impl FnOnce() -> KernelAccess) -> bool {
        match fast {
            Check::Ok => true,
            _ if self.cold.reported(row) => true,
            fast => self.cold.decide(self.ledger, row, access(), fast),
        }
    }
}

impl KvGuard for ShadowGuard<'_> {
    fn ledger(&self) -> &RowLedger {
        self.ledger
    }

    #[inline]
    fn read(&self, row: usize, entry: usize, page: PageRef, layer: usize, slots: usize) -> bool {
        let who = self.cold.owners[row].request;
        let fast = self
            .shadow
            .check_read(who, page, layer as u32, slots as u32);
        self.settle(row, fast, || KernelAccess {
            op: AccessOp::Read,
            page,
            entry: entry as u32,
            layer: layer as u32,
            slots: 0..slots as u32,
        })
    }

    #[inline]
    fn store(&self, row: usize, token: usize, page: PageRef, slot: usize, layer: usize) -> bool {
        let who = self.cold.owners[row].request;
        let fast = self
            .shadow
            .store(who, page, layer as u32, slot as u32, self.cold.step);
        self.settle(row, fast, || KernelAccess {
            op: AccessOp::Store,
            page,
            entry: token as u32,
            layer: layer as u32,
            slots: slot as u32..slot as u32 + 1,
        })
    }

    #[inline]
    fn count(&self, read_pages: u64, stores: u64) {
        self.shadow.count(read_pages, stores);
    }
}

/// The guard of a step, one of three.
enum StepGuard<'a> {
    Unchecked(Unchecked<'a>),
    Generations(GenerationChecked<'a>),
    Shadow(ShadowGuard<'a>),
}

macro_rules! each_guard {
    ($self:ident, $g:ident => $e:expr) => {
        match $self {
            StepGuard::Unchecked($g) => $e,
            StepGuard::Generations($g) => $e,
            StepGuard::Shadow($g) => $e,
        }
    };
}

impl KvGuard for StepGuard<'_> {
    fn ledger(&self) -> &RowLedger {
        each_guard!(self, g => g.ledger())
    }

    #[inline]
    fn read(&self, row: usize, entry: usize, page: PageRef, layer: usize, slots: usize) -> bool {
        each_guard!(self, g => g.read(row, entry, page, layer, slots))
    }

    #[inline]
    fn store(&self, row: usize, token: usize, page: PageRef, slot: usize, layer: usize) -> bool {
        each_guard!(self, g => g.store(row, token, page, slot, layer))
    }

    #[inline]
    fn count(&self, read_pages: u64, stores: u64) {
        each_guard!(self, g => g.count(read_pages, stores));
    }
}

fn make_guard<'g>(
    shadow: Option<KernelShadow<'g>>,
    check: AttentionCheck,
    ledger: &'g RowLedger,
    cold: &'g ColdPath<'g>,
    generations: &'g [kvsan_sanitizer::Generation],
) -> StepGuard<'g> {
    match (shadow, check) {
        (Some(shadow), _) => StepGuard::Shadow(ShadowGuard {
            ledger,
            shadow,
            cold,
        }),
        (None, AttentionCheck::Generations) => StepGuard::Generations(GenerationChecked {
            ledger,
            generations,
        }),
        (None, AttentionCheck::Unchecked) => StepGuard::Unchecked(Unchecked { ledger }),
    }
}

/// One step's access to the pool (see the module doc).
pub struct KvAccess<'a> {
    pool: &'a mut KvPool,
    batch: &'a StepBatch,
    check: AttentionCheck,
    shadow: Option<KernelShadow<'a>>,
    poison: bool,
    ledger: RowLedger,
    cold: ColdPath<'a>,
    nan: Mutex<Vec<(usize, usize)>>,
}

impl<'a> KvAccess<'a> {
    /// Access to `pool` for `batch` at `step`: checked against `shadow`
    /// when a sanitizer gave one (refusals go to `hooks`), else as `check`
    /// says; NaN attention output is traced to poison when `hooks` poisons
    /// freed pages.
    pub fn new(
        pool: &'a mut KvPool,
        batch: &'a StepBatch,
        check: AttentionCheck,
        shadow: Option<KernelShadow<'a>>,
        hooks: &'a Hooks,
        pool_id: PoolId,
        step: u64,
    ) -> KvAccess<'a> {
        let rows = batch.rows();
        KvAccess {
            pool,
            batch,
            check,
            shadow,
            poison: hooks.poison(),
            ledger: RowLedger::new(rows),
            cold: ColdPath {
                hooks,
                pool: pool_id,
                step,
                owners: &batch.owners,
                verdicts: Mutex::new(Vec::new()),
                reported: (0..rows).map(|_| AtomicBool::new(false)).collect(),
            },
            nan: Mutex::new(Vec::new()),
        }
    }

    /// The batch.
    #[must_use]
    pub fn batch(&self) -> &StepBatch {
        self.batch
    }

    /// The pool's geometry.
    #[must_use]
    pub fn geometry(&self) -> &KvGeometry {
        self.pool.geometry()
    }

    /// Stores every token's K and V of `layer` (`tokens × kv_dim` each)
    /// where the store slot mapping says; rows marked in `skip` store
    /// nothing this layer (fault `skip-layer-write`: their store path
    /// stops short).
    pub fn store(&mut self, layer: usize, k: &[f32], v: &[f32], skip: &[bool]) {
        let geom = *self.pool.geometry();
        let (data, generations) = self.pool.data_and_generations_mut();
        let guard = make_guard(
            self.shadow,
            self.check,
            &self.ledger,
            &self.cold,
            generations,
        );
        if skip.iter().any(|&s| s) {
            let mut slots = self.batch.store_slots.clone();
            for r in (0..self.batch.rows()).filter(|&r| skip[r]) {
                slots[self.batch.row_tokens(r)].fill(StoreSlot::PADDING);
            }
            let batch = KvBatch {
                store_slots: &slots,
                ..self.batch.kernel_view()
            };
            kvsan_kernels::store_kv(data, &geom, layer, &batch, k, v, &guard);
        } else {
            kvsan_kernels::store_kv(data, &geom, layer, &self.batch.kernel_view(), k, v, &guard);
        }
    }

    /// Attention of every row's tokens over its pages for `layer`.
    pub fn attend(&self, layer: usize, n_heads: usize, scale: f32, q: &[f32], out: &mut [f32]) {
        let guard = make_guard(
            self.shadow,
            self.check,
            &self.ledger,
            &self.cold,
            self.pool.generations(),
        );
        kvsan_kernels::attend(
            Exec::global(),
            self.pool.data(),
            self.pool.geometry(),
            layer,
            n_heads,
            scale,
            &self.batch.kernel_view(),
            q,
            out,
            &guard,
        );
        if self.poison {
            let width = n_heads * self.pool.geometry().head_dim;
            for r in 0..self.batch.rows() {
                let tokens = self.batch.row_tokens(r);
                if self.ledger.live(r)
                    && out[tokens.start * width..tokens.end * width]
                        .iter()
                        .any(|v| v.is_nan())
                {
                    self.poison_source(r, layer);
                }
            }
        }
    }

    /// Row `r`'s attention output of `layer` turned NaN: finds the poisoned
    /// slot it read (cold: a walk of the row's pages) and hands it to the
    /// target as a `poison` access; a NaN with no poison behind it stops
    /// the row as an engine error.
    #[cold]
    fn poison_source(&self, r: usize, layer: usize) {
        let g = *self.pool.geometry();
        let seq_len = self.batch.seq_lens[r] as usize;
        let data = self.pool.data();
        let found = (0..seq_len).find_map(|t| {
            let entry = t / g.page_slots;
            let page = *self.batch.block_tables.get(r * self.batch.width + entry)?;
            if page.page.0 as usize >= self.pool.n_pages() {
                return None;
            }
            let slot = t % g.page_slots;
            let poisoned = (0..2).any(|kv| {
                let o = g.offset(page.page, layer, kv, slot);
                data[o..o + g.slot_width()]
                    .iter()
                    .any(|v| v.to_bits() == POISON_F16_BITS)
            });
            poisoned.then_some((entry, page, slot))
        });
        match found {
            Some((entry, page, slot)) => {
                let access = KernelAccess {
                    op: AccessOp::Poison,
                    page,
                    entry: entry as u32,
                    layer: layer as u32,
                    slots: slot as u32..slot as u32 + 1,
                };
                let _ = self.cold.decide(&self.ledger, r, access, Check::Arbitrate);
            }
            None => {
                self.nan
                    .lock()
                    .unwrap_or_else(std::sync::PoisonError::into_inner)
                    .push((r, layer));
                self.ledger.refuse(Refusal {
                    row: r,
                    access: Access::Read {
                        entry: 0,
                        layer,
                        slots: 0,
                    },
                    page: PageRef::default(),
                    reason: Reason::Checked,
                });
            }
        }
    }

    /// Whether row `r` still runs.
    #[must_use]
    pub fn live(&self, r: usize) -> bool {
        self.ledger.live(r)
    }

    /// Why each stopped row stopped, by row.
    #[must_use]
    pub fn finish(self) -> Vec<(usize, RowFault)> {
        let verdicts = self
            .cold
            .verdicts
            .into_inner()
            .unwrap_or_else(std::sync::PoisonError::into_inner);
        let nan = self
            .nan
            .into_inner()
            .unwrap_or_else(std::sync::PoisonError::into_inner);
        self.ledger
            .refusals()
            .into_iter()
            .map(|refusal| {
                let row = refusal.row;
                let fault = match refusal.reason {
                    Reason::Outside { .. } => RowFault::Outside(refusal),
                    Reason::Generation { .. } => RowFault::Generation(refusal),
                    Reason::Checked => match verdicts.iter().find(|(r, _)| *r == row) {
                        Some((_, v)) => RowFault::Violation(*v),
                        None => RowFault::Nan {
                            layer: nan.iter().find(|(r, _)| *r == row).map_or(0, |&(_, l)| l),
                        },
                    },
                };
                (row, fault)
            })
            .collect()
    }
}

/// Whether a value carries the poison pattern (for tests and dumps).
#[must_use]
pub fn is_poison(v: f16) -> bool {
    v.to_bits() == POISON_F16_BITS
}
