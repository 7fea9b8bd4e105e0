//! `kvsan serve` as real processes on loopback: a decode process and a
//! prefill process serve the same tokens as a unified one; killing the
//! prefill process mid-transfer aborts its requests with a transport error,
//! frees their pages, and the decode process serves on with a new prefill
//! process; a prompt over the prefill pool is rejected before anything is
//! allocated. Every pair runs with an authenticated peer link
//! (`--peer-key`). Every wait is bounded; every child is killed on drop.

use std::io::{BufRead, BufReader, Write};
use std::net::TcpStream;
use std::sync::mpsc;
use std::thread;
use std::time::{Duration, Instant};

use serde_json::{Value, json};

mod serve_common;
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
    let decode = Server::start(
        "decode",
        &[
            "--role",
            "decode",
            "--synthetic",
            "--listen",
            "127.0.0.1:0",
            "--peer-listen",
            "127.0.0.1:0",
            "--peer-key",
            &key,
        ],
    );
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

/// A client connection speaking JSON lines.
struct Client {
    reader: BufReader<TcpStream>,
    writer: TcpStream,
}

/// How a generation ended: its id, tokens and final line.
#[derive(Debug)]
struct Outcome {
    tokens: Vec<u64>,
    end: Value,
}

impl Outcome {
    fn error_kind(&self) -> Option<&str> {
        self.end["error"]["kind"].as_str()
    }
}

impl Client {
    fn connect(addr: &str) -> Client {
        let stream = TcpStream::connect(addr).expect("connect to the client port");
        stream.set_read_timeout(Some(BOUND)).unwrap();
        stream.set_nodelay(true).unwrap();
        Client {
            reader: BufReader::new(stream.try_clone().unwrap()),
            writer: stream,
        }
    }

