//! Owned ibverbs resources: an opened device with its protection domain, the
//! registered KV pool, registered buffers, and one reliable-connected queue
//! pair with its completion queues.
//!
//! The `sideway` crate is the two layers below (raw bindings to libibverbs,
//! loaded at run time, and RAII handles); this file is the layer the link
//! code uses. The unsafe operations of ibverbs — registering memory the NIC
//! may write at any time, and posting work requests that read or write local
//! memory until they complete — are wrapped here, each type holding what
//! keeps its memory valid.

use std::num::NonZeroU32;
use std::sync::Arc;
use std::time::{Duration, Instant};

use sideway::ibverbs::AccessFlags;
use sideway::ibverbs::address::{AddressHandleAttribute, Gid, GidType};
use sideway::ibverbs::completion::{BasicCompletionQueue, WorkCompletionStatus};
use sideway::ibverbs::device::{DeviceInfo, DeviceList};
use sideway::ibverbs::device_context::{DeviceContext, LinkLayer, Mtu};
use sideway::ibverbs::memory_region::MemoryRegion;
use sideway::ibverbs::protection_domain::ProtectionDomain;
use sideway::ibverbs::queue_pair::{
    BasicQueuePair, PostSendGuard, QueuePair, QueuePairAttribute, QueuePairState,
    SetScatterGatherEntry, WorkRequestFlags,
};

use kvsan_kernels::attention::KvGeometry;

use super::RdmaError;
use crate::kv_pool::KvPool;
use crate::transport::LandingZone;

/// Which device, port and GID an RDMA link uses.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct RdmaConfig {
    /// Device name (`mlx5_0`); `None`: the first device.
    pub device: Option<String>,
    /// Port number on the device (ports count from 1).
    pub port: u8,
    /// GID table index; `None`: the first RoCE v2 GID on Ethernet, index 0
    /// on InfiniBand.
    pub gid_index: Option<u8>,
}

impl Default for RdmaConfig {
    fn default() -> Self {
        RdmaConfig {
            device: None,
            port: 1,
            gid_index: None,
        }
    }
}

/// The RDMA devices present, by name.
///
/// # Errors
/// [`RdmaError::Verbs`] when the device list cannot be read: libibverbs is
/// not installed, or the kernel has no RDMA support (`ENOSYS`).
pub fn rdma_devices() -> Result<Vec<String>, RdmaError> {
    let list = DeviceList::new().map_err(|e| rdma_err("list devices", "-", e))?;
    Ok(list.iter().map(|d| d.name()).collect())
}

/// An opened RDMA device: its context, one protection domain for every
/// region and queue pair of this process, and the port's address.
pub struct RdmaDevice {
    // Field order is drop order: the protection domain before the context.
    pd: Arc<ProtectionDomain>,
    context: Arc<DeviceContext>,
    name: String,
    port: u8,
    lid: u16,
    gid: Gid,
    gid_index: u8,
    link_layer: LinkLayer,
    mtu: Mtu,
}

impl std::fmt::Debug for RdmaDevice {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("RdmaDevice")
            .field("name", &self.name)
            .field("port", &self.port)
            .field("lid", &self.lid)
            .field("gid", &self.gid.to_string())
            .field("gid_index", &self.gid_index)
            .field("mtu", &self.mtu)
            .finish_non_exhaustive()
    }
}

