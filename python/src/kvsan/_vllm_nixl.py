"""kvsan at vLLM's NIXL connector worker: the READs it posts, checked as NIXL
takes them.

A decode engine's NIXL worker pulls a prefill engine's KV with one-sided
READs. What a READ moves is what NIXL is given: two prepared descriptor
lists (``prep_xfer_dlist``: byte ranges of the local and of the remote KV
memory) and, per transfer, the indices into them (``make_prepped_xfer``).
The adapter keeps each list's byte ranges and maps an index back to the
block it lies in, through the regions the worker registered (its own:
``kv_caches_base_addr``, ``block_stride_per_layer``; the remote's: the
``NixlAgentMetadata`` of the handshake). So the checked blocks are those
the bytes really go to and come from, not the ids vLLM computed them from:

* the destination blocks must be the reading request's when the READ is
  posted; they count as written only once NIXL reports the transfer done
  (``check_xfer_state``), only the tokens the load was for, and only where
  the READs of the request covered the whole block in every region (a
  block partly covered keeps the slots it had: its attention then reads
  unwritten slots);
* the source blocks, where the prefill engine's scheduler is in this
  process, must be among those its request handed out
  (``request_finished``), at the generation it handed them, and still
  held: a READ of blocks the producer let go of and handed to another
  request reads that request's KV.

Transfers the adapter cannot map (a descriptor list it did not see
prepared, a host staging buffer, Mamba state regions, more than one KV
cache group, a producer in another process) are counted in
``Adapter.unchecked_transfers`` by the reason; for them the scheduler's
report of the load (``finished_recving``) marks the tokens written.
"""

from __future__ import annotations

import inspect
import threading
import weakref
from collections import OrderedDict
from dataclasses import dataclass, field
from typing import Any, Callable
from unittest import mock

import numpy as np

from ._abi import Owner, PageRef

# The local agent's name in vLLM's prepared descriptor lists.
_LOCAL_AGENT = "NIXL_INIT_AGENT"
# Hand-offs kept after their send is over: a late READ of one is checked.
_HANDOFFS_KEPT = 4096


@dataclass
class _Regions:
    """One engine rank's registered KV memory: a region per layer (or per
    K and V), each ``count`` kernel blocks of ``lens`` bytes, ``strides``
    bytes apart; ``ppl`` kernel blocks make one of the scheduler's blocks."""

    bases: np.ndarray
    strides: np.ndarray
    counts: np.ndarray
    lens: np.ndarray
    ppl: int

    @classmethod
    def of(cls, bases: Any, strides: Any, counts: Any, lens: Any, ppl: int) -> "_Regions | None":
        b = np.asarray(list(bases), dtype=np.int64)
        s = np.asarray(list(strides), dtype=np.int64)
        c = np.asarray(list(counts), dtype=np.int64)
        n = np.asarray(list(lens), dtype=np.int64)
        if not (len(b) == len(s) == len(c) == len(n)) or len(b) == 0 or (s <= 0).any() or ppl < 1:
            return None
        return cls(b, s, c, n, int(ppl))

    def locate(self, addrs: np.ndarray) -> tuple[np.ndarray, np.ndarray, np.ndarray] | None:
        """Each address's region, block (the scheduler's), and offset in
        the block's data (kernel sub-blocks laid end to end); ``None`` if
        one lies outside every region."""
        region = np.full(len(addrs), -1, dtype=np.int64)
        for i in range(len(self.bases)):
            inside = (addrs >= self.bases[i]) & (addrs < self.bases[i] + self.counts[i] * self.strides[i])
            region[inside & (region < 0)] = i
        if (region < 0).any():
            return None
        rel = addrs - self.bases[region]
        kernel = rel // self.strides[region]
        offset = (kernel % self.ppl) * self.lens[region] + rel % self.strides[region]
        return region, kernel // self.ppl, offset


@dataclass
class _Read:
    """A READ posted for a request, until NIXL reports it done."""

    rid: str
    st: Any
    manager: Any
    owner: Owner
    # Bytes of one block's data in each region.
    sizes: list[int]
    # Destination: per block, the ref it had when the READ was posted and
    # the byte ranges written in each region.
    refs: dict[int, PageRef]
    spans: dict[tuple[int, int], list[tuple[int, int]]]


