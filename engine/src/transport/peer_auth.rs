//! Authenticated peer links: a pre-shared key, a mutual challenge–response
//! before anything else is exchanged, and an HMAC-SHA256 tag on every record
//! of the byte stream after it.
//!
//! ```text
//!  handshake (both sides at once; all integers little-endian)
//!    hello  magic "KVSNAUTH" (8 bytes), version u16 = 1, role u8 (1 decode, 2 prefill),
//!           nonce [32] (fresh random bytes)                                  43 bytes
//!    proof  HMAC-SHA256(K_role, "kvsan peer-link v1" ‖ prefill nonce ‖ decode nonce)  32 bytes
//!           each side sends its proof once it has the peer's hello, then checks the
//!           peer's (constant-time compare); a peer that does not finish within the
//!           deadline is dropped
//!
//!  keys     HKDF-SHA256(salt = prefill nonce ‖ decode nonce, ikm = the pre-shared key)
//!           K_role  = expand("kvsan proof prefill" | "kvsan proof decode")
//!           K_frames = expand("kvsan frames prefill->decode" | "kvsan frames decode->prefill")
//!
//!  after it, each direction's bytes travel in records:
//!           +-----------+-------------------------+------------------------------------------+
//!           | len: u32  | data (1..=64 KiB)       | tag: HMAC-SHA256(K_frames, seq: u64 ‖ len ‖ data) |
//!           +-----------+-------------------------+------------------------------------------+
//!           seq counts the direction's records from 0 and never travels: a replayed,
//!           reordered, dropped-then-replayed or altered record fails its tag
//! ```
//!
//! The proofs use a key per role, so a proof reflected back to its sender
//! does not verify; both nonces are fresh, so a recorded handshake replayed
//! to either node does not verify. Every frame (heartbeats included) is
//! written into records and a record is flushed at the end of the frames
//! queued at once, so a frame is never delivered before every byte of it
//! verified. The bytes are authenticated, not encrypted: KV travels in clear.

use std::fmt;
use std::io::{self, Read, Write};
use std::net::TcpStream;
use std::path::Path;
use std::sync::Arc;
use std::time::{Duration, Instant};

use hkdf::Hkdf;
use hmac::{Hmac, KeyInit, Mac};
use sha2::Sha256;

pub use crate::error::PeerAuthError;

/// Bytes a peer key has at least.
pub const MIN_KEY_BYTES: usize = 32;
/// Bytes a key file has at most.
pub const MAX_KEY_FILE_BYTES: u64 = 4096;
/// How long a peer has to finish the handshake by default.
pub const DEFAULT_HANDSHAKE_DEADLINE: Duration = Duration::from_secs(5);
/// Data bytes of one record at most.
pub const MAX_RECORD: usize = 64 << 10;

/// The first bytes of the handshake. A plain link's frames start with
/// "KVSN" too, so a node without a key reads the rest as the version "AU".
pub const HANDSHAKE_MAGIC: &[u8; 8] = b"KVSNAUTH";
const VERSION: u16 = 1;
const NONCE_LEN: usize = 32;
const HELLO_LEN: usize = 8 + 2 + 1 + NONCE_LEN;
const TAG_LEN: usize = 32;
const TRANSCRIPT_LABEL: &[u8] = b"kvsan peer-link v1";

type HmacSha256 = Hmac<Sha256>;

/// Which end of a peer link this node is.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum PeerRole {
    /// The node that reserves pages and receives KV.
    Decode,
    /// The node that computes KV and sends it.
    Prefill,
}

impl PeerRole {
    fn byte(self) -> u8 {
        match self {
            PeerRole::Decode => 1,
            PeerRole::Prefill => 2,
        }
    }

    fn other(self) -> PeerRole {
        match self {
            PeerRole::Decode => PeerRole::Prefill,
            PeerRole::Prefill => PeerRole::Decode,
        }
    }

    fn name(self) -> &'static str {
        match self {
            PeerRole::Decode => "decode",
            PeerRole::Prefill => "prefill",
        }
    }

    fn proof_label(self) -> &'static [u8] {
        match self {
            PeerRole::Decode => b"kvsan proof decode",
            PeerRole::Prefill => b"kvsan proof prefill",
        }
    }

    /// The label of the frames this role sends.
    fn frames_label(self) -> &'static [u8] {
        match self {
            PeerRole::Decode => b"kvsan frames decode->prefill",
            PeerRole::Prefill => b"kvsan frames prefill->decode",
        }
    }
}

