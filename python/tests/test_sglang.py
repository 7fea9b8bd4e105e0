"""kvsan.sglang on SGLang's own memory pools, radix cache and forward batch.

SGLang's allocators (``TokenToKVPoolAllocator``,
``PagedTokenToKVPoolAllocator``), ``ReqToTokenPool`` and ``RadixCache`` run
here on the CPU, driven the way SGLang's scheduler drives them (match the
prefix, lock it, allocate the rest, write the row, forward, insert the
finished request, free what the tree already had, free the row); each step's
``ForwardBatch`` is SGLang's own and is checked as its kernels would take
it. Then known bug classes are re-created, each caught with a report, each
beside its legal neighbour.
"""

from __future__ import annotations

import pytest

pytest.importorskip("sglang.srt.mem_cache.radix_cache")

import torch  # noqa: E402
from sglang.srt.mem_cache.allocator import (  # noqa: E402
    PagedTokenToKVPoolAllocator,
    TokenToKVPoolAllocator,
)
from sglang.srt.mem_cache.base_prefix_cache import (  # noqa: E402
    EvictParams,
    InsertParams,
    MatchPrefixParams,
)
from sglang.srt.mem_cache.cache_init_params import CacheInitParams  # noqa: E402
from sglang.srt.mem_cache.memory_pool import ReqToTokenPool  # noqa: E402
from sglang.srt.mem_cache.radix_cache import RadixCache, RadixKey  # noqa: E402
from sglang.srt.model_executor.forward_batch_info import (  # noqa: E402
    ForwardBatch,
    ForwardMode,
)

import kvsan  # noqa: E402
from kvsan import sglang as ks  # noqa: E402


@pytest.fixture(scope="module")
def adapter():
    a = ks.attach(kvsan.attach())
    yield a
    a.detach()


@pytest.fixture(autouse=True)
def fresh(adapter):
    adapter.take_violations()
    yield


