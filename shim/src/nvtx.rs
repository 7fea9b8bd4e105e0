//! NVTX registration of an engine's own pool (`kvsan_nvtx_*`, feature
//! `nvtx`): the pool's pages described to NVIDIA's compute-sanitizer, and
//! kept in step by the alloc and free hooks, so that memcheck reports a
//! kernel access to a freed page and initcheck a read of a reused page
//! before its new owner wrote it (see kvsan-kernels' `cuda::NvtxPool`).
//!
//! ```text
//!  kvsan_nvtx_describe_pool ──▶ one NvtxPool per pool (heaps: the allocations
//!                               holding the planes; regions: the held pages)
//!  alloc / free (both faces) ──▶ touched(pool, page) ──▶ NvtxPool::sync
//!  kvsan_nvtx_bind / unbind ──▶ permissions bound to this thread's CUDA work
//! ```
//!
//! Without the feature every call is refused with `KVSAN_ERR_DEVICE`, and
//! the hooks pay nothing.

use kvsan_sanitizer::abi::KvsanNvtxPlane;

use crate::error::ShimError;

#[cfg(not(feature = "nvtx"))]
fn not_built(call: &'static str) -> ShimError {
    ShimError::Nvtx {
        call,
        reason: "this library was built without the `nvtx` feature".into(),
        invalid: false,
    }
}

#[cfg(feature = "nvtx")]
mod registry {
    use std::collections::HashMap;
    use std::sync::atomic::{AtomicBool, Ordering};
    use std::sync::{Mutex, PoisonError};

    use kvsan_kernels::cuda::{CudaError, NvtxPlane, NvtxPool, allocation_containing};
    use kvsan_sanitizer::abi::KvsanNvtxPlane;
    use kvsan_sanitizer::{PageId, PoolId, RequestId, Sanitizer};

    use crate::error::ShimError;

    /// The described pools, by pool id.
    static POOLS: Mutex<Option<HashMap<u32, NvtxPool>>> = Mutex::new(None);
    /// Whether any pool is described: the hooks' one check when none is.
    static ANY: AtomicBool = AtomicBool::new(false);

    fn nvtx_error(call: &'static str, error: &CudaError) -> ShimError {
        let invalid = matches!(
            error,
            CudaError::NvtxPlane { .. }
                | CudaError::NvtxPlanesOverlap { .. }
                | CudaError::NotDeviceMemory { .. }
                | CudaError::WrongDevice { .. }
                | CudaError::Length { .. }
                | CudaError::ZeroDimension { .. }
        );
        ShimError::Nvtx {
            call,
            reason: error.to_string(),
            invalid,
        }
    }

    fn with_pools<R>(f: impl FnOnce(&mut HashMap<u32, NvtxPool>) -> R) -> R {
        let mut pools = POOLS.lock().unwrap_or_else(PoisonError::into_inner);
        f(pools.get_or_insert_with(HashMap::new))
    }

    fn not_described(call: &'static str, pool: u32) -> ShimError {
        ShimError::InvalidArgument {
            call,
            argument: "pool",
            value: u64::from(pool),
            allowed: "a pool described with kvsan_nvtx_describe_pool",
        }
    }

    pub(super) fn describe(
        call: &'static str,
        san: &Sanitizer,
        pool: u32,
        ordinal: usize,
        planes: &[KvsanNvtxPlane],
    ) -> Result<(), ShimError> {
        let shadow = san
            .kernel_shadow(PoolId(pool))
            .map_err(|source| ShimError::Sanitizer { call, source })?;
        if with_pools(|p| p.contains_key(&pool)) {
            return Err(ShimError::Nvtx {
                call,
                reason: format!(
                    "pool {pool} is described already (a tool takes one heap per allocation; \
                     kvsan_nvtx_forget_pool ends the description)"
                ),
                invalid: true,
            });
        }
        let planes: Vec<NvtxPlane> = planes
            .iter()
            .map(|p| NvtxPlane {
                base: p.base,
                page_stride: p.page_stride,
                page_bytes: p.page_bytes,
            })
            .collect();
        let mut allocations = Vec::with_capacity(planes.len());
        for plane in &planes {
            allocations.push(
                allocation_containing(ordinal, plane.base).map_err(|e| nvtx_error(call, &e))?,
            );
        }
        let mut nvtx = NvtxPool::with_heaps(
            &format!("pool {pool}"),
            &planes,
            shadow.pages(),
            &allocations,
        )
        .map_err(|e| nvtx_error(call, &e))?;
        let all: Vec<PageId> = (0..shadow.pages())
            .filter_map(|p| u32::try_from(p).ok().map(PageId))
            .collect();
        nvtx.sync(&shadow, &all).map_err(|e| nvtx_error(call, &e))?;
        with_pools(|p| p.insert(pool, nvtx));
        ANY.store(true, Ordering::Release);
        Ok(())
    }