/// The deployment's pre-shared key. Its bytes never appear in `Debug`.
#[derive(Clone)]
pub struct PeerKey {
    bytes: Arc<[u8]>,
}

impl fmt::Debug for PeerKey {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "PeerKey({} bytes)", self.bytes.len())
    }
}

impl PeerKey {
    /// Reads a key file: only hex digits (surrounding whitespace ignored)
    /// are read as hex, anything else as raw bytes. `openssl rand -hex 32`
    /// makes one.
    ///
    /// # Errors
    /// [`PeerAuthError::KeyFile`] when it cannot be read;
    /// [`PeerAuthError::KeyMalformed`] when it is larger than
    /// [`MAX_KEY_FILE_BYTES`], has an odd number of hex digits, or holds
    /// fewer than [`MIN_KEY_BYTES`] bytes.
    pub fn from_file(path: &Path) -> Result<PeerKey, PeerAuthError> {
        let malformed = |what: String| PeerAuthError::KeyMalformed {
            path: path.to_path_buf(),
            what,
        };
        let file_err = |source| PeerAuthError::KeyFile {
            path: path.to_path_buf(),
            source,
        };
        let mut raw = Vec::new();
        std::fs::File::open(path)
            .map_err(file_err)?
            .take(MAX_KEY_FILE_BYTES + 1)
            .read_to_end(&mut raw)
            .map_err(file_err)?;
        if raw.len() as u64 > MAX_KEY_FILE_BYTES {
            return Err(malformed(format!(
                "the file is larger than {MAX_KEY_FILE_BYTES} bytes; a key is {MIN_KEY_BYTES} to {MAX_KEY_FILE_BYTES} bytes"
            )));
        }
        let trimmed = raw.trim_ascii();
        let bytes = if !trimmed.is_empty() && trimmed.iter().all(u8::is_ascii_hexdigit) {
            if trimmed.len() % 2 != 0 {
                return Err(malformed(format!(
                    "{} hex digits: a hex key needs an even number",
                    trimmed.len()
                )));
            }
            trimmed
                .chunks_exact(2)
                .map(|pair| (hex_value(pair[0]) << 4) | hex_value(pair[1]))
                .collect()
        } else {
            raw
        };
        PeerKey::from_bytes(&bytes).map_err(|short| malformed(short.to_string()))
    }

    /// A key from its bytes.
    ///
    /// # Errors
    /// [`KeyTooShort`] when there are fewer than [`MIN_KEY_BYTES`].
    pub fn from_bytes(bytes: &[u8]) -> Result<PeerKey, KeyTooShort> {
        if bytes.len() < MIN_KEY_BYTES {
            return Err(KeyTooShort { bytes: bytes.len() });
        }
        Ok(PeerKey {
            bytes: Arc::from(bytes),
        })
    }
}

/// A key with fewer than [`MIN_KEY_BYTES`] bytes.
#[derive(Clone, Copy, Debug, PartialEq, Eq, thiserror::Error)]
#[error(
    "the key is {bytes} bytes, at least {MIN_KEY_BYTES} are needed (e.g. `openssl rand -hex 32`)"
)]
pub struct KeyTooShort {
    /// Bytes found.
    pub bytes: usize,
}

fn hex_value(digit: u8) -> u8 {
    match digit {
        b'0'..=b'9' => digit - b'0',
        b'a'..=b'f' => digit - b'a' + 10,
        _ => digit - b'A' + 10,
    }
}

/// The keys of an authenticated link, one per direction.
pub struct SessionKeys {
    send: HmacSha256,
    recv: HmacSha256,
}

impl fmt::Debug for SessionKeys {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str("SessionKeys(..)")
    }
}

impl SessionKeys {
    /// The two halves: a writer for what this side sends and a reader for
    /// what it receives.
    pub fn split<W: Write, R: Read>(self, w: W, r: R) -> (SealedWriter<W>, OpenedReader<R>) {
        (
            SealedWriter {
                inner: w,
                mac: self.send,
                seq: 0,
                record: Vec::with_capacity(4 + MAX_RECORD + TAG_LEN),
            },
            OpenedReader {
                inner: r,
                mac: self.recv,
                seq: 0,
                record: Vec::with_capacity(MAX_RECORD + TAG_LEN),
                pos: 0,
            },
        )
    }
}

