//! ibverbs RDMA links (feature `rdma`): prefill writes KV straight into the
//! decode node's registered pool, then sends the manifest as the completion
//! message.
//!
//! ```text
//!  decode                                              prefill
//!  ------                                              -------
//!  PoolRegistration (pool pages, remote write)
//!  queue pair (RC), 64 receives posted
//!          ── TCP: hello {qp, psn, lid, gid, pool addr, rkey, geometry} ─▶
//!          ◀─ TCP: hello {qp, psn, lid, gid} ──────────────────────────────
//!  INIT → RTR → RTS                                     INIT → RTR → RTS
//!          ◀──────────── TCP: ready / ready ───────────▶
//!
//!  ToPrefill ── TCP: wire frame ────────────────────▶  inbox
//!                                                      ToDecode::Kv {manifest, Bytes}:
//!   pages ◀════ RDMA WRITE per contiguous run ═══════  staging buffer
//!   inbox ◀──── SEND: manifest (completion message) ── (after the WRITEs on the same
//!   Kv {manifest, Landed}                                queue pair: RC ordering means
//!                                                        the bytes are in place first)
//!   inbox ◀──── SEND: Hello / PrefillDone / PrefillFailed
//! ```
//!
//! Messages are [`super::wire`] frames (checksummed; a SEND carries at most
//! 4 KiB, a longer frame goes as several). A damaged frame that names a
//! request aborts that request on the receiving node ([`ToDecode::PrefillFailed`]
//! on decode, [`ToPrefill::Cancel`] on prefill); any other damage closes the
//! link. Every prefill → decode message travels on the queue pair, so decode sees
//! them in the order prefill sent them (a `PrefillDone` never overtakes its
//! KV). Decode → prefill orders travel on the TCP side channel, which also
//! tells each side when the other process is gone: the side channel closing,
//! or an error completion on the queue pair, delivers
//! [`Inbound::Disconnected`] once.
//!
//! A transfer whose manifest does not fit the decode pool (a destination
//! page missing or outside the pool, layers beyond the model, a payload of
//! the wrong length) is refused before anything is written; the link stays
//! up. A failed work request breaks the link for good.

mod handshake;
mod verbs;

use std::io::{Read, Write};
use std::net::TcpStream;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Mutex, PoisonError};
use std::thread::JoinHandle;
use std::time::Duration;

use crossbeam_channel::Sender;
use kvsan_sanitizer::{Manifest, PageId};

pub use crate::error::RdmaError;
pub use verbs::{
    PoolRegion, PoolRegistration, RdmaConfig, RdmaDevice, RegisteredPool, rdma_devices,
};

use self::handshake::Hello;
use self::verbs::{Backoff, QueuePairRc, RegisteredBuffer, RemotePool, SendKind, SendOp};
use super::peer_auth::{self, PeerKey, PeerRole};
use super::wire::{self, WireLimits};
use super::{
    Inbound, KvPayload, KvTransfer, LandingZone, Link, LinkDown, ToDecode, ToPrefill,
    kv_payload_len, kv_slices,
};
use crate::EngineError;
use crate::request::{ErrorKind, RequestError};

/// Bytes of one SEND (one receive slot): a flag byte, then up to 4095 bytes
/// of message. Longer messages go as several SENDs.
const SLOT: usize = 4096;
/// Receives decode keeps posted.
const RECV_DEPTH: u32 = 64;
/// Send queue depth; at most this many work requests are outstanding.
const SEND_DEPTH: u32 = 256;
/// The largest prefill → decode message reassembled: a wire frame.
const MAX_MESSAGE: usize = wire::DEFAULT_MAX_FRAME + wire::HEADER_LEN;
/// The longest one RDMA WRITE gets (contiguous runs are merged up to this).
const MAX_WRITE: u64 = 1 << 30;
/// How long a send waits for its completions before the link is declared
/// broken (the queue pair's own retries give up well before this).
const SEND_TIMEOUT: Duration = Duration::from_secs(30);
/// How long a handshake waits for each of the peer's messages: a
/// connection that never answers (not a kvsan peer) must not hold the
/// decode node's accept loop for ever.
const HANDSHAKE_TIMEOUT: Duration = Duration::from_secs(10);
const FRAGMENT_MORE: u8 = 0;
const FRAGMENT_LAST: u8 = 1;

/// Delivers [`Inbound::Disconnected`] to a node's inbox at most once.
struct DisconnectOnce<M> {
    sent: AtomicBool,
    inbox: Sender<Inbound<M>>,
}

impl<M> DisconnectOnce<M> {
    fn new(inbox: Sender<Inbound<M>>) -> Arc<Self> {
        Arc::new(DisconnectOnce {
            sent: AtomicBool::new(false),
            inbox,
        })
    }