impl RdmaDevice {
    /// Opens the device `config` names (or the first) and allocates its
    /// protection domain.
    ///
    /// # Errors
    /// [`RdmaError::Verbs`] when a verbs call fails (no libibverbs, no
    /// kernel support), [`RdmaError::NoDevice`] when there is no such
    /// device, [`RdmaError::Protocol`] when the port is not active or has
    /// no usable GID.
    pub fn open(config: &RdmaConfig) -> Result<Arc<RdmaDevice>, RdmaError> {
        let list = DeviceList::new().map_err(|e| rdma_err("list devices", "-", e))?;
        let device = match &config.device {
            Some(want) => list.iter().find(|d| d.name() == *want),
            None => list.iter().next(),
        };
        let Some(device) = device else {
            return Err(RdmaError::NoDevice {
                wanted: config.device.clone(),
                found: list.iter().map(|d| d.name()).collect(),
            });
        };
        let name = device.name();
        let context = device
            .open()
            .map_err(|e| rdma_err("open device", &name, e))?;
        let port_attr = context
            .query_port(config.port)
            .map_err(|e| rdma_err("query port", &name, e))?;
        let link_layer = port_attr.link_layer();
        let gid_index = match config.gid_index {
            Some(i) => i,
            None => pick_gid_index(&context, config.port, port_attr.gid_tbl_len(), link_layer)
                .ok_or_else(|| RdmaError::Protocol {
                    peer: name.clone(),
                    what: format!(
                        "port {} has no usable GID in its {} entries; set the GID index",
                        config.port,
                        port_attr.gid_tbl_len()
                    ),
                })?,
        };
        let gid = context
            .query_gid(config.port, u32::from(gid_index))
            .map_err(|e| rdma_err("query GID", &name, e))?;
        let pd = context
            .alloc_pd()
            .map_err(|e| rdma_err("allocate protection domain", &name, e))?;
        Ok(Arc::new(RdmaDevice {
            pd,
            context,
            port: config.port,
            lid: port_attr.lid(),
            gid,
            gid_index,
            link_layer,
            mtu: port_attr.active_mtu(),
            name,
        }))
    }

    /// The device's name.
    #[must_use]
    pub fn name(&self) -> &str {
        &self.name
    }

    /// Registers `len` bytes at `addr` for local writes and, with
    /// `remote_write`, for RDMA WRITEs from the peer.
    ///
    /// # Safety
    /// - `addr..addr + len` is one allocation, valid for reads and writes,
    ///   and stays allocated (not freed, not moved) until the returned
    ///   region is dropped;
    /// - the caller accepts that the NIC writes into it whenever a work
    ///   request (or, with `remote_write`, the peer) says so, whatever Rust
    ///   references to it exist.
    unsafe fn register(
        &self,
        addr: *mut u8,
        len: usize,
        remote_write: bool,
    ) -> Result<Arc<MemoryRegion>, RdmaError> {
        let mut access = AccessFlags::LocalWrite;
        if remote_write {
            access |= AccessFlags::RemoteWrite;
        }
        // SAFETY: the caller guarantees the range stays valid and in place
        // until the region is dropped, and accepts NIC writes into it.
        unsafe { self.pd.reg_mr(addr as usize, len, access) }
            .map_err(|e| rdma_err("register memory", &self.name, e))
    }
}

/// The first GID worth using on `port`: on Ethernet (RoCE) a non-zero RoCE v2
/// GID, else any non-zero one; on InfiniBand index 0.
fn pick_gid_index(
    context: &DeviceContext,
    port: u8,
    table_len: i32,
    link_layer: LinkLayer,
) -> Option<u8> {
    if link_layer != LinkLayer::Ethernet {
        return Some(0);
    }
    let len = u8::try_from(table_len.clamp(0, 255)).unwrap_or(u8::MAX);
    let usable = |i: u8| {
        context
            .query_gid(port, u32::from(i))
            .is_ok_and(|g| !g.is_zero())
    };
    (0..len)
        .find(|&i| {
            usable(i)
                && context
                    .query_gid_type(port, u32::from(i))
                    .is_ok_and(|t| t == GidType::RoceV2 as u32)
        })
        .or_else(|| (0..len).find(|&i| usable(i)))
}

/// The registration of a [`KvPool`]'s page storage with the NIC for RDMA
/// WRITEs from the peer, held apart from the pool.
///
/// A decode node owns its pool in its `Executor`; this type lets it hold
/// the registration next to the pool without owning it. Whoever creates one
/// (through the `unsafe` [`PoolRegistration::new`]) promises that the pool
/// outlives it and that the pool's storage never moves while it lives; the
/// decode node keeps it in a field dropped before its core (which holds the
/// pool). [`RegisteredPool`] bundles both for callers that own a pool alone.
///
/// The region covers `pool.data()` (all pages, as bytes). Deregistration
/// (the drop) returns only once the NIC will not touch the memory again;
/// a peer that writes with the old remote key afterwards gets a remote
/// access error and its link breaks.
pub struct PoolRegistration {
    region: Arc<MemoryRegion>,
    device: Arc<RdmaDevice>,
    geometry: KvGeometry,
    n_pages: u32,
}

