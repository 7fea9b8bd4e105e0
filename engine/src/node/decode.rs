//! The decode node of a disaggregated deployment: admits requests, reserves
//! pages for their prompts, has the prefill node push the prompts' KV into
//! them, commits, and generates.
//!
//! A request cancelled while its KV is on its way is answered at once, but
//! its pages stay reserved ("draining") until the prefill node acknowledges
//! the cancel — its completion, its failure, or the cancel's own
//! acknowledgement — so KV already on the wire (an RDMA WRITE in flight)
//! can only land in pages the request still holds. Then the pages are
//! freed and the request ends in this node's view.

use std::collections::{HashMap, VecDeque};
use std::time::Duration;

use crossbeam_channel::{Receiver, Sender};
use std::ops::Range;

use kvsan_sanitizer::{Manifest, Owner, PageLanding, PageRef, RequestId, Verdict};

use crate::node::Command;
use crate::node::admission::{self, PoolLimit};
use crate::node::executor::Executor;
use crate::node::lifecycle::State;
use crate::node::scheduler::Scheduler;
use crate::node::sequence::Sequence;
use crate::node::step_loop::{self, fail, new_sequence};
use crate::request::{ErrorKind, Event, Request, RequestError};
use crate::transport::{
    Inbound, KvPayload, KvTransfer, LandingZone, Link, NodeInfo, PrefillOrder, ToDecode, ToPrefill,
    kv_checksum, kv_payload_len, kv_slices, landing_seed,
};

mod faults;

/// The first `written` slots of a wire piece of `slots` slots × `layers`
/// layers (per layer, K then V, each `slots` slot widths): the whole piece
/// when `written == slots`.
fn slot_prefix(
    piece: &[u8],
    slots: usize,
    written: usize,
    layers: usize,
) -> std::borrow::Cow<'_, [u8]> {
    if written == slots {
        return std::borrow::Cow::Borrowed(piece);
    }
    let run = piece.len() / (layers * 2).max(1);
    let keep = run / slots.max(1) * written;
    std::borrow::Cow::Owned(
        piece
            .chunks(run.max(1))
            .flat_map(|c| &c[..keep.min(c.len())])
            .copied()
            .collect(),
    )
}

/// The current link to a prefill node.
struct PrefillPeer {
    epoch: u64,
    link: Box<dyn Link<ToPrefill>>,
    info: Option<NodeInfo>,
    /// The link was set up with this node's registered pool: prefill writes
    /// KV straight into the pages (RDMA) and [`KvPayload::Landed`] is its
    /// completion notice. On any other link a `Landed` is refused.
    writes_land: bool,
}

/// The decode node's state.
pub(crate) struct DecodeNode {
    /// Feature `rdma`: the registration of `core.pool` with the NIC, for the
    /// node's whole life. Declared before `core`: fields drop in declaration
    /// order, so the pool is deregistered before its storage is freed (the
    /// contract of [`PoolRegistration::new`](crate::transport::rdma::PoolRegistration::new)).
    #[cfg(feature = "rdma")]
    registration: Option<crate::transport::rdma::PoolRegistration>,
    /// The registered range of this node's pool, if it is registered.
    landing: Option<LandingZone>,
    core: Executor,
    sched: Scheduler,
    context: usize,
    peer: Option<PrefillPeer>,
    epochs: u64,
    /// Every request this node holds until its scheduler runs it, one
    /// record each: where it is on the way to decoding (its state is the
    /// lifecycle's).
    records: HashMap<RequestId, Record>,
    /// The requests waiting for admission or pages, in arrival order.
    arrivals: VecDeque<RequestId>,
    tx: Sender<Command>,
}

/// Where a request is on the decode node before its scheduler runs it.
enum Record {
    /// Submitted before the prefill node announced its capacity: not yet
    /// admitted.
    Unchecked {
        owner: Owner,
        request: Request,
        events: Sender<Event>,
    },
    /// Admitted, waiting for pages to reserve (lifecycle: queued).
    Reserving(Sequence),
    /// Pages reserved and the prefill order sent: the KV is on its way
    /// (lifecycle: transferring), or the request was cancelled while it was
    /// (draining: answered, its pages kept until prefill acknowledges).
    AwaitingKv(Sequence),
    /// Fault `free-during-transfer`: cancelled while its KV was on its way,
    /// the transfer never fenced; the destination pages it still lands in.
    Unfenced(Vec<PageRef>),
    /// Fault `commit-after-abort`: cancelled while its KV was on its way,
    /// its pages already back on the free list, left with the block table
    /// it had for the end of its transfer to clean up.
    LeftForCleanup(Sequence),
}

impl DecodeNode {
    pub fn new(
        core: Executor,
        sched: Scheduler,
        context: usize,
        tx: Sender<Command>,
    ) -> DecodeNode {
        DecodeNode {
            #[cfg(feature = "rdma")]
            registration: None,
            landing: None,
            core,
            sched,
            context,
            peer: None,
            epochs: 0,
            records: HashMap::new(),
            arrivals: VecDeque::new(),
            tx,
        }
    }

    /// A node whose pool `registration` registered with the NIC (it must
    /// be the registration of this node's `core.pool`; the node keeps it
    /// until it stops).
    #[cfg(feature = "rdma")]
    pub fn with_registration(
        mut self,
        registration: crate::transport::rdma::PoolRegistration,
    ) -> DecodeNode {
        self.landing = Some(registration.region().landing_zone());
        self.registration = Some(registration);
        self
    }

    fn idle(&self) -> bool {
        self.sched.is_idle()
            && !self
                .arrivals
                .iter()
                .any(|id| matches!(self.records.get(id), Some(Record::Reserving(_))))
    }