    fn send_raw(&mut self, line: &str) {
        // One write per line: a line in two writes waits for the server's
        // delayed ACK before its newline goes out.
        self.writer
            .write_all(format!("{line}\n").as_bytes())
            .unwrap();
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

    fn generate(&mut self, request: &Value) -> Outcome {
        self.send_raw(&request.to_string());
        let first = self.recv();
        if first.get("error").is_some() {
            return Outcome {
                tokens: Vec::new(),
                end: first,
            };
        }
        assert!(first["id"].is_u64(), "first line is the id: {first}");
        let mut tokens = Vec::new();
        loop {
            let v = self.recv();
            if let Some(t) = v.get("token") {
                tokens.push(t.as_u64().expect("token id"));
            } else {
                assert!(
                    v.get("finished").is_some() || v.get("error").is_some(),
                    "unexpected line {v}"
                );
                return Outcome { tokens, end: v };
            }
        }
    }

    /// The front node's counters.
    fn front_stats(&mut self) -> Value {
        self.send_raw(r#"{"stats": true}"#);
        let v = self.recv();
        v["stats"]["front"].clone()
    }
}

/// A deterministic prompt of `len` token ids inside the synthetic vocabulary.
fn prompt(len: usize, salt: u64) -> Vec<u64> {
    (0..len as u64)
        .map(|i| (i * 31 + salt * 7 + 3) % 251)
        .collect()
}

fn finished(o: &Outcome, prompt_len: usize, max_tokens: usize) {
    let fin = &o.end["finished"];
    assert_eq!(fin["reason"], "length", "{:?}", o.end);
    assert_eq!(fin["prompt_tokens"], prompt_len);
    assert_eq!(fin["generated"], max_tokens);
    assert_eq!(o.tokens.len(), max_tokens);
}

#[test]
fn a_decode_and_a_prefill_process_serve_the_tokens_a_unified_process_serves() {
    let pair = start_pair(&[]);
    let disagg_addr = pair.listen.clone();
    let unified = Server::start(
        "unified",
        &[
            "--role",
            "unified",
            "--synthetic",
            "--listen",
            "127.0.0.1:0",
        ],
    );
    let unified_addr = unified.serving().listen.expect("listen=");
    let cases: Vec<(Vec<u64>, usize)> = vec![
        (prompt(1, 1), 8),
        (prompt(17, 2), 16),
        (prompt(300, 3), 8),
        (prompt(1000, 4), 12),
    ];
    // The disaggregated requests run at once, one connection each.
    let handles: Vec<_> = cases
        .iter()
        .cloned()
        .map(|(p, n)| {
            let addr = disagg_addr.clone();
            thread::spawn(move || {
                Client::connect(&addr).generate(&json!({ "prompt_ids": p, "max_tokens": n }))
            })
        })
        .collect();
    let mut uni = Client::connect(&unified_addr);
    for ((p, n), h) in cases.iter().zip(handles) {
        let disagg = h.join().expect("client thread");
        let alone = uni.generate(&json!({ "prompt_ids": p, "max_tokens": n }));
        finished(&disagg, p.len(), *n);
        finished(&alone, p.len(), *n);
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
    let mut ctl = Client::connect(&listen);
    let total = ctl.front_stats()["total_pages"].as_u64().unwrap();
    let n = 4;
    let (tx, rx) = mpsc::channel();
    for i in 0..n {
        let (addr, tx) = (listen.clone(), tx.clone());
        thread::spawn(move || {
            let o = Client::connect(&addr)
                .generate(&json!({ "prompt_ids": prompt(2000, i), "max_tokens": 4 }));
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
        assert_eq!(o.error_kind(), Some("transport"), "{:?}", o.end);
        let message = o.end["error"]["message"].as_str().unwrap();
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
    let o = ctl.generate(&json!({ "prompt_ids": p, "max_tokens": 6 }));
    finished(&o, p.len(), 6);
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
    let mut c = Client::connect(&pair.listen);
    let o = c.generate(&json!({ "prompt_ids": prompt(1100, 5), "max_tokens": 4 }));
    let e = &o.end["error"];
    assert_eq!(e["kind"], "rejected", "{e}");
    assert_eq!(e["limit"], 1024, "{e}");
    assert_eq!(e["prompt_tokens"], 1100, "{e}");
    assert_eq!(e["node"], "prefill", "{e}");
    assert!(o.tokens.is_empty());
    let s = c.front_stats();
    assert_eq!(s["pages_allocated"], 0, "decode allocated nothing: {s}");
    assert_eq!(s["transfers"], 0, "{s}");
    // The link is fine: a prompt that fits is served.
    let p = prompt(1000, 6);
    finished(
        &c.generate(&json!({ "prompt_ids": p, "max_tokens": 3 })),
        p.len(),
        3,
    );
}

#[test]
fn a_malformed_line_gets_an_invalid_request_error_and_the_connection_goes_on() {
    let unified = Server::start(
        "unified",
        &[
            "--role",
            "unified",
            "--synthetic",
            "--listen",
            "127.0.0.1:0",
        ],
    );
    let mut c = Client::connect(&unified.serving().listen.expect("listen="));
    for (line, names) in [
        ("not json", "not valid JSON"),
        ("[1, 2]", "JSON object"),
        (r#"{"prompt_ids": [1], "max_token": 3}"#, "max_token"),
        (r#"{"prompt_ids": [1, -2]}"#, "prompt_ids\"[1]"),
        (r#"{"prompt_ids": [1], "temperature": -1}"#, "temperature"),
        (r#"{"prompt": "hello"}"#, "prompt_ids"),
        (r#"{"max_tokens": 3}"#, "prompt"),
    ] {
        c.send_raw(line);
        let v = c.recv();
        assert_eq!(v["error"]["kind"], "invalid-request", "{line}: {v}");
        let message = v["error"]["message"].as_str().unwrap();
        assert!(message.contains(names), "{line}: {message}");
    }
    let p = prompt(40, 7);
    finished(
        &c.generate(&json!({ "prompt_ids": p, "max_tokens": 5 })),
        p.len(),
        5,
    );
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