    fn disconnect(&self, reason: String) {
        if !self.sent.swap(true, Ordering::AcqRel) {
            tracing::warn!(%reason, "RDMA link down");
            let _ = self.inbox.send(Inbound::Disconnected { reason });
        }
    }

    fn deliver(&self, msg: M) {
        if !self.sent.load(Ordering::Acquire) {
            let _ = self.inbox.send(Inbound::Message(msg));
        }
    }
}

fn peer_name(stream: &TcpStream) -> String {
    stream
        .peer_addr()
        .map_or_else(|_| "unknown peer".to_string(), |a| a.to_string())
}

/// Bounds each read of the handshake (`None` after it: the side channel then
/// waits as long as the link lives).
fn set_handshake_timeout(
    stream: &TcpStream,
    peer: &str,
    timeout: Option<Duration>,
) -> Result<(), RdmaError> {
    stream
        .set_read_timeout(timeout)
        .map_err(|e| side_err(peer, "set the handshake timeout", e))
}

fn side_err(peer: &str, op: &'static str, source: std::io::Error) -> RdmaError {
    RdmaError::SideChannel {
        peer: peer.to_string(),
        op,
        source,
    }
}

/// The side channel's two halves: the socket's bytes as they are, or —
/// with the deployment's key — authenticated records after the
/// challenge–response of [`peer_auth`], so that the connection data that
/// follows (the queue pair and, from decode, the pool's address and key)
/// reaches only a peer holding the key, and every later order is
/// authenticated.
struct SideChannel {
    reader: Box<dyn Read + Send>,
    writer: Box<dyn Write + Send>,
}

impl SideChannel {
    /// Opens the side channel on `stream` as `me`; with `auth`, the peer
    /// must prove within [`HANDSHAKE_TIMEOUT`] that it holds the key.
    fn open(
        stream: &TcpStream,
        peer: &str,
        me: PeerRole,
        auth: Option<&PeerKey>,
    ) -> Result<SideChannel, EngineError> {
        let clone = || {
            stream
                .try_clone()
                .map_err(|e| side_err(peer, "clone socket", e))
        };
        let (reader, writer) = (clone()?, clone()?);
        let Some(key) = auth else {
            return Ok(SideChannel {
                reader: Box::new(reader),
                writer: Box::new(writer),
            });
        };
        let keys = peer_auth::handshake(stream, peer, me, key, HANDSHAKE_TIMEOUT)?;
        // The handshake bounded each write by its deadline; orders later
        // wait as long as the link lives.
        stream
            .set_write_timeout(None)
            .map_err(|e| side_err(peer, "clear the handshake's write timeout", e))?;
        let (writer, reader) = keys.split(writer, reader);
        Ok(SideChannel {
            reader: Box::new(reader),
            writer: Box::new(writer),
        })
    }
}

impl Read for SideChannel {
    fn read(&mut self, buf: &mut [u8]) -> std::io::Result<usize> {
        self.reader.read(buf)
    }
}

impl Write for SideChannel {
    fn write(&mut self, buf: &[u8]) -> std::io::Result<usize> {
        self.writer.write(buf)
    }

    fn flush(&mut self) -> std::io::Result<()> {
        self.writer.flush()
    }
}

/// The decode node's end of an RDMA link: receives KV into its
/// registered pool ([`PoolRegistration`]) and messages into its inbox;
/// sends orders to prefill.
pub struct RdmaDecodeEndpoint {
    peer: String,
    landing: LandingZone,
    writer: Mutex<Box<dyn Write + Send>>,
    /// The side channel's socket, shut down when the link is dropped.
    control: TcpStream,
    stop: Arc<AtomicBool>,
    threads: Vec<JoinHandle<()>>,
}

impl std::fmt::Debug for RdmaDecodeEndpoint {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("RdmaDecodeEndpoint")
            .field("peer", &self.peer)
            .finish_non_exhaustive()
    }
}

