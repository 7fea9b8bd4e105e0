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
//!       | KVSN  | u16 = 1 | u8   | u8    | payload  | (flag REQUEST)   | XXH3-64 of the   | low 32 b. |
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
//!                                                  checksum u64; payload kind u8 (0 Bytes, 1 Landed);
//!                                                  Bytes: the KV bytes are the bulk section, exactly
//!                                                  kv_payload_len(manifest, kv_dim) long
//!    18  prefill → decode   ToDecode::PrefillDone  request u64, first_token u32
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
//! the `Vec` that becomes [`KvPayload::Bytes`] and written straight from it.

use std::io::{self, Read, Write};

use kvsan_sanitizer::{Manifest, Owner, PageRef, PoolId, RequestId, TenantId};
use xxhash_rust::xxh3::{Xxh3, xxh3_64};

use super::{KvPayload, KvTransfer, NodeInfo, PrefillOrder, ToDecode, ToPrefill};
use crate::error::EngineError;
use crate::request::{ErrorKind, Rejection, RequestError};
use crate::sampler::SamplingParams;

/// The four bytes every frame starts with.
pub const MAGIC: [u8; 4] = *b"KVSN";
/// The protocol version this build writes.
pub const VERSION: u16 = 1;
/// The protocol versions this build reads.
pub const SUPPORTED_VERSIONS: &[u16] = &[1];
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
    /// [`EngineError::WireMalformed`] naming the field that cannot be decoded.
    fn decode(
        header: &FrameHeader,
        fields: &[u8],
        bulk: Option<Vec<u8>>,
        limits: &WireLimits,
    ) -> Result<Self, EngineError>;
}

// ---------------------------------------------------------------- writing

/// The header and fields of `msg`'s frame: everything but the bulk section,
/// which the caller writes after it, straight from the message.
///
/// # Errors
/// [`EngineError::WireFrameTooLarge`] when the payload exceeds what the
/// `u32` length field can say.
pub fn frame_head<M: WireMessage>(msg: &M) -> Result<Vec<u8>, EngineError> {
    let bulk = msg.bulk();
    let mut out = vec![0u8; HEADER_LEN];
    if bulk.is_some() {
        out.extend_from_slice(&[0; 4]);
    }
    msg.encode_fields(&mut out);
    let fields_len = out.len() - HEADER_LEN - if bulk.is_some() { 4 } else { 0 };
    let mut flags = 0;
    let mut hasher = Xxh3::new();
    if let Some(b) = bulk {
        flags |= FLAG_BULK;
        // `fields_len` fits: checked with the total below, which is larger.
        let n = u32::try_from(fields_len).unwrap_or(u32::MAX);
        out[HEADER_LEN..HEADER_LEN + 4].copy_from_slice(&n.to_le_bytes());
        hasher.update(&out[HEADER_LEN..]);
        hasher.update(b);
    } else {
        hasher.update(&out[HEADER_LEN..]);
    }
    let len = (out.len() - HEADER_LEN) as u64 + bulk.map_or(0, |b| b.len() as u64);
    let len = u32::try_from(len).map_err(|_| EngineError::WireFrameTooLarge {
        msg_type: msg.msg_type(),
        len,
        limit: u64::from(u32::MAX),
    })?;
    let request = msg.request();
    if request.is_some() {
        flags |= FLAG_REQUEST;
    }
    write_header(
        &mut out[..HEADER_LEN],
        msg.msg_type(),
        flags,
        len,
        request.map_or(0, |r| r.0),
        hasher.digest(),
    );
    Ok(out)
}

/// A heartbeat frame: a header with an empty payload.
#[must_use]
pub fn heartbeat_frame() -> [u8; HEADER_LEN] {
    let mut out = [0u8; HEADER_LEN];
    write_header(&mut out, TYPE_HEARTBEAT, 0, 0, 0, xxh3_64(&[]));
    out
}

