//! A raw TCP peer sends damaged frames: a frame whose header is sound but
//! whose payload is bad aborts its request on both sides and the link goes
//! on; a frame whose header is bad closes the link.

mod transport_wire_support;

use std::io::Write;
use std::net::TcpStream;
use std::time::Duration;

use crossbeam_channel::{Receiver, RecvTimeoutError};
use kvsan_engine::request::ErrorKind;
use kvsan_engine::transport::tcp::{self, TcpOptions};
use kvsan_engine::transport::wire::{self, HEADER_LEN, WireLimits, encode, read_frame};
use kvsan_engine::transport::{Inbound, ToDecode, ToPrefill};
use kvsan_sanitizer::RequestId;
use transport_wire_support as support;
use xxhash_rust::xxh3::xxh3_64;

const BOUND: Duration = Duration::from_secs(10);

fn next<M>(inbox: &Receiver<Inbound<M>>) -> Inbound<M> {
    inbox
        .recv_timeout(BOUND)
        .expect("a message within the bound")
}

fn expect_disconnected<M: std::fmt::Debug>(inbox: &Receiver<Inbound<M>>) -> String {
    match next(inbox) {
        Inbound::Disconnected { reason } => {
            assert_eq!(
                inbox.recv_timeout(BOUND).map(|_| ()),
                Err(RecvTimeoutError::Disconnected),
                "Disconnected is delivered once, then the inbox closes"
            );
            reason
        }
        other => panic!("expected Disconnected, got {other:?}"),
    }
}

/// A decode-side link whose peer is a raw socket.
fn decode_with_raw_peer(opts: TcpOptions) -> (tcp::DecodeEnd, TcpStream) {
    let listener = tcp::listen("127.0.0.1:0").unwrap();
    let raw = TcpStream::connect(listener.local_addr()).unwrap();
    raw.set_read_timeout(Some(BOUND)).unwrap();
    let end = listener.accept_decode(Some(BOUND), &opts).unwrap();
    (end, raw)
}

/// A prefill-side link whose peer is a raw socket.
fn prefill_with_raw_peer() -> (tcp::PrefillEnd, TcpStream) {
    let listener = tcp::listen("127.0.0.1:0").unwrap();
    let raw = TcpStream::connect(listener.local_addr()).unwrap();
    raw.set_read_timeout(Some(BOUND)).unwrap();
    let end = listener
        .accept_prefill(Some(BOUND), &TcpOptions::default())
        .unwrap();
    (end, raw)
}

fn flip_last_byte(mut frame: Vec<u8>) -> Vec<u8> {
    let n = frame.len();
    frame[n - 1] ^= 0x40;
    frame
}

fn expect_transport_abort(inbound: Inbound<ToDecode>, request: u64, needle: &str) {
    match inbound {
        Inbound::Message(ToDecode::PrefillFailed { request: r, error }) => {
            assert_eq!(r, RequestId(request));
            assert_eq!(error.kind, ErrorKind::Transport);
            assert!(error.message.contains(needle), "{}", error.message);
            assert!(
                error.message.contains("prefill@127.0.0.1"),
                "names the peer: {}",
                error.message
            );
        }
        other => panic!("expected PrefillFailed for request {request}, got {other:?}"),
    }
}

#[test]
fn a_kv_frame_with_a_bad_checksum_aborts_its_request_and_later_frames_arrive() {
    let ((_to_prefill, inbox), mut raw) = decode_with_raw_peer(TcpOptions::default());
    raw.write_all(&encode(&support::hello()).unwrap()).unwrap();
    raw.write_all(&flip_last_byte(
        encode(&support::kv(42, 0, 20, 4, support::KV_DIM)).unwrap(),
    ))
    .unwrap();
    raw.write_all(&encode(&support::done(43)).unwrap()).unwrap();

    assert_eq!(next(&inbox), Inbound::Message(support::hello()));
    expect_transport_abort(next(&inbox), 42, "checksum mismatch");
    assert_eq!(next(&inbox), Inbound::Message(support::done(43)));

    // The peer is told to stop working on the request.
    let notice: ToPrefill = read_frame(&mut raw, &WireLimits::default())
        .unwrap()
        .unwrap();
    assert_eq!(
        notice,
        ToPrefill::Cancel {
            request: RequestId(42)
        }
    );
}

#[test]
fn a_kv_frame_that_does_not_fit_its_manifest_aborts_its_request_and_the_link_goes_on() {
    let ((_to_prefill, inbox), mut raw) = decode_with_raw_peer(TcpOptions::default());
    raw.write_all(&encode(&support::hello()).unwrap()).unwrap();
    // Bytes sized for kv_dim 4 while the hello announced 8: sound checksum,
    // wrong length.
    raw.write_all(&encode(&support::kv(50, 0, 20, 4, 4)).unwrap())
        .unwrap();
    raw.write_all(&encode(&support::kv(51, 0, 20, 4, support::KV_DIM)).unwrap())
        .unwrap();
    assert_eq!(next(&inbox), Inbound::Message(support::hello()));
    expect_transport_abort(next(&inbox), 50, "malformed payload");
    assert_eq!(
        next(&inbox),
        Inbound::Message(support::kv(51, 0, 20, 4, support::KV_DIM))
    );
}

