//! Checked against unchecked on the GPU: the paged-attention decode kernel
//! with the bounds check only (a release build), the generation check, and
//! the device kernel shadow (kvsan's full read check); and the check kernel
//! over an engine's own block table, against the same check on the host.
//! One JSON object on stdout (what `scripts/gpu-check` records).
//!
//! ```text
//! gpu_bench [--contexts 1024,8192,32768] [--rows 16] [--iters 20]
//! ```
//!
//! Geometry: 16-token pages, 8 KV heads of 128 values (a Llama-3-8B layer),
//! 32 query heads, one layer; every row reads `context` tokens through its
//! own pages. Device times are CUDA events around the kernel alone
//! ([`CudaKernels::set_kernel_timing`]), medians over `iters` launches after
//! 3 warm-ups; "call" times are the whole safe call (copies of the batch
//! arrays in and the output back included). Ratios are to the bounds-only
//! kernel of the same run.

use std::process::ExitCode;
use std::time::Instant;

use kvsan_kernels::RowLedger;
use kvsan_kernels::attention::{KvBatch, KvGeometry, StoreSlot};
use kvsan_kernels::cuda::{CudaKernels, EngineBatch, ReadCheck, cuda_available};
use kvsan_sanitizer::{
    Generation, NodeRole, Options, Owner, PageId, PageRef, PoolGeometry, RequestId, Sanitizer,
};

const GEOMETRY: KvGeometry = KvGeometry {
    page_slots: 16,
    n_layers: 1,
    n_kv_heads: 8,
    head_dim: 128,
};
const HEADS: usize = 32;

struct Args {
    contexts: Vec<usize>,
    rows: usize,
    iters: usize,
}

fn parse() -> Result<Args, String> {
    let mut args = Args {
        contexts: vec![1024, 8192, 32768],
        rows: 16,
        iters: 20,
    };
    let mut it = std::env::args().skip(1);
    while let Some(flag) = it.next() {
        let mut value = || it.next().ok_or(format!("{flag} needs a value"));
        let number = |v: &str| {
            v.parse::<usize>()
                .ok()
                .filter(|&n| n > 0)
                .ok_or(format!("{flag}: {v:?} is not a positive number"))
        };
        match flag.as_str() {
            "--contexts" => {
                args.contexts = value()?.split(',').map(number).collect::<Result<_, _>>()?
            }
            "--rows" => args.rows = number(&value()?)?,
            "--iters" => args.iters = number(&value()?)?,
            other => return Err(format!("unknown argument {other:?}")),
        }
    }
    Ok(args)
}

fn median(mut xs: Vec<f64>) -> f64 {
    xs.sort_by(f64::total_cmp);
    xs[xs.len() / 2]
}

/// Median device and call milliseconds of `iters` runs of `f` (3 warm-ups).
fn time(
    kernels: &CudaKernels,
    iters: usize,
    mut f: impl FnMut() -> Result<(), String>,
) -> Result<(f64, f64), String> {
    for _ in 0..3 {
        f()?;
    }
    let mut device = Vec::new();
    let mut call = Vec::new();
    for _ in 0..iters {
        let t = Instant::now();
        f()?;
        call.push(t.elapsed().as_secs_f64() * 1e3);
        device.push(f64::from(
            kernels.last_kernel_ms().ok_or("no kernel time recorded")?,
        ));
    }
    Ok((median(device), median(call)))
}

fn row_json(name: &str, device: f64, call: f64, base: f64) -> String {
    format!(
        "{{\"check\": \"{name}\", \"kernel_ms\": {device:.4}, \"call_ms\": {call:.4}, \"kernel_ratio\": {:.4}}}",
        device / base
    )
}

