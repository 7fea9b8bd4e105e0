//! The atomics every lock-free transition uses, through one door so that
//! `--cfg loom` swaps in the model checker's versions.

#[cfg(loom)]
pub use loom::sync::atomic::{AtomicU32, AtomicU64, Ordering, fence};
#[cfg(not(loom))]
pub use std::sync::atomic::{AtomicU32, AtomicU64, Ordering, fence};
