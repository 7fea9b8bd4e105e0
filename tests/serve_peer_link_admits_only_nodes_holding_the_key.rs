//! `kvsan serve` with `--peer-key`, as real processes on loopback: a decode
//! and a prefill process holding the same key serve the tokens a unified
//! process serves; a prefill process with another key or none, and a peer
//! that stalls the handshake, are refused with a line naming their address
//! and why, the stalled one without delaying the real prefill process, and
//! decode goes on serving that one; a frame
//! altered or replayed on the wire drops the link with the reason and the
//! prefill process reconnects. Without a key, a non-loopback peer address
//! is refused at start.

use std::net::TcpStream;
use std::thread;
use std::time::{Duration, Instant};

#[path = "../engine/tests/peer_link_relay/mod.rs"]
mod peer_link_relay;
mod serve_common;
use peer_link_relay::{Meddle, relay};
use serve_common::client::Client;
use serve_common::{START_BOUND, Server, peer_key_file};

/// How long any one expected event may take.
const BOUND: Duration = Duration::from_secs(20);

fn path_arg(p: &std::path::Path) -> String {
    p.to_str().expect("UTF-8 path").to_string()
}

/// A decode process holding `key`; its client and peer addresses.
fn start_decode(key: &str) -> (Server, String, String) {
    let decode = Server::synthetic("decode", "decode", &["--peer-key", key]);
    decode.wait_for("peer link authenticated with the key in", START_BOUND);
    let addrs = decode.serving();
    let listen = addrs.listen.expect("decode prints listen=");
    let peer = addrs.peer_listen.expect("decode prints peer-listen=");
    (decode, listen, peer)
}

fn start_prefill(name: &'static str, peer: &str, key: Option<&str>) -> Server {
    let mut args = vec!["--role", "prefill", "--synthetic", "--peer", peer];
    if let Some(key) = key {
        args.extend(["--peer-key", key]);
    }
    Server::start(name, &args)
}

/// The greedy completion of `prompt` (token ids) from the server at
/// `addr`, checked to run to `max_tokens`.
fn complete(addr: &str, prompt: &[u64], max_tokens: usize) -> Vec<u64> {
    let done = Client::new(addr).complete(prompt, max_tokens);
    done.assert_finished(prompt.len(), max_tokens);
    done.tokens
}

/// A deterministic prompt of `len` token ids inside the synthetic vocabulary.
fn prompt(len: usize, salt: u64) -> Vec<u64> {
    (0..len as u64)
        .map(|i| (i * 31 + salt * 7 + 3) % 251)
        .collect()
}

#[test]
fn with_the_same_key_a_decode_and_a_prefill_process_serve_what_a_unified_process_serves() {
    let key = path_arg(&peer_key_file("serves", 0x11));
    let (decode, listen, peer) = start_decode(&key);
    let prefill = start_prefill("prefill", &peer, Some(&key));
    prefill.wait_for("peer link authenticated with the key in", START_BOUND);
    decode.wait_for("prefill node connected", START_BOUND);
    let unified = Server::synthetic("unified", "unified", &[]);
    let unified_addr = unified.serving().listen.expect("listen=");
    for (p, n) in [(prompt(17, 2), 16), (prompt(700, 3), 8)] {
        let disagg = complete(&listen, &p, n);
        assert_eq!(disagg.len(), n);
        assert_eq!(
            disagg,
            complete(&unified_addr, &p, n),
            "prompt of {} tokens: authenticated disaggregated and unified differ",
            p.len()
        );
    }
}