impl RdmaDecodeEndpoint {
    /// Connects to the prefill side over `stream` (already connected, either
    /// side may have listened): offers the registered pool `pool` for RDMA
    /// WRITEs and starts delivering prefill's messages to `inbox`.
    ///
    /// With `auth`, the prefill side must first prove it holds the
    /// deployment's key: a peer that does not is refused before it learns
    /// anything about the pool, and the side channel's orders are
    /// authenticated records.
    ///
    /// The registration must outlive the link for transfers to land; if it
    /// is dropped first, prefill's writes fail (the region is gone) and the
    /// link breaks, but no memory is touched.
    ///
    /// # Errors
    /// [`EngineError::PeerAuth`] when the peer fails authentication;
    /// [`RdmaError::Verbs`] when a verbs call fails,
    /// [`RdmaError::SideChannel`] / [`RdmaError::Protocol`] when
    /// the handshake fails.
    pub fn handshake(
        stream: TcpStream,
        pool: &PoolRegion,
        inbox: Sender<Inbound<ToDecode>>,
        auth: Option<&PeerKey>,
    ) -> Result<RdmaDecodeEndpoint, EngineError> {
        let peer = peer_name(&stream);
        let mut side = SideChannel::open(&stream, &peer, PeerRole::Decode, auth)?;
        set_handshake_timeout(&stream, &peer, Some(HANDSHAKE_TIMEOUT))?;
        let device = pool.device();
        let remote = pool.remote();
        let landing = pool.landing_zone();
        let mut qp = QueuePairRc::new(device, 1, RECV_DEPTH)?;
        let slots = RegisteredBuffer::new(device, SLOT * RECV_DEPTH as usize)?;
        for slot in 0..RECV_DEPTH {
            // SAFETY: slot `slot` of `slots` is handed to the NIC here and
            // touched again only after its receive completes; `slots` moves
            // into the receiver, which drops the queue pair before it.
            unsafe { qp.post_recv(u64::from(slot), &slots, slot as usize * SLOT, SLOT as u32) }?;
        }
        let mine = Hello::Decode {
            qp: qp.endpoint(),
            pool: remote,
        };
        let Hello::Prefill { qp: theirs } = handshake::exchange(&mut side, &peer, &mine)? else {
            return Err(RdmaError::Protocol {
                peer,
                what: "the peer answered as a decode node".into(),
            }
            .into());
        };
        qp.connect(&theirs)?;
        handshake::ready(&mut side, &peer)?;
        set_handshake_timeout(&stream, &peer, None)?;

        let stop = Arc::new(AtomicBool::new(false));
        let link = DisconnectOnce::new(inbox);
        let mut receiver = Receiver {
            qp,
            slots,
            link: Arc::clone(&link),
            stop: Arc::clone(&stop),
            message: Vec::new(),
        };
        let recv_thread = std::thread::Builder::new()
            .name("rdma-decode-recv".into())
            .spawn(move || receiver.run())
            .map_err(|e| side_err(&peer, "start receive thread", e))?;
        let SideChannel {
            reader: mut watch,
            writer,
        } = side;
        let watch_stop = Arc::clone(&stop);
        let watch_peer = peer.clone();
        let watch_thread = std::thread::Builder::new()
            .name("rdma-decode-side".into())
            .spawn(move || {
                // Prefill sends nothing on the side channel after the
                // handshake: any read result means the link is over.
                let mut b = [0u8; 1];
                let reason = match watch.read(&mut b) {
                    Ok(0) => format!("prefill {watch_peer} closed the side channel"),
                    Ok(_) => format!("prefill {watch_peer} sent unexpected side-channel data"),
                    Err(e) => format!("side channel to prefill {watch_peer}: {e}"),
                };
                if !watch_stop.swap(true, Ordering::AcqRel) {
                    link.disconnect(reason);
                }
            })
            .map_err(|e| side_err(&peer, "start side-channel thread", e))?;
        Ok(RdmaDecodeEndpoint {
            peer,
            landing,
            writer: Mutex::new(writer),
            control: stream,
            stop,
            threads: vec![recv_thread, watch_thread],
        })
    }
}

impl RdmaDecodeEndpoint {
    /// The registered range this link offered prefill: the decode node
    /// accepts [`KvPayload::Landed`] on the link only if it is its own pool's.
    pub(crate) fn landing_zone(&self) -> LandingZone {
        self.landing
    }

    /// The prefill node's address.
    #[must_use]
    pub fn peer(&self) -> &str {
        &self.peer
    }
}

impl Link<ToPrefill> for RdmaDecodeEndpoint {
    fn send(&self, msg: ToPrefill) -> Result<(), LinkDown> {
        let down = |reason: String| LinkDown {
            peer: self.peer.clone(),
            reason,
        };
        if self.stop.load(Ordering::Acquire) {
            return Err(down("the link is closed".into()));
        }
        let mut w = self.writer.lock().unwrap_or_else(PoisonError::into_inner);
        wire::write_frame(&mut *w, &msg).map_err(|e| down(e.to_string()))?;
        w.flush()
            .map_err(|e| down(format!("sending an order failed: {e}")))
    }
}

impl Drop for RdmaDecodeEndpoint {
    fn drop(&mut self) {
        self.stop.store(true, Ordering::Release);
        let _ = self.control.shutdown(std::net::Shutdown::Both);
        for t in self.threads.drain(..) {
            let _ = t.join();
        }
    }
}

/// Decode's receive loop: owns the queue pair and its receive slots.
struct Receiver {
    // Field order is drop order: the queue pair before the buffers it may
    // still be writing.
    qp: QueuePairRc,
    slots: RegisteredBuffer,
    link: Arc<DisconnectOnce<ToDecode>>,
    stop: Arc<AtomicBool>,
    message: Vec<u8>,
}