fn write_header(out: &mut [u8], msg_type: u8, flags: u8, len: u32, request: u64, checksum: u64) {
    out[0..4].copy_from_slice(&MAGIC);
    out[4..6].copy_from_slice(&VERSION.to_le_bytes());
    out[6] = msg_type;
    out[7] = flags;
    out[8..12].copy_from_slice(&len.to_le_bytes());
    out[12..20].copy_from_slice(&request.to_le_bytes());
    out[20..28].copy_from_slice(&checksum.to_le_bytes());
    let head = header_checksum(&out[..28]);
    out[28..32].copy_from_slice(&head.to_le_bytes());
}

fn header_checksum(first_28: &[u8]) -> u32 {
    // The low 32 bits of the hash: a damaged header is caught with
    // probability 1 - 2^-32, enough to tell framing loss from noise.
    xxh3_64(first_28) as u32
}

/// The whole frame of `msg` in one buffer (copies the KV bytes; a link
/// writes with [`write_frame`] instead).
///
/// # Errors
/// As [`frame_head`].
pub fn encode<M: WireMessage>(msg: &M) -> Result<Vec<u8>, EngineError> {
    let mut out = frame_head(msg)?;
    if let Some(b) = msg.bulk() {
        out.extend_from_slice(b);
    }
    Ok(out)
}

/// Writes `msg`'s frame to `w`: the header and fields, then the KV bytes
/// straight from the message. Does not flush.
///
/// # Errors
/// As [`frame_head`]; [`EngineError::WireIo`] when writing fails.
pub fn write_frame<M: WireMessage, W: Write>(w: &mut W, msg: &M) -> Result<(), EngineError> {
    let head = frame_head(msg)?;
    let io = |source| EngineError::WireIo {
        peer: "peer".into(),
        op: "write",
        source,
    };
    w.write_all(&head).map_err(io)?;
    if let Some(b) = msg.bulk() {
        w.write_all(b).map_err(io)?;
    }
    Ok(())
}

// ---------------------------------------------------------------- reading

/// Reads the next message from `r`, skipping heartbeats.
///
/// Returns `Ok(None)` when the stream ends cleanly between frames.
///
/// # Errors
/// - Framing is lost, the stream must be closed: [`EngineError::WireBadMagic`],
///   [`EngineError::WireUnsupportedVersion`], [`EngineError::WireBadHeader`],
///   [`EngineError::WireFrameTooLarge`], [`EngineError::WireTruncated`],
///   [`EngineError::WireIo`].
/// - The frame was skipped whole and the stream is still in step
///   ([`frame_fault_keeps_stream`] is true): [`EngineError::WireChecksumMismatch`],
///   [`EngineError::WireUnknownMessageType`], [`EngineError::WireMalformed`].
pub fn read_frame<M: WireMessage, R: Read>(
    r: &mut R,
    limits: &WireLimits,
) -> Result<Option<M>, EngineError> {
    loop {
        let Some(header) = read_header(r, limits)? else {
            return Ok(None);
        };
        let (fields, bulk) = read_payload(r, &header)?;
        if header.msg_type == TYPE_HEARTBEAT {
            if header.len != 0 || header.flags != 0 {
                return Err(EngineError::WireMalformed {
                    msg_type: TYPE_HEARTBEAT,
                    request: header.request,
                    field: "payload",
                    what: format!(
                        "a heartbeat carries no payload and no flags, found {} bytes and flags {:#04x}",
                        header.len, header.flags
                    ),
                });
            }
            continue;
        }
        if !M::accepts(header.msg_type) {
            return Err(EngineError::WireUnknownMessageType {
                msg_type: header.msg_type,
                request: header.request,
                direction: M::DIRECTION,
                accepted: M::ACCEPTED,
            });
        }
        let msg = M::decode(&header, &fields, bulk, limits)?;
        if header.request != msg.request() {
            return Err(malformed(
                &header,
                "request",
                format!(
                    "the header names request {:?}, the payload request {:?}",
                    header.request.map(|r| r.0),
                    msg.request().map(|r| r.0)
                ),
            ));
        }
        return Ok(Some(msg));
    }
}

