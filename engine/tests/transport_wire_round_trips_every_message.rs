//! Every prefill/decode message comes out of a frame exactly as it went in.

mod transport_wire_support;

use std::io::Cursor;

use kvsan_engine::transport::wire::{
    self, HEADER_LEN, WireLimits, WireMessage, encode, read_frame, write_frame,
};
use kvsan_engine::transport::{KvPayload, ToDecode, ToPrefill};
use proptest::prelude::*;
use transport_wire_support as support;

fn limits() -> WireLimits {
    WireLimits {
        kv_dim: Some(support::KV_DIM),
        ..WireLimits::default()
    }
}

/// Encodes, decodes, and checks the result: equal to the input (bit-equal
/// through a second encoding, which also covers NaN sampling parameters).
fn round_trip<M: WireMessage + std::fmt::Debug + PartialEq>(msg: &M) -> Result<(), TestCaseError> {
    let bytes = encode(msg).expect("encodes");
    let mut written = Vec::new();
    write_frame(&mut written, msg).expect("writes");
    prop_assert_eq!(&bytes, &written, "encode and write_frame agree");
    let mut r = Cursor::new(&bytes);
    let back: M = read_frame(&mut r, &limits())
        .expect("decodes")
        .expect("a message, not end of stream");
    prop_assert_eq!(
        r.position() as usize,
        bytes.len(),
        "the frame is consumed exactly"
    );
    prop_assert_eq!(encode(&back).expect("re-encodes"), bytes);
    #[allow(clippy::eq_op)]
    if msg == msg {
        prop_assert_eq!(&back, msg);
    }
    Ok(())
}

#[test]
fn every_message_kind_round_trips() {
    for m in support::every_to_decode() {
        round_trip(&m).unwrap();
    }
    for m in support::every_to_prefill() {
        round_trip(&m).unwrap();
    }
}

#[test]
fn a_multi_mib_kv_payload_round_trips_and_its_bytes_are_the_bulk_section() {
    // 700 tokens × 30 layers × K and V × 192 values × 2 bytes ≈ 15 MiB
    // (SmolLM2's geometry), far more than one read returns.
    let msg = support::kv(11, 3, 700, 30, 192);
    let mut lim = limits();
    lim.kv_dim = Some(192);
    let bytes = encode(&msg).unwrap();
    let ToDecode::Kv(t) = &msg else {
        unreachable!()
    };
    let KvPayload::Bytes(kv) = &t.payload else {
        unreachable!()
    };
    assert!(kv.len() > 8 << 20, "{} bytes", kv.len());
    assert_eq!(
        &bytes[bytes.len() - kv.len()..],
        &kv[..],
        "KV bytes travel unchanged at the end"
    );
    let back: ToDecode = read_frame(&mut Cursor::new(&bytes), &lim).unwrap().unwrap();
    assert_eq!(back, msg);
}

#[test]
fn frames_follow_each_other_and_heartbeats_are_skipped() {
    let mut stream = Vec::new();
    stream.extend_from_slice(&wire::heartbeat_frame());
    for m in support::every_to_decode() {
        write_frame(&mut stream, &m).unwrap();
        stream.extend_from_slice(&wire::heartbeat_frame());
    }
    let mut r = Cursor::new(&stream);
    for m in support::every_to_decode() {
        let got: ToDecode = read_frame(&mut r, &limits()).unwrap().unwrap();
        assert_eq!(got, m);
    }
    let end: Option<ToDecode> = read_frame(&mut r, &limits()).unwrap();
    assert_eq!(end, None, "a clean end after the last frame");
}

#[test]
fn an_empty_stream_is_a_clean_end() {
    let end: Option<ToPrefill> = read_frame(&mut Cursor::new(&[]), &limits()).unwrap();
    assert_eq!(end, None);
}

#[test]
fn the_header_is_the_documented_layout() {
    let msg = support::done(0x0102_0304_0506_0708);
    let bytes = encode(&msg).unwrap();
    assert_eq!(&bytes[0..4], b"KVSN");
    assert_eq!(u16::from_le_bytes([bytes[4], bytes[5]]), wire::VERSION);
    assert_eq!(bytes[6], wire::TYPE_PREFILL_DONE);
    assert_eq!(bytes[7], wire::FLAG_REQUEST);
    let len = u32::from_le_bytes(bytes[8..12].try_into().unwrap()) as usize;
    assert_eq!(len, bytes.len() - HEADER_LEN);
    assert_eq!(
        len,
        8 + 4 + 4 + 8,
        "request u64 + first token u32 + cached tokens u32 + queued µs u64"
    );
    assert_eq!(
        u64::from_le_bytes(bytes[bytes.len() - 8..].try_into().unwrap()),
        support::DONE_QUEUED_US,
        "queued µs last"
    );
    assert_eq!(
        u64::from_le_bytes(bytes[12..20].try_into().unwrap()),
        0x0102_0304_0506_0708
    );
    assert_eq!(
        u64::from_le_bytes(bytes[20..28].try_into().unwrap()),
        xxhash_rust::xxh3::xxh3_64(&bytes[HEADER_LEN..])
    );
}

proptest! {
    #![proptest_config(ProptestConfig::with_cases(300))]

    #[test]
    fn any_to_prefill_round_trips(msg in support::to_prefill()) {
        round_trip(&msg)?;
    }

    #[test]
    fn any_to_decode_round_trips(msg in support::to_decode()) {
        round_trip(&msg)?;
    }
}
