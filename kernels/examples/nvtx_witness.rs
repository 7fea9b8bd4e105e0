//! A second witness for kvsan's page rules: NVIDIA's compute-sanitizer,
//! told about the pool's pages through NVTX ([`NvtxPool`]), with every kvsan
//! check off (the kernels run with their bounds check only, as a release
//! build does). Run one scenario per process under compute-sanitizer:
//!
//! ```text
//! compute-sanitizer --tool memcheck --destroy-on-device-error kernel \
//!     target/release/examples/nvtx_witness use-after-free
//! ```
//!
//! | scenario | what the kernels do | tool | seen (H200, CUDA 13.0) |
//! | --- | --- | --- | --- |
//! | `legal` | request 1 stores into and reads its own pages | memcheck, initcheck | no error |
//! | `use-after-free` | a decode reads a page freed since its block table was built | memcheck | "Invalid __global__ read … out of bounds" |
//! | `store-after-free` | a store writes a freed page | memcheck | "Invalid __global__ write … out of bounds" |
//! | `foreign-read` | request 2's decode, bound to request 2's permissions, reads request 1's page | memcheck | "Invalid __global__ read … not readable" |
//! | `stale-read` | request 2 reads a reused page that only request 1 wrote (the incident) | initcheck | "Uninitialized __global__ memory read" |
//! | `probe` | which heaps the tool takes (see [`NvtxPool::new`]) | memcheck | printed |
//! | `shim-legal`, `shim-use-after-free` | as `legal` and `use-after-free`, the pool described and kept in step through the shim's C ABI (`kvsan_nvtx_describe_pool`, `kvsan_alloc`, `kvsan_free`; `KVSAN_SHIM` names a `libkvsan_shim.so` built with feature `nvtx`) | memcheck | as `legal`, `use-after-free` |
//!
//! Without a tool attached it says so and runs the same launches (no error
//! can be seen then). Exit status 0 when every launch returned, or when a
//! launch the scenario made illegal came back with a CUDA error (the tool
//! may stop the kernel); 1 on anything else; 2 on a bad argument.

use std::process::ExitCode;

use kvsan_kernels::RowLedger;
use kvsan_kernels::attention::{KvBatch, KvGeometry, StoreSlot};
use kvsan_kernels::cuda::{
    CudaError, CudaKernels, CudaKvPool, NvtxPool, ReadCheck, StoreCheck, cuda_available, probe_heap,
};
use kvsan_sanitizer::{
    NodeRole, Options, Owner, PageId, PageRef, PoolGeometry, PoolId, RequestId, Sanitizer,
};

const GEOMETRY: KvGeometry = KvGeometry {
    page_slots: 16,
    n_layers: 1,
    n_kv_heads: 1,
    head_dim: 64,
};
const PAGES: usize = 8;
const HEADS: usize = 1;

const SCENARIOS: [&str; 8] = [
    "probe",
    "shim-legal",
    "shim-use-after-free",
    "legal",
    "use-after-free",
    "store-after-free",
    "foreign-read",
    "stale-read",
];

struct World {
    san: Sanitizer,
    pool_id: PoolId,
    kernels: CudaKernels,
    pool: CudaKvPool,
}

impl World {
    fn new() -> Result<World, String> {
        let kernels = CudaKernels::new(0).map_err(|e| format!("CUDA: {e}"))?;
        let pool = kernels
            .alloc_pool(GEOMETRY, PAGES)
            .map_err(|e| format!("allocate the pool: {e}"))?;
        // Reuse at once, as a release engine does (no quarantine).
        let mut options = Options::default();
        options.quarantine_pages = 0;
        let san = Sanitizer::with_writer(options, std::io::sink());
        let pool_id = san
            .pool_register(PoolGeometry {
                pages: PAGES as u32,
                page_slots: GEOMETRY.page_slots as u32,
                layers: GEOMETRY.n_layers as u32,
                bytes_per_slot: (2 * GEOMETRY.slot_width() * 2) as u64,
                role: NodeRole::Unified,
                node: "nvtx-witness".into(),
            })
            .map_err(|e| format!("register the pool: {e}"))?;
        let mut pool = pool;
        pool.attach_nvtx("nvtx-witness")
            .map_err(|e| format!("NVTX: {e}"))?;
        Ok(World {
            san,
            pool_id,
            kernels,
            pool,
        })
    }

