//! A `kvsan serve` child process for the benchmarks that drive real
//! servers (`latency`, `soak`), and the HTTP client they drive it with.
//!
//! The child's stderr is drained for its whole life by a thread (so the
//! child never blocks on a full pipe) and handed over line by line: the
//! benchmark waits for the lines it needs (the "serving" line with the
//! addresses) and, once the child has stopped, gets the rest (the
//! sanitizer's reports and summary).

use std::ffi::OsString;
use std::io::{BufRead, BufReader};
use std::path::Path;
use std::process::{Child, Command, ExitStatus, Stdio};
use std::sync::mpsc::{self, RecvTimeoutError};
use std::time::{Duration, Instant};

use anyhow::{Context, bail};
use serde_json::Value;

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

/// A client of `kvsan serve`'s HTTP API: reqwest (`TCP_NODELAY` on its
/// sockets, so a request's small writes leave at once), keep-alive
/// connections, each request driven to its end on a single-threaded runtime
/// in the calling thread — no hand-off to another thread on the timed path.
pub struct HttpClient {
    runtime: tokio::runtime::Runtime,
    http: reqwest::Client,
    base: String,
}

/// A server's answer to a generation request.
pub enum Answer<'c> {
    /// 200 with `"stream": true`: server-sent events to read.
    Stream(Events<'c>),
    /// 200 with a whole JSON answer.
    Whole(Value),
    /// Another status, and its `error` object.
    Error { status: u16, error: Value },
}

impl HttpClient {
    /// A client of the server at `addr` (`HOST:PORT`); one read waits at
    /// most `read_timeout`.
    pub fn new(addr: &str, read_timeout: Duration) -> anyhow::Result<HttpClient> {
        let runtime = tokio::runtime::Builder::new_current_thread()
            .enable_all()
            .build()
            .context("starting the HTTP client's runtime")?;
        let http = reqwest::Client::builder()
            .no_proxy()
            .tcp_nodelay(true)
            .read_timeout(read_timeout)
            .build()
            .context("building the HTTP client")?;
        Ok(HttpClient {
            runtime,
            http,
            base: format!("http://{addr}"),
        })
    }

    /// `GET path`, a JSON answer.
    pub fn get_json(&self, path: &str) -> anyhow::Result<Value> {
        let url = format!("{}{path}", self.base);
        self.runtime.block_on(async {
            let response = self
                .http
                .get(&url)
                .send()
                .await
                .with_context(|| format!("GET {url}"))?;
            let status = response.status();
            let body = response
                .bytes()
                .await
                .with_context(|| format!("GET {url}"))?;
            if !status.is_success() {
                bail!("GET {url}: {status}: {}", String::from_utf8_lossy(&body));
            }
            serde_json::from_slice(&body).with_context(|| format!("GET {url}: not JSON"))
        })
    }

    /// `POST /v1/completions` with `body`, as tenant `key`'s (`None`: no
    /// key). A streamed answer is returned at its status, its events still
    /// to read; a whole one once it is all in.
    pub fn complete(&self, body: &Value, key: Option<&str>) -> anyhow::Result<Answer<'_>> {
        let url = format!("{}/v1/completions", self.base);
        let mut request = self
            .http
            .post(&url)
            .header(reqwest::header::CONTENT_TYPE, "application/json")
            .body(body.to_string());
        if let Some(key) = key {
            request = request.bearer_auth(key);
        }
        self.runtime.block_on(async {
            let response = request
                .send()
                .await
                .with_context(|| format!("POST {url}"))?;
            let status = response.status().as_u16();
            let streamed = response
                .headers()
                .get(reqwest::header::CONTENT_TYPE)
                .is_some_and(|v| v.as_bytes().starts_with(b"text/event-stream"));
            if status == 200 && streamed {
                return Ok(Answer::Stream(Events {
                    client: self,
                    response,
                    buf: Vec::new(),
                }));
            }
            let bytes = response
                .bytes()
                .await
                .with_context(|| format!("POST {url}: reading the answer"))?;
            let v: Value = serde_json::from_slice(&bytes).with_context(|| {
                format!(
                    "POST {url}: {status}, not JSON: {}",
                    String::from_utf8_lossy(&bytes)
                )
            })?;
            Ok(if status == 200 {
                Answer::Whole(v)
            } else {
                Answer::Error {
                    status,
                    error: v["error"].clone(),
                }
            })
        })
    }
}

/// The events of a streamed answer. Dropped before its end, it closes the
/// connection: the server cancels the request.
pub struct Events<'c> {
    client: &'c HttpClient,
    response: reqwest::Response,
    /// Bytes received past the last whole event.
    buf: Vec<u8>,
}

impl Events<'_> {
    /// The next event's `data`, as it arrives; `None` at the end of the body.
    pub fn next_data(&mut self) -> anyhow::Result<Option<String>> {
        loop {
            if let Some(end) = self.buf.windows(2).position(|w| w == b"\n\n") {
                let event: Vec<u8> = self.buf.drain(..end + 2).collect();
                let text = std::str::from_utf8(&event).context("an event that is not UTF-8")?;
                let data = text
                    .lines()
                    .find_map(|l| l.strip_prefix("data: "))
                    .with_context(|| format!("an event without data: {text:?}"))?;
                return Ok(Some(data.to_string()));
            }
            let chunk = self
                .client
                .runtime
                .block_on(self.response.chunk())
                .context("reading the event stream")?;
            match chunk {
                Some(bytes) => self.buf.extend_from_slice(&bytes),
                None if self.buf.iter().all(u8::is_ascii_whitespace) => return Ok(None),
                None => bail!(
                    "the event stream ended inside an event: {:?}",
                    String::from_utf8_lossy(&self.buf)
                ),
            }
        }
    }
}