impl std::fmt::Debug for PoolRegistration {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("PoolRegistration")
            .field("device", &self.device.name)
            .field("addr", &format_args!("{:#x}", self.region.get_ptr()))
            .field("bytes", &self.region.region_len())
            .field("pages", &self.n_pages)
            .finish_non_exhaustive()
    }
}

impl PoolRegistration {
    /// Registers `pool`'s page storage on `device` for remote writes.
    ///
    /// # Safety
    /// - the pool's page storage outlives the returned registration: the
    ///   pool is dropped only after the registration is;
    /// - the storage never moves while the registration lives: the pool is
    ///   not replaced (`std::mem::swap`, `replace`, assigning a new pool) —
    ///   moving the `KvPool` value itself is fine, it moves only its handle,
    ///   and a `KvPool` allocates its storage once and never grows it;
    /// - the caller accepts that the peer's RDMA WRITEs land in the pages at
    ///   any time while registered, whatever Rust references to them exist
    ///   (the decode node reads a page only after the completion message of
    ///   the transfer that wrote it, the contract of any DMA buffer).
    ///
    /// # Errors
    /// [`RdmaError::Verbs`] when the registration fails (memory lock limit,
    /// no device).
    pub unsafe fn new(device: &Arc<RdmaDevice>, pool: &mut KvPool) -> Result<Self, RdmaError> {
        let geometry = *pool.geometry();
        let n_pages = u32::try_from(pool.n_pages()).unwrap_or(u32::MAX);
        let data = pool.data_mut();
        let len = std::mem::size_of_val(data);
        let addr = data.as_mut_ptr().cast::<u8>();
        // SAFETY: `addr..addr + len` is the pool's page storage, one
        // allocation; the caller guarantees it stays allocated and in place
        // until the region (held only by the returned value) is dropped, and
        // accepts the peer's writes into it.
        let region = unsafe { device.register(addr, len, true) }?;
        Ok(PoolRegistration {
            region,
            device: Arc::clone(device),
            geometry,
            n_pages,
        })
    }

    /// What an endpoint handshake offers the peer: the registered range,
    /// its remote key, the page geometry. A plain description: it keeps
    /// nothing registered, and writes with it after this registration is
    /// dropped fail at the NIC.
    #[must_use]
    pub fn region(&self) -> PoolRegion {
        PoolRegion {
            device: Arc::clone(&self.device),
            remote: RemotePool {
                addr: self.region.get_ptr() as u64,
                len: self.region.region_len() as u64,
                rkey: self.region.rkey(),
                geometry: self.geometry,
                n_pages: self.n_pages,
            },
        }
    }
}

/// A registered pool as an endpoint handshake offers it to the prefill side
/// ([`PoolRegistration::region`], [`RegisteredPool::region`]).
#[derive(Clone, Debug)]
pub struct PoolRegion {
    device: Arc<RdmaDevice>,
    remote: RemotePool,
}

impl PoolRegion {
    /// The device the pool is registered on.
    #[must_use]
    pub fn device(&self) -> &Arc<RdmaDevice> {
        &self.device
    }

    pub(crate) fn remote(&self) -> RemotePool {
        self.remote
    }

    /// The range as the decode node recognises its own registration.
    pub(crate) fn landing_zone(&self) -> LandingZone {
        LandingZone {
            addr: self.remote.addr,
            len: self.remote.len,
            rkey: self.remote.rkey,
        }
    }
}

/// A [`KvPool`] that owns its [`PoolRegistration`]: for callers that hold a
/// pool alone (tests, tools). The pool is lent out as `&KvPool`, or as
/// `&mut KvPool` only through [`RegisteredPool::pool_mut`], whose contract
/// forbids moving the pool out from behind the reference.
pub struct RegisteredPool {
    // Field order is drop order: deregister, then free the pool.
    registration: PoolRegistration,
    pool: KvPool,
}

impl std::fmt::Debug for RegisteredPool {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("RegisteredPool")
            .field("registration", &self.registration)
            .finish_non_exhaustive()
    }
}

