//! Each way a frame can be wrong is refused with an error that names the
//! input and the limit, and tells whether the stream is still in step.

mod transport_wire_support;

use std::io::Cursor;

use kvsan_engine::transport::wire::{
    self, FLAG_BULK, FLAG_REQUEST, HEADER_LEN, WireError, WireLimits, WireMessage, encode,
    frame_fault_keeps_stream, read_frame,
};
use kvsan_engine::transport::{KvPayload, ToDecode, ToPrefill};
use kvsan_sanitizer::RequestId;
use transport_wire_support as support;
use xxhash_rust::xxh3::xxh3_64;

fn limits() -> WireLimits {
    WireLimits {
        kv_dim: Some(support::KV_DIM),
        ..WireLimits::default()
    }
}

fn read<M: WireMessage>(bytes: &[u8], limits: &WireLimits) -> Result<Option<M>, WireError> {
    read_frame(&mut Cursor::new(bytes), limits)
}

/// Rewrites the header's own checksum after a deliberate header edit.
fn reseal_header(frame: &mut [u8]) {
    let h = xxh3_64(&frame[..28]) as u32;
    frame[28..32].copy_from_slice(&h.to_le_bytes());
}

/// Rewrites the payload checksum (and the header's) after a payload edit:
/// the frame is then well-formed on the outside, wrong on the inside.
fn reseal_payload(frame: &mut [u8]) {
    let sum = xxh3_64(&frame[HEADER_LEN..]);
    frame[20..28].copy_from_slice(&sum.to_le_bytes());
    reseal_header(frame);
}

/// A frame with `fields` as its payload, built by hand.
fn raw_frame(msg_type: u8, flags: u8, request: u64, payload: &[u8]) -> Vec<u8> {
    let mut f = vec![0u8; HEADER_LEN];
    f[0..4].copy_from_slice(b"KVSN");
    f[4..6].copy_from_slice(&wire::VERSION.to_le_bytes());
    f[6] = msg_type;
    f[7] = flags;
    f[8..12].copy_from_slice(&(payload.len() as u32).to_le_bytes());
    f[12..20].copy_from_slice(&request.to_le_bytes());
    f.extend_from_slice(payload);
    reseal_payload(&mut f);
    f
}

#[test]
fn bad_magic_names_the_bytes_found_and_breaks_the_stream() {
    let mut f = encode(&support::done(1)).unwrap();
    f[0..4].copy_from_slice(b"HTTP");
    let e = read::<ToDecode>(&f, &limits()).unwrap_err();
    assert!(
        matches!(e, WireError::BadMagic { found } if &found == b"HTTP"),
        "{e}"
    );
    assert!(e.to_string().contains("KVSN"), "{e}");
    assert!(!frame_fault_keeps_stream(&e));
}

#[test]
fn an_unsupported_version_names_the_supported_ones() {
    let mut f = encode(&support::done(1)).unwrap();
    f[4..6].copy_from_slice(&7u16.to_le_bytes());
    reseal_header(&mut f);
    let e = read::<ToDecode>(&f, &limits()).unwrap_err();
    assert!(
        matches!(e, WireError::UnsupportedVersion { version: 7, .. }),
        "{e}"
    );
    assert!(
        e.to_string().contains("version 7") && e.to_string().contains("[3]"),
        "{e}"
    );
    assert!(!frame_fault_keeps_stream(&e));
}

#[test]
fn a_damaged_header_is_caught_by_its_own_checksum() {
    let mut f = encode(&support::done(1)).unwrap();
    f[9] ^= 0x10; // the length: framing would be lost without the header check
    let e = read::<ToDecode>(&f, &limits()).unwrap_err();
    assert!(matches!(e, WireError::BadHeader { .. }), "{e}");
    assert!(e.to_string().contains("header checksum"), "{e}");
    assert!(!frame_fault_keeps_stream(&e));
}

#[test]
fn undefined_flag_bits_are_refused() {
    let mut f = encode(&support::done(1)).unwrap();
    f[7] |= 0x80;
    reseal_header(&mut f);
    let e = read::<ToDecode>(&f, &limits()).unwrap_err();
    assert!(matches!(e, WireError::BadHeader { .. }), "{e}");
    assert!(e.to_string().contains("0x81"), "{e}");
}

#[test]
fn an_oversize_frame_names_its_length_and_the_limit_before_reading_it() {
    let f = encode(&support::kv(3, 0, 64, 4, support::KV_DIM)).unwrap();
    let small = WireLimits {
        max_frame: 1000,
        ..limits()
    };
    // Only the header is given: the limit is checked before the payload.
    let e = read::<ToDecode>(&f[..HEADER_LEN], &small).unwrap_err();
    let len = (f.len() - HEADER_LEN) as u64;
    assert!(
        matches!(e, WireError::FrameTooLarge { len: l, limit: 1000, msg_type: 17 } if l == len),
        "{e}"
    );
    assert!(
        e.to_string().contains(&len.to_string()) && e.to_string().contains("1000"),
        "{e}"
    );
    assert!(!frame_fault_keeps_stream(&e));
}

