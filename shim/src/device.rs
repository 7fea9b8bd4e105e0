//! The batch checks over CUDA device buffers (`kvsan_check_*_device`,
//! feature `cuda`): the buffers an engine hands its attention or store
//! kernel, where they lie on the GPU, checked by kvsan-kernels' check
//! kernels against a device copy of the pool's kernel shadow.
//!
//! ```text
//!  call ──▶ wait for the device (the engine's writes to its buffers land)
//!       ──▶ upload the pool's kernel shadow (a snapshot, whole)
//!       ──▶ check kernel over the engine's buffers ──▶ one record per row
//!            │ no row refused                        │ a row refused
//!            ▼                                       ▼
//!       every row Continue (stores: the bits       copy the buffers to the host and
//!       they set come back to the host shadow)     run the host check on the copies:
//!                                                  its verdicts and reports
//! ```
//!
//! The clean path copies nothing but the shadow and one record per row; a
//! refused row is reported by the host check on the same values (so the
//! report, the sharer table's decision for a shared page, and a buffer no
//! kernel could use are exactly the host's). One device state per device
//! ordinal, kept for the process: the compiled kernels and one device
//! shadow per pool.

use std::collections::HashMap;
use std::ops::Range;
use std::sync::{Mutex, PoisonError};

use crate::error::ShimError;
use kvsan_kernels::cuda::{CudaError, CudaKernelShadow, CudaKernels, views};
use kvsan_sanitizer::layouts::{Addresses, Batch};
use kvsan_sanitizer::{Owner, PageId, PageRef, PoolId, RequestId, Sanitizer, Verdict};

/// One device's compiled kernels and its pools' device shadows.
struct Device {
    kernels: CudaKernels,
    shadows: HashMap<u32, CudaKernelShadow>,
}

static DEVICES: Mutex<Option<HashMap<usize, Device>>> = Mutex::new(None);

fn device_error(call: &'static str) -> impl Fn(CudaError) -> ShimError {
    move |error| ShimError::Device {
        call,
        reason: error.to_string(),
    }
}

/// Runs the check of `batch` (its addresses already checked non-null and
/// aligned) on device `ordinal` for `owners`, as the module doc says.
///
/// # Safety
/// Every address in `batch` is a live allocation of device `ordinal`'s
/// primary context holding the values its length says, unchanged by
/// anyone until this returns.
#[allow(clippy::too_many_arguments)]
pub(crate) unsafe fn check(
    call: &'static str,
    san: &Sanitizer,
    pool: u32,
    ordinal: usize,
    owners: &[Owner],
    batch: &Batch<Addresses>,
    layers: Range<u32>,
    step: u64,
) -> Result<Vec<Verdict>, ShimError> {
    let err = device_error(call);
    let host = san
        .kernel_shadow(PoolId(pool))
        .map_err(|source| ShimError::Sanitizer { call, source })?;
    let mut devices = DEVICES.lock().unwrap_or_else(PoisonError::into_inner);
    let devices = devices.get_or_insert_with(HashMap::new);
    let device = match devices.entry(ordinal) {
        std::collections::hash_map::Entry::Occupied(e) => e.into_mut(),
        std::collections::hash_map::Entry::Vacant(e) => e.insert(Device {
            kernels: CudaKernels::new(ordinal).map_err(&err)?,
            shadows: HashMap::new(),
        }),
    };
    let kernels = &device.kernels;
    for (argument, array, size) in batch.device_arrays() {
        if array.len > 0 {
            let bytes = (array.len as u64).saturating_mul(size as u64);
            kernels
                .check_device_buffer(argument, array.address, bytes)
                .map_err(&err)?;
        }
    }
    kernels.synchronize_device().map_err(&err)?;
    // A store check brings written bits back: to every page at the
    // generation the upload below copies. Reads need no such list.
    let stores = batch.layout().stores();
    let uploaded: Vec<PageRef> = (0..if stores { host.pages() } else { 0 })
        .filter_map(|p| {
            let page = PageId(u32::try_from(p).ok()?);
            let (word, _) = host.record_words(page)?;
            Some(PageRef::new(page.0, word as u32))
        })
        .collect();
    let shadow = match device.shadows.entry(pool) {
        std::collections::hash_map::Entry::Occupied(e) => {
            let shadow = e.into_mut();
            shadow.upload_all(&host).map_err(&err)?;
            shadow
        }
        std::collections::hash_map::Entry::Vacant(e) => {
            e.insert(kernels.upload_shadow(&host).map_err(&err)?)
        }
    };
    let requests: Vec<RequestId> = owners.iter().map(|o| o.request).collect();
    // SAFETY: the caller's contract on the addresses and lengths.
    let borrowed = unsafe { kernels.borrow_batch(batch) };
    let refused = !kernels
        .check_engine_batch(shadow, &requests, &views(&borrowed), layers.clone(), stores)
        .map_err(&err)?
        .is_empty();
    if !refused {
        if stores {
            // The slots the check let through were marked written on the
            // device; bring every page's bits back, to the generation each
            // page had when the shadow was uploaded (a page reallocated
            // since gets none).
            shadow
                .download_written(&host, &uploaded, step)
                .map_err(&err)?;
        }
        return Ok(vec![Verdict::Continue; owners.len()]);
    }
    // A row refused: the host check reports it, on copies of the values
    // the kernel checked.
    let copies = kernels.copy_batch_to_host(&borrowed).map_err(&err)?;
    san.check_batch(PoolId(pool), owners, &copies.as_host(), layers, step)
        .map_err(|source| ShimError::Sanitizer { call, source })
}
