//! The boundary: no panic crosses it, and no refused call goes unsaid.
//!
//! Every export runs its body inside [`guarded`], which turns a panic into
//! [`ShimError::Panic`]. A refused call is [`record`]ed: the first
//! [`PRINTED_ERRORS`] are printed to stderr, all are counted, and the
//! calling thread's last error is kept for `kvsan_last_error`.

use std::any::Any;
use std::cell::RefCell;
use std::panic::{AssertUnwindSafe, catch_unwind};
use std::sync::atomic::{AtomicU64, Ordering};

use kvsan_sanitizer::abi::AbiStatus;

use crate::attach::say;
use crate::error::ShimError;

/// Refused calls printed in full before they are only counted.
pub(crate) const PRINTED_ERRORS: u64 = 16;

static ERRORS: AtomicU64 = AtomicU64::new(0);

thread_local! {
    static LAST_ERROR: RefCell<String> = const { RefCell::new(String::new()) };
}

/// Runs `body`, turning a panic into [`ShimError::Panic`].
///
/// The sanitizer's shared state is atomics and non-poisoning locks, so a
/// caught panic leaves it usable; the panic itself is a library bug and the
/// error says so.
pub(crate) fn guarded<T>(
    call: &'static str,
    body: impl FnOnce() -> Result<T, ShimError>,
) -> Result<T, ShimError> {
    catch_unwind(AssertUnwindSafe(body)).unwrap_or_else(|payload| {
        Err(ShimError::Panic {
            call,
            message: panic_text(payload.as_ref()),
        })
    })
}

fn panic_text(payload: &(dyn Any + Send)) -> String {
    if let Some(s) = payload.downcast_ref::<&str>() {
        (*s).to_string()
    } else if let Some(s) = payload.downcast_ref::<String>() {
        s.clone()
    } else {
        "a non-text panic payload".to_string()
    }
}

/// Says and keeps a refused call; returns its status code.
#[cold]
#[inline(never)]
pub(crate) fn record(error: &ShimError) -> AbiStatus {
    let status = error.status();
    let n = ERRORS.fetch_add(1, Ordering::Relaxed);
    if n < PRINTED_ERRORS {
        say(format_args!(
            "kvsan: call refused (status {status}): {error}"
        ));
    } else if n == PRINTED_ERRORS {
        say(format_args!(
            "kvsan: further refused calls are only counted"
        ));
    }
    let text = error.to_string();
    LAST_ERROR.with(|last| *last.borrow_mut() = text);
    status
}

/// Refused calls since load, all threads.
pub(crate) fn refused_calls() -> u64 {
    ERRORS.load(Ordering::Relaxed)
}

/// Calls `f` with the calling thread's last error message ("" if none).
pub(crate) fn with_last_error<R>(f: impl FnOnce(&str) -> R) -> R {
    LAST_ERROR.with(|last| f(&last.borrow()))
}
