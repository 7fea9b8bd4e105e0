//! `kvsan serve`'s client sockets do not hold small writes back.
//!
//! An SSE event written while the previous one is still unacknowledged
//! waits, under Nagle's algorithm, for the client's delayed ACK (40 ms on
//! Linux): a two-token request took 44 ms instead of under one. The server
//! sets `TCP_NODELAY` on every accepted client socket; these tests look at
//! the accepted sockets of a real `kvsan serve` process from outside — a
//! duplicate of each descriptor taken with `pidfd_getfd(2)`, matched to the
//! test's connection by its peer address — and check the option, with no
//! timing asserted. That each event then leaves as soon as the engine hands
//! its token over is what `kvsan bench latency` measures (streamed TTFT
//! and completion within a millisecond of the model's steps; a held-back
//! event shows there as tens of milliseconds).

use std::net::{SocketAddr, TcpStream};
use std::os::fd::{AsRawFd, FromRawFd, OwnedFd, RawFd};

use serde_json::{Value, json};

mod serve_common;
use serve_common::Server;
use serve_common::client::RawStream;

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

/// Streams a request of `max_tokens` on a connection of its own and reads
/// it to `[DONE]`: each token in an event of its own, then the event with
/// the finish reason. The connection stays open.
fn stream(addr: &str, max_tokens: usize) -> RawStream {
    let body = json!({
        "model": "synthetic",
        "prompt": [1, 2, 3, 4, 5, 6, 7, 8],
        "max_tokens": max_tokens,
        "stream": true,
    });
    let mut s = RawStream::open(addr, &body.to_string());
    for i in 0..=max_tokens {
        let chunk: Value = serde_json::from_str(&s.next_data()).expect("a JSON chunk");
        let choice = &chunk["choices"][0];
        let (tokens, reason) = if i < max_tokens {
            (1, None)
        } else {
            (0, Some("length"))
        };
        assert_eq!(
            choice["token_ids"].as_array().map(Vec::len),
            Some(tokens),
            "event {i}: {chunk}"
        );
        assert_eq!(
            choice["finish_reason"].as_str(),
            reason,
            "event {i}: {chunk}"
        );
    }
    assert_eq!(s.next_data(), "[DONE]");
    s
}

/// Every server-side socket connected to `client` has `TCP_NODELAY`.
fn assert_nodelay(server: &Server, client: SocketAddr) {
    let sockets = sockets_connected_to(server, client);
    assert!(
        !sockets.is_empty(),
        "no socket of the server is connected to {client}"
    );
    for s in &sockets {
        assert!(
            s.nodelay().expect("getsockopt TCP_NODELAY"),
            "the server's socket for client {client} has TCP_NODELAY off: small SSE events \
             wait for the client's delayed ACK"
        );
    }
}

#[test]
fn a_unified_server_sets_tcp_nodelay_on_every_client_socket() {
    let server = Server::synthetic("serve", "unified", &[]);
    let addr = server.listen();
    // Whole requests, so each connection is accepted and served.
    let streams = [stream(&addr, 4), stream(&addr, 4)];
    for s in &streams {
        assert_nodelay(&server, s.local_addr());
    }
}

#[test]
fn a_decode_server_sets_tcp_nodelay_on_its_client_sockets() {
    // No prefill node is needed for the client side: /stats is answered
    // by the decode node alone, on a connection kept open for the check.
    let server = Server::synthetic("serve", "decode", &[]);
    let addr = server.listen();
    let mut s = RawStream::get(&addr, "/stats");
    let stats = s.json_body();
    assert!(stats["front"].is_object(), "{stats}");
    assert_nodelay(&server, s.local_addr());
}