/// Runs the handshake on `stream` as `me`; the peer must hold `key` and be
/// of the other role, and finish within `deadline`.
///
/// # Errors
/// [`PeerAuthError::Io`] (a stalled peer: `TimedOut`),
/// [`PeerAuthError::NotAuthenticating`], [`PeerAuthError::Mismatch`],
/// [`PeerAuthError::BadProof`]; each names `peer`.
pub fn handshake(
    stream: &TcpStream,
    peer: &str,
    me: PeerRole,
    key: &PeerKey,
    deadline: Duration,
) -> Result<SessionKeys, PeerAuthError> {
    let until = Instant::now() + deadline;
    let io = |op, source| PeerAuthError::Io {
        peer: peer.to_string(),
        op,
        source,
    };
    let mut mine = [0u8; NONCE_LEN];
    rand::fill(&mut mine);
    let mut hello = Vec::with_capacity(HELLO_LEN);
    hello.extend_from_slice(HANDSHAKE_MAGIC);
    hello.extend_from_slice(&VERSION.to_le_bytes());
    hello.push(me.byte());
    hello.extend_from_slice(&mine);
    write_by(stream, &hello, until).map_err(|e| io("send hello", e))?;

    let mut theirs_hello = [0u8; HELLO_LEN];
    read_by(stream, &mut theirs_hello[..8], until).map_err(|e| io("read hello", e))?;
    if &theirs_hello[..8] != HANDSHAKE_MAGIC {
        let mut found = [0u8; 8];
        found.copy_from_slice(&theirs_hello[..8]);
        return Err(PeerAuthError::NotAuthenticating {
            peer: peer.to_string(),
            found,
        });
    }
    read_by(stream, &mut theirs_hello[8..], until).map_err(|e| io("read hello", e))?;
    let version = u16::from_le_bytes([theirs_hello[8], theirs_hello[9]]);
    let mismatch = |what| PeerAuthError::Mismatch {
        peer: peer.to_string(),
        what,
    };
    if version != VERSION {
        return Err(mismatch(format!(
            "handshake version {version}, this node speaks {VERSION}"
        )));
    }
    let role = theirs_hello[10];
    if role != me.other().byte() {
        return Err(mismatch(format!(
            "it says it is role {role}, a {} node takes only {} peers (role {})",
            me.name(),
            me.other().name(),
            me.other().byte()
        )));
    }
    let theirs = &theirs_hello[11..];
    let (prefill_nonce, decode_nonce) = match me {
        PeerRole::Prefill => (&mine[..], theirs),
        PeerRole::Decode => (theirs, &mine[..]),
    };
    let mut salt = Vec::with_capacity(2 * NONCE_LEN);
    salt.extend_from_slice(prefill_nonce);
    salt.extend_from_slice(decode_nonce);
    let hkdf = Hkdf::<Sha256>::new(Some(&salt), &key.bytes);
    let keyed = |label: &[u8]| {
        let mut k = [0u8; 32];
        // 32 bytes is far below HKDF-SHA256's 8160-byte limit.
        let _ = hkdf.expand(label, &mut k);
        // HMAC takes keys of any length.
        HmacSha256::new_from_slice(&k).unwrap_or_else(|_| unreachable!("HMAC takes any key"))
    };
    let proof_of = |role: PeerRole| {
        let mut mac = keyed(role.proof_label());
        mac.update(TRANSCRIPT_LABEL);
        mac.update(&salt);
        mac
    };

    let my_proof = proof_of(me).finalize().into_bytes();
    write_by(stream, &my_proof, until).map_err(|e| io("send proof", e))?;
    let mut their_proof = [0u8; TAG_LEN];
    read_by(stream, &mut their_proof, until).map_err(|e| io("read proof", e))?;
    proof_of(me.other())
        .verify_slice(&their_proof)
        .map_err(|_| PeerAuthError::BadProof {
            peer: peer.to_string(),
        })?;
    Ok(SessionKeys {
        send: keyed(me.frames_label()),
        recv: keyed(me.other().frames_label()),
    })
}

fn timed_out() -> io::Error {
    io::Error::new(
        io::ErrorKind::TimedOut,
        "the peer did not finish the handshake in time",
    )
}

