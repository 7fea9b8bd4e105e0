//! A `kvsan serve` child process for the benchmarks that drive real
//! servers (`latency`, `soak`), and the client socket to it.
//!
//! The child's stderr is drained for its whole life by a thread (so the
//! child never blocks on a full pipe) and handed over line by line: the
//! benchmark waits for the lines it needs (the "serving" line with the
//! addresses) and, once the child has stopped, gets the rest (the
//! sanitizer's reports and summary).

use std::ffi::OsString;
use std::io::{BufRead, BufReader, Write};
use std::net::TcpStream;
use std::path::Path;
use std::process::{Child, Command, ExitStatus, Stdio};
use std::sync::mpsc::{self, RecvTimeoutError};
use std::time::{Duration, Instant};

use anyhow::{Context, bail};

/// How long a server process may take to start serving.
pub const START_BOUND: Duration = Duration::from_secs(60);
/// How long a stopped server may take to exit.
const STOP_BOUND: Duration = Duration::from_secs(30);

/// A `kvsan serve` child; killed and reaped on drop unless stopped.
pub struct Server {
    child: Child,
    lines: mpsc::Receiver<String>,
    /// Lines [`Server::wait_for`] went through.
    seen: Vec<String>,
    name: &'static str,
}

/// What a server that was stopped left.
pub struct Stopped {
    /// How it exited.
    pub status: ExitStatus,
    /// Every line it wrote on stderr, in order.
    pub lines: Vec<String>,
}

impl Server {
    /// Starts `bin serve args…` with `env` added (and the variables named
    /// with an empty value removed).
    pub fn start(
        bin: &Path,
        name: &'static str,
        args: &[&str],
        env: &[(&str, OsString)],
    ) -> anyhow::Result<Server> {
        let mut cmd = Command::new(bin);
        cmd.arg("serve")
            .args(args)
            .stdin(Stdio::null())
            .stdout(Stdio::null())
            .stderr(Stdio::piped());
        for (key, value) in env {
            if value.is_empty() {
                cmd.env_remove(key);
            } else {
                cmd.env(key, value);
            }
        }
        let mut child = cmd
            .spawn()
            .with_context(|| format!("starting {} serve", bin.display()))?;
        let stderr = child.stderr.take().context("the server's stderr")?;
        let (tx, lines) = mpsc::channel();
        std::thread::spawn(move || {
            for line in BufReader::new(stderr).lines().map_while(Result::ok) {
                let _ = tx.send(line);
            }
        });
        Ok(Server {
            child,
            lines,
            seen: Vec::new(),
            name,
        })
    }

    /// The process id.
    pub fn pid(&self) -> u32 {
        self.child.id()
    }

    /// The next stderr line containing `pattern` (it and the lines before
    /// it are kept for [`Server::stop`]).
    pub fn wait_for(&mut self, pattern: &str) -> anyhow::Result<String> {
        let deadline = Instant::now() + START_BOUND;
        loop {
            let left = deadline.saturating_duration_since(Instant::now());
            match self.lines.recv_timeout(left) {
                Ok(line) => {
                    let found = line.contains(pattern);
                    self.seen.push(line);
                    if found {
                        return Ok(self.seen.last().cloned().unwrap_or_default());
                    }
                }
                Err(RecvTimeoutError::Timeout) => {
                    bail!(
                        "{}: no line with {pattern:?} within {START_BOUND:?}",
                        self.name
                    )
                }
                Err(RecvTimeoutError::Disconnected) => {
                    bail!("{}: exited before printing {pattern:?}", self.name)
                }
            }
        }
    }

    /// `key=ADDR` from the "kvsan: serving" line.
    pub fn address(&self, line: &str, key: &str) -> anyhow::Result<String> {
        line.split_whitespace()
            .find_map(|w| w.strip_prefix(key))
            .map(str::to_string)
            .with_context(|| format!("{}: no {key} in {line:?}", self.name))
    }

    /// Stops the server cleanly (SIGTERM: `kvsan serve` and a preloaded
    /// shim print their summaries on the way out) and returns how it
    /// exited and the rest of its stderr.
    ///
    /// # Errors
    /// The signal cannot be sent, or the server does not exit within 30 s
    /// (it is then killed).
    pub fn stop(mut self) -> anyhow::Result<Stopped> {
        let pid = libc::pid_t::try_from(self.child.id()).context("pid out of range")?;
        // SAFETY: `pid` is our own child, not yet reaped (`self.child` owns
        // it), so the id cannot have been reused by another process.
        if unsafe { libc::kill(pid, libc::SIGTERM) } != 0 {
            let e = std::io::Error::last_os_error();
            return Err(e).with_context(|| format!("{}: sending SIGTERM", self.name));
        }
        let deadline = Instant::now() + STOP_BOUND;
        let status = loop {
            if let Some(status) = self.child.try_wait()? {
                break status;
            }
            if Instant::now() >= deadline {
                bail!(
                    "{}: still running {STOP_BOUND:?} after SIGTERM (killed)",
                    self.name
                );
            }
            std::thread::sleep(Duration::from_millis(20));
        };
        // The drain thread ends at the pipe's end: take every line to it.
        let mut lines = std::mem::take(&mut self.seen);
        loop {
            match self.lines.recv_timeout(STOP_BOUND) {
                Ok(line) => lines.push(line),
                Err(RecvTimeoutError::Disconnected) => break,
                Err(RecvTimeoutError::Timeout) => {
                    bail!("{}: stderr still open after exit", self.name)
                }
            }
        }
        Ok(Stopped { status, lines })
    }
}

impl Drop for Server {
    fn drop(&mut self) {
        // After `stop` the child is reaped and both calls are no-ops.
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}

/// A client connection speaking JSON lines: `TCP_NODELAY` (a small line
/// leaves at once, not after the server's delayed ACK), each request line
/// sent in one write, reads bounded by a timeout.
pub struct Connection {
    reader: BufReader<TcpStream>,
    writer: TcpStream,
    line: String,
}

impl Connection {
    /// Connects to `addr`; a read waits at most `read_timeout`.
    pub fn open(addr: &str, read_timeout: Duration) -> anyhow::Result<Connection> {
        let stream = TcpStream::connect(addr).with_context(|| format!("connecting to {addr}"))?;
        stream.set_nodelay(true)?;
        stream.set_read_timeout(Some(read_timeout))?;
        Ok(Connection {
            reader: BufReader::new(stream.try_clone()?),
            writer: stream,
            line: String::new(),
        })
    }

    /// Sends `line` and its newline in one write.
    pub fn send(&mut self, line: &str) -> anyhow::Result<()> {
        let mut bytes = Vec::with_capacity(line.len() + 1);
        bytes.extend_from_slice(line.as_bytes());
        bytes.push(b'\n');
        self.writer.write_all(&bytes)?;
        Ok(())
    }

    /// The next answer line (with its newline).
    pub fn recv(&mut self) -> anyhow::Result<&str> {
        self.line.clear();
        let n = self
            .reader
            .read_line(&mut self.line)
            .context("reading the server's answer")?;
        if n == 0 {
            bail!("the server closed the connection");
        }
        Ok(&self.line)
    }
}