    /// Queues an admitted sequence for pages, last.
    fn queue_for_pages(&mut self, seq: Sequence) {
        let id = seq.owner.request;
        self.records.insert(id, Record::Reserving(seq));
        self.arrivals.push_back(id);
    }

    /// The sequence of a request whose record is [`Record::AwaitingKv`],
    /// taken out of it; `None` (the record left as it is) for any other.
    fn take_awaiting(&mut self, id: RequestId) -> Option<Sequence> {
        match self.records.remove(&id)? {
            Record::AwaitingKv(seq) => Some(seq),
            other => {
                self.records.insert(id, other);
                None
            }
        }
    }

    /// Forgets a fault's record of an ended request (`Unfenced`,
    /// `LeftForCleanup`): nothing more of it is expected.
    fn forget_ended(&mut self, id: RequestId) {
        if matches!(
            self.records.get(&id),
            Some(Record::Unfenced(_) | Record::LeftForCleanup(_))
        ) {
            self.records.remove(&id);
        }
    }

    /// The node's loop.
    pub fn run(mut self, rx: Receiver<Command>) {
        loop {
            let first = if self.idle() {
                self.core.idle();
                match rx.recv() {
                    Ok(c) => Some(c),
                    Err(_) => return,
                }
            } else {
                None
            };
            for cmd in first
                .into_iter()
                .chain(std::iter::from_fn(|| rx.try_recv().ok()))
            {
                if !self.command(cmd) {
                    return;
                }
            }
            self.reserve_pages();
            step_loop::step(&mut self.core, &mut self.sched);
        }
    }

    /// Handles one command; false to stop.
    fn command(&mut self, cmd: Command) -> bool {
        match cmd {
            Command::Submit {
                owner,
                request,
                events,
            } => self.submit(owner, request, events),
            Command::Cancel(id) => self.cancel(id),
            Command::Stats(tx) => {
                let mut s = step_loop::stats(&self.core, &self.sched);
                s.waiting += self
                    .records
                    .iter()
                    .filter(|&(&id, record)| match record {
                        Record::Unchecked { .. } | Record::Reserving(_) => true,
                        Record::AwaitingKv(_) => {
                            self.core.lifecycle.state(id) == Some(State::Transferring)
                        }
                        Record::Unfenced(_) | Record::LeftForCleanup(_) => false,
                    })
                    .count();
                let _ = tx.send(s);
            }
            Command::AttachPrefill {
                link,
                inbox,
                landing,
            } => self.attach(link, inbox, landing),
            Command::FromPrefill { epoch, inbound } => {
                if self.peer.as_ref().is_some_and(|p| p.epoch == epoch) {
                    self.on_prefill_message(inbound);
                }
            }
            Command::Shutdown => {
                self.fail_waiting_for_prefill("the engine is shutting down");
                step_loop::shutdown(&mut self.core, &mut self.sched);
                return false;
            }
        }
        true
    }

    fn attach(
        &mut self,
        link: Box<dyn Link<ToPrefill>>,
        inbox: Receiver<Inbound<ToDecode>>,
        landing: Option<LandingZone>,
    ) {
        let writes_land = match landing {
            None => false,
            Some(zone) if Some(zone) == self.landing => true,
            Some(zone) => {
                // Its peer writes into a range this node does not read:
                // nothing it announces as landed would be here.
                tracing::error!(
                    node = %self.core.name,
                    offered = ?zone,
                    registered = ?self.landing,
                    "an RDMA link set up with another pool's registration; link refused"
                );
                return;
            }
        };
        if self.peer.is_some() {
            self.fail_waiting_for_prefill("the prefill link was replaced");
        }
        self.epochs += 1;
        let epoch = self.epochs;
        let tx = self.tx.clone();
        std::thread::Builder::new()
            .name(format!("kvsan-decode-link-{epoch}"))
            .spawn(move || {
                for inbound in inbox.iter() {
                    let last = matches!(inbound, Inbound::Disconnected { .. });
                    if tx.send(Command::FromPrefill { epoch, inbound }).is_err() || last {
                        return;
                    }
                }
                let _ = tx.send(Command::FromPrefill {
                    epoch,
                    inbound: Inbound::Disconnected {
                        reason: "the link's inbox closed".into(),
                    },
                });
            })
            .expect("spawn the link forwarder");
        self.peer = Some(PrefillPeer {
            epoch,
            link,
            info: None,
            writes_land,
        });
    }

    fn submit(&mut self, owner: Owner, request: Request, events: Sender<Event>) {
        let Some(peer) = &self.peer else {
            let error = RequestError::new(
                ErrorKind::Transport,
                "no prefill node is connected to this decode node",
            );
            let _ = self.core.lifecycle.refuse(owner, &error);
            let _ = events.send(Event::Error(error));
            return;
        };
        let Some(info) = peer.info else {
            let id = owner.request;
            if self.records.contains_key(&id) {
                // The lifecycle, which refuses a live id twice, has not
                // seen either yet: refused here, as it would be there.
                let error = RequestError::new(
                    ErrorKind::Internal,
                    format!("request {} is already waiting on this node", id.0),
                );
                let _ = events.send(Event::Error(error));
                return;
            }
            self.records.insert(
                id,
                Record::Unchecked {
                    owner,
                    request,
                    events,
                },
            );
            self.arrivals.push_back(id);
            return;
        };
        let limits = [
            PoolLimit {
                node: "prefill",
                tokens: info.pool_tokens,
            },
            PoolLimit {
                node: "decode",
                tokens: self.core.capacity_tokens(),
            },
        ];
        let context = self.context.min(info.context_length);
        let checked = admission::check(&request, &self.core.model, "decode", context, &limits);
        let kept = faults::keep_rejected(&request);
        match checked.and_then(|()| {
            new_sequence(
                owner,
                request,
                self.core.pool.page_slots(),
                Some(events.clone()),
            )
        }) {
            Ok(seq) => {
                if let Some(seq) = step_loop::queue(&mut self.core, seq) {
                    self.queue_for_pages(seq);
                }
            }
            Err(e) => {
                // Refused either way; a move the lifecycle refuses is logged there.
                let _ = self.core.lifecycle.refuse(owner, &e);
                tracing::info!(node = %self.core.name, request = owner.request.0, tenant = owner.tenant.0, "request refused: {}", e.message);
                if faults::reject_as_placeholder(self, owner, &e, kept, &events) {
                    return;
                }
                let _ = events.send(Event::Error(e));
            }
        }
    }

