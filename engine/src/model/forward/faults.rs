//! The forward pass's fail point: the long-chunk KV store path. The seam
//! is a no-op unless its fault is injected; without the `faults` feature
//! it compiles away.

use crate::faults::{Fault, active};
use crate::kv_access::StepBatch;

/// Rows of more new tokens than this take the long-chunk KV store path
/// (the path fault `skip-layer-write` breaks).
pub const LONG_CHUNK_TOKENS: usize = 64;

/// Marks in `skip` the rows of `batch` whose KV store of layer `layer` (of
/// `n_layers`) is skipped: none, `skip` is left as it is.
///
/// Fault `skip-layer-write`: the long-chunk store path's layer loop stops
/// one layer short.
pub(super) fn skip_layer_write(
    layer: usize,
    n_layers: usize,
    batch: &StepBatch,
    skip: &mut [bool],
) {
    if active(Fault::SkipLayerWrite) && layer + 1 == n_layers {
        for (r, skip) in skip.iter_mut().enumerate() {
            *skip = batch.row_tokens(r).len() > LONG_CHUNK_TOKENS;
        }
    }
}
