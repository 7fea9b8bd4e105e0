//! One workload run as a child process: its stdout, its stderr, its peak
//! resident set size and the CPU time it used, from `wait4`'s resource
//! usage of that child alone.

use std::ffi::OsString;
use std::io::Read;
use std::path::Path;
use std::process::{Command, Stdio};

use anyhow::{Context, bail};

/// What a finished child left.
#[derive(Debug)]
pub struct Finished {
    /// Everything it wrote on stdout.
    pub stdout: String,
    /// Everything it wrote on stderr.
    pub stderr: String,
    /// Its peak resident set size in bytes (`ru_maxrss`).
    pub peak_rss_bytes: u64,
    /// CPU seconds it used, user and system, all its threads (`ru_utime +
    /// ru_stime`): unlike elapsed time, not lengthened by waiting for a
    /// core another process holds.
    pub cpu_seconds: f64,
}

/// Runs `program args…` with `env` added, waits for it with `wait4` and
/// returns its output and peak RSS.
///
/// # Errors
/// The program does not start, or exits unsuccessfully (the message carries
/// the end of its stderr).
pub fn run(
    program: &Path,
    args: &[String],
    env: &[(String, OsString)],
) -> anyhow::Result<Finished> {
    let mut child = Command::new(program)
        .args(args)
        .envs(env.iter().map(|(k, v)| (k, v)))
        .stdin(Stdio::null())
        .stdout(Stdio::piped())
        .stderr(Stdio::piped())
        .spawn()
        .with_context(|| format!("starting {}", program.display()))?;
    let pid = libc::pid_t::try_from(child.id()).context("child pid out of range")?;
    let mut out = child.stdout.take().context("child stdout")?;
    let mut err = child.stderr.take().context("child stderr")?;
    let stderr_reader = std::thread::spawn(move || {
        let mut s = String::new();
        let _ = err.read_to_string(&mut s);
        s
    });
    let mut stdout = String::new();
    out.read_to_string(&mut stdout)
        .context("reading the child's stdout")?;
    let (status, usage) = wait4(pid)?;
    // The child is reaped: `child` must not wait for it again; dropping a
    // `Child` neither waits nor kills.
    drop(child);
    let stderr = stderr_reader.join().unwrap_or_default();
    if !(libc::WIFEXITED(status) && libc::WEXITSTATUS(status) == 0) {
        let tail: String = {
            let lines: Vec<&str> = stderr.lines().collect();
            lines[lines.len().saturating_sub(20)..].join("\n")
        };
        bail!(
            "{} {} failed ({}):\n{tail}",
            program.display(),
            args.join(" "),
            describe(status)
        );
    }
    Ok(Finished {
        stdout,
        stderr,
        // Linux reports ru_maxrss in kilobytes.
        peak_rss_bytes: u64::try_from(usage.ru_maxrss).unwrap_or(0) * 1024,
        cpu_seconds: seconds(usage.ru_utime) + seconds(usage.ru_stime),
    })
}

fn seconds(t: libc::timeval) -> f64 {
    t.tv_sec as f64 + t.tv_usec as f64 / 1e6
}

fn describe(status: libc::c_int) -> String {
    if libc::WIFEXITED(status) {
        format!("exit status {}", libc::WEXITSTATUS(status))
    } else if libc::WIFSIGNALED(status) {
        format!("killed by signal {}", libc::WTERMSIG(status))
    } else {
        format!("wait status {status:#x}")
    }
}

/// Waits for child `pid`, retrying on `EINTR`.
fn wait4(pid: libc::pid_t) -> anyhow::Result<(libc::c_int, libc::rusage)> {
    let mut status: libc::c_int = 0;
    // SAFETY: `rusage` is a plain C struct of integers; all-zero is a valid value.
    let mut usage: libc::rusage = unsafe { std::mem::zeroed() };
    loop {
        // SAFETY: `pid` is our own unreaped child (spawned above, never waited
        // for by `Child`); `status` and `usage` are live, writable locals of
        // the types wait4 writes.
        let r = unsafe { libc::wait4(pid, &raw mut status, 0, &raw mut usage) };
        if r == pid {
            return Ok((status, usage));
        }
        let e = std::io::Error::last_os_error();
        if e.kind() != std::io::ErrorKind::Interrupted {
            return Err(e).with_context(|| format!("wait4 for child {pid}"));
        }
    }
}