impl Receiver {
    fn run(&mut self) {
        let mut done = Vec::new();
        let mut backoff = Backoff::default();
        while !self.stop.load(Ordering::Acquire) {
            done.clear();
            if let Err(e) = self.qp.poll_recv(&mut done) {
                self.fail(e.to_string());
                return;
            }
            if done.is_empty() {
                backoff.wait();
                continue;
            }
            backoff.reset();
            for c in std::mem::take(&mut done) {
                if let Err(reason) = self.on_completion(c) {
                    self.fail(reason);
                    return;
                }
            }
        }
    }

    fn fail(&mut self, reason: String) {
        if !self.stop.swap(true, Ordering::AcqRel) {
            self.link.disconnect(reason);
        }
        self.qp.set_error();
    }

    fn on_completion(&mut self, c: verbs::Completion) -> Result<(), String> {
        if !c.is_success() {
            return Err(format!("receive completed with {}", c.status_name()));
        }
        let slot = usize::try_from(c.wr_id)
            .ok()
            .filter(|&s| s < RECV_DEPTH as usize)
            .ok_or_else(|| format!("completion for unknown receive {}", c.wr_id))?;
        let len = c.byte_len as usize;
        if len == 0 || len > SLOT {
            return Err(format!(
                "a message fragment of {len} bytes (expected 1 to {SLOT})"
            ));
        }
        let at = slot * SLOT;
        let frag = self.slots.bytes(at..at + len);
        let (flag, body) = (frag[0], &frag[1..]);
        if self.message.len() + body.len() > MAX_MESSAGE {
            return Err(format!(
                "a message longer than the limit of {MAX_MESSAGE} bytes"
            ));
        }
        self.message.extend_from_slice(body);
        // SAFETY: the slot's bytes were copied out above and nothing else
        // reads or writes them until this receive completes; `slots` lives
        // as long as the queue pair (field order of `Receiver`).
        unsafe { self.qp.post_recv(c.wr_id, &self.slots, at, SLOT as u32) }
            .map_err(|e| e.to_string())?;
        match flag {
            FRAGMENT_MORE => Ok(()),
            FRAGMENT_LAST => {
                let bytes = std::mem::take(&mut self.message);
                match wire::read_frame::<ToDecode, _>(&mut bytes.as_slice(), &WireLimits::default())
                {
                    Ok(Some(msg)) => self.link.deliver(msg),
                    Ok(None) => return Err("an empty message from prefill".into()),
                    Err(e) if wire::frame_fault_keeps_stream(&e) => {
                        // One damaged message: abort the request it names.
                        let subject = wire::frame_fault_subject(&e);
                        tracing::error!(error = %e, "damaged message from prefill over RDMA");
                        if let Some((_, Some(request))) = subject {
                            self.link.deliver(ToDecode::PrefillFailed {
                                request,
                                error: RequestError::new(
                                    ErrorKind::Transport,
                                    format!("damaged completion message from prefill: {e}"),
                                ),
                            });
                        }
                    }
                    Err(e) => return Err(format!("malformed message from prefill: {e}")),
                }
                Ok(())
            }
            f => Err(format!("fragment flag {f} (expected 0 or 1)")),
        }
    }
}

/// One RDMA WRITE of a transfer: `len` bytes from the staging buffer at
/// `local` to the decode pool at `remote`.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
struct WriteRun {
    local: u64,
    remote: u64,
    len: u64,
}

