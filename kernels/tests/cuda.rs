//! The CUDA kernels against the CPU kernels.
//!
//! Tests that need a GPU are `#[ignore = "requires CUDA"]`; run them where
//! one is, with NVRTC on the library path (`scripts/nvrtc-check --gpu`):
//!
//! ```text
//! cargo test -p kvsan-kernels --features cuda --test cuda -- --include-ignored
//! ```
//!
//! They run the batch kernels and the CPU kernels ([`attend`], [`store_kv`])
//! on the same pool and batch arrays, over the same sanitizer kernel shadow
//! (a real [`Sanitizer`]'s, the CPU guard calling `check_read` / `store`
//! as an engine's does), and compare outputs, refusals and written bits.
//!
//! `cuda_sources_compile_with_nvrtc` runs everywhere: it compiles every CUDA
//! source with a real NVRTC when one can be loaded (`scripts/nvrtc-check`
//! installs one), and says it skipped otherwise — unless
//! `KVSAN_REQUIRE_NVRTC=1`, which makes a missing NVRTC a failure.
#![cfg(feature = "cuda")]

use std::collections::BTreeMap;
use std::ops::Range;
use std::sync::Mutex;

use half::f16;
use kvsan_kernels::attention::{KvBatch, KvGeometry, StoreSlot};
use kvsan_kernels::cuda::result::{driver_present, nvrtc_present};
use kvsan_kernels::cuda::{
    CompileTarget, CudaError, CudaKernelShadow, CudaKernels, CudaKvPool, CudaRefusal, CudaSource,
    EngineBatch, EngineRefusal, ImageKind, POISON_F16_BITS, ReadCheck, SOURCES, StoreCheck,
    compile, cuda_available, nvrtc_version, supported_archs,
};
use kvsan_kernels::error::KernelError;
use kvsan_kernels::guard::{Access, Reason, Refusal};
use kvsan_kernels::{Exec, GenerationChecked, KvGuard, RowLedger, Unchecked, attend, store_kv};
use kvsan_sanitizer::{
    Check, Generation, KernelShadow, NodeRole, Options, Owner, PageId, PageRef, PoolGeometry,
    PoolId, RequestId, RequestState, Sanitizer, ViolationKind,
};
use rand::rngs::StdRng;
use rand::seq::SliceRandom;
use rand::{Rng, SeedableRng};

#[test]
fn cuda_sources_compile_with_nvrtc() {
    if !nvrtc_or_skip() {
        return;
    }
    let (major, minor) = nvrtc_version().expect("NVRTC version");
    let archs = supported_archs().expect("NVRTC architectures");
    eprintln!("NVRTC {major}.{minor}, architectures {archs:?}");
    assert!(
        archs.contains(&90),
        "this NVRTC cannot target sm_90 (H100/H200)"
    );
    for source in SOURCES {
        for target in [CompileTarget::ptx(90), CompileTarget::cubin(90)] {
            let module = match compile(source, target) {
                Ok(module) => module,
                Err(err) => panic!("{err}"),
            };
            assert!(
                module.log.is_empty(),
                "{:?} for {target} compiled with warnings:\n{}",
                source.name,
                module.log
            );
            match target.kind {
                ImageKind::Ptx => {
                    let ptx = module.ptx_text().expect("PTX is text");
                    for kernel in source.kernels {
                        assert!(
                            ptx.contains(&format!(".entry {kernel}(")),
                            "{:?} PTX lacks kernel {kernel}",
                            source.name
                        );
                    }
                }
                ImageKind::Cubin => {
                    assert!(
                        module.image.starts_with(b"\x7fELF"),
                        "a CUBIN is an ELF file"
                    );
                    for kernel in source.kernels {
                        let found = module
                            .image
                            .windows(kernel.len())
                            .any(|w| w == kernel.as_bytes());
                        assert!(found, "{:?} CUBIN lacks kernel {kernel}", source.name);
                    }
                }
            }
        }
    }
}

/// Whether NVRTC can be loaded; a failure when `KVSAN_REQUIRE_NVRTC` is set.
fn nvrtc_or_skip() -> bool {
    if nvrtc_present() {
        return true;
    }
    assert!(
        std::env::var_os("KVSAN_REQUIRE_NVRTC").is_none(),
        "KVSAN_REQUIRE_NVRTC is set but libnvrtc cannot be loaded (LD_LIBRARY_PATH?)"
    );
    eprintln!("skipped: libnvrtc cannot be loaded here (scripts/nvrtc-check installs one)");
    false
}

#[test]
fn a_source_nvrtc_rejects_comes_back_as_an_error_with_the_compiler_log() {
    if !nvrtc_or_skip() {
        return;
    }
    let broken = CudaSource {
        name: c"broken.cu",
        code: c"extern \"C\" __global__ void k(float* x) { x[0] = no_such_value; }",
        kernels: &["k"],
    };
    match compile(&broken, CompileTarget::cubin(90)) {
        Err(CudaError::Compile {
            source_name,
            target,
            log,
            ..
        }) => {
            assert_eq!(source_name, "broken.cu");
            assert_eq!(target, "sm_90");
            assert!(log.contains("no_such_value"), "log: {log}");
        }
        other => panic!("expected a compile error, got {other:?}"),
    }
}

#[test]
fn missing_cuda_libraries_are_errors_not_panics() {
    let available = cuda_available();
    match (driver_present(), nvrtc_present()) {
        (false, _) => {
            assert!(!available);
            assert!(matches!(
                CudaKernels::new(0),
                Err(CudaError::DriverNotFound)
            ));
        }
        (true, false) => {
            assert!(!available);
            assert!(matches!(CudaKernels::new(0), Err(CudaError::NvrtcNotFound)));
        }
        // Both libraries load: the GPU tests below cover this machine.
        (true, true) => {}
    }
}

// ---- GPU tests -------------------------------------------------------------

fn kernels() -> CudaKernels {
    let ordinal = std::env::var("KVSAN_CUDA_DEVICE")
        .ok()
        .and_then(|v| v.parse().ok())
        .unwrap_or(0);
    match CudaKernels::new(ordinal) {
        Ok(kernels) => kernels,
        Err(err) => panic!("CUDA kernels on device {ordinal}: {err}"),
    }
}

fn random_pool(rng: &mut StdRng, geometry: &KvGeometry, n_pages: usize) -> Vec<f16> {
    (0..n_pages * geometry.page_elems())
        .map(|_| f16::from_f32(rng.random_range(-1.0f32..1.0)))
        .collect()
}

fn random_f32(rng: &mut StdRng, n: usize, amp: f32) -> Vec<f32> {
    (0..n).map(|_| rng.random_range(-amp..amp)).collect()
}

fn random_generations(rng: &mut StdRng, n_pages: usize) -> Vec<Generation> {
    (0..n_pages)
        .map(|_| Generation(rng.random_range(1..1000)))
        .collect()
}

fn bits(pages: &[f16]) -> Vec<u16> {
    pages.iter().map(|v| v.to_bits()).collect()
}

fn assert_close(gpu: &[f32], cpu: &[f32], what: &str) {
    assert_eq!(gpu.len(), cpu.len(), "{what}: output lengths");
    for (i, (&g, &c)) in gpu.iter().zip(cpu).enumerate() {
        assert!(
            (g - c).abs() <= 1e-4 + 1e-3 * c.abs(),
            "{what}: value {i}: GPU {g}, CPU {c}"
        );
    }
}

fn owner(request: u64) -> Owner {
    Owner::new(request, 1)
}

/// A real sanitizer with one pool of the kernels' geometry: its kernel
/// shadow is what both the CPU guard and the device copy check.
struct World {
    san: Sanitizer,
    pool: PoolId,
    geometry: KvGeometry,
    n_pages: usize,
}

impl World {
    fn new(geometry: KvGeometry, n_pages: usize) -> World {
        let san = Sanitizer::with_writer(Options::default(), std::io::sink());
        let pool = san
            .pool_register(PoolGeometry {
                pages: n_pages as u32,
                page_slots: geometry.page_slots as u32,
                layers: geometry.n_layers as u32,
                bytes_per_slot: (2 * geometry.slot_width() * 2) as u64,
                role: NodeRole::Unified,
                node: "cuda-test".into(),
            })
            .expect("register the pool");
        World {
            san,
            pool,
            geometry,
            n_pages,
        }
    }

