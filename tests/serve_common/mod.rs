//! A `kvsan serve` child process for the multi-process tests: started from
//! the test's `kvsan` binary, its stderr drained for its whole life, killed
//! and reaped on drop; and the HTTP clients the tests talk to it with
//! ([`client`]).
#![allow(dead_code)] // each test binary uses its part

pub mod client;

use std::ffi::OsStr;
use std::io::{BufRead, BufReader};
use std::process::{Child, Command, Stdio};
use std::sync::mpsc::{self, Receiver, RecvTimeoutError};
use std::thread;
use std::time::{Duration, Instant};

/// How long a process may take to start serving.
pub const START_BOUND: Duration = Duration::from_secs(60);

/// A `kvsan serve` child process; killed and reaped on drop.
pub struct Server {
    name: &'static str,
    child: Child,
    stderr: Receiver<String>,
}

impl Server {
    pub fn start(name: &'static str, args: &[&str]) -> Server {
        Self::start_with_env(name, args, &[])
    }

    /// `kvsan serve --role ROLE` serving HTTP clients on a free loopback
    /// port (a decode node also takes prefill nodes on one), with `extra`
    /// flags and `env` added to the child's environment.
    pub fn http(name: &'static str, role: &str, extra: &[&str], env: &[(&str, &OsStr)]) -> Server {
        let mut args = vec!["--role", role, "--listen", "127.0.0.1:0"];
        if role == "decode" {
            args.extend(["--peer-listen", "127.0.0.1:0"]);
        }
        args.extend_from_slice(extra);
        Self::start_with_env(name, &args, env)
    }

    /// [`Server::http`] of the synthetic model (prompts are token-id arrays).
    pub fn synthetic(name: &'static str, role: &str, extra: &[&str]) -> Server {
        let mut args = vec!["--synthetic"];
        args.extend_from_slice(extra);
        Self::http(name, role, &args, &[])
    }

    /// As [`Server::start`], with `env` added to the child's environment.
    pub fn start_with_env(name: &'static str, args: &[&str], env: &[(&str, &OsStr)]) -> Server {
        let mut child = Command::new(env!("CARGO_BIN_EXE_kvsan"))
            .arg("serve")
            .args(args)
            .envs(env.iter().copied())
            .stdin(Stdio::null())
            .stdout(Stdio::null())
            .stderr(Stdio::piped())
            .spawn()
            .expect("start kvsan serve");
        let stderr = child.stderr.take().expect("piped stderr");
        let (tx, rx) = mpsc::channel();
        // Drain stderr for the child's whole life so it never blocks on a full pipe.
        thread::spawn(move || {
            for line in BufReader::new(stderr).lines().map_while(Result::ok) {
                eprintln!("[{name}] {line}");
                let _ = tx.send(line);
            }
        });
        Server {
            name,
            child,
            stderr: rx,
        }
    }

    /// The next stderr line containing `pattern`, waiting at most `within`.
    pub fn wait_for(&self, pattern: &str, within: Duration) -> String {
        let deadline = Instant::now() + within;
        loop {
            let left = deadline.saturating_duration_since(Instant::now());
            match self.stderr.recv_timeout(left) {
                Ok(line) if line.contains(pattern) => return line,
                Ok(_) => {}
                Err(RecvTimeoutError::Timeout) => {
                    panic!("{}: no line with {pattern:?} within {within:?}", self.name)
                }
                Err(RecvTimeoutError::Disconnected) => {
                    panic!("{}: exited before printing {pattern:?}", self.name)
                }
            }
        }
    }

    /// The addresses of the "serving" line: `key=ADDR` pairs.
    pub fn serving(&self) -> Addrs {
        let line = self.wait_for("kvsan: serving", START_BOUND);
        let get = |key: &str| {
            line.split_whitespace()
                .find_map(|w| w.strip_prefix(key))
                .map(str::to_string)
        };
        Addrs {
            listen: get("listen="),
            peer_listen: get("peer-listen="),
        }
    }

    /// The client address of the "serving" line.
    pub fn listen(&self) -> String {
        self.serving().listen.expect("listen= on the serving line")
    }

    /// The process id.
    pub fn pid(&self) -> u32 {
        self.child.id()
    }

    /// The exit status, if the process has exited.
    pub fn try_wait(&mut self) -> Option<std::process::ExitStatus> {
        self.child.try_wait().expect("wait for the child")
    }

    /// Sends SIGKILL and reaps the process.
    pub fn kill(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}

impl Drop for Server {
    fn drop(&mut self) {
        self.kill();
    }
}

/// Writes a peer key file (64 hex digits from `byte`) for `--peer-key`, a
/// new file on every call, and returns its path.
pub fn peer_key_file(test: &str, byte: u8) -> std::path::PathBuf {
    static FILES: std::sync::atomic::AtomicUsize = std::sync::atomic::AtomicUsize::new(0);
    let n = FILES.fetch_add(1, std::sync::atomic::Ordering::Relaxed);
    let path = std::path::Path::new(env!("CARGO_TARGET_TMPDIR")).join(format!(
        "peer-key-{test}-{byte:02x}-{}-{n}",
        std::process::id()
    ));
    std::fs::write(&path, format!("{byte:02x}").repeat(32) + "\n").expect("write the key file");
    path
}

/// The addresses a server printed.
pub struct Addrs {
    /// The client address.
    pub listen: Option<String>,
    /// Where prefill processes connect (decode only).
    pub peer_listen: Option<String>,
}