    /// Reserves pages for waiting prompts, in order, and sends their prefill orders.
    fn reserve_pages(&mut self) {
        // Running requests first: no new reservations while one of them
        // waits for a page or a preempted one waits to be recomputed.
        if self.sched.starved || !self.sched.waiting.is_empty() {
            return;
        }
        while let Some(&id) = self.arrivals.front() {
            let mut seq = match self.records.remove(&id) {
                Some(Record::Reserving(front))
                    if front.table.entries_for(front.prompt_len) <= self.core.free_pages() =>
                {
                    front
                }
                // Waits for pages, or for the prefill node's capacity.
                Some(waiting @ (Record::Reserving(_) | Record::Unchecked { .. })) => {
                    self.records.insert(id, waiting);
                    break;
                }
                // Cancelled or ended since it arrived.
                other => {
                    if let Some(record) = other {
                        self.records.insert(id, record);
                    }
                    self.arrivals.pop_front();
                    continue;
                }
            };
            self.arrivals.pop_front();
            if let Err(e) = self.core.lifecycle.enter(seq.owner, State::Admitted) {
                fail(&mut self.core, seq, e.into());
                continue;
            }
            let prompt_len = seq.prompt_len;
            match self.core.ensure_pages(&mut seq, prompt_len) {
                // Admitted: what it waits for from here is the prompt's
                // computation (less prefill's queue, which prefill reports).
                Ok(true) => seq.admitted = Some(std::time::Instant::now()),
                Ok(false) => {
                    self.core.release(&mut seq);
                    match self.core.lifecycle.enter(seq.owner, State::Queued) {
                        Ok(()) => {
                            self.records.insert(id, Record::Reserving(seq));
                            self.arrivals.push_front(id);
                        }
                        Err(e) => fail(&mut self.core, seq, e.into()),
                    }
                    break;
                }
                Err(e) => {
                    fail(&mut self.core, seq, e);
                    continue;
                }
            }
            let Some(peer) = &self.peer else {
                fail(
                    &mut self.core,
                    seq,
                    RequestError::new(ErrorKind::Transport, "the prefill node disconnected"),
                );
                continue;
            };
            let order = PrefillOrder {
                owner: seq.owner,
                prompt: faults::placeholder_prompt(&seq, seq.tokens[..seq.prompt_len].to_vec()),
                sampling: *seq.sampler.params(),
                dst_pool: self.core.pool_id,
                dst_pages: seq.table.pages().to_vec(),
                cache_salt: seq.cache_salt.clone(),
            };
            // The KV is on its way once the order is out.
            if let Err(e) = self.core.lifecycle.enter(seq.owner, State::Transferring) {
                fail(&mut self.core, seq, e.into());
                continue;
            }
            if let Err(e) = peer.link.send(ToPrefill::Prefill(order)) {
                fail(
                    &mut self.core,
                    seq,
                    RequestError::new(ErrorKind::Transport, e.to_string()),
                );
                continue;
            }
            self.records.insert(id, Record::AwaitingKv(seq));
        }
    }

    fn on_prefill_message(&mut self, inbound: Inbound<ToDecode>) {
        match inbound {
            Inbound::Message(ToDecode::Hello(info)) => self.hello(info),
            Inbound::Message(ToDecode::Kv(transfer)) => self.receive(transfer),
            Inbound::Message(ToDecode::PrefillDone {
                request,
                first_token,
                cached_tokens,
                queued_us,
            }) => self.commit(
                request,
                first_token,
                cached_tokens as usize,
                Duration::from_micros(queued_us),
            ),
            Inbound::Message(ToDecode::PrefillFailed { request, error }) => {
                self.forget_ended(request);
                if self.core.lifecycle.state(request) == Some(State::Transferring)
                    && let Some(seq) = self.take_awaiting(request)
                {
                    fail(&mut self.core, seq, error);
                } else {
                    self.drained(request);
                }
            }
            Inbound::Disconnected { reason } => {
                tracing::warn!(node = %self.core.name, "prefill link down: {reason}");
                self.peer = None;
                self.fail_waiting_for_prefill("the prefill node disconnected");
            }
        }
    }

    fn hello(&mut self, info: NodeInfo) {
        let g = *self.core.pool.geometry();
        if info.page_slots != g.page_slots
            || info.n_layers != g.n_layers
            || info.kv_dim != g.slot_width()
        {
            tracing::error!(
                node = %self.core.name,
                "prefill node's KV geometry ({} slots/page, {} layers, kv width {}) differs from ours ({}, {}, {}); link refused",
                info.page_slots, info.n_layers, info.kv_dim, g.page_slots, g.n_layers, g.slot_width()
            );
            self.peer = None;
            self.fail_waiting_for_prefill("the prefill node runs another model geometry");
            return;
        }
        if let Some(peer) = &mut self.peer {
            peer.info = Some(info);
        }
        // The requests that waited for the capacity are admitted (or
        // refused) now, in arrival order.
        let arrivals: Vec<RequestId> = self.arrivals.iter().copied().collect();
        for id in arrivals {
            match self.records.remove(&id) {
                Some(Record::Unchecked {
                    owner,
                    request,
                    events,
                }) => {
                    self.arrivals.retain(|&a| a != id);
                    self.submit(owner, request, events);
                }
                Some(other) => {
                    self.records.insert(id, other);
                }
                None => {}
            }
        }
    }

