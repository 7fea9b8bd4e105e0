//! Links between a prefill and a decode process over one TCP connection,
//! carrying [`wire`] frames both ways.
//!
//! ```text
//!   node ── send(msg) ──▶ TcpLink ──queue──▶ writer thread ──frames──▶ socket ──▶ peer
//!                                              │ idle `heartbeat` → heartbeat frame
//!                                              ▲ abort notices for damaged frames
//!   node ◀── inbox ◀── reader thread ◀──frames── socket ◀── peer
//!             Inbound::Message(m)          read timeout `peer_timeout`
//!             Inbound::Disconnected{..}    (once, then the thread ends)
//! ```
//!
//! A link behaves as the in-process one for its users: `send` queues and
//! returns, the inbox receives the peer's messages in order, and a broken
//! connection is reported once as [`Inbound::Disconnected`]. What TCP adds:
//!
//! - **A damaged frame aborts one request, not the link.** A frame whose
//!   header is sound but whose payload fails its checksum or cannot be
//!   decoded is skipped whole (framing holds) and logged with the peer, the
//!   message type and the request — never its bytes. When the header names a
//!   request, both nodes are told to abort it: the local inbox receives
//!   [`ToDecode::PrefillFailed`] (on decode) or [`ToPrefill::Cancel`] (on
//!   prefill), and the peer is sent the matching notice. A damaged frame
//!   that names no request is dropped, except a damaged hello, without which
//!   the link cannot be used: that closes it.
//! - **A damaged header closes the link** (bad magic, unsupported version,
//!   header checksum, oversize, truncation): framing is lost.
//! - **A dead peer is noticed in bounded time.** A closed or reset socket is
//!   seen at once; a peer that hangs or vanishes without closing sends no
//!   heartbeat, and the read times out after `peer_timeout` (default 3 s;
//!   each side sends a heartbeat after `heartbeat`, default 500 ms, without
//!   traffic).
//! - **Dropping a [`TcpLink`] closes the connection** after the queued
//!   messages are written; the peer's inbox then receives `Disconnected`.
//! - **With a peer key ([`TcpOptions::auth`]) the peer proves it holds the
//!   key before any frame moves**, and every byte after that travels in
//!   HMAC-tagged records ([`peer_auth`]). A peer that fails the handshake
//!   is refused before a link exists (the caller gets the error naming its
//!   address and why); a record that fails its tag — altered, replayed,
//!   reordered — closes the link, which is reported as `Disconnected` with
//!   that reason.

use std::fmt;
use std::io::{self, Read, Write};
use std::net::{Shutdown, SocketAddr, TcpListener, TcpStream, ToSocketAddrs};
use std::sync::{Arc, Mutex, PoisonError};
use std::thread;
use std::time::{Duration, Instant};

use crossbeam_channel::{Receiver, RecvTimeoutError, Sender, unbounded};
use kvsan_sanitizer::RequestId;

use super::peer_auth::{self, PeerKey, PeerRole};
use super::wire::{self, WireError, WireLimits, WireMessage};
use super::{Inbound, Link, LinkDown, ToDecode, ToPrefill};
use crate::error::EngineError;
use crate::request::{ErrorKind, RequestError};

/// How a TCP link behaves.
#[derive(Clone, Debug)]
pub struct TcpOptions {
    /// What the reader accepts (largest frame; `kv_dim` is learned from the
    /// peer's hello when not set here).
    pub limits: WireLimits,
    /// A heartbeat is sent after this long without sending anything.
    pub heartbeat: Duration,
    /// The peer is declared dead after this long without receiving a byte
    /// (and a write that makes no progress for this long fails).
    pub peer_timeout: Duration,
    /// The deployment's key: with one, the peer must prove it holds the
    /// same key within `handshake_deadline` and every frame is
    /// authenticated; without one, the link is open to whoever connects.
    pub auth: Option<PeerKey>,
    /// How long a peer has to finish the authenticated handshake.
    pub handshake_deadline: Duration,
}