impl RegisteredPool {
    /// Registers `pool`'s page storage on `device` for remote writes.
    ///
    /// # Errors
    /// [`RdmaError::Verbs`] when the registration fails (memory lock limit,
    /// no device); the pool is dropped then.
    pub fn register(device: &Arc<RdmaDevice>, mut pool: KvPool) -> Result<Self, RdmaError> {
        // SAFETY: the pool moves into the returned value, whose field order
        // drops the registration before the pool; nothing replaces the pool
        // (`pool_mut`'s contract forbids it), and moving the `KvPool` value
        // into the struct does not move its storage.
        let registration = unsafe { PoolRegistration::new(device, &mut pool) }?;
        Ok(RegisteredPool { registration, pool })
    }

    /// The pool.
    #[must_use]
    pub fn pool(&self) -> &KvPool {
        &self.pool
    }

    /// The pool, for allocation, frees and page writes.
    ///
    /// # Safety
    /// The caller must not move the `KvPool` out from behind the reference
    /// (`std::mem::swap`, `replace`, `take`, assigning a new pool): the NIC
    /// may write into its storage until this `RegisteredPool` is dropped.
    /// Calling its methods, including [`KvPool::data_mut`], is fine.
    pub unsafe fn pool_mut(&mut self) -> &mut KvPool {
        &mut self.pool
    }

    /// Deregisters the storage and gives the pool back.
    #[must_use]
    pub fn into_pool(self) -> KvPool {
        let RegisteredPool { registration, pool } = self;
        drop(registration);
        pool
    }

    /// The device the pool is registered on.
    #[must_use]
    pub fn device(&self) -> &Arc<RdmaDevice> {
        &self.registration.device
    }

    /// What an endpoint handshake offers the peer.
    #[must_use]
    pub fn region(&self) -> PoolRegion {
        self.registration.region()
    }
}

/// A heap buffer registered for local use by work requests (staging for
/// RDMA WRITEs, SEND and RECV buffers).
pub(crate) struct RegisteredBuffer {
    // Field order is drop order: deregister, then free.
    region: Arc<MemoryRegion>,
    buf: Box<[u8]>,
}

impl RegisteredBuffer {
    /// A zeroed buffer of `len` bytes, registered on `device`.
    pub(crate) fn new(device: &RdmaDevice, len: usize) -> Result<Self, RdmaError> {
        let mut buf = vec![0u8; len.max(1)].into_boxed_slice();
        // SAFETY: the boxed slice is one allocation that stays in place for
        // as long as `buf` lives; the struct drops the region first. Only
        // local work requests write into it (no remote access).
        let region = unsafe { device.register(buf.as_mut_ptr(), buf.len(), false) }?;
        Ok(RegisteredBuffer { region, buf })
    }

    /// Bytes in the buffer.
    pub(crate) fn len(&self) -> usize {
        self.buf.len()
    }

    /// The buffer (only while no work request that writes it is in flight).
    pub(crate) fn bytes_mut(&mut self) -> &mut [u8] {
        &mut self.buf
    }

    /// The buffer's bytes `range`.
    pub(crate) fn bytes(&self, range: std::ops::Range<usize>) -> &[u8] {
        &self.buf[range]
    }

    /// The address of byte `offset` and the local key, for a scatter/gather
    /// entry.
    pub(crate) fn sge(&self, offset: usize) -> (u64, u32) {
        debug_assert!(offset <= self.buf.len());
        (self.buf.as_ptr() as u64 + offset as u64, self.region.lkey())
    }
}

/// The decode node's registered pool, as the prefill side addresses it.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) struct RemotePool {
    pub addr: u64,
    pub len: u64,
    pub rkey: u32,
    pub geometry: KvGeometry,
    pub n_pages: u32,
}

/// What one side tells the other to connect its queue pair.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) struct QpEndpoint {
    pub qp_num: u32,
    pub psn: u32,
    pub lid: u16,
    pub gid: [u8; 16],
    /// The port's active MTU, as `ibv_mtu` (1 = 256 … 5 = 4096).
    pub mtu: u8,
}

/// One work completion, copied out of the completion queue.
#[derive(Clone, Copy, Debug)]
pub(crate) struct Completion {
    pub wr_id: u64,
    pub status: u32,
    pub byte_len: u32,
}