    /// The sanitizer's books, then the NVTX regions and the pool's
    /// generation array, as an engine's allocator would keep them.
    fn alloc(&mut self, page: u32, request: u64) -> Result<PageRef, String> {
        let (_, generation) = self
            .san
            .alloc(
                self.pool_id,
                PageId(page),
                Owner::new(request, request as u32),
                0,
            )
            .map_err(|e| format!("alloc: {e}"))?;
        self.pool
            .set_generation(PageId(page), generation)
            .map_err(|e| e.to_string())?;
        self.sync(page)?;
        Ok(PageRef {
            page: PageId(page),
            generation,
        })
    }

    fn free(&mut self, page: PageRef, request: u64) -> Result<(), String> {
        let _ = self
            .san
            .free(self.pool_id, Owner::new(request, request as u32), page, 0)
            .map_err(|e| format!("free: {e}"))?;
        self.sync(page.page.0)
    }

    fn nvtx(&mut self) -> &mut NvtxPool {
        self.pool.nvtx_mut().expect("attached in World::new")
    }

    fn sync(&mut self, page: u32) -> Result<(), String> {
        let shadow = self
            .san
            .kernel_shadow(self.pool_id)
            .map_err(|e| e.to_string())?;
        self.pool
            .nvtx_mut()
            .expect("attached in World::new")
            .sync(&shadow, &[PageId(page)])
            .map(|_| ())
            .map_err(|e| format!("NVTX sync: {e}"))
    }

    fn store(&mut self, page: PageRef, tokens: u32) -> Result<(), CudaError> {
        store(&self.kernels, &mut self.pool, page, tokens)
    }

    fn decode(&self, page: PageRef, len: u32) -> Result<(), CudaError> {
        decode(&self.kernels, &self.pool, page, len)
    }
}

/// Stores `tokens` tokens into `page`, slots 0.., with the bounds check only.
fn store(
    kernels: &CudaKernels,
    pool: &mut CudaKvPool,
    page: PageRef,
    tokens: u32,
) -> Result<(), CudaError> {
    let slots: Vec<StoreSlot> = (0..tokens).map(|slot| StoreSlot { page, slot }).collect();
    let batch = KvBatch {
        block_tables: &[page],
        width: 1,
        seq_lens: &[tokens],
        query_start: &[0, tokens],
        store_slots: &slots,
    };
    let kv: Vec<f32> = (0..tokens as usize * GEOMETRY.slot_width())
        .map(|i| (i % 7) as f32 * 0.25)
        .collect();
    kernels
        .store_kv(
            pool,
            0,
            &batch,
            &kv,
            &kv,
            StoreCheck::Bounds,
            &RowLedger::new(1),
        )
        .map(|_| ())
}

/// Decodes one row over `page`'s first `len` slots, bounds check only.
fn decode(
    kernels: &CudaKernels,
    pool: &CudaKvPool,
    page: PageRef,
    len: u32,
) -> Result<(), CudaError> {
    let batch = KvBatch {
        block_tables: &[page],
        width: 1,
        seq_lens: &[len],
        query_start: &[0, 1],
        store_slots: &[StoreSlot::PADDING],
    };
    let q = vec![0.5f32; HEADS * GEOMETRY.head_dim];
    kernels
        .attend_decode(
            pool,
            0,
            HEADS,
            0.125,
            &batch,
            &q,
            ReadCheck::Bounds,
            &RowLedger::new(1),
        )
        .map(|_| ())
}

/// A launch the scenario makes illegal: a CUDA error from it is what a tool
/// that stops the kernel gives back.
fn illegal(what: &str, result: Result<(), CudaError>) {
    match result {
        Ok(()) => println!("nvtx_witness: {what}: launched"),
        Err(e) => println!("nvtx_witness: {what}: the launch came back with an error ({e})"),
    }
}