impl Default for TcpOptions {
    /// 64 MiB frames, a heartbeat every 500 ms, a dead peer noticed in 3 s,
    /// no authentication (5 s to finish the handshake once a key is set).
    fn default() -> Self {
        TcpOptions {
            limits: WireLimits::default(),
            heartbeat: Duration::from_millis(500),
            peer_timeout: Duration::from_secs(3),
            auth: None,
            handshake_deadline: peer_auth::DEFAULT_HANDSHAKE_DEADLINE,
        }
    }
}

/// The decode side of a connection: its link to prefill and its inbox.
pub type DecodeEnd = (TcpLink<ToPrefill>, Receiver<Inbound<ToDecode>>);
/// The prefill side of a connection: its link to decode and its inbox.
pub type PrefillEnd = (TcpLink<ToDecode>, Receiver<Inbound<ToPrefill>>);

/// What goes to the writer thread.
enum Outgoing<M> {
    /// A frame: its header and fields, and the message for its bulk bytes.
    Frame { head: Vec<u8>, msg: M },
    /// Write what was queued before, then close the connection.
    Close,
}

/// State both threads and the link see.
#[derive(Debug, Default)]
struct Shared {
    /// Why the connection is down, once it is.
    down: Mutex<Option<String>>,
}

impl Shared {
    fn down_reason(&self) -> Option<String> {
        self.down
            .lock()
            .unwrap_or_else(PoisonError::into_inner)
            .clone()
    }

    /// Records the first reason the connection went down.
    fn set_down(&self, reason: &str) {
        let mut d = self.down.lock().unwrap_or_else(PoisonError::into_inner);
        if d.is_none() {
            *d = Some(reason.to_string());
        }
    }
}

/// The sending half of a TCP link carrying messages of type `M`.
pub struct TcpLink<M> {
    peer: String,
    queue: Sender<Outgoing<M>>,
    shared: Arc<Shared>,
    max_frame: usize,
}

impl<M> fmt::Debug for TcpLink<M> {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("TcpLink")
            .field("peer", &self.peer)
            .field("down", &self.shared.down_reason())
            .finish_non_exhaustive()
    }
}

impl<M> TcpLink<M> {
    /// The peer, as logs name it (`prefill@127.0.0.1:7001`).
    #[must_use]
    pub fn peer(&self) -> &str {
        &self.peer
    }

    /// Why the connection is down, or `None` while it is up.
    #[must_use]
    pub fn down_reason(&self) -> Option<String> {
        self.shared.down_reason()
    }
}

impl<M: WireMessage> Link<M> for TcpLink<M> {
    /// Queues `msg` for the writer thread. An oversize message is refused
    /// here (the link stays up); a message queued just before the
    /// connection breaks is lost, and the inbox reports the break.
    fn send(&self, msg: M) -> Result<(), LinkDown> {
        let down = |reason: String| LinkDown {
            peer: self.peer.clone(),
            reason,
        };
        if let Some(reason) = self.shared.down_reason() {
            return Err(down(reason));
        }
        let head = wire::frame_head(&msg).map_err(|e| down(e.to_string()))?;
        let len = (head.len() - wire::HEADER_LEN) as u64 + msg.bulk().map_or(0, |b| b.len() as u64);
        if len > self.max_frame as u64 {
            let e = WireError::FrameTooLarge {
                msg_type: msg.msg_type(),
                len,
                limit: self.max_frame as u64,
            };
            tracing::warn!(peer = %self.peer, request = ?msg.request().map(|r| r.0), "not sent: {e}");
            return Err(down(e.to_string()));
        }
        self.queue.send(Outgoing::Frame { head, msg }).map_err(|_| {
            down(
                self.shared
                    .down_reason()
                    .unwrap_or_else(|| "the writer has stopped".into()),
            )
        })
    }
}

impl<M> Drop for TcpLink<M> {
    fn drop(&mut self) {
        let _ = self.queue.send(Outgoing::Close);
    }
}

/// What one side receives, and how it and its peer are told to abort a
/// request whose frame arrived damaged.
trait Inbox: WireMessage {
    /// What this side sends.
    type Reply: WireMessage;
    /// The peer's role, for logs.
    const PEER_ROLE: &'static str;
    /// This side's role in the authenticated handshake.
    const ROLE: PeerRole;
    /// The local notice that aborts `request`.
    fn local_abort(request: RequestId, error: RequestError) -> Self;
    /// The notice that makes the peer abort `request`.
    fn peer_abort(request: RequestId, error: RequestError) -> Self::Reply;
    /// Learns from a message what later frames are checked against.
    fn observe(&self, _limits: &mut WireLimits) {}
}