/// Whether a [`read_frame`] error concerns one frame only, which was
/// skipped whole, so the stream is still in step and reading can go on.
/// False for every error that loses framing or the connection.
#[must_use]
pub fn frame_fault_keeps_stream(err: &EngineError) -> bool {
    matches!(
        err,
        EngineError::WireChecksumMismatch { .. }
            | EngineError::WireUnknownMessageType { .. }
            | EngineError::WireMalformed { .. }
    )
}

/// The message type and request a per-frame fault concerns
/// (see [`frame_fault_keeps_stream`]); `None` for other errors.
#[must_use]
pub fn frame_fault_subject(err: &EngineError) -> Option<(u8, Option<RequestId>)> {
    match err {
        EngineError::WireChecksumMismatch {
            msg_type, request, ..
        }
        | EngineError::WireUnknownMessageType {
            msg_type, request, ..
        }
        | EngineError::WireMalformed {
            msg_type, request, ..
        } => Some((*msg_type, *request)),
        _ => None,
    }
}

fn io_err(op: &'static str, source: io::Error) -> EngineError {
    EngineError::WireIo {
        peer: "peer".into(),
        op,
        source,
    }
}

/// Reads until `buf` is full or the stream ends; returns the bytes read.
fn read_full<R: Read>(r: &mut R, buf: &mut [u8]) -> Result<usize, EngineError> {
    let mut got = 0;
    while got < buf.len() {
        match r.read(&mut buf[got..]) {
            Ok(0) => break,
            Ok(n) => got += n,
            Err(e) if e.kind() == io::ErrorKind::Interrupted => {}
            Err(e) => return Err(io_err("read", e)),
        }
    }
    Ok(got)
}

/// Reads and checks one header; `None` on a clean end of stream.
///
/// # Errors
/// See [`read_frame`]'s framing errors.
pub fn read_header<R: Read>(
    r: &mut R,
    limits: &WireLimits,
) -> Result<Option<FrameHeader>, EngineError> {
    let mut h = [0u8; HEADER_LEN];
    // The magic first, on its own: a peer of another protocol that sends
    // less than a header is refused at once, not after a read timeout.
    let mut got = read_full(r, &mut h[..4])?;
    if got == 0 {
        return Ok(None);
    }
    if h[..got] != MAGIC[..got] {
        let mut found = [0u8; 4];
        found[..got].copy_from_slice(&h[..got]);
        return Err(EngineError::WireBadMagic { found });
    }
    if got == 4 {
        got += read_full(r, &mut h[4..])?;
    }
    if got < HEADER_LEN {
        return Err(EngineError::WireTruncated {
            part: "header",
            got: got as u64,
            needed: HEADER_LEN as u64,
        });
    }
    let version = u16::from_le_bytes([h[4], h[5]]);
    if !SUPPORTED_VERSIONS.contains(&version) {
        return Err(EngineError::WireUnsupportedVersion {
            version,
            supported: SUPPORTED_VERSIONS,
        });
    }
    let stored = u32::from_le_bytes([h[28], h[29], h[30], h[31]]);
    let actual = header_checksum(&h[..28]);
    if stored != actual {
        return Err(EngineError::WireBadHeader {
            what: format!("header checksum is {stored:#010x}, the header hashes to {actual:#010x}"),
        });
    }
    let msg_type = h[6];
    let flags = h[7];
    if flags & !KNOWN_FLAGS != 0 {
        return Err(EngineError::WireBadHeader {
            what: format!(
                "flags {flags:#04x} set bits no version defines (known: {KNOWN_FLAGS:#04x})"
            ),
        });
    }
    let len = u32::from_le_bytes([h[8], h[9], h[10], h[11]]);
    if u64::from(len) > limits.max_frame as u64 {
        return Err(EngineError::WireFrameTooLarge {
            msg_type,
            len: u64::from(len),
            limit: limits.max_frame as u64,
        });
    }
    let request = u64::from_le_bytes(h[12..20].try_into().unwrap_or([0; 8]));
    let checksum = u64::from_le_bytes(h[20..28].try_into().unwrap_or([0; 8]));
    Ok(Some(FrameHeader {
        version,
        msg_type,
        flags,
        len,
        request: (flags & FLAG_REQUEST != 0).then_some(RequestId(request)),
        checksum,
    }))
}

