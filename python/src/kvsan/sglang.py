"""kvsan for SGLang's KV memory, attached without changing SGLang.

:func:`attach` wraps, in place, the methods through which SGLang's KV token
slots change hands, and reports each change to kvsan as it happens:

==============================================  ================================
SGLang                                          kvsan
==============================================  ================================
an allocator hands out a page (``alloc``,       ``alloc`` by the allocator: the
``alloc_extend``, ``alloc_decode``)             page is in use, no request's yet
a ``req_to_token`` row first points at a page   the request ``alloc``\\s it (a
(``ReqToTokenPool.write``, or found at the      fresh page) or ``share``\\s it (a
forward)                                        prefix-cache hit)
a row stops pointing at a page (rewritten,      the request lets go (``free``);
``free_rows``)                                  the last one keeps its hold while
                                                the allocator keeps the page
                                                (the radix cache holds it)
the allocator takes a page back (``free``,      every holder that no row points
``free_page_ids``, eviction, ``clear``)         for lets go; a page taken back
                                                twice is a ``double-free``
``ForwardBatch.init_new``                       the batch's own buffers checked:
                                                ``out_cache_loc`` as the store's
                                                slot mapping, then
                                                ``req_to_token`` rows up to
                                                ``seq_lens`` as attention reads
==============================================  ================================

Each token-to-KV allocator (``TokenToKVPoolAllocator``, one slot per page,
and ``PagedTokenToKVPoolAllocator``) is one kvsan pool of its pages, one
layer. A request is a kvsan owner: one per ``ReqToTokenPool`` row taken
(``alloc_rows``) until the row is freed, all of tenant 0 (SGLang shares its
radix cache between all requests of an ``extra_key``; kvsan's tenant policy
is not applied).

So a page the allocator hands out while a row still points at it (the radix
cache evicted, or a request freed, a page a running request reads) is a
``double-alloc``; a store into a page of another request a
``foreign-write``; an attention read of slots no store wrote in the page's
current generation (a row longer than what was computed into it) a
``stale-read``; a row pointing at a
page the allocator never handed out, or took back, a ``read-free-page``.

Allocators of other kinds (SWA, Mamba, HiSparse, page-interleaved, unified
pools) are left alone and counted in :attr:`Adapter.unchecked_pools`.
Violations are kept in :attr:`Adapter.violations`.

On SGLang's disaggregated path (releases :data:`RELEASES`; see
:mod:`kvsan._sglang_pd`) a request is followed through the prefill
bootstrap queue, its KV sender, the decode preallocation and transfer
queues and the commit of its transfer; a transfer backend's copies are
checked through :meth:`Adapter.land` or :meth:`Adapter.checked_copy`.
SGLang's behaviour is never changed, except with ``abort=True``: then a
request a violation was found in on that path is aborted as the
disaggregation queues abort one (``prepare_abort``), with a message naming
the violation.
"""

from __future__ import annotations

import threading
import weakref
from dataclasses import dataclass, field
from typing import Any, Callable

import numpy as np

from ._abi import Owner, PageRef
from ._hooks import Finding, Hooks, host_array as _numpy, subclasses
from ._sglang_pd import RELEASES, DisaggregatedPath, kv_digest
from .sanitizer import Pool, Sanitizer, attach as attach_sanitizer

__all__ = ["Adapter", "Finding", "RELEASES", "attach", "kv_digest"]

# The allocator as a page holder: it holds a page from handing it out until
# a row points at it.
ALLOCATOR = (1 << 64) - 2
# kvsan pages hold at most this many slots.
_MAX_PAGE_SLOTS = 4096


@dataclass
class _Page:
    ref: PageRef | None = None
    # The kvsan holders (owner ids), and which of them a row points for now.
    held: list[int] = field(default_factory=list)
    refs: set[int] = field(default_factory=set)
    taken: bool = False


class _PoolState:
    """The kvsan pool behind one SGLang allocator."""

    def __init__(self, pool: Pool, capacity: int, page_size: int) -> None:
        self.pool = pool
        self.capacity = capacity
        self.page_size = page_size
        self.pages: dict[int, _Page] = {}

    def page(self, p: int) -> _Page:
        pg = self.pages.get(p)
        if pg is None:
            pg = self.pages[p] = _Page()
        return pg