    pub(super) fn forget(call: &'static str, pool: u32) -> Result<(), ShimError> {
        let gone = with_pools(|p| {
            let gone = p.remove(&pool);
            ANY.store(!p.is_empty(), Ordering::Release);
            gone
        });
        gone.map(drop).ok_or_else(|| not_described(call, pool))
    }

    pub(super) fn bind(call: &'static str, pool: u32, requests: &[u64]) -> Result<(), ShimError> {
        let requests: Vec<RequestId> = requests.iter().copied().map(RequestId).collect();
        with_pools(|p| match p.get_mut(&pool) {
            Some(nvtx) => {
                nvtx.bind(&requests);
                Ok(())
            }
            None => Err(not_described(call, pool)),
        })
    }

    pub(super) fn unbind(call: &'static str, pool: u32) -> Result<(), ShimError> {
        with_pools(|p| match p.get_mut(&pool) {
            Some(nvtx) => {
                nvtx.unbind();
                Ok(())
            }
            None => Err(not_described(call, pool)),
        })
    }

    pub(super) fn touched(san: &Sanitizer, pool: u32, page: u32) -> Result<(), CudaError> {
        if !ANY.load(Ordering::Acquire) {
            return Ok(());
        }
        with_pools(|p| {
            let Some(nvtx) = p.get_mut(&pool) else {
                return Ok(());
            };
            // The pool is registered (its alloc or free just went through).
            let Ok(shadow) = san.kernel_shadow(PoolId(pool)) else {
                return Ok(());
            };
            nvtx.sync(&shadow, &[PageId(page)]).map(|_| ())
        })
    }
}

/// `kvsan_nvtx_describe_pool` (arguments checked by the caller).
pub(crate) fn describe(
    call: &'static str,
    pool: u32,
    device: i32,
    planes: &[KvsanNvtxPlane],
) -> Result<(), ShimError> {
    let ordinal = crate::buffers::device_ordinal(call, device)?;
    if planes.is_empty() {
        return Err(ShimError::InvalidArgument {
            call,
            argument: "n_planes",
            value: 0,
            allowed: "1 or more",
        });
    }
    let san = crate::attach::sanitizer()?;
    #[cfg(feature = "nvtx")]
    {
        registry::describe(call, san, pool, ordinal, planes)
    }
    #[cfg(not(feature = "nvtx"))]
    {
        let _ = (san, pool, ordinal);
        Err(not_built(call))
    }
}

/// `kvsan_nvtx_forget_pool`.
pub(crate) fn forget(call: &'static str, pool: u32) -> Result<(), ShimError> {
    #[cfg(feature = "nvtx")]
    {
        registry::forget(call, pool)
    }
    #[cfg(not(feature = "nvtx"))]
    {
        let _ = pool;
        Err(not_built(call))
    }
}

/// `kvsan_nvtx_bind`.
pub(crate) fn bind(call: &'static str, pool: u32, requests: &[u64]) -> Result<(), ShimError> {
    #[cfg(feature = "nvtx")]
    {
        registry::bind(call, pool, requests)
    }
    #[cfg(not(feature = "nvtx"))]
    {
        let _ = (pool, requests);
        Err(not_built(call))
    }
}

/// `kvsan_nvtx_unbind`.
pub(crate) fn unbind(call: &'static str, pool: u32) -> Result<(), ShimError> {
    #[cfg(feature = "nvtx")]
    {
        registry::unbind(call, pool)
    }
    #[cfg(not(feature = "nvtx"))]
    {
        let _ = pool;
        Err(not_built(call))
    }
}

/// After an alloc or free of `page` in `pool` went through the sanitizer:
/// brings the page's region in step when the pool is described. A failure
/// (none is expected: the sanitizer took the page) is printed.
#[cfg_attr(not(feature = "nvtx"), allow(unused_variables))]
pub(crate) fn touched(san: &kvsan_sanitizer::Sanitizer, pool: u32, page: u32) {
    #[cfg(feature = "nvtx")]
    if let Err(e) = registry::touched(san, pool, page) {
        crate::attach::say(format_args!(
            "kvsan: NVTX regions of pool {pool} page {page} not brought in step: {e}"
        ));
    }
}
