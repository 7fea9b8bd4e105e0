//! The in-kernel check against the kernel shadow, on its own: CPU paged
//! attention of a decode batch, unchecked and checked (every page touched:
//! owner, generation, the layer's written slots), timed alternately in one
//! run, at 8k and 32k tokens of context.
//!
//! ```text
//! cargo bench --bench kernel_check
//! ```
//!
//! Shape: SmolLM2-135M's attention (9 query heads over 3 KV heads of 64,
//! 16-slot pages), one layer, 8 sequences. Prints, per context, the median
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
        "{:>8} {:>6} {:>14} {:>14}   checked/unchecked min / median / max",
        "context", "seqs", "unchecked µs", "checked µs"
    );
    for seq_len in [8 * 1024, 32 * 1024] {
        let k = kernel::measure_shape(8, seq_len, rounds, calls);
        println!(
            "{seq_len:>8} {:>6} {:>14.0} {:>14.0}   {:.3} / {:.3} / {:.3}",
            8, k.unchecked_us, k.checked_us, k.ratio.min, k.ratio.median, k.ratio.max
        );
    }
}