/// Reads exactly `n` payload bytes into a new `Vec` (allocated once, `n`
/// is at most the frame limit); `done` payload bytes were read before.
fn read_vec<R: Read>(
    r: &mut R,
    n: usize,
    done: usize,
    header: &FrameHeader,
) -> Result<Vec<u8>, EngineError> {
    let mut v = Vec::with_capacity(n);
    let got = loop {
        match r.by_ref().take(n as u64).read_to_end(&mut v) {
            Ok(_) => break v.len(),
            Err(e) if e.kind() == io::ErrorKind::Interrupted => {}
            Err(e) => return Err(io_err("read", e)),
        }
    };
    if got < n {
        return Err(EngineError::WireTruncated {
            part: "payload",
            got: (done + got) as u64,
            needed: u64::from(header.len),
        });
    }
    Ok(v)
}

/// Reads the payload `header` announces and checks its checksum: the
/// fields, and the bulk section when the frame has one.
fn read_payload<R: Read>(
    r: &mut R,
    header: &FrameHeader,
) -> Result<(Vec<u8>, Option<Vec<u8>>), EngineError> {
    let len = header.len as usize;
    let mut hasher = Xxh3::new();
    let mut bad_split = None;
    let (fields, bulk) = if header.flags & FLAG_BULK != 0 && len >= 4 {
        let mut n = [0u8; 4];
        let got = read_full(r, &mut n)?;
        if got < 4 {
            return Err(EngineError::WireTruncated {
                part: "payload",
                got: got as u64,
                needed: u64::from(header.len),
            });
        }
        hasher.update(&n);
        let declared = u32::from_le_bytes(n) as usize;
        if declared > len - 4 {
            bad_split = Some(format!(
                "the fields are said to be {declared} bytes, only {} follow",
                len - 4
            ));
        }
        let fields_len = declared.min(len - 4);
        let fields = read_vec(r, fields_len, 4, header)?;
        hasher.update(&fields);
        let bulk = read_vec(r, len - 4 - fields_len, 4 + fields_len, header)?;
        hasher.update(&bulk);
        (fields, Some(bulk))
    } else {
        let fields = read_vec(r, len, 0, header)?;
        hasher.update(&fields);
        if header.flags & FLAG_BULK != 0 {
            bad_split = Some(format!(
                "a payload with a bulk section needs at least 4 bytes, found {len}"
            ));
        }
        (fields, None)
    };
    let actual = hasher.digest();
    if actual != header.checksum {
        return Err(EngineError::WireChecksumMismatch {
            msg_type: header.msg_type,
            request: header.request,
            expected: header.checksum,
            actual,
        });
    }
    if let Some(what) = bad_split {
        return Err(malformed(header, "bulk split", what));
    }
    Ok((fields, bulk))
}

fn malformed(header: &FrameHeader, field: &'static str, what: String) -> EngineError {
    EngineError::WireMalformed {
        msg_type: header.msg_type,
        request: header.request,
        field,
        what,
    }
}

// ---------------------------------------------------------------- fields

/// Appends little-endian fields.
struct Put<'a>(&'a mut Vec<u8>);

impl Put<'_> {
    fn u8(&mut self, v: u8) {
        self.0.push(v);
    }
    fn u32(&mut self, v: u32) {
        self.0.extend_from_slice(&v.to_le_bytes());
    }
    fn u64(&mut self, v: u64) {
        self.0.extend_from_slice(&v.to_le_bytes());
    }
    fn usize(&mut self, v: usize) {
        self.u64(v as u64);
    }
    fn f32(&mut self, v: f32) {
        self.u32(v.to_bits());
    }
    /// A count; one beyond `u32` makes the frame too large, which
    /// [`frame_head`] reports, so saturating here loses nothing.
    fn count(&mut self, n: usize) {
        self.u32(u32::try_from(n).unwrap_or(u32::MAX));
    }
    fn str(&mut self, s: &str) {
        self.count(s.len());
        self.0.extend_from_slice(s.as_bytes());
    }
    fn owner(&mut self, o: Owner) {
        self.u64(o.request.0);
        self.u32(o.tenant.0);
    }
    fn pages(&mut self, pages: &[PageRef]) {
        self.count(pages.len());
        for p in pages {
            self.u32(p.page.0);
            self.u32(p.generation.0);
        }
    }
    fn tokens(&mut self, tokens: &[u32]) {
        self.count(tokens.len());
        for &t in tokens {
            self.u32(t);
        }
    }
}

