//! Fuzz-style: valid frames with random bit flips, truncations, splices and
//! pure noise never panic the decoder, and a damaged frame is never taken
//! for a valid one.

mod transport_wire_support;

use std::io::Cursor;

use kvsan_engine::transport::wire::{WireError, WireLimits, WireMessage, encode, read_frame};
use kvsan_engine::transport::{ToDecode, ToPrefill};
use rand::{RngExt, SeedableRng};
use rand_chacha::ChaCha8Rng;
use transport_wire_support as support;

fn limits() -> WireLimits {
    WireLimits {
        max_frame: 1 << 20,
        kv_dim: Some(support::KV_DIM),
    }
}

/// Reads every frame from `bytes` until the end or a framing error; a
/// per-frame error is skipped as the link does. Returns the messages read.
fn drain<M: WireMessage>(bytes: &[u8]) -> Vec<M> {
    let mut r = Cursor::new(bytes);
    let mut out = Vec::new();
    loop {
        match read_frame::<M, _>(&mut r, &limits()) {
            Ok(Some(m)) => out.push(m),
            Ok(None) => return out,
            Err(e) if kvsan_engine::transport::wire::frame_fault_keeps_stream(&e) => {
                assert!(!e.to_string().is_empty());
            }
            Err(e) => {
                assert!(!e.to_string().is_empty());
                return out;
            }
        }
    }
}

fn frames() -> Vec<(Vec<u8>, bool)> {
    let mut v: Vec<(Vec<u8>, bool)> = support::every_to_decode()
        .iter()
        .map(|m| (encode(m).unwrap(), true))
        .collect();
    v.extend(
        support::every_to_prefill()
            .iter()
            .map(|m| (encode(m).unwrap(), false)),
    );
    v
}

fn decode_any(bytes: &[u8], to_decode: bool) -> Result<Option<()>, WireError> {
    let lim = limits();
    let mut r = Cursor::new(bytes);
    if to_decode {
        read_frame::<ToDecode, _>(&mut r, &lim).map(|m| m.map(|_| ()))
    } else {
        read_frame::<ToPrefill, _>(&mut r, &lim).map(|m| m.map(|_| ()))
    }
}

#[test]
fn every_single_bit_flip_of_a_valid_frame_is_detected() {
    for (frame, to_decode) in frames() {
        for byte in 0..frame.len() {
            for bit in 0..8 {
                let mut f = frame.clone();
                f[byte] ^= 1 << bit;
                let r = decode_any(&f, to_decode);
                assert!(
                    r.is_err(),
                    "a flip of bit {bit} of byte {byte} of a {}-byte frame went unnoticed",
                    f.len()
                );
            }
        }
    }
}

#[test]
fn every_truncation_of_a_valid_frame_is_an_error() {
    for (frame, to_decode) in frames() {
        for cut in 1..frame.len() {
            let e = decode_any(&frame[..cut], to_decode).unwrap_err();
            assert!(
                matches!(e, WireError::Truncated { .. } | WireError::Io { .. }),
                "cut at {cut} of {}: {e}",
                frame.len()
            );
        }
    }
}

#[test]
fn random_damage_to_a_stream_of_frames_never_panics_or_invents_messages() {
    let mut rng = ChaCha8Rng::seed_from_u64(0x6b76_736e);
    let originals = support::every_to_decode();
    let mut clean = Vec::new();
    for m in &originals {
        clean.extend(encode(m).unwrap());
    }
    for round in 0..3000 {
        let mut s = clean.clone();
        match round % 4 {
            0 => {
                for _ in 0..rng.random_range(1..6) {
                    let i = rng.random_range(0..s.len());
                    s[i] ^= rng.random_range(1..=255u8);
                }
            }
            1 => s.truncate(rng.random_range(0..s.len())),
            2 => {
                let at = rng.random_range(0..s.len());
                let n = rng.random_range(1..64);
                let junk: Vec<u8> = (0..n).map(|_| rng.random()).collect();
                s.splice(at..at, junk);
            }
            _ => {
                let a = rng.random_range(0..s.len());
                let b = rng.random_range(a..s.len());
                s.drain(a..b);
            }
        }
        // Whatever is read must be one of the messages sent: damage is
        // detected, never decoded into something else.
        for m in drain::<ToDecode>(&s) {
            assert!(originals.contains(&m), "round {round}: invented {m:?}");
        }
    }
}

#[test]
fn pure_noise_is_refused_without_panicking() {
    let mut rng = ChaCha8Rng::seed_from_u64(7);
    for _ in 0..2000 {
        let n = rng.random_range(0..200);
        let mut s: Vec<u8> = (0..n).map(|_| rng.random()).collect();
        if rng.random::<bool>() && s.len() >= 4 {
            s[..4].copy_from_slice(b"KVSN");
        }
        assert!(drain::<ToDecode>(&s).is_empty());
        assert!(drain::<ToPrefill>(&s).is_empty());
    }
}