    fn alloc(&self, page: u32, request: u64) -> PageRef {
        let (verdict, generation) = self
            .san
            .alloc(self.pool, PageId(page), owner(request), 0)
            .expect("alloc");
        assert!(verdict.is_continue(), "alloc of page {page}: {verdict:?}");
        PageRef {
            page: PageId(page),
            generation,
        }
    }

    /// `request` wrote `slots` of `page` for every layer.
    fn write(&self, page: PageRef, request: u64, slots: Range<u32>) {
        let layers = 0..self.geometry.n_layers as u32;
        let verdict = self
            .san
            .write(self.pool, owner(request), page, slots, layers, 0)
            .expect("write");
        assert!(verdict.is_continue(), "write of {page:?}: {verdict:?}");
    }

    fn alloc_written(&self, page: u32, request: u64, slots: Range<u32>) -> PageRef {
        let page = self.alloc(page, request);
        self.write(page, request, slots);
        page
    }

    fn free(&self, page: PageRef, request: u64) {
        let verdict = self
            .san
            .free(self.pool, owner(request), page, 0)
            .expect("free");
        assert!(verdict.is_continue(), "free of {page:?}: {verdict:?}");
    }

    fn shadow(&self) -> KernelShadow<'_> {
        self.san.kernel_shadow(self.pool).expect("kernel shadow")
    }

    /// Every page's current generation (the pool's generation array).
    fn generations(&self) -> Vec<Generation> {
        let shadow = self.shadow();
        (0..self.n_pages as u32)
            .map(|p| {
                let (word, _) = shadow.record_words(PageId(p)).expect("page in the pool");
                Generation(word as u32)
            })
            .collect()
    }
}

/// The CPU kernels' guard over the sanitizer's kernel shadow, as an engine
/// builds one: a check that does not pass (refused, or left to the host's
/// arbitration) stops the row with [`Reason::Checked`]; the answer is kept
/// per row.
struct ShadowGuard<'a> {
    ledger: &'a RowLedger,
    shadow: KernelShadow<'a>,
    owners: &'a [RequestId],
    step: u64,
    checks: Mutex<BTreeMap<usize, Check>>,
}

impl<'a> ShadowGuard<'a> {
    fn new(
        ledger: &'a RowLedger,
        shadow: KernelShadow<'a>,
        owners: &'a [RequestId],
        step: u64,
    ) -> ShadowGuard<'a> {
        ShadowGuard {
            ledger,
            shadow,
            owners,
            step,
            checks: Mutex::new(BTreeMap::new()),
        }
    }

    fn decide(&self, row: usize, access: Access, page: PageRef, check: Check) -> bool {
        if check == Check::Ok {
            return true;
        }
        if self.ledger.live(row) {
            self.checks.lock().unwrap().entry(row).or_insert(check);
        }
        self.ledger.refuse(Refusal {
            row,
            access,
            page,
            reason: Reason::Checked,
        });
        false
    }

    fn checks(&self) -> BTreeMap<usize, Check> {
        self.checks.lock().unwrap().clone()
    }
}

impl KvGuard for ShadowGuard<'_> {
    fn ledger(&self) -> &RowLedger {
        self.ledger
    }

    fn read(&self, row: usize, entry: usize, page: PageRef, layer: usize, slots: usize) -> bool {
        let check = self
            .shadow
            .check_read(self.owners[row], page, layer as u32, slots as u32);
        let access = Access::Read {
            entry,
            layer,
            slots,
        };
        self.decide(row, access, page, check)
    }

    fn store(&self, row: usize, token: usize, page: PageRef, slot: usize, layer: usize) -> bool {
        let check = self
            .shadow
            .store(self.owners[row], page, layer as u32, slot as u32, self.step);
        self.decide(row, Access::Store { token, layer, slot }, page, check)
    }
}

/// Owned batch arrays: rows of `(owner, block table, context length,
/// store slots of the row's new tokens)`; tables padded to `width` with
/// entries no row reads.
struct Batch {
    block_tables: Vec<PageRef>,
    width: usize,
    seq_lens: Vec<u32>,
    query_start: Vec<u32>,
    store_slots: Vec<StoreSlot>,
    owners: Vec<RequestId>,
}

/// An entry past a row's table (never read unless a length runs past it).
const NO_PAGE: PageRef = PageRef::new(u32::MAX, 0);

impl Batch {
    fn new(width: usize, rows: &[(u64, Vec<PageRef>, u32, Vec<StoreSlot>)]) -> Batch {
        let mut b = Batch {
            block_tables: Vec::new(),
            width,
            seq_lens: Vec::new(),
            query_start: vec![0],
            store_slots: Vec::new(),
            owners: Vec::new(),
        };
        for (request, table, len, slots) in rows {
            assert!(table.len() <= width);
            b.block_tables.extend(table);
            b.block_tables
                .extend(std::iter::repeat_n(NO_PAGE, width - table.len()));
            b.seq_lens.push(*len);
            b.store_slots.extend(slots);
            b.query_start.push(b.store_slots.len() as u32);
            b.owners.push(RequestId(*request));
        }
        b
    }

    /// Decode rows: one new token each (no store).
    fn decode(width: usize, rows: &[(u64, Vec<PageRef>, u32)]) -> Batch {
        let rows: Vec<_> = rows
            .iter()
            .map(|(r, t, l)| (*r, t.clone(), *l, vec![StoreSlot::PADDING]))
            .collect();
        Batch::new(width, &rows)
    }

    fn view(&self) -> KvBatch<'_> {
        KvBatch {
            block_tables: &self.block_tables,
            width: self.width,
            seq_lens: &self.seq_lens,
            query_start: &self.query_start,
            store_slots: &self.store_slots,
        }
    }

    fn rows(&self) -> usize {
        self.seq_lens.len()
    }
}

#[allow(clippy::too_many_arguments)]
fn cpu_attend(
    pool: &[f16],
    geometry: &KvGeometry,
    layer: usize,
    n_heads: usize,
    scale: f32,
    batch: &Batch,
    q: &[f32],
    guard: &impl KvGuard,
) -> Vec<f32> {
    let mut out = vec![-7.0f32; q.len()];
    attend(
        Exec::global(),
        pool,
        geometry,
        layer,
        n_heads,
        scale,
        &batch.view(),
        q,
        &mut out,
        guard,
    );
    out
}

fn refusals_of(gpu: &[CudaRefusal]) -> Vec<Refusal> {
    gpu.iter().map(|r| r.refusal).collect()
}

fn checks_of(gpu: &[CudaRefusal]) -> BTreeMap<usize, Check> {
    gpu.iter()
        .filter_map(|r| r.check.map(|c| (r.refusal.row, c)))
        .collect()
}