/// The RDMA WRITEs that put a payload in [`super::kv_slices`] order into
/// the decode pool: per page, per layer, K then V of the slots carried —
/// runs that are contiguous on both sides merged (a full page is one run,
/// consecutive full pages one run).
///
/// Refuses a manifest that does not fit `pool` or a payload of the wrong
/// length, before anything is written.
fn plan_writes(
    manifest: &Manifest,
    pool: &RemotePool,
    payload_len: usize,
) -> Result<Vec<WriteRun>, String> {
    let g = &pool.geometry;
    let layers = manifest.layers.start as usize..manifest.layers.end as usize;
    if layers.end > g.n_layers || layers.start > layers.end {
        return Err(format!(
            "layers {layers:?} outside the decode pool's {} layers",
            g.n_layers
        ));
    }
    let expected = kv_payload_len(manifest, g.slot_width());
    if payload_len != expected {
        return Err(format!(
            "payload of {payload_len} bytes, the manifest ({} tokens × {} layers) needs {expected}",
            manifest.tokens,
            layers.len()
        ));
    }
    let mut runs: Vec<WriteRun> = Vec::new();
    let mut local = 0u64;
    for (idx, slots) in kv_slices(manifest, g.page_slots) {
        let Some(page) = manifest.dst_pages.get(idx) else {
            return Err(format!(
                "tokens {}..{} need destination page {idx}, the manifest has {}",
                manifest.first_token,
                u64::from(manifest.first_token) + u64::from(manifest.tokens),
                manifest.dst_pages.len()
            ));
        };
        if page.page.0 >= pool.n_pages {
            return Err(format!(
                "destination {} outside the decode pool of {} pages",
                page.page, pool.n_pages
            ));
        }
        let len = (slots.len() * g.slot_width() * 2) as u64;
        for layer in layers.clone() {
            for kv in 0..2 {
                let offset = g.offset(PageId(page.page.0), layer, kv, slots.start) as u64 * 2;
                if offset + len > pool.len {
                    return Err(format!(
                        "bytes {offset}..{} outside the registered {} bytes",
                        offset + len,
                        pool.len
                    ));
                }
                let remote = pool.addr + offset;
                match runs.last_mut() {
                    Some(r)
                        if r.remote + r.len == remote
                            && r.local + r.len == local
                            && r.len + len <= MAX_WRITE =>
                    {
                        r.len += len;
                    }
                    _ => runs.push(WriteRun { local, remote, len }),
                }
                local += len;
            }
        }
    }
    Ok(runs)
}

/// The prefill node's end of an RDMA link: writes KV into decode's pool and
/// sends messages; receives decode's orders into its inbox.
pub struct RdmaPrefillEndpoint {
    peer: String,
    remote: RemotePool,
    sender: Mutex<PrefillSender>,
    link: Arc<DisconnectOnce<ToPrefill>>,
    stop: Arc<AtomicBool>,
    control: TcpStream,
    reader: Option<JoinHandle<()>>,
}

impl std::fmt::Debug for RdmaPrefillEndpoint {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("RdmaPrefillEndpoint")
            .field("peer", &self.peer)
            .field("remote", &self.remote)
            .finish_non_exhaustive()
    }
}

/// What one send needs, under the endpoint's lock.
struct PrefillSender {
    // Field order is drop order: the queue pair before the buffers its work
    // requests read.
    qp: QueuePairRc,
    staging: RegisteredBuffer,
    outbox: RegisteredBuffer,
    device: Arc<RdmaDevice>,
    next_wr: u64,
    /// Why the link broke, once it has.
    broken: Option<String>,
}

impl RdmaPrefillEndpoint {
    /// Connects to the decode side over `stream` (already connected, either
    /// side may have listened) using `device`, and starts delivering decode's
    /// orders to `inbox`. With `auth`, the decode side must first prove it
    /// holds the deployment's key, as in [`RdmaDecodeEndpoint::handshake`].
    ///
    /// # Errors
    /// [`EngineError::PeerAuth`] when the peer fails authentication;
    /// [`RdmaError::Verbs`] when a verbs call fails,
    /// [`RdmaError::SideChannel`] / [`RdmaError::Protocol`] when
    /// the handshake fails.
    pub fn handshake(
        stream: TcpStream,
        device: &Arc<RdmaDevice>,
        inbox: Sender<Inbound<ToPrefill>>,
        auth: Option<&PeerKey>,
    ) -> Result<RdmaPrefillEndpoint, EngineError> {
        let peer = peer_name(&stream);
        let mut side = SideChannel::open(&stream, &peer, PeerRole::Prefill, auth)?;
        set_handshake_timeout(&stream, &peer, Some(HANDSHAKE_TIMEOUT))?;
        let mut qp = QueuePairRc::new(device, SEND_DEPTH, 1)?;
        let mine = Hello::Prefill { qp: qp.endpoint() };
        let Hello::Decode { qp: theirs, pool } = handshake::exchange(&mut side, &peer, &mine)?
        else {
            return Err(RdmaError::Protocol {
                peer,
                what: "the peer answered as a prefill node".into(),
            }
            .into());
        };
        qp.connect(&theirs)?;
        handshake::ready(&mut side, &peer)?;
        set_handshake_timeout(&stream, &peer, None)?;
        let sender = PrefillSender {
            qp,
            staging: RegisteredBuffer::new(device, 1 << 20)?,
            outbox: RegisteredBuffer::new(device, SLOT * 16)?,
            device: Arc::clone(device),
            next_wr: 0,
            broken: None,
        };
        let stop = Arc::new(AtomicBool::new(false));
        let link = DisconnectOnce::new(inbox);
        // Decode's orders; prefill sends nothing on the side channel after
        // the handshake (its messages go over the queue pair).
        let mut reader_stream = side.reader;
        let reader_link = Arc::clone(&link);
        let reader_stop = Arc::clone(&stop);
        let reader_peer = peer.clone();
        let reader = std::thread::Builder::new()
            .name("rdma-prefill-side".into())
            .spawn(move || {
                let limits = WireLimits::default();
                let reason = loop {
                    match wire::read_frame::<ToPrefill, _>(&mut reader_stream, &limits) {
                        Ok(Some(msg)) => reader_link.deliver(msg),
                        Ok(None) => break format!("decode {reader_peer} closed the side channel"),
                        Err(e) if wire::frame_fault_keeps_stream(&e) => {
                            // One damaged order: stop the request it names.
                            tracing::error!(peer = %reader_peer, error = %e, "damaged order from decode");
                            if let Some((_, Some(request))) = wire::frame_fault_subject(&e) {
                                reader_link.deliver(ToPrefill::Cancel { request });
                            }
                        }
                        Err(e) => break format!("side channel to decode {reader_peer}: {e}"),
                    }
                };
                if !reader_stop.load(Ordering::Acquire) {
                    reader_link.disconnect(reason);
                }
            })
            .map_err(|e| side_err(&peer, "start side-channel thread", e))?;
        Ok(RdmaPrefillEndpoint {
            peer,
            remote: pool,
            sender: Mutex::new(sender),
            link,
            stop,
            control: stream,
            reader: Some(reader),
        })
    }

