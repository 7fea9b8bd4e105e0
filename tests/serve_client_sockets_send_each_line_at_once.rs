//! `kvsan serve`'s client sockets do not hold small lines back.
//!
//! A token line written while the previous line is still unacknowledged
//! waits, under Nagle's algorithm, for the client's delayed ACK (40 ms on
//! Linux): a two-token request took 44 ms instead of under one. The server
//! sets `TCP_NODELAY` on every accepted client socket; these tests look at
//! the accepted sockets of a real `kvsan serve` process from outside — a
//! duplicate of each descriptor taken with `pidfd_getfd(2)`, matched to the
//! test's connection by its peer address — and check the option, with no
//! timing asserted. That each token line is written and flushed on its own,
//! before the next event is waited for, is the unit test
//! `a_token_line_is_flushed_before_the_next_event_arrives` in
//! `src/commands/serve/client.rs`.

use std::io::{BufRead, BufReader, Write};
use std::net::{SocketAddr, TcpStream};
use std::os::fd::{AsRawFd, FromRawFd, OwnedFd, RawFd};
use std::time::Duration;

use serde_json::{Value, json};

mod serve_common;
use serve_common::Server;

/// How long any one answer line may take.
const BOUND: Duration = Duration::from_secs(15);

/// Duplicates of `server`'s descriptors for the socket whose peer is
/// `client` (the accepted socket and its clones).
fn sockets_connected_to(server: &Server, client: SocketAddr) -> Vec<TcpStream> {
    let pid = libc::pid_t::try_from(server.pid()).expect("pid");
    // SAFETY: pidfd_open takes a pid and flags and returns a new
    // descriptor or -1; no memory is passed.
    let pidfd = unsafe { libc::syscall(libc::SYS_pidfd_open, pid, 0) };
    assert!(
        pidfd >= 0,
        "pidfd_open({pid}): {}",
        std::io::Error::last_os_error()
    );
    // SAFETY: pidfd_open returned a new descriptor that nothing else owns.
    let pidfd = unsafe { OwnedFd::from_raw_fd(pidfd as RawFd) };
    let fds = std::fs::read_dir(format!("/proc/{pid}/fd")).expect("list the server's fds");
    let mut found = Vec::new();
    for entry in fds.map_while(Result::ok) {
        let target = std::fs::read_link(entry.path()).unwrap_or_default();
        if !target.to_string_lossy().starts_with("socket:") {
            continue;
        }
        let Ok(fd) = entry.file_name().to_string_lossy().parse::<RawFd>() else {
            continue;
        };
        // SAFETY: pidfd_getfd takes two descriptor numbers and flags and
        // returns a new descriptor or -1; no memory is passed.
        let dup = unsafe { libc::syscall(libc::SYS_pidfd_getfd, pidfd.as_raw_fd(), fd, 0) };
        assert!(
            dup >= 0,
            "pidfd_getfd of the server's fd {fd} (the test is the server's parent, which \
             ptrace access mode allows unless kernel.yama.ptrace_scope >= 2): {}",
            std::io::Error::last_os_error()
        );
        // SAFETY: pidfd_getfd returned a new descriptor, a socket (its
        // /proc link says so), that nothing else owns.
        let stream = unsafe { TcpStream::from_raw_fd(dup as RawFd) };
        if stream.peer_addr().ok() == Some(client) {
            found.push(stream);
        }
    }
    found
}

/// A client connection: `TCP_NODELAY`, one write per request line.
struct Client {
    reader: BufReader<TcpStream>,
    writer: TcpStream,
}

impl Client {
    fn connect(addr: &str) -> Client {
        let stream = TcpStream::connect(addr).expect("connect to the client port");
        stream.set_nodelay(true).unwrap();
        stream.set_read_timeout(Some(BOUND)).unwrap();
        Client {
            reader: BufReader::new(stream.try_clone().unwrap()),
            writer: stream,
        }
    }

    fn local(&self) -> SocketAddr {
        self.writer.local_addr().unwrap()
    }

    fn send(&mut self, v: &Value) {
        let mut line = v.to_string().into_bytes();
        line.push(b'\n');
        self.writer.write_all(&line).unwrap();
    }

    fn recv(&mut self) -> Value {
        let mut line = String::new();
        let n = self
            .reader
            .read_line(&mut line)
            .unwrap_or_else(|e| panic!("no line from the server within {BOUND:?}: {e}"));
        assert!(n > 0, "the server closed the connection");
        serde_json::from_str(&line).unwrap_or_else(|e| panic!("not JSON ({e}): {line}"))
    }

    /// Streams a request of `max_tokens` and checks the answer is the id,
    /// one line per token, and the finished line.
    fn stream(&mut self, max_tokens: usize) {
        self.send(&json!({ "prompt_ids": [1, 2, 3, 4, 5, 6, 7, 8], "max_tokens": max_tokens }));
        let id = self.recv();
        assert!(id["id"].is_u64(), "first line is the id: {id}");
        for i in 0..max_tokens {
            let v = self.recv();
            let obj = v.as_object().expect("an object per line");
            assert!(
                obj.len() == 1 && obj["token"].is_u64(),
                "line {i} after the id carries one token: {v}"
            );
        }
        let end = self.recv();
        assert_eq!(end["finished"]["generated"], max_tokens, "{end}");
    }
}

/// Every server-side socket connected to `client` has `TCP_NODELAY`.
fn assert_nodelay(server: &Server, client: &Client) {
    let sockets = sockets_connected_to(server, client.local());
    assert!(
        !sockets.is_empty(),
        "no socket of the server is connected to {}",
        client.local()
    );
    for s in &sockets {
        assert!(
            s.nodelay().expect("getsockopt TCP_NODELAY"),
            "the server's socket for client {} has TCP_NODELAY off: small answer lines \
             wait for the client's delayed ACK",
            client.local()
        );
    }
}

#[test]
fn a_unified_server_sets_tcp_nodelay_on_every_client_socket() {
    let server = Server::start(
        "serve",
        &[
            "--role",
            "unified",
            "--synthetic",
            "--listen",
            "127.0.0.1:0",
        ],
    );
    let addr = server
        .serving()
        .listen
        .expect("listen= on the serving line");
    let mut clients = [Client::connect(&addr), Client::connect(&addr)];
    for c in &mut clients {
        // A whole request, so the connection is accepted and served.
        c.stream(4);
    }
    for c in &clients {
        assert_nodelay(&server, c);
    }
}

#[test]
fn a_decode_server_sets_tcp_nodelay_on_its_client_sockets() {
    // No prefill node is needed for the client side: a stats line is
    // answered by the decode node alone.
    let server = Server::start(
        "serve",
        &[
            "--role",
            "decode",
            "--synthetic",
            "--listen",
            "127.0.0.1:0",
            "--peer-listen",
            "127.0.0.1:0",
        ],
    );
    let addr = server
        .serving()
        .listen
        .expect("listen= on the serving line");
    let mut client = Client::connect(&addr);
    client.send(&json!({ "stats": true }));
    let stats = client.recv();
    assert!(stats["stats"]["front"].is_object(), "{stats}");
    assert_nodelay(&server, &client);
}