fn decode_matches_cpu(geometry: KvGeometry, n_heads: usize, lens: &[u32], seed: u64) {
    let mut rng = StdRng::seed_from_u64(seed);
    let ps = geometry.page_slots;
    let per_row: Vec<usize> = lens.iter().map(|&l| (l as usize).div_ceil(ps)).collect();
    let n_pages = per_row.iter().sum::<usize>() + 3;
    let world = World::new(geometry, n_pages);
    let mut order: Vec<u32> = (0..n_pages as u32).collect();
    order.shuffle(&mut rng);
    let mut free = order.into_iter();
    // Each row's pages, written exactly up to its length (a slot more read
    // would be a stale read).
    let rows: Vec<(u64, Vec<PageRef>, u32)> = lens
        .iter()
        .enumerate()
        .map(|(r, &len)| {
            let request = 100 + r as u64;
            let table = (0..per_row[r])
                .map(|e| {
                    let page = free.next().expect("pool large enough");
                    let filled = (len as usize - e * ps).min(ps) as u32;
                    world.alloc_written(page, request, 0..filled)
                })
                .collect();
            (request, table, len)
        })
        .collect();
    let width = per_row.iter().copied().max().unwrap_or(0) + 1;
    let batch = Batch::decode(width, &rows);
    let host = random_pool(&mut rng, &geometry, n_pages);
    let q = random_f32(&mut rng, batch.rows() * n_heads * geometry.head_dim, 2.0);
    let scale = 1.0 / (geometry.head_dim as f32).sqrt();

    let kernels = kernels();
    let pool = kernels
        .upload_pool(geometry, &host, &world.generations())
        .expect("upload pool");
    let shadow = kernels
        .upload_shadow(&world.shadow())
        .expect("upload shadow");
    for layer in 0..geometry.n_layers {
        let ledger = RowLedger::new(batch.rows());
        let cpu = cpu_attend(
            &host,
            &geometry,
            layer,
            n_heads,
            scale,
            &batch,
            &q,
            &Unchecked { ledger: &ledger },
        );
        assert!(ledger.refusals().is_empty());
        let ledger = RowLedger::new(batch.rows());
        let guard = ShadowGuard::new(&ledger, world.shadow(), &batch.owners, 0);
        let checked = cpu_attend(&host, &geometry, layer, n_heads, scale, &batch, &q, &guard);
        assert!(ledger.refusals().is_empty(), "{:?}", ledger.refusals());
        assert_eq!(
            bits_f32(&checked),
            bits_f32(&cpu),
            "CPU checked vs unchecked"
        );
        for (name, check) in [
            ("bounds", ReadCheck::Bounds),
            ("generations", ReadCheck::Generations),
            (
                "shadow",
                ReadCheck::Shadow {
                    shadow: &shadow,
                    owners: &batch.owners,
                },
            ),
        ] {
            let ledger = RowLedger::new(batch.rows());
            let got = kernels
                .attend_decode(
                    &pool,
                    layer,
                    n_heads,
                    scale,
                    &batch.view(),
                    &q,
                    check,
                    &ledger,
                )
                .expect("decode");
            assert!(got.refusals.is_empty(), "{name}: {:?}", got.refusals);
            assert_close(&got.out, &cpu, &format!("layer {layer}, {name}"));
        }
    }
}

fn bits_f32(values: &[f32]) -> Vec<u32> {
    values.iter().map(|v| v.to_bits()).collect()
}

#[test]
#[ignore = "requires CUDA"]
fn decode_matches_cpu_over_rows_crossing_pages_with_grouped_query_heads() {
    // SmolLM2's attention shape: 9 query heads over 3 KV heads, head_dim 64.
    let geometry = KvGeometry {
        page_slots: 16,
        n_layers: 2,
        n_kv_heads: 3,
        head_dim: 64,
    };
    decode_matches_cpu(geometry, 9, &[1, 15, 16, 17, 100, 333], 1);
}

#[test]
#[ignore = "requires CUDA"]
fn decode_matches_cpu_for_head_dims_that_are_not_warp_multiples() {
    let geometry = KvGeometry {
        page_slots: 5,
        n_layers: 1,
        n_kv_heads: 2,
        head_dim: 80,
    };
    decode_matches_cpu(geometry, 2, &[3, 7, 41], 2);
    let widest = KvGeometry {
        page_slots: 8,
        n_layers: 1,
        n_kv_heads: 1,
        head_dim: 256,
    };
    decode_matches_cpu(widest, 4, &[9, 64], 3);
    // 30 layers of 16 slots: a layer's bits straddle two words of a page.
    let straddling = KvGeometry {
        page_slots: 48,
        n_layers: 3,
        n_kv_heads: 1,
        head_dim: 32,
    };
    decode_matches_cpu(straddling, 2, &[1, 47, 48, 49, 150], 4);
}

/// Geometry of the refusal tests: small pages, so rows cross them.
const SMALL: KvGeometry = KvGeometry {
    page_slots: 4,
    n_layers: 2,
    n_kv_heads: 2,
    head_dim: 32,
};
const SMALL_HEADS: usize = 4;
const SMALL_PAGES: usize = 16;
const LAYER: usize = 1;

/// A decode batch with one row of each refusal, each through a real
/// sanitizer history, and the answers the shadow check must give:
/// `(row, access, page, reason, check, current generation, first unwritten)`.
struct Refusals {
    world: World,
    batch: Batch,
    expected: Vec<(usize, Access, PageRef, Reason, Option<Check>)>,
    stale_row: (usize, Generation),
    unwritten_row: (usize, u32),
}

fn refusal_scenario() -> Refusals {
    let w = World::new(SMALL, SMALL_PAGES);
    let p0 = w.alloc_written(0, 10, 0..4);
    let p1 = w.alloc_written(1, 10, 0..4);
    let p2 = w.alloc_written(2, 11, 0..4);
    // Page 3 freed and re-allocated since row 1's table was written.
    let p3_old = w.alloc_written(3, 11, 0..4);
    w.free(p3_old, 11);
    let p3_new = w.alloc_written(3, 11, 0..4);
    assert_ne!(p3_old.generation, p3_new.generation);
    let p4 = w.alloc_written(4, 13, 0..2);
    let p5 = w.alloc_written(5, 14, 0..4);
    let p6 = w.alloc_written(6, 15, 0..4);
    w.free(p6, 15);
    let p7 = w.alloc_written(7, 10, 0..4);
    let shared = w.san.share(w.pool, p7, owner(16)).expect("share");
    assert!(shared.is_continue());
    let p8 = w.alloc_written(8, 17, 0..4);
    // Request 17 ends holding page 8 (a leak, reported): its owner is terminal.
    let _leak = w.san.request_event(owner(17), RequestState::Finished);
    let p9 = w.alloc_written(9, 18, 0..4);
    let p10 = w.alloc_written(10, 18, 0..4);
    let p11 = w.alloc_written(11, 19, 0..4);
    let p12 = w.alloc_written(12, 19, 0..4);
    let outside = PageRef::new(SMALL_PAGES as u32 + 3, 1);
    let batch = Batch::decode(
        2,
        &[
            (10, vec![p0, p1], 7),      // 0: fine, across two pages
            (11, vec![p2, p3_old], 6),  // 1: stale generation at entry 1
            (12, vec![p0], 3),          // 2: request 10's page
            (13, vec![p4], 4),          // 3: slots 2, 3 never written
            (14, vec![p5, outside], 6), // 4: a page outside the pool at entry 1
            (15, vec![p6], 2),          // 5: a freed page
            (16, vec![p7], 3),          // 6: a shared page, read by a sharer
            (17, vec![p8], 4),          // 7: a terminal owner
            (19, vec![p11, p12], 9),    // 8: entry 2 is row 9's entry 0 (page 9, request 18's)
            (18, vec![p9, p10], 9),     // 9: entry 2 is past the block-table array
        ],
    );
    let read = |entry, slots| Access::Read {
        entry,
        layer: LAYER,
        slots,
    };
    let checked = |kind| (Reason::Checked, Some(Check::Refused(kind)));
    let out = (Reason::Outside { pages: SMALL_PAGES }, None);
    let expected = vec![
        (
            1,
            read(1, 2),
            p3_old,
            checked(ViolationKind::GenerationMismatch),
        ),
        (2, read(0, 3), p0, checked(ViolationKind::ForeignRead)),
        (3, read(0, 4), p4, checked(ViolationKind::StaleRead)),
        (4, read(1, 2), outside, out),
        (5, read(0, 2), p6, checked(ViolationKind::ReadFreePage)),
        (6, read(0, 3), p7, (Reason::Checked, Some(Check::Arbitrate))),
        (
            7,
            read(0, 4),
            p8,
            checked(ViolationKind::TerminalRequestActivity),
        ),
        (8, read(2, 1), p9, checked(ViolationKind::ForeignRead)),
        (9, read(2, 1), PageRef::default(), out),
    ]
    .into_iter()
    .map(|(row, access, page, (reason, check))| (row, access, page, reason, check))
    .collect();
    Refusals {
        world: w,
        batch,
        expected,
        stale_row: (1, p3_new.generation),
        unwritten_row: (3, 2),
    }
}

