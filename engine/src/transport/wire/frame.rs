//! Frames on a byte stream: writing a message's header and payload, and
//! reading one back with every length bounded and every checksum checked.

use super::WireError;
use super::{
    FLAG_BULK, FLAG_REQUEST, FrameHeader, HEADER_LEN, KNOWN_FLAGS, MAGIC, SUPPORTED_VERSIONS,
    TYPE_HEARTBEAT, VERSION, WireLimits, WireMessage,
};
use kvsan_sanitizer::RequestId;
use std::io::{self, Read, Write};
use xxhash_rust::xxh3::{Xxh3, xxh3_64};

/// The header and fields of `msg`'s frame: everything but the bulk section,
/// which the caller writes after it, straight from the message.
///
/// # Errors
/// [`WireError::FrameTooLarge`] when the payload exceeds what the
/// `u32` length field can say.
pub fn frame_head<M: WireMessage>(msg: &M) -> Result<Vec<u8>, WireError> {
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
    let len = u32::try_from(len).map_err(|_| WireError::FrameTooLarge {
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
pub fn encode<M: WireMessage>(msg: &M) -> Result<Vec<u8>, WireError> {
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
/// As [`frame_head`]; [`WireError::Io`] when writing fails.
pub fn write_frame<M: WireMessage, W: Write>(w: &mut W, msg: &M) -> Result<(), WireError> {
    let head = frame_head(msg)?;
    let io = |source| WireError::Io {
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
/// - Framing is lost, the stream must be closed: [`WireError::BadMagic`],
///   [`WireError::UnsupportedVersion`], [`WireError::BadHeader`],
///   [`WireError::FrameTooLarge`], [`WireError::Truncated`],
///   [`WireError::Io`].
/// - The frame was skipped whole and the stream is still in step
///   ([`frame_fault_keeps_stream`] is true): [`WireError::ChecksumMismatch`],
///   [`WireError::UnknownMessageType`], [`WireError::Malformed`].
pub fn read_frame<M: WireMessage, R: Read>(
    r: &mut R,
    limits: &WireLimits,
) -> Result<Option<M>, WireError> {
    loop {
        let Some(header) = read_header(r, limits)? else {
            return Ok(None);
        };
        let (fields, bulk) = read_payload(r, &header)?;
        if header.msg_type == TYPE_HEARTBEAT {
            if header.len != 0 || header.flags != 0 {
                return Err(WireError::Malformed {
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
            return Err(WireError::UnknownMessageType {
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
pub fn frame_fault_keeps_stream(err: &WireError) -> bool {
    matches!(
        err,
        WireError::ChecksumMismatch { .. }
            | WireError::UnknownMessageType { .. }
            | WireError::Malformed { .. }
    )
}

/// The message type and request a per-frame fault concerns
/// (see [`frame_fault_keeps_stream`]); `None` for other errors.
#[must_use]
pub fn frame_fault_subject(err: &WireError) -> Option<(u8, Option<RequestId>)> {
    match err {
        WireError::ChecksumMismatch {
            msg_type, request, ..
        }
        | WireError::UnknownMessageType {
            msg_type, request, ..
        }
        | WireError::Malformed {
            msg_type, request, ..
        } => Some((*msg_type, *request)),
        _ => None,
    }
}

fn io_err(op: &'static str, source: io::Error) -> WireError {
    WireError::Io {
        peer: "peer".into(),
        op,
        source,
    }
}

/// Reads until `buf` is full or the stream ends; returns the bytes read.
fn read_full<R: Read>(r: &mut R, buf: &mut [u8]) -> Result<usize, WireError> {
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
) -> Result<Option<FrameHeader>, WireError> {
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
        return Err(WireError::BadMagic { found });
    }
    if got == 4 {
        got += read_full(r, &mut h[4..])?;
    }
    if got < HEADER_LEN {
        return Err(WireError::Truncated {
            part: "header",
            got: got as u64,
            needed: HEADER_LEN as u64,
        });
    }
    let version = u16::from_le_bytes([h[4], h[5]]);
    if !SUPPORTED_VERSIONS.contains(&version) {
        return Err(WireError::UnsupportedVersion {
            version,
            supported: SUPPORTED_VERSIONS,
        });
    }
    let stored = u32::from_le_bytes([h[28], h[29], h[30], h[31]]);
    let actual = header_checksum(&h[..28]);
    if stored != actual {
        return Err(WireError::BadHeader {
            what: format!("header checksum is {stored:#010x}, the header hashes to {actual:#010x}"),
        });
    }
    let msg_type = h[6];
    let flags = h[7];
    if flags & !KNOWN_FLAGS != 0 {
        return Err(WireError::BadHeader {
            what: format!(
                "flags {flags:#04x} set bits no version defines (known: {KNOWN_FLAGS:#04x})"
            ),
        });
    }
    let len = u32::from_le_bytes([h[8], h[9], h[10], h[11]]);
    if u64::from(len) > limits.max_frame as u64 {
        return Err(WireError::FrameTooLarge {
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
) -> Result<Vec<u8>, WireError> {
    let mut v = Vec::with_capacity(n);
    let got = loop {
        match r.by_ref().take(n as u64).read_to_end(&mut v) {
            Ok(_) => break v.len(),
            Err(e) if e.kind() == io::ErrorKind::Interrupted => {}
            Err(e) => return Err(io_err("read", e)),
        }
    };
    if got < n {
        return Err(WireError::Truncated {
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
) -> Result<(Vec<u8>, Option<Vec<u8>>), WireError> {
    let len = header.len as usize;
    let mut hasher = Xxh3::new();
    let mut bad_split = None;
    let (fields, bulk) = if header.flags & FLAG_BULK != 0 && len >= 4 {
        let mut n = [0u8; 4];
        let got = read_full(r, &mut n)?;
        if got < 4 {
            return Err(WireError::Truncated {
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
        return Err(WireError::ChecksumMismatch {
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

pub(super) fn malformed(header: &FrameHeader, field: &'static str, what: String) -> WireError {
    WireError::Malformed {
        msg_type: header.msg_type,
        request: header.request,
        field,
        what,
    }
}