    /// KV landing in a request's reserved pages: bytes this node writes
    /// ([`KvPayload::Bytes`]), or the completion notice of RDMA WRITEs that
    /// put them there already ([`KvPayload::Landed`]).
    ///
    /// Both go through the same checks — the manifest names the request's
    /// own reserved pages and fits them, the checksum matches the bytes, the
    /// `transfer_recv` hook accepts the manifest (which reserves the pages
    /// for it; it marks nothing written) — then [`DecodeNode::land`]: the
    /// checked copy of [`KvPayload::Bytes`] (each page's piece is checked
    /// by `transfer_land` where the copy really writes it, and only then
    /// written), and with a hook target attached, the landing digest of
    /// every destination page against the sender's (`transfer_verify`). A
    /// `Landed` transfer has no copy to check: its slots count as written
    /// only through the digests of what the NIC put in its pages. A write
    /// that strays into another request's page (a bug in the sender's
    /// planning, or another process holding the remote key) is seen only
    /// as the damage it does there, when that request's digests are checked.
    /// `Landed` is believed only on a link set up with this node's
    /// registered pool; on any other (a forged TCP frame) it is refused.
    fn receive(&mut self, transfer: KvTransfer) {
        let KvTransfer {
            manifest,
            payload,
            digests,
        } = transfer;
        let id = manifest.request.request;
        let state = self.core.lifecycle.state(id);
        if state == Some(State::Draining) {
            // Cancelled: what was on the wire is dropped (an RDMA WRITE has
            // landed in pages the request still holds).
            return;
        }
        let record = self.records.get(&id);
        let Some(Record::AwaitingKv(seq)) = record.filter(|_| state == Some(State::Transferring))
        else {
            if let Some(Record::LeftForCleanup(_)) = record {
                // Fault `commit-after-abort`: the cancelled request's KV is
                // dropped; the cleanup waits for its completion.
                return;
            }
            let unfenced = matches!(record, Some(Record::Unfenced(pages))
                if manifest.dst_pool == self.core.pool_id && manifest.dst_pages == *pages);
            let replayed = faults::transfer_replayed_after_commit(self, &manifest);
            if unfenced || replayed {
                faults::land_late(self, &manifest, &payload, &digests);
                return;
            }
            tracing::warn!(node = %self.core.name, request = id.0, "KV transfer for an unknown request dropped");
            return;
        };
        let problem = self.transfer_problem(seq, &manifest, &payload, &digests);
        if let Some(what) = problem {
            let seq = self.take_awaiting(id).expect("awaiting its KV");
            tracing::warn!(node = %self.core.name, request = id.0, "KV transfer refused: {what}");
            self.cancel_at_prefill(id);
            fail(
                &mut self.core,
                seq,
                RequestError::new(ErrorKind::Transport, format!("KV transfer refused: {what}")),
            );
            return;
        }
        let mut verdict = self.core.hooks.transfer_recv(self.core.pool_id, &manifest);
        self.core.stats.transfers += 1;
        if verdict.is_continue() {
            verdict = self.land(&manifest, &payload, &digests);
        }
        if !verdict.is_continue() {
            // Refused before a byte went where it does not belong.
            let seq = self.take_awaiting(id).expect("awaiting its KV");
            self.cancel_at_prefill(id);
            let e = RequestError::aborted_by(verdict, &self.core.name);
            fail(&mut self.core, seq, e);
            return;
        }
        // What landed, for the anomaly monitor.
        let layers = self.core.model.config().n_layers;
        if let Some(Record::AwaitingKv(seq)) = self.records.get_mut(&id) {
            seq.kv.record(
                manifest.first_token as usize,
                manifest.tokens as usize,
                manifest.layers.start as usize..manifest.layers.end as usize,
                seq.prompt_len,
                layers,
            );
        }
    }

