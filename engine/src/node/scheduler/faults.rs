//! The scheduler's fail point: preemption. The seam runs the release it is
//! given as it is unless its fault is injected; without the `faults`
//! feature it compiles away.

use crate::faults::{Fault, active};
use crate::node::sequence::Sequence;

/// Lets go of a preempted `seq`'s pages with `release`.
///
/// Fault `stale-block-table`: the pages are freed from a copy of the block
/// table and the sequence keeps its own. On resume `ensure_pages` finds the
/// table long enough and allocates nothing, so the recompute writes and
/// reads pages the free list has since handed to another request.
pub(super) fn stale_block_table(seq: &mut Sequence, release: impl FnOnce(&mut Sequence)) {
    let kept = active(Fault::StaleBlockTable).then(|| seq.table.clone());
    release(seq);
    if let Some(table) = kept {
        seq.table = table;
    }
}