/// Reads `buf` full before `until`.
fn read_by(mut stream: &TcpStream, buf: &mut [u8], until: Instant) -> io::Result<()> {
    let mut got = 0;
    while got < buf.len() {
        let left = until.saturating_duration_since(Instant::now());
        if left.is_zero() {
            return Err(timed_out());
        }
        stream.set_read_timeout(Some(left))?;
        match stream.read(&mut buf[got..]) {
            Ok(0) => {
                return Err(io::Error::new(
                    io::ErrorKind::UnexpectedEof,
                    format!(
                        "the peer closed the connection after {got} of {} bytes",
                        buf.len()
                    ),
                ));
            }
            Ok(n) => got += n,
            Err(e) if e.kind() == io::ErrorKind::Interrupted => {}
            Err(e)
                if matches!(
                    e.kind(),
                    io::ErrorKind::WouldBlock | io::ErrorKind::TimedOut
                ) =>
            {
                return Err(timed_out());
            }
            Err(e) => return Err(e),
        }
    }
    Ok(())
}

/// Writes `buf` before `until`.
fn write_by(mut stream: &TcpStream, buf: &[u8], until: Instant) -> io::Result<()> {
    let left = until.saturating_duration_since(Instant::now());
    if left.is_zero() {
        return Err(timed_out());
    }
    stream.set_write_timeout(Some(left))?;
    stream.write_all(buf)
}

/// The sending half of an authenticated link: buffers what is written into
/// a record, and seals and writes the record when it is full or flushed.
pub struct SealedWriter<W: Write> {
    inner: W,
    mac: HmacSha256,
    seq: u64,
    /// `len` placeholder, then the data, then room for the tag.
    record: Vec<u8>,
}

impl<W: Write> SealedWriter<W> {
    /// The stream records are written to.
    pub fn get_ref(&self) -> &W {
        &self.inner
    }

    fn seal(&mut self) -> io::Result<()> {
        if self.record.len() <= 4 {
            return Ok(());
        }
        let len = (self.record.len() - 4) as u32;
        self.record[..4].copy_from_slice(&len.to_le_bytes());
        let mut mac = self.mac.clone();
        mac.update(&self.seq.to_le_bytes());
        mac.update(&self.record);
        let tag = mac.finalize().into_bytes();
        self.record.extend_from_slice(&tag);
        self.seq += 1;
        let result = self.inner.write_all(&self.record);
        self.record.clear();
        result
    }
}

impl<W: Write> Write for SealedWriter<W> {
    fn write(&mut self, buf: &[u8]) -> io::Result<usize> {
        if self.record.is_empty() {
            self.record.extend_from_slice(&[0; 4]);
        }
        let n = buf.len().min(4 + MAX_RECORD - self.record.len());
        self.record.extend_from_slice(&buf[..n]);
        if self.record.len() == 4 + MAX_RECORD {
            self.seal()?;
        }
        Ok(n)
    }

    fn flush(&mut self) -> io::Result<()> {
        self.seal()?;
        self.inner.flush()
    }
}

/// The receiving half of an authenticated link: reads a whole record,
/// verifies its tag, and only then hands out its bytes.
///
/// A record that does not verify is an [`io::ErrorKind::InvalidData`] error
/// whose inner error is the [`PeerAuthError`]; the link must be closed.
pub struct OpenedReader<R: Read> {
    inner: R,
    mac: HmacSha256,
    seq: u64,
    /// The verified data of the current record (the tag's room at the end
    /// while it is read).
    record: Vec<u8>,
    pos: usize,
}

impl<R: Read> OpenedReader<R> {
    /// Reads and verifies the next record; `false` at a clean end of stream.
    fn next_record(&mut self) -> io::Result<bool> {
        let mut len = [0u8; 4];
        let mut got = 0;
        while got < 4 {
            match self.inner.read(&mut len[got..]) {
                Ok(0) if got == 0 => return Ok(false),
                Ok(0) => return Err(io::ErrorKind::UnexpectedEof.into()),
                Ok(n) => got += n,
                Err(e) if e.kind() == io::ErrorKind::Interrupted => {}
                Err(e) => return Err(e),
            }
        }
        let n = u32::from_le_bytes(len) as usize;
        if n == 0 || n > MAX_RECORD {
            return Err(refused(PeerAuthError::RecordLength {
                seq: self.seq,
                len: n as u64,
                limit: MAX_RECORD as u64,
            }));
        }
        self.record.resize(n + TAG_LEN, 0);
        self.inner.read_exact(&mut self.record)?;
        let mut mac = self.mac.clone();
        mac.update(&self.seq.to_le_bytes());
        mac.update(&len);
        mac.update(&self.record[..n]);
        mac.verify_slice(&self.record[n..])
            .map_err(|_| refused(PeerAuthError::BadTag { seq: self.seq }))?;
        self.record.truncate(n);
        self.pos = 0;
        self.seq += 1;
        Ok(true)
    }
}

