//! The CUDA kernels against the CPU kernels.
//!
//! Tests that need a GPU are `#[ignore = "requires CUDA"]`; run them where
//! one is, with NVRTC on the library path:
//!
//! ```text
//! cargo test -p kvsan-kernels --features cuda -- --ignored
//! ```
//!
//! `cuda_sources_compile_with_nvrtc` runs everywhere: it compiles every CUDA
//! source with a real NVRTC when one can be loaded (`scripts/nvrtc-check`
//! installs one), and says it skipped otherwise — unless
//! `KVSAN_REQUIRE_NVRTC=1`, which makes a missing NVRTC a failure.
#![cfg(feature = "cuda")]

use half::f16;
use kvsan_kernels::attention::{
    DecodeSeq, KvGeometry, paged_attention_decode, paged_attention_decode_checked,
};
use kvsan_kernels::cuda::result::{driver_present, nvrtc_present};
use kvsan_kernels::cuda::{
    CompileTarget, CudaError, CudaKernels, CudaKvPool, CudaSource, ImageKind, POISON_F16_BITS,
    SOURCES, compile, cuda_available, nvrtc_version, supported_archs,
};
use kvsan_kernels::error::KernelError;
use kvsan_sanitizer::{Generation, PageId, PageRef};
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

fn random_generations(rng: &mut StdRng, n_pages: usize) -> Vec<Generation> {
    (0..n_pages)
        .map(|_| Generation(rng.random_range(1..1000)))
        .collect()
}

/// Sequences of the given lengths over distinct random pages, each block
/// table one entry longer than needed (entries past `seq_len` are not read).
struct Batch {
    queries: Vec<Vec<f32>>,
    tables: Vec<Vec<PageRef>>,
    lens: Vec<usize>,
}

impl Batch {
    fn new(
        rng: &mut StdRng,
        geometry: &KvGeometry,
        n_heads: usize,
        lens: &[usize],
        generations: &[Generation],
    ) -> Batch {
        let mut pages: Vec<u32> = (0..generations.len() as u32).collect();
        pages.shuffle(rng);
        let mut free = pages.into_iter();
        let tables = lens
            .iter()
            .map(|&len| {
                (0..len.div_ceil(geometry.page_slots) + 1)
                    .map(|_| {
                        let page = free.next().expect("pool large enough for the batch");
                        PageRef::new(page, generations[page as usize].0)
                    })
                    .collect()
            })
            .collect();
        let queries = lens
            .iter()
            .map(|_| {
                (0..n_heads * geometry.head_dim)
                    .map(|_| rng.random_range(-2.0f32..2.0))
                    .collect()
            })
            .collect();
        Batch {
            queries,
            tables,
            lens: lens.to_vec(),
        }
    }

    fn seqs(&self) -> Vec<DecodeSeq<'_>> {
        (0..self.lens.len())
            .map(|i| DecodeSeq {
                q: &self.queries[i],
                block_table: &self.tables[i],
                seq_len: self.lens[i],
            })
            .collect()
    }
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

fn decode_matches_cpu(geometry: KvGeometry, n_heads: usize, lens: &[usize], seed: u64) {
    let mut rng = StdRng::seed_from_u64(seed);
    let n_pages = lens
        .iter()
        .map(|l| l.div_ceil(geometry.page_slots) + 1)
        .sum::<usize>()
        + 3;
    let host = random_pool(&mut rng, &geometry, n_pages);
    let generations = random_generations(&mut rng, n_pages);
    let batch = Batch::new(&mut rng, &geometry, n_heads, lens, &generations);
    let seqs = batch.seqs();
    let scale = 1.0 / (geometry.head_dim as f32).sqrt();
    let kernels = kernels();
    let pool = kernels
        .upload_pool(geometry, &host, &generations)
        .expect("upload pool");
    for layer in 0..geometry.n_layers {
        let mut cpu = vec![0.0f32; lens.len() * n_heads * geometry.head_dim];
        paged_attention_decode(&host, &geometry, layer, n_heads, scale, &seqs, &mut cpu);
        for checked in [false, true] {
            let gpu = kernels
                .decode_attention(&pool, layer, n_heads, scale, &seqs, checked)
                .expect("decode");
            assert_close(&gpu, &cpu, &format!("layer {layer}, checked {checked}"));
        }
    }
}

#[test]
#[ignore = "requires CUDA"]
fn decode_matches_cpu_with_grouped_query_heads_and_partial_pages() {
    // SmolLM2's attention shape: 9 query heads over 3 KV heads, head_dim 64.
    let geometry = KvGeometry {
        page_slots: 16,
        n_layers: 2,
        n_kv_heads: 3,
        head_dim: 64,
    };
    decode_matches_cpu(geometry, 9, &[1, 15, 16, 17, 100, 0, 333], 1);
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
}

