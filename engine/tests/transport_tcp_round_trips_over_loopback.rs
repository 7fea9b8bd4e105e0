//! Every message kind crosses a real TCP connection on 127.0.0.1 in order
//! and unchanged, both ways, whichever side listens.

mod transport_wire_support;

use std::thread;
use std::time::Duration;

use crossbeam_channel::{Receiver, RecvTimeoutError};
use kvsan_engine::transport::tcp::{self, DecodeEnd, PrefillEnd, TcpOptions};
use kvsan_engine::transport::wire::WireLimits;
use kvsan_engine::transport::{Inbound, Link, NodeInfo, ToDecode};
use transport_wire_support as support;

/// Upper bound on any wait, so a broken link fails the test instead of hanging it.
const BOUND: Duration = Duration::from_secs(10);

/// A decode node listening, a prefill node connecting.
fn connected(opts: TcpOptions) -> (DecodeEnd, PrefillEnd) {
    let listener = tcp::listen("127.0.0.1:0").unwrap();
    let addr = listener.local_addr();
    let prefill_opts = opts.clone();
    let prefill = thread::spawn(move || tcp::connect_prefill(addr, BOUND, &prefill_opts).unwrap());
    let decode = listener.accept_decode(Some(BOUND), &opts).unwrap();
    (decode, prefill.join().unwrap())
}

fn next<M>(inbox: &Receiver<Inbound<M>>) -> Inbound<M> {
    inbox
        .recv_timeout(BOUND)
        .expect("a message within the bound")
}

#[test]
fn every_message_kind_arrives_in_order_both_ways() {
    let ((to_prefill, decode_inbox), (to_decode, prefill_inbox)) = connected(TcpOptions::default());
    for m in support::every_to_decode() {
        to_decode.send(m).unwrap();
    }
    for m in support::every_to_prefill() {
        to_prefill.send(m).unwrap();
    }
    for m in support::every_to_decode() {
        assert_eq!(next(&decode_inbox), Inbound::Message(m));
    }
    for m in support::every_to_prefill() {
        assert_eq!(next(&prefill_inbox), Inbound::Message(m));
    }
}

#[test]
fn the_prefill_side_may_listen_and_the_decode_side_connect() {
    let opts = TcpOptions::default();
    let listener = tcp::listen("127.0.0.1:0").unwrap();
    let addr = listener.local_addr();
    let decode_opts = opts.clone();
    let decode =
        thread::spawn(move || tcp::connect_decode(addr.to_string(), BOUND, &decode_opts).unwrap());
    let (to_decode, prefill_inbox) = listener.accept_prefill(Some(BOUND), &opts).unwrap();
    let (to_prefill, decode_inbox) = decode.join().unwrap();
    to_decode.send(support::hello()).unwrap();
    to_prefill.send(support::prefill_order(1, 40)).unwrap();
    assert_eq!(next(&decode_inbox), Inbound::Message(support::hello()));
    assert_eq!(
        next(&prefill_inbox),
        Inbound::Message(support::prefill_order(1, 40))
    );
}

#[test]
fn a_multi_mib_kv_transfer_arrives_unchanged() {
    let ((_to_prefill, decode_inbox), (to_decode, _prefill_inbox)) =
        connected(TcpOptions::default());
    // SmolLM2's geometry: 30 layers, kv_dim 192; 700 tokens ≈ 15 MiB.
    let hello = ToDecode::Hello(NodeInfo {
        pool_tokens: 8192,
        page_slots: 16,
        n_layers: 30,
        kv_dim: 192,
        context_length: 8192,
    });
    let big = support::kv(77, 0, 700, 30, 192);
    let small = support::done(77);
    to_decode.send(hello.clone()).unwrap();
    to_decode.send(big.clone()).unwrap();
    to_decode.send(small.clone()).unwrap();
    assert_eq!(next(&decode_inbox), Inbound::Message(hello));
    assert_eq!(next(&decode_inbox), Inbound::Message(big));
    assert_eq!(next(&decode_inbox), Inbound::Message(small));
}

#[test]
fn a_message_over_the_frame_limit_is_refused_at_send_and_the_link_goes_on() {
    let opts = TcpOptions {
        limits: WireLimits {
            max_frame: 4096,
            kv_dim: None,
        },
        ..TcpOptions::default()
    };
    let ((_to_prefill, decode_inbox), (to_decode, _prefill_inbox)) = connected(opts);
    to_decode.send(support::hello()).unwrap();
    let err = to_decode
        .send(support::kv(5, 0, 200, 4, support::KV_DIM))
        .unwrap_err();
    assert!(err.reason.contains("4096"), "names the limit: {err}");
    assert!(to_decode.down_reason().is_none(), "the link is still up");
    to_decode.send(support::done(5)).unwrap();
    assert_eq!(next(&decode_inbox), Inbound::Message(support::hello()));
    assert_eq!(next(&decode_inbox), Inbound::Message(support::done(5)));
}

#[test]
fn an_idle_link_stays_up_on_heartbeats() {
    // Frequent heartbeats, a peer timeout 20× longer: the link must outlive
    // several timeouts with no message sent.
    let opts = TcpOptions {
        heartbeat: Duration::from_millis(50),
        peer_timeout: Duration::from_secs(1),
        ..TcpOptions::default()
    };
    let ((to_prefill, decode_inbox), (to_decode, prefill_inbox)) = connected(opts);
    thread::sleep(Duration::from_millis(3500));
    assert_eq!(
        decode_inbox.try_recv().ok(),
        None,
        "nothing delivered while idle"
    );
    assert_eq!(
        prefill_inbox.try_recv().ok(),
        None,
        "nothing delivered while idle"
    );
    to_decode.send(support::done(1)).unwrap();
    to_prefill
        .send(support::every_to_prefill()[1].clone())
        .unwrap();
    assert_eq!(next(&decode_inbox), Inbound::Message(support::done(1)));
    assert_eq!(
        next(&prefill_inbox),
        Inbound::Message(support::every_to_prefill()[1].clone())
    );
}

#[test]
fn dropping_one_link_disconnects_the_peer_after_delivering_what_was_sent() {
    let ((to_prefill, decode_inbox), (to_decode, prefill_inbox)) = connected(TcpOptions::default());
    to_decode.send(support::hello()).unwrap();
    to_decode.send(support::done(3)).unwrap();
    drop(to_decode);
    assert_eq!(next(&decode_inbox), Inbound::Message(support::hello()));
    assert_eq!(next(&decode_inbox), Inbound::Message(support::done(3)));
    match next(&decode_inbox) {
        Inbound::Disconnected { reason } => assert!(reason.contains("closed"), "{reason}"),
        other => panic!("expected Disconnected, got {other:?}"),
    }
    // Reported once: then the inbox closes.
    assert_eq!(
        decode_inbox.recv_timeout(BOUND),
        Err(RecvTimeoutError::Disconnected)
    );
    // The side that closed learns it too, and its peer's sends fail.
    assert!(matches!(next(&prefill_inbox), Inbound::Disconnected { .. }));
    let err = to_prefill
        .send(support::every_to_prefill()[1].clone())
        .unwrap_err();
    assert!(err.peer.starts_with("prefill@127.0.0.1:"), "{err}");
}