#[test]
fn a_stalled_handshake_a_wrong_key_or_no_key_is_refused_and_decode_serves_its_real_prefill() {
    let key = path_arg(&peer_key_file("refuses", 0x22));
    let (decode, listen, peer) = start_decode(&key);
    // A socket that never sends its hello, connected before the real
    // prefill process: the real one is attached while it stalls.
    let stalled = TcpStream::connect(&peer).unwrap();
    let here = stalled.local_addr().unwrap();
    let _real = start_prefill("prefill", &peer, Some(&key));
    decode.wait_for("prefill node connected", START_BOUND);
    let line = decode.wait_for("did not finish the handshake in time", BOUND);
    assert!(
        line.contains(&format!("refused a prefill node: peer prefill@{here}")),
        "{line}"
    );

    let other = path_arg(&peer_key_file("refuses", 0x33));
    let impostor = start_prefill("impostor", &peer, Some(&other));
    let line = decode.wait_for("refused a prefill node", BOUND);
    assert!(
        line.contains("prefill@127.0.0.1:"),
        "names the address: {line}"
    );
    assert!(
        line.contains("key proof does not verify"),
        "says why: {line}"
    );
    impostor.wait_for("did not authenticate each other", BOUND);

    let keyless = start_prefill("keyless", &peer, None);
    let line = decode.wait_for("did not open an authenticated handshake", START_BOUND);
    assert!(
        line.contains("refused a prefill node: peer prefill@127.0.0.1:"),
        "{line}"
    );
    keyless.wait_for("requires an authenticated link", BOUND);
    drop(keyless);

    // The real prefill process's link was never replaced: requests are served.
    let p = prompt(300, 4);
    assert_eq!(complete(&listen, &p, 6).len(), 6);
}

#[test]
fn an_altered_or_a_replayed_frame_drops_the_link_with_the_reason_and_prefill_reconnects() {
    let key = path_arg(&peer_key_file("meddled", 0x44));
    let (decode, listen, peer) = start_decode(&key);
    let via = relay(peer, vec![Meddle::Alter, Meddle::Replay]);
    let _prefill = start_prefill("prefill", &via, Some(&key));
    for refused in ["record 0 refused", "record 1 refused"] {
        let line = decode.wait_for(refused, START_BOUND);
        assert!(
            line.contains("prefill@127.0.0.1:"),
            "names the address: {line}"
        );
        assert!(line.contains("fails authentication"), "says why: {line}");
    }
    // The third connection is relayed faithfully: requests are served.
    decode.wait_for("prefill node connected", BOUND);
    let p = prompt(200, 5);
    assert_eq!(complete(&listen, &p, 4).len(), 4);
}

/// A decode process taking prefill nodes on every address (`0.0.0.0`),
/// with `extra` flags.
fn decode_on_every_address(name: &'static str, extra: &[&str]) -> Server {
    let mut args = vec![
        "--role",
        "decode",
        "--synthetic",
        "--listen",
        "127.0.0.1:0",
        "--peer-listen",
        "0.0.0.0:0",
    ];
    args.extend_from_slice(extra);
    Server::start(name, &args)
}

#[test]
fn without_a_key_a_non_loopback_peer_address_is_refused_at_start() {
    let mut decode = decode_on_every_address("decode", &[]);
    let line = decode.wait_for("is not a loopback address", BOUND);
    assert!(line.contains("--peer-listen 0.0.0.0:0"), "{line}");
    assert!(
        line.contains("--peer-key") && line.contains("--insecure-peer-link"),
        "{line}"
    );
    let deadline = Instant::now() + BOUND;
    while decode.try_wait().is_none() {
        assert!(Instant::now() < deadline, "the decode process did not exit");
        thread::sleep(Duration::from_millis(20));
    }

    let insecure = decode_on_every_address("insecure", &["--insecure-peer-link"]);
    insecure.wait_for("peer link NOT authenticated (--insecure-peer-link)", BOUND);
    insecure.serving();
}

#[test]
fn a_short_key_file_is_refused_at_start_naming_the_file_and_the_limit() {
    let short = std::path::Path::new(env!("CARGO_TARGET_TMPDIR"))
        .join(format!("peer-key-short-{}", std::process::id()));
    std::fs::write(&short, "00112233").unwrap();
    let short = path_arg(&short);
    let prefill = start_prefill("prefill", "127.0.0.1:1", Some(&short));
    let line = prefill.wait_for("peer key", BOUND);
    assert!(line.contains(&short), "names the file: {line}");
    assert!(
        line.contains("4 bytes, at least 32"),
        "names the limit: {line}"
    );
}