/// Which heaps an attached tool accepts: the pool's own memory, a fresh
/// stream-ordered allocation, fresh plain allocations named and unnamed, a
/// part of one, and a range registered (and unregistered) before.
fn probe() -> Result<(), String> {
    let kernels = CudaKernels::new(0).map_err(|e| format!("CUDA: {e}"))?;
    let pool = kernels
        .alloc_pool(GEOMETRY, PAGES)
        .map_err(|e| format!("allocate the pool: {e}"))?;
    let plane = pool.nvtx_plane();
    let bytes = plane.page_stride * PAGES as u64;
    let show = |label: &str, ok: bool| {
        println!(
            "nvtx_witness: probe {label}: {}",
            if ok { "accepted" } else { "refused" }
        )
    };
    let plain = || {
        // SAFETY: a plain allocation of `bytes`, freed below, used by nothing.
        unsafe { cudarc::driver::result::malloc_sync(bytes as usize) }
            .map_err(|e| format!("cuMemAlloc: {e}"))
    };
    let (one, two, three) = (plain()?, plain()?, plain()?);
    show(
        "A the pool's pages, named",
        probe_heap(plane.base, bytes, Some("kvsan probe")),
    );
    let stream = cudarc::driver::CudaContext::new(0)
        .map_err(|e| e.to_string())?
        .default_stream();
    // SAFETY: a stream-ordered allocation, never read; dropped below.
    let ordered = unsafe { stream.alloc::<u8>(bytes as usize) }.map_err(|e| e.to_string())?;
    let (ordered_ptr, _sync) = cudarc::driver::DevicePtr::device_ptr(&ordered, &stream);
    show(
        "B stream-ordered, named",
        probe_heap(ordered_ptr, bytes, Some("kvsan probe")),
    );
    show(
        "C plain, named",
        probe_heap(one, bytes, Some("kvsan probe")),
    );
    show("D plain, unnamed", probe_heap(two, bytes, None));
    show(
        "E part of a plain one, named",
        probe_heap(three + 4096, bytes - 8192, Some("kvsan probe")),
    );
    show(
        "F plain, registered before, named",
        probe_heap(one, bytes, Some("kvsan probe")),
    );
    for ptr in [one, two, three] {
        // SAFETY: allocated above, not used since.
        unsafe { cudarc::driver::result::free_sync(ptr) }.map_err(|e| format!("cuMemFree: {e}"))?;
    }
    Ok(())
}

/// The shim's C ABI, loaded from `$KVSAN_SHIM`.
struct Shim {
    lib: libloading::Library,
}

type Status = i32;

impl Shim {
    fn load() -> Result<Shim, String> {
        let path = std::env::var_os("KVSAN_SHIM").ok_or(
            "the shim scenarios need KVSAN_SHIM (a libkvsan_shim.so built with feature nvtx)",
        )?;
        // SAFETY: the kvsan shim's constructor reads its options and starts
        // nothing else; it is built from this repository.
        let lib = unsafe { libloading::Library::new(&path) }
            .map_err(|e| format!("load the shim: {e}"))?;
        Ok(Shim { lib })
    }

    /// `name` from the shim, with the C type `T`.
    fn get<T: Copy>(&self, name: &[u8]) -> Result<T, String> {
        // SAFETY: each caller names `T` as kvsan.h declares `name`.
        unsafe { self.lib.get::<T>(name) }
            .map(|f| *f)
            .map_err(|e| format!("shim symbol {}: {e}", String::from_utf8_lossy(name)))
    }

    fn ok(what: &str, status: Status) -> Result<(), String> {
        if status == 0 {
            Ok(())
        } else {
            Err(format!("{what}: status {status}"))
        }
    }
}