    fn down(&self, reason: String) -> LinkDown {
        LinkDown {
            peer: self.peer.clone(),
            reason,
        }
    }
}

/// Connects to a decode node whose side channel listens at `addr`
/// (retrying refused connections for up to `retry_for`, as
/// [`super::tcp::connect`]) and runs the prefill handshake on `device`,
/// authenticated with `auth` when given.
/// Returns the link and the inbox decode's orders arrive in.
///
/// # Errors
/// [`EngineError::TcpConnect`] when no connection was made in time; as
/// [`RdmaPrefillEndpoint::handshake`].
pub fn connect_prefill(
    addr: impl std::net::ToSocketAddrs + std::fmt::Display,
    retry_for: Duration,
    device: &Arc<RdmaDevice>,
    auth: Option<&PeerKey>,
) -> Result<
    (
        RdmaPrefillEndpoint,
        crossbeam_channel::Receiver<Inbound<ToPrefill>>,
    ),
    EngineError,
> {
    let stream = super::tcp::connect(addr, retry_for)?;
    let (tx, rx) = crossbeam_channel::unbounded();
    Ok((
        RdmaPrefillEndpoint::handshake(stream, device, tx, auth)?,
        rx,
    ))
}

impl Link<ToDecode> for RdmaPrefillEndpoint {
    fn send(&self, msg: ToDecode) -> Result<(), LinkDown> {
        let mut s = self.sender.lock().unwrap_or_else(PoisonError::into_inner);
        if let Some(reason) = &s.broken {
            return Err(self.down(reason.clone()));
        }
        let runs = match &msg {
            ToDecode::Kv(t) => match &t.payload {
                KvPayload::Bytes(bytes) => {
                    let runs =
                        plan_writes(&t.manifest, &self.remote, bytes.len()).map_err(|e| {
                            self.down(format!("KV transfer refused, nothing sent: {e}"))
                        })?;
                    s.stage(bytes).map_err(|e| self.down(e.to_string()))?;
                    runs
                }
                KvPayload::Landed => {
                    return Err(self.down(
                        "a KV transfer over RDMA must carry its bytes (KvPayload::Bytes)".into(),
                    ));
                }
            },
            _ => Vec::new(),
        };
        // The completion message: the manifest alone, its bytes already sent.
        let notice = match msg {
            // The sender's landing digests go with it: decode verifies what
            // the WRITEs put in its pages against them.
            ToDecode::Kv(t) => ToDecode::Kv(KvTransfer {
                manifest: t.manifest,
                payload: KvPayload::Landed,
                digests: t.digests,
            }),
            other => other,
        };
        let message = wire::encode(&notice).map_err(|e| self.down(e.to_string()))?;
        if let Err(reason) = s.transmit(&runs, &message, &self.remote) {
            s.broken = Some(reason.clone());
            s.qp.set_error();
            drop(s);
            if !self.stop.load(Ordering::Acquire) {
                self.link.disconnect(reason.clone());
            }
            return Err(self.down(reason));
        }
        Ok(())
    }
}

impl PrefillSender {
    /// Copies the payload into the staging buffer, growing it if needed.
    fn stage(&mut self, bytes: &[u8]) -> Result<(), RdmaError> {
        if self.staging.len() < bytes.len() {
            let len = bytes.len().max(self.staging.len() * 2);
            self.staging = RegisteredBuffer::new(&self.device, len)?;
        }
        self.staging.bytes_mut()[..bytes.len()].copy_from_slice(bytes);
        Ok(())
    }