#[test]
#[ignore = "requires CUDA"]
fn each_refused_read_refuses_the_same_row_for_the_same_reason_on_gpu_and_cpu() {
    let s = refusal_scenario();
    let (batch, world) = (&s.batch, &s.world);
    let mut rng = StdRng::seed_from_u64(11);
    let host = random_pool(&mut rng, &SMALL, SMALL_PAGES);
    let q = random_f32(&mut rng, batch.rows() * SMALL_HEADS * SMALL.head_dim, 2.0);
    let scale = 0.2;
    let kernels = kernels();
    let pool = kernels
        .upload_pool(SMALL, &host, &world.generations())
        .expect("upload pool");
    let shadow = kernels
        .upload_shadow(&world.shadow())
        .expect("upload shadow");
    let qw = SMALL_HEADS * SMALL.head_dim;
    let row_out = |out: &[f32], r: usize| out[r * qw..(r + 1) * qw].to_vec();

    // Checked against the sanitizer's shadow.
    let ledger = RowLedger::new(batch.rows());
    let guard = ShadowGuard::new(&ledger, world.shadow(), &batch.owners, 0);
    let cpu = cpu_attend(&host, &SMALL, LAYER, SMALL_HEADS, scale, batch, &q, &guard);
    let cpu_refusals = ledger.refusals();
    let gpu_ledger = RowLedger::new(batch.rows());
    let check = ReadCheck::Shadow {
        shadow: &shadow,
        owners: &batch.owners,
    };
    let gpu = kernels
        .attend_decode(
            &pool,
            LAYER,
            SMALL_HEADS,
            scale,
            &batch.view(),
            &q,
            check,
            &gpu_ledger,
        )
        .expect("decode");
    let want: Vec<Refusal> = s
        .expected
        .iter()
        .map(|&(row, access, page, reason, _)| Refusal {
            row,
            access,
            page,
            reason,
        })
        .collect();
    assert_eq!(cpu_refusals, want, "CPU refusals");
    assert_eq!(refusals_of(&gpu.refusals), want, "GPU refusals");
    assert_eq!(
        gpu_ledger.refusals(),
        want,
        "the GPU's refusals went to its ledger"
    );
    let want_checks: BTreeMap<usize, Check> = s
        .expected
        .iter()
        .filter_map(|&(row, _, _, _, check)| check.map(|c| (row, c)))
        .collect();
    assert_eq!(guard.checks(), want_checks, "CPU checks");
    assert_eq!(checks_of(&gpu.refusals), want_checks, "GPU checks");
    for r in &gpu.refusals {
        let row = r.refusal.row;
        match r.refusal.reason {
            Reason::Outside { .. } => assert_eq!(r.current, None, "row {row}"),
            _ => assert!(r.current.is_some(), "row {row}"),
        }
        if row == s.stale_row.0 {
            assert_eq!(r.current, Some(s.stale_row.1), "the page's generation now");
        }
        let unwritten = (row == s.unwritten_row.0).then_some(s.unwritten_row.1);
        assert_eq!(r.first_unwritten, unwritten, "row {row}");
    }
    for r in 0..batch.rows() {
        if want.iter().any(|w| w.row == r) {
            assert!(row_out(&cpu, r).iter().all(|&v| v == 0.0), "CPU row {r}");
            assert!(
                row_out(&gpu.out, r).iter().all(|&v| v == 0.0),
                "GPU row {r}"
            );
        } else {
            assert_close(
                &row_out(&gpu.out, r),
                &row_out(&cpu, r),
                &format!("row {r}"),
            );
        }
    }

    // The pool's generation array: only the stale tag and the bounds.
    let generations = world.generations();
    let ledger = RowLedger::new(batch.rows());
    let guard = GenerationChecked {
        ledger: &ledger,
        generations: &generations,
    };
    let cpu = cpu_attend(&host, &SMALL, LAYER, SMALL_HEADS, scale, batch, &q, &guard);
    let gpu = kernels
        .attend_decode(
            &pool,
            LAYER,
            SMALL_HEADS,
            scale,
            &batch.view(),
            &q,
            ReadCheck::Generations,
            &RowLedger::new(batch.rows()),
        )
        .expect("decode");
    assert_eq!(refusals_of(&gpu.refusals), ledger.refusals());
    assert_eq!(
        gpu.refusals
            .iter()
            .map(|r| r.refusal.row)
            .collect::<Vec<_>>(),
        [1, 4, 9]
    );
    assert_eq!(
        gpu.refusals[0].refusal.reason,
        Reason::Generation {
            current: s.stale_row.1
        }
    );
    assert_close(&gpu.out, &cpu, "generation-checked");

    // Bounds only: what a release build reads.
    let ledger = RowLedger::new(batch.rows());
    let cpu = cpu_attend(
        &host,
        &SMALL,
        LAYER,
        SMALL_HEADS,
        scale,
        batch,
        &q,
        &Unchecked { ledger: &ledger },
    );
    let gpu = kernels
        .attend_decode(
            &pool,
            LAYER,
            SMALL_HEADS,
            scale,
            &batch.view(),
            &q,
            ReadCheck::Bounds,
            &RowLedger::new(batch.rows()),
        )
        .expect("decode");
    assert_eq!(refusals_of(&gpu.refusals), ledger.refusals());
    assert_eq!(
        gpu.refusals
            .iter()
            .map(|r| r.refusal.row)
            .collect::<Vec<_>>(),
        [4, 9]
    );
    assert_close(&gpu.out, &cpu, "unchecked");
}

#[test]
#[ignore = "requires CUDA"]
fn rows_the_ledger_stopped_are_neither_read_nor_refused_again() {
    let s = refusal_scenario();
    let kernels = kernels();
    let mut rng = StdRng::seed_from_u64(12);
    let host = random_pool(&mut rng, &SMALL, SMALL_PAGES);
    let pool = kernels
        .upload_pool(SMALL, &host, &s.world.generations())
        .expect("upload pool");
    let shadow = kernels
        .upload_shadow(&s.world.shadow())
        .expect("upload shadow");
    let q = random_f32(&mut rng, s.batch.rows() * SMALL_HEADS * SMALL.head_dim, 1.0);
    let ledger = RowLedger::new(s.batch.rows());
    let earlier = Refusal {
        row: 0,
        access: Access::Store {
            token: 0,
            layer: 0,
            slot: 0,
        },
        page: PageRef::new(1, 1),
        reason: Reason::Checked,
    };
    ledger.refuse(earlier);
    let check = ReadCheck::Shadow {
        shadow: &shadow,
        owners: &s.batch.owners,
    };
    let got = kernels
        .attend_decode(
            &pool,
            LAYER,
            SMALL_HEADS,
            0.3,
            &s.batch.view(),
            &q,
            check,
            &ledger,
        )
        .expect("decode");
    let qw = SMALL_HEADS * SMALL.head_dim;
    assert!(got.out[..qw].iter().all(|&v| v == 0.0), "row 0 not read");
    assert!(got.refusals.iter().all(|r| r.refusal.row != 0));
    assert_eq!(ledger.refusals()[0], earlier, "the ledger keeps the first");
}

/// A store batch with one row of each refused store, through a real
/// sanitizer history (built twice: once for the CPU, once for the GPU).
struct Stores {
    world: World,
    batch: Batch,
    /// `(row, the row's token index of the refused store, page, reason, check)`.
    expected: Vec<(usize, usize, PageRef, Reason, Option<Check>)>,
}

