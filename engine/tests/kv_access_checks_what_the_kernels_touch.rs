//! The forward pass reaches the KV pool only through `KvAccess`, whose
//! kernels check each page they touch against the sanitizer's kernel
//! shadow with the arguments they were handed. Batches built wrong by hand —
//! a length, a row's block table, a store slot — are stopped with the kind
//! of what they really do, and poison that reaches attention output is
//! reported with the page it came from.

use std::sync::Arc;

use kvsan_engine::hooks::Hooks;
use kvsan_engine::kv_access::{AttentionCheck, KvAccess, Logits, RowFault, SeqChunk, StepBatch};
use kvsan_engine::kv_pool::KvPool;
use kvsan_engine::model::{Model, SyntheticSpec};
use kvsan_sanitizer::{
    NodeRole, Options, Owner, PageRef, PoolGeometry, PoolId, ReportBuffer, Sanitizer, Verdict,
    ViolationKind,
};

const SLOTS: usize = 4;

struct Rig {
    model: Model,
    pool: KvPool,
    san: Arc<Sanitizer>,
    pool_id: PoolId,
    hooks: Hooks,
    reports: ReportBuffer,
    step: u64,
}

impl Rig {
    fn new(pages: usize) -> Rig {
        let model = SyntheticSpec::default().build().expect("synthetic model");
        let geometry = model.kv_geometry(SLOTS);
        let pool = KvPool::new(geometry, pages).expect("pool");
        let reports = ReportBuffer::default();
        let san = Arc::new(Sanitizer::with_writer(
            // Poison on: the kernels' NaN scan traces poison to its page.
            Options::parse("report_format=text:poison=1").expect("options"),
            reports.clone(),
        ));
        let pool_id = san
            .pool_register(PoolGeometry {
                pages: pages as u32,
                page_slots: SLOTS as u32,
                layers: geometry.n_layers as u32,
                bytes_per_slot: (geometry.slot_width() * 4) as u64,
                role: NodeRole::Unified,
                node: "unified-0".into(),
            })
            .expect("register");
        let hooks = Hooks::sanitizer(san.clone());
        Rig {
            model,
            pool,
            san,
            pool_id,
            hooks,
            reports,
            step: 0,
        }
    }

    /// `n` pages for `owner` (as `StepBatch::of_chunks` numbers rows: row
    /// `i` is request `i + 1`).
    fn pages(&mut self, owner: Owner, n: usize) -> Vec<PageRef> {
        (0..n)
            .map(|_| {
                let page = self.pool.alloc().expect("a free page");
                let (v, g) = self
                    .san
                    .alloc(self.pool_id, page.page, owner, self.step)
                    .expect("alloc");
                assert!(v.is_continue() && g == page.generation);
                page
            })
            .collect()
    }

    fn free(&mut self, owner: Owner, page: PageRef) {
        assert!(
            self.san
                .free(self.pool_id, owner, page, self.step)
                .expect("free")
                .is_continue()
        );
        self.pool.free(page).expect("pool free");
        self.pool.poison_page(page.page);
    }

    /// Runs `batch` through the checked kernels; the stopped rows.
    fn run(&mut self, batch: &StepBatch) -> Vec<(usize, RowFault)> {
        self.step += 1;
        let shadow = self.san.kernel_shadow(self.pool_id).expect("shadow");
        let mut kv = KvAccess::new(
            &mut self.pool,
            batch,
            AttentionCheck::Generations,
            Some(shadow),
            &self.hooks,
            self.pool_id,
            self.step,
        );
        self.model.forward(&mut kv).expect("a batch the model runs");
        kv.finish()
    }
}

fn owner(row: usize) -> Owner {
    Owner::new(row as u64 + 1, 0)
}

fn prompt(n: usize, seed: u32) -> Vec<u32> {
    (0..n as u32).map(|i| (i * 31 + seed * 7) % 256).collect()
}

fn kind_of(fault: &RowFault) -> Option<ViolationKind> {
    match fault {
        RowFault::Violation(Verdict::Abort { kind, .. }) => Some(*kind),
        _ => None,
    }
}

/// Prefills `tokens` for rows 0 and 1 in one step: their tables.
fn two_prefilled(rig: &mut Rig, tokens: usize) -> (Vec<PageRef>, Vec<PageRef>, Vec<u32>) {
    let pages = (tokens + 1).div_ceil(SLOTS);
    let t0 = rig.pages(owner(0), pages);
    let t1 = rig.pages(owner(1), pages);
    let p = prompt(tokens, 1);
    let batch = StepBatch::of_chunks(
        &[
            SeqChunk {
                tokens: &p,
                start_pos: 0,
                block_table: &t0,
                logits: Logits::Last,
            },
            SeqChunk {
                tokens: &p,
                start_pos: 0,
                block_table: &t1,
                logits: Logits::Last,
            },
        ],
        SLOTS,
    )
    .expect("batch");
    assert!(rig.run(&batch).is_empty(), "{}", rig.reports.text());
    (t0, t1, p)
}

fn decode_batch(t0: &[PageRef], t1: &[PageRef], pos: usize) -> StepBatch {
    StepBatch::of_chunks(
        &[
            SeqChunk {
                tokens: &[7],
                start_pos: pos,
                block_table: t0,
                logits: Logits::Last,
            },
            SeqChunk {
                tokens: &[9],
                start_pos: pos,
                block_table: t1,
                logits: Logits::Last,
            },
        ],
        SLOTS,
    )
    .expect("batch")
}