    /// Puts a transfer's KV into its pages and checks it landed: the
    /// checked copy of a [`KvPayload::Bytes`] transfer, piece by piece (the
    /// `transfer_land` hook sees each page and slots as the copy really
    /// writes them, and only on `Continue` is the piece written), then,
    /// with a hook target attached, the landing digest of each destination
    /// page of the manifest against the sender's (`transfer_verify`; for a
    /// `Landed` transfer, the only evidence of what the NIC wrote where).
    /// The first refusal stops it and is returned.
    fn land(&mut self, manifest: &Manifest, payload: &KvPayload, digests: &[u64]) -> Verdict {
        let ps = self.core.pool.page_slots();
        let layers = manifest.layers.start as usize..manifest.layers.end as usize;
        let pieces = kv_slices(manifest, ps);
        if let KvPayload::Bytes(bytes) = payload {
            let slot_bytes = layers.len() * 2 * self.core.pool.geometry().slot_width() * 2;
            let mut at = 0;
            for (idx, slots) in &pieces {
                let Some(piece) = bytes.get(at..at + slots.len() * slot_bytes) else {
                    tracing::error!(node = %self.core.name, request = manifest.request.request.0, "KV transfer shorter than its manifest: copy stopped");
                    break;
                };
                at += piece.len();
                let (page, written) = self.copy_destination(manifest, *idx, slots.clone());
                if written.is_empty() {
                    continue;
                }
                let landing = PageLanding {
                    request: manifest.request,
                    page,
                    first_token: (idx * ps + slots.start) as u64,
                    slots: written.start as u32..written.end as u32,
                    layers: manifest.layers.clone(),
                    sent_digest: 0,
                    landed_digest: 0,
                };
                let verdict = self.core.hooks.transfer_land(self.core.pool_id, &landing);
                if !verdict.is_continue() {
                    return verdict;
                }
                let part = slot_prefix(piece, slots.len(), written.len(), layers.len());
                if let Err(e) =
                    self.core
                        .pool
                        .unpack_slots(page.page, written, layers.clone(), &part)
                {
                    tracing::error!(node = %self.core.name, request = manifest.request.request.0, "{e}");
                    break;
                }
            }
        }
        if !self.core.hooks.is_attached() {
            return Verdict::Continue;
        }
        for (i, (idx, slots)) in pieces.into_iter().enumerate() {
            let page = manifest.dst_pages[idx];
            let first = idx * ps + slots.start;
            let seed = landing_seed(first, slots.len(), &layers);
            let landing = PageLanding {
                request: manifest.request,
                page,
                first_token: first as u64,
                slots: slots.start as u32..slots.end as u32,
                layers: manifest.layers.clone(),
                sent_digest: digests.get(i).copied().unwrap_or_default(),
                landed_digest: self.core.pool.landing_digest(
                    page.page,
                    slots,
                    layers.clone(),
                    seed,
                ),
            };
            let verdict = self.core.hooks.transfer_verify(self.core.pool_id, &landing);
            if !verdict.is_continue() {
                return verdict;
            }
        }
        Verdict::Continue
    }

    /// Where the copy of a manifest's piece for block-table entry `idx`
    /// (slots `slots` of its page) really writes: the entry's page and the
    /// same slots, unless a fail point bends it.
    fn copy_destination(
        &self,
        manifest: &Manifest,
        idx: usize,
        slots: Range<usize>,
    ) -> (PageRef, Range<usize>) {
        faults::overlapping_transfer(self, manifest, idx, &slots)
            .or_else(|| faults::descriptor_offset_dropped(self, manifest, &slots))
            .or_else(|| faults::block_size_mismatch(self, manifest, idx, &slots))
            .unwrap_or((manifest.dst_pages[idx], slots))
    }

    /// Frame-level checks of a transfer: the request's own pages, sizes,
    /// checksum; a `Landed` transfer only on a link whose peer writes into
    /// this node's registered pool.
    fn transfer_problem(
        &self,
        seq: &Sequence,
        manifest: &kvsan_sanitizer::Manifest,
        payload: &KvPayload,
        digests: &[u64],
    ) -> Option<String> {
        let writes_land = self.peer.as_ref().is_some_and(|p| p.writes_land);
        if *payload == KvPayload::Landed && !writes_land {
            return Some(
                "it says its bytes already landed in this node's pages (an RDMA completion), \
                 but the link from prefill is not an RDMA link with this node's registered pool"
                    .into(),
            );
        }
        if manifest.dst_pool != self.core.pool_id || manifest.dst_pages != seq.table.pages() {
            return Some(format!(
                "it targets pages request {} does not hold",
                seq.owner.request.0
            ));
        }
        let end = manifest.first_token as usize + manifest.tokens as usize;
        if end > seq.table.capacity() {
            return Some(format!(
                "tokens up to {end} exceed the {} reserved pages",
                seq.table.len()
            ));
        }
        if manifest.layers.end as usize > self.core.model.config().n_layers
            || manifest.layers.is_empty()
        {
            return Some(format!(
                "layers {:?} outside the model's {}",
                manifest.layers,
                self.core.model.config().n_layers
            ));
        }
        let pieces = kv_slices(manifest, self.core.pool.page_slots()).len();
        if digests.len() != pieces {
            return Some(format!(
                "{} landing digests, the manifest's tokens touch {pieces} pages",
                digests.len()
            ));
        }
        let landed;
        let bytes = match payload {
            KvPayload::Bytes(bytes) => {
                let want = kv_payload_len(manifest, self.core.pool.geometry().slot_width());
                if bytes.len() != want {
                    return Some(format!(
                        "{} payload bytes, the manifest describes {want}",
                        bytes.len()
                    ));
                }
                bytes
            }
            KvPayload::Landed => {
                // The bytes are in the pages: read them back as the wire
                // would carry them.
                landed = self.landed_bytes(manifest);
                &landed
            }
        };
        if kv_checksum(bytes) != manifest.checksum {
            // The values are not shown: they are derived from KV.
            return Some("checksum of the bytes does not match the manifest's".into());
        }
        None
    }

    /// The bytes an RDMA transfer wrote into the pages its manifest names,
    /// in wire order (the manifest was checked to fit the request's pages).
    fn landed_bytes(&self, manifest: &Manifest) -> Vec<u8> {
        let layers = manifest.layers.start as usize..manifest.layers.end as usize;
        let mut out = Vec::with_capacity(kv_payload_len(
            manifest,
            self.core.pool.geometry().slot_width(),
        ));
        for (idx, slots) in kv_slices(manifest, self.core.pool.page_slots()) {
            let page = manifest.dst_pages[idx].page;
            self.core
                .pool
                .pack_slots(page, slots, layers.clone(), &mut out);
        }
        out
    }

