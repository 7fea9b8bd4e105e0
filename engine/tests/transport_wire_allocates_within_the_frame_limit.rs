//! Hostile frames cannot make the decoder allocate beyond the frame limit:
//! a length over the limit is refused before reading, and counts inside a
//! payload are checked against the bytes that remain before allocating.
//!
//! A counting global allocator records the largest single allocation and
//! the peak of live bytes while decoding; this binary holds one test so
//! nothing else allocates meanwhile.

mod transport_wire_support;

use std::alloc::{GlobalAlloc, Layout, System};
use std::io::Cursor;
use std::sync::atomic::{AtomicUsize, Ordering};

use kvsan_engine::transport::wire::{
    self, FLAG_BULK, FLAG_REQUEST, HEADER_LEN, WireLimits, WireMessage, read_frame,
};
use kvsan_engine::transport::{ToDecode, ToPrefill};
use rand::{RngExt, SeedableRng};
use rand_chacha::ChaCha8Rng;
use transport_wire_support as support;
use xxhash_rust::xxh3::xxh3_64;

struct Counting;

static LIVE: AtomicUsize = AtomicUsize::new(0);
static PEAK: AtomicUsize = AtomicUsize::new(0);
static LARGEST: AtomicUsize = AtomicUsize::new(0);

// SAFETY: every method forwards to `System` with the caller's arguments,
// which meet `System`'s contract because they meet `GlobalAlloc`'s; the
// counters are plain atomics and never touch the memory.
unsafe impl GlobalAlloc for Counting {
    unsafe fn alloc(&self, layout: Layout) -> *mut u8 {
        let live = LIVE.fetch_add(layout.size(), Ordering::Relaxed) + layout.size();
        PEAK.fetch_max(live, Ordering::Relaxed);
        LARGEST.fetch_max(layout.size(), Ordering::Relaxed);
        // SAFETY: the caller's layout meets `alloc`'s contract.
        unsafe { System.alloc(layout) }
    }
    unsafe fn dealloc(&self, ptr: *mut u8, layout: Layout) {
        LIVE.fetch_sub(layout.size(), Ordering::Relaxed);
        // SAFETY: `ptr` came from `System.alloc` with this layout.
        unsafe { System.dealloc(ptr, layout) }
    }
    unsafe fn realloc(&self, ptr: *mut u8, layout: Layout, new_size: usize) -> *mut u8 {
        let live = LIVE.fetch_add(new_size, Ordering::Relaxed) + new_size;
        PEAK.fetch_max(live, Ordering::Relaxed);
        LARGEST.fetch_max(new_size, Ordering::Relaxed);
        // SAFETY: `ptr` came from `System` with `layout`; the caller meets
        // `realloc`'s contract for `new_size`.
        let p = unsafe { System.realloc(ptr, layout, new_size) };
        LIVE.fetch_sub(layout.size(), Ordering::Relaxed);
        p
    }
}

#[global_allocator]
static ALLOC: Counting = Counting;

const LIMIT: usize = 1 << 20;

/// Decodes every frame of `input` (skipping per-frame faults) and returns
/// (largest single allocation, peak live bytes above the start).
fn measure<M: WireMessage>(input: &[u8]) -> (usize, usize) {
    let limits = WireLimits {
        max_frame: LIMIT,
        kv_dim: Some(support::KV_DIM),
    };
    let base = LIVE.load(Ordering::Relaxed);
    PEAK.store(base, Ordering::Relaxed);
    LARGEST.store(0, Ordering::Relaxed);
    let mut r = Cursor::new(input);
    loop {
        match read_frame::<M, _>(&mut r, &limits) {
            Ok(Some(_)) => {}
            Ok(None) => break,
            Err(e) if wire::frame_fault_keeps_stream(&e) => {}
            Err(_) => break,
        }
    }
    (
        LARGEST.load(Ordering::Relaxed),
        PEAK.load(Ordering::Relaxed).saturating_sub(base),
    )
}