impl Completion {
    pub(crate) fn is_success(&self) -> bool {
        self.status == WorkCompletionStatus::Success as u32
    }

    /// The status, named as libibverbs names it.
    pub(crate) fn status_name(&self) -> String {
        // libibverbs defines statuses 0 (success) to 23; `From` panics on
        // anything else.
        if self.status <= 23 {
            format!("{:?}", WorkCompletionStatus::from(self.status))
        } else {
            format!("status {}", self.status)
        }
    }
}

/// A work request for the send queue.
#[derive(Clone, Copy, Debug)]
pub(crate) enum SendKind {
    /// RDMA WRITE into the peer's memory.
    Write { remote_addr: u64, rkey: u32 },
    /// SEND, consumed by one of the peer's posted receives.
    Send,
}

/// A send-queue work request over one local buffer range.
#[derive(Clone, Copy, Debug)]
pub(crate) struct SendOp {
    pub wr_id: u64,
    pub kind: SendKind,
    pub addr: u64,
    pub lkey: u32,
    pub len: u32,
    pub signaled: bool,
}

/// A reliable-connected queue pair with its send and receive completion
/// queues.
pub(crate) struct QueuePairRc {
    // Field order is drop order: the queue pair (which stops all its DMA)
    // before the completion queues.
    qp: BasicQueuePair,
    send_cq: Arc<BasicCompletionQueue>,
    recv_cq: Arc<BasicCompletionQueue>,
    device: Arc<RdmaDevice>,
    psn: u32,
}

impl QueuePairRc {
    /// A queue pair in the INIT state, accepting RDMA WRITEs into regions
    /// registered with remote write access.
    pub(crate) fn new(
        device: &Arc<RdmaDevice>,
        max_send_wr: u32,
        max_recv_wr: u32,
    ) -> Result<Self, RdmaError> {
        let name = device.name.as_str();
        let mut send_cq = device
            .context
            .create_cq_builder()
            .setup_cqe(max_send_wr + 1)
            .build()
            .map_err(|e| rdma_err("create send completion queue", name, e))?;
        let mut recv_cq = device
            .context
            .create_cq_builder()
            .setup_cqe(max_recv_wr + 1)
            .build()
            .map_err(|e| rdma_err("create receive completion queue", name, e))?;
        // Poll up to 32 completions per call (the CQs are not shared yet).
        for cq in [&mut send_cq, &mut recv_cq] {
            if let Some(cq) = Arc::get_mut(cq) {
                cq.setup_poll_batch(NonZeroU32::new(32).unwrap_or(NonZeroU32::MIN));
            }
        }
        let mut qp = device
            .pd
            .create_qp_builder()
            .setup_max_send_wr(max_send_wr)
            .setup_max_recv_wr(max_recv_wr)
            .setup_max_send_sge(1)
            .setup_max_recv_sge(1)
            .setup_send_cq(Arc::clone(&send_cq))
            .setup_recv_cq(Arc::clone(&recv_cq))
            .build()
            .map_err(|e| rdma_err("create queue pair", name, e))?;
        let mut attr = QueuePairAttribute::new();
        attr.setup_state(QueuePairState::Init)
            .setup_pkey_index(0)
            .setup_port(device.port)
            .setup_access_flags(AccessFlags::LocalWrite | AccessFlags::RemoteWrite);
        qp.modify(&attr)
            .map_err(|e| rdma_err("move queue pair to INIT", name, e))?;
        Ok(QueuePairRc {
            qp,
            send_cq,
            recv_cq,
            device: Arc::clone(device),
            psn: initial_psn(),
        })
    }

    /// What the peer needs to connect to this queue pair.
    pub(crate) fn endpoint(&self) -> QpEndpoint {
        QpEndpoint {
            qp_num: self.qp.qp_number(),
            psn: self.psn,
            lid: self.device.lid,
            gid: self.device.gid.raw,
            mtu: mtu_code(self.device.mtu),
        }
    }