/// Reads little-endian fields, every read checked against what remains.
struct Take<'a> {
    buf: &'a [u8],
    pos: usize,
    header: &'a FrameHeader,
}

impl<'a> Take<'a> {
    fn new(buf: &'a [u8], header: &'a FrameHeader) -> Self {
        Take {
            buf,
            pos: 0,
            header,
        }
    }

    fn err(&self, field: &'static str, what: String) -> EngineError {
        malformed(self.header, field, what)
    }

    fn bytes(&mut self, n: usize, field: &'static str) -> Result<&'a [u8], EngineError> {
        let left = self.buf.len() - self.pos;
        if n > left {
            return Err(self.err(
                field,
                format!("needs {n} bytes at offset {}, only {left} remain", self.pos),
            ));
        }
        let s = &self.buf[self.pos..self.pos + n];
        self.pos += n;
        Ok(s)
    }

    fn array<const N: usize>(&mut self, field: &'static str) -> Result<[u8; N], EngineError> {
        let s = self.bytes(N, field)?;
        let mut a = [0u8; N];
        a.copy_from_slice(s);
        Ok(a)
    }

    fn u8(&mut self, field: &'static str) -> Result<u8, EngineError> {
        Ok(self.array::<1>(field)?[0])
    }
    fn u32(&mut self, field: &'static str) -> Result<u32, EngineError> {
        Ok(u32::from_le_bytes(self.array(field)?))
    }
    fn u64(&mut self, field: &'static str) -> Result<u64, EngineError> {
        Ok(u64::from_le_bytes(self.array(field)?))
    }
    fn usize(&mut self, field: &'static str) -> Result<usize, EngineError> {
        let v = self.u64(field)?;
        usize::try_from(v)
            .map_err(|_| self.err(field, format!("{v} does not fit this machine's usize")))
    }
    fn f32(&mut self, field: &'static str) -> Result<f32, EngineError> {
        Ok(f32::from_bits(self.u32(field)?))
    }

    /// A count of items of `item_bytes` each, checked against what remains
    /// before anything is allocated for them.
    fn count(&mut self, item_bytes: usize, field: &'static str) -> Result<usize, EngineError> {
        let n = self.u32(field)? as usize;
        let left = self.buf.len() - self.pos;
        if n.saturating_mul(item_bytes) > left {
            return Err(self.err(
                field,
                format!(
                    "{n} items of {item_bytes} bytes do not fit in the {left} bytes that remain"
                ),
            ));
        }
        Ok(n)
    }

    fn str(&mut self, field: &'static str) -> Result<String, EngineError> {
        let n = self.count(1, field)?;
        let b = self.bytes(n, field)?;
        match std::str::from_utf8(b) {
            Ok(s) => Ok(s.to_string()),
            // The text itself is not repeated: it may be anything.
            Err(e) => Err(self.err(
                field,
                format!(
                    "{n} bytes are not UTF-8 (invalid at byte {})",
                    e.valid_up_to()
                ),
            )),
        }
    }

    fn flag(&mut self, field: &'static str) -> Result<bool, EngineError> {
        match self.u8(field)? {
            0 => Ok(false),
            1 => Ok(true),
            v => Err(self.err(field, format!("option tag {v}, expected 0 or 1"))),
        }
    }

    fn owner(&mut self, field: &'static str) -> Result<Owner, EngineError> {
        Ok(Owner {
            request: RequestId(self.u64(field)?),
            tenant: TenantId(self.u32(field)?),
        })
    }

    fn pages(&mut self, field: &'static str) -> Result<Vec<PageRef>, EngineError> {
        let n = self.count(8, field)?;
        let mut v = Vec::with_capacity(n);
        for _ in 0..n {
            let page = self.u32(field)?;
            let generation = self.u32(field)?;
            v.push(PageRef::new(page, generation));
        }
        Ok(v)
    }

    fn tokens(&mut self, field: &'static str) -> Result<Vec<u32>, EngineError> {
        let n = self.count(4, field)?;
        let mut v = Vec::with_capacity(n);
        for _ in 0..n {
            v.push(self.u32(field)?);
        }
        Ok(v)
    }

    fn finish(self) -> Result<(), EngineError> {
        let left = self.buf.len() - self.pos;
        if left != 0 {
            return Err(self.err(
                "end of fields",
                format!("{left} bytes follow the last field"),
            ));
        }
        Ok(())
    }
}

fn no_bulk(header: &FrameHeader, bulk: Option<&Vec<u8>>) -> Result<(), EngineError> {
    match bulk {
        None => Ok(()),
        Some(b) => Err(malformed(
            header,
            "bulk",
            format!(
                "a {} message has no bulk section, found {} bytes",
                type_name(header.msg_type),
                b.len()
            ),
        )),
    }
}

// ---------------------------------------------------------------- messages

impl WireMessage for ToPrefill {
    const DIRECTION: &'static str = "decode → prefill";
    const ACCEPTED: &'static str = "1 prefill, 2 cancel";