impl Inbox for ToDecode {
    type Reply = ToPrefill;
    const PEER_ROLE: &'static str = "prefill";
    const ROLE: PeerRole = PeerRole::Decode;
    fn local_abort(request: RequestId, error: RequestError) -> Self {
        ToDecode::PrefillFailed { request, error }
    }
    fn peer_abort(request: RequestId, _error: RequestError) -> ToPrefill {
        ToPrefill::Cancel { request }
    }
    fn observe(&self, limits: &mut WireLimits) {
        if let ToDecode::Hello(info) = self {
            limits.kv_dim = Some(info.kv_dim);
        }
    }
}

impl Inbox for ToPrefill {
    type Reply = ToDecode;
    const PEER_ROLE: &'static str = "decode";
    const ROLE: PeerRole = PeerRole::Prefill;
    fn local_abort(request: RequestId, _error: RequestError) -> Self {
        ToPrefill::Cancel { request }
    }
    fn peer_abort(request: RequestId, error: RequestError) -> ToDecode {
        ToDecode::PrefillFailed { request, error }
    }
}

/// Starts the decode side of the link over a connected `stream` (after the
/// authenticated handshake when `opts.auth` is set).
///
/// # Errors
/// [`WireError::Io`] when the socket cannot be configured or cloned;
/// [`PeerAuthError`](peer_auth::PeerAuthError) when the peer fails the
/// handshake.
pub fn decode_end(stream: TcpStream, opts: &TcpOptions) -> Result<DecodeEnd, EngineError> {
    open::<ToDecode>(stream, opts)
}

/// Starts the prefill side of the link over a connected `stream`, as
/// [`decode_end`].
///
/// # Errors
/// As [`decode_end`].
pub fn prefill_end(stream: TcpStream, opts: &TcpOptions) -> Result<PrefillEnd, EngineError> {
    open::<ToPrefill>(stream, opts)
}

/// Connects to a decode node listening at `addr` and starts the prefill
/// side, retrying refused connections for up to `retry_for`.
///
/// # Errors
/// [`EngineError::TcpConnect`] when no connection was made in time;
/// as [`prefill_end`].
pub fn connect_prefill(
    addr: impl ToSocketAddrs + fmt::Display,
    retry_for: Duration,
    opts: &TcpOptions,
) -> Result<PrefillEnd, EngineError> {
    prefill_end(connect(addr, retry_for)?, opts)
}

/// Connects to a prefill node listening at `addr` and starts the decode
/// side, retrying refused connections for up to `retry_for`.
///
/// # Errors
/// [`EngineError::TcpConnect`] when no connection was made in time;
/// as [`decode_end`].
pub fn connect_decode(
    addr: impl ToSocketAddrs + fmt::Display,
    retry_for: Duration,
    opts: &TcpOptions,
) -> Result<DecodeEnd, EngineError> {
    decode_end(connect(addr, retry_for)?, opts)
}

/// Opens a TCP connection to `addr`, retrying every 50 ms for up to
/// `retry_for` (the peer process may not be listening yet).
///
/// # Errors
/// [`EngineError::TcpConnect`] with the last attempt's error.
pub fn connect(
    addr: impl ToSocketAddrs + fmt::Display,
    retry_for: Duration,
) -> Result<TcpStream, EngineError> {
    let start = Instant::now();
    loop {
        match TcpStream::connect(&addr) {
            Ok(s) => return Ok(s),
            Err(source) => {
                let waited = start.elapsed();
                if waited >= retry_for {
                    return Err(EngineError::TcpConnect {
                        addr: addr.to_string(),
                        waited,
                        source,
                    });
                }
                thread::sleep((retry_for - waited).min(Duration::from_millis(50)));
            }
        }
    }
}

/// A listening socket that accepts one peer per call.
#[derive(Debug)]
pub struct Listener {
    inner: TcpListener,
    local: SocketAddr,
}

