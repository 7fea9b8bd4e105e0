"""kvsan for vLLM's v1 KV cache manager, attached without changing vLLM.

:func:`attach` wraps, in place, the methods of vLLM's ``BlockPool``,
``KVCacheManager``, ``KVCacheCoordinator`` and single-type managers through
which KV blocks change hands, and reports each change to kvsan as it
happens:

==========================================  ==================================
vLLM                                        kvsan
==========================================  ==================================
``BlockPool.get_new_blocks`` for a request  ``alloc`` (a new generation)
``BlockPool.touch`` (a prefix-cache hit)    ``share`` with the request
``BlockPool.free_blocks``                   ``free`` by the holder that lets go
a block hash inserted (``cache_full_blocks``)  ``share`` with the prefix cache:
                                            the block must be fully written
a block hash removed (eviction, reset)      the prefix cache lets go
``KVCacheManager.allocate_slots``           ``write`` of the tokens the step
                                            computes (and a synchronous
                                            connector load's), then ``read``
                                            of the block table the step
                                            attends over
``Scheduler.update_from_output``: the      ``write`` of an asynchronous load's
worker's ``finished_recving``               tokens, minus the blocks named in
                                            ``invalid_block_ids``
``Scheduler.schedule`` returns a step       its writes, in flight until the
                                            step is reported
blocks allocated for a connector load       an in-flight step's write into
                                            one of them under an earlier
                                            owner (``generation-mismatch``)
``Scheduler._connector_finished`` delays   the blocks and tokens handed to
the free (a remote reader)                  the reader (``remote_block_ids``,
                                            ``remote_num_tokens``) noted
the worker's ``finished_sending``           ``read`` of those blocks by the
                                            request
``KVCacheManager.free`` of a finished one   ``finished`` (``page-leak``)
the model runner's step                     the KV store's ``slot_mapping``
(``GPUModelRunner._build_attention_metadata``, checked as its rows' writes
in the scheduler's process)                 (padding: a holder of nothing),
                                            then the block table rows up to
                                            ``seq_lens`` as their reads
the same step, for a Mamba state group       the state slots its metadata
                                            names (``state_indices_tensor_d``
                                            and ``_p``) as its rows' writes;
                                            a padding row names none
a NIXL worker's READ (``make_prepped_xfer``  the blocks its descriptors' bytes
with the descriptors of ``_read_blocks``)   lie in: the destination must be
                                            the reading request's; the source
                                            (a producer in this process) what
                                            its request handed out, still
                                            held
NIXL reports the READ done                  ``write`` of the load's tokens in
(``check_xfer_state``)                      the slots the request's READs
                                            cover (the scheduler's
                                            ``finished_recving`` then marks
                                            nothing)
==========================================  ==================================

The NIXL side is :mod:`kvsan._vllm_nixl`'s (what it maps and what it
leaves unchecked is in its doc).

A request recomputing tokens into a block the prefix cache holds, under
that block's own hash (the same tokens' KV at the same positions, as vLLM
does for the last block of a prompt that arrived whole), is counted in
:attr:`Adapter.cached_rewrites`, not reported, unless
``strict_cached_rewrites``.

Each vLLM ``BlockPool`` is one kvsan pool: a block is a page of
``block_size`` token slots, one layer (the manager does not see layers).
A request is a kvsan owner; its tenant is its ``cache_salt`` (none: 0), so
kvsan's default isolation policy is vLLM's salt isolation.

What is checked, and what is not:

* full-attention, sliding-window and chunked-local groups
  (``FullAttentionManager``, ``SinkFullAttentionManager``,
  ``SlidingWindowManager``, ``ChunkedLocalAttentionManager``) whose block
  size is the hash block size: every written slot and every read; a
  windowed group is read from the step's first query's window on (the
  window and the chunk from the group's spec, not from the blocks vLLM
  let go of), and a position in that window whose block is the null
  block is a read of it;
* other groups on such a pool (cross attention, Mamba state groups, ring
  buffers) keep their blocks' allocation, sharing and freeing checked,
  but their blocks count as written whole when taken and their reads are
  not checked;
* vLLM's null block is held by a holder of its own: a step computing
  positions whose block (in any KV group of a checked pool) is the null
  block writes into a page it does not own (a state group's step writes
  its state block, not a block per position);
* a block taken outside any request's call and handed to a request by
  its caller is the first request's that lets go of it;
* pools beyond this model are left alone and counted in
  :attr:`Adapter.unchecked_pools`: HiSparse pools, pools whose blocks are
  larger than the hash block (vLLM then caches partial entries inside a
  block; kvsan shares whole pages only), and block pools of other kinds;
* a block that still enters the prefix cache as a partial entry
  (``cache_partial_block``) is left unchecked until the pool hands it out
  again (:attr:`Adapter.unchecked_blocks`);
* a reference vLLM takes on a block itself, not through the pool (a
  copy-on-write endpoint kept until the copy ran), is let go unseen.

Violations are returned by kvsan as verdicts; the adapter keeps them in
:attr:`Adapter.violations` (what, block, request) and never changes what
vLLM does, so a test sees vLLM's own behaviour.
"""

from __future__ import annotations

import hashlib
import inspect
import threading
import weakref
from dataclasses import dataclass, field
from typing import Any, Callable, Iterator

from ._abi import PREFIX_CACHE_REQUEST, Owner, PageRef
from ._hooks import Finding, Hooks, host_array, subclasses
from ._vllm_nixl import NixlReads
from .sanitizer import KvsanError, Pool, Sanitizer, attach as attach_sanitizer

__all__ = ["Adapter", "Finding", "attach"]

# Why a pool is left alone: HiSparse's host tier (a pool of its own kind)
# and device groups hold one request's KV in two tiers, moved by copies.
_HISPARSE = "HiSparse host tiers and their device groups"
# Why a worker row is not checked (Adapter.unchecked_steps).
_IN_FLIGHT = "rows of requests finished while their step was in flight"

# The kinds of manager whose blocks hold one token per slot and whose
# attention reads every token before the current one.
_WINDOWED_MANAGERS = ("SlidingWindowManager", "ChunkedLocalAttentionManager")
_TOKEN_MANAGERS = ("FullAttentionManager", "SinkFullAttentionManager", *_WINDOWED_MANAGERS)


@dataclass
class _Block:
    ref: PageRef | None = None
    owner: int = 0
    # Who holds the block in vLLM's count, and which of them kvsan knows
    # (a block left unchecked gains holders kvsan does not see).
    holders: list[int] = field(default_factory=list)
    known: list[int] = field(default_factory=list)
    pending_free: list[int] = field(default_factory=list)
    cache_held: bool = False
    unchecked: bool = False
    # Taken outside any request's call (a caller that hands blocks to a
    # request itself): the first request that lets go of it held it.
    unclaimed: bool = False


@dataclass
class _StepWrite:
    """A write a scheduled step dispatched to the worker."""

    st: "_PoolState"
    block: int
    ref: PageRef
    owner: Owner
    rid: str
    slots: tuple[int, int]