    /// Writes `runs` from the staging buffer, then sends `message` in
    /// fragments, and waits until every work request has completed.
    fn transmit(
        &mut self,
        runs: &[WriteRun],
        message: &[u8],
        remote: &RemotePool,
    ) -> Result<(), String> {
        let frag_len = SLOT - 1;
        let n_frags = message.len().div_ceil(frag_len).max(1);
        if self.outbox.len() < n_frags * SLOT {
            self.outbox =
                RegisteredBuffer::new(&self.device, n_frags * SLOT).map_err(|e| e.to_string())?;
        }
        let (staging_addr, staging_lkey) = self.staging.sge(0);
        let mut ops = Vec::with_capacity(runs.len() + n_frags);
        for r in runs {
            ops.push(SendOp {
                wr_id: 0,
                kind: SendKind::Write {
                    remote_addr: r.remote,
                    rkey: remote.rkey,
                },
                addr: staging_addr + r.local,
                lkey: staging_lkey,
                // plan_writes caps runs at MAX_WRITE (1 GiB).
                len: r.len as u32,
                signaled: false,
            });
        }
        for i in 0..n_frags {
            let body = &message
                [(i * frag_len).min(message.len())..((i + 1) * frag_len).min(message.len())];
            let at = i * SLOT;
            let outbox = self.outbox.bytes_mut();
            outbox[at] = if i + 1 == n_frags {
                FRAGMENT_LAST
            } else {
                FRAGMENT_MORE
            };
            outbox[at + 1..at + 1 + body.len()].copy_from_slice(body);
            let (addr, lkey) = self.outbox.sge(at);
            ops.push(SendOp {
                wr_id: 0,
                kind: SendKind::Send,
                addr,
                lkey,
                len: (1 + body.len()) as u32,
                signaled: false,
            });
        }
        for chunk in ops.chunks_mut(SEND_DEPTH as usize / 2) {
            for op in chunk.iter_mut() {
                self.next_wr += 1;
                op.wr_id = self.next_wr;
            }
            let last = chunk.len() - 1;
            chunk[last].signaled = true;
            // SAFETY: every op's range lies in `staging` (offsets from
            // plan_writes, within the staged payload) or `outbox` (one slot
            // per fragment), both registered on this device. Neither buffer
            // is touched until `wait_send` below has seen this chunk's last
            // (signaled) completion, which on an RC queue pair means all of
            // the chunk's requests are done; on an error the queue pair is
            // moved to the error state and the buffers are kept until it is
            // dropped (field order of `PrefillSender`).
            unsafe { self.qp.post_send(chunk) }.map_err(|e| e.to_string())?;
            self.qp.wait_send(chunk[last].wr_id, SEND_TIMEOUT)?;
        }
        Ok(())
    }
}

impl Drop for RdmaPrefillEndpoint {
    fn drop(&mut self) {
        self.stop.store(true, Ordering::Release);
        let _ = self.control.shutdown(std::net::Shutdown::Both);
        if let Some(t) = self.reader.take() {
            let _ = t.join();
        }
    }
}

#[cfg(test)]
mod tests {
    use half::f16;
    use kvsan_kernels::attention::KvGeometry;
    use kvsan_sanitizer::{Generation, Owner, PageRef, PoolId};

    use super::*;
    use crate::kv_pool::KvPool;

    fn geometry() -> KvGeometry {
        KvGeometry {
            page_slots: 4,
            n_layers: 3,
            n_kv_heads: 2,
            head_dim: 3,
        }
    }

    fn remote(pool: &KvPool, addr: u64) -> RemotePool {
        RemotePool {
            addr,
            len: pool.data().len() as u64 * 2,
            rkey: 1,
            geometry: *pool.geometry(),
            n_pages: pool.n_pages() as u32,
        }
    }

    /// A source pool with distinct values everywhere, and the payload of
    /// `manifest` packed from it.
    fn source(manifest: &Manifest) -> Vec<u8> {
        let mut src = KvPool::new(geometry(), 8).unwrap();
        for (i, v) in src.data_mut().iter_mut().enumerate() {
            *v = f16::from_f32(i as f32 * 0.25 + 1.0);
        }
        let mut bytes = Vec::new();
        for (idx, slots) in kv_slices(manifest, geometry().page_slots) {
            let layers = manifest.layers.start as usize..manifest.layers.end as usize;
            src.pack_slots(manifest.src_pages[idx].page, slots, layers, &mut bytes);
        }
        bytes
    }

    fn manifest(
        dst: &[u32],
        first_token: u32,
        tokens: u32,
        layers: std::ops::Range<u32>,
    ) -> Manifest {
        let refs = |ps: &[u32]| {
            ps.iter()
                .map(|&p| PageRef {
                    page: PageId(p),
                    generation: Generation(1),
                })
                .collect::<Vec<_>>()
        };
        Manifest {
            request: Owner::new(1, 0),
            src_pool: PoolId(0),
            src_pages: refs(&[5, 1, 7, 2]),
            dst_pool: PoolId(1),
            dst_pages: refs(dst),
            first_token,
            tokens,
            layers,
            checksum: 0,
        }
    }