/// Binds a listener at `addr` (`127.0.0.1:0` picks a free port; see
/// [`Listener::local_addr`]).
///
/// # Errors
/// [`EngineError::TcpListen`] when the address cannot be bound.
pub fn listen(addr: impl ToSocketAddrs + fmt::Display) -> Result<Listener, EngineError> {
    let err = |source| EngineError::TcpListen {
        addr: addr.to_string(),
        source,
    };
    let inner = TcpListener::bind(&addr).map_err(err)?;
    let local = inner.local_addr().map_err(err)?;
    Ok(Listener { inner, local })
}

impl Listener {
    /// The address bound.
    #[must_use]
    pub fn local_addr(&self) -> SocketAddr {
        self.local
    }

    /// Waits up to `wait` (`None`: for ever) for a prefill node to connect
    /// and starts the decode side.
    ///
    /// # Errors
    /// [`WireError::Io`] when accepting fails or nobody connects in time.
    pub fn accept_decode(
        &self,
        wait: Option<Duration>,
        opts: &TcpOptions,
    ) -> Result<DecodeEnd, EngineError> {
        decode_end(self.accept(wait)?, opts)
    }

    /// Waits up to `wait` (`None`: for ever) for a decode node to connect
    /// and starts the prefill side.
    ///
    /// # Errors
    /// [`WireError::Io`] when accepting fails or nobody connects in time.
    pub fn accept_prefill(
        &self,
        wait: Option<Duration>,
        opts: &TcpOptions,
    ) -> Result<PrefillEnd, EngineError> {
        prefill_end(self.accept(wait)?, opts)
    }

    /// Accepts one connection within `wait`.
    ///
    /// # Errors
    /// [`WireError::Io`] when accepting fails or nobody connects in time.
    pub fn accept(&self, wait: Option<Duration>) -> Result<TcpStream, EngineError> {
        let err = |op, source| {
            EngineError::from(WireError::Io {
                peer: format!("listener {}", self.local),
                op,
                source,
            })
        };
        let Some(wait) = wait else {
            return self
                .inner
                .accept()
                .map(|(s, _)| s)
                .map_err(|e| err("accept", e));
        };
        self.inner
            .set_nonblocking(true)
            .map_err(|e| err("set non-blocking", e))?;
        let deadline = Instant::now() + wait;
        let accepted = loop {
            match self.inner.accept() {
                Ok((s, _)) => break Ok(s),
                Err(e) if e.kind() == io::ErrorKind::WouldBlock => {
                    let now = Instant::now();
                    if now >= deadline {
                        break Err(err(
                            "accept",
                            io::Error::new(
                                io::ErrorKind::TimedOut,
                                format!("no peer connected within {wait:?}"),
                            ),
                        ));
                    }
                    thread::sleep((deadline - now).min(Duration::from_millis(10)));
                }
                Err(e) if e.kind() == io::ErrorKind::Interrupted => {}
                Err(e) => break Err(err("accept", e)),
            }
        };
        self.inner
            .set_nonblocking(false)
            .map_err(|e| err("set blocking", e))?;
        let stream = accepted?;
        stream
            .set_nonblocking(false)
            .map_err(|e| err("set blocking", e))?;
        Ok(stream)
    }
}

/// One side of a connection: its link to the peer and its inbox.
type End<In> = (TcpLink<<In as Inbox>::Reply>, Receiver<Inbound<In>>);