    /// Prefill finished: commit the received KV and start decoding.
    /// `cached_tokens` of the prompt came from prefill's prefix cache; the
    /// request waited `peer_queued` in prefill's queue.
    fn commit(
        &mut self,
        request: RequestId,
        first_token: u32,
        cached_tokens: usize,
        peer_queued: Duration,
    ) {
        match self.core.lifecycle.state(request) {
            Some(State::Transferring) => {}
            Some(State::Draining) => return self.drained(request),
            _ => {
                match self.records.remove(&request) {
                    Some(Record::LeftForCleanup(mut seq)) => {
                        seq.peer_queued = peer_queued;
                        faults::commit_left_for_cleanup(self, seq, first_token);
                    }
                    Some(Record::Unfenced(_)) | None => {
                        tracing::warn!(node = %self.core.name, request = request.0, "prefill completion for an unknown request dropped");
                    }
                    Some(other) => {
                        // Not one this node has sent to prefill: kept.
                        self.records.insert(request, other);
                        tracing::warn!(node = %self.core.name, request = request.0, "prefill completion for a request not transferring dropped");
                    }
                }
                return;
            }
        }
        let Some(mut seq) = self.take_awaiting(request) else {
            tracing::error!(node = %self.core.name, request = request.0, "prefill completion for a transferring request that holds no pages dropped");
            return;
        };
        seq.cached_tokens = cached_tokens.min(seq.prompt_len);
        seq.peer_queued = peer_queued;
        let verdict = self.commit_hook(&seq);
        if !verdict.is_continue() {
            let e = RequestError::aborted_by(verdict, &self.core.name);
            fail(&mut self.core, seq, e);
            return;
        }
        if let Err(e) = self.core.lifecycle.enter(seq.owner, State::Decoding) {
            fail(&mut self.core, seq, e.into());
            return;
        }
        self.start_decoding(seq, first_token);
    }

    /// The commit hook: decode starts using the KV of `seq`'s prompt.
    fn commit_hook(&self, seq: &Sequence) -> Verdict {
        self.core.hooks.transfer_commit(
            self.core.pool_id,
            seq.owner,
            seq.table.pages(),
            seq.prompt_len,
        )
    }

    /// A committed request takes its first token: it joins the running
    /// batch, or ends with that token.
    fn start_decoding(&mut self, mut seq: Sequence, first_token: u32) {
        if let Some(e) = self.core.first_token_anomaly(&seq) {
            fail(&mut self.core, seq, e);
            return;
        }
        seq.computed = seq.prompt_len;
        match seq.push_token(first_token) {
            Some(reason) => step_loop::finish(&mut self.core, seq, reason),
            None => {
                seq.admitted_at = self.sched.next_admission();
                self.sched.running.push(seq);
            }
        }
    }

    fn cancel_at_prefill(&self, request: RequestId) {
        if let Some(peer) = &self.peer {
            let _ = peer.link.send(ToPrefill::Cancel { request });
        }
    }

    fn cancel(&mut self, id: RequestId) {
        let cancelled = RequestError::new(ErrorKind::Cancelled, "cancelled by the client");
        if self.core.lifecycle.state(id) == Some(State::Transferring)
            && let Some(seq) = self.take_awaiting(id)
        {
            return self.cancel_transfer(seq, cancelled);
        }
        match self.records.remove(&id) {
            Some(Record::Reserving(seq)) => {
                self.arrivals.retain(|&a| a != id);
                fail(&mut self.core, seq, cancelled);
            }
            Some(Record::Unchecked { owner, events, .. }) => {
                self.arrivals.retain(|&a| a != id);
                // Refused either way; a move the lifecycle refuses is logged there.
                let _ = self.core.lifecycle.refuse(owner, &cancelled);
                let _ = events.send(Event::Error(cancelled));
            }
            other => {
                // Draining (answered already), or a fault's record of an
                // ended request: kept as it is.
                if let Some(record) = other {
                    self.records.insert(id, record);
                }
                // Running or preempted.
                step_loop::cancel(&mut self.core, &mut self.sched, id);
            }
        }
    }

    /// Cancels a request whose KV is on its way.
    fn cancel_transfer(&mut self, seq: Sequence, cancelled: RequestError) {
        let Some((seq, cancelled)) = faults::commit_after_abort(self, seq, cancelled) else {
            return;
        };
        let Some((mut seq, cancelled)) = faults::free_during_transfer(self, seq, cancelled) else {
            return;
        };
        let id = seq.owner.request;
        // Drain: the client has its answer now; the pages stay the
        // request's until prefill acknowledges the cancel.
        if let Err(e) = self.core.lifecycle.enter(seq.owner, State::Draining) {
            fail(&mut self.core, seq, e.into());
            return;
        }
        seq.fail(cancelled);
        seq.events = None;
        self.cancel_at_prefill(id);
        self.records.insert(id, Record::AwaitingKv(seq));
    }

    /// Prefill acknowledged a cancelled request (or the link to it is
    /// gone): nothing more lands in its pages, which are freed now, and the
    /// request ends in this node's view.
    fn drained(&mut self, request: RequestId) {
        if self.core.lifecycle.state(request) == Some(State::Draining)
            && let Some(seq) = self.take_awaiting(request)
        {
            fail(
                &mut self.core,
                seq,
                RequestError::new(ErrorKind::Cancelled, "cancelled by the client"),
            );
        }
    }