class Engine:
    """SGLang's memory objects and the scheduler's calls on them."""

    def __init__(self, adapter, page_size: int = 4, tokens: int = 256, rows: int = 8, ctx: int = 64):
        self.adapter = adapter
        self.ps = page_size
        if page_size == 1:
            self.alloc = TokenToKVPoolAllocator(tokens, torch.float16, "cpu", None, False)
        else:
            self.alloc = PagedTokenToKVPoolAllocator(tokens, page_size, torch.float16, "cpu", None, False)
        self.rtp = ReqToTokenPool(rows, ctx, "cpu", False)
        self.cache = RadixCache(
            CacheInitParams(
                disable=False,
                req_to_token_pool=self.rtp,
                token_to_kv_pool_allocator=self.alloc,
                page_size=page_size,
            )
        )

    def row(self, row: int, n: int) -> torch.Tensor:
        return self.rtp.req_to_token[row, :n].to(torch.int64)

    def admit(self, tokens: list[int], lock: bool = True):
        """A request prefilled: prefix matched (and locked), the rest
        allocated, the row written, the extend forward run."""
        row = self.rtp.alloc_rows(1)[0]
        m = self.cache.match_prefix(MatchPrefixParams(key=RadixKey(tokens)))
        node = m.last_device_node
        prefix = self.cache.path_device_indices(node)[: m.device_prefix_len].to(torch.int64)
        if lock:
            self.cache.inc_lock_ref(node)
        out = self.extend_slots(len(prefix), len(tokens), prefix)
        self.rtp.write((row, slice(0, len(prefix))), prefix.to(torch.int32))
        self.rtp.write((row, slice(len(prefix), len(tokens))), out.to(torch.int32))
        self.forward([row], [len(tokens)], out, extend=[len(tokens) - len(prefix)])
        return Req(row, list(tokens), node, len(prefix), lock)

    def extend_slots(self, prefix_len: int, seq_len: int, prefix: torch.Tensor) -> torch.Tensor:
        if self.ps == 1:
            return self.alloc.alloc(seq_len - prefix_len)
        last = prefix[-1:] if prefix_len else torch.tensor([-1])
        return self.alloc.alloc_extend(
            torch.tensor([prefix_len]),
            torch.tensor([prefix_len]),
            torch.tensor([seq_len]),
            torch.tensor([seq_len]),
            last,
            seq_len - prefix_len,
        )

    def decode(self, reqs: list["Req"], token: int = 7):
        """One decode step of ``reqs``: a slot each, rows written, forward."""
        rows = torch.tensor([r.row for r in reqs])
        lens = torch.tensor([len(r.tokens) for r in reqs])
        if self.ps == 1:
            out = self.alloc.alloc(len(reqs))
        else:
            last = self.rtp.req_to_token[rows, lens - 1].to(torch.int64)
            out = self.alloc.alloc_decode(lens + 1, lens + 1, last)
        self.rtp.write((rows, lens), out.to(torch.int32))
        for r in reqs:
            r.tokens.append(token)
        self.forward([r.row for r in reqs], [len(r.tokens) for r in reqs], out)

    def forward(self, rows, lens, out_cache_loc, extend=None):
        fb = ForwardBatch(
            forward_mode=ForwardMode.EXTEND if extend else ForwardMode.DECODE,
            batch_size=len(rows),
            input_ids=torch.zeros(len(out_cache_loc), dtype=torch.int64),
            req_pool_indices=torch.tensor(rows, dtype=torch.int64),
            seq_lens=torch.tensor(lens, dtype=torch.int64),
            out_cache_loc=out_cache_loc.to(torch.int64),
            seq_lens_sum=sum(lens),
            extend_seq_lens_cpu=extend,
        )
        self.adapter.check_forward(fb, self.rtp, self.alloc)

    def finish(self, req: "Req", group: bool = False) -> None:
        """What SGLang does with a finished request: its page-aligned KV
        goes into the tree, what the tree had already is freed, the rest of
        the row is freed, the lock dropped, the row freed. In a free group
        (``group``), the allocator takes the slots back at its end."""
        if group:
            self.alloc.free_group_begin()
            self.finish(req)
            self.alloc.free_group_end()
            return
        n = len(req.tokens)
        aligned = n // self.ps * self.ps
        kv = self.row(req.row, n)
        res = self.cache.insert(InsertParams(key=RadixKey(req.tokens[:aligned]), value=kv[:aligned]))
        self.alloc.free(kv[req.prefix_len : res.prefix_len])
        self.alloc.free(kv[aligned:])
        if req.locked:
            self.cache.dec_lock_ref(req.node)
        self.rtp.free_rows([req.row])


class Req:
    def __init__(self, row, tokens, node, prefix_len, locked):
        self.row, self.tokens, self.node, self.prefix_len, self.locked = row, tokens, node, prefix_len, locked


def kinds(found) -> list[str]:
    return sorted({f.kind for f in found})


