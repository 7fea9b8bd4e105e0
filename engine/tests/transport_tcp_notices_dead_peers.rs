//! A peer that closes, hangs, or whose process is killed mid-frame is
//! reported as Disconnected within a bounded time, once.

mod transport_wire_support;

use std::io::{BufRead, BufReader, Write};
use std::net::TcpStream;
use std::process::{Command, Stdio};
use std::time::Duration;

use crossbeam_channel::{Receiver, RecvTimeoutError};
use kvsan_engine::transport::tcp::{self, TcpOptions};
use kvsan_engine::transport::wire::encode;
use kvsan_engine::transport::{Inbound, Link, ToDecode};
use transport_wire_support as support;

/// Generous bound on "noticed in bounded time" (the default peer timeout
/// is 3 s), so that a broken link fails the test instead of hanging it.
const BOUND: Duration = Duration::from_secs(10);
const CHILD_ENV: &str = "KVSAN_TCP_TEST_PEER_ADDR";
const CHILD_READY: &str = "kvsan-test-peer: half a frame written";

fn disconnected_within_bound(inbox: &Receiver<Inbound<ToDecode>>) -> String {
    match inbox.recv_timeout(BOUND) {
        Ok(Inbound::Disconnected { reason }) => {
            assert_eq!(
                inbox.recv_timeout(BOUND).map(|_| ()),
                Err(RecvTimeoutError::Disconnected),
                "Disconnected is delivered once"
            );
            reason
        }
        Ok(Inbound::Message(m)) => panic!("unexpected message {m:?}"),
        Err(e) => panic!("no Disconnected within {BOUND:?}: {e}"),
    }
}

#[test]
fn a_peer_that_closes_is_noticed_at_once() {
    let listener = tcp::listen("127.0.0.1:0").unwrap();
    let raw = TcpStream::connect(listener.local_addr()).unwrap();
    let (_link, inbox) = listener
        .accept_decode(Some(BOUND), &TcpOptions::default())
        .unwrap();
    drop(raw);
    let reason = disconnected_within_bound(&inbox);
    assert!(
        reason.contains("closed the connection") || reason.contains("reset"),
        "{reason}"
    );
}

#[test]
fn a_peer_that_stays_connected_but_silent_is_presumed_dead_after_the_timeout() {
    let opts = TcpOptions {
        peer_timeout: Duration::from_millis(500),
        ..TcpOptions::default()
    };
    let listener = tcp::listen("127.0.0.1:0").unwrap();
    // Connected, never writes, never closes: a hung process.
    let _raw = TcpStream::connect(listener.local_addr()).unwrap();
    let (link, inbox) = listener.accept_decode(Some(BOUND), &opts).unwrap();
    let reason = disconnected_within_bound(&inbox);
    assert!(
        reason.contains("presumed dead") && reason.contains("500ms"),
        "{reason}"
    );
    let err = link
        .send(support::every_to_prefill()[1].clone())
        .unwrap_err();
    assert!(
        err.reason.contains("presumed dead"),
        "sends fail with the reason: {err}"
    );
}

/// Not a test of its own: the peer process that
/// `a_peer_process_killed_mid_frame_is_noticed` starts and kills.
#[test]
#[ignore = "the peer process of a_peer_process_killed_mid_frame_is_noticed; run by that test"]
fn child_peer_writes_half_a_frame_then_hangs() {
    let addr = std::env::var(CHILD_ENV).expect("run by a_peer_process_killed_mid_frame_is_noticed");
    let mut s = TcpStream::connect(addr).unwrap();
    s.write_all(&encode(&support::hello()).unwrap()).unwrap();
    let kv = encode(&support::kv(5, 0, 200, 4, support::KV_DIM)).unwrap();
    s.write_all(&kv[..kv.len() / 2]).unwrap();
    s.flush().unwrap();
    println!("{CHILD_READY}");
    std::io::stdout().flush().unwrap();
    std::thread::sleep(Duration::from_secs(120));
}

#[test]
fn a_peer_process_killed_mid_frame_is_noticed() {
    let listener = tcp::listen("127.0.0.1:0").unwrap();
    let mut child = Command::new(std::env::current_exe().unwrap())
        .args([
            "--exact",
            "child_peer_writes_half_a_frame_then_hangs",
            "--ignored",
            "--nocapture",
            "--test-threads=1",
        ])
        .env(CHILD_ENV, listener.local_addr().to_string())
        .stdout(Stdio::piped())
        .stderr(Stdio::null())
        .spawn()
        .unwrap();
    let accepted = listener.accept_decode(Some(BOUND), &TcpOptions::default());
    let (_link, inbox) = match accepted {
        Ok(end) => end,
        Err(e) => {
            let _ = child.kill();
            panic!("the peer process did not connect: {e}");
        }
    };
    assert_eq!(
        inbox.recv_timeout(BOUND).unwrap(),
        Inbound::Message(support::hello())
    );
    // Wait until the child says the half frame is out.
    let mut lines = BufReader::new(child.stdout.take().unwrap()).lines();
    assert!(
        lines.any(|l| l.is_ok_and(|l| l.contains(CHILD_READY))),
        "the peer process did not get to write half a frame"
    );
    child.kill().unwrap();
    child.wait().unwrap();
    let reason = disconnected_within_bound(&inbox);
    assert!(
        reason.contains("truncated") || reason.contains("reset") || reason.contains("closed"),
        "{reason}"
    );
}
