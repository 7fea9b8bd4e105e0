//! Attaching: the load-time constructor, the options, the sanitizer started
//! at first use, and the exit summary.
//!
//! ```text
//!  load (.init_array)    read KVSAN_OPTIONS once ──ok──▶ "kvsan: attached (pid …, options …)"
//!                                              └─bad─▶ "kvsan: NOT attached …" (refused for good)
//!  first call (pool_register in practice)  ──▶ self_test::start: the self-test if asked, reports sink, log file
//!                                              └─fails─▶ "kvsan: NOT attached …" (refused for good)
//!  exit (.fini_array)    only if a sanitizer was started ──▶ the requests it still tracks,
//!                                                               then the summary line
//! ```
//!
//! Every process that loads the library prints the banner (a staging run
//! can see which of its processes carry the preload). A process that never
//! calls the library — a shell or interpreter that inherited `LD_PRELOAD` —
//! is otherwise left alone: no sanitizer, no log file, no summary.
//!
//! The constructor calls no interposed function and does not allocate for
//! the banner (it is formatted on the stack and written with `write(2)`).
//! It allocates only to parse the options with the sanitizer's own parser,
//! so that a bad option is reported at load; this library interposes no
//! allocator or libc function, so that allocation cannot re-enter it, and
//! libc is initialised before any preloaded constructor runs.

use std::ffi::CStr;
use std::fmt::{self, Write as _};
use std::sync::OnceLock;

use kvsan_sanitizer::options::OPTIONS_ENV;
use kvsan_sanitizer::{OnViolation, Options, Sanitizer};

use crate::error::ShimError;

/// The options variable, NUL-terminated for `getenv`.
const OPTIONS_ENV_C: &CStr = c"KVSAN_OPTIONS";
const _: () = assert!(OPTIONS_ENV_C.count_bytes() == OPTIONS_ENV.len());

/// What loading decided, once per process.
#[derive(Debug)]
pub(crate) enum Attach {
    /// The options parsed; the sanitizer starts at the first call.
    Attached(Options),
    /// Refused at load; the message said why.
    Refused(String),
}

static ATTACH: OnceLock<Attach> = OnceLock::new();
static SANITIZER: OnceLock<Result<Sanitizer, String>> = OnceLock::new();

/// The load decision (made by the constructor; made here if a call comes
/// first, which only a library loaded without running constructors does).
pub(crate) fn attach() -> &'static Attach {
    ATTACH.get_or_init(attach_now)
}

/// The process's sanitizer, started at the first call that needs it.
///
/// # Errors
/// [`ShimError::NotAttached`] when the options were refused at load or the
/// sanitizer could not start (its log file cannot be opened).
pub(crate) fn sanitizer() -> Result<&'static Sanitizer, ShimError> {
    let options = match attach() {
        Attach::Attached(options) => options,
        Attach::Refused(reason) => {
            return Err(ShimError::NotAttached {
                reason: reason.clone(),
            });
        }
    };
    match SANITIZER.get_or_init(|| start(options)) {
        Ok(sanitizer) => Ok(sanitizer),
        Err(reason) => Err(ShimError::NotAttached {
            reason: reason.clone(),
        }),
    }
}

fn start(options: &Options) -> Result<Sanitizer, String> {
    kvsan_sanitizer::self_test::start(options.clone()).map_err(|e| {
        say(format_args!(
            "kvsan: NOT attached (pid {}): {e}; this process runs UNSANITIZED",
            std::process::id()
        ));
        e.to_string()
    })
}

fn attach_now() -> Attach {
    // SAFETY: `getenv` with a NUL-terminated name; the value is copied
    // (parsed) before this function returns, before the process can change
    // its environment from another thread (constructors run single-threaded).
    let raw = unsafe { libc::getenv(OPTIONS_ENV_C.as_ptr()) };
    let text: &[u8] = if raw.is_null() {
        b""
    } else {
        // SAFETY: a non-null `getenv` result is a NUL-terminated string.
        unsafe { CStr::from_ptr(raw) }.to_bytes()
    };
    let pid = std::process::id();
    let parsed = match std::str::from_utf8(text) {
        Ok(text) => Options::parse(text).map_err(|e| e.to_string()),
        Err(_) => Err(format!("{OPTIONS_ENV} is not UTF-8")),
    };
    match parsed {
        Ok(options) => {
            let shown = std::str::from_utf8(text).unwrap_or("");
            if shown.trim().is_empty() {
                say(format_args!(
                    "kvsan: attached (pid {pid}, options: defaults)"
                ));
            } else {
                say(format_args!("kvsan: attached (pid {pid}, options {shown})"));
            }
            Attach::Attached(options)
        }
        Err(reason) => {
            say(format_args!(
                "kvsan: NOT attached (pid {pid}): {reason}; this process runs UNSANITIZED"
            ));
            Attach::Refused(reason)
        }
    }
}

/// The constructor: decide at load, print the banner. Never unwinds.
extern "C" fn on_load() {
    let _ = std::panic::catch_unwind(attach);
}

/// The destructor, for a process that started a sanitizer: the requests it
/// still tracks (live, and ended ones remembered: what its memory for
/// requests holds after a long run), then the summary line. Never unwinds.
extern "C" fn on_exit() {
    let _ = std::panic::catch_unwind(|| {
        if let Some(Ok(sanitizer)) = SANITIZER.get() {
            // `halt` already wrote the summary to the report sink on its
            // way out; do not repeat it.
            let halted = sanitizer.options().on_violation == OnViolation::Halt
                && sanitizer.violation_count() > 0;
            if !halted {
                let (live, remembered) = sanitizer.tracked_requests();
                say(format_args!(
                    "kvsan: requests tracked at exit: {live} live, {remembered} ended and remembered (ended_requests={})",
                    sanitizer.options().ended_requests
                ));
                say(format_args!("{}", sanitizer.summary()));
            }
        }
    });
}

#[used]
#[unsafe(link_section = ".init_array")]
static ON_LOAD: extern "C" fn() = on_load;

#[used]
#[unsafe(link_section = ".fini_array")]
static ON_EXIT: extern "C" fn() = on_exit;

/// One line on stderr, formatted on the stack (truncated past 1 KiB) and
/// written with `write(2)`: no allocation, no lock, nothing that fails when
/// stderr is closed at exit.
pub(crate) fn say(args: fmt::Arguments<'_>) {
    let mut line = StackLine {
        buf: [0; 1024],
        len: 0,
    };
    let _ = line.write_fmt(args);
    let _ = line.write_str("\n");
    if line.len == line.buf.len() {
        line.buf[line.len - 1] = b'\n';
    }
    let mut rest = &line.buf[..line.len];
    while !rest.is_empty() {
        // SAFETY: `rest` is readable for its length; fd 2 may be closed, in
        // which case write returns -1 and the line is dropped.
        let n = unsafe { libc::write(2, rest.as_ptr().cast(), rest.len()) };
        if n <= 0 {
            if n < 0 && std::io::Error::last_os_error().kind() == std::io::ErrorKind::Interrupted {
                continue;
            }
            return;
        }
        rest = &rest[n.unsigned_abs()..];
    }
}

struct StackLine {
    buf: [u8; 1024],
    len: usize,
}

impl fmt::Write for StackLine {
    fn write_str(&mut self, s: &str) -> fmt::Result {
        let room = self.buf.len() - self.len;
        let n = s.len().min(room);
        self.buf[self.len..self.len + n].copy_from_slice(&s.as_bytes()[..n]);
        self.len += n;
        Ok(())
    }
}