@pytest.mark.parametrize("page_size", [1, 4])
def test_shared_prefix_and_decode_are_clean(adapter, page_size):
    """Two requests sharing a prompt prefix through the radix cache, decode
    steps, finish, eviction and reuse of the evicted pages: no violation."""
    e = Engine(adapter, page_size)
    a = e.admit(list(range(1, 19)))
    for _ in range(3):
        e.decode([a])
    e.finish(a)
    b = e.admit(list(range(1, 17)) + [50, 51, 52])
    assert b.prefix_len == 16
    c = e.admit([90, 91, 92, 93, 94])
    e.decode([b, c])
    e.finish(b)
    e.finish(c)
    e.cache.evict(EvictParams(num_tokens=10_000))
    d = e.admit(list(range(200, 240)))
    e.decode([d])
    e.finish(d, group=True)
    e.cache.evict(EvictParams(num_tokens=10_000))
    assert adapter.take_violations() == []
    assert adapter.forwards > 0
    # everything went back: the whole pool can be handed out again
    assert e.alloc.alloc(e.alloc.size // page_size * page_size) is not None
    assert adapter.take_violations() == []


def test_detach_puts_sglang_back():
    from sglang.srt.mem_cache.memory_pool import ReqToTokenPool as R

    before = R.write
    a = ks.attach(kvsan.attach())
    assert R.write is not before
    a.detach()
    assert R.write is before


def test_double_free_is_caught(adapter):
    """The allocator takes the same slots back twice (SGLang frees a
    request's tail once in release and again in an abort path)."""
    e = Engine(adapter, 4)
    a = e.admit(list(range(1, 11)))
    e.finish(a)
    assert adapter.take_violations() == []
    tail = e.alloc.alloc(4)
    e.alloc.free(tail)
    assert adapter.take_violations() == []
    e.alloc.free(tail)
    found = adapter.take_violations()
    assert kinds(found) == ["double-free"], found


def test_eviction_of_a_page_a_running_request_reads(adapter):
    """A request uses a cached prefix without locking it: the radix cache
    evicts it under pressure and the allocator hands the pages to another
    request while the first still reads them. Locked (the legal neighbour),
    nothing is evicted and nothing is reported."""
    for lock in (True, False):
        e = Engine(adapter, 4, tokens=48)
        a = e.admit(list(range(1, 17)))
        e.finish(a)
        b = e.admit(list(range(1, 17)) + [40, 41], lock=lock)
        e.cache.evict(EvictParams(num_tokens=16))
        c = e.admit(list(range(60, 72)))
        if lock:
            e.decode([b, c])
            assert adapter.take_violations() == []
        else:
            found = adapter.take_violations()
            # the pages b reads are handed to c, and c's stores land in them
            assert kinds(found) == ["double-alloc", "foreign-write"], found
            assert any("still in use" in f.what for f in found)


def test_row_longer_than_what_was_computed_reads_unwritten_slots(adapter):
    """The incident's shape: a request whose row claims more tokens than
    its forward stored (an oversize prompt cut to a placeholder) attends
    over reserved slots that hold an earlier request's KV."""
    e = Engine(adapter, 4)
    a = e.admit(list(range(1, 13)), lock=False)
    e.rtp.free_rows([a.row])
    e.alloc.free(e.row(a.row, 12))  # nothing cached: the pages go back, unzeroed
    assert adapter.take_violations() == []
    row = e.rtp.alloc_rows(1)[0]
    reserved = e.alloc.alloc(12)  # the same pages again, still holding a's KV
    e.rtp.write((row, slice(0, 12)), reserved.to(torch.int32))
    # the placeholder: one token computed, the row read whole
    e.forward([row], [12], reserved[:1], extend=[1])
    found = adapter.take_violations()
    assert kinds(found) == ["stale-read"], found
    # the legal neighbour: the row read as far as it was computed
    e.forward([row], [1], reserved[:0], extend=[0])
    assert adapter.take_violations() == []


def test_store_into_another_requests_page(adapter):
    """A forward whose out_cache_loc points into another running request's
    page (a stale or reused out_cache_loc buffer)."""
    e = Engine(adapter, 4)
    a = e.admit([1, 2, 3, 4, 5, 6])
    b = e.admit([9, 8, 7])
    assert adapter.take_violations() == []
    # b's next token stored at a's free slot 6 instead of its own
    theirs = e.row(a.row, 6)[-1:] + 1
    rows = torch.tensor([b.row])
    e.rtp.write((rows, torch.tensor([3])), theirs.to(torch.int32))
    b.tokens.append(0)
    e.forward([b.row], [4], theirs)
    found = adapter.take_violations()
    # b shares a's half-written page, stores into it and reads it
    assert kinds(found) == ["foreign-read", "foreign-write", "unwritten-share"], found


def test_row_pointing_at_a_page_taken_back(adapter):
    """A row that still points at slots the allocator took back (freed
    without the row being rewritten) is read by the next forward."""
    e = Engine(adapter, 4)
    a = e.admit(list(range(1, 9)), lock=False)
    kv = e.row(a.row, 8)
    e.alloc.free(kv)  # the row is not rewritten: its pages stay held by it
    assert adapter.take_violations() == []
    e.alloc.alloc(8)  # and handed out again
    found = adapter.take_violations()
    assert kinds(found) == ["double-alloc"], found
