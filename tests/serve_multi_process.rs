//! `kvsan serve` as real processes on loopback, driven over HTTP: a decode
//! process and a prefill process serve the same tokens as a unified one;
//! killing the prefill process mid-transfer aborts its requests with a
//! transport error, frees their pages, and the decode process serves on
//! with a new prefill process; a prompt over the prefill pool is rejected
//! before anything is allocated. Every pair runs with an authenticated
//! peer link (`--peer-key`). Every wait is bounded; every child is killed
//! on drop.

use std::sync::mpsc;
use std::thread;
use std::time::{Duration, Instant};

mod serve_common;
use serve_common::client::Client;
use serve_common::{START_BOUND, Server, peer_key_file};

/// How long any one expected event may take.
const BOUND: Duration = Duration::from_secs(15);

/// A decode process and a prefill process connected to it.
struct Pair {
    decode: Server,
    prefill: Server,
    /// The decode process's client address.
    listen: String,
    /// Where prefill processes connect.
    peer: String,
}

/// The key file every process of these tests holds.
fn key() -> String {
    peer_key_file("multi-process", 0x5a)
        .to_str()
        .expect("UTF-8 path")
        .to_string()
}

fn start_pair(prefill_args: &[&str]) -> Pair {
    let key = key();
    let decode = Server::synthetic("decode", "decode", &["--peer-key", &key]);
    decode.wait_for("peer link authenticated", START_BOUND);
    let addrs = decode.serving();
    let peer = addrs.peer_listen.expect("decode prints peer-listen=");
    let prefill = start_prefill(&peer, prefill_args);
    decode.wait_for("prefill node connected", START_BOUND);
    Pair {
        decode,
        prefill,
        listen: addrs.listen.expect("decode prints listen="),
        peer,
    }
}

fn start_prefill(peer: &str, extra: &[&str]) -> Server {
    let key = key();
    let mut args = vec![
        "--role",
        "prefill",
        "--synthetic",
        "--peer",
        peer,
        "--peer-key",
        &key,
    ];
    args.extend_from_slice(extra);
    Server::start("prefill", &args)
}

/// A deterministic prompt of `len` token ids inside the synthetic vocabulary.
fn prompt(len: usize, salt: u64) -> Vec<u64> {
    (0..len as u64)
        .map(|i| (i * 31 + salt * 7 + 3) % 251)
        .collect()
}

#[test]
fn a_decode_and_a_prefill_process_serve_the_tokens_a_unified_process_serves() {
    let pair = start_pair(&[]);
    let disagg_addr = pair.listen.clone();
    let unified = Server::synthetic("unified", "unified", &[]);
    let unified_addr = unified.listen();
    let cases: Vec<(Vec<u64>, usize)> = vec![
        (prompt(1, 1), 8),
        (prompt(17, 2), 16),
        (prompt(300, 3), 8),
        (prompt(1000, 4), 12),
    ];
    // The disaggregated requests run at once, one client each.
    let handles: Vec<_> = cases
        .iter()
        .cloned()
        .map(|(p, n)| {
            let addr = disagg_addr.clone();
            thread::spawn(move || Client::new(&addr).complete(&p, n))
        })
        .collect();
    let uni = Client::new(&unified_addr);
    for ((p, n), h) in cases.iter().zip(handles) {
        let disagg = h.join().expect("client thread");
        let alone = uni.complete(p, *n);
        disagg.assert_finished(p.len(), *n);
        alone.assert_finished(p.len(), *n);
        assert_eq!(
            disagg.tokens,
            alone.tokens,
            "prompt of {} tokens: disaggregated over TCP and unified differ",
            p.len()
        );
    }
}

