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

use kvsan_kernels::cuda::{CudaError, CudaKernelShadow, CudaKernels, EngineBatch};
use kvsan_sanitizer::{Owner, PageId, PageRef, PoolId, RequestId, Sanitizer, Verdict};

use crate::buffers::DeviceBuffers;
use crate::error::ShimError;

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

/// Runs the check of `buffers` (already checked non-null and aligned) on
/// device `ordinal` for `owners`, as the module doc says.
///
/// # Safety
/// Every address in `buffers` is a live allocation of device `ordinal`'s
/// primary context holding the values its length says, unchanged by
/// anyone until this returns.
#[allow(clippy::too_many_arguments)]
pub(crate) unsafe fn check(
    call: &'static str,
    san: &Sanitizer,
    pool: u32,
    ordinal: usize,
    owners: &[Owner],
    buffers: DeviceBuffers,
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
    for (argument, address, len, size) in buffers.arrays(owners.len()) {
        if len > 0 {
            kernels
                .check_device_buffer(argument, address, (len as u64).saturating_mul(size as u64))
                .map_err(&err)?;
        }
    }
    kernels.synchronize_device().map_err(&err)?;
    // A store check brings written bits back: to every page at the
    // generation the upload below copies. Reads need no such list.
    let stores = matches!(buffers, DeviceBuffers::SlotMapping { .. });
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
    // Whether the check kernel refused a row of `batch`.
    let refused = |shadow: &mut CudaKernelShadow, batch: &EngineBatch<'_>| {
        kernels
            .check_engine_batch(shadow, &requests, batch, layers.clone())
            .map(|found| !found.is_empty())
            .map_err(&err)
    };
    let host_check = match buffers {
        DeviceBuffers::BlockTable {
            block_table,
            table_len,
            stride,
            seq_lens,
        } => {
            // SAFETY: the caller's contract on the address and length.
            let table = unsafe { kernels.borrow_device::<i32>(block_table, table_len) };
            // SAFETY: the caller's contract on the address and length.
            let lens = unsafe { kernels.borrow_device::<i32>(seq_lens, owners.len()) };
            let batch = EngineBatch::BlockTable {
                block_table: table.as_view(),
                row_stride: stride,
                seq_lens: lens.as_view(),
            };
            if !refused(&mut *shadow, &batch)? {
                None
            } else {
                let (table, lens) = (
                    kernels.copy_to_host(&table).map_err(&err)?,
                    kernels.copy_to_host(&lens).map_err(&err)?,
                );
                Some(san.check_block_table(
                    PoolId(pool),
                    owners,
                    &table,
                    stride,
                    &lens,
                    layers,
                    step,
                ))
            }
        }
        DeviceBuffers::PagedCsr {
            indptr,
            indices,
            nnz,
            last_page_len,
        } => {
            let rows = owners.len();
            // SAFETY: the caller's contract on the address and length.
            let indptr = unsafe { kernels.borrow_device::<i32>(indptr, rows + 1) };
            // SAFETY: the caller's contract on the address and length.
            let indices = unsafe { kernels.borrow_device::<i32>(indices, nnz) };
            // SAFETY: the caller's contract on the address and length.
            let last = unsafe { kernels.borrow_device::<i32>(last_page_len, rows) };
            let batch = EngineBatch::PagedCsr {
                indptr: indptr.as_view(),
                indices: indices.as_view(),
                last_page_len: last.as_view(),
            };
            if !refused(&mut *shadow, &batch)? {
                None
            } else {
                let (indptr, indices, last) = (
                    kernels.copy_to_host(&indptr).map_err(&err)?,
                    kernels.copy_to_host(&indices).map_err(&err)?,
                    kernels.copy_to_host(&last).map_err(&err)?,
                );
                Some(san.check_paged_csr(
                    PoolId(pool),
                    owners,
                    &indptr,
                    &indices,
                    &last,
                    layers,
                    step,
                ))
            }
        }
        DeviceBuffers::ReqToToken {
            req_to_token,
            table_len,
            stride,
            req_indices,
            seq_lens,
        } => {
            let rows = owners.len();
            // SAFETY: the caller's contract on the address and length.
            let table = unsafe { kernels.borrow_device::<i32>(req_to_token, table_len) };
            // SAFETY: the caller's contract on the address and length.
            let reqs = unsafe { kernels.borrow_device::<i32>(req_indices, rows) };
            // SAFETY: the caller's contract on the address and length.
            let lens = unsafe { kernels.borrow_device::<i32>(seq_lens, rows) };
            let batch = EngineBatch::ReqToToken {
                req_to_token: table.as_view(),
                row_stride: stride,
                req_indices: reqs.as_view(),
                seq_lens: lens.as_view(),
            };
            if !refused(&mut *shadow, &batch)? {
                None
            } else {
                let (table, reqs, lens) = (
                    kernels.copy_to_host(&table).map_err(&err)?,
                    kernels.copy_to_host(&reqs).map_err(&err)?,
                    kernels.copy_to_host(&lens).map_err(&err)?,
                );
                Some(san.check_req_to_token(
                    PoolId(pool),
                    owners,
                    &table,
                    stride,
                    &reqs,
                    &lens,
                    layers,
                    step,
                ))
            }
        }
        DeviceBuffers::SlotMapping {
            query_start_loc,
            slot_mapping,
            tokens,
        } => {
            let rows = owners.len();
            // SAFETY: the caller's contract on the address and length.
            let starts = unsafe { kernels.borrow_device::<i32>(query_start_loc, rows + 1) };
            // SAFETY: the caller's contract on the address and length.
            let slots = unsafe { kernels.borrow_device::<i64>(slot_mapping, tokens) };
            let batch = EngineBatch::SlotMapping {
                query_start_loc: starts.as_view(),
                slot_mapping: slots.as_view(),
                record: true,
            };
            if !refused(&mut *shadow, &batch)? {
                // The slots the check let through were marked written on
                // the device; bring every page's bits back, to the
                // generation each page had when the shadow was uploaded
                // (a page reallocated since gets none).
                shadow
                    .download_written(&host, &uploaded, step)
                    .map_err(&err)?;
                None
            } else {
                let (starts, slots) = (
                    kernels.copy_to_host(&starts).map_err(&err)?,
                    kernels.copy_to_host(&slots).map_err(&err)?,
                );
                Some(san.check_slot_mapping(PoolId(pool), owners, &starts, &slots, layers, step))
            }
        }
    };
    match host_check {
        None => Ok(vec![Verdict::Continue; owners.len()]),
        Some(verdicts) => verdicts.map_err(|source| ShimError::Sanitizer { call, source }),
    }
}