    fn msg_type(&self) -> u8 {
        match self {
            ToPrefill::Prefill(_) => TYPE_PREFILL,
            ToPrefill::Cancel { .. } => TYPE_CANCEL,
        }
    }

    fn request(&self) -> Option<RequestId> {
        Some(match self {
            ToPrefill::Prefill(o) => o.owner.request,
            ToPrefill::Cancel { request } => *request,
        })
    }

    fn accepts(msg_type: u8) -> bool {
        matches!(msg_type, TYPE_PREFILL | TYPE_CANCEL)
    }

    fn bulk(&self) -> Option<&[u8]> {
        None
    }

    fn encode_fields(&self, out: &mut Vec<u8>) {
        let mut p = Put(out);
        match self {
            ToPrefill::Prefill(o) => {
                p.owner(o.owner);
                p.f32(o.sampling.temperature);
                p.usize(o.sampling.top_k);
                p.f32(o.sampling.top_p);
                p.u64(o.sampling.seed);
                p.u32(o.dst_pool.0);
                p.pages(&o.dst_pages);
                p.tokens(&o.prompt);
            }
            ToPrefill::Cancel { request } => p.u64(request.0),
        }
    }

    fn decode(
        header: &FrameHeader,
        fields: &[u8],
        bulk: Option<Vec<u8>>,
        _limits: &WireLimits,
    ) -> Result<Self, EngineError> {
        no_bulk(header, bulk.as_ref())?;
        let mut t = Take::new(fields, header);
        let msg = match header.msg_type {
            TYPE_PREFILL => {
                let owner = t.owner("owner")?;
                let sampling = SamplingParams {
                    temperature: t.f32("sampling.temperature")?,
                    top_k: t.usize("sampling.top_k")?,
                    top_p: t.f32("sampling.top_p")?,
                    seed: t.u64("sampling.seed")?,
                };
                let dst_pool = PoolId(t.u32("dst_pool")?);
                let dst_pages = t.pages("dst_pages")?;
                let prompt = t.tokens("prompt")?;
                ToPrefill::Prefill(PrefillOrder {
                    owner,
                    prompt,
                    sampling,
                    dst_pool,
                    dst_pages,
                })
            }
            _ => ToPrefill::Cancel {
                request: RequestId(t.u64("request")?),
            },
        };
        t.finish()?;
        Ok(msg)
    }
}

const KV_BYTES: u8 = 0;
const KV_LANDED: u8 = 1;

/// The kind named `name` (its stable kebab-case name, as serde spells it),
/// so that kinds added later travel without a change here.
fn error_kind_named(name: &str) -> Option<ErrorKind> {
    use serde::Deserialize;
    use serde::de::value::{Error, StrDeserializer};
    ErrorKind::deserialize(StrDeserializer::<Error>::new(name)).ok()
}

/// [`super::kv_payload_len`], checked: `None` when it overflows (a hostile
/// manifest).
fn checked_kv_len(manifest: &Manifest, kv_dim: usize) -> Option<usize> {
    let layers = manifest.layers.end.saturating_sub(manifest.layers.start) as usize;
    (manifest.tokens as usize)
        .checked_mul(layers)?
        .checked_mul(kv_dim)?
        .checked_mul(4)
}

impl WireMessage for ToDecode {
    const DIRECTION: &'static str = "prefill → decode";
    const ACCEPTED: &'static str = "16 hello, 17 kv, 18 prefill-done, 19 prefill-failed";