fn refused(e: PeerAuthError) -> io::Error {
    io::Error::new(io::ErrorKind::InvalidData, e)
}

impl<R: Read> Read for OpenedReader<R> {
    fn read(&mut self, buf: &mut [u8]) -> io::Result<usize> {
        if self.pos == self.record.len() && !self.next_record()? {
            return Ok(0);
        }
        let n = buf.len().min(self.record.len() - self.pos);
        buf[..n].copy_from_slice(&self.record[self.pos..self.pos + n]);
        self.pos += n;
        Ok(n)
    }
}

/// The authentication failure behind an I/O error from an
/// [`OpenedReader`], if that is what it is.
#[must_use]
pub fn auth_failure(e: &io::Error) -> Option<&PeerAuthError> {
    e.get_ref()?.downcast_ref::<PeerAuthError>()
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::net::TcpListener;
    use std::thread;

    const KEY: [u8; 32] = [7; 32];

    fn pair() -> (TcpStream, TcpStream) {
        let l = TcpListener::bind("127.0.0.1:0").unwrap();
        let a = TcpStream::connect(l.local_addr().unwrap()).unwrap();
        let (b, _) = l.accept().unwrap();
        (a, b)
    }

    fn both(
        decode_key: &[u8],
        prefill_key: &[u8],
    ) -> (
        Result<SessionKeys, PeerAuthError>,
        Result<SessionKeys, PeerAuthError>,
    ) {
        let (d, p) = pair();
        let pk = PeerKey::from_bytes(prefill_key).unwrap();
        let t = thread::spawn(move || {
            handshake(&p, "decode", PeerRole::Prefill, &pk, Duration::from_secs(5))
        });
        let dk = PeerKey::from_bytes(decode_key).unwrap();
        let d_res = handshake(&d, "prefill", PeerRole::Decode, &dk, Duration::from_secs(5));
        (d_res, t.join().unwrap())
    }

    #[test]
    fn the_same_key_authenticates_both_sides() {
        let (d, p) = both(&KEY, &KEY);
        assert!(d.is_ok() && p.is_ok(), "{d:?} {p:?}");
    }

    #[test]
    fn another_key_is_refused_by_both_sides() {
        let (d, p) = both(&KEY, &[8; 32]);
        assert!(matches!(d, Err(PeerAuthError::BadProof { .. })), "{d:?}");
        assert!(matches!(p, Err(PeerAuthError::BadProof { .. })), "{p:?}");
    }

    #[test]
    fn a_stalled_peer_is_dropped_at_the_deadline() {
        let (d, _silent) = pair();
        let key = PeerKey::from_bytes(&KEY).unwrap();
        let err = handshake(
            &d,
            "prefill@x",
            PeerRole::Decode,
            &key,
            Duration::from_millis(200),
        )
        .unwrap_err();
        assert!(
            matches!(&err, PeerAuthError::Io { source, .. } if source.kind() == io::ErrorKind::TimedOut),
            "{err:?}"
        );
        assert!(err.to_string().contains("prefill@x"), "{err}");
    }

    #[test]
    fn a_peer_of_the_same_role_is_refused() {
        let (a, b) = pair();
        let key = PeerKey::from_bytes(&KEY).unwrap();
        let k2 = key.clone();
        let t = thread::spawn(move || {
            handshake(&b, "decode", PeerRole::Decode, &k2, Duration::from_secs(5))
        });
        let err =
            handshake(&a, "decode", PeerRole::Decode, &key, Duration::from_secs(5)).unwrap_err();
        assert!(matches!(err, PeerAuthError::Mismatch { .. }), "{err:?}");
        assert!(t.join().unwrap().is_err());
    }

    /// Sealed records from one side's writer, as bytes.
    fn sealed(keys: SessionKeys, chunks: &[&[u8]]) -> (Vec<u8>, OpenedReader<io::Empty>) {
        let (mut w, r) = keys.split(Vec::new(), io::empty());
        for c in chunks {
            w.write_all(c).unwrap();
            w.flush().unwrap();
        }
        (w.inner, r)
    }

    fn keys_pair() -> (SessionKeys, SessionKeys) {
        let (d, p) = both(&KEY, &KEY);
        (d.unwrap(), p.unwrap())
    }

    fn open(keys: SessionKeys, bytes: Vec<u8>) -> io::Result<Vec<u8>> {
        let (_w, mut r) = keys.split(io::sink(), io::Cursor::new(bytes));
        let mut out = Vec::new();
        r.read_to_end(&mut out).map(|_| out)
    }

    #[test]
    fn records_round_trip_across_the_record_limit() {
        let (d, p) = keys_pair();
        let big: Vec<u8> = (0..(MAX_RECORD * 2 + 17)).map(|i| i as u8).collect();
        let (bytes, _) = sealed(p, &[b"hello", &big]);
        let mut want = b"hello".to_vec();
        want.extend_from_slice(&big);
        assert_eq!(open(d, bytes).unwrap(), want);
    }

    fn refusal(result: io::Result<Vec<u8>>) -> String {
        let e = result.unwrap_err();
        auth_failure(&e)
            .unwrap_or_else(|| panic!("not an authentication failure: {e}"))
            .to_string()
    }

    #[test]
    fn an_altered_byte_is_refused() {
        let (d, p) = keys_pair();
        let (mut bytes, _) = sealed(p, &[b"first record", b"second record"]);
        bytes[6] ^= 1;
        assert!(refusal(open(d, bytes)).contains("record 0 refused"));
    }

    #[test]
    fn a_replayed_record_is_refused() {
        let (d, p) = keys_pair();
        let (bytes, _) = sealed(p, &[b"first record"]);
        let mut twice = bytes.clone();
        twice.extend_from_slice(&bytes);
        assert!(refusal(open(d, twice)).contains("record 1 refused"));
    }

    #[test]
    fn reordered_records_are_refused() {
        let (d, p) = keys_pair();
        let (bytes, _) = sealed(p, &[b"aaaa", b"bbbb"]);
        let one = 4 + 4 + TAG_LEN;
        let mut swapped = bytes[one..].to_vec();
        swapped.extend_from_slice(&bytes[..one]);
        assert!(refusal(open(d, swapped)).contains("record 0 refused"));
    }

    #[test]
    fn a_record_reflected_back_to_its_sender_is_refused() {
        let (d, _p) = keys_pair();
        let (a, b) = pair();
        // Decode's own sealed records come back to decode's reader.
        let (mut w, mut r) = d.split(a, b);
        w.write_all(b"from decode").unwrap();
        w.flush().unwrap();
        w.get_ref().shutdown(std::net::Shutdown::Write).unwrap();
        let mut out = Vec::new();
        assert!(refusal(r.read_to_end(&mut out).map(|_| out)).contains("record 0 refused"));
    }

    #[test]
    fn an_impossible_length_is_refused_before_reading_it() {
        let (d, _p) = keys_pair();
        let bytes = u32::MAX.to_le_bytes().to_vec();
        assert!(refusal(open(d, bytes)).contains("outside 1..=65536"));
    }

    #[test]
    fn key_files_are_read_as_hex_or_raw_and_short_ones_refused() {
        let dir = tempfile::tempdir().unwrap();
        let hex = dir.path().join("hex");
        std::fs::write(&hex, format!("{}\n", "ab".repeat(32))).unwrap();
        assert_eq!(&*PeerKey::from_file(&hex).unwrap().bytes, &[0xab; 32]);
        let raw = dir.path().join("raw");
        std::fs::write(&raw, [0xffu8; 40]).unwrap();
        assert_eq!(PeerKey::from_file(&raw).unwrap().bytes.len(), 40);
        let short = dir.path().join("short");
        std::fs::write(&short, "abcd").unwrap();
        let e = PeerKey::from_file(&short).unwrap_err().to_string();
        assert!(
            e.contains("short") && e.contains("2 bytes, at least 32"),
            "{e}"
        );
        let odd = dir.path().join("odd");
        std::fs::write(&odd, "a".repeat(65)).unwrap();
        let e = PeerKey::from_file(&odd).unwrap_err().to_string();
        assert!(e.contains("65 hex digits"), "{e}");
        let missing = dir.path().join("missing");
        let e = PeerKey::from_file(&missing).unwrap_err().to_string();
        assert!(e.contains("missing") && e.contains("cannot read"), "{e}");
    }
}