#[test]
fn a_stream_ending_mid_header_or_mid_payload_is_truncated() {
    let f = encode(&support::kv(3, 0, 20, 4, support::KV_DIM)).unwrap();
    let e = read::<ToDecode>(&f[..10], &limits()).unwrap_err();
    assert!(
        matches!(
            e,
            WireError::Truncated {
                part: "header",
                got: 10,
                needed: 32
            }
        ),
        "{e}"
    );
    let cut = HEADER_LEN + 100;
    let e = read::<ToDecode>(&f[..cut], &limits()).unwrap_err();
    let needed = (f.len() - HEADER_LEN) as u64;
    assert!(
        matches!(e, WireError::Truncated { part: "payload", got: 100, needed: n } if n == needed),
        "{e}"
    );
    assert!(!frame_fault_keeps_stream(&e));
}

#[test]
fn a_payload_checksum_mismatch_names_both_sums_and_the_request_and_keeps_the_stream() {
    let mut stream = encode(&support::kv(42, 0, 20, 4, support::KV_DIM)).unwrap();
    let n = stream.len();
    stream[n - 5] ^= 1; // one bit of the KV bytes
    stream.extend(encode(&support::done(43)).unwrap());
    let mut r = Cursor::new(&stream);
    let e = read_frame::<ToDecode, _>(&mut r, &limits()).unwrap_err();
    match &e {
        WireError::ChecksumMismatch {
            msg_type,
            request,
            expected,
            actual,
        } => {
            assert_eq!(*msg_type, wire::TYPE_KV);
            assert_eq!(*request, Some(RequestId(42)));
            assert_ne!(expected, actual);
        }
        other => panic!("expected a checksum mismatch, got {other}"),
    }
    assert!(e.to_string().contains("request 42"), "{e}");
    assert!(frame_fault_keeps_stream(&e));
    // The damaged frame was consumed whole: the next one reads.
    let next: ToDecode = read_frame(&mut r, &limits()).unwrap().unwrap();
    assert_eq!(next, support::done(43));
}

#[test]
fn a_message_type_of_the_other_direction_is_unknown_here() {
    let f = encode(&ToPrefill::Cancel {
        request: RequestId(8),
    })
    .unwrap();
    let e = read::<ToDecode>(&f, &limits()).unwrap_err();
    assert!(
        matches!(
            e,
            WireError::UnknownMessageType {
                msg_type: 2,
                request: Some(RequestId(8)),
                ..
            }
        ),
        "{e}"
    );
    assert!(
        e.to_string().contains("16 hello"),
        "lists what is accepted: {e}"
    );
    assert!(frame_fault_keeps_stream(&e));
    let f = raw_frame(200, 0, 0, &[]);
    let e = read::<ToPrefill>(&f, &limits()).unwrap_err();
    assert!(
        matches!(
            e,
            WireError::UnknownMessageType {
                msg_type: 200,
                request: None,
                ..
            }
        ),
        "{e}"
    );
}

fn malformed_field(e: &WireError) -> &'static str {
    match e {
        WireError::Malformed { field, .. } => field,
        other => panic!("expected a malformed payload, got {other}"),
    }
}

#[test]
fn a_kv_frame_whose_bytes_do_not_fit_its_manifest_is_malformed() {
    let msg = support::kv(5, 0, 20, 4, support::KV_DIM);
    let f = encode(&msg).unwrap();
    // The receiver believes kv_dim is 16: the bytes are half what it needs.
    let wrong = WireLimits {
        kv_dim: Some(16),
        ..limits()
    };
    let e = read::<ToDecode>(&f, &wrong).unwrap_err();
    assert_eq!(malformed_field(&e), "bulk");
    let ToDecode::Kv(t) = &msg else {
        unreachable!()
    };
    let KvPayload::Bytes(b) = &t.payload else {
        unreachable!()
    };
    assert!(
        e.to_string().contains(&b.len().to_string())
            && e.to_string().contains(&(b.len() * 2).to_string()),
        "names the length and the need: {e}"
    );
    assert!(frame_fault_keeps_stream(&e));
    // Bytes before the hello: kv_dim unknown.
    let e = read::<ToDecode>(&f, &WireLimits::default()).unwrap_err();
    assert_eq!(malformed_field(&e), "bulk");
    assert!(e.to_string().contains("hello"), "{e}");
}

#[test]
fn truncated_fields_name_the_field() {
    // A prefill-done frame with only 5 of its 24 bytes.
    let f = raw_frame(wire::TYPE_PREFILL_DONE, FLAG_REQUEST, 9, &[9, 0, 0, 0, 0]);
    let e = read::<ToDecode>(&f, &limits()).unwrap_err();
    assert_eq!(malformed_field(&e), "request");
    assert!(e.to_string().contains("needs 8 bytes"), "{e}");
}