/// The `legal` and `use-after-free` scenarios, with the pool's pages
/// described to NVTX by the shim and its alloc and free keeping them in
/// step (what an engine with its own pool does).
fn shim(scenario: &str) -> Result<(), String> {
    use kvsan_sanitizer::abi::{
        KvsanNvtxPlane, KvsanOwner, KvsanPageRef, KvsanPoolGeometry, KvsanVerdict,
    };
    let kernels = CudaKernels::new(0).map_err(|e| format!("CUDA: {e}"))?;
    let mut pool = kernels
        .alloc_pool(GEOMETRY, PAGES)
        .map_err(|e| format!("allocate the pool: {e}"))?;
    let shim = Shim::load()?;
    type Register = unsafe extern "C" fn(*const KvsanPoolGeometry, usize, *mut u32) -> Status;
    type Event = unsafe extern "C" fn(KvsanOwner, u32, *mut KvsanVerdict) -> Status;
    type Alloc = unsafe extern "C" fn(
        u32,
        KvsanOwner,
        u32,
        u64,
        *mut KvsanPageRef,
        *mut KvsanVerdict,
    ) -> Status;
    type Free =
        unsafe extern "C" fn(u32, KvsanOwner, KvsanPageRef, u64, *mut KvsanVerdict) -> Status;
    type Describe = unsafe extern "C" fn(u32, i32, *const KvsanNvtxPlane, usize, usize) -> Status;
    type Forget = unsafe extern "C" fn(u32) -> Status;
    let register: Register = shim.get(b"kvsan_pool_register")?;
    let event: Event = shim.get(b"kvsan_request_event")?;
    let alloc: Alloc = shim.get(b"kvsan_alloc")?;
    let free: Free = shim.get(b"kvsan_free")?;
    let describe: Describe = shim.get(b"kvsan_nvtx_describe_pool")?;
    let forget: Forget = shim.get(b"kvsan_nvtx_forget_pool")?;

    let node = b"nvtx-witness-shim";
    let geometry = KvsanPoolGeometry {
        pages: PAGES as u32,
        page_slots: GEOMETRY.page_slots as u32,
        layers: GEOMETRY.n_layers as u32,
        role: 0,
        bytes_per_slot: (2 * GEOMETRY.slot_width() * 2) as u64,
        node: node.as_ptr(),
        node_len: node.len(),
    };
    let mut id = 0u32;
    let mut verdict = KvsanVerdict::default();
    let who = KvsanOwner {
        request: 1,
        tenant: 1,
        reserved: 0,
    };
    let plane = pool.nvtx_plane();
    let plane = KvsanNvtxPlane {
        base: plane.base,
        page_stride: plane.page_stride,
        page_bytes: plane.page_bytes,
    };
    // SAFETY: every pointer is to a live local of the type kvsan.h names,
    // and the sizes are those types' (the layout test holds them to the
    // header's).
    unsafe {
        Shim::ok(
            "kvsan_pool_register",
            register(&geometry, size_of::<KvsanPoolGeometry>(), &mut id),
        )?;
        for e in [0, 1, 4] {
            Shim::ok("kvsan_request_event", event(who, e, &mut verdict))?;
        }
        Shim::ok(
            "kvsan_nvtx_describe_pool",
            describe(id, 0, &plane, 1, size_of::<KvsanNvtxPlane>()),
        )?;
    }
    println!("nvtx_witness: scenario {scenario}: pool described through the shim");
    let mut page = KvsanPageRef::default();
    // SAFETY: as above.
    unsafe { Shim::ok("kvsan_alloc", alloc(id, who, 2, 0, &mut page, &mut verdict))? };
    let page_ref = PageRef::new(page.page, page.generation);
    pool.set_generation(page_ref.page, page_ref.generation)
        .map_err(|e| e.to_string())?;
    store(&kernels, &mut pool, page_ref, 8).map_err(|e| format!("store: {e}"))?;
    if scenario == "shim-legal" {
        decode(&kernels, &pool, page_ref, 8).map_err(|e| format!("decode: {e}"))?;
    }
    // SAFETY: as above.
    unsafe { Shim::ok("kvsan_free", free(id, who, page, 0, &mut verdict))? };
    if scenario == "shim-use-after-free" {
        illegal(
            "decode over the page the shim saw freed",
            decode(&kernels, &pool, page_ref, 8),
        );
    }
    if let Err(e) = kernels.synchronize_device() {
        println!("nvtx_witness: the device reported: {e}");
    }
    // Before the memory goes: the tool refuses to unregister a heap whose
    // memory is gone.
    // SAFETY: a plain call with the pool's id.
    unsafe { Shim::ok("kvsan_nvtx_forget_pool", forget(id))? };
    println!("nvtx_witness: scenario {scenario} done");
    Ok(())
}

