//! The check kernels of `check.cu` (an engine's own kernel arguments
//! against the device kernel shadow) against the sanitizer's host-side
//! batch checks, on a machine without a GPU: the source NVRTC compiles
//! (with 3 lanes a row instead of 64, so that each lane of these short rows
//! walks several entries) is built by the C++ compiler as ordinary
//! functions (`tests/cuda_host/prelude.h` gives the few CUDA built-ins they
//! use their one-thread meaning: one thread runs to its end before the
//! next, so the last lane of a row to arrive settles it) and run by
//! `tests/cuda_host/harness.cpp` over every (block, thread) of a small grid. Its records go through the same
//! decoder as a launch's ([`decode_engine_refusals`]).
//!
//! Each case builds a real [`Sanitizer`] pool (pages allocated, written,
//! freed, shared), takes its kernel shadow's words as an upload would, and
//! runs the same buffers through the device check and the host check: the
//! same rows refused, for the same reason; the same malformed row; the
//! same slots recorded written. The GPU run of the same kernels is in
//! `tests/cuda.rs` (ignored without a GPU).
#![cfg(feature = "cuda")]

use std::io::Write as _;
use std::ops::Range;
use std::path::{Path, PathBuf};
use std::process::{Command, Stdio};
use std::sync::OnceLock;

use kvsan_kernels::cuda::source::{
    CHECK, CHECK_LANES, REFUSAL_WORDS, REFUSED_BAD_INPUT, REFUSED_OUTSIDE_POOL,
    REFUSED_OUTSIDE_TABLE,
};
use kvsan_kernels::cuda::{
    BatchLayout, EngineFinding, EngineRefusal, decode_engine_refusals, may_record,
};
use kvsan_sanitizer::{
    NodeRole, Options, Owner, PageId, PageRef, PoolGeometry, PoolId, Sanitizer, SanitizerError,
    Verdict, ViolationKind,
};
use rand::rngs::StdRng;
use rand::{Rng, SeedableRng};

/// The harness binary, built once per test process.
fn harness() -> &'static Path {
    static BUILT: OnceLock<PathBuf> = OnceLock::new();
    BUILT.get_or_init(|| {
        let dir = Path::new(env!("CARGO_TARGET_TMPDIR")).join("cuda_check_host");
        std::fs::create_dir_all(&dir).expect("create the harness directory");
        let source = CHECK.code.to_str().expect("check.cu is UTF-8");
        // Three lanes a row instead of the device's 64: the rows here are
        // short, and with 3 lanes each lane walks several of a row's entries
        // and the row's first refusal is settled across lanes.
        let lanes = format!("#define KVSAN_CHECK_LANES {CHECK_LANES}u\n");
        assert!(source.contains(&lanes), "check.cu defines {}", lanes.trim());
        let source = source.replace(&lanes, "#define KVSAN_CHECK_LANES 3u\n");
        std::fs::write(dir.join("check_all.cu"), source).expect("write the kernel source");
        let here = Path::new(env!("CARGO_MANIFEST_DIR")).join("tests/cuda_host");
        let exe = dir.join(format!("harness-{}", std::process::id()));
        let out = Command::new(std::env::var("CXX").unwrap_or_else(|_| "c++".into()))
            .args(["-std=c++17", "-O1", "-Wall", "-Wextra", "-Werror", "-I"])
            .arg(&dir)
            .arg("-I")
            .arg(&here)
            .arg(here.join("harness.cpp"))
            .arg("-o")
            .arg(&exe)
            .output()
            .expect("run the C++ compiler (c++, or $CXX)");
        assert!(
            out.status.success(),
            "the check kernels do not build as C++:\n{}",
            String::from_utf8_lossy(&out.stderr)
        );
        exe
    })
}

/// A real sanitizer with one pool.
struct World {
    san: Sanitizer,
    pool: PoolId,
    pages: u32,
    page_slots: u32,
    layers: u32,
}

fn owner(request: u64) -> Owner {
    Owner::new(request, 1)
}