    /// Aborts every request that still needs the prefill node; frees their pages.
    fn fail_waiting_for_prefill(&mut self, why: &str) {
        let error = RequestError::new(ErrorKind::Transport, why);
        let awaiting: Vec<RequestId> = self
            .records
            .iter()
            .filter(|(_, r)| matches!(r, Record::AwaitingKv(_)))
            .map(|(&id, _)| id)
            .collect();
        for &request in &awaiting {
            // The draining ones end here, as cancelled; the transferring
            // ones with the link's error.
            self.drained(request);
            if let Some(seq) = self.take_awaiting(request) {
                fail(&mut self.core, seq, error.clone());
            }
        }
        for id in std::mem::take(&mut self.arrivals) {
            match self.records.remove(&id) {
                Some(Record::Reserving(seq)) => fail(&mut self.core, seq, error.clone()),
                Some(Record::Unchecked { owner, events, .. }) => {
                    // Refused either way; a move the lifecycle refuses is logged there.
                    let _ = self.core.lifecycle.refuse(owner, &error);
                    let _ = events.send(Event::Error(error.clone()));
                }
                Some(other) => {
                    self.records.insert(id, other);
                }
                None => {}
            }
        }
        // What is left are the faults' records of ended requests: nothing
        // more of them comes over a new link.
        self.records.clear();
    }
}

#[cfg(test)]
mod tests {
    //! The accepting side of [`KvPayload::Landed`], without a NIC: the node
    //! is driven by hand, and the test writes the bytes into the reserved
    //! pages itself, as the NIC would, before the completion notice.

    use std::sync::Arc;

    use crossbeam_channel::unbounded;
    use kvsan_sanitizer::{NodeRole, PoolId, RequestId, TenantId};

    use super::*;
    use crate::hooks::Hooks;
    use crate::model::{AttentionCheck, SyntheticSpec};
    use crate::node::executor::NodeSettings;
    use crate::node::scheduler::SchedulerConfig;
    use crate::sampler::SamplingParams;
    use crate::transport::in_process;

    const PAGE_SLOTS: usize = 16;
    const CONTEXT: usize = 256;
    /// The registered range the node pretends its pool has.
    const ZONE: LandingZone = LandingZone {
        addr: 0x10_0000,
        len: 1 << 30,
        rkey: 7,
    };

    /// A decode node with a prefill link, `registered` or not, whose
    /// prefill side is `prefill_inbox`.
    fn node(
        registered: bool,
        link: Option<LandingZone>,
    ) -> (DecodeNode, Receiver<Inbound<ToPrefill>>) {
        node_with(registered, link, Hooks::none())
    }

    /// [`node`] with `hooks`.
    fn node_with(
        registered: bool,
        link: Option<LandingZone>,
        hooks: Hooks,
    ) -> (DecodeNode, Receiver<Inbound<ToPrefill>>) {
        let model = Arc::new(
            SyntheticSpec {
                context_length: CONTEXT,
                ..SyntheticSpec::default()
            }
            .build()
            .unwrap(),
        );
        let cfg = NodeSettings {
            page_slots: PAGE_SLOTS,
            hooks,
            check: AttentionCheck::Unchecked,
            anomaly: crate::anomaly::AnomalyAction::Abort,
            prefix_cache: crate::prefix_cache::PrefixCachePolicy::Off,
            tiers: crate::tier::TierConfig::default(),
        };
        let core = Executor::new(
            model.clone(),
            CONTEXT / PAGE_SLOTS,
            NodeRole::Decode,
            "decode",
            cfg,
        )
        .unwrap();
        let (tx, _) = unbounded();
        let mut node = DecodeNode::new(
            core,
            Scheduler::new(SchedulerConfig::default()),
            CONTEXT,
            tx,
        );
        if registered {
            node.landing = Some(ZONE);
        }
        let pair = in_process::pair();
        node.attach(Box::new(pair.to_prefill), pair.decode_inbox, link);
        let c = model.config();
        node.hello(NodeInfo {
            pool_tokens: CONTEXT,
            page_slots: PAGE_SLOTS,
            n_layers: c.n_layers,
            kv_dim: c.n_kv_heads * c.head_dim,
            context_length: CONTEXT,
        });
        (node, pair.prefill_inbox)
    }

    /// Submits a 20-token prompt; the order prefill gets.
    fn submit(
        node: &mut DecodeNode,
        prefill: &Receiver<Inbound<ToPrefill>>,
    ) -> (PrefillOrder, Receiver<Event>) {
        let (tx, events) = unbounded();
        let request = Request {
            tenant: TenantId(1),
            prompt: (0..20).map(|i| (i * 7 + 3) % 100).collect(),
            max_tokens: 4,
            sampling: SamplingParams::greedy(),
            stop_tokens: Vec::new(),
            cache_salt: Default::default(),
        };
        node.submit(
            crate::request::owner(RequestId(1), TenantId(1)),
            request,
            tx,
        );
        node.reserve_pages();
        match prefill.try_recv() {
            Ok(Inbound::Message(ToPrefill::Prefill(order))) => (order, events),
            other => panic!("expected a prefill order, got {other:?}"),
        }
    }

    /// The manifest of the whole prompt of `order`, and its bytes.
    fn transfer(node: &DecodeNode, order: &PrefillOrder) -> (Manifest, Vec<u8>) {
        let mut m = Manifest {
            request: order.owner,
            src_pool: PoolId(0),
            src_pages: order.dst_pages.clone(),
            dst_pool: order.dst_pool,
            dst_pages: order.dst_pages.clone(),
            first_token: 0,
            tokens: order.prompt.len() as u32,
            layers: 0..node.core.model.config().n_layers as u32,
            checksum: 0,
        };
        let len = kv_payload_len(&m, node.core.pool.geometry().slot_width());
        let bytes: Vec<u8> = (0..len).map(|i| (i % 61) as u8).collect();
        m.checksum = kv_checksum(&bytes);
        (m, bytes)
    }

    /// The sender's landing digests of `bytes`.
    fn digests_of(node: &DecodeNode, m: &Manifest, bytes: &[u8]) -> Vec<u64> {
        let kv_dim = node.core.pool.geometry().slot_width();
        crate::transport::landing_digests(m, PAGE_SLOTS, kv_dim, bytes)
    }