fn run(scenario: &str) -> Result<(), String> {
    if scenario == "probe" {
        return probe();
    }
    if scenario.starts_with("shim-") {
        return shim(scenario);
    }
    let mut w = World::new()?;
    println!(
        "nvtx_witness: scenario {scenario}; NVTX tool attached: {}",
        if w.nvtx().tool_attached() {
            "yes"
        } else {
            "no"
        }
    );
    let legal = |what: &str, r: Result<(), CudaError>| r.map_err(|e| format!("{what}: {e}"));
    match scenario {
        "legal" => {
            let a = w.alloc(0, 1)?;
            let b = w.alloc(1, 1)?;
            w.nvtx().bind(&[RequestId(1)]);
            legal("store", w.store(a, 16))?;
            legal("store", w.store(b, 4))?;
            legal("decode", w.decode(a, 16))?;
            w.nvtx().unbind();
            w.free(a, 1)?;
            w.free(b, 1)?;
        }
        "use-after-free" => {
            let a = w.alloc(2, 1)?;
            legal("store", w.store(a, 8))?;
            w.free(a, 1)?;
            illegal("decode over the freed page", w.decode(a, 8));
        }
        "store-after-free" => {
            let a = w.alloc(3, 1)?;
            w.free(a, 1)?;
            illegal("store into the freed page", w.store(a, 1));
        }
        "foreign-read" => {
            let a = w.alloc(4, 1)?;
            let _b = w.alloc(5, 2)?;
            legal("store", w.store(a, 8))?;
            w.nvtx().bind(&[RequestId(2)]);
            illegal("request 2's decode over request 1's page", w.decode(a, 8));
            w.nvtx().unbind();
        }
        "stale-read" => {
            let a = w.alloc(6, 1)?;
            legal("store", w.store(a, 16))?;
            w.free(a, 1)?;
            let b = w.alloc(6, 2)?;
            // Request 2 reads what request 1 wrote: legal bytes to memcheck.
            legal("decode of the reused page", w.decode(b, 16))?;
        }
        other => return Err(format!("unknown scenario {other:?}")),
    }
    w.kernels.synchronize_device().or_else(|e| {
        // After an illegal launch a tool may have stopped the kernel.
        println!("nvtx_witness: the device reported: {e}");
        Ok::<(), String>(())
    })?;
    println!("nvtx_witness: scenario {scenario} done");
    Ok(())
}

fn main() -> ExitCode {
    let args: Vec<String> = std::env::args().skip(1).collect();
    let [scenario] = args.as_slice() else {
        eprintln!(
            "usage: nvtx_witness SCENARIO   (one of: {})",
            SCENARIOS.join(", ")
        );
        return ExitCode::from(2);
    };
    if !SCENARIOS.contains(&scenario.as_str()) {
        eprintln!(
            "nvtx_witness: unknown scenario {scenario:?} (one of: {})",
            SCENARIOS.join(", ")
        );
        return ExitCode::from(2);
    }
    if !cuda_available() {
        eprintln!("nvtx_witness: no CUDA device (driver, NVRTC and a GPU are needed)");
        return ExitCode::from(1);
    }
    match run(scenario) {
        Ok(()) => ExitCode::SUCCESS,
        Err(e) => {
            eprintln!("nvtx_witness: {e}");
            ExitCode::from(1)
        }
    }
}