#[test]
fn killing_the_prefill_process_mid_transfer_aborts_its_requests_frees_their_pages_and_decode_serves_on()
 {
    // Small prefill steps keep each 2,000-token prompt busy for many steps.
    let Pair {
        decode,
        mut prefill,
        listen,
        peer,
    } = start_pair(&["--step-tokens", "64"]);
    let ctl = Client::new(&listen);
    let total = ctl.front_stats()["total_pages"].as_u64().unwrap();
    let n = 4;
    let (tx, rx) = mpsc::channel();
    for i in 0..n {
        let (addr, tx) = (listen.clone(), tx.clone());
        thread::spawn(move || {
            let o = Client::new(&addr).complete(&prompt(2000, i), 4);
            let _ = tx.send(o);
        });
    }
    // Once decode has reserved pages, a prefill order is on its way: kill then.
    let deadline = Instant::now() + BOUND;
    while ctl.front_stats()["pages_allocated"].as_u64().unwrap() == 0 {
        assert!(Instant::now() < deadline, "decode never reserved pages");
        thread::sleep(Duration::from_millis(1));
    }
    prefill.kill();
    let killed = Instant::now();
    for _ in 0..n {
        let left = (killed + BOUND).saturating_duration_since(Instant::now());
        let o = rx
            .recv_timeout(left)
            .unwrap_or_else(|_| panic!("a request did not end within {BOUND:?} of the kill"));
        assert_eq!(o.error_code(), Some("transport"), "{o:?}");
        assert_eq!(o.status, 503, "refused before any token: {o:?}");
        let message = o.error.as_ref().unwrap()["message"].as_str().unwrap();
        assert!(
            message.contains("prefill"),
            "names the prefill node: {message}"
        );
    }
    decode.wait_for("prefill link down", BOUND);
    let s = ctl.front_stats();
    assert_eq!(s["free_pages"], total, "every page is back: {s}");
    assert_eq!(s["running"], 0, "{s}");
    assert_eq!(s["waiting"], 0, "{s}");

    // A new prefill process on the same address: decode serves again.
    let _prefill = start_prefill(&peer, &[]);
    decode.wait_for("prefill node connected", START_BOUND);
    let p = prompt(500, 9);
    ctl.complete(&p, 6).assert_finished(p.len(), 6);
    let s = ctl.front_stats();
    assert_eq!(s["free_pages"], total, "{s}");
    assert!(s["transfers"].as_u64().unwrap() > 0, "{s}");
}

#[test]
fn a_prompt_over_the_prefill_pool_is_rejected_over_the_wire_before_decode_allocates() {
    let pair = start_pair(&[
        "--prefill-pool-tokens",
        "1024",
        "--allow-pool-smaller-than-context",
    ]);
    let c = Client::new(&pair.listen);
    let o = c.complete(&prompt(1100, 5), 4);
    assert_eq!(o.status, 400, "{o:?}");
    assert_eq!(o.error_code(), Some("rejected"), "{o:?}");
    let r = &o.error.as_ref().unwrap()["rejection"];
    assert_eq!(r["limit"], 1024, "{r}");
    assert_eq!(r["prompt_tokens"], 1100, "{r}");
    assert_eq!(r["node"], "prefill", "{r}");
    assert!(o.tokens.is_empty());
    let s = c.front_stats();
    assert_eq!(s["pages_allocated"], 0, "decode allocated nothing: {s}");
    assert_eq!(s["transfers"], 0, "{s}");
    // The link is fine: a prompt that fits is served.
    let p = prompt(1000, 6);
    c.complete(&p, 3).assert_finished(p.len(), 3);
}

#[test]
fn a_prefill_process_that_cannot_reach_its_decode_node_exits_with_an_error() {
    // A port that was free a moment ago: nobody listens there.
    let port = std::net::TcpListener::bind("127.0.0.1:0")
        .unwrap()
        .local_addr()
        .unwrap();
    let mut prefill = start_prefill(&port.to_string(), &["--peer-retry-secs", "1"]);
    let line = prefill.wait_for("could not be reached", BOUND);
    assert!(line.contains(&port.to_string()), "{line}");
    let deadline = Instant::now() + BOUND;
    let status = loop {
        if let Some(s) = prefill.try_wait() {
            break s;
        }
        assert!(
            Instant::now() < deadline,
            "the prefill process did not exit"
        );
        thread::sleep(Duration::from_millis(20));
    };
    assert!(!status.success(), "{status}");
}