    /// Writes `bytes` into the pages `m` names, as the NIC's WRITEs would.
    fn land(node: &mut DecodeNode, m: &Manifest, bytes: &[u8]) {
        let layers = m.layers.start as usize..m.layers.end as usize;
        let mut at = 0;
        for (idx, slots) in kv_slices(m, PAGE_SLOTS) {
            at += node
                .core
                .pool
                .unpack_slots(m.dst_pages[idx].page, slots, layers.clone(), &bytes[at..])
                .unwrap();
        }
    }

    /// Commits request 1 and runs the node until it is idle; its events.
    fn finish(node: &mut DecodeNode, events: &Receiver<Event>) -> Vec<Event> {
        node.commit(RequestId(1), 1, 0, Duration::ZERO);
        for _ in 0..100 {
            if node.sched.is_idle() {
                break;
            }
            step_loop::step(&mut node.core, &mut node.sched);
        }
        events.try_iter().collect()
    }

    #[test]
    fn landed_kv_on_the_nodes_own_rdma_link_decodes_like_the_same_bytes_in_the_message() {
        let (mut by_message, prefill) = node(false, None);
        let (order, events) = submit(&mut by_message, &prefill);
        let (m, bytes) = transfer(&by_message, &order);
        let digests = digests_of(&by_message, &m, &bytes);
        by_message.receive(KvTransfer {
            manifest: m,
            payload: KvPayload::Bytes(bytes),
            digests,
        });
        let expected = finish(&mut by_message, &events);
        assert!(
            matches!(expected.last(), Some(Event::Finished { generated: 4, .. })),
            "{expected:?}"
        );

        let (mut landed, prefill) = node(true, Some(ZONE));
        let (order, events) = submit(&mut landed, &prefill);
        let (m, bytes) = transfer(&landed, &order);
        land(&mut landed, &m, &bytes);
        let digests = digests_of(&landed, &m, &bytes);
        landed.receive(KvTransfer {
            manifest: m,
            payload: KvPayload::Landed,
            digests,
        });
        assert_eq!(landed.core.stats.transfers, 1);
        assert_eq!(finish(&mut landed, &events), expected);
    }

    /// An RDMA landing has no copy to check: under a sanitizer its slots
    /// count as written only through the landing digests. With the sender's
    /// digests the request decodes as it does without a sanitizer; with a
    /// digest that does not match what its page holds it is aborted, and
    /// the slots of that page are never marked written.
    #[test]
    fn landed_kv_under_a_sanitizer_is_written_only_where_its_digests_match() {
        let expected = {
            let (mut plain, prefill) = node(true, Some(ZONE));
            let (order, events) = submit(&mut plain, &prefill);
            let (m, bytes) = transfer(&plain, &order);
            land(&mut plain, &m, &bytes);
            let digests = digests_of(&plain, &m, &bytes);
            plain.receive(KvTransfer {
                manifest: m,
                payload: KvPayload::Landed,
                digests,
            });
            finish(&mut plain, &events)
        };
        for bad_page in [None, Some(1)] {
            let sanitizer = Arc::new(kvsan_sanitizer::Sanitizer::with_writer(
                kvsan_sanitizer::Options::default(),
                std::io::sink(),
            ));
            let hooks = Hooks::sanitizer(sanitizer.clone());
            let (mut node, prefill) = node_with(true, Some(ZONE), hooks);
            let (order, events) = submit(&mut node, &prefill);
            let (m, bytes) = transfer(&node, &order);
            land(&mut node, &m, &bytes);
            let mut digests = digests_of(&node, &m, &bytes);
            if let Some(page) = bad_page {
                digests[page] ^= 1;
            }
            node.receive(KvTransfer {
                manifest: m,
                payload: KvPayload::Landed,
                digests,
            });
            let kinds: Vec<_> = sanitizer.violations().iter().map(|v| v.kind).collect();
            match bad_page {
                None => {
                    assert_eq!(finish(&mut node, &events), expected);
                    assert!(kinds.is_empty(), "{kinds:?}");
                }
                Some(_) => {
                    assert_eq!(
                        kinds,
                        [kvsan_sanitizer::ViolationKind::TransferDigestMismatch]
                    );
                    assert!(
                        matches!(events.try_iter().last(), Some(Event::Error(_))),
                        "the request is aborted"
                    );
                }
            }
        }
    }

    #[test]
    fn landed_kv_whose_pages_do_not_hold_the_manifests_checksum_is_refused() {
        let (mut node, prefill) = node(true, Some(ZONE));
        let (order, events) = submit(&mut node, &prefill);
        let (m, mut bytes) = transfer(&node, &order);
        bytes[5] ^= 1;
        land(&mut node, &m, &bytes);
        let digests = digests_of(&node, &m, &bytes);
        node.receive(KvTransfer {
            manifest: m,
            payload: KvPayload::Landed,
            digests,
        });
        match events.try_iter().last() {
            Some(Event::Error(e)) => assert!(
                e.message.contains("KV transfer refused: checksum"),
                "{}",
                e.message
            ),
            other => panic!("expected the request to fail, got {other:?}"),
        }
        assert!(matches!(
            prefill.try_recv(),
            Ok(Inbound::Message(ToPrefill::Cancel { .. }))
        ));
    }

    #[test]
    fn an_rdma_link_set_up_with_another_pools_registration_is_refused() {
        let other = LandingZone { rkey: 8, ..ZONE };
        let (registered, _prefill) = node(true, Some(other));
        assert!(registered.peer.is_none());
        let (unregistered, _prefill) = node(false, Some(other));
        assert!(unregistered.peer.is_none());
    }
}