impl World {
    fn new(pages: u32, page_slots: u32, layers: u32) -> World {
        let san = Sanitizer::with_writer(Options::default(), std::io::sink());
        let pool = san
            .pool_register(PoolGeometry {
                pages,
                page_slots,
                layers,
                bytes_per_slot: 64,
                role: NodeRole::Unified,
                node: "check-host".into(),
            })
            .expect("register the pool");
        World {
            san,
            pool,
            pages,
            page_slots,
            layers,
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

    /// `request` wrote `slots` of `page` for `layers`.
    fn write(&self, page: PageRef, request: u64, slots: Range<u32>, layers: Range<u32>) {
        let verdict = self
            .san
            .write(self.pool, owner(request), page, slots, layers, 0)
            .expect("write");
        assert!(verdict.is_continue(), "write of {page:?}: {verdict:?}");
    }

    /// A page of `request`, its first `slots` written for every layer.
    fn written(&self, page: u32, request: u64, slots: u32) -> PageRef {
        let page = self.alloc(page, request);
        self.write(page, request, 0..slots, 0..self.layers);
        page
    }

    fn free(&self, page: PageRef, request: u64) {
        let verdict = self
            .san
            .free(self.pool, owner(request), page, 0)
            .expect("free");
        assert!(verdict.is_continue(), "free of {page:?}: {verdict:?}");
    }

    /// The shadow's words, as `CudaKernelShadow::upload_all` copies them.
    fn words(&self) -> (Vec<u64>, Vec<u64>) {
        let shadow = self.san.kernel_shadow(self.pool).expect("kernel shadow");
        let mut records = Vec::new();
        let mut bits = Vec::new();
        for page in 0..self.pages {
            let (word, owner) = shadow.record_words(PageId(page)).expect("page");
            records.extend([word, owner]);
            bits.extend(shadow.page_bits(PageId(page)).expect("page"));
        }
        (records, bits)
    }

    fn stride(&self) -> usize {
        (self.layers as usize * self.page_slots as usize).div_ceil(64)
    }
}

/// One batch of an engine's buffers, in the four layouts.
#[derive(Clone, Debug)]
enum Buffers {
    BlockTable {
        table: Vec<i32>,
        stride: usize,
        seq_lens: Vec<i32>,
    },
    Csr {
        indptr: Vec<i32>,
        indices: Vec<i32>,
        last: Vec<i32>,
    },
    ReqToToken {
        table: Vec<i32>,
        stride: usize,
        reqs: Vec<i32>,
        seq_lens: Vec<i32>,
    },
    Slots {
        starts: Vec<i32>,
        slots: Vec<i64>,
    },
}

impl Buffers {
    fn layout(&self) -> BatchLayout {
        match self {
            Buffers::BlockTable { .. } => BatchLayout::BlockTable,
            Buffers::Csr { .. } => BatchLayout::PagedCsr,
            Buffers::ReqToToken { .. } => BatchLayout::ReqToToken,
            Buffers::Slots { .. } => BatchLayout::SlotMapping,
        }
    }
}

/// What the device check said: its refusals, and the written words after it.
struct Device {
    refusals: Vec<EngineRefusal>,
    bits: Vec<u64>,
}

fn push<T: ToString>(out: &mut String, values: &[T]) {
    out.push_str(&values.len().to_string());
    for v in values {
        out.push(' ');
        out.push_str(&v.to_string());
    }
    out.push('\n');
}

/// Runs the layout's check kernel over `buffers` for `rows` rows of
/// `owners`, on a grid of `grid` blocks of `block` threads.
fn device(
    world: &World,
    owners: &[u64],
    buffers: &Buffers,
    layers: Range<u32>,
    grid: (u32, u32),
) -> Device {
    // As `CudaKernels::check_engine_batch` does: a store check looks, then
    // records only if `may_record` says so.
    let first = run(world, owners, buffers, layers.clone(), grid, false);
    if buffers.layout() == BatchLayout::SlotMapping && may_record(&first.refusals) {
        let second = run(world, owners, buffers, layers, grid, true);
        assert_eq!(
            second.refusals, first.refusals,
            "recording changed a verdict"
        );
        return second;
    }
    first
}

/// One launch of the layout's check kernel over `buffers`.
fn run(
    world: &World,
    owners: &[u64],
    buffers: &Buffers,
    layers: Range<u32>,
    (grid, block): (u32, u32),
    record: bool,
) -> Device {
    let (records, bits) = world.words();
    let layout = match buffers.layout() {
        BatchLayout::BlockTable => 0,
        BatchLayout::PagedCsr => 1,
        BatchLayout::ReqToToken => 2,
        BatchLayout::SlotMapping => 3,
    };
    let mut input = format!(
        "{layout}\n{} {} {} {} {} {} {grid} {block}\n",
        owners.len(),
        world.pages,
        world.page_slots,
        world.stride(),
        layers.start,
        layers.end,
    );
    push(&mut input, &records);
    push(&mut input, &bits);
    push(&mut input, owners);
    match buffers {
        Buffers::BlockTable {
            table,
            stride,
            seq_lens,
        } => {
            push(&mut input, table);
            input.push_str(&format!("{stride}\n"));
            push(&mut input, seq_lens);
        }
        Buffers::Csr {
            indptr,
            indices,
            last,
        } => {
            push(&mut input, indptr);
            push(&mut input, indices);
            push(&mut input, last);
        }
        Buffers::ReqToToken {
            table,
            stride,
            reqs,
            seq_lens,
        } => {
            push(&mut input, table);
            input.push_str(&format!("{stride}\n"));
            push(&mut input, reqs);
            push(&mut input, seq_lens);
        }
        Buffers::Slots { starts, slots } => {
            push(&mut input, starts);
            push(&mut input, slots);
            input.push_str(if record { "1\n" } else { "0\n" });
        }
    }
    let mut child = Command::new(harness())
        .stdin(Stdio::piped())
        .stdout(Stdio::piped())
        .stderr(Stdio::piped())
        .spawn()
        .expect("run the harness");
    child
        .stdin
        .take()
        .expect("stdin")
        .write_all(input.as_bytes())
        .expect("feed the harness");
    let out = child.wait_with_output().expect("harness output");
    assert!(
        out.status.success(),
        "harness failed: {}",
        String::from_utf8_lossy(&out.stderr)
    );
    let text = String::from_utf8(out.stdout).expect("harness output is text");
    let mut lines = text.lines();
    let words: Vec<u32> = lines
        .next()
        .unwrap_or("")
        .split_whitespace()
        .map(|w| w.parse().expect("a record word"))
        .collect();
    assert_eq!(words.len(), REFUSAL_WORDS * owners.len());
    let bits = lines
        .next()
        .unwrap_or("")
        .split_whitespace()
        .map(|w| w.parse().expect("a written word"))
        .collect();
    let refusals = decode_engine_refusals(&words, buffers.layout()).expect("known codes");
    Device { refusals, bits }
}

/// The host-side check of the same buffers.
fn host(
    world: &World,
    owners: &[u64],
    buffers: &Buffers,
    layers: Range<u32>,
) -> Result<Vec<Verdict>, SanitizerError> {
    let owners: Vec<Owner> = owners.iter().map(|&r| owner(r)).collect();
    let (san, pool) = (&world.san, world.pool);
    match buffers {
        Buffers::BlockTable {
            table,
            stride,
            seq_lens,
        } => san.check_block_table(pool, &owners, table, *stride, seq_lens, layers, 1),
        Buffers::Csr {
            indptr,
            indices,
            last,
        } => san.check_paged_csr(pool, &owners, indptr, indices, last, layers, 1),
        Buffers::ReqToToken {
            table,
            stride,
            reqs,
            seq_lens,
        } => san.check_req_to_token(pool, &owners, table, *stride, reqs, seq_lens, layers, 1),
        Buffers::Slots { starts, slots } => {
            san.check_slot_mapping(pool, &owners, starts, slots, layers, 1)
        }
    }
}

fn is_bounds(finding: EngineFinding) -> bool {
    matches!(
        finding,
        EngineFinding::OutsideBuffer | EngineFinding::OutsidePool { .. } | EngineFinding::BadInput
    )
}

/// Runs both checks (the device first: the host's records its writes) and
/// requires them to agree; returns the device's refusals.
fn agree(
    world: &World,
    owners: &[u64],
    buffers: &Buffers,
    layers: Range<u32>,
    grid: (u32, u32),
) -> Vec<EngineRefusal> {
    let dev = device(world, owners, buffers, layers.clone(), grid);
    let host = host(world, owners, buffers, layers);
    let context = || {
        format!(
            "buffers {buffers:?}, owners {owners:?}, device {dev_r:?}",
            dev_r = dev.refusals
        )
    };
    match host {
        Err(SanitizerError::BadBatch { row, what, .. }) => {
            let first = dev.refusals.iter().find(|r| is_bounds(r.finding));
            assert_eq!(
                first.map(|r| r.row),
                Some(row),
                "the host refused row {row} ({what}); {}",
                context()
            );
        }
        Err(other) => panic!("host check failed: {other}; {}", context()),
        Ok(verdicts) => {
            assert!(
                !dev.refusals.iter().any(|r| is_bounds(r.finding)),
                "the host found the buffers usable; {}",
                context()
            );
            for (row, verdict) in verdicts.iter().enumerate() {
                let found = dev.refusals.iter().find(|r| r.row == row);
                assert_eq!(
                    found.and_then(EngineRefusal::kind),
                    verdict.kind(),
                    "row {row}; {}",
                    context()
                );
            }
            assert_eq!(
                dev.refusals.len(),
                verdicts.iter().filter(|v| !v.is_continue()).count(),
                "{}",
                context()
            );
        }
    }
    if buffers.layout() == BatchLayout::SlotMapping {
        assert_eq!(dev.bits, world.words().1, "written words; {}", context());
    }
    dev.refusals
}

const ONE_THREAD: (u32, u32) = (1, 1);

/// Two requests' pages: request 1 holds pages 0 and 1 (16 + 5 tokens
/// written), request 2 page 2 (16 written); page 3 was request 3's and is
/// free again; page 4 was never allocated.
fn two_requests() -> World {
    let world = World::new(6, 16, 2);
    world.written(0, 1, 16);
    world.written(1, 1, 5);
    world.written(2, 2, 16);
    let gone = world.written(3, 3, 16);
    world.free(gone, 3);
    world
}

fn kinds(refusals: &[EngineRefusal]) -> Vec<(usize, Option<ViolationKind>)> {
    refusals.iter().map(|r| (r.row, r.kind())).collect()
}

#[test]
fn a_block_table_as_written_passes_and_a_wrong_row_length_or_stride_is_refused() {
    let world = two_requests();
    let table = |table: Vec<i32>, stride, seq_lens| Buffers::BlockTable {
        table,
        stride,
        seq_lens,
    };
    let owners = [1, 2];
    // Legal: row 0 reads 21 tokens of pages 0, 1; row 1 16 of page 2.
    let legal = table(vec![0, 1, 2, -7], 2, vec![21, 16]);
    assert!(agree(&world, &owners, &legal, 0..2, (2, 3)).is_empty());
    // A wrong row: request 2's row points at request 1's page.
    let refused = agree(
        &world,
        &owners,
        &table(vec![0, 1, 0, 0], 2, vec![21, 16]),
        0..2,
        ONE_THREAD,
    );
    assert_eq!(kinds(&refused), [(1, Some(ViolationKind::ForeignRead))]);
    assert_eq!(refused[0].page.map(|p| p.page), Some(PageId(0)));
    // A wrong length: one token past what request 1 wrote.
    let refused = agree(
        &world,
        &owners,
        &table(vec![0, 1, 2, 0], 2, vec![22, 16]),
        0..2,
        ONE_THREAD,
    );
    assert_eq!(kinds(&refused), [(0, Some(ViolationKind::StaleRead))]);
    assert_eq!((refused[0].index, refused[0].slot), (Some(1), Some(5)));
    // A wrong stride: rows of 1 entry make row 1 read row 0's second entry.
    let refused = agree(
        &world,
        &owners,
        &table(vec![0, 1, 2], 1, vec![21, 16]),
        0..2,
        ONE_THREAD,
    );
    assert_eq!(kinds(&refused), [(1, Some(ViolationKind::ForeignRead))]);
    // A page freed since, and one never allocated.
    let refused = agree(
        &world,
        &owners,
        &table(vec![3, 4], 1, vec![1, 1]),
        0..1,
        ONE_THREAD,
    );
    assert_eq!(
        kinds(&refused),
        [
            (0, Some(ViolationKind::ReadFreePage)),
            (1, Some(ViolationKind::ReadFreePage))
        ]
    );
}

#[test]
fn paged_csr_and_token_tables_refuse_what_the_host_refuses() {
    let world = two_requests();
    let owners = [1, 2];
    let csr = |indptr, indices, last| Buffers::Csr {
        indptr,
        indices,
        last,
    };
    assert!(
        agree(
            &world,
            &owners,
            &csr(vec![0, 2, 3], vec![0, 1, 2], vec![5, 16]),
            0..2,
            (1, 2)
        )
        .is_empty()
    );
    // A last page one token longer than written.
    let refused = agree(
        &world,
        &owners,
        &csr(vec![0, 2, 3], vec![0, 1, 2], vec![6, 16]),
        0..2,
        ONE_THREAD,
    );
    assert_eq!(kinds(&refused), [(0, Some(ViolationKind::StaleRead))]);
    // Offsets that give row 1 row 0's last page.
    let refused = agree(
        &world,
        &owners,
        &csr(vec![0, 2, 3], vec![0, 1, 1], vec![5, 5]),
        0..2,
        ONE_THREAD,
    );
    assert_eq!(kinds(&refused), [(1, Some(ViolationKind::ForeignRead))]);

    let tokens = |table, stride, reqs, seq_lens| Buffers::ReqToToken {
        table,
        stride,
        reqs,
        seq_lens,
    };
    // Request slot 0: tokens at page 0 slots 0..16 then page 1 slots 0..5;
    // request slot 1: page 2.
    let mut table: Vec<i32> = (0..21).collect();
    table.resize(24, -1);
    table.extend(32..48);
    table.resize(48, -1);
    let legal = tokens(table.clone(), 24, vec![0, 1], vec![21, 16]);
    assert!(agree(&world, &owners, &legal, 0..2, (2, 2)).is_empty());
    // The wrong request slot for row 1.
    let refused = agree(
        &world,
        &owners,
        &tokens(table.clone(), 24, vec![0, 0], vec![21, 16]),
        0..2,
        ONE_THREAD,
    );
    assert_eq!(kinds(&refused), [(1, Some(ViolationKind::ForeignRead))]);
    // One token past what was written: its location is a slot never written.
    let mut longer = table.clone();
    longer[21] = 21;
    let refused = agree(
        &world,
        &owners,
        &tokens(longer, 24, vec![0, 1], vec![22, 16]),
        0..2,
        ONE_THREAD,
    );
    assert_eq!(kinds(&refused), [(0, Some(ViolationKind::StaleRead))]);
    assert_eq!((refused[0].index, refused[0].slot), (Some(21), Some(5)));
}

#[test]
fn store_slots_into_own_pages_are_recorded_and_into_others_refused() {
    let world = World::new(6, 16, 2);
    world.alloc(0, 1);
    world.alloc(1, 2);
    let shared = world.written(2, 3, 16);
    let verdict = world
        .san
        .share(world.pool, shared, owner(1))
        .expect("share");
    assert!(verdict.is_continue(), "{verdict:?}");
    let slots = |starts, slots| Buffers::Slots { starts, slots };
    // Row 0 stores 3 tokens (one padding) into page 0; row 1 two into page 1.
    let legal = slots(vec![0, 3, 5], vec![0, -1, 1, 16, 17]);
    assert!(agree(&world, &[1, 2], &legal, 0..2, (1, 3)).is_empty());
    // A wrong slot: row 1's second token goes to request 1's page.
    let refused = agree(
        &world,
        &[1, 2],
        &slots(vec![0, 1, 3], vec![2, 18, 3]),
        0..2,
        ONE_THREAD,
    );
    assert_eq!(kinds(&refused), [(1, Some(ViolationKind::ForeignWrite))]);
    assert_eq!((refused[0].index, refused[0].slot), (Some(2), Some(3)));
    // Into a shared page (nobody writes one) and into a free page.
    let refused = agree(
        &world,
        &[3, 1],
        &slots(vec![0, 1, 2], vec![36, 80]),
        0..2,
        ONE_THREAD,
    );
    assert_eq!(
        kinds(&refused),
        [
            (0, Some(ViolationKind::ForeignWrite)),
            (1, Some(ViolationKind::WriteAfterFree))
        ]
    );
}

#[test]
fn a_shared_page_read_by_a_sharer_is_left_to_the_host() {
    let world = World::new(4, 16, 1);
    let page = world.written(0, 1, 16);
    let verdict = world.san.share(world.pool, page, owner(2)).expect("share");
    assert!(verdict.is_continue(), "{verdict:?}");
    let buffers = Buffers::BlockTable {
        table: vec![0, 0],
        stride: 1,
        seq_lens: vec![16, 16],
    };
    let dev = device(&world, &[1, 2], &buffers, 0..1, ONE_THREAD);
    assert_eq!(dev.refusals.len(), 1);
    assert_eq!(
        (dev.refusals[0].row, dev.refusals[0].finding),
        (1, EngineFinding::Arbitrate)
    );
    let verdicts = host(&world, &[1, 2], &buffers, 0..1).expect("usable buffers");
    assert!(verdicts.iter().all(Verdict::is_continue), "{verdicts:?}");
}

#[test]
fn buffers_no_kernel_could_use_are_named_by_row_like_the_host_does() {
    let world = two_requests();
    let owners = [1, 2];
    let cases = [
        // An entry past the table, a page past the pool, a negative length.
        (
            Buffers::BlockTable {
                table: vec![0, 1, 2],
                stride: 2,
                seq_lens: vec![21, 17],
            },
            REFUSED_OUTSIDE_TABLE,
        ),
        (
            Buffers::BlockTable {
                table: vec![0, 1, 9, 0],
                stride: 2,
                seq_lens: vec![21, 16],
            },
            REFUSED_OUTSIDE_POOL,
        ),
        (
            Buffers::BlockTable {
                table: vec![0, 1, 2, 0],
                stride: 2,
                seq_lens: vec![21, -1],
            },
            REFUSED_BAD_INPUT,
        ),
        // Offsets that go backwards; a last page length of 0.
        (
            Buffers::Csr {
                indptr: vec![0, 2, 1],
                indices: vec![0, 1, 2],
                last: vec![5, 16],
            },
            REFUSED_BAD_INPUT,
        ),
        (
            Buffers::Csr {
                indptr: vec![0, 2, 3],
                indices: vec![0, 1, 2],
                last: vec![5, 0],
            },
            REFUSED_BAD_INPUT,
        ),
        // A negative location; a location past the pool.
        (
            Buffers::ReqToToken {
                table: vec![0, 1, -3, 33],
                stride: 2,
                reqs: vec![0, 1],
                seq_lens: vec![2, 2],
            },
            REFUSED_BAD_INPUT,
        ),
        (
            Buffers::ReqToToken {
                table: vec![0, 1, 32, 999],
                stride: 2,
                reqs: vec![0, 1],
                seq_lens: vec![2, 2],
            },
            REFUSED_OUTSIDE_POOL,
        ),
        // A store location of -2 (only -1 is padding); tokens past the slots.
        (
            Buffers::Slots {
                starts: vec![0, 1, 2],
                slots: vec![0, -2],
            },
            REFUSED_BAD_INPUT,
        ),
        (
            Buffers::Slots {
                starts: vec![0, 1, 3],
                slots: vec![0, 32],
            },
            REFUSED_OUTSIDE_TABLE,
        ),
    ];
    for (buffers, code) in cases {
        let refused = agree(&world, &owners, &buffers, 0..2, ONE_THREAD);
        let expected = match code {
            REFUSED_OUTSIDE_TABLE => "outside the buffer",
            REFUSED_OUTSIDE_POOL => "outside the pool",
            _ => "unusable",
        };
        assert_eq!(refused.len(), 1, "{buffers:?}: {refused:?}");
        let finding = refused[0].finding;
        let matches = match code {
            REFUSED_OUTSIDE_TABLE => finding == EngineFinding::OutsideBuffer,
            REFUSED_OUTSIDE_POOL => matches!(finding, EngineFinding::OutsidePool { .. }),
            _ => finding == EngineFinding::BadInput,
        };
        assert!(matches, "{buffers:?}: expected {expected}, got {finding:?}");
        assert_eq!(refused[0].row, 1, "{buffers:?}");
    }
}

/// A random pool: each page free, owned with a random prefix written for
/// all layers or only the first, or freed again; requests 1..=4.
fn random_world(rng: &mut StdRng) -> (World, Vec<Vec<u32>>) {
    let page_slots = [4, 16, 32][rng.random_range(0..3)];
    let layers = rng.random_range(1..=3);
    let world = World::new(10, page_slots, layers);
    let mut held: Vec<Vec<u32>> = vec![Vec::new(); 5];
    for page in 0..world.pages {
        match rng.random_range(0..6) {
            0 => {}
            1 => {
                let request = rng.random_range(1..=4);
                let p = world.written(page, request, page_slots);
                world.free(p, request);
            }
            k => {
                let request = rng.random_range(1..=4);
                let p = world.alloc(page, request);
                let written = if k == 2 {
                    rng.random_range(0..=page_slots)
                } else {
                    page_slots
                };
                let upto = if k == 3 && layers > 1 { 1 } else { layers };
                world.write(p, request, 0..written, 0..upto);
                held[request as usize].push(page);
            }
        }
    }
    (world, held)
}

/// A page index: mostly one the row's request holds, sometimes any page,
/// rarely one outside the pool or negative.
fn pick(rng: &mut StdRng, world: &World, held: &[u32]) -> i32 {
    match rng.random_range(0..40) {
        0 => -1,
        1 => world.pages as i32 + rng.random_range(0..3),
        2..=9 => rng.random_range(0..world.pages) as i32,
        _ if !held.is_empty() => held[rng.random_range(0..held.len())] as i32,
        _ => rng.random_range(0..world.pages) as i32,
    }
}

fn random_buffers(rng: &mut StdRng, world: &World, held: &[Vec<u32>], owners: &[u64]) -> Buffers {
    let ps = world.page_slots as i32;
    let rows = owners.len();
    let len = |rng: &mut StdRng| match rng.random_range(0..30) {
        0 => -1,
        _ => rng.random_range(0..=3 * ps),
    };
    match rng.random_range(0..4) {
        0 => {
            let stride = rng.random_range(1..=4);
            let table = (0..rows * stride + rng.random_range(0..2))
                .map(|i| {
                    pick(
                        rng,
                        world,
                        &held[owners[(i / stride).min(rows - 1)] as usize],
                    )
                })
                .collect();
            let seq_lens = (0..rows)
                .map(|_| len(rng).min(stride as i32 * ps + 1))
                .collect();
            Buffers::BlockTable {
                table,
                stride,
                seq_lens,
            }
        }
        1 => {
            let mut indptr = vec![0];
            let mut indices = Vec::new();
            let mut last = Vec::new();
            for &o in owners {
                for _ in 0..rng.random_range(0..=3) {
                    indices.push(pick(rng, world, &held[o as usize]));
                }
                let mut end = indices.len() as i32;
                if rng.random_range(0..30) == 0 {
                    end = (end - 2).max(0);
                }
                indptr.push(end);
                last.push(if rng.random_range(0..30) == 0 {
                    0
                } else {
                    rng.random_range(1..=ps)
                });
            }
            if rng.random_range(0..20) == 0 {
                indices.pop();
            }
            Buffers::Csr {
                indptr,
                indices,
                last,
            }
        }
        2 => {
            let stride = rng.random_range(1..=3 * ps as usize);
            let slots_of = rows + 1;
            let mut table = Vec::with_capacity(slots_of * stride);
            for r in 0..slots_of {
                let o = owners[r.min(rows - 1)] as usize;
                let mut page = pick(rng, world, &held[o]);
                for t in 0..stride {
                    if t % ps as usize == 0 && t > 0 {
                        page = pick(rng, world, &held[o]);
                    }
                    table.push(page.saturating_mul(ps) + (t as i32 % ps));
                }
            }
            let reqs = (0..rows)
                .map(|r| {
                    if rng.random_range(0..10) == 0 {
                        rng.random_range(-1..=slots_of as i32)
                    } else {
                        r as i32
                    }
                })
                .collect();
            let seq_lens = (0..rows).map(|_| len(rng).min(stride as i32 + 1)).collect();
            Buffers::ReqToToken {
                table,
                stride,
                reqs,
                seq_lens,
            }
        }
        _ => {
            let mut starts = vec![0];
            let mut slots = Vec::new();
            for &o in owners {
                for _ in 0..rng.random_range(0..=4) {
                    slots.push(match rng.random_range(0..12) {
                        0 => -1,
                        1 if rng.random_range(0..4) == 0 => -5,
                        _ => {
                            let page = i64::from(pick(rng, world, &held[o as usize]));
                            page * i64::from(ps) + rng.random_range(0..i64::from(ps))
                        }
                    });
                }
                starts.push(slots.len() as i32);
            }
            if rng.random_range(0..20) == 0 {
                slots.pop();
            }
            Buffers::Slots { starts, slots }
        }
    }
}

#[test]
fn random_buffers_over_random_pools_get_the_hosts_verdict_row_by_row() {
    let mut rng = StdRng::seed_from_u64(0x006b_7673_616e);
    let mut seen = std::collections::BTreeMap::<String, usize>::new();
    for _ in 0..400 {
        let (world, held) = random_world(&mut rng);
        let rows = rng.random_range(1..=4);
        // Distinct requests per row: a row the host aborts does not make
        // another row's reader an ended request.
        let mut owners: Vec<u64> = (1..=4).collect();
        owners.truncate(rows);
        let lo = rng.random_range(0..world.layers);
        let hi = rng.random_range(lo + 1..=world.layers);
        let grid = (rng.random_range(1..=2), rng.random_range(1..=3));
        let buffers = random_buffers(&mut rng, &world, &held, &owners);
        for r in agree(&world, &owners, &buffers, lo..hi, grid) {
            let name = match r.finding {
                EngineFinding::Refused(kind) => kind.to_string(),
                EngineFinding::OutsidePool { .. } => "outside the pool".into(),
                other => format!("{other:?}"),
            };
            *seen.entry(name).or_default() += 1;
        }
    }
    // The cases reach every finding these pools can give, not only passes.
    for finding in [
        "foreign-read",
        "read-free-page",
        "stale-read",
        "foreign-write",
        "write-after-free",
        "OutsideBuffer",
        "outside the pool",
        "BadInput",
    ] {
        assert!(seen.contains_key(finding), "no {finding} in {seen:?}");
    }
}