    /// Connects to the peer's queue pair: INIT → RTR → RTS.
    pub(crate) fn connect(&mut self, peer: &QpEndpoint) -> Result<(), RdmaError> {
        let name = self.device.name.clone();
        let mtu = mtu_from_code(peer.mtu.min(mtu_code(self.device.mtu)));
        let mut ah = AddressHandleAttribute::new();
        ah.setup_dest_lid(peer.lid)
            .setup_port(self.device.port)
            .setup_service_level(0);
        if self.device.link_layer == LinkLayer::Ethernet || peer.lid == 0 {
            ah.setup_grh_src_gid_index(self.device.gid_index)
                .setup_grh_dest_gid(&Gid { raw: peer.gid })
                .setup_grh_hop_limit(64);
        }
        let mut rtr = QueuePairAttribute::new();
        rtr.setup_state(QueuePairState::ReadyToReceive)
            .setup_path_mtu(mtu)
            .setup_dest_qp_num(peer.qp_num)
            .setup_rq_psn(peer.psn)
            .setup_max_dest_read_atomic(0)
            // 0 = the longest RNR wait the peer is told to back off (655 ms).
            .setup_min_rnr_timer(0)
            .setup_address_vector(&ah);
        self.qp
            .modify(&rtr)
            .map_err(|e| rdma_err("move queue pair to RTR", &name, e))?;
        let mut rts = QueuePairAttribute::new();
        rts.setup_state(QueuePairState::ReadyToSend)
            .setup_sq_psn(self.psn)
            // 4.096 µs × 2^14 ≈ 67 ms per try, 7 tries: a dead peer fails a
            // send within about half a second.
            .setup_timeout(14)
            .setup_retry_cnt(7)
            // Receiver not ready: 6 retries of up to 655 ms, then an error
            // rather than waiting forever on a stuck peer.
            .setup_rnr_retry(6)
            .setup_max_read_atomic(0);
        self.qp
            .modify(&rts)
            .map_err(|e| rdma_err("move queue pair to RTS", &name, e))
    }

    /// Moves the queue pair to the error state: every posted work request
    /// completes (flushed) and the NIC stops touching their buffers.
    pub(crate) fn set_error(&mut self) {
        let mut attr = QueuePairAttribute::new();
        attr.setup_state(QueuePairState::Error);
        // A failure here leaves the queue pair as it was; dropping it still
        // destroys it, which also stops its DMA.
        let _ = self.qp.modify(&attr);
    }

    /// Posts a receive of up to `len` bytes into `buf` at `offset`.
    ///
    /// # Safety
    /// `buf` must stay alive and the bytes `offset..offset + len` must not be
    /// read or written by anyone else until the receive completes or this
    /// queue pair is dropped.
    pub(crate) unsafe fn post_recv(
        &mut self,
        wr_id: u64,
        buf: &RegisteredBuffer,
        offset: usize,
        len: u32,
    ) -> Result<(), RdmaError> {
        debug_assert!(offset + len as usize <= buf.len());
        let (addr, lkey) = buf.sge(offset);
        let mut guard = self.qp.start_post_recv();
        let wr = guard.construct_wr(wr_id);
        // SAFETY: `addr..addr + len` lies in `buf`'s registered memory
        // (checked by the caller's offsets); the caller keeps it alive and
        // untouched until the receive completes or the queue pair is gone.
        unsafe { wr.setup_sge(lkey, addr, len) };
        guard
            .post()
            .map_err(|e| rdma_err("post receive", &self.device.name, e))
    }

    /// Posts `ops` to the send queue, in order, as one list.
    ///
    /// # Safety
    /// Every op's `addr..addr + len` must lie in a region registered on this
    /// device under `lkey`, and stay alive and unwritten until the op
    /// completes (or, for an unsignaled op, until a later signaled op of the
    /// same queue completes) or the queue pair is moved to the error state
    /// and drained, or dropped.
    pub(crate) unsafe fn post_send(&mut self, ops: &[SendOp]) -> Result<(), RdmaError> {
        let mut guard = self.qp.start_post_send();
        for op in ops {
            let flags = if op.signaled {
                WorkRequestFlags::Signaled
            } else {
                WorkRequestFlags::none()
            };
            let wr = guard.construct_wr(op.wr_id, flags);
            let wr = match op.kind {
                SendKind::Write { remote_addr, rkey } => wr.setup_write(rkey, remote_addr),
                SendKind::Send => wr.setup_send(),
            };
            // SAFETY: the caller guarantees the range is registered under
            // `lkey` and stays valid until the op has completed.
            unsafe { wr.setup_sge(op.lkey, op.addr, op.len) };
        }
        guard
            .post()
            .map_err(|e| rdma_err("post send", &self.device.name, e))
    }