    fn msg_type(&self) -> u8 {
        match self {
            ToDecode::Hello(_) => TYPE_HELLO,
            ToDecode::Kv(_) => TYPE_KV,
            ToDecode::PrefillDone { .. } => TYPE_PREFILL_DONE,
            ToDecode::PrefillFailed { .. } => TYPE_PREFILL_FAILED,
        }
    }

    fn request(&self) -> Option<RequestId> {
        match self {
            ToDecode::Hello(_) => None,
            ToDecode::Kv(kv) => Some(kv.manifest.request.request),
            ToDecode::PrefillDone { request, .. } | ToDecode::PrefillFailed { request, .. } => {
                Some(*request)
            }
        }
    }

    fn accepts(msg_type: u8) -> bool {
        matches!(
            msg_type,
            TYPE_HELLO | TYPE_KV | TYPE_PREFILL_DONE | TYPE_PREFILL_FAILED
        )
    }

    fn bulk(&self) -> Option<&[u8]> {
        match self {
            ToDecode::Kv(KvTransfer {
                payload: KvPayload::Bytes(b),
                ..
            }) => Some(b),
            _ => None,
        }
    }

    fn encode_fields(&self, out: &mut Vec<u8>) {
        let mut p = Put(out);
        match self {
            ToDecode::Hello(info) => {
                p.usize(info.pool_tokens);
                p.usize(info.page_slots);
                p.usize(info.n_layers);
                p.usize(info.kv_dim);
                p.usize(info.context_length);
            }
            ToDecode::Kv(kv) => {
                let m = &kv.manifest;
                p.owner(m.request);
                p.u32(m.src_pool.0);
                p.pages(&m.src_pages);
                p.u32(m.dst_pool.0);
                p.pages(&m.dst_pages);
                p.u32(m.first_token);
                p.u32(m.tokens);
                p.u32(m.layers.start);
                p.u32(m.layers.end);
                p.u64(m.checksum);
                p.u8(match kv.payload {
                    KvPayload::Bytes(_) => KV_BYTES,
                    KvPayload::Landed => KV_LANDED,
                });
            }
            ToDecode::PrefillDone {
                request,
                first_token,
            } => {
                p.u64(request.0);
                p.u32(*first_token);
            }
            ToDecode::PrefillFailed { request, error } => {
                p.u64(request.0);
                p.str(error.kind.name());
                p.str(&error.message);
                match &error.rejection {
                    None => p.u8(0),
                    Some(r) => {
                        p.u8(1);
                        p.str(&r.reason);
                        p.usize(r.prompt_tokens);
                        p.usize(r.limit);
                        p.str(&r.node);
                    }
                }
                match error.violation {
                    None => p.u8(0),
                    Some(v) => {
                        p.u8(1);
                        p.str(&v.id.to_string());
                        p.str(v.kind.name());
                    }
                }
            }
        }
    }