fn store_scenario() -> Stores {
    let w = World::new(SMALL, SMALL_PAGES);
    let p0 = w.alloc_written(0, 20, 0..3);
    let p1 = w.alloc_written(1, 21, 0..2);
    let p2 = w.alloc(2, 21);
    let p3 = w.alloc_written(3, 20, 0..4);
    let p4_old = w.alloc(4, 23);
    w.free(p4_old, 23);
    let _p4_new = w.alloc(4, 23);
    let p5 = w.alloc(5, 24);
    w.free(p5, 24);
    let p6 = w.alloc(6, 25);
    let p7 = w.alloc(7, 26);
    let p8 = w.alloc(8, 27);
    let p9 = w.alloc(9, 20);
    let p10 = w.alloc(10, 29);
    let _leak = w.san.request_event(owner(29), RequestState::Finished);
    // A full page the prefix cache holds: read-only to its owner too.
    let p11 = w.alloc_written(11, 30, 0..4);
    let cache = Owner {
        request: RequestId::PREFIX_CACHE,
        tenant: owner(30).tenant,
    };
    let shared = w.san.share(w.pool, p11, cache).expect("share");
    assert!(shared.is_continue(), "the cache registers p11: {shared:?}");
    let outside = PageRef::new(SMALL_PAGES as u32 + 1, 1);
    let at = |page: PageRef, slot: u32| StoreSlot { page, slot };
    let batch = Batch::new(
        3,
        &[
            (20, vec![p0], 4, vec![at(p0, 3)]), // 0: fine
            (21, vec![p1, p2], 5, vec![at(p1, 2), at(p1, 3), at(p2, 0)]), // 1: across pages
            (22, vec![p3], 1, vec![at(p3, 0)]), // 2: request 20's page
            (23, vec![p4_old], 1, vec![at(p4_old, 0)]), // 3: stale generation
            (24, vec![p5], 1, vec![at(p5, 0)]), // 4: a freed page
            (25, vec![p6], 2, vec![StoreSlot::PADDING, at(p6, 0)]), // 5: padding, then fine
            (26, vec![p7], 1, vec![at(p7, 4)]), // 6: slot past the page
            (27, vec![p8, p9], 3, vec![at(p8, 0), at(p9, 0), at(p8, 1)]), // 7: 2nd refused
            (28, vec![outside], 1, vec![at(outside, 0)]), // 8: outside the pool
            (29, vec![p10], 1, vec![at(p10, 0)]), // 9: terminal owner
            (30, vec![p11], 1, vec![at(p11, 0)]), // 10: its page, shared
        ],
    );
    let checked = |kind| (Reason::Checked, Some(Check::Refused(kind)));
    let out = (Reason::Outside { pages: SMALL_PAGES }, None);
    let expected = vec![
        (2, 0, p3, checked(ViolationKind::ForeignWrite)),
        (3, 0, p4_old, checked(ViolationKind::GenerationMismatch)),
        (4, 0, p5, checked(ViolationKind::WriteAfterFree)),
        (6, 0, p7, out),
        (7, 1, p9, checked(ViolationKind::ForeignWrite)),
        (8, 0, outside, out),
        (9, 0, p10, checked(ViolationKind::TerminalRequestActivity)),
        (10, 0, p11, checked(ViolationKind::ForeignWrite)),
    ]
    .into_iter()
    .map(|(row, i, page, (reason, check))| (row, i, page, reason, check))
    .collect();
    Stores {
        world: w,
        batch,
        expected,
    }
}

impl Stores {
    fn refusals(&self) -> Vec<Refusal> {
        self.expected
            .iter()
            .map(|&(row, i, page, reason, _)| {
                let token = self.batch.query_start[row] as usize + i;
                Refusal {
                    row,
                    access: Access::Store {
                        token,
                        layer: LAYER,
                        slot: self.batch.store_slots[token].slot as usize,
                    },
                    page,
                    reason,
                }
            })
            .collect()
    }

    fn checks(&self) -> BTreeMap<usize, Check> {
        self.expected
            .iter()
            .filter_map(|&(row, _, _, _, check)| check.map(|c| (row, c)))
            .collect()
    }

    /// The store slots inside the pool (whose bits may have been set).
    fn pages_stored(&self) -> Vec<PageRef> {
        self.batch
            .store_slots
            .iter()
            .filter(|s| !s.is_padding() && (s.page.page.0 as usize) < SMALL_PAGES)
            .map(|s| s.page)
            .collect()
    }
}

/// K or V of a slot of a page, for `LAYER`.
fn slot_values(pool: &[f16], page: PageId, kv: usize, slot: u32) -> Vec<u16> {
    let o = SMALL.offset(page, LAYER, kv, slot as usize);
    bits(&pool[o..o + SMALL.slot_width()])
}

#[test]
#[ignore = "requires CUDA"]
fn the_store_writes_checks_and_marks_exactly_what_the_cpu_store_does() {
    let cpu_side = store_scenario();
    let gpu_side = store_scenario();
    let batch = &gpu_side.batch;
    let mut rng = StdRng::seed_from_u64(13);
    let before = random_pool(&mut rng, &SMALL, SMALL_PAGES);
    let w = SMALL.slot_width();
    let k = random_f32(&mut rng, batch.store_slots.len() * w, 1.5);
    let v = random_f32(&mut rng, batch.store_slots.len() * w, 1.5);
    let step = 5;

    let mut cpu_pool = before.clone();
    let cpu_ledger = RowLedger::new(batch.rows());
    let guard = ShadowGuard::new(
        &cpu_ledger,
        cpu_side.world.shadow(),
        &cpu_side.batch.owners,
        step,
    );
    store_kv(
        &mut cpu_pool,
        &SMALL,
        LAYER,
        &cpu_side.batch.view(),
        &k,
        &v,
        &guard,
    );

    let kernels = kernels();
    let mut pool = kernels
        .upload_pool(SMALL, &before, &gpu_side.world.generations())
        .expect("upload pool");
    let host_shadow = gpu_side.world.shadow();
    let mut shadow = kernels.upload_shadow(&host_shadow).expect("upload shadow");
    let gpu_ledger = RowLedger::new(batch.rows());
    let refusals = kernels
        .store_kv(
            &mut pool,
            LAYER,
            &batch.view(),
            &k,
            &v,
            StoreCheck::Shadow {
                shadow: &mut shadow,
                owners: &batch.owners,
            },
            &gpu_ledger,
        )
        .expect("store");
    let after = pool.download().expect("download");

    assert_eq!(cpu_ledger.refusals(), gpu_side.refusals(), "CPU refusals");
    assert_eq!(refusals_of(&refusals), gpu_side.refusals(), "GPU refusals");
    assert_eq!(gpu_ledger.refusals(), gpu_side.refusals(), "GPU ledger");
    assert_eq!(guard.checks(), gpu_side.checks(), "CPU checks");
    assert_eq!(checks_of(&refusals), gpu_side.checks(), "GPU checks");
    assert_eq!(bits(&after), bits(&cpu_pool), "GPU pool vs CPU pool");

    // Every store made holds its token's values; no refused (or skipped)
    // store changed a byte.
    let stored = |row: usize, i: usize| {
        !gpu_side
            .expected
            .iter()
            .any(|&(r, first, ..)| r == row && i >= first)
    };
    for row in 0..batch.rows() {
        let tokens = batch.query_start[row] as usize..batch.query_start[row + 1] as usize;
        for (i, t) in tokens.enumerate() {
            let s = batch.store_slots[t];
            if s.is_padding() || s.page.page.0 as usize >= SMALL_PAGES || s.slot as usize >= 4 {
                continue;
            }
            for (kv, src) in [(0, &k), (1, &v)] {
                let got = slot_values(&after, s.page.page, kv, s.slot);
                let want: Vec<u16> = if stored(row, i) {
                    src[t * w..(t + 1) * w]
                        .iter()
                        .map(|&x| f16::from_f32(x).to_bits())
                        .collect()
                } else {
                    slot_values(&before, s.page.page, kv, s.slot)
                };
                assert_eq!(got, want, "row {row} token {t} kv {kv}");
            }
        }
    }

    // Before any download, the device's own bits let the device read what
    // it stored: row 1's five tokens, row 7's first.
    let read_back = Batch::decode(
        2,
        &[(21, vec![batch.block_tables[3], batch.block_tables[4]], 5)],
    );
    let q = random_f32(&mut rng, SMALL_HEADS * SMALL.head_dim, 1.0);
    let got = kernels
        .attend_decode(
            &pool,
            LAYER,
            SMALL_HEADS,
            0.3,
            &read_back.view(),
            &q,
            ReadCheck::Shadow {
                shadow: &shadow,
                owners: &read_back.owners,
            },
            &RowLedger::new(1),
        )
        .expect("decode");
    assert!(got.refusals.is_empty(), "{:?}", got.refusals);

    // The bits come back to the host shadow: the same bits as the CPU set.
    assert!(matches!(
        host_shadow.check_read(RequestId(21), batch.block_tables[4], LAYER as u32, 1),
        Check::Refused(ViolationKind::StaleRead)
    ));
    shadow
        .download_written(&host_shadow, &gpu_side.pages_stored(), step)
        .expect("download written bits");
    let cpu_shadow = cpu_side.world.shadow();
    for p in 0..SMALL_PAGES as u32 {
        assert_eq!(
            host_shadow.page_bits(PageId(p)),
            cpu_shadow.page_bits(PageId(p)),
            "written bits of page {p}"
        );
        assert_eq!(
            shadow.page_bits(PageId(p)).expect("device bits"),
            host_shadow.page_bits(PageId(p)).expect("host bits"),
            "device bits of page {p}"
        );
    }
    let p1 = batch.block_tables[3];
    let p2 = batch.block_tables[4];
    assert_eq!(
        host_shadow.check_read(RequestId(21), p1, LAYER as u32, 4),
        Check::Ok
    );
    assert_eq!(
        host_shadow.check_read(RequestId(21), p2, LAYER as u32, 1),
        Check::Ok
    );
    // Row 7's first token went in, the one after its refusal did not.
    let p8 = batch.store_slots[batch.query_start[7] as usize].page;
    assert_eq!(
        host_shadow.check_read(RequestId(27), p8, LAYER as u32, 1),
        Check::Ok
    );
    assert!(matches!(
        host_shadow.check_read(RequestId(27), p8, LAYER as u32, 2),
        Check::Refused(ViolationKind::StaleRead)
    ));
}