class _PoolState:
    """The kvsan pool behind one vLLM ``BlockPool``, and who holds what."""

    def __init__(self, pool: Pool, pages: int, page_slots: int) -> None:
        self.pool = pool
        self.pages = pages
        self.page_slots = page_slots
        self.blocks: dict[int, _Block] = {}
        # vLLM's null block (the one every skipped or padded position names),
        # held in kvsan by a holder of its own that never writes it: a write
        # by a request is a write into a page it does not own.
        self.null: tuple[Owner, PageRef] | None = None
        # vLLM's request ids are unique within one engine, not across the
        # engines (or tests) of a process: kvsan owners are per pool.
        self.requests: dict[str, int] = {}
        # The worker's batch rows of requests the scheduler no longer has,
        # and the holder of a step's padding tokens: holders of nothing.
        self.strangers: dict[str, Owner] = {}
        self.padding: Owner | None = None

    def block(self, block_id: int) -> _Block:
        b = self.blocks.get(block_id)
        if b is None:
            b = self.blocks[block_id] = _Block()
        return b


class Adapter(NixlReads, Hooks):
    """kvsan attached to vLLM's KV cache manager (see the module's doc)."""

    engine = "vllm"
    follows = "vLLM 0.33.0's KV cache manager"

    def __init__(self, san: Sanitizer, strict_cached_rewrites: bool = False) -> None:
        super().__init__(san)
        self.unchecked_blocks = 0
        #: Report a request recomputing its own tokens into a block the
        #: prefix cache holds (see the module's doc) as ``foreign-write``.
        self.strict_cached_rewrites = strict_cached_rewrites
        #: Blocks in the prefix cache that a request wrote again with the
        #: tokens the block's hash stands for (not reported unless strict).
        self.cached_rewrites = 0
        # Asynchronous connector loads allocated and not yet over, by
        # request id: the external token range, and the blocks the worker
        # reported failed so far.
        self._loading: dict[str, tuple[int, int, set[int]]] = {}
        # P/D producer side: what a finished request handed to a remote
        # reader (the connector delays the free of its blocks), read when
        # the worker reports the send over: pool, owner, block runs and
        # the tokens read from each.
        self._sending: dict[str, list[tuple[_PoolState, Owner, list[PageRef], int]]] = {}
        # Steps scheduled and not yet reported back, by KV cache manager,
        # oldest first: each with the writes it dispatched (pool, block,
        # tag, writer, slots). A block vLLM frees while such a write is in
        # flight and hands to a connector load gets two writers that
        # nothing orders.
        self._inflight: weakref.WeakKeyDictionary[Any, list[tuple[Any, list[_StepWrite]]]] = (
            weakref.WeakKeyDictionary()
        )
        self._local = threading.local()
        self._lock = threading.RLock()
        self._pools: weakref.WeakKeyDictionary[Any, _PoolState] = weakref.WeakKeyDictionary()
        self._names: dict[int, str] = {}
        self._next_request = 1
        self._tenants: dict[str, int] = {}
        self._block_sizes: weakref.WeakKeyDictionary[Any, set[int]] = weakref.WeakKeyDictionary()
        self._pool_cls: type | None = None
        self._unmodelled: weakref.WeakKeyDictionary[Any, str] = weakref.WeakKeyDictionary()
        #: vLLM pools checked, and those left unchecked by the reason.
        self.checked_pools = 0
        self.unchecked_pools: dict[str, int] = {}
        # The worker side: model runners whose steps are checked, each with
        # the scheduler that hands it its steps (weakly).
        self._runners: weakref.WeakKeyDictionary[Any, weakref.ref[Any]] = weakref.WeakKeyDictionary()
        # Schedulers seen scheduling, for runners found by their config.
        self._schedulers: weakref.WeakSet[Any] = weakref.WeakSet()
        self._build_metadata: inspect.Signature | None = None
        #: Worker steps whose attention buffers were checked, and steps
        #: left unchecked by the reason.
        self.checked_steps = 0
        self.unchecked_steps: dict[str, int] = {}
        self._nixl_init()

    # ---- attaching ----------------------------------------------------------

    def attach(self) -> "Adapter":
        """Wraps vLLM's methods (idempotent per adapter)."""
        if self._patches:
            return self
        from vllm.v1.core import block_pool as bp
        from vllm.v1.core import kv_cache_coordinator as kc
        from vllm.v1.core import kv_cache_manager as km
        from vllm.v1.core import single_type_kv_cache_manager as st

        pool_cls = self._pool_cls = bp.BlockPool
        self._wrap(pool_cls, "get_new_blocks", self._on_get_new_blocks)
        self._wrap(pool_cls, "touch", self._on_touch)
        self._wrap(pool_cls, "free_blocks", self._on_free_blocks)
        self._wrap(pool_cls, "unpin_blocks", self._on_free_blocks, optional=True)
        self._wrap(pool_cls, "_insert_block_hash", self._on_insert_hash)
        self._wrap(pool_cls, "_remove_cached_block_hashes", self._on_remove_hashes)
        self._wrap(pool_cls, "reset_prefix_cache", self._on_reset_prefix_cache)
        self._wrap(pool_cls, "cache_partial_block", self._on_partial, optional=True)
        self._wrap(km.KVCacheManager, "allocate_slots", self._on_allocate_slots)
        self._allocate_slots = inspect.signature(vars(km.KVCacheManager)["allocate_slots"].__wrapped__)
        self._wrap(km.KVCacheManager, "free", self._on_manager_free)
        from vllm.v1.core.sched import scheduler as sch

        self._wrap(sch.Scheduler, "schedule", self._on_schedule)
        self._wrap(sch.Scheduler, "update_from_output", self._on_worker_output)
        self._wrap(sch.Scheduler, "_connector_finished", self._on_connector_finished)
        self._attach_nixl()
        for cls in subclasses(kc.KVCacheCoordinator):
            if "allocate_new_blocks" in vars(cls):
                self._wrap(cls, "allocate_new_blocks", self._on_allocate_new_blocks)
        for cls in subclasses(st.SingleTypeKVCacheManager):
            if "__init__" in vars(cls):
                self._wrap(cls, "__init__", self._on_manager_init)
            for name, fn in list(vars(cls).items()):
                if name.startswith("__") or not inspect.isfunction(fn):
                    continue
                params = list(inspect.signature(fn).parameters)
                if len(params) > 1 and params[1] in ("request_id", "request"):
                    self._wrap(cls, name, self._in_request)
                if name == "pop_blocks_for_free":
                    self._wrap(cls, name, self._on_pop_for_free)
        try:
            from vllm.v1.worker import gpu_model_runner as gmr
        except Exception as e:  # a vLLM build or platform without it
            self.unchecked_steps[f"the model runner did not import ({type(e).__name__}: {e})"] = 0
            return self
        self._wrap(gmr.GPUModelRunner, "_build_attention_metadata", self._on_attention_metadata)
        self._build_metadata = inspect.signature(vars(gmr.GPUModelRunner)["_build_attention_metadata"].__wrapped__)
        self._wrap(gmr.GPUModelRunner, "_dummy_run", self._on_dummy_run, optional=True)
        return self

    def watch_runner(self, runner: Any, scheduler: Any) -> None:
        """Checks the steps ``runner`` (vLLM's ``GPUModelRunner``, or a
        subclass such as ``CPUModelRunner``) prepares for attention against
        the blocks ``scheduler`` handed out: the model runner is the
        worker, in this process, of that scheduler's engine. Needed only
        where the adapter cannot find the scheduler by itself (it links a
        runner to the one scheduler it has seen built from the runner's
        config object, as vLLM's engine builds both in one process). Each step's
        buffers are checked as the attention and KV store kernels take
        them (see :meth:`check_runner_step`).

        Raises :class:`TypeError` for a runner whose steps the adapter
        cannot see, such as vLLM's V2 model runner
        (``vllm.v1.worker.gpu.model_runner``; ``VLLM_USE_V2_MODEL_RUNNER=0``
        selects the V1 runner)."""
        from vllm.v1.worker.gpu_model_runner import GPUModelRunner

        if not isinstance(runner, GPUModelRunner):
            kind = f"{type(runner).__module__}.{type(runner).__qualname__}"
            raise TypeError(
                f"kvsan.vllm checks the steps of vLLM's V1 model runner (GPUModelRunner and its "
                f"subclasses, such as CPUModelRunner), not of {kind}; with vLLM's V2 model runner, "
                "set VLLM_USE_V2_MODEL_RUNNER=0"
            )
        self._runners[runner] = weakref.ref(scheduler)

    # ---- context: which request a pool call is for ---------------------------

    def _stack(self) -> list[tuple[str, Any]]:
        s = getattr(self._local, "stack", None)
        if s is None:
            s = self._local.stack = []
        return s

    def _steps(self) -> list[tuple[Any, int, int, int]]:
        """The ``allocate_slots`` calls under way: the request, its first
        token the step writes (after its local hits and any connector
        tokens loaded with the step), tokens computed before the step,
        tokens after it."""
        s = getattr(self._local, "steps", None)
        if s is None:
            s = self._local.steps = []
        return s

    @property
    def _current(self) -> tuple[str, Any] | None:
        s = self._stack()
        return s[-1] if s else None

    def _in_request(self, original: Callable[..., Any], manager: Any, *a: Any, **kw: Any) -> Any:
        who = a[0] if a else kw.get("request_id", kw.get("request"))
        rid = who if isinstance(who, str) else getattr(who, "request_id", None)
        if rid is None:
            return original(manager, *a, **kw)
        self._stack().append((rid, manager))
        try:
            return original(manager, *a, **kw)
        finally:
            self._stack().pop()

    def _owner(self, st: _PoolState, rid: str) -> Owner:
        n = st.requests.get(rid)
        if n is None:
            n = st.requests[rid] = self._next_request
            self._names[n] = rid
            self._next_request += 1
            owner = Owner(n, self._tenants.get(rid, 0))
            # The scheduler took it in: it may hold blocks now.
            for event in ("queued", "admitted"):
                self._note(self.san.request_event(owner, event, st.pool), f"the request is {event}", None, n)
            return owner
        return Owner(n, self._tenants.get(rid, 0))

    def _anonymous(self) -> Owner:
        """The holder of a block taken outside any request's call."""
        n = self._next_request
        self._next_request += 1
        return Owner(n, 0)

    def _request_name(self, n: int) -> str | None:
        return self._names.get(n)

    # ---- pools ---------------------------------------------------------------

    def _on_manager_init(self, original: Callable[..., Any], manager: Any, *a: Any, **kw: Any) -> Any:
        out = original(manager, *a, **kw)
        pool = getattr(manager, "block_pool", None)
        if pool is not None:
            self._block_sizes.setdefault(pool, set()).add(manager.block_size)
            reason = _unmodelled(manager, pool)
            if reason is not None:
                self._leave(pool, reason)
        return out

    def _leave(self, pool: Any, reason: str) -> None:
        if pool not in self._unmodelled:
            self._unmodelled[pool] = reason
            self.unchecked_pools[reason] = self.unchecked_pools.get(reason, 0) + 1

    def _state(self, block_pool: Any) -> _PoolState | None:
        """The pool's state; ``None`` for a pool the adapter leaves alone."""
        st = self._pools.get(block_pool)
        if st is not None:
            return st
        if block_pool in self._unmodelled:
            return None
        if type(block_pool) is not self._pool_cls:
            kind = type(block_pool)
            hisparse = "hisparse" in kind.__module__
            self._leave(block_pool, _HISPARSE if hisparse else f"pools of another kind ({kind.__name__})")
            return None
        sizes = self._block_sizes.get(block_pool) or {block_pool.hash_block_size}
        page_slots = max(sizes)
        try:
            pool, pages = self._kvsan_pool(block_pool.num_gpu_blocks, page_slots)
        except KvsanError:
            # Blocks larger than kvsan's pages (context-parallel groups
            # multiply the block size): each block is one slot, taken whole;
            # allocation, sharing and freeing are still checked.
            page_slots = 1
            pool, pages = self._kvsan_pool(block_pool.num_gpu_blocks, page_slots)
        self.checked_pools += 1
        st = _PoolState(pool, pages, page_slots)
        null = getattr(block_pool, "null_block", None)
        if null is not None:
            holder = self._anonymous()
            self._names[holder.request] = "vLLM's null block"
            ref = pool.alloc(holder, null.block_id)
            if ref.verdict.ok:
                st.null = (holder, PageRef(ref.page, ref.generation))
        self._pools[block_pool] = st
        self._watch(block_pool, st)
        return st

    def _retire(self, st: _PoolState) -> None:
        """A vLLM pool is gone: every holder lets go, and its kvsan pool
        serves the next vLLM pool of its page size."""
        for b in st.blocks.values():
            if b.ref is None:
                continue
            for n in b.known:
                st.pool.free(Owner(n, 0), b.ref)
            if b.cache_held:
                st.pool.free(Owner(PREFIX_CACHE_REQUEST, 0), b.ref)
        if st.null is not None:
            st.pool.free(*st.null)
            self._names.pop(st.null[0].request, None)
        for rid, reads in list(self._sending.items()):
            reads[:] = [r for r in reads if r[0] is not st]
            if not reads:
                del self._sending[rid]
        self._spare_pool(st.page_slots, st.pages, st.pool)

    def _state_of(self, default_pool: Any, block: Any) -> _PoolState | None:
        return self._state(getattr(block, "pool", None) or default_pool)

    def _slot_exact(self, st: _PoolState, manager: Any) -> bool:
        return (
            manager is not None
            and type(manager).__name__ in _TOKEN_MANAGERS
            and manager.block_size == st.page_slots
        )

    # ---- BlockPool -----------------------------------------------------------

    def _on_get_new_blocks(self, original: Callable[..., Any], pool: Any, num: int) -> Any:
        blocks = original(pool, num)
        with self._lock:
            cur = self._current
            for blk in blocks:
                st = self._state_of(pool, blk)
                if st is None:
                    continue
                owner = self._owner(st, cur[0]) if cur else self._anonymous()
                b = st.block(blk.block_id)
                ref = st.pool.alloc(owner, blk.block_id)
                self._note(ref.verdict, "taking a block", blk.block_id, owner.request)
                if not ref.verdict.ok and b.ref is not None:
                    continue
                b.ref = PageRef(ref.page, ref.generation)
                b.owner = owner.request
                b.holders = [owner.request]
                b.known = [owner.request]
                b.pending_free = []
                b.cache_held = False
                b.unchecked = False
                b.unclaimed = cur is None
                if not self._slot_exact(st, cur[1] if cur else None):
                    v = st.pool.write(owner, b.ref, (0, st.page_slots))
                    self._note(v, "a block taken whole", blk.block_id, owner.request)
        return blocks

    def _on_touch(self, original: Callable[..., Any], pool: Any, blocks: Any) -> Any:
        blocks = list(blocks)
        with self._lock:
            cur = self._current
            anonymous = self._anonymous()
            for blk in blocks:
                if blk.is_null:
                    continue
                st = self._state_of(pool, blk)
                if st is None:
                    continue
                owner = self._owner(st, cur[0]) if cur else anonymous
                b = st.block(blk.block_id)
                b.holders.append(owner.request)
                if b.unchecked or b.ref is None:
                    continue
                b.known.append(owner.request)
                v = st.pool.share(b.ref, owner)
                self._note(v, "a prefix-cache hit shares a block", blk.block_id, owner.request)
        return original(pool, blocks)

    def _on_free_blocks(self, original: Callable[..., Any], pool: Any, blocks: Any, *a: Any, **kw: Any) -> Any:
        blocks = list(blocks)
        with self._lock:
            cur = self._current
            for blk in blocks:
                if blk.is_null or (getattr(blk, "pool", None) not in (None, pool)):
                    continue  # another pool's blocks: its own call reports them
                st = self._state_of(pool, blk)
                if st is None:
                    continue
                b = st.block(blk.block_id)
                if b.ref is None:
                    continue
                n = self._holder_letting_go(st, b, cur, blk.ref_cnt)
                if cur is not None and b.unclaimed and len(b.holders) == 1 and b.known == b.holders and n not in b.holders:
                    # The request was handed the block by whoever took it.
                    self._claim(st, b, n)
                if n not in b.holders and blk.ref_cnt > len(b.holders):
                    # vLLM took this reference itself, not through the pool
                    # (a copy-on-write endpoint kept until the copy ran):
                    # it goes as it came, unseen.
                    continue
                if n in b.holders:
                    b.holders.remove(n)
                    if n not in b.known:
                        continue  # a holder of an unchecked block kvsan never saw
                    b.known.remove(n)
                # else no such holder: kvsan names the double or foreign free
                v = st.pool.free(Owner(n, 0), b.ref)
                self._note(v, "freeing a block", blk.block_id, n)
        return original(pool, blocks, *a, **kw)

    def _claim(self, st: _PoolState, b: _Block, n: int) -> None:
        """Request ``n`` takes over a block from its only holder, who took
        it outside any request's call."""
        assert b.ref is not None
        taker = b.known[0]
        self._note(st.pool.share(b.ref, Owner(n, 0)), "a request given a block taken for it", None, n)
        self._note(st.pool.free(Owner(taker, 0), b.ref), "the block's taker lets it go", None, taker)
        b.holders = [n]
        b.known = [n]
        b.owner = n
        b.unclaimed = False

    def _holder_letting_go(self, st: _PoolState, b: _Block, cur: tuple[str, Any] | None, refs: int) -> int:
        """Who drops a reference: the request whose call this is; else one
        whose blocks were popped for a deferred free; else, if vLLM counts
        more references than the pool handed out, one of those (-1); else
        the last holder."""
        if cur is not None:
            return self._owner(st, cur[0]).request
        if b.pending_free:
            return b.pending_free.pop()
        if refs > len(b.holders):
            return -1
        if b.holders:
            return b.holders[-1]
        # No one holds it: a free of a free block. Its last owner frees it
        # again, which kvsan names.
        return b.owner

    def _on_insert_hash(self, original: Callable[..., Any], pool: Any, key: Any, blk: Any, *a: Any, **kw: Any) -> Any:
        out = original(pool, key, blk, *a, **kw)
        with self._lock:
            st = self._state_of(pool, blk)
            if st is None:
                return out
            b = st.block(blk.block_id)
            if getattr(self._local, "partial", False):
                if not b.unchecked:
                    b.unchecked = True
                    self.unchecked_blocks += 1
                return out
            if b.cache_held or b.unchecked or b.ref is None or blk.block_hash is None:
                return out
            v = st.pool.share(b.ref, Owner(PREFIX_CACHE_REQUEST, 0))
            self._note(v, "registering a block in the prefix cache", blk.block_id, b.holders[0] if b.holders else None)
            b.cache_held = v.ok
        return out

    def _on_remove_hashes(self, original: Callable[..., Any], pool: Any, blk: Any) -> Any:
        removed = original(pool, blk)
        if removed:
            with self._lock:
                st = self._state_of(pool, blk)
                b = None if st is None else st.block(blk.block_id)
                if st is not None and b is not None and b.cache_held and b.ref is not None:
                    b.cache_held = False
                    v = st.pool.free(Owner(PREFIX_CACHE_REQUEST, 0), b.ref)
                    self._note(v, "evicting a block from the prefix cache", blk.block_id, None)
        return removed

    def _on_reset_prefix_cache(self, original: Callable[..., Any], pool: Any, *a: Any, **kw: Any) -> Any:
        # A reset drops every hash at once, past _remove_cached_block_hashes:
        # the prefix cache lets go of each block it held.
        done = original(pool, *a, **kw)
        if done:
            with self._lock:
                st = self._pools.get(pool)
                for block_id, b in [] if st is None else st.blocks.items():
                    if b.cache_held and b.ref is not None:
                        b.cache_held = False
                        v = st.pool.free(Owner(PREFIX_CACHE_REQUEST, 0), b.ref)
                        self._note(v, "resetting the prefix cache", block_id, None)
        return done

    def _on_partial(self, original: Callable[..., Any], pool: Any, *a: Any, **kw: Any) -> Any:
        self._local.partial = True
        try:
            return original(pool, *a, **kw)
        finally:
            self._local.partial = False

    # ---- managers ------------------------------------------------------------

    def _on_pop_for_free(self, original: Callable[..., Any], manager: Any, request_id: str) -> Any:
        blocks = self._in_request(original, manager, request_id)
        with self._lock:
            for blk in blocks:
                if blk.is_null:
                    continue
                st = self._state_of(manager.block_pool, blk)
                if st is not None:
                    st.block(blk.block_id).pending_free.append(self._owner(st, request_id).request)
        return blocks

    def _on_allocate_slots(self, original: Callable[..., Any], kvm: Any, request: Any, num_new_tokens: int, *a: Any, **kw: Any) -> Any:
        salt = getattr(request, "cache_salt", None)
        self._tenants[request.request_id] = _tenant(salt) if salt else 0
        bound = self._allocate_slots.bind(kvm, request, num_new_tokens, *a, **kw)
        bound.apply_defaults()
        args = bound.arguments
        local = request.num_computed_tokens + args["num_new_computed_tokens"]
        total = min(local + args["num_external_computed_tokens"], kvm.max_model_len)
        first = local
        if args["delay_cache_blocks"] and total > local:
            # An asynchronous load: its tokens are written when it lands
            # (``_update_waiting_for_remote_kv``), not now.
            first = total
        step = (request, first, total, total + num_new_tokens)
        steps = self._steps()
        steps.append(step)
        try:
            out = original(kvm, request, num_new_tokens, *a, **kw)
        finally:
            steps.pop()
        if out is not None and total > local:
            with self._lock:
                self._unordered_load(kvm, request, local, total)
        if out is not None and first > local:
            self._loading[request.request_id] = (local, total, set())
        if out is not None and num_new_tokens > 0:
            with self._lock:
                self._read(kvm, request.request_id, total, total + num_new_tokens)
        return out

    def _on_allocate_new_blocks(self, original: Callable[..., Any], coord: Any, request_id: str, *a: Any, **kw: Any) -> Any:
        out = original(coord, request_id, *a, **kw)
        steps = self._steps()
        step = steps[-1] if steps else None
        if step is not None and step[0].request_id == request_id:
            request, first, total, end = step
            with self._lock:
                # A synchronous connector load lands within the step, before
                # its attention; then the step computes its own tokens.
                managers = coord.single_type_managers
                self._write(managers, request, first, total, loaded=True)
                self._write(managers, request, max(first, total), end)
        return out

    def _on_schedule(self, original: Callable[..., Any], sched: Any, *a: Any, **kw: Any) -> Any:
        """A step: the writes it dispatches stay in flight until its output
        is reported (``update_from_output``). The engine's loop keeps at
        most ``max_concurrent_batches`` steps in flight (two under async
        scheduling), so scheduling a new one means the older ones are
        done, reported or not (a test may skip a report)."""
        kvm = sched.kv_cache_manager
        self._note_engine(sched)
        self._schedulers.add(sched)
        async_sched = any(c.__name__ == "AsyncScheduler" for c in type(sched).__mro__)
        depth = max(int(getattr(sched.vllm_config, "max_concurrent_batches", 1) or 1), 2 if async_sched else 1)
        with self._lock:
            inflight = self._inflight.setdefault(kvm, [])
            del inflight[: max(0, len(inflight) - (depth - 1))]
        writes: list[_StepWrite] = []
        self._local.step_writes = writes
        try:
            out = original(sched, *a, **kw)
        finally:
            self._local.step_writes = None
        scheduled = getattr(out, "num_scheduled_tokens", None) or {}
        # A request preempted within the schedule dispatched nothing.
        writes = [w for w in writes if w.rid in scheduled]
        with self._lock:
            inflight.append((out, writes))
        return out

    def _unordered_load(self, kvm: Any, request: Any, start: int, end: int) -> None:
        """A connector load into tokens ``start..end`` of ``request``'s
        blocks: a block among them that a step still in flight writes under
        an earlier owner gets that write and the load's in no set order
        (the load is the NIC's, the write the GPU stream's; vLLM defers a
        finished request's free on a consumer for this, PR #45357). The
        step's write is reported as it is: through the tag of a page freed
        and handed out since. A block the next owner computes into itself
        is not reported: the stream orders those writes after the stale
        one."""
        inflight = self._inflight.get(kvm)
        if not inflight or end <= start:
            return
        for m in kvm.coordinator.single_type_managers:
            st = self._state(m.block_pool)
            if st is None or not self._slot_exact(st, m):
                continue
            blocks = m.req_to_blocks.get(request.request_id) or []
            size = m.block_size
            targets = {blocks[i].block_id for i in range(start // size, min(len(blocks), -(-end // size)))}
            for _, writes in inflight:
                for w in writes:
                    if w.st is not st or w.block not in targets:
                        continue
                    b = st.block(w.block)
                    if b.ref is None or b.ref.generation == w.ref.generation:
                        continue
                    v = st.pool.write(w.owner, w.ref, w.slots)
                    self._note(
                        v,
                        f"a step still in flight writes a block freed and handed to request {request.request_id}'s connector load",
                        w.block,
                        w.owner.request,
                        w.rid,
                    )

    def _on_worker_output(self, original: Callable[..., Any], sched: Any, scheduler_output: Any, runner: Any, *a: Any, **kw: Any) -> Any:
        """The worker's report of a step, read before vLLM acts on it: an
        asynchronous load it says is over (``finished_recving``) wrote its
        tokens, except in the blocks it says failed (``invalid_block_ids``,
        in this report or an earlier one); a load it says failed as a whole
        (``failed_recving``) wrote nothing. What vLLM then counts as
        computed or registers in the prefix cache is checked against that.
        """
        with self._lock:
            inflight = self._inflight.get(sched.kv_cache_manager) or []
            # Steps are reported in the order they were scheduled.
            done = next((i for i, (o, _) in enumerate(inflight) if o is scheduler_output), None)
            if done is not None:
                del inflight[: done + 1]
        report = getattr(runner, "kv_connector_output", None)
        if report is not None and (self._loading or self._sending):
            with self._lock:
                self._read_load_report(sched, report)
                for rid in getattr(report, "finished_sending", None) or ():
                    for st, owner, refs, n in self._sending.pop(rid, []):
                        v = st.pool.read(owner, refs, n)
                        self._note(v, "the remote reader reads the finished request's blocks", None, owner.request)
        return original(sched, scheduler_output, runner, *a, **kw)

    def _on_connector_finished(self, original: Callable[..., Any], sched: Any, request: Any) -> Any:
        """A finished request's blocks go to a remote reader when the
        connector delays their free. What the remote reads is what the
        connector hands it (``kv_transfer_params``: ``remote_block_ids``
        per KV cache group, ``remote_num_tokens``), else the request's
        blocks and computed tokens. The read is checked when the worker
        reports the send over (``finished_sending``), as the request's, at
        the blocks' generations of the hand-off: a block handed out that
        the request does not hold, tokens it never wrote, or blocks vLLM
        let go of and handed out before the send is over are reported."""
        out = original(sched, request)
        delay = bool(out[0]) if isinstance(out, tuple) and out else False
        if not delay or request.request_id in self._sending:
            return out
        params = out[1] if len(out) > 1 and isinstance(out[1], dict) else {}
        handed = _block_id_groups(params.get("remote_block_ids"))
        tokens = params.get("remote_num_tokens")
        if not isinstance(tokens, int) or isinstance(tokens, bool):
            tokens = request.num_computed_tokens
        self._note_engine(sched)
        with self._lock:
            reads: list[tuple[_PoolState, Owner, list[PageRef], int]] = []
            handoff: dict[int, tuple[_PoolState, Owner, PageRef, int]] = {}
            for i, m in enumerate(sched.kv_cache_manager.coordinator.single_type_managers):
                st = self._state(m.block_pool)
                if st is None or not self._slot_exact(st, m):
                    continue
                owner = self._owner(st, request.request_id)
                if handed is not None and i < len(handed):
                    every = m.block_pool.blocks
                    blocks = [every[b] if 0 <= b < len(every) else None for b in handed[i]]
                else:
                    blocks = m.req_to_blocks.get(request.request_id) or []
                blocks = blocks[: -(-tokens // m.block_size)]
                # Tokens past the blocks handed out have no block to be read
                # from (the reader's own count of blocks refuses them).
                n_read = min(tokens, len(blocks) * m.block_size)
                for _, refs, n in _segments(st, blocks, n_read, m.block_size):
                    reads.append((st, owner, refs, n))
                if i == 0:
                    for j, blk in enumerate(blocks):
                        b = None if blk is None or blk.is_null else st.blocks.get(blk.block_id)
                        n = min(m.block_size, n_read - j * m.block_size)
                        if b is not None and b.ref is not None and not b.unchecked and n > 0:
                            handoff[blk.block_id] = (st, owner, PageRef(b.ref.page, b.ref.generation), n)
            self._sending[request.request_id] = reads
            self._note_handoff(sched, request.request_id, handoff)
        return out

    def _read_load_report(self, sched: Any, report: Any) -> None:
        invalid = set(getattr(report, "invalid_block_ids", None) or ())
        failed = set(getattr(report, "failed_recving", None) or ())
        managers = sched.kv_cache_manager.coordinator.single_type_managers
        for rid in list(self._loading):
            request = sched.requests.get(rid)
            if request is None:
                continue
            start, end, bad = self._loading[rid]
            bad.update(b for b in self._blocks_of(managers, rid) if b in invalid)
            if rid not in (getattr(report, "finished_recving", None) or ()):
                continue
            del self._loading[rid]
            landed = rid in self._landing_seen
            self._load_over(rid)
            if rid in failed or landed:
                # Failed: nothing landed. Landed through READs the adapter
                # checked: they marked what they wrote.
                continue
            for lo, hi in _ranges_without(managers, rid, start, end, bad):
                self._write(managers, request, lo, hi, loaded=True)

    @staticmethod
    def _blocks_of(managers: Any, rid: str) -> list[int]:
        return [b.block_id for m in managers for b in (m.req_to_blocks.get(rid) or [])]

    def _write(self, managers: Any, request: Any, start: int, end: int, loaded: bool = False) -> None:
        """Positions ``start..end`` of ``request`` written in each group's
        blocks: computed by a step, or ``loaded`` by a connector (which
        fills the blocks the table names and skips a window's null blocks,
        as vLLM loads nothing outside a window)."""
        rid = request.request_id
        hashes = getattr(request, "block_hashes", None) or []
        for m in managers:
            st = self._state(m.block_pool)
            if st is None or _state_group(m):
                # A state group's step writes the request's running state
                # in its state block, not a block per position.
                continue
            exact = self._slot_exact(st, m)
            owner = self._owner(st, rid)
            blocks = m.req_to_blocks.get(rid) or []
            size = m.block_size
            for i in range(start // size, min(len(blocks), -(-end // size))):
                blk = blocks[i]
                if blk.is_null and loaded:
                    continue
                if blk.is_null:
                    # The step computes positions whose block is the null
                    # block (a window's skipped prefix, a table's padding):
                    # their KV would land in the page every such position
                    # names, in any kind of group.
                    # (A pool whose blocks outgrew kvsan's pages keeps each
                    # block as one slot: then the write is that slot.)
                    if st.null is not None:
                        lo, hi = max(start, i * size) - i * size, min(end, (i + 1) * size) - i * size
                        v = st.pool.write(owner, st.null[1], (0, 1) if st.page_slots < size else (lo, hi))
                        self._note(v, "the step computes tokens into vLLM's null block", blk.block_id, owner.request)
                    continue
                if not exact:
                    continue
                b = st.block(blk.block_id)
                if b.unchecked or b.ref is None:
                    continue
                lo, hi = max(start, i * size) - i * size, min(end, (i + 1) * size) - i * size
                if lo >= hi:
                    continue
                if (
                    b.cache_held
                    and not self.strict_cached_rewrites
                    and blk.block_hash is not None
                    and i < len(hashes)
                    and _hash_of(blk.block_hash) == hashes[i]
                ):
                    # The request writes the tokens the cached block's hash
                    # stands for, at their positions (the hash chains every
                    # token before them): the same KV, not another's.
                    self.cached_rewrites += 1
                    continue
                v = st.pool.write(owner, b.ref, (lo, hi))
                self._note(v, "the step computes tokens into a block", blk.block_id, owner.request)
                writes = getattr(self._local, "step_writes", None)
                if writes is not None and v.ok:
                    writes.append(_StepWrite(st, blk.block_id, PageRef(b.ref.page, b.ref.generation), owner, rid, (lo, hi)))

    def _read(self, kvm: Any, rid: str, first_query: int, tokens: int) -> None:
        """The step's attention, for queries at ``first_query..tokens``,
        reads its block table: from token 0 in a full-attention group; in
        a sliding-window or chunked-local group from the first query's
        window (from the group's spec, not from the blocks vLLM let go of):
        a position there whose block is the null block is a read of it."""
        for m in kvm.coordinator.single_type_managers:
            st = self._state(m.block_pool)
            if st is None or not self._slot_exact(st, m):
                continue
            owner = self._owner(st, rid)
            size = m.block_size
            start = _window_start(m, first_query) // size
            blocks = (m.req_to_blocks.get(rid) or [])[: -(-tokens // size)]
            if st.null is not None and any(blk.is_null for blk in blocks[start:]):
                n = min(tokens - start * size, size)
                v = st.pool.read(owner, [st.null[1]], n)
                self._note(v, "the step's attention reads vLLM's null block in its window", m.block_pool.null_block.block_id, owner.request)
            for first, refs, n in _segments(st, blocks[start:], tokens - start * size, size):
                v = st.pool.read(owner, refs, n)
                self._note(v, "the step's attention reads its block table", first, owner.request)

    def _on_manager_free(self, original: Callable[..., Any], kvm: Any, request: Any) -> Any:
        out = original(kvm, request)
        with self._lock:
            # A load still under way when the blocks go never lands in them.
            self._loading.pop(request.request_id, None)
            self._load_over(request.request_id)
            tenant = self._tenants.pop(request.request_id, 0)
            pools = {id(m.block_pool): m.block_pool for m in kvm.coordinator.single_type_managers}
            for block_pool in pools.values():
                st = self._pools.get(block_pool)
                n = None if st is None else st.requests.pop(request.request_id, None)
                if st is not None and n is not None and request.is_finished():
                    v = self.san.request_event(Owner(n, tenant), "finished", st.pool)
                    self._note(v, "the request finished", None, n)
                if n is not None:
                    self._names.pop(n, None)
        return out


    # ---- the worker: what attention and the KV store kernels take -------------

    def _on_dummy_run(self, original: Callable[..., Any], runner: Any, *a: Any, **kw: Any) -> Any:
        self._local.dummy = getattr(self._local, "dummy", 0) + 1
        try:
            return original(runner, *a, **kw)
        finally:
            self._local.dummy -= 1

    def _on_attention_metadata(self, original: Callable[..., Any], runner: Any, *a: Any, **kw: Any) -> Any:
        out = original(runner, *a, **kw)
        assert self._build_metadata is not None
        args = self._build_metadata.bind(runner, *a, **kw).arguments
        if args.get("for_cudagraph_capture"):
            return out  # a capture's dummy batch, no request's
        if getattr(self._local, "dummy", 0):
            # Rows of no request (profiling, warm-up, an idle data-parallel
            # rank): what a dummy batch writes is not checked.
            self._skip_step("dummy runs (profiling, warm-up, idle data-parallel ranks)")
            return out
        ref = self._runners.get(runner)
        scheduler = ref() if ref is not None else self._scheduler_of(runner)
        if scheduler is None:
            self._skip_step("model runners not linked to a scheduler (Adapter.watch_runner)")
            return out
        if args.get("ubatch_slices") is not None:
            self._skip_step("micro-batched steps (ubatch_slices)")
            return out
        self.check_runner_step(
            runner,
            scheduler,
            args["num_reqs"],
            args.get("num_reqs_padded") or args["num_reqs"],
            args.get("slot_mappings") or {},
            out[0] if isinstance(out, tuple) and out and isinstance(out[0], dict) else None,
        )
        return out

    def _scheduler_of(self, runner: Any) -> Any:
        """The scheduler of the runner's engine, found without
        :meth:`watch_runner`: in one process (vLLM's uni-process executor
        with ``VLLM_ENABLE_V1_MULTIPROCESSING=0``) the engine builds its
        scheduler and its runner from one config object. Linked only when
        exactly one scheduler seen shares the runner's config."""
        config = getattr(runner, "vllm_config", None)
        found = [s for s in list(self._schedulers) if config is not None and s.vllm_config is config]
        if len(found) != 1:
            return None
        self._runners[runner] = weakref.ref(found[0])
        return found[0]

    def check_runner_step(
        self,
        runner: Any,
        scheduler: Any,
        num_reqs: int,
        num_reqs_padded: int,
        slot_mappings: dict[int, Any],
        attn_metadata: dict[str, Any] | None = None,
    ) -> None:
        """Checks one step of ``runner`` as its kernels take it, for each KV
        cache group on a checked pool: the group's ``slot_mapping`` (the KV
        store kernel's, −1 for padding) as each row's request's writes —
        tokens past the last row are padding, stored by no request, so a
        slot there other than −1 writes a page its holder did not give —
        and each row of the block table up to its ``seq_lens`` as its
        request's read (in a sliding-window or local-chunk group, from the
        row's first query's window on). Row ``r`` is the request
        ``input_batch.req_ids[r]``. :meth:`attach` calls this from
        ``GPUModelRunner._build_attention_metadata``, once the buffers the
        metadata builders got are final. For a Mamba state group, the state
        slots its kernels take (``attn_metadata``, the builders' output by
        layer: see :meth:`_check_state_group`)."""
        import numpy as np

        from vllm.v1.worker.block_table import SlotMappingMode

        with self._lock:
            kvm = scheduler.kv_cache_manager
            managers = kvm.coordinator.single_type_managers
            req_ids = list(runner.input_batch.req_ids[:num_reqs])
            if len(req_ids) < num_reqs:
                self._skip_step("steps with more rows than the input batch has requests")
                return
            starts = host_array(runner.query_start_loc.cpu[: num_reqs + 1]).astype(np.int32)
            positions = host_array(runner.positions[: int(starts[-1])]).astype(np.int64)
            # A request that finished (and was freed) while a step that
            # computes it was in flight: the step's write lands in its freed
            # blocks, and their next owner computes into them after it on
            # the same stream (vLLM frees at once without a KV connector;
            # the scheduler side reports the case a connector load makes
            # unordered). Its row is not checked.
            gone = {
                w.rid for _, writes in self._inflight.get(kvm) or [] for w in writes if w.rid not in scheduler.requests
            }
            skipped = [r for r, rid in enumerate(req_ids) if rid in gone]
            if skipped:
                self.unchecked_steps[_IN_FLIGHT] = self.unchecked_steps.get(_IN_FLIGHT, 0) + len(skipped)
            checked = False
            for gid, m in enumerate(managers):
                st = self._state(m.block_pool)
                if st is None:
                    continue
                table = runner.input_batch.block_table[gid]
                if _state_group(m):
                    checked |= self._check_state_group(st, gid, runner, req_ids, skipped, attn_metadata or {})
                    continue
                if table.slot_mapping_mode != SlotMappingMode.TOKEN_TO_KV_SLOT:
                    continue
                if table.block_size != m.block_size or m.block_size != st.page_slots:
                    self._skip_step("groups whose worker block size is not the pool's")
                    continue
                try:
                    self._check_group(
                        st, m, gid, runner, scheduler, req_ids, num_reqs_padded, starts, positions, skipped,
                        slot_mappings.get(gid),
                    )
                except KvsanError as e:
                    # A buffer the kernels could not use as it is (an entry
                    # past the pool, offsets going backwards): kvsan names it.
                    self.violations.append(Finding("bad-batch", "-", f"group {gid}: {e.message}", None, None))
                checked = True
            if checked:
                self.checked_steps += 1

    def _check_group(
        self,
        st: _PoolState,
        m: Any,
        gid: int,
        runner: Any,
        scheduler: Any,
        req_ids: list[str],
        num_reqs_padded: int,
        starts: Any,
        positions: Any,
        skipped: list[int],
        mapping: Any,
    ) -> None:
        """:meth:`check_runner_step` for KV cache group ``gid`` (manager
        ``m``): its slot mapping, then its block table."""
        import numpy as np

        num_reqs = len(req_ids)
        owners = [self._row_owner(st, rid) for rid in req_ids]
        pad = self._padding(st)
        if mapping is not None:
            slots = host_array(mapping).astype(np.int64).copy()
            for r in skipped:
                slots[starts[r] : starts[r + 1]] = -1
            self._spare_cached_rewrites(st, m, scheduler, req_ids, starts, positions, slots)
            rows, offsets = owners, starts
            if len(slots) > starts[-1]:
                rows, offsets = owners + [pad], np.append(starts, len(slots)).astype(np.int32)
            verdicts = st.pool.check_slot_mapping(rows, offsets, slots)
            for r, v in enumerate(verdicts):
                who = req_ids[r] if r < num_reqs else "the step's padding tokens"
                self._note(v, f"the KV store writes slot_mapping row {r} (group {gid})", None, None, who)
        if self._slot_exact(st, m):
            blocks = host_array(runner.input_batch.block_table[gid].get_device_tensor(num_reqs_padded))
            blocks = blocks.astype(np.int32)
            lens = host_array(runner.seq_lens[:num_reqs_padded]).astype(np.int32)
            lens[skipped] = 0
            if type(m).__name__ in _WINDOWED_MANAGERS:
                # A sliding-window or local-chunk group: each row is read
                # from its first query's window on (the entries before it
                # are the null block by design); one in the window is not.
                size = m.block_size
                for r in range(num_reqs):
                    k = min(_window_start(m, int(positions[starts[r]])) // size, blocks.shape[1]) if starts[r + 1] > starts[r] else 0
                    blocks[r] = np.roll(blocks[r], -k)
                    lens[r] = max(0, lens[r] - k * size)
            rows = owners + [pad] * (num_reqs_padded - num_reqs)
            verdicts = st.pool.check_block_table(rows, blocks, blocks.shape[1], lens)
            for r, v in enumerate(verdicts):
                who = req_ids[r] if r < num_reqs else "a padding row"
                self._note(v, f"attention reads block table row {r} (group {gid})", None, None, who)

    def _check_state_group(
        self, st: _PoolState, gid: int, runner: Any, req_ids: list[str], skipped: list[int], attn_metadata: dict[str, Any]
    ) -> bool:
        """The state slots a Mamba group's kernels read and update in place
        this step: the group's metadata (``state_indices_tensor_d`` for the
        decode rows, then ``state_indices_tensor_p`` for the prefill rows,
        in batch order) names, per row, the block holding the row's running
        state. A request's row must name a block it holds (column 0: the
        state it updates); a padding row (past the batch's requests, or a
        CUDA graph's rows past its decodes) must name none (vLLM's null
        block or ``PAD_SLOT_ID``): its update goes to the block it names.
        Returns whether the group was checked."""
        import numpy as np

        names = runner.kv_cache_config.kv_cache_groups[gid].layer_names
        md = next((attn_metadata[n] for n in names if n in attn_metadata), None)
        if md is None or not hasattr(md, "state_indices_tensor_p"):
            self._skip_step("state groups whose metadata names no state slots")
            return False
        parts = []
        for name, n in (("state_indices_tensor_d", None), ("state_indices_tensor_p", int(md.num_prefills))):
            t = getattr(md, name, None)
            if t is None:
                continue
            a = host_array(t).astype(np.int64)
            a = a[:, None] if a.ndim == 1 else a
            parts.append(a[:n] if n is not None else a)
        if not parts:
            return False
        width = max(p.shape[1] for p in parts)
        table = np.concatenate([np.pad(p, ((0, 0), (0, width - p.shape[1])), constant_values=-1) for p in parts])
        owners = [self._row_owner(st, rid) for rid in req_ids]
        pad = self._padding(st)
        from vllm.v1.attention.backends.utils import NULL_BLOCK_ID as null

        slots: list[int] = []
        offsets = [0]
        rows: list[Owner] = []
        for r, entries in enumerate(table):
            if r < len(req_ids):
                ids = [] if r in skipped else entries[:1].tolist()
                rows.append(owners[r])
            else:
                ids = [i for i in entries.tolist() if i != null]
                rows.append(pad)
            slots += [i * st.page_slots if i >= 0 else -1 for i in ids]
            offsets.append(len(slots))
        verdicts = st.pool.check_slot_mapping(rows, np.asarray(offsets, dtype=np.int32), np.asarray(slots, dtype=np.int64))
        for r, v in enumerate(verdicts):
            who = req_ids[r] if r < len(req_ids) else "a padding row"
            self._note(v, f"the state kernels update state_indices row {r} (group {gid})", None, None, who)
        return True

    def _row_owner(self, st: _PoolState, rid: str) -> Owner:
        """The request of a batch row: the scheduler's, else (a row of a
        request the scheduler no longer has) one that holds nothing."""
        n = st.requests.get(rid)
        if n is not None:
            return Owner(n, self._tenants.get(rid, 0))
        stranger = st.strangers.get(rid)
        if stranger is None:
            stranger = st.strangers[rid] = self._anonymous()
            self._names[stranger.request] = f"{rid} (not scheduled)"
        return stranger

    def _padding(self, st: _PoolState) -> Owner:
        if st.padding is None:
            st.padding = self._anonymous()
            self._names[st.padding.request] = "the step's padding"
        return st.padding

    def _spare_cached_rewrites(
        self, st: _PoolState, m: Any, scheduler: Any, req_ids: list[str], starts: Any, positions: Any, slots: Any
    ) -> None:
        """Leaves out of ``slots`` a request's recomputation of tokens into
        a block the prefix cache holds under that block's own hash (see the
        module's doc), unless strict. Only the tokens whose slot lies in a
        cached block are looked at one by one."""
        import numpy as np

        if self.strict_cached_rewrites:
            return
        size = m.block_size
        cached = [n for n, b in st.blocks.items() if b.cache_held]
        n_tokens = int(starts[-1])
        if not cached or n_tokens == 0:
            return
        real = slots[:n_tokens]
        hits = np.flatnonzero((real >= 0) & np.isin(real // size, cached))
        every = m.block_pool.blocks
        for t in hits:
            r = int(np.searchsorted(starts, t, side="right")) - 1
            rid = req_ids[r]
            hashes = getattr(scheduler.requests.get(rid), "block_hashes", None) or []
            table = m.req_to_blocks.get(rid) or []
            block, i = int(real[t]) // size, int(positions[t]) // size
            key = every[block].block_hash if 0 <= block < len(every) else None
            if (
                key is not None
                and i < len(hashes)
                and i < len(table)
                and table[i].block_id == block
                and _hash_of(key) == hashes[i]
            ):
                slots[t] = -1

    def _skip_step(self, reason: str) -> None:
        self.unchecked_steps[reason] = self.unchecked_steps.get(reason, 0) + 1


def _segments(st: _PoolState, blocks: list[Any], tokens: int, size: int) -> Iterator[tuple[int, list[PageRef], int]]:
    """The runs of checked blocks in a table, each with the tokens read."""
    run: list[PageRef] = []
    first = 0
    start = 0
    for i, blk in enumerate(blocks):
        b = None if blk is None or blk.is_null else st.blocks.get(blk.block_id)
        if b is None or b.unchecked or b.ref is None:
            if run:
                yield first, run, min(tokens, i * size) - start
            run = []
            continue
        if not run:
            first, start = blk.block_id, i * size
        run.append(b.ref)
    if run:
        yield first, run, tokens - start


def _window_start(manager: Any, first_query: int) -> int:
    """The first token a query at ``first_query`` attends to in the
    manager's group: the sliding window's (its trailing edge) or the local
    chunk's start; 0 for full attention."""
    kind = type(manager).__name__
    if kind == _WINDOWED_MANAGERS[0]:
        return max(0, first_query - int(manager.sliding_window) + 1)
    if kind == _WINDOWED_MANAGERS[1]:
        chunk = int(manager.attention_chunk_size)
        return first_query // chunk * chunk
    return 0


def _block_id_groups(ids: Any) -> list[list[int]] | None:
    """A connector's block ids per KV cache group (``BlockIds``: one list
    per group, or one flat list for a single group); ``None`` if absent or
    not block ids."""
    if not isinstance(ids, (list, tuple)):
        return None
    if all(isinstance(b, int) for b in ids):
        return [list(ids)]
    if all(isinstance(g, (list, tuple)) and all(isinstance(b, int) for b in g) for g in ids):
        return [list(g) for g in ids]
    return None


def _state_group(manager: Any) -> bool:
    """A group of recurrent state blocks (Mamba and its kin), not KV."""
    return "Mamba" in type(manager).__name__


def _unmodelled(manager: Any, pool: Any) -> str | None:
    """Why a manager's pool is beyond the adapter's model, if it is."""
    kind = type(manager).__name__
    if "HiSparse" in kind:
        return _HISPARSE
    if manager.block_size != pool.hash_block_size:
        return "blocks larger than the hash block (fine-grained partial hits)"
    return None


def _ranges_without(managers: Any, rid: str, start: int, end: int, bad: set[int]) -> Iterator[tuple[int, int]]:
    """The token ranges of ``start..end`` outside the request's blocks in
    ``bad``, in any of its groups (block sizes may differ by group)."""
    cut: set[int] = set()
    for m in managers:
        for i, blk in enumerate(m.req_to_blocks.get(rid) or []):
            if blk.block_id in bad:
                cut.update(range(max(start, i * m.block_size), min(end, (i + 1) * m.block_size)))
    lo = start
    while lo < end:
        while lo < end and lo in cut:
            lo += 1
        hi = lo
        while hi < end and hi not in cut:
            hi += 1
        if lo < hi:
            yield lo, hi
        lo = hi


def _hash_of(key: Any) -> Any:
    """The block hash in a cached block's key (hash and group id)."""
    from vllm.v1.core.kv_cache_utils import get_block_hash

    return get_block_hash(key)


def _tenant(salt: str) -> int:
    """A tenant id for a cache salt: the same salt, the same tenant."""
    return int.from_bytes(hashlib.sha256(salt.encode()).digest()[:4], "little") or 1


def attach(san: Sanitizer | None = None, strict_cached_rewrites: bool = False) -> Adapter:
    """kvsan attached to vLLM in this process (the shim as
    :func:`kvsan.attach` finds it). Detach with :meth:`Adapter.detach`, or
    use the adapter as a context manager. ``strict_cached_rewrites``
    reports a request recomputing its own tokens into a cached block as
    ``foreign-write`` (by default they are counted in
    :attr:`Adapter.cached_rewrites`)."""
    return Adapter(san or attach_sanitizer(), strict_cached_rewrites).attach()