#[test]
fn a_hostile_count_is_refused_before_allocation() {
    // A prefill order claiming 4 billion destination pages in a few bytes.
    let mut p = Vec::new();
    p.extend_from_slice(&1u64.to_le_bytes()); // request
    p.extend_from_slice(&1u32.to_le_bytes()); // tenant
    p.extend_from_slice(&0f32.to_bits().to_le_bytes());
    p.extend_from_slice(&0u64.to_le_bytes());
    p.extend_from_slice(&1f32.to_bits().to_le_bytes());
    p.extend_from_slice(&0u64.to_le_bytes());
    p.extend_from_slice(&2u32.to_le_bytes()); // dst pool
    p.extend_from_slice(&u32::MAX.to_le_bytes()); // dst pages count
    let f = raw_frame(wire::TYPE_PREFILL, FLAG_REQUEST, 1, &p);
    let e = read::<ToPrefill>(&f, &limits()).unwrap_err();
    assert_eq!(malformed_field(&e), "dst_pages");
    assert!(e.to_string().contains("4294967295 items"), "{e}");
}

#[test]
fn trailing_bytes_after_the_last_field_are_refused() {
    let mut payload = Vec::new();
    payload.extend_from_slice(&9u64.to_le_bytes());
    payload.extend_from_slice(&[0xAA, 0xBB]);
    let f = raw_frame(wire::TYPE_CANCEL, FLAG_REQUEST, 9, &payload);
    let e = read::<ToPrefill>(&f, &limits()).unwrap_err();
    assert_eq!(malformed_field(&e), "end of fields");
    assert!(e.to_string().contains("2 bytes follow"), "{e}");
}

#[test]
fn a_header_request_that_disagrees_with_the_payload_is_refused() {
    let f = raw_frame(wire::TYPE_CANCEL, FLAG_REQUEST, 10, &11u64.to_le_bytes());
    let e = read::<ToPrefill>(&f, &limits()).unwrap_err();
    assert_eq!(malformed_field(&e), "request");
    let f = raw_frame(wire::TYPE_CANCEL, 0, 0, &11u64.to_le_bytes());
    let e = read::<ToPrefill>(&f, &limits()).unwrap_err();
    assert_eq!(
        malformed_field(&e),
        "request",
        "a request message must name it in the header"
    );
}

#[test]
fn an_unknown_error_kind_or_invalid_utf8_is_named_without_echoing_the_text() {
    let mut p = Vec::new();
    p.extend_from_slice(&4u64.to_le_bytes());
    p.extend_from_slice(&6u32.to_le_bytes());
    p.extend_from_slice(b"bogus!"); // error kind
    let f = raw_frame(wire::TYPE_PREFILL_FAILED, FLAG_REQUEST, 4, &p);
    let e = read::<ToDecode>(&f, &limits()).unwrap_err();
    assert_eq!(malformed_field(&e), "error.kind");
    assert!(
        e.to_string().contains("\"bogus!\" is not an error kind"),
        "{e}"
    );

    let mut p = Vec::new();
    p.extend_from_slice(&4u64.to_le_bytes());
    p.extend_from_slice(&9u32.to_le_bytes());
    p.extend_from_slice(b"transport");
    p.extend_from_slice(&3u32.to_le_bytes());
    p.extend_from_slice(&[b's', 0xFF, b'x']);
    p.extend_from_slice(&[0, 0]);
    let f = raw_frame(wire::TYPE_PREFILL_FAILED, FLAG_REQUEST, 4, &p);
    let e = read::<ToDecode>(&f, &limits()).unwrap_err();
    assert_eq!(malformed_field(&e), "error.message");
    assert!(e.to_string().contains("not UTF-8"), "{e}");
}

#[test]
fn a_bulk_section_on_a_message_without_one_is_refused() {
    let mut p = Vec::new();
    p.extend_from_slice(&12u32.to_le_bytes());
    p.extend_from_slice(&4u64.to_le_bytes());
    p.extend_from_slice(&5u32.to_le_bytes());
    p.extend_from_slice(b"extra");
    let f = raw_frame(wire::TYPE_PREFILL_DONE, FLAG_REQUEST | FLAG_BULK, 4, &p);
    let e = read::<ToDecode>(&f, &limits()).unwrap_err();
    assert_eq!(malformed_field(&e), "bulk");
    // A bulk split that points past the payload.
    let mut p = Vec::new();
    p.extend_from_slice(&1000u32.to_le_bytes());
    p.extend_from_slice(&4u64.to_le_bytes());
    let f = raw_frame(wire::TYPE_KV, FLAG_REQUEST | FLAG_BULK, 4, &p);
    let e = read::<ToDecode>(&f, &limits()).unwrap_err();
    assert_eq!(malformed_field(&e), "bulk split");
    assert!(e.to_string().contains("1000"), "{e}");
}

#[test]
fn a_heartbeat_with_a_payload_is_malformed() {
    let f = raw_frame(wire::TYPE_HEARTBEAT, 0, 0, &[1, 2, 3]);
    let e = read::<ToDecode>(&f, &limits()).unwrap_err();
    assert_eq!(malformed_field(&e), "payload");
    assert!(frame_fault_keeps_stream(&e));
}