    fn decode(
        header: &FrameHeader,
        fields: &[u8],
        bulk: Option<Vec<u8>>,
        limits: &WireLimits,
    ) -> Result<Self, EngineError> {
        let mut t = Take::new(fields, header);
        let msg = match header.msg_type {
            TYPE_HELLO => {
                no_bulk(header, bulk.as_ref())?;
                ToDecode::Hello(NodeInfo {
                    pool_tokens: t.usize("hello.pool_tokens")?,
                    page_slots: t.usize("hello.page_slots")?,
                    n_layers: t.usize("hello.n_layers")?,
                    kv_dim: t.usize("hello.kv_dim")?,
                    context_length: t.usize("hello.context_length")?,
                })
            }
            TYPE_KV => {
                let manifest = Manifest {
                    request: t.owner("manifest.request")?,
                    src_pool: PoolId(t.u32("manifest.src_pool")?),
                    src_pages: t.pages("manifest.src_pages")?,
                    dst_pool: PoolId(t.u32("manifest.dst_pool")?),
                    dst_pages: t.pages("manifest.dst_pages")?,
                    first_token: t.u32("manifest.first_token")?,
                    tokens: t.u32("manifest.tokens")?,
                    layers: t.u32("manifest.layers")?..t.u32("manifest.layers")?,
                    checksum: t.u64("manifest.checksum")?,
                };
                if manifest.layers.start > manifest.layers.end {
                    return Err(t.err(
                        "manifest.layers",
                        format!(
                            "range {}..{} is reversed",
                            manifest.layers.start, manifest.layers.end
                        ),
                    ));
                }
                let payload = match (t.u8("payload kind")?, bulk) {
                    (KV_LANDED, None) => KvPayload::Landed,
                    (KV_BYTES, Some(bytes)) => {
                        let Some(kv_dim) = limits.kv_dim else {
                            return Err(t.err(
                                "bulk",
                                "KV bytes arrived before the sender's hello: kv_dim is unknown"
                                    .into(),
                            ));
                        };
                        match checked_kv_len(&manifest, kv_dim) {
                            Some(want) if want == bytes.len() => KvPayload::Bytes(bytes),
                            want => {
                                return Err(t.err(
                                    "bulk",
                                    format!(
                                        "{} KV bytes, the manifest ({} tokens × {} layers, kv_dim {kv_dim}) needs {}",
                                        bytes.len(),
                                        manifest.tokens,
                                        manifest.layers.end - manifest.layers.start,
                                        want.map_or("more than usize holds".into(), |w| w.to_string())
                                    ),
                                ));
                            }
                        }
                    }
                    (KV_LANDED, Some(b)) => {
                        return Err(t.err(
                            "bulk",
                            format!("a landed transfer carries no bytes, found {}", b.len()),
                        ));
                    }
                    (KV_BYTES, None) => {
                        return Err(t.err("bulk", "a transfer of bytes has no bulk section".into()));
                    }
                    (kind, _) => {
                        return Err(t.err(
                            "payload kind",
                            format!("{kind}, expected {KV_BYTES} (bytes) or {KV_LANDED} (landed)"),
                        ));
                    }
                };
                ToDecode::Kv(KvTransfer { manifest, payload })
            }
            TYPE_PREFILL_DONE => {
                no_bulk(header, bulk.as_ref())?;
                ToDecode::PrefillDone {
                    request: RequestId(t.u64("request")?),
                    first_token: t.u32("first_token")?,
                }
            }
            _ => {
                no_bulk(header, bulk.as_ref())?;
                let request = RequestId(t.u64("request")?);
                let name = t.str("error.kind")?;
                let kind = error_kind_named(&name).ok_or_else(|| {
                    let shown: String = name.chars().take(32).collect();
                    t.err(
                        "error.kind",
                        format!("{shown:?} is not an error kind's name (rejected, transport, …)"),
                    )
                })?;
                let message = t.str("error.message")?;
                let rejection = if t.flag("error.rejection")? {
                    Some(Box::new(Rejection {
                        reason: t.str("error.rejection.reason")?,
                        prompt_tokens: t.usize("error.rejection.prompt_tokens")?,
                        limit: t.usize("error.rejection.limit")?,
                        node: t.str("error.rejection.node")?,
                    }))
                } else {
                    None
                };
                let violation = if t.flag("error.violation")? {
                    let id = t.str("error.violation.id")?;
                    let kind = t.str("error.violation.kind")?;
                    Some(
                        crate::request::Violated::parse(&id, &kind)
                            .map_err(|what| t.err("error.violation", what))?,
                    )
                } else {
                    None
                };
                ToDecode::PrefillFailed {
                    request,
                    error: RequestError {
                        kind,
                        message,
                        rejection,
                        violation,
                    },
                }
            }
        };
        t.finish()?;
        Ok(msg)
    }
}