@dataclass(eq=False)
class _Agent:
    """What the adapter saw of one worker's NIXL agent."""

    # Prepared descriptor lists: start and length of each descriptor, and
    # whose memory they are (None: local; else engine id and rank).
    dlists: dict[Any, tuple[np.ndarray, np.ndarray, tuple[str, int] | None]] = field(default_factory=dict)
    remotes: dict[tuple[str, int], _Regions] = field(default_factory=dict)
    reads: dict[Any, _Read] = field(default_factory=dict)
    # Per request being loaded: byte ranges landed so far, by block and
    # region, and the slots of each block marked written.
    landed: dict[str, tuple[dict[tuple[int, int], list[tuple[int, int]]], dict[int, np.ndarray]]] = field(default_factory=dict)


def _descriptors(descs: Any) -> tuple[np.ndarray, np.ndarray] | None:
    """A descriptor list's (start, length) per descriptor: NIXL's strided
    rows (address, length, device, stride, count), or plain (address,
    length, device) rows."""
    try:
        a = np.asarray(descs, dtype=np.int64)
    except (TypeError, ValueError):
        return None
    if a.ndim != 2 or a.shape[1] not in (3, 4, 5):
        return None
    if a.shape[1] != 5:
        return a[:, 0].copy(), a[:, 1].copy()
    counts = a[:, 4]
    first = np.repeat(np.cumsum(counts) - counts, counts)
    j = np.arange(int(counts.sum()), dtype=np.int64) - first
    return np.repeat(a[:, 0], counts) + j * np.repeat(a[:, 3], counts), np.repeat(a[:, 1], counts)


