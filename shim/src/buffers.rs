//! How the batch checks' C functions hold an engine's buffers
//! (`kvsan_check_*` and `kvsan_check_*_device`, generated from
//! `kvsan_sanitizer::for_each_batch_layout!`): host pointers or device
//! addresses (`kvsan_sanitizer::layouts::Addresses`), each with its length
//! in values; checked by `calls`, used by `device` (feature `cuda`).

use kvsan_sanitizer::layouts::Buffers;

/// A host buffer as a C function got it: `ptr[0..len]`.
#[derive(Clone, Copy, Debug)]
pub(crate) struct CArray<T> {
    pub ptr: *const T,
    pub len: usize,
}

/// A host batch check's buffers (`kvsan_check_*`).
#[derive(Debug)]
pub(crate) struct CPointers;

impl Buffers for CPointers {
    type I32 = CArray<i32>;
    type I64 = CArray<i64>;
}

/// The CUDA device ordinal `device` (a C `int32_t`), refused if negative.
pub(crate) fn device_ordinal(
    call: &'static str,
    device: i32,
) -> Result<usize, crate::error::ShimError> {
    usize::try_from(device).map_err(|_| crate::error::ShimError::InvalidArgument {
        call,
        argument: "device",
        value: device as u64,
        allowed: "a CUDA device ordinal, 0 or more",
    })
}
