//! The in-kernel check against the kernel shadow, on its own: CPU paged
//! attention of a decode batch, and of a prefill chunk (tiles of queries
//! over the pages), unchecked and checked (every page touched: owner,
//! generation, the layer's written slots), timed alternately in one run, at
//! 8k and 32k tokens of context.
//!
//! ```text
//! cargo bench --bench kernel_check
//! ```
//!
//! Shape: SmolLM2-135M's attention (9 query heads over 3 KV heads of 64,
//! 16-slot pages), one layer; decode: 8 sequences; prefill: one sequence,
//! its last 64 tokens computed. Prints, per shape, the median
//! time of one call of each and the checked ÷ unchecked ratio per round
//! (min / median / max). The target is a median ratio ≤ 1.02.

#![allow(
    unused_imports,
    reason = "the shared module's unit tests are compiled out of a bench"
)]

#[path = "../src/commands/bench/kernel.rs"]
#[allow(
    dead_code,
    reason = "shared with `kvsan bench overhead`, which uses the rest"
)]
mod kernel;

fn main() {
    // Criterion's harness passes `--bench`; nothing here takes arguments.
    let quick = std::env::args().any(|a| a == "--quick");
    let (rounds, calls) = if quick { (3, 2) } else { (15, 6) };
    println!(
        "{:>8} {:>6} {:>4} {:>14} {:>14}   checked/unchecked min / median / max",
        "context", "seqs", "new", "unchecked µs", "checked µs"
    );
    for (seqs, new) in [(8, 1), (1, 64)] {
        for seq_len in [8 * 1024, 32 * 1024] {
            let k = kernel::measure_shape(seqs, seq_len, new, rounds, calls);
            println!(
                "{seq_len:>8} {seqs:>6} {new:>4} {:>14.0} {:>14.0}   {:.3} / {:.3} / {:.3}",
                k.unchecked_us, k.checked_us, k.ratio.min, k.ratio.median, k.ratio.max
            );
        }
    }
}
