//! The kvsan wire protocol: how [`ToPrefill`] and [`ToDecode`] messages
//! travel over a byte stream (TCP between processes, or any other stream).
//!
//! Every message is one frame: a fixed 32-byte header, then the payload.
//!
//! ```text
//!  header (32 bytes, integers little-endian)
//!  byte 0       4         6      7       8          12                 20                 28          32
//!       +-------+---------+------+-------+----------+------------------+------------------+-----------+
//!       | magic | version | type | flags | len: u32 | request: u64     | payload: u64     | head: u32 |
//!       | KVSN  | u16 = 3 | u8   | u8    | payload  | (flag REQUEST)   | XXH3-64 of the   | low 32 b. |
//!       |       |         |      |       | bytes    | else 0           | len payload bytes| of XXH3-64|
//!       +-------+---------+------+-------+----------+------------------+------------------+ of 0..28  +
//!
//!  flags: bit 0 REQUEST  the header names the message's request (so a frame
//!                        whose payload is damaged can still be attributed)
//!         bit 1 BULK     the payload ends with a bulk section (KV bytes)
//!         bits 2..8      reserved, must be 0
//!
//!  payload (len bytes)
//!       without BULK: +------------------------------+
//!                     | fields                       |
//!                     +------------------------------+
//!       with BULK:    +--------------+---------------+--------------------------------+
//!                     | n: u32       | fields        | bulk: len - 4 - n bytes        |
//!                     |              | (n bytes)     | (KvPayload::Bytes, unchanged)  |
//!                     +--------------+---------------+--------------------------------+
//! ```
//!
//! The header's own checksum makes a damaged header detectable: the length
//! cannot be trusted any more, framing is lost and the stream must be
//! closed. A damaged payload under a sound header is a fault of that frame
//! only: the reader skips exactly `len` bytes and stays in step, so the link
//! can abort the one request the frame belongs to and go on.
//!
//! Message types and their fields (`u64` for `usize`; `str` = `u32` byte
//! count + UTF-8; `[T]` = `u32` count + items; `Option<T>` = `u8` 0/1 + `T`;
//! `PageRef` = page `u32`, generation `u32`; `Owner` = request `u64`,
//! tenant `u32`):
//!
//! ```text
//!  type  direction          message                fields
//!     0  both               heartbeat              (none; never delivered)
//!     1  decode → prefill   ToPrefill::Prefill     owner, temperature f32, top_k u64, top_p f32,
//!                                                  seed u64, dst_pool u32, dst_pages [PageRef],
//!                                                  prompt [u32]
//!     2  decode → prefill   ToPrefill::Cancel      request u64
//!    16  prefill → decode   ToDecode::Hello        pool_tokens, page_slots, n_layers, kv_dim,
//!                                                  context_length (u64 each)
//!    17  prefill → decode   ToDecode::Kv           manifest: owner, src_pool u32, src_pages [PageRef],
//!                                                  dst_pool u32, dst_pages [PageRef], first_token u32,
//!                                                  tokens u32, layers.start u32, layers.end u32,
//!                                                  checksum u64; digests [u64] (a landing digest per
//!                                                  destination page piece, kv_slices order);
//!                                                  payload kind u8 (0 Bytes, 1 Landed);
//!                                                  Bytes: the KV bytes are the bulk section, exactly
//!                                                  kv_payload_len(manifest, kv_dim) long
//!    18  prefill → decode   ToDecode::PrefillDone  request u64, first_token u32, cached_tokens u32,
//!                                                  queued_us u64
//!    19  prefill → decode   ToDecode::PrefillFailed request u64, kind str (the stable name:
//!                                                  `rejected`, `transport`, …), message str,
//!                                                  rejection Option<(reason str, prompt_tokens u64,
//!                                                  limit u64, node str)>,
//!                                                  violation Option<(id str, kind str)>
//! ```
//!
//! Decoding never panics and never allocates more than the frame limit,
//! whatever the input: every count is checked against the bytes that remain
//! before anything is allocated for it. The KV bytes are read straight into
//! the `Vec` that becomes [`KvPayload::Bytes`](super::KvPayload::Bytes) and written straight from it.

use kvsan_sanitizer::RequestId;

use super::{ToDecode, ToPrefill};

mod fields;
mod frame;
mod messages;

pub use crate::error::WireError;
pub use frame::{
    encode, frame_fault_keeps_stream, frame_fault_subject, frame_head, heartbeat_frame, read_frame,
    read_header, write_frame,
};