class _Row:
    """One taken ``req_to_token`` row: its kvsan owner and the page each
    position points at as kvsan last saw it."""

    def __init__(self, n: int, name: str) -> None:
        self.n = n
        self.name = name
        self.pos = np.full(0, -1, dtype=np.int64)
        self.counts: dict[int, int] = {}

    def grow(self, end: int) -> None:
        if end > len(self.pos):
            more = np.full(max(end, 2 * len(self.pos)) - len(self.pos), -1, dtype=np.int64)
            self.pos = np.concatenate([self.pos, more])


class Adapter(DisaggregatedPath, Hooks):
    """kvsan attached to SGLang's KV memory (see the module's doc, and
    :mod:`kvsan._sglang_pd` for the disaggregated path)."""

    engine = "sglang"
    follows = "SGLang 0.5.23's memory pools"
    reports_landing = True

    def __init__(self, san: Sanitizer, abort: bool = False, disaggregation: bool | None = None) -> None:
        super().__init__(san)
        self._lock = threading.RLock()
        self._pools: weakref.WeakKeyDictionary[Any, _PoolState] = weakref.WeakKeyDictionary()
        self._rows: weakref.WeakKeyDictionary[Any, dict[int, _Row]] = weakref.WeakKeyDictionary()
        self._pairs: weakref.WeakKeyDictionary[Any, Any] = weakref.WeakKeyDictionary()
        self._kinds: tuple[type, ...] = ()
        self._names: dict[int, str] = {ALLOCATOR: "the allocator"}
        self._next = 1
        self._last_allocator: Any = None
        self._unmodelled: weakref.WeakKeyDictionary[Any, str] = weakref.WeakKeyDictionary()
        self._kv_states: weakref.WeakKeyDictionary[Any, _PoolState] = weakref.WeakKeyDictionary()
        self._pd_mode = disaggregation
        self._init_pd(abort)
        #: SGLang allocators checked, and those left unchecked by the reason.
        self.checked_pools = 0
        self.unchecked_pools: dict[str, int] = {}
        #: Forward batches checked, and those left unchecked by the reason.
        self.forwards = 0
        self.unchecked_forwards: dict[str, int] = {}

    # ---- attaching ----------------------------------------------------------

    def attach(self) -> "Adapter":
        """Wraps SGLang's methods (idempotent per adapter)."""
        if self._patches:
            return self
        from sglang.srt.mem_cache import memory_pool as mp
        from sglang.srt.mem_cache.allocator import paged, token

        self._kinds = (token.TokenToKVPoolAllocator, paged.PagedTokenToKVPoolAllocator)
        for cls in self._kinds:
            for name in ("alloc", "alloc_extend", "alloc_decode"):
                self._wrap(cls, name, self._on_hand_out, optional=name != "alloc")
            self._wrap(cls, "clear", self._on_clear)
        self._wrap(token.TokenToKVPoolAllocator, "free", self._on_token_free)
        self._wrap(paged.PagedTokenToKVPoolAllocator, "_release_page_ids", self._on_release_pages)
        rtp = mp.ReqToTokenPool
        self._wrap(rtp, "alloc_rows", self._on_alloc_rows)
        self._wrap(rtp, "free_rows", self._on_free_rows)
        self._wrap(rtp, "write", self._on_row_write)
        self._wrap(rtp, "clear", self._on_rows_clear, optional=True)
        try:
            from sglang.srt.mem_cache import base_prefix_cache as bpc

            for cls in subclasses(bpc.BasePrefixCache):
                if "__init__" in vars(cls):
                    self._wrap(cls, "__init__", self._on_cache_init)
        except ImportError:
            pass
        from sglang.srt.model_executor import forward_batch_info as fbi

        self._wrap(fbi.ForwardBatch, "init_new", self._on_forward_new)
        self._attach_pd(self._pd_mode)
        return self

    def pair(self, req_to_token_pool: Any, allocator: Any) -> None:
        """Says whose token slots a ``ReqToTokenPool``'s rows hold (learned
        by itself from the prefix cache and the forward batch)."""
        self._pairs[req_to_token_pool] = allocator

    # ---- pools ---------------------------------------------------------------

    def _state(self, allocator: Any) -> _PoolState | None:
        st = self._pools.get(allocator)
        if st is not None or allocator is None:
            return st
        if allocator in self._unmodelled:
            return None
        if type(allocator) not in self._kinds:
            self._leave(allocator, f"allocators of another kind ({type(allocator).__name__})")
            return None
        page_size = int(allocator.page_size)
        if page_size > _MAX_PAGE_SLOTS:
            self._leave(allocator, f"pages of more than {_MAX_PAGE_SLOTS} slots")
            return None
        # Page ids run from 1 (0 is SGLang's padding page) to the page count.
        pages = int(allocator.size) // page_size + 1
        pool, capacity = self._kvsan_pool(pages, page_size)
        st = _PoolState(pool, capacity, page_size)
        self._pools[allocator] = st
        kv = getattr(allocator, "_kvcache", None)
        if kv is not None:
            self._kv_states[kv] = st
        self._last_allocator = weakref.ref(allocator)
        self.checked_pools += 1
        self._watch(allocator, st)
        return st

    def _kv_state(self, kv_pool: Any) -> _PoolState | None:
        """The pool state of the allocator over the KV cache ``kv_pool``."""
        return self._kv_states.get(kv_pool)

    def _leave(self, allocator: Any, reason: str) -> None:
        if allocator not in self._unmodelled:
            self._unmodelled[allocator] = reason
            self.unchecked_pools[reason] = self.unchecked_pools.get(reason, 0) + 1

    def _retire(self, st: _PoolState) -> None:
        """An allocator is gone: every holder lets go; its kvsan pool serves
        the next allocator of its page size."""
        for pg in st.pages.values():
            if pg.ref is not None:
                for n in pg.held:
                    st.pool.free(Owner(n, 0), pg.ref)
        self._spare_pool(st.page_size, st.capacity, st.pool)

    def _pool_of_rows(self, rtp: Any) -> _PoolState | None:
        allocator = self._pairs.get(rtp)
        if allocator is None and self._last_allocator is not None:
            allocator = self._last_allocator()
        return self._state(allocator)

    def _in_range(self, st: _PoolState, pages: np.ndarray, what: str) -> np.ndarray:
        bad = (pages < 0) | (pages >= st.capacity)
        if bad.any():
            self.unchecked_forwards[what] = self.unchecked_forwards.get(what, 0) + int(bad.sum())
            return pages[~bad]
        return pages

    # ---- the allocator -------------------------------------------------------

    def _on_hand_out(self, original: Callable[..., Any], allocator: Any, *a: Any, **kw: Any) -> Any:
        out = original(allocator, *a, **kw)
        if out is None:
            return out
        with self._lock:
            st = self._state(allocator)
            if st is None:
                return out
            idx = _numpy(out)
            # A page is new to this call where the call hands out its first
            # slot; the other slots continue a request's last page.
            pages = np.unique(idx[idx % st.page_size == 0] // st.page_size)
            for p in self._in_range(st, pages, "slots beyond the pool"):
                self._take(st, int(p))
        return out

    def _take(self, st: _PoolState, p: int) -> None:
        pg = st.page(p)
        if pg.held:
            # Still held: by a row that points at it, or not yet taken back.
            ref = st.pool.alloc(Owner(ALLOCATOR, 0), p)
            self._note(ref.verdict, "the allocator hands out a page still in use", p, ALLOCATOR)
            return
        ref = st.pool.alloc(Owner(ALLOCATOR, 0), p)
        self._note(ref.verdict, "the allocator hands out a page", p, ALLOCATOR)
        if ref.verdict.ok:
            pg.ref = PageRef(ref.page, ref.generation)
            pg.held = [ALLOCATOR]
            pg.refs = set()
        pg.taken = True

    def _on_token_free(self, original: Callable[..., Any], allocator: Any, free_index: Any) -> Any:
        # Inside a free group the slots wait for free_group_end, which
        # frees them again through here.
        now = getattr(allocator, "free_group", None) is None
        if now and _numel(free_index):
            self._release(allocator, _numpy(free_index) // int(allocator.page_size))
        return original(allocator, free_index)

    def _on_release_pages(self, original: Callable[..., Any], allocator: Any, *page_ids: Any) -> Any:
        for ids in page_ids:
            if _numel(ids):
                self._release(allocator, _numpy(ids))
        return original(allocator, *page_ids)

    def _release(self, allocator: Any, pages: np.ndarray) -> None:
        with self._lock:
            st = self._state(allocator)
            if st is None:
                return
            for p in self._in_range(st, pages, "slots beyond the pool"):
                self._give_back(st, int(p))

    def _give_back(self, st: _PoolState, p: int) -> None:
        pg = st.page(p)
        if not pg.taken:
            v = st.pool.free(Owner(ALLOCATOR, 0), pg.ref or PageRef(p, 0))
            self._note(v, "the allocator takes back a page it does not hold", p, ALLOCATOR)
            return
        pg.taken = False
        for n in [n for n in pg.held if n not in pg.refs]:
            pg.held.remove(n)
            assert pg.ref is not None
            v = st.pool.free(Owner(n, 0), pg.ref)
            self._note(v, "the allocator takes a page back", p, n)

    def _on_clear(self, original: Callable[..., Any], allocator: Any, *a: Any, **kw: Any) -> Any:
        with self._lock:
            st = self._pools.get(allocator)
            if st is not None:
                for p, pg in list(st.pages.items()):
                    if pg.taken:
                        self._give_back(st, p)
        return original(allocator, *a, **kw)

    # ---- req_to_token rows ---------------------------------------------------

    def _row_table(self, rtp: Any) -> dict[int, _Row]:
        t = self._rows.get(rtp)
        if t is None:
            t = self._rows[rtp] = {}
        return t

    def _new_row(self, rtp: Any, row: int, owner: int | None = None) -> _Row:
        """Row ``row`` taken: by request ``owner`` (a request the
        disaggregation doors follow), else by an owner of its own."""
        if owner is None and self._binding:
            owner = self._binding.pop(0)
        if owner is not None:
            r = _Row(owner, self._names.get(owner, f"#{owner}"))
            self._row_table(rtp)[row] = r
            return r
        n = self._next
        self._next += 1
        r = _Row(n, f"row {row}#{n}")
        self._names[n] = r.name
        self._row_table(rtp)[row] = r
        st = self._pool_of_rows(rtp)
        if st is not None:
            for event in ("queued", "admitted"):
                self._note(self.san.request_event(Owner(n, 0), event, st.pool), f"the request is {event}", None, n)
        return r

    def _row(self, rtp: Any, row: int) -> _Row:
        r = self._row_table(rtp).get(row)
        return r if r is not None else self._new_row(rtp, row)

    def _request_name(self, n: int) -> str | None:
        return self._names.get(n)

    def _on_alloc_rows(self, original: Callable[..., Any], rtp: Any, *a: Any, **kw: Any) -> Any:
        rows = original(rtp, *a, **kw)
        if rows:
            with self._lock:
                for row in rows:
                    old = self._row_table(rtp).get(int(row))
                    if old is not None:
                        self._let_go_row(rtp, old)
                    self._new_row(rtp, int(row))
        return rows

    def _on_free_rows(self, original: Callable[..., Any], rtp: Any, indices: Any, *a: Any, **kw: Any) -> Any:
        with self._lock:
            table = self._row_table(rtp)
            for row in list(indices):
                r = table.pop(int(row), None)
                if r is not None:
                    self._let_go_row(rtp, r)
        return original(rtp, indices, *a, **kw)

    def _on_rows_clear(self, original: Callable[..., Any], rtp: Any, *a: Any, **kw: Any) -> Any:
        with self._lock:
            table = self._row_table(rtp)
            for r in table.values():
                self._let_go_row(rtp, r)
            table.clear()
        return original(rtp, *a, **kw)

    def _let_go_row(self, rtp: Any, r: _Row) -> None:
        st = self._pool_of_rows(rtp)
        if st is not None:
            for p in list(r.counts):
                self._unpoint(st, r, p)
        r.counts.clear()
        if r.n not in self._reqs:
            self._names.pop(r.n, None)

    def _on_row_write(self, original: Callable[..., Any], rtp: Any, indices: Any, values: Any) -> Any:
        out = original(rtp, indices, values)
        with self._lock:
            st = self._pool_of_rows(rtp)
            if st is not None:
                for row, cols in _positions(indices, rtp.req_to_token.shape[1]):
                    if row != 0:
                        self._reconcile(st, rtp, row, cols)
        return out

    def _reconcile(self, st: _PoolState, rtp: Any, row: int, cols: np.ndarray) -> None:
        """Brings kvsan's view of ``row`` at ``cols`` up to what the row
        holds now."""
        if len(cols) == 0:
            return
        r = self._row(rtp, row)
        r.grow(int(cols.max()) + 1)
        import torch

        cur = _numpy(rtp.req_to_token[row, torch.from_numpy(cols)]).astype(np.int64) // st.page_size
        old = r.pos[cols]
        changed = cur != old
        if not changed.any():
            return
        for p in old[changed]:
            if p >= 0:
                left = r.counts.get(int(p), 0) - 1
                if left > 0:
                    r.counts[int(p)] = left
                elif left == 0:
                    del r.counts[int(p)]
                    self._unpoint(st, r, int(p))
        r.pos[cols[changed]] = cur[changed]
        for p in cur[changed]:
            p = int(p)
            if p in r.counts:
                r.counts[p] += 1
            else:
                r.counts[p] = 1
                self._point(st, r, p)

    def _point(self, st: _PoolState, r: _Row, p: int) -> None:
        """Row ``r`` points at page ``p`` for the first time."""
        if not 0 <= p < st.capacity:
            self.unchecked_forwards["rows pointing beyond the pool"] = (
                self.unchecked_forwards.get("rows pointing beyond the pool", 0) + 1
            )
            return
        pg = st.page(p)
        me = Owner(r.n, 0)
        if pg.taken and pg.held == [ALLOCATOR]:
            # A page fresh from the allocator: the request takes it.
            assert pg.ref is not None
            self._note(st.pool.free(Owner(ALLOCATOR, 0), pg.ref), "a row takes a new page", p, r.n)
            ref = st.pool.alloc(me, p)
            self._note(ref.verdict, "a row takes a new page", p, r.n)
            if ref.verdict.ok:
                pg.ref = PageRef(ref.page, ref.generation)
                pg.held = [r.n]
                pg.refs = {r.n}
            else:
                pg.held = []
            return
        if r.n in pg.held:
            pg.refs.add(r.n)
            return
        ref = pg.ref if pg.held and pg.ref is not None else PageRef(p, pg.ref.generation if pg.ref else 0)
        v = st.pool.share(ref, me)
        self._note(v, "a row points at a page", p, r.n)
        if v.ok:
            pg.held.append(r.n)
            pg.refs.add(r.n)

    def _unpoint(self, st: _PoolState, r: _Row, p: int) -> None:
        """Row ``r`` no longer points at page ``p``."""
        pg = st.pages.get(p)
        if pg is None or r.n not in pg.held:
            return
        pg.refs.discard(r.n)
        if pg.taken and pg.held == [r.n]:
            # The allocator still has the page (the radix cache holds it):
            # the hold stays until the allocator takes it back.
            return
        pg.held.remove(r.n)
        assert pg.ref is not None
        self._note(st.pool.free(Owner(r.n, 0), pg.ref), "a row lets go of a page", p, r.n)

    # ---- prefix caches and forward batches ------------------------------------

    def _on_cache_init(self, original: Callable[..., Any], cache: Any, *a: Any, **kw: Any) -> Any:
        out = original(cache, *a, **kw)
        rtp = getattr(cache, "req_to_token_pool", None)
        allocator = getattr(cache, "token_to_kv_pool_allocator", None)
        if rtp is not None and allocator is not None:
            self._pairs[rtp] = allocator
        return out

    def _on_forward_new(self, original: Callable[..., Any], *a: Any, **kw: Any) -> Any:
        fb = original(*a, **kw)
        runner = a[1] if len(a) > 1 else kw.get("model_runner")
        rtp = getattr(runner, "req_to_token_pool", None)
        if rtp is None:
            self._skip_forward("no req_to_token_pool on the model runner")
            return fb
        self.check_forward(fb, rtp, getattr(runner, "token_to_kv_pool_allocator", None))
        return fb

    def check_forward(self, fb: Any, req_to_token_pool: Any, allocator: Any = None) -> None:
        """Checks one forward batch's buffers as its kernels take them:
        ``out_cache_loc`` stored, then each row of ``req_to_token_pool``
        (the model runner's) up to its ``seq_lens`` read. :meth:`attach`
        calls this from ``ForwardBatch.init_new``."""
        if allocator is not None:
            self._pairs.setdefault(req_to_token_pool, allocator)
        mode = getattr(fb, "forward_mode", None)
        if mode is None or mode.is_idle():
            return
        if getattr(fb, "encoder_lens", None) is not None:
            self._skip_forward("encoder-decoder batches")
            return
        rtp = req_to_token_pool
        with self._lock:
            st = self._pool_of_rows(rtp)
            if st is None:
                self._skip_forward("rows of an unchecked allocator")
                return
            rows = _numpy(fb.req_pool_indices).astype(np.int64)
            lens = _numpy(fb.seq_lens).astype(np.int64)
            if len(rows) == 0:
                return
            stores = _numpy(fb.out_cache_loc).astype(np.int64)
            if mode.is_extend() and getattr(fb, "extend_seq_lens_cpu", None) is not None:
                per_row = np.asarray(fb.extend_seq_lens_cpu, dtype=np.int64)
            elif len(stores) % len(rows) == 0:
                per_row = np.full(len(rows), len(stores) // len(rows), dtype=np.int64)
            else:
                self._skip_forward("stores not split evenly between rows")
                return
            if per_row.sum() != len(stores):
                self._skip_forward("stores not split evenly between rows")
                return
            self.forwards += 1
            owners = []
            for row, n in zip(rows, lens):
                self._reconcile(st, rtp, int(row), np.arange(int(n)))
                owners.append(Owner(self._row(rtp, int(row)).n, 0))
            starts = np.zeros(len(rows) + 1, dtype=np.int32)
            np.cumsum(per_row, out=starts[1:])
            # Slot 0 is SGLang's dummy slot for padded tokens: not a store.
            slots = np.where(stores == 0, -1, stores)
            verdicts = st.pool.check_slot_mapping(owners, starts, slots)
            for o, v in zip(owners, verdicts):
                self._note(v, "the forward stores its tokens' KV (out_cache_loc)", None, o.request)
            table = rtp.req_to_token
            verdicts = st.pool.check_req_to_token(
                owners,
                table if table.device.type != "cpu" else _numpy(table).astype(np.int32, copy=False),
                table.shape[1],
                rows.astype(np.int32),
                lens.astype(np.int32),
            )
            for o, v in zip(owners, verdicts):
                self._note(v, "the forward's attention reads its req_to_token row", None, o.request)

    def _skip_forward(self, reason: str) -> None:
        self.unchecked_forwards[reason] = self.unchecked_forwards.get(reason, 0) + 1


def _numel(t: Any) -> int:
    return int(t.numel()) if hasattr(t, "numel") else len(t)


def _positions(indices: Any, width: int) -> list[tuple[int, np.ndarray]]:
    """The (row, columns) a ``req_to_token[indices] = ...`` write touches."""
    if not isinstance(indices, tuple) or len(indices) != 2:
        rows = np.atleast_1d(_numpy(indices)).astype(np.int64)
        return [(int(r), np.arange(width)) for r in np.unique(rows)]
    r, c = indices
    rows = np.atleast_1d(_numpy(r)).astype(np.int64)
    if isinstance(c, slice):
        cols = np.arange(width)[c]
        return [(int(row), cols) for row in np.unique(rows)]
    cols = np.atleast_1d(_numpy(c)).astype(np.int64)
    rows, cols = (a.reshape(-1) for a in np.broadcast_arrays(rows, cols))
    return [(int(row), cols[rows == row]) for row in np.unique(rows)]


def attach(san: Sanitizer | None = None, abort: bool = False, disaggregation: bool | None = None) -> Adapter:
    """kvsan attached to SGLang in this process (the shim as
    :func:`kvsan.attach` finds it). Detach with :meth:`Adapter.detach`, or
    use the adapter as a context manager. ``abort``: abort a request a
    violation was found in on the disaggregated path. ``disaggregation``:
    None wraps the disaggregated path on the releases the adapter follows
    (:data:`RELEASES`) and says why not on others
    (:attr:`Adapter.disaggregation`); True refuses another release with
    an error naming it; False leaves the path alone."""
    return Adapter(san or attach_sanitizer(), abort=abort, disaggregation=disaggregation).attach()