/// Authenticates the peer (with a key), configures `stream`, starts the
/// reader and writer threads.
fn open<In: Inbox>(stream: TcpStream, opts: &TcpOptions) -> Result<End<In>, EngineError> {
    let peer = match stream.peer_addr() {
        Ok(a) => format!("{}@{a}", In::PEER_ROLE),
        Err(_) => In::PEER_ROLE.to_string(),
    };
    let err = |op, source| {
        EngineError::from(WireError::Io {
            peer: peer.clone(),
            op,
            source,
        })
    };
    stream
        .set_nodelay(true)
        .map_err(|e| err("set TCP_NODELAY", e))?;
    let session = match &opts.auth {
        Some(key) => Some(peer_auth::handshake(
            &stream,
            &peer,
            In::ROLE,
            key,
            opts.handshake_deadline,
        )?),
        None => None,
    };
    stream
        .set_read_timeout(Some(opts.peer_timeout))
        .map_err(|e| err("set read timeout", e))?;
    stream
        .set_write_timeout(Some(opts.peer_timeout))
        .map_err(|e| err("set write timeout", e))?;
    let clone = || stream.try_clone().map_err(|e| err("clone socket", e));
    let (sink, input): (Box<dyn Write + Send>, Box<dyn Read + Send>) = match session {
        Some(keys) => {
            let (w, r) = keys.split(clone()?, io::BufReader::with_capacity(64 << 10, clone()?));
            (Box::new(w), Box::new(r))
        }
        None => (
            Box::new(io::BufWriter::with_capacity(64 << 10, clone()?)),
            Box::new(io::BufReader::with_capacity(64 << 10, clone()?)),
        ),
    };
    let read_half = clone()?;
    let shared = Arc::new(Shared::default());
    let (queue, outgoing) = unbounded::<Outgoing<In::Reply>>();
    let (inbox_tx, inbox) = unbounded::<Inbound<In>>();

    let writer = Writer {
        peer: peer.clone(),
        sink,
        socket: stream,
        outgoing,
        shared: Arc::clone(&shared),
        heartbeat: opts.heartbeat,
    };
    thread::Builder::new()
        .name(format!("kvsan-tcp-write {peer}"))
        .spawn(move || writer.run())
        .map_err(|e| err("spawn writer thread", e))?;

    let reader = Reader::<In> {
        peer: peer.clone(),
        input,
        stream: read_half,
        inbox: inbox_tx,
        replies: queue.clone(),
        shared: Arc::clone(&shared),
        limits: opts.limits,
        peer_timeout: opts.peer_timeout,
    };
    thread::Builder::new()
        .name(format!("kvsan-tcp-read {peer}"))
        .spawn(move || reader.run())
        .map_err(|e| err("spawn reader thread", e))?;

    Ok((
        TcpLink {
            peer,
            queue,
            shared,
            max_frame: opts.limits.max_frame,
        },
        inbox,
    ))
}

/// Writes queued frames and heartbeats.
struct Writer<M> {
    peer: String,
    /// Buffered (plain) or sealed into records (authenticated).
    sink: Box<dyn Write + Send>,
    /// For shutting the connection down.
    socket: TcpStream,
    outgoing: Receiver<Outgoing<M>>,
    shared: Arc<Shared>,
    heartbeat: Duration,
}

impl<M: WireMessage> Writer<M> {
    fn run(mut self) {
        // A first heartbeat at once: a peer of another protocol version
        // finds out before any message is at stake.
        let mut result = self.write(&wire::heartbeat_frame(), None);
        while result.is_ok() {
            result = match self.outgoing.recv_timeout(self.heartbeat) {
                Ok(Outgoing::Frame { head, msg }) => self.write(&head, msg.bulk()),
                Err(RecvTimeoutError::Timeout) => self.write(&wire::heartbeat_frame(), None),
                Ok(Outgoing::Close) | Err(RecvTimeoutError::Disconnected) => {
                    // FIN after the queued bytes; the reader goes on until
                    // the peer closes its side.
                    let _ = self.sink.flush();
                    let _ = self.socket.shutdown(Shutdown::Write);
                    return;
                }
            };
        }
        if let Err(e) = result {
            let reason = format!("writing to {} failed: {e}", self.peer);
            tracing::warn!(peer = %self.peer, "{reason}");
            self.shared.set_down(&reason);
            // Wakes the reader, which reports the break to the inbox.
            let _ = self.socket.shutdown(Shutdown::Both);
        }
    }

    /// Writes one frame and flushes (unless more frames are already queued).
    fn write(&mut self, head: &[u8], bulk: Option<&[u8]>) -> io::Result<()> {
        self.sink.write_all(head)?;
        if let Some(b) = bulk {
            // Plain: large writes bypass the buffer, the KV bytes go from
            // the message to the socket. Sealed: they fill records.
            self.sink.write_all(b)?;
        }
        if self.outgoing.is_empty() {
            self.sink.flush()?;
        }
        Ok(())
    }
}