def _slots_covered(spans: list[tuple[int, int]], size: int, slots: int) -> np.ndarray:
    """Which of a block's ``slots`` the byte ranges cover, the block's
    ``size`` bytes of data being its slots in order (vLLM moves a block by
    sub-blocks of whole token ranges: a descriptor of part of a block is
    the tokens in that part). A slot counts only if all its bytes are in."""
    covered = np.zeros(slots, dtype=bool)
    if size % slots:
        # Bytes not a whole number per slot: only the whole block counts.
        merged = _merge(spans)
        covered[:] = bool(merged) and merged[0][0] <= 0 and merged[0][1] >= size
        return covered
    per = size // slots
    for lo, hi in _merge(spans):
        covered[-(-lo // per) : max(0, hi) // per] = True
    return covered


def _merge(spans: list[tuple[int, int]]) -> list[tuple[int, int]]:
    out: list[tuple[int, int]] = []
    for lo, hi in sorted(spans):
        if out and lo <= out[-1][1]:
            out[-1] = (out[-1][0], max(out[-1][1], hi))
        else:
            out.append((lo, hi))
    return out


class NixlReads:
    """The NIXL side of :class:`kvsan.vllm.Adapter` (mixed in: it uses the
    adapter's pools, owners, load records and findings)."""

    # The adapter's, used here.
    _lock: Any
    _local: threading.local
    _loading: dict[str, tuple[int, int, set[int]]]
    _wrap: Callable[..., None]
    _state: Callable[[Any], Any]
    _slot_exact: Callable[[Any, Any], bool]
    _owner: Callable[[Any, str], Owner]
    _anonymous: Callable[[], Owner]
    _note: Callable[..., None]

    def _nixl_init(self) -> None:
        # What the adapter saw of each watched NIXL agent (kept on the agent).
        self._agents: weakref.WeakSet[_Agent] = weakref.WeakSet()
        # Engines whose scheduler is in this process, by engine id.
        self._engines: weakref.WeakValueDictionary[str, Any] = weakref.WeakValueDictionary()
        # What finished requests handed to a remote reader, by engine id
        # and request id: per block, its pool, the request, its ref and
        # the tokens handed in it.
        self._handoffs: OrderedDict[tuple[str, str], dict[int, tuple[Any, Owner, PageRef, int]]] = OrderedDict()
        # Loads whose landing a checked READ reports (the scheduler's
        # report then marks nothing).
        self._landing_seen: set[str] = set()
        self._read_blocks_sig: inspect.Signature | None = None
        #: READs checked, and transfers left unchecked by the reason.
        self.checked_transfers = 0
        self.unchecked_transfers: dict[str, int] = {}

    # ---- attaching ----------------------------------------------------------

    def _attach_nixl(self) -> None:
        try:
            from vllm.distributed.kv_transfer.kv_connector.v1.nixl import base_worker, pull_worker
        except Exception as e:  # a vLLM build without the NIXL connector
            self.unchecked_transfers[f"the NIXL connector did not import ({type(e).__name__}: {e})"] = 0
            return
        worker = base_worker.NixlBaseConnectorWorker
        self._wrap(worker, "__init__", self._on_nixl_worker_init)
        self._wrap(worker, "add_remote_agent", self._on_add_remote_agent)
        self._wrap(pull_worker.NixlPullConnectorWorker, "_read_blocks", self._on_read_blocks)
        self._read_blocks_sig = inspect.signature(vars(pull_worker.NixlPullConnectorWorker)["_read_blocks"].__wrapped__)

    def _note_engine(self, sched: Any) -> None:
        engine = _engine_id(getattr(sched, "vllm_config", None))
        if engine is not None and self._engines.get(engine) is not sched:
            self._engines[engine] = sched

    def _skip_transfer(self, reason: str) -> None:
        self.unchecked_transfers[reason] = self.unchecked_transfers.get(reason, 0) + 1

    def _on_nixl_worker_init(self, original: Callable[..., Any], worker: Any, *a: Any, **kw: Any) -> Any:
        out = original(worker, *a, **kw)
        agent = getattr(worker, "nixl_wrapper", None)
        if agent is None or isinstance(agent, mock.NonCallableMock) or hasattr(agent, "_kvsan_seen"):
            return out
        try:
            self._watch_agent(worker, agent)
        except (AttributeError, TypeError):
            self._skip_transfer("NIXL agents whose methods cannot be wrapped")
        return out

    def _watch_agent(self, worker: Any, agent: Any) -> None:
        seen = _Agent()
        prep, make, state, release = (
            agent.prep_xfer_dlist,
            agent.make_prepped_xfer,
            agent.check_xfer_state,
            agent.release_xfer_handle,
        )

        def prep_xfer_dlist(agent_name: Any, descs: Any, *a: Any, **kw: Any) -> Any:
            handle = prep(agent_name, descs, *a, **kw)
            ranges = _descriptors(descs)
            adding = getattr(self._local, "adding", None)
            if ranges is not None and (agent_name == _LOCAL_AGENT or adding is not None):
                seen.dlists[handle] = (*ranges, None if agent_name == _LOCAL_AGENT else adding)
            return handle

        def make_prepped_xfer(op: Any, local: Any, local_ids: Any, remote: Any, remote_ids: Any, *a: Any, **kw: Any) -> Any:
            handle = make(op, local, local_ids, remote, remote_ids, *a, **kw)
            ctx = getattr(self._local, "read", None)
            if op == "READ" and ctx is not None and ctx[0] is worker:
                with self._lock:
                    self._posted(worker, seen, handle, (local, local_ids), (remote, remote_ids), ctx[1:])
            return handle

        def check_xfer_state(handle: Any, *a: Any, **kw: Any) -> Any:
            out = state(handle, *a, **kw)
            if out == "DONE" and handle in seen.reads:
                with self._lock:
                    self._landed(seen, seen.reads.pop(handle))
            elif out not in ("DONE", "PROC"):
                seen.reads.pop(handle, None)  # failed: nothing lands
            return out

        def release_xfer_handle(handle: Any, *a: Any, **kw: Any) -> Any:
            seen.reads.pop(handle, None)
            return release(handle, *a, **kw)

        agent.prep_xfer_dlist = prep_xfer_dlist
        agent.make_prepped_xfer = make_prepped_xfer
        agent.check_xfer_state = check_xfer_state
        agent.release_xfer_handle = release_xfer_handle
        agent._kvsan_seen = seen
        self._agents.add(seen)

    def _on_add_remote_agent(self, original: Callable[..., Any], worker: Any, meta: Any, *a: Any, **kw: Any) -> Any:
        rank = a[0] if a else kw.get("remote_tp_rank", 0)
        self._local.adding = (meta.engine_id, rank)
        try:
            out = original(worker, meta, *a, **kw)
        finally:
            self._local.adding = None
        agent = getattr(getattr(worker, "nixl_wrapper", None), "_kvsan_seen", None)
        if isinstance(agent, _Agent):
            bases = meta.kv_caches_base_addr
            counts = meta.region_num_blocks or [meta.num_blocks] * len(bases)
            regions = _Regions.of(bases, meta.block_strides, counts, meta.block_lens, meta.physical_blocks_per_logical_kv_block or 1)
            if regions is not None:
                agent.remotes[(meta.engine_id, rank)] = regions
        return out

    def _on_read_blocks(self, original: Callable[..., Any], worker: Any, *a: Any, **kw: Any) -> Any:
        assert self._read_blocks_sig is not None
        args = self._read_blocks_sig.bind(worker, *a, **kw).arguments
        spec = args["read_spec"]
        self._local.read = (worker, args["request_id"], args["dst_engine_id"], args["remote_request_id"], getattr(spec, "remote_rank", 0))
        try:
            return original(worker, *a, **kw)
        finally:
            self._local.read = None

    # ---- a READ posted, and done --------------------------------------------

    def _local_regions(self, worker: Any) -> _Regions | str:
        """The worker's own KV memory, or why it is not mapped."""
        if getattr(worker, "use_host_buffer", False):
            return "READs into a host staging buffer (copied to the device afterwards)"
        if getattr(worker, "_has_mamba", False):
            return "pools with Mamba state regions"
        if getattr(worker, "_mixed_mem_types", False):
            return "KV memory split between host and device"
        groups = getattr(getattr(worker, "kv_cache_config", None), "kv_cache_groups", None) or []
        if len(groups) != 1:
            return "several KV cache groups"
        try:
            bases = worker.kv_caches_base_addr[worker.engine_id][worker.tp_rank]
            regions = _Regions.of(
                bases,
                worker.block_stride_per_layer,
                worker.region_num_blocks,
                worker.block_len_per_layer,
                worker._physical_blocks_per_logical_kv_block,
            )
        except (AttributeError, KeyError, TypeError):
            regions = None
        return regions if regions is not None else "workers whose KV memory was not registered"

    def _posted(self, worker: Any, seen: _Agent, handle: Any, local: tuple[Any, Any], remote: tuple[Any, Any], ctx: tuple[Any, ...]) -> None:
        rid, engine, remote_rid, remote_rank = ctx
        regions = self._local_regions(worker)
        if isinstance(regions, str):
            self._skip_transfer(regions)
            return
        dst = seen.dlists.get(local[0])
        src = seen.dlists.get(remote[0])
        if dst is None or src is None or dst[2] is not None or src[2] is None:
            self._skip_transfer("descriptor lists the adapter did not see prepared")
            return
        sched = self._engines.get(worker.engine_id)
        if sched is None:
            self._skip_transfer("workers whose scheduler is in another process")
            return
        manager = sched.kv_cache_manager.coordinator.single_type_managers[0]
        st = self._state(manager.block_pool)
        if st is None or not self._slot_exact(st, manager):
            self._skip_transfer("pools left unchecked")
            return
        ids = np.asarray(local[1], dtype=np.int64)
        if len(ids) and ((ids < 0).any() or (ids >= len(dst[0])).any()):
            self._skip_transfer("descriptor indices past their list")
            return
        starts, lens = dst[0][ids], dst[1][ids]
        where = regions.locate(starts)
        if where is None:
            self._skip_transfer("descriptors outside the registered KV memory")
            return
        self._landing_seen.add(rid)
        self.checked_transfers += 1
        owner = self._owner(st, rid)
        region, block, offset = where
        held = {b.block_id for b in manager.req_to_blocks.get(rid) or []}
        spans: dict[tuple[int, int], list[tuple[int, int]]] = {}
        refs: dict[int, PageRef] = {}
        for r, b, off, n in zip(region.tolist(), block.tolist(), offset.tolist(), lens.tolist()):
            spans.setdefault((b, r), []).append((off, off + n))
            if b in refs:
                continue
            ref = st.block(b).ref
            # A block the pool never handed out: kvsan's page of generation 0.
            refs[b] = PageRef(b, 0) if ref is None else PageRef(ref.page, ref.generation)
            if b not in held:
                # The READ lands in a block the request does not hold.
                v = st.pool.write(owner, refs[b], (0, 1))
                self._note(v, "a NIXL READ lands in a block", b, owner.request)
        sizes = (regions.lens * regions.ppl).tolist()
        seen.reads[handle] = _Read(rid, st, manager, owner, sizes, refs, spans)
        self._check_source(seen, engine, remote_rid, remote_rank, src, np.asarray(remote[1], dtype=np.int64))

    def _check_source(self, seen: _Agent, engine: str, remote_rid: str, rank: int, src: Any, ids: np.ndarray) -> None:
        """The blocks a READ takes from a producer in this process: each
        must be one its request handed out, still at that generation."""
        producer = self._engines.get(engine)
        regions = seen.remotes.get((engine, rank))
        if producer is None:
            self._skip_transfer("producers in another process (their blocks are checked there)")
            return
        if regions is None or (len(ids) and ((ids < 0).any() or (ids >= len(src[0])).any())):
            self._skip_transfer("remote descriptors the adapter cannot map")
            return
        where = regions.locate(src[0][ids])
        if where is None:
            self._skip_transfer("remote descriptors outside the producer's KV memory")
            return
        handed = self._handoffs.get((engine, remote_rid), {})
        manager = producer.kv_cache_manager.coordinator.single_type_managers[0]
        st = self._state(manager.block_pool)
        if st is None:
            return
        stranger: Owner | None = None
        for b in sorted(set(where[1].tolist())):
            if b in handed:
                pst, owner, ref, tokens = handed[b]
                v = pst.pool.read(owner, [ref], tokens)
            else:
                blk = st.blocks.get(b)
                if blk is not None and blk.unchecked:
                    continue
                if stranger is None:
                    stranger = self._anonymous()
                owner = stranger
                ref = blk.ref if blk is not None and blk.ref is not None else PageRef(b, 0)
                v = st.pool.read(owner, [ref], 1)
            self._note(v, f"a NIXL READ takes a block request {remote_rid} handed out", b, owner.request)

    def _landed(self, seen: _Agent, read: _Read) -> None:
        """NIXL says a READ is done: its bytes are in place. The slots the
        request's READs now cover in every region, within the load's
        tokens, count as written; the rest of a block keeps what it had."""
        spans, marked = seen.landed.setdefault(read.rid, ({}, {}))
        for key, ranges in read.spans.items():
            spans.setdefault(key, []).extend(ranges)
        load = self._loading.get(read.rid)
        if load is None:
            return  # the load is over or abandoned: what lands now is no one's
        table = {blk.block_id: i for i, blk in enumerate(read.manager.req_to_blocks.get(read.rid) or [])}
        size = read.manager.block_size
        for b, ref in read.refs.items():
            i = table.get(b)
            if i is None:
                continue  # reported when posted: not the request's block
            slots = np.ones(size, dtype=bool)
            for r, n in enumerate(read.sizes):
                slots &= _slots_covered(spans.get((b, r), []), n, size)
            tokens = np.zeros(size, dtype=bool)
            tokens[max(load[0] - i * size, 0) : max(load[1] - i * size, 0)] = True
            new = slots & tokens & ~marked.get(b, np.zeros(size, dtype=bool))
            marked[b] = marked.get(b, np.zeros(size, dtype=bool)) | new
            for lo, hi in _runs(new):
                v = read.st.pool.write(read.owner, ref, (lo, hi))
                self._note(v, "a NIXL READ lands the load's tokens", b, read.owner.request)

    def _load_over(self, rid: str) -> None:
        """The scheduler heard the load end: the READs' records go."""
        self._landing_seen.discard(rid)
        for agent in self._agents:
            agent.landed.pop(rid, None)

    # ---- the producer's hand-off ----------------------------------------------

    def _note_handoff(self, sched: Any, rid: str, blocks: dict[int, tuple[Any, Owner, PageRef, int]]) -> None:
        engine = _engine_id(getattr(sched, "vllm_config", None))
        if engine is None:
            return
        self._handoffs[(engine, rid)] = blocks
        self._handoffs.move_to_end((engine, rid))
        while len(self._handoffs) > _HANDOFFS_KEPT:
            self._handoffs.popitem(last=False)


def _runs(mask: np.ndarray) -> list[tuple[int, int]]:
    """The runs of set entries: (start, end) each."""
    edges = np.flatnonzero(np.diff(np.concatenate(([0], mask.astype(np.int8), [0]))))
    return list(zip(edges[::2].tolist(), edges[1::2].tolist()))


def _engine_id(config: Any) -> str | None:
    engine = getattr(getattr(config, "kv_transfer_config", None), "engine_id", None)
    return engine if isinstance(engine, str) else None