    /// Appends the send queue's completions to `out` (does not wait).
    pub(crate) fn poll_send(&self, out: &mut Vec<Completion>) -> Result<(), RdmaError> {
        poll(&self.send_cq, &self.device.name, out)
    }

    /// Appends the receive queue's completions to `out` (does not wait).
    pub(crate) fn poll_recv(&self, out: &mut Vec<Completion>) -> Result<(), RdmaError> {
        poll(&self.recv_cq, &self.device.name, out)
    }

    /// Waits until the send completion `wr_id` arrives, or an error
    /// completion, or `timeout`.
    pub(crate) fn wait_send(&self, wr_id: u64, timeout: Duration) -> Result<(), String> {
        let deadline = Instant::now() + timeout;
        let mut done = Vec::new();
        let mut backoff = Backoff::default();
        loop {
            done.clear();
            self.poll_send(&mut done).map_err(|e| e.to_string())?;
            for c in &done {
                if !c.is_success() {
                    return Err(format!(
                        "work request {} completed with {}",
                        c.wr_id,
                        c.status_name()
                    ));
                }
                if c.wr_id == wr_id {
                    return Ok(());
                }
            }
            if done.is_empty() {
                if Instant::now() >= deadline {
                    return Err(format!(
                        "no completion for work request {wr_id} within {timeout:?}"
                    ));
                }
                backoff.wait();
            } else {
                backoff.reset();
            }
        }
    }
}

fn poll(
    cq: &BasicCompletionQueue,
    device: &str,
    out: &mut Vec<Completion>,
) -> Result<(), RdmaError> {
    use sideway::ibverbs::completion::PollCompletionQueueError;
    match cq.start_poll() {
        Ok(poller) => {
            out.extend(poller.map(|wc| Completion {
                wr_id: wc.wr_id(),
                status: wc.status(),
                byte_len: wc.byte_len(),
            }));
            Ok(())
        }
        Err(PollCompletionQueueError::CompletionQueueEmpty) => Ok(()),
        Err(e) => Err(rdma_err("poll completion queue", device, e)),
    }
}

/// Spin briefly, then yield, then sleep up to 1 ms: completions usually
/// arrive within microseconds, and a waiting thread must not hog a core.
#[derive(Default)]
pub(crate) struct Backoff(u32);

impl Backoff {
    pub(crate) fn wait(&mut self) {
        self.0 = self.0.saturating_add(1);
        match self.0 {
            0..64 => std::hint::spin_loop(),
            64..128 => std::thread::yield_now(),
            n => std::thread::sleep(Duration::from_micros(u64::from((n - 127).min(1000)))),
        }
    }
    pub(crate) fn reset(&mut self) {
        self.0 = 0;
    }
}

/// A random 24-bit initial packet sequence number.
fn initial_psn() -> u32 {
    rand::random::<u32>() & 0x00ff_ffff
}

fn mtu_code(mtu: Mtu) -> u8 {
    match mtu {
        Mtu::Mtu256 => 1,
        Mtu::Mtu512 => 2,
        Mtu::Mtu1024 => 3,
        Mtu::Mtu2048 => 4,
        Mtu::Mtu4096 => 5,
    }
}

fn mtu_from_code(code: u8) -> Mtu {
    match code {
        0 | 1 => Mtu::Mtu256,
        2 => Mtu::Mtu512,
        3 => Mtu::Mtu1024,
        4 => Mtu::Mtu2048,
        _ => Mtu::Mtu4096,
    }
}

pub(crate) fn rdma_err(
    op: &'static str,
    device: &str,
    e: impl std::error::Error + Send + Sync + 'static,
) -> RdmaError {
    let mut detail = e.to_string();
    let mut cause = e.source();
    while let Some(c) = cause {
        detail.push_str(": ");
        detail.push_str(&c.to_string());
        cause = c.source();
    }
    RdmaError::Verbs {
        op,
        device: device.to_string(),
        detail,
        source: Box::new(e),
    }
}