#[test]
#[ignore = "requires CUDA"]
fn checked_decode_refuses_a_stale_generation_naming_sequence_page_and_both_generations() {
    let geometry = KvGeometry {
        page_slots: 4,
        n_layers: 2,
        n_kv_heads: 2,
        head_dim: 32,
    };
    let n_heads = 4;
    let mut rng = StdRng::seed_from_u64(4);
    let n_pages = 32;
    let host = random_pool(&mut rng, &geometry, n_pages);
    let generations = random_generations(&mut rng, n_pages);
    let mut batch = Batch::new(&mut rng, &geometry, n_heads, &[6, 13, 9], &generations);
    // Sequence 1's third page was freed and re-allocated since its block
    // table was written: the table holds the old generation.
    let stale = batch.tables[1][2];
    batch.tables[1][2] = PageRef::new(stale.page.0, stale.generation.0 - 1);
    let seqs = batch.seqs();
    let scale = 0.125;

    let kernels = kernels();
    let pool = kernels
        .upload_pool(geometry, &host, &generations)
        .expect("upload pool");
    let mut cpu = vec![0.0f32; 3 * n_heads * geometry.head_dim];
    let cpu_err = paged_attention_decode_checked(
        &host,
        &geometry,
        1,
        n_heads,
        scale,
        &seqs,
        &mut cpu,
        &generations,
    )
    .expect_err("CPU refuses the stale page");
    let gpu_err = kernels
        .decode_attention(&pool, 1, n_heads, scale, &seqs, true)
        .expect_err("GPU refuses the stale page");
    let expected = KernelError::GenerationMismatch {
        seq: 1,
        index: 2,
        page: stale.page,
        found: Generation(stale.generation.0 - 1),
        current: stale.generation,
    };
    assert_eq!(cpu_err, expected);
    match gpu_err {
        CudaError::Kernel(err) => assert_eq!(err, expected),
        other => panic!("expected a generation mismatch, got {other}"),
    }

    // Unchecked, the same stale table is read (what a release build does).
    let mut cpu = vec![0.0f32; 3 * n_heads * geometry.head_dim];
    paged_attention_decode(&host, &geometry, 1, n_heads, scale, &seqs, &mut cpu);
    let gpu = kernels
        .decode_attention(&pool, 1, n_heads, scale, &seqs, false)
        .expect("unchecked decode reads the stale page");
    assert_close(&gpu, &cpu, "unchecked over a stale table");
}

#[test]
#[ignore = "requires CUDA"]
fn decode_refuses_a_page_outside_the_pool_even_unchecked() {
    let geometry = KvGeometry {
        page_slots: 4,
        n_layers: 1,
        n_kv_heads: 1,
        head_dim: 32,
    };
    let mut rng = StdRng::seed_from_u64(5);
    let host = random_pool(&mut rng, &geometry, 4);
    let generations = random_generations(&mut rng, 4);
    let kernels = kernels();
    let pool = kernels
        .upload_pool(geometry, &host, &generations)
        .expect("upload pool");
    let q = vec![0.5f32; 32];
    let table = [PageRef::new(1, generations[1].0), PageRef::new(9, 1)];
    let seqs = [DecodeSeq {
        q: &q,
        block_table: &table,
        seq_len: 6,
    }];
    for checked in [false, true] {
        match kernels.decode_attention(&pool, 0, 1, 1.0, &seqs, checked) {
            Err(CudaError::Kernel(KernelError::PageOutOfRange {
                seq: 0,
                index: 1,
                page: PageId(9),
                n_pages: 4,
            })) => {}
            other => panic!("expected page 9 out of range, got {other:?}"),
        }
    }
}

fn bits(pages: &[f16]) -> Vec<u16> {
    pages.iter().map(|v| v.to_bits()).collect()
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

    // Reading a poisoned page unchecked shows: NaN output, for that sequence only.
    let q = vec![0.25f32; 2 * geometry.head_dim];
    let poisoned = [PageRef::new(3, generations[3].0)];
    let clean = [PageRef::new(4, generations[4].0)];
    let seqs = [
        DecodeSeq {
            q: &q,
            block_table: &poisoned,
            seq_len: 3,
        },
        DecodeSeq {
            q: &q,
            block_table: &clean,
            seq_len: 3,
        },
    ];
    let out = kernels
        .decode_attention(&pool, 2, 2, 0.25, &seqs, false)
        .expect("decode");
    let (first, second) = out.split_at(out.len() / 2);
    assert!(first.iter().all(|v| v.is_nan()), "poison reached no output");
    assert!(
        second.iter().all(|v| v.is_finite()),
        "poison leaked across sequences"
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