#[test]
fn a_correct_batch_passes_and_every_store_and_page_read_is_counted() {
    let mut rig = Rig::new(16);
    let (t0, t1, _) = two_prefilled(&mut rig, 6);
    assert!(rig.run(&decode_batch(&t0, &t1, 6)).is_empty());
    let checks = rig.san.checks();
    let layers = rig.model.config().n_layers as u64;
    // 2 × 6 prompt tokens and 2 decode tokens, each stored for every layer.
    assert_eq!(checks.kernel_stores, (12 + 2) * layers);
    assert!(checks.kernel_read_pages >= 2 * 2 * layers, "{checks:?}");
    assert_eq!(rig.san.violation_count(), 0, "{}", rig.reports.text());
}

#[test]
fn a_length_past_what_the_row_wrote_is_stopped_as_stale_read_for_that_row_only() {
    let mut rig = Rig::new(16);
    let (t0, t1, _) = two_prefilled(&mut rig, 6);
    let mut batch = decode_batch(&t0, &t1, 6);
    // Row 1's attention length claims the slot after its new token.
    batch.seq_lens[1] += 1;
    let stopped = rig.run(&batch);
    assert_eq!(stopped.len(), 1, "{}", rig.reports.text());
    assert_eq!(stopped[0].0, 1);
    assert_eq!(kind_of(&stopped[0].1), Some(ViolationKind::StaleRead));
    let text = rig.reports.text();
    assert!(text.contains("stale-read in request 2"), "{text}");
    assert!(text.contains("slot 3 (token 7)"), "{text}");
}

#[test]
fn a_row_handed_another_rows_block_table_is_stopped_before_its_store_lands() {
    let mut rig = Rig::new(16);
    let (t0, t1, _) = two_prefilled(&mut rig, 6);
    let mut batch = decode_batch(&t0, &t1, 6);
    // Row 0's block-table row is row 1's: its store slot is computed from it.
    let width = batch.width;
    let (r0, r1) = batch.block_tables.split_at_mut(width);
    r0.copy_from_slice(&r1[..width]);
    batch.store_slots[0].page = batch.block_tables[6 / SLOTS];
    let victim_page = t1[6 / SLOTS].page;
    let before = rig.pool.page_data(victim_page).to_vec();
    let stopped = rig.run(&batch);
    let row0 = stopped
        .iter()
        .find(|(r, _)| *r == 0)
        .expect("row 0 stopped");
    assert_eq!(kind_of(&row0.1), Some(ViolationKind::ForeignWrite));
    // Row 1 wrote its own token into that page; row 0's store did not land:
    // slot 2 holds row 1's KV only (what row 1 alone would have written).
    assert!(stopped.iter().all(|(r, _)| *r != 1), "{stopped:?}");
    let after = rig.pool.page_data(victim_page);
    let g = rig.pool.geometry();
    let w = g.slot_width();
    let o = g.offset(kvsan_sanitizer::PageId(0), 0, 0, 2);
    assert_ne!(after[o..o + w], before[o..o + w], "row 1's own store");
    let mut alone = Rig::new(16);
    let (a0, a1, _) = two_prefilled(&mut alone, 6);
    assert!(alone.run(&decode_batch(&a0, &a1, 6)).is_empty());
    assert_eq!(
        alone.pool.page_data(a1[6 / SLOTS].page)[o..o + w],
        after[o..o + w],
        "the page holds what row 1 alone stores"
    );
}

#[test]
fn poison_that_reaches_attention_output_is_poison_read_naming_the_page() {
    let mut rig = Rig::new(16);
    let (t0, t1, _) = two_prefilled(&mut rig, 6);
    // An engine bug: row 1's page is poison-filled while it still holds it.
    rig.pool.poison_page(t1[0].page);
    let stopped = rig.run(&decode_batch(&t0, &t1, 6));
    assert_eq!(stopped.len(), 1, "{}", rig.reports.text());
    assert_eq!(stopped[0].0, 1);
    assert_eq!(kind_of(&stopped[0].1), Some(ViolationKind::PoisonRead));
    let text = rig.reports.text();
    assert!(
        text.contains(&format!(
            "poison-read in request 2 (tenant 0) reading pool 0 {}",
            t1[0]
        )),
        "{text}"
    );
}

#[test]
fn a_poisoned_page_given_out_again_and_rewritten_is_read_without_a_finding() {
    let mut rig = Rig::new(4);
    let first = rig.pages(owner(0), 2);
    let p = prompt(6, 3);
    let chunk = |t: &[PageRef]| {
        StepBatch::of_chunks(
            &[SeqChunk {
                tokens: &p,
                start_pos: 0,
                block_table: t,
                logits: Logits::Last,
            }],
            SLOTS,
        )
        .expect("batch")
    };
    assert!(rig.run(&chunk(&first)).is_empty());
    for page in first.clone() {
        rig.free(owner(0), page);
    }
    // The same pages (poisoned), the same request id reused by a new row 0.
    let again = rig.pages(owner(0), 2);
    assert!(again.iter().any(|p| first.iter().any(|f| f.page == p.page)));
    assert!(rig.run(&chunk(&again)).is_empty(), "{}", rig.reports.text());
    assert_eq!(rig.san.violation_count(), 0);
}