#[test]
#[ignore = "requires CUDA"]
fn unchecked_and_generation_checked_stores_match_the_cpu_guards() {
    let s = store_scenario();
    let batch = &s.batch;
    let mut rng = StdRng::seed_from_u64(14);
    let before = random_pool(&mut rng, &SMALL, SMALL_PAGES);
    let w = SMALL.slot_width();
    let k = random_f32(&mut rng, batch.store_slots.len() * w, 1.0);
    let v = random_f32(&mut rng, batch.store_slots.len() * w, 1.0);
    let generations = s.world.generations();
    let kernels = kernels();
    for generation_checked in [false, true] {
        let mut cpu_pool = before.clone();
        let ledger = RowLedger::new(batch.rows());
        let check = if generation_checked {
            store_kv(
                &mut cpu_pool,
                &SMALL,
                LAYER,
                &batch.view(),
                &k,
                &v,
                &GenerationChecked {
                    ledger: &ledger,
                    generations: &generations,
                },
            );
            StoreCheck::Generations
        } else {
            store_kv(
                &mut cpu_pool,
                &SMALL,
                LAYER,
                &batch.view(),
                &k,
                &v,
                &Unchecked { ledger: &ledger },
            );
            StoreCheck::Bounds
        };
        let mut pool = kernels
            .upload_pool(SMALL, &before, &generations)
            .expect("upload pool");
        let refusals = kernels
            .store_kv(
                &mut pool,
                LAYER,
                &batch.view(),
                &k,
                &v,
                check,
                &RowLedger::new(batch.rows()),
            )
            .expect("store");
        let what = if generation_checked {
            "generations"
        } else {
            "bounds"
        };
        assert_eq!(refusals_of(&refusals), ledger.refusals(), "{what}");
        let rows: Vec<usize> = refusals.iter().map(|r| r.refusal.row).collect();
        let want: &[usize] = if generation_checked {
            &[3, 6, 8]
        } else {
            &[6, 8]
        };
        assert_eq!(rows, want, "{what}");
        assert_eq!(
            bits(&pool.download().expect("download")),
            bits(&cpu_pool),
            "{what}"
        );
    }
}

#[test]
#[ignore = "requires CUDA"]
fn the_device_shadow_follows_the_host_where_it_is_uploaded() {
    let geometry = SMALL;
    let world = World::new(geometry, 4);
    let old = world.alloc_written(0, 1, 0..4);
    let kernels = kernels();
    let mut rng = StdRng::seed_from_u64(15);
    let host = random_pool(&mut rng, &geometry, 4);
    let pool = kernels
        .upload_pool(geometry, &host, &world.generations())
        .expect("upload pool");
    let mut shadow = kernels
        .upload_shadow(&world.shadow())
        .expect("upload shadow");
    let q = random_f32(&mut rng, SMALL_HEADS * geometry.head_dim, 1.0);
    let decode = |shadow: &CudaKernelShadow, request: u64, page: PageRef| {
        let batch = Batch::decode(1, &[(request, vec![page], 4)]);
        kernels
            .attend_decode(
                &pool,
                LAYER,
                SMALL_HEADS,
                0.3,
                &batch.view(),
                &q,
                ReadCheck::Shadow {
                    shadow,
                    owners: &batch.owners,
                },
                &RowLedger::new(1),
            )
            .expect("decode")
            .refusals
            .first()
            .and_then(CudaRefusal::kind)
    };
    assert_eq!(decode(&shadow, 1, old), None);

    world.free(old, 1);
    // The device copy has not been told.
    assert_eq!(decode(&shadow, 1, old), None);
    shadow
        .upload(&world.shadow(), &[PageId(0), PageId(0)])
        .expect("upload page 0");
    assert_eq!(decode(&shadow, 1, old), Some(ViolationKind::ReadFreePage));
    assert_eq!(
        shadow.record_words(PageId(0)).expect("device record"),
        world.shadow().record_words(PageId(0)).expect("host record")
    );

    let new = world.alloc_written(0, 2, 0..4);
    shadow
        .upload(&world.shadow(), &[PageId(0)])
        .expect("upload page 0");
    assert_eq!(decode(&shadow, 2, new), None);
    assert_eq!(
        decode(&shadow, 1, old),
        Some(ViolationKind::GenerationMismatch)
    );

    // A whole upload leaves the same words.
    let _other = world.alloc_written(3, 5, 0..1);
    shadow.upload_all(&world.shadow()).expect("upload all");
    for p in 0..4 {
        let page = PageId(p);
        assert_eq!(
            shadow.record_words(page).expect("device record"),
            world.shadow().record_words(page).expect("host record")
        );
        assert_eq!(
            Some(shadow.page_bits(page).expect("device bits")),
            world.shadow().page_bits(page)
        );
    }
}