fn one_context(
    kernels: &CudaKernels,
    context: usize,
    rows: usize,
    iters: usize,
) -> Result<String, String> {
    let per_row = context.div_ceil(GEOMETRY.page_slots);
    let n_pages = per_row * rows;
    let mut options = Options::default();
    options.quarantine_pages = 0;
    let san = Sanitizer::with_writer(options, std::io::sink());
    let pool_id = san
        .pool_register(PoolGeometry {
            pages: n_pages as u32,
            page_slots: GEOMETRY.page_slots as u32,
            layers: GEOMETRY.n_layers as u32,
            bytes_per_slot: (2 * GEOMETRY.slot_width() * 2) as u64,
            role: NodeRole::Unified,
            node: "gpu-bench".into(),
        })
        .map_err(|e| e.to_string())?;
    let mut table = Vec::with_capacity(n_pages);
    let mut generations = vec![Generation(0); n_pages];
    for row in 0..rows {
        let owner = Owner::new(row as u64 + 1, 1);
        for e in 0..per_row {
            let page = PageId((row * per_row + e) as u32);
            let (_, generation) = san
                .alloc(pool_id, page, owner, 0)
                .map_err(|e| e.to_string())?;
            let r = PageRef { page, generation };
            let _ = san
                .write(
                    pool_id,
                    owner,
                    r,
                    0..GEOMETRY.page_slots as u32,
                    0..GEOMETRY.n_layers as u32,
                    0,
                )
                .map_err(|e| e.to_string())?;
            generations[page.0 as usize] = generation;
            table.push(r);
        }
    }
    let mut pool = kernels
        .alloc_pool(GEOMETRY, n_pages)
        .map_err(|e| e.to_string())?;
    pool.upload_generations(&generations)
        .map_err(|e| e.to_string())?;
    let host_shadow = san.kernel_shadow(pool_id).map_err(|e| e.to_string())?;
    let mut shadow = kernels
        .upload_shadow(&host_shadow)
        .map_err(|e| e.to_string())?;
    let owners: Vec<RequestId> = (1..=rows as u64).map(RequestId).collect();
    let seq_lens = vec![context as u32; rows];
    let mut query_start = vec![0u32];
    query_start.extend(1..=rows as u32);
    let store_slots = vec![StoreSlot::PADDING; rows];
    let batch = KvBatch {
        block_tables: &table,
        width: per_row,
        seq_lens: &seq_lens,
        query_start: &query_start,
        store_slots: &store_slots,
    };
    let q = vec![0.01f32; rows * HEADS * GEOMETRY.head_dim];
    let decode = |check: ReadCheck<'_>| -> Result<(), String> {
        let out = kernels
            .attend_decode(
                &pool,
                0,
                HEADS,
                0.088,
                &batch,
                &q,
                check,
                &RowLedger::new(rows),
            )
            .map_err(|e| e.to_string())?;
        if out.refusals.is_empty() {
            Ok(())
        } else {
            Err(format!("a legal decode was refused: {:?}", out.refusals[0]))
        }
    };
    let (bounds, bounds_call) = time(kernels, iters, || decode(ReadCheck::Bounds))?;
    let (gens, gens_call) = time(kernels, iters, || decode(ReadCheck::Generations))?;
    let (full, full_call) = time(kernels, iters, || {
        decode(ReadCheck::Shadow {
            shadow: &shadow,
            owners: &owners,
        })
    })?;

    // The engine's own block table (int32 page indices) on the device,
    // checked by the check kernel, and the same check on the host.
    let flat: Vec<i32> = table.iter().map(|r| r.page.0 as i32).collect();
    let lens: Vec<i32> = vec![context as i32; rows];
    let ctx = cudarc::driver::CudaContext::new(kernels.ordinal()).map_err(|e| e.to_string())?;
    let stream = ctx.default_stream();
    let d_table = stream.clone_htod(&flat).map_err(|e| e.to_string())?;
    let d_lens = stream.clone_htod(&lens).map_err(|e| e.to_string())?;
    let engine = EngineBatch::BlockTable {
        block_table: d_table.as_view(),
        stride: per_row,
        seq_lens: d_lens.as_view(),
    };
    let (check, check_call) = time(kernels, iters, || {
        let found = kernels
            .check_engine_batch(&mut shadow, &owners, &engine, 0..1, false)
            .map_err(|e| e.to_string())?;
        if found.is_empty() {
            Ok(())
        } else {
            Err(format!("a legal block table was refused: {:?}", found[0]))
        }
    })?;
    let host_owners: Vec<Owner> = (1..=rows as u64).map(|r| Owner::new(r, 1)).collect();
    let mut host = Vec::new();
    for _ in 0..iters.min(5) {
        let t = Instant::now();
        let verdicts = san
            .check_block_table(pool_id, &host_owners, &flat, per_row, &lens, 0..1, 0)
            .map_err(|e| e.to_string())?;
        host.push(t.elapsed().as_secs_f64() * 1e3);
        if verdicts.iter().any(|v| !v.is_continue()) {
            return Err("the host check refused a legal block table".into());
        }
    }
    let host = median(host);
    let kv_bytes = (rows * context * 2 * GEOMETRY.slot_width() * 2) as f64;
    Ok(format!(
        "{{\"context\": {context}, \"rows\": {rows}, \"pages\": {n_pages}, \
         \"kv_gb_read\": {:.4}, \"decode_bounds_gb_per_s\": {:.1}, \"decode\": [{}, {}, {}], \
         \"block_table_check\": {{\"kernel_ms\": {check:.4}, \"call_ms\": {check_call:.4}, \
         \"host_ms\": {host:.4}, \"kernel_to_decode_bounds\": {:.4}}}}}",
        kv_bytes / 1e9,
        kv_bytes / 1e9 / (bounds / 1e3),
        row_json("bounds", bounds, bounds_call, bounds),
        row_json("generations", gens, gens_call, bounds),
        row_json("shadow", full, full_call, bounds),
        check / bounds,
    ))
}

fn main() -> ExitCode {
    let args = match parse() {
        Ok(a) => a,
        Err(e) => {
            eprintln!("gpu_bench: {e}");
            eprintln!("usage: gpu_bench [--contexts N,N,…] [--rows N] [--iters N]");
            return ExitCode::from(2);
        }
    };
    if !cuda_available() {
        eprintln!("gpu_bench: no CUDA device (driver, NVRTC and a GPU are needed)");
        return ExitCode::from(1);
    }
    let kernels = match CudaKernels::new(0) {
        Ok(k) => k,
        Err(e) => {
            eprintln!("gpu_bench: {e}");
            return ExitCode::from(1);
        }
    };
    kernels.set_kernel_timing(true);
    let mut results = Vec::new();
    for &context in &args.contexts {
        match one_context(&kernels, context, args.rows, args.iters) {
            Ok(json) => {
                eprintln!("gpu_bench: context {context} done");
                results.push(json);
            }
            Err(e) => {
                eprintln!("gpu_bench: context {context}: {e}");
                return ExitCode::from(1);
            }
        }
    }
    let (major, minor) = kernels.compute_capability();
    println!(
        "{{\"target\": \"{}\", \"compute_capability\": \"{major}.{minor}\", \"iters\": {}, \
         \"geometry\": {{\"page_slots\": {}, \"kv_heads\": {}, \"head_dim\": {}, \"query_heads\": {HEADS}}}, \
         \"contexts\": [{}]}}",
        kernels.target(),
        args.iters,
        GEOMETRY.page_slots,
        GEOMETRY.n_kv_heads,
        GEOMETRY.head_dim,
        results.join(", ")
    );
    ExitCode::SUCCESS
}