/// The four bytes every frame starts with.
pub const MAGIC: [u8; 4] = *b"KVSN";
/// The protocol version this build writes: 3 added `PrefillDone`'s
/// `queued_us` and the landing digests of `Kv`, which a version 2 peer
/// neither sends nor reads.
pub const VERSION: u16 = 3;
/// The protocol versions this build reads.
pub const SUPPORTED_VERSIONS: &[u16] = &[3];
/// Bytes of a frame header.
pub const HEADER_LEN: usize = 32;
/// Default largest payload a reader accepts: 64 MiB.
pub const DEFAULT_MAX_FRAME: usize = 64 << 20;

/// Header flag: the `request` field names the message's request.
pub const FLAG_REQUEST: u8 = 1 << 0;
/// Header flag: the payload ends with a bulk section.
pub const FLAG_BULK: u8 = 1 << 1;
const KNOWN_FLAGS: u8 = FLAG_REQUEST | FLAG_BULK;

/// Message type of a heartbeat frame (link-level, never delivered).
pub const TYPE_HEARTBEAT: u8 = 0;
/// Message type of [`ToPrefill::Prefill`].
pub const TYPE_PREFILL: u8 = 1;
/// Message type of [`ToPrefill::Cancel`].
pub const TYPE_CANCEL: u8 = 2;
/// Message type of [`ToDecode::Hello`].
pub const TYPE_HELLO: u8 = 16;
/// Message type of [`ToDecode::Kv`].
pub const TYPE_KV: u8 = 17;
/// Message type of [`ToDecode::PrefillDone`].
pub const TYPE_PREFILL_DONE: u8 = 18;
/// Message type of [`ToDecode::PrefillFailed`].
pub const TYPE_PREFILL_FAILED: u8 = 19;

/// The name of a message type, for logs (`"unknown"` for others).
#[must_use]
pub fn type_name(msg_type: u8) -> &'static str {
    match msg_type {
        TYPE_HEARTBEAT => "heartbeat",
        TYPE_PREFILL => "prefill",
        TYPE_CANCEL => "cancel",
        TYPE_HELLO => "hello",
        TYPE_KV => "kv",
        TYPE_PREFILL_DONE => "prefill-done",
        TYPE_PREFILL_FAILED => "prefill-failed",
        _ => "unknown",
    }
}

/// What a reader accepts.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct WireLimits {
    /// Largest payload accepted, in bytes (the header not counted).
    pub max_frame: usize,
    /// Values of one slot's K (or V) for one layer, as the sender announced
    /// in [`ToDecode::Hello`]. A KV frame's bulk section must be exactly
    /// [`kv_payload_len`](super::kv_payload_len) bytes for this `kv_dim`; a
    /// KV frame with bytes while it is unknown is malformed.
    pub kv_dim: Option<usize>,
}

impl Default for WireLimits {
    fn default() -> Self {
        WireLimits {
            max_frame: DEFAULT_MAX_FRAME,
            kv_dim: None,
        }
    }
}

/// A frame header, as read from the stream and checked.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct FrameHeader {
    /// The protocol version.
    pub version: u16,
    /// The message type.
    pub msg_type: u8,
    /// The flag bits.
    pub flags: u8,
    /// Payload bytes that follow the header.
    pub len: u32,
    /// The request the frame belongs to ([`FLAG_REQUEST`]).
    pub request: Option<RequestId>,
    /// XXH3-64 of the payload.
    pub checksum: u64,
}

mod sealed {
    pub trait Sealed {}
    impl Sealed for super::ToPrefill {}
    impl Sealed for super::ToDecode {}
}

/// A message that travels in frames: [`ToPrefill`] or [`ToDecode`].
pub trait WireMessage: sealed::Sealed + Sized + Send + 'static {
    /// The direction this message type travels in, for errors.
    const DIRECTION: &'static str;
    /// The message types this direction accepts, for errors.
    const ACCEPTED: &'static str;

    /// This message's type byte.
    fn msg_type(&self) -> u8;

    /// The request this message belongs to, if any.
    fn request(&self) -> Option<RequestId>;

    /// Whether a frame of `msg_type` carries this message type.
    fn accepts(msg_type: u8) -> bool;

    /// The bulk section (KV bytes), if the message has one.
    fn bulk(&self) -> Option<&[u8]>;

    /// Appends the message's fields (everything but the bulk) to `out`.
    fn encode_fields(&self, out: &mut Vec<u8>);

    /// Decodes a message from a frame whose checksum was verified.
    ///
    /// # Errors
    /// [`WireError::Malformed`] naming the field that cannot be decoded.
    fn decode(
        header: &FrameHeader,
        fields: &[u8],
        bulk: Option<Vec<u8>>,
        limits: &WireLimits,
    ) -> Result<Self, WireError>;
}