#[test]
#[ignore = "requires CUDA"]
fn launches_refuse_inputs_that_do_not_fit_before_touching_the_device() {
    let world = World::new(SMALL, 4);
    let page = world.alloc_written(0, 1, 0..4);
    let kernels = kernels();
    let mut pool = kernels.alloc_pool(SMALL, 4).expect("alloc pool");
    let mut shadow = kernels
        .upload_shadow(&world.shadow())
        .expect("upload shadow");
    let batch = Batch::decode(1, &[(1, vec![page], 4)]);
    let q = vec![0.5f32; SMALL_HEADS * SMALL.head_dim];
    let ledger = RowLedger::new(1);
    let decode = |batch: &Batch, q: &[f32], layer: usize, check: ReadCheck<'_>| {
        kernels.attend_decode(
            &pool,
            layer,
            SMALL_HEADS,
            0.3,
            &batch.view(),
            q,
            check,
            &ledger,
        )
    };

    let no_owners = ReadCheck::Shadow {
        shadow: &shadow,
        owners: &[],
    };
    assert!(matches!(
        decode(&batch, &q, LAYER, no_owners),
        Err(CudaError::Length {
            len: 0,
            expected: 1,
            ..
        })
    ));
    assert!(matches!(
        decode(&batch, &q[1..], LAYER, ReadCheck::Bounds),
        Err(CudaError::Length { .. })
    ));
    assert!(matches!(
        decode(&batch, &q, 2, ReadCheck::Bounds),
        Err(CudaError::OutOfRange {
            what: "layer",
            value: 2,
            limit: 2
        })
    ));
    let two = Batch::new(
        1,
        &[(
            1,
            vec![page],
            4,
            vec![StoreSlot::PADDING, StoreSlot::PADDING],
        )],
    );
    assert!(matches!(
        decode(
            &two,
            &[q.clone(), q.clone()].concat(),
            LAYER,
            ReadCheck::Bounds
        ),
        Err(CudaError::Kernel(KernelError::BatchShape { .. }))
    ));

    // A shadow of another pool's geometry.
    let bigger = World::new(SMALL, 5);
    let other = kernels
        .upload_shadow(&bigger.shadow())
        .expect("upload shadow");
    let other_check = ReadCheck::Shadow {
        shadow: &other,
        owners: &batch.owners,
    };
    assert!(matches!(
        decode(&batch, &q, LAYER, other_check),
        Err(CudaError::ShadowGeometry {
            what: "pages",
            shadow: 5,
            expected: 4,
            ..
        })
    ));
    assert!(matches!(
        shadow.upload(&bigger.shadow(), &[PageId(0)]),
        Err(CudaError::ShadowGeometry { .. })
    ));
    assert!(matches!(
        shadow.upload(&world.shadow(), &[PageId(4)]),
        Err(CudaError::OutOfRange {
            value: 4,
            limit: 4,
            ..
        })
    ));
    assert!(matches!(
        shadow.download_written(&world.shadow(), &[PageRef::new(7, 1)], 0),
        Err(CudaError::OutOfRange {
            value: 7,
            limit: 4,
            ..
        })
    ));

    // The store: K of the wrong length.
    let stores = Batch::new(1, &[(1, vec![page], 4, vec![StoreSlot { page, slot: 3 }])]);
    let kv = vec![0.25f32; SMALL.slot_width()];
    assert!(matches!(
        kernels.store_kv(
            &mut pool,
            LAYER,
            &stores.view(),
            &kv[1..],
            &kv,
            StoreCheck::Shadow {
                shadow: &mut shadow,
                owners: &stores.owners,
            },
            &RowLedger::new(1),
        ),
        Err(CudaError::Length { .. })
    ));
}

#[test]
#[ignore = "requires CUDA"]
fn poison_fills_exactly_the_listed_pages_with_the_nan_pattern() {
    let geometry = KvGeometry {
        page_slots: 4,
        n_layers: 3,
        n_kv_heads: 2,
        head_dim: 16,
    };
    let n_pages = 10;
    let mut rng = StdRng::seed_from_u64(6);
    let host = random_pool(&mut rng, &geometry, n_pages);
    let generations = random_generations(&mut rng, n_pages);
    let kernels = kernels();
    let mut pool = kernels
        .upload_pool(geometry, &host, &generations)
        .expect("upload pool");
    let listed = [PageId(7), PageId(0), PageId(3)];
    kernels.poison(&mut pool, &listed).expect("poison");

    let after = pool.download().expect("download");
    let page_elems = geometry.page_elems();
    for page in 0..n_pages {
        let range = page * page_elems..(page + 1) * page_elems;
        let got = bits(&after[range.clone()]);
        if listed.contains(&PageId(page as u32)) {
            assert!(
                got.iter().all(|&b| b == POISON_F16_BITS),
                "page {page} not poisoned"
            );
        } else {
            assert_eq!(got, bits(&host[range]), "page {page} changed");
        }
    }
    assert_eq!(pool.generations().expect("generations"), generations);

    // Reading a poisoned page unchecked shows: NaN output, for that row only.
    let q = vec![0.25f32; 2 * 2 * geometry.head_dim];
    let batch = Batch::decode(
        1,
        &[
            (1, vec![PageRef::new(3, generations[3].0)], 3),
            (2, vec![PageRef::new(4, generations[4].0)], 3),
        ],
    );
    let out = kernels
        .attend_decode(
            &pool,
            2,
            2,
            0.25,
            &batch.view(),
            &q,
            ReadCheck::Bounds,
            &RowLedger::new(2),
        )
        .expect("decode")
        .out;
    let (first, second) = out.split_at(out.len() / 2);
    assert!(first.iter().all(|v| v.is_nan()), "poison reached no output");
    assert!(
        second.iter().all(|v| v.is_finite()),
        "poison leaked across rows"
    );
}

fn copy_copies_exactly_the_listed_pages(geometry: KvGeometry, seed: u64) {
    let mut rng = StdRng::seed_from_u64(seed);
    let (src_pages, dst_pages) = (9, 12);
    let src_host = random_pool(&mut rng, &geometry, src_pages);
    let dst_host = random_pool(&mut rng, &geometry, dst_pages);
    let src_gens = random_generations(&mut rng, src_pages);
    let dst_gens = random_generations(&mut rng, dst_pages);
    let kernels = kernels();
    let src = kernels
        .upload_pool(geometry, &src_host, &src_gens)
        .expect("upload src");
    let mut dst = kernels
        .upload_pool(geometry, &dst_host, &dst_gens)
        .expect("upload dst");
    let pairs = [
        (PageId(1), PageId(5)),
        (PageId(2), PageId(0)),
        (PageId(8), PageId(11)),
        (PageId(1), PageId(6)),
    ];
    kernels.copy_pages(&src, &mut dst, &pairs).expect("copy");

    let after = dst.download().expect("download");
    let n = geometry.page_elems();
    let page = |pool: &[f16], p: usize| bits(&pool[p * n..(p + 1) * n]);
    for p in 0..dst_pages {
        match pairs.iter().find(|(_, to)| to.0 as usize == p) {
            Some((from, _)) => assert_eq!(
                page(&after, p),
                page(&src_host, from.0 as usize),
                "page {p}"
            ),
            None => assert_eq!(page(&after, p), page(&dst_host, p), "page {p} changed"),
        }
    }
    assert_eq!(
        src.download().expect("download src"),
        src_host,
        "source changed"
    );
    assert_eq!(
        dst.generations().expect("generations"),
        dst_gens,
        "generations copied"
    );
}

#[test]
#[ignore = "requires CUDA"]
fn copy_copies_exactly_the_listed_pages_in_16_byte_units() {
    let geometry = KvGeometry {
        page_slots: 16,
        n_layers: 2,
        n_kv_heads: 3,
        head_dim: 64,
    };
    assert_eq!(geometry.page_elems() % 8, 0);
    copy_copies_exactly_the_listed_pages(geometry, 7);
}

#[test]
#[ignore = "requires CUDA"]
fn copy_copies_exactly_the_listed_pages_of_odd_sizes() {
    let geometry = KvGeometry {
        page_slots: 3,
        n_layers: 1,
        n_kv_heads: 1,
        head_dim: 5,
    };
    assert_ne!(geometry.page_elems() % 8, 0);
    copy_copies_exactly_the_listed_pages(geometry, 8);
}

#[test]
#[ignore = "requires CUDA"]
fn copy_refuses_a_destination_page_listed_twice() {
    let geometry = KvGeometry {
        page_slots: 2,
        n_layers: 1,
        n_kv_heads: 1,
        head_dim: 8,
    };
    let kernels = kernels();
    let src = kernels.alloc_pool(geometry, 4).expect("alloc src");
    let mut dst = kernels.alloc_pool(geometry, 4).expect("alloc dst");
    let err = kernels
        .copy_pages(
            &src,
            &mut dst,
            &[(PageId(0), PageId(2)), (PageId(1), PageId(2))],
        )
        .expect_err("duplicate destination");
    assert!(
        matches!(err, CudaError::DuplicateDestination { page: PageId(2) }),
        "{err}"
    );
}

#[test]
#[ignore = "requires CUDA"]
fn pool_round_trips_pages_and_generations() {
    let geometry = KvGeometry {
        page_slots: 4,
        n_layers: 2,
        n_kv_heads: 1,
        head_dim: 8,
    };
    let mut rng = StdRng::seed_from_u64(9);
    let kernels = kernels();
    let mut pool: CudaKvPool = kernels.alloc_pool(geometry, 6).expect("alloc");
    assert_eq!(
        pool.generations().expect("generations"),
        vec![Generation(0); 6]
    );
    let host = random_pool(&mut rng, &geometry, 6);
    pool.upload_pages(PageId(0), &host).expect("upload");
    pool.set_generation(PageId(4), Generation(17))
        .expect("set generation");
    assert_eq!(bits(&pool.download().expect("download")), bits(&host));
    assert_eq!(
        bits(&pool.download_page(PageId(5)).expect("page 5")),
        bits(&host[5 * geometry.page_elems()..])
    );
    let mut expected = vec![Generation(0); 6];
    expected[4] = Generation(17);
    assert_eq!(pool.generations().expect("generations"), expected);
    assert!(matches!(
        pool.upload_pages(PageId(5), &host[..2 * geometry.page_elems()]),
        Err(CudaError::OutOfRange { .. })
    ));
}