fn header(msg_type: u8, flags: u8, len: u32, request: u64, payload: &[u8]) -> Vec<u8> {
    let mut f = vec![0u8; HEADER_LEN];
    f[0..4].copy_from_slice(b"KVSN");
    f[4..6].copy_from_slice(&wire::VERSION.to_le_bytes());
    f[6] = msg_type;
    f[7] = flags;
    f[8..12].copy_from_slice(&len.to_le_bytes());
    f[12..20].copy_from_slice(&request.to_le_bytes());
    f[20..28].copy_from_slice(&xxh3_64(payload).to_le_bytes());
    let h = xxh3_64(&f[..28]) as u32;
    f[28..32].copy_from_slice(&h.to_le_bytes());
    f.extend_from_slice(payload);
    f
}

#[test]
fn hostile_lengths_and_counts_never_allocate_beyond_the_frame_limit() {
    let mut cases: Vec<(&str, Vec<u8>, bool)> = Vec::new();
    // A length of 4 GiB: refused from the header alone.
    cases.push((
        "4 GiB length",
        header(wire::TYPE_KV, FLAG_BULK, u32::MAX, 1, &[]),
        true,
    ));
    // A length at the limit with 3 bytes behind it.
    cases.push((
        "length at the limit, truncated",
        header(wire::TYPE_PREFILL, 0, LIMIT as u32, 1, &[1, 2, 3]),
        false,
    ));
    // Counts of 4 billion items in small payloads, in every counted field.
    let mut order = Vec::new();
    order.extend_from_slice(&1u64.to_le_bytes());
    order.extend_from_slice(&[0; 4 + 4 + 8 + 4 + 8 + 4]);
    order.extend_from_slice(&u32::MAX.to_le_bytes());
    cases.push((
        "4 billion pages",
        header(
            wire::TYPE_PREFILL,
            FLAG_REQUEST,
            order.len() as u32,
            1,
            &order,
        ),
        false,
    ));
    let mut failed = Vec::new();
    failed.extend_from_slice(&1u64.to_le_bytes());
    failed.extend_from_slice(&u32::MAX.to_le_bytes());
    cases.push((
        "4 GiB message",
        header(
            wire::TYPE_PREFILL_FAILED,
            FLAG_REQUEST,
            failed.len() as u32,
            1,
            &failed,
        ),
        true,
    ));
    let mut split = Vec::new();
    split.extend_from_slice(&u32::MAX.to_le_bytes());
    cases.push((
        "4 GiB bulk split",
        header(wire::TYPE_KV, FLAG_BULK, split.len() as u32, 1, &split),
        true,
    ));

    for (name, input, to_decode) in &cases {
        let (largest, peak) = if *to_decode {
            measure::<ToDecode>(input)
        } else {
            measure::<ToPrefill>(input)
        };
        assert!(
            largest <= LIMIT,
            "{name}: an allocation of {largest} bytes (limit {LIMIT})"
        );
        assert!(
            peak <= 2 * LIMIT,
            "{name}: {peak} bytes live at once (limit {LIMIT})"
        );
    }

    // Noise that starts like a frame.
    let mut rng = ChaCha8Rng::seed_from_u64(99);
    for _ in 0..500 {
        let n = rng.random_range(HEADER_LEN..400);
        let mut s: Vec<u8> = (0..n).map(|_| rng.random()).collect();
        let len: u32 = rng.random();
        let hdr = header(
            rng.random_range(0..20),
            rng.random_range(0..4),
            len,
            1,
            &s[HEADER_LEN..],
        );
        s[..HEADER_LEN].copy_from_slice(&hdr[..HEADER_LEN]);
        let (largest, peak) = measure::<ToDecode>(&s);
        assert!(
            largest <= LIMIT,
            "an allocation of {largest} bytes (limit {LIMIT})"
        );
        assert!(peak <= 2 * LIMIT, "{peak} bytes live at once");
    }
}