/// Reads frames and delivers them to the inbox.
struct Reader<In: Inbox> {
    peer: String,
    /// Buffered (plain) or opened from verified records (authenticated).
    input: Box<dyn Read + Send>,
    /// For shutting the connection down.
    stream: TcpStream,
    inbox: Sender<Inbound<In>>,
    replies: Sender<Outgoing<In::Reply>>,
    shared: Arc<Shared>,
    limits: WireLimits,
    peer_timeout: Duration,
}

impl<In: Inbox> Reader<In> {
    fn run(mut self) {
        let reason = loop {
            match wire::read_frame::<In, _>(&mut self.input, &self.limits) {
                Ok(Some(msg)) => {
                    msg.observe(&mut self.limits);
                    if self.inbox.send(Inbound::Message(msg)).is_err() {
                        break format!("the inbox of the link to {} was dropped", self.peer);
                    }
                }
                Ok(None) => break format!("{} closed the connection", self.peer),
                Err(e) if wire::frame_fault_keeps_stream(&e) => {
                    if let Err(reason) = self.frame_fault(&e) {
                        break reason;
                    }
                }
                Err(e) => break self.describe_break(&e),
            }
        };
        // A writer that failed first knows the better reason.
        let reason = self.shared.down_reason().unwrap_or(reason);
        self.shared.set_down(&reason);
        tracing::warn!(peer = %self.peer, "link down: {reason}");
        let _ = self.inbox.send(Inbound::Disconnected { reason });
        let _ = self.stream.shutdown(Shutdown::Both);
        let _ = self.replies.send(Outgoing::Close);
    }

    fn describe_break(&self, e: &WireError) -> String {
        match e {
            WireError::Io { source, .. }
                if matches!(
                    source.kind(),
                    io::ErrorKind::WouldBlock | io::ErrorKind::TimedOut
                ) =>
            {
                format!(
                    "no frame or heartbeat from {} for {:?}: the peer is presumed dead",
                    self.peer, self.peer_timeout
                )
            }
            WireError::Io { source, .. } => match peer_auth::auth_failure(source) {
                Some(refused) => format!(
                    "{} sent a frame that fails authentication: {refused}",
                    self.peer
                ),
                None => format!("connection with {} failed: {source}", self.peer),
            },
            WireError::UnsupportedVersion { version, .. }
                if version.to_le_bytes() == peer_auth::HANDSHAKE_MAGIC[4..6] =>
            {
                format!(
                    "{} requires an authenticated link: start this node with the deployment's --peer-key",
                    self.peer
                )
            }
            e => format!("frame from {} breaks the stream: {e}", self.peer),
        }
    }

    /// Handles a frame skipped whole: logs it and aborts its request on
    /// both sides. `Err` when the link cannot go on.
    fn frame_fault(&self, e: &WireError) -> Result<(), String> {
        let (msg_type, request) = wire::frame_fault_subject(e).unwrap_or((u8::MAX, None));
        let type_name = wire::type_name(msg_type);
        tracing::warn!(
            peer = %self.peer,
            msg_type,
            type_name,
            request = ?request.map(|r| r.0),
            "dropped a damaged frame: {e}"
        );
        let Some(request) = request else {
            if msg_type == wire::TYPE_HELLO {
                return Err(format!(
                    "the hello from {} was damaged, the link cannot be used: {e}",
                    self.peer
                ));
            }
            return Ok(());
        };
        let error = RequestError::new(
            ErrorKind::Transport,
            format!(
                "a {type_name} frame for this request from {} was rejected: {e}",
                self.peer
            ),
        );
        // Tell the peer first: the local inbox may be gone.
        let reply = In::peer_abort(request, error.clone());
        if let Ok(head) = wire::frame_head(&reply) {
            let _ = self.replies.send(Outgoing::Frame { head, msg: reply });
        }
        self.inbox
            .send(Inbound::Message(In::local_abort(request, error)))
            .map_err(|_| format!("the inbox of the link to {} was dropped", self.peer))
    }
}