/// Device buffers on the kernels' device, as an engine holds its own.
fn device_buffer<T: cudarc::driver::DeviceRepr>(
    kernels: &CudaKernels,
    host: &[T],
) -> cudarc::driver::CudaSlice<T> {
    let ctx = cudarc::driver::CudaContext::new(kernels.ordinal()).expect("context");
    ctx.default_stream()
        .clone_htod(host)
        .expect("copy to the device")
}

#[test]
#[ignore = "requires CUDA"]
fn the_check_kernels_refuse_an_engines_wrong_row_length_and_slot_as_the_host_does() {
    let geometry = KvGeometry {
        page_slots: 16,
        n_layers: 2,
        n_kv_heads: 1,
        head_dim: 8,
    };
    let world = World::new(geometry, 6);
    world.alloc_written(0, 1, 0..16);
    world.alloc_written(1, 1, 0..5);
    world.alloc_written(2, 2, 0..16);
    let gone = world.alloc_written(3, 3, 0..16);
    world.free(gone, 3);
    let kernels = kernels();
    let mut shadow = kernels
        .upload_shadow(&world.shadow())
        .expect("upload the shadow");
    let owners = [RequestId(1), RequestId(2)];
    let host_owners = [owner(1), owner(2)];
    let kinds = |found: &[EngineRefusal]| -> Vec<(usize, Option<ViolationKind>)> {
        found.iter().map(|r| (r.row, r.kind())).collect()
    };
    let host_kinds =
        |verdicts: Vec<kvsan_sanitizer::Verdict>| -> Vec<(usize, Option<ViolationKind>)> {
            verdicts
                .iter()
                .enumerate()
                .filter(|(_, v)| !v.is_continue())
                .map(|(row, v)| (row, v.kind()))
                .collect()
        };

    // Block table: legal, then row 1 pointed at request 1's page, then a
    // length one token past what request 1 wrote.
    let seq_lens = device_buffer(&kernels, &[21i32, 16]);
    let longer = device_buffer(&kernels, &[22i32, 16]);
    for (table, lens, expected) in [
        (vec![0i32, 1, 2, 0], &seq_lens, vec![]),
        (
            vec![0, 1, 0, 0],
            &seq_lens,
            vec![(1, Some(ViolationKind::ForeignRead))],
        ),
        (
            vec![0, 1, 2, 0],
            &longer,
            vec![(0, Some(ViolationKind::StaleRead))],
        ),
    ] {
        let buffer = device_buffer(&kernels, &table);
        let batch = EngineBatch::BlockTable {
            block_table: buffer.as_view(),
            stride: 2,
            seq_lens: lens.as_view(),
        };
        let found = kernels
            .check_engine_batch(&mut shadow, &owners, &batch, 0..2, false)
            .expect("check");
        assert_eq!(kinds(&found), expected, "table {table:?}");
        let host_lens = kernels_host_lens(lens);
        let verdicts = world
            .san
            .check_block_table(world.pool, &host_owners, &table, 2, &host_lens, 0..2, 1)
            .expect("host check");
        assert_eq!(host_kinds(verdicts), expected, "host, table {table:?}");
    }

    // Paged CSR and a token table with row 1 given request 1's pages.
    let indptr = device_buffer(&kernels, &[0i32, 2, 3]);
    let indices = device_buffer(&kernels, &[0i32, 1, 1]);
    let last = device_buffer(&kernels, &[5i32, 5]);
    let batch = EngineBatch::PagedCsr {
        indptr: indptr.as_view(),
        indices: indices.as_view(),
        last_page_len: last.as_view(),
    };
    let found = kernels
        .check_engine_batch(&mut shadow, &owners, &batch, 0..2, false)
        .expect("check");
    assert_eq!(kinds(&found), [(1, Some(ViolationKind::ForeignRead))]);
    let table: Vec<i32> = (0..21).chain(32..48).collect();
    let req_to_token = device_buffer(&kernels, &table);
    let reqs = device_buffer(&kernels, &[0i32, 0]);
    let batch = EngineBatch::ReqToToken {
        req_to_token: req_to_token.as_view(),
        stride: 21,
        req_indices: reqs.as_view(),
        seq_lens: seq_lens.as_view(),
    };
    let found = kernels
        .check_engine_batch(&mut shadow, &owners, &batch, 0..2, false)
        .expect("check");
    assert_eq!(kinds(&found), [(1, Some(ViolationKind::ForeignRead))]);

    // Store slots: row 1's second token into request 1's page is refused;
    // the slots let through before it are marked written on the device.
    let starts = device_buffer(&kernels, &[0i32, 1, 3]);
    let slots = device_buffer(&kernels, &[5i64, 40, 6]);
    let batch = EngineBatch::SlotMapping {
        query_start_loc: starts.as_view(),
        slot_mapping: slots.as_view(),
    };
    let found = kernels
        .check_engine_batch(&mut shadow, &owners, &batch, 0..2, true)
        .expect("check");
    assert_eq!(kinds(&found), [(1, Some(ViolationKind::ForeignWrite))]);
    assert_eq!(found[0].index, Some(2));
    // Page 0 (request 1, row 0's slot 5: already written); page 2 slot 8
    // (row 1's first token) now written for both layers.
    let page2 = shadow.page_bits(PageId(2)).expect("page 2 bits");
    assert_eq!(page2[0] & (1 << 8 | 1 << 24), 1 << 8 | 1 << 24);
    let verdicts = world
        .san
        .check_slot_mapping(world.pool, &host_owners, &[0, 1, 3], &[5, 40, 6], 0..2, 1)
        .expect("host check");
    assert_eq!(
        host_kinds(verdicts),
        [(1, Some(ViolationKind::ForeignWrite))]
    );
}

/// A small device buffer back on the host.
fn kernels_host_lens(lens: &cudarc::driver::CudaSlice<i32>) -> Vec<i32> {
    lens.stream().clone_dtoh(lens).expect("copy to the host")
}

#[test]
#[ignore = "requires CUDA"]
fn buffers_outside_a_device_allocation_are_refused_before_any_kernel_reads_them() {
    let kernels = kernels();
    let buffer = device_buffer(&kernels, &[0i32; 64]);
    let stream = kernels_stream(&kernels);
    let (address, _sync) = cudarc::driver::DevicePtr::device_ptr(&buffer, &stream);
    kernels
        .check_device_buffer("block_table", address, 64 * 4)
        .expect("a whole allocation");
    kernels
        .check_device_buffer("block_table", address + 16, 32)
        .expect("a part of one");
    assert!(matches!(
        kernels.check_device_buffer("block_table", address, 65 * 4),
        Err(CudaError::OutsideAllocation { bytes: 260, .. })
    ));
    let host = [0i32; 4];
    assert!(matches!(
        kernels.check_device_buffer("seq_lens", host.as_ptr() as u64, 16),
        Err(CudaError::NotDeviceMemory {
            what: "seq_lens",
            ..
        })
    ));
    assert!(matches!(
        kernels.check_device_buffer("seq_lens", 0x7F00_0000_0000, 16),
        Err(CudaError::NotDeviceMemory { .. })
    ));
    // The context is still usable.
    let again = device_buffer(&kernels, &[1i32, 2, 3]);
    assert_eq!(
        kernels.copy_to_host(&again).expect("copy back"),
        vec![1, 2, 3]
    );
}

fn kernels_stream(kernels: &CudaKernels) -> std::sync::Arc<cudarc::driver::CudaStream> {
    cudarc::driver::CudaContext::new(kernels.ordinal())
        .expect("context")
        .default_stream()
}