    /// Applies the planned writes to a pool, as the NIC would.
    fn land(runs: &[WriteRun], payload: &[u8], pool: &mut KvPool, base: u64) {
        let mut image: Vec<u8> = pool
            .data()
            .iter()
            .flat_map(|v| v.to_bits().to_le_bytes())
            .collect();
        for r in runs {
            let at = (r.remote - base) as usize;
            let from = r.local as usize;
            image[at..at + r.len as usize].copy_from_slice(&payload[from..from + r.len as usize]);
        }
        for (v, b) in pool.data_mut().iter_mut().zip(image.chunks_exact(2)) {
            *v = f16::from_bits(u16::from_le_bytes([b[0], b[1]]));
        }
    }

    fn landed_bytes(pool: &KvPool, m: &Manifest) -> Vec<u8> {
        let mut out = Vec::new();
        for (idx, slots) in kv_slices(m, geometry().page_slots) {
            let layers = m.layers.start as usize..m.layers.end as usize;
            pool.pack_slots(m.dst_pages[idx].page, slots, layers, &mut out);
        }
        out
    }

    #[test]
    fn planned_writes_land_every_byte_where_unpack_would_put_it() {
        let base = 0x10_0000;
        // Partial first page, two full pages, partial last; all layers, then a sub-range.
        for (first, tokens, layers) in [
            (1u32, 13u32, 0..3),
            (0, 16, 0..3),
            (2, 1, 1..2),
            (4, 8, 1..3),
        ] {
            let m = manifest(&[6, 0, 3, 4], first, tokens, layers);
            let payload = source(&m);
            let mut dst = KvPool::new(geometry(), 8).unwrap();
            let runs = plan_writes(&m, &remote(&dst, base), payload.len()).unwrap();
            land(&runs, &payload, &mut dst, base);
            assert_eq!(landed_bytes(&dst, &m), payload, "tokens {first}+{tokens}");
            // The same bytes through the TCP path's unpack.
            let mut expect = KvPool::new(geometry(), 8).unwrap();
            let mut at = 0;
            for (idx, slots) in kv_slices(&m, geometry().page_slots) {
                let layers = m.layers.start as usize..m.layers.end as usize;
                at += expect
                    .unpack_slots(m.dst_pages[idx].page, slots, layers, &payload[at..])
                    .unwrap();
            }
            assert_eq!(dst.data(), expect.data(), "tokens {first}+{tokens}");
        }
    }

    #[test]
    fn full_adjacent_pages_are_one_write() {
        let m = manifest(&[2, 3, 4, 0], 0, 12, 0..3);
        let dst = KvPool::new(geometry(), 8).unwrap();
        let runs = plan_writes(&m, &remote(&dst, 0), source(&m).len()).unwrap();
        let page_bytes = geometry().page_elems() as u64 * 2;
        assert_eq!(
            runs,
            vec![WriteRun {
                local: 0,
                remote: 2 * page_bytes,
                len: 3 * page_bytes
            }]
        );
    }

    #[test]
    fn a_partial_page_is_one_write_per_layer_and_kv() {
        let m = manifest(&[2], 0, 3, 0..3);
        let dst = KvPool::new(geometry(), 8).unwrap();
        let runs = plan_writes(&m, &remote(&dst, 0), source(&m).len()).unwrap();
        assert_eq!(runs.len(), 3 * 2);
    }

    #[test]
    fn manifests_that_do_not_fit_the_decode_pool_are_refused() {
        let dst = KvPool::new(geometry(), 8).unwrap();
        let r = remote(&dst, 0);
        let m = manifest(&[1, 2], 0, 12, 0..3);
        let err = plan_writes(&m, &r, kv_payload_len(&m, 6)).unwrap_err();
        assert!(
            err.contains("need destination page 2, the manifest has 2"),
            "{err}"
        );
        let m = manifest(&[1, 9], 0, 8, 0..3);
        let err = plan_writes(&m, &r, kv_payload_len(&m, 6)).unwrap_err();
        assert!(err.contains("outside the decode pool of 8 pages"), "{err}");
        let m = manifest(&[1], 0, 4, 0..4);
        let err = plan_writes(&m, &r, kv_payload_len(&m, 6)).unwrap_err();
        assert!(err.contains("outside the decode pool's 3 layers"), "{err}");
        let m = manifest(&[1], 0, 4, 0..3);
        let err = plan_writes(&m, &r, kv_payload_len(&m, 6) - 2).unwrap_err();
        assert!(err.contains("needs 288"), "{err}");
    }
}
