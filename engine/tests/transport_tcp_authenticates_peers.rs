//! With a peer key, a TCP link comes up only between nodes that hold the
//! same key, and a frame altered or replayed on the wire closes the link
//! with the reason; the listener goes on taking the next peer.

mod peer_link_relay;
mod transport_wire_support;

use std::net::{SocketAddr, TcpStream};
use std::thread;
use std::time::Duration;

use crossbeam_channel::Receiver;
use kvsan_engine::EngineError;
use kvsan_engine::transport::peer_auth::{PeerAuthError, PeerKey};
use kvsan_engine::transport::tcp::{self, TcpOptions};
use kvsan_engine::transport::{Inbound, Link};
use peer_link_relay::{Meddle, relay};
use transport_wire_support as support;

/// Upper bound on any wait, so a broken link fails the test instead of hanging it.
const BOUND: Duration = Duration::from_secs(10);

fn keyed(byte: u8) -> TcpOptions {
    TcpOptions {
        auth: Some(PeerKey::from_bytes(&[byte; 32]).unwrap()),
        ..TcpOptions::default()
    }
}

fn next<M>(inbox: &Receiver<Inbound<M>>) -> Inbound<M> {
    inbox
        .recv_timeout(BOUND)
        .expect("a message within the bound")
}

/// Connects a prefill side with `opts` to `addr` in a thread.
fn prefill_to(
    addr: SocketAddr,
    opts: TcpOptions,
) -> thread::JoinHandle<Result<tcp::PrefillEnd, EngineError>> {
    thread::spawn(move || tcp::connect_prefill(addr, BOUND, &opts))
}

#[test]
fn every_message_kind_and_a_multi_mib_transfer_cross_with_the_same_key() {
    let listener = tcp::listen("127.0.0.1:0").unwrap();
    let prefill = prefill_to(listener.local_addr(), keyed(1));
    let (to_prefill, decode_inbox) = listener.accept_decode(Some(BOUND), &keyed(1)).unwrap();
    let (to_decode, prefill_inbox) = prefill.join().unwrap().unwrap();
    let big = support::kv(77, 0, 700, 4, support::KV_DIM);
    for m in support::every_to_decode().into_iter().chain([big.clone()]) {
        to_decode.send(m).unwrap();
    }
    for m in support::every_to_prefill() {
        to_prefill.send(m).unwrap();
    }
    for m in support::every_to_decode().into_iter().chain([big]) {
        assert_eq!(next(&decode_inbox), Inbound::Message(m));
    }
    for m in support::every_to_prefill() {
        assert_eq!(next(&prefill_inbox), Inbound::Message(m));
    }
}

fn refusal(result: Result<impl std::fmt::Debug, EngineError>) -> PeerAuthError {
    match result {
        Err(EngineError::PeerAuth(e)) => e,
        other => panic!("expected an authentication refusal, got {other:?}"),
    }
}

#[test]
fn a_wrong_key_is_refused_and_the_listener_takes_the_next_peer() {
    let listener = tcp::listen("127.0.0.1:0").unwrap();
    let impostor = prefill_to(listener.local_addr(), keyed(2));
    let e = refusal(listener.accept_decode(Some(BOUND), &keyed(1)));
    assert!(matches!(e, PeerAuthError::BadProof { .. }), "{e}");
    assert!(e.to_string().contains("prefill@127.0.0.1:"), "{e}");
    assert!(matches!(
        refusal(impostor.join().unwrap()),
        PeerAuthError::BadProof { .. }
    ));

    let real = prefill_to(listener.local_addr(), keyed(1));
    let (_to_prefill, decode_inbox) = listener.accept_decode(Some(BOUND), &keyed(1)).unwrap();
    let (to_decode, _prefill_inbox) = real.join().unwrap().unwrap();
    to_decode.send(support::hello()).unwrap();
    assert_eq!(next(&decode_inbox), Inbound::Message(support::hello()));
}

#[test]
fn a_peer_without_a_key_is_refused_by_a_node_with_one() {
    let listener = tcp::listen("127.0.0.1:0").unwrap();
    let plain = prefill_to(listener.local_addr(), TcpOptions::default());
    let e = refusal(listener.accept_decode(Some(BOUND), &keyed(1)));
    assert!(matches!(e, PeerAuthError::NotAuthenticating { .. }), "{e}");
    // The plain side connected, then saw its peer go away.
    if let Ok((_link, inbox)) = plain.join().unwrap() {
        assert!(matches!(next(&inbox), Inbound::Disconnected { .. }));
    }
}

#[test]
fn a_peer_that_stalls_the_handshake_is_dropped() {
    let listener = tcp::listen("127.0.0.1:0").unwrap();
    let _silent = TcpStream::connect(listener.local_addr()).unwrap();
    let opts = TcpOptions {
        handshake_deadline: Duration::from_millis(300),
        ..keyed(1)
    };
    let e = refusal(listener.accept_decode(Some(BOUND), &opts));
    assert!(
        e.to_string()
            .contains("did not finish the handshake in time"),
        "{e}"
    );
}

fn meddled_link_closes_with(meddle: Meddle, record: &str) {
    let listener = tcp::listen("127.0.0.1:0").unwrap();
    let via = relay(listener.local_addr().to_string(), vec![meddle]);
    let prefill = prefill_to(via.parse().unwrap(), keyed(1));
    let (_to_prefill, decode_inbox) = listener.accept_decode(Some(BOUND), &keyed(1)).unwrap();
    let _prefill_end = prefill.join().unwrap().unwrap();
    let Inbound::Disconnected { reason } = next(&decode_inbox) else {
        panic!("the meddled link delivered a message");
    };
    assert!(reason.contains("fails authentication"), "{reason}");
    assert!(reason.contains(record), "{reason}");
    assert!(reason.contains("prefill@127.0.0.1:"), "{reason}");
}

#[test]
fn an_altered_frame_closes_the_link_with_the_reason() {
    meddled_link_closes_with(Meddle::Alter, "record 0 refused");
}

#[test]
fn a_replayed_frame_closes_the_link_with_the_reason() {
    meddled_link_closes_with(Meddle::Replay, "record 1 refused");
}