#[test]
fn a_damaged_prefill_order_cancels_it_on_prefill_and_fails_it_on_decode() {
    let ((_to_decode, inbox), mut raw) = prefill_with_raw_peer();
    raw.write_all(&flip_last_byte(
        encode(&support::prefill_order(60, 30)).unwrap(),
    ))
    .unwrap();
    raw.write_all(&encode(&support::prefill_order(61, 30)).unwrap())
        .unwrap();
    assert_eq!(
        next(&inbox),
        Inbound::Message(ToPrefill::Cancel {
            request: RequestId(60)
        })
    );
    assert_eq!(
        next(&inbox),
        Inbound::Message(support::prefill_order(61, 30))
    );
    let notice: ToDecode = read_frame(&mut raw, &WireLimits::default())
        .unwrap()
        .unwrap();
    match notice {
        ToDecode::PrefillFailed { request, error } => {
            assert_eq!(request, RequestId(60));
            assert_eq!(error.kind, ErrorKind::Transport);
            assert!(error.message.contains("checksum"), "{}", error.message);
        }
        other => panic!("expected PrefillFailed, got {other:?}"),
    }
}

#[test]
fn a_frame_of_the_wrong_direction_aborts_its_request() {
    let ((_to_prefill, inbox), mut raw) = decode_with_raw_peer(TcpOptions::default());
    raw.write_all(
        &encode(&ToPrefill::Cancel {
            request: RequestId(70),
        })
        .unwrap(),
    )
    .unwrap();
    raw.write_all(&encode(&support::done(71)).unwrap()).unwrap();
    expect_transport_abort(next(&inbox), 70, "not accepted");
    assert_eq!(next(&inbox), Inbound::Message(support::done(71)));
}

#[test]
fn bad_magic_disconnects() {
    let ((_to_prefill, inbox), mut raw) = decode_with_raw_peer(TcpOptions::default());
    raw.write_all(&encode(&support::hello()).unwrap()).unwrap();
    raw.write_all(b"GET / HTTP/1.1\r\nHost: x\r\n\r\n\r\n\r\n")
        .unwrap();
    assert_eq!(next(&inbox), Inbound::Message(support::hello()));
    let reason = expect_disconnected(&inbox);
    assert!(reason.contains("bad magic"), "{reason}");
}

#[test]
fn an_oversize_frame_disconnects_naming_the_limit() {
    let opts = TcpOptions {
        limits: WireLimits {
            max_frame: 1024,
            kv_dim: None,
        },
        ..TcpOptions::default()
    };
    let ((_to_prefill, inbox), mut raw) = decode_with_raw_peer(opts);
    raw.write_all(&encode(&support::hello()).unwrap()).unwrap();
    raw.write_all(&encode(&support::kv(80, 0, 64, 4, support::KV_DIM)).unwrap())
        .unwrap();
    assert_eq!(next(&inbox), Inbound::Message(support::hello()));
    let reason = expect_disconnected(&inbox);
    assert!(reason.contains("frame limit of 1024 bytes"), "{reason}");
}

#[test]
fn a_peer_of_another_protocol_version_is_disconnected_naming_the_versions() {
    let ((_to_prefill, inbox), mut raw) = decode_with_raw_peer(TcpOptions::default());
    let mut f = encode(&support::hello()).unwrap();
    // Version 2: a build from before prefill completions carried the time
    // the request waited in prefill's queue.
    f[4..6].copy_from_slice(&2u16.to_le_bytes());
    let h = xxh3_64(&f[..28]) as u32;
    f[28..32].copy_from_slice(&h.to_le_bytes());
    raw.write_all(&f).unwrap();
    let reason = expect_disconnected(&inbox);
    assert!(
        reason.contains("version 2") && reason.contains("[3]"),
        "{reason}"
    );
}

#[test]
fn a_damaged_hello_disconnects_because_the_link_cannot_be_used_without_it() {
    let ((_to_prefill, inbox), mut raw) = decode_with_raw_peer(TcpOptions::default());
    raw.write_all(&flip_last_byte(encode(&support::hello()).unwrap()))
        .unwrap();
    let reason = expect_disconnected(&inbox);
    assert!(reason.contains("hello"), "{reason}");
}

#[test]
fn a_damaged_header_disconnects() {
    let ((_to_prefill, inbox), mut raw) = decode_with_raw_peer(TcpOptions::default());
    let mut f = encode(&support::done(90)).unwrap();
    f[HEADER_LEN - 10] ^= 1; // inside the payload checksum field: the header's own sum catches it
    raw.write_all(&f).unwrap();
    let reason = expect_disconnected(&inbox);
    assert!(reason.contains("corrupt header"), "{reason}");
    assert_eq!(wire::HEADER_LEN, 32);
}
