//! The pool's fail point: its "already free" check. The seam is the
//! identity unless its fault is injected; without the `faults` feature it
//! compiles away.

use crate::faults::{Fault, active};

/// Whether a freed page counts as already free: `already_free`.
///
/// Fault `double-free`: the pool has no "already free" check, like an
/// allocator that only pushes indices back on its list; a page freed
/// twice at the same generation goes on the free list twice.
pub(super) fn double_free(already_free: bool) -> bool {
    already_free && !active(Fault::DoubleFree)
}
