"""kvsan.vllm on vLLM's own KV cache manager: clean runs pass, and known
vLLM bug classes, re-created here by patching vLLM, are caught.

Needs vLLM installed (``pip install vllm``; CPU is enough): skipped without.
"""

from __future__ import annotations

from typing import Any, Iterator

import pytest

# The module, not a directory of that name on the path: the real vLLM.
pytest.importorskip("vllm.v1.core.kv_cache_manager")

import torch  # noqa: E402
from vllm.sampling_params import SamplingParams  # noqa: E402
from vllm.utils.hashing import sha256  # noqa: E402
from vllm.v1.core.block_pool import BlockPool  # noqa: E402
from vllm.v1.core.kv_cache_manager import KVCacheManager  # noqa: E402
from vllm.v1.core.kv_cache_utils import get_request_block_hasher, init_none_hash  # noqa: E402
from vllm.v1.kv_cache_interface import FullAttentionSpec, KVCacheConfig, KVCacheGroupSpec  # noqa: E402
from vllm.v1.request import Request, RequestStatus  # noqa: E402

import kvsan  # noqa: E402
import kvsan.vllm  # noqa: E402

BLOCK = 16


@pytest.fixture(scope="module")
def adapter() -> Iterator[kvsan.vllm.Adapter]:
    a = kvsan.vllm.attach()
    yield a
    a.detach()


@pytest.fixture
def found(adapter: kvsan.vllm.Adapter) -> Iterator[list[kvsan.vllm.Finding]]:
    """The violations the test's own vLLM calls made."""
    adapter.take_violations()
    out: list[kvsan.vllm.Finding] = []
    yield out


def take(adapter: kvsan.vllm.Adapter, found: list[kvsan.vllm.Finding]) -> list[str]:
    found.extend(adapter.take_violations())
    return [f.kind for f in found]


def manager(num_blocks: int = 12) -> KVCacheManager:
    init_none_hash(sha256)
    spec = FullAttentionSpec(block_size=BLOCK, num_kv_heads=1, head_size=1, dtype=torch.float32)
    config = KVCacheConfig(
        num_blocks=num_blocks,
        kv_cache_tensors=[],
        kv_cache_groups=[KVCacheGroupSpec(["layer"], spec)],
    )
    return KVCacheManager(
        config, max_model_len=8192, enable_caching=True, hash_block_size=BLOCK, scheduler_block_size=BLOCK
    )


def request(rid: str, tokens: list[int], salt: str | None = None) -> Request:
    params = SamplingParams(max_tokens=8)
    params.update_from_generation_config({}, eos_token_id=100)
    return Request(
        request_id=rid,
        prompt_token_ids=tokens,
        mm_features=None,
        sampling_params=params,
        pooling_params=None,
        cache_salt=salt,
        block_hasher=get_request_block_hasher(BLOCK, sha256, 0),
    )


def schedule(m: KVCacheManager, req: Request, num_new_tokens: int | None = None) -> Any:
    """One step of the scheduler for ``req``: look up the prefix cache (on
    its first step), allocate, and count the step's tokens computed."""
    hit, hit_tokens = m.empty_kv_cache_blocks, 0
    if req.num_computed_tokens == 0:
        hit, hit_tokens, _ = m.get_computed_blocks(req)
    n = num_new_tokens if num_new_tokens is not None else req.num_tokens - req.num_computed_tokens - hit_tokens
    blocks = m.allocate_slots(req, n, hit_tokens, hit)
    assert blocks is not None
    req.num_computed_tokens += hit_tokens + n
    return blocks


def finish(m: KVCacheManager, req: Request) -> None:
    req.status = RequestStatus.FINISHED_STOPPED
    m.free(req)


PROMPT = [7] * 16 + [8] * 16 + [9] * 8  # two full blocks and half of a third


def test_a_shared_prefix_under_chunked_prefill_has_no_violation(adapter: Any, found: list[Any]) -> None:
    m = manager()
    a = request("a", PROMPT)
    schedule(m, a, 20)  # a chunk that ends inside the second block
    schedule(m, a)  # the rest of the prompt
    b = request("b", PROMPT[:32] + [5] * 4)
    schedule(m, b)
    assert b.num_computed_tokens == 36
    assert m.block_pool.blocks[m.get_block_ids("b")[0][0]] is m.block_pool.blocks[m.get_block_ids("a")[0][0]]
    finish(m, a)
    finish(m, b)
    c = request("c", PROMPT)  # hits the blocks after their writers are gone
    schedule(m, c)
    finish(m, c)
    assert take(adapter, found) == []
    assert adapter.events > 0


def test_a_reset_prefix_cache_lets_go_of_every_cached_block(adapter: Any, found: list[Any]) -> None:
    # vLLM's reset (RLHF weight updates, benchmarks) drops every hash at
    # once; the next requests get the blocks anew, which is no violation.
    m = manager(num_blocks=4)
    a = request("a", PROMPT)
    schedule(m, a)
    finish(m, a)
    assert m.block_pool.reset_prefix_cache()
    b = request("b", [3] * 40)  # takes every block again, the cached ones included
    schedule(m, b)
    assert b.num_computed_tokens == 40
    finish(m, b)
    assert take(adapter, found) == []


def test_a_block_cached_before_the_step_that_writes_it_is_caught(
    adapter: Any, found: list[Any], monkeypatch: pytest.MonkeyPatch
) -> None:
    """vLLM #37152's class: a block enters the prefix cache before its KV is
    computed. Here the manager caches the whole prompt while the step
    computes only its first chunk; the half-computed second block is
    registered, and a second request takes it as a hit."""
    m = manager()
    real = m.coordinator.cache_blocks

    def cache_whole_prompt(req: Request, num_tokens: int) -> None:
        real(req, req.num_tokens)

    monkeypatch.setattr(m.coordinator, "cache_blocks", cache_whole_prompt)
    a = request("a", PROMPT)
    schedule(m, a, 20)
    kinds = take(adapter, found)
    assert kinds == ["unwritten-share"], found
    assert "registering a block in the prefix cache" in found[0].what
    assert found[0].request == "a"
    # What vLLM does with it: the next request reads the half-written block.
    b = request("b", PROMPT[:32] + [5] * 4)
    hit, hit_tokens, _ = m.get_computed_blocks(b)
    assert hit_tokens == 32


def test_a_block_freed_twice_is_caught(adapter: Any, found: list[Any]) -> None:
    """vLLM #42571's class: a request's blocks go back to the pool twice
    (a deferred free applied again)."""
    m = manager()
    a = request("a", PROMPT)
    schedule(m, a)
    blocks = m.coordinator.pop_blocks_for_free("a")
    m.block_pool.free_blocks(reversed(blocks))
    assert take(adapter, found) == []
    m.block_pool.free_blocks(reversed(blocks[-1:]))  # the tail block, again
    kinds = take(adapter, found)
    assert kinds == ["double-free"], found
    assert found[0].block == blocks[-1].block_id


def test_a_block_freed_while_a_running_request_holds_it_is_caught(
    adapter: Any, found: list[Any], monkeypatch: pytest.MonkeyPatch
) -> None:
    """A free that ignores the other holders of a shared prefix block: the
    block goes back to the pool while a running request still reads it,
    and the pool hands it to a third request."""
    m = manager(num_blocks=8)
    a = request("a", PROMPT)
    schedule(m, a)
    b = request("b", PROMPT[:32] + [5] * 4)
    schedule(m, b)

    def free_ignoring_holders(pool: BlockPool, blocks: Any) -> None:
        blocks = list(blocks)
        for blk in blocks:
            if not blk.is_null:
                blk.ref_cnt = 1
        BlockPool.free_blocks(pool, blocks)

    monkeypatch.setattr(m.block_pool, "free_blocks", free_ignoring_holders.__get__(m.block_pool))
    finish(m, a)
    assert take(adapter, found) == []
    monkeypatch.undo()
    shared = m.get_block_ids("b")[0][0]
    c = request("c", [3] * 96)  # needs every free block, the shared ones too
    taken = schedule(m, c)
    assert shared in taken.get_block_ids()[0]
    kinds = take(adapter, found)
    assert "double-alloc" in kinds, found
    assert any(f.block == shared and f.request == "c" for f in found)


def test_a_request_that_ends_holding_blocks_is_a_page_leak(adapter: Any, found: list[Any], monkeypatch: pytest.MonkeyPatch) -> None:
    m = manager()
    a = request("a", PROMPT)
    schedule(m, a)
    monkeypatch.setattr(m.coordinator, "free", lambda rid: None)
    finish(m, a)
    assert take(adapter, found) == ["page-leak"], found


def test_requests_of_different_cache_salts_share_nothing(adapter: Any, found: list[Any]) -> None:
    m = manager()
    a = request("a", PROMPT, salt="tenant-1")
    schedule(m, a)
    b = request("b", PROMPT, salt="tenant-2")
    schedule(m, b)
    assert b.num_computed_tokens == len(PROMPT)
    assert set(m.get_block_ids("a")[0]).isdisjoint(m.get_block_ids("b")[0])
    assert take(adapter, found) == []


def test_a_request_recomputing_its_own_cached_tokens_is_counted_and_reported_only_when_strict(
    adapter: Any, found: list[Any], monkeypatch: pytest.MonkeyPatch
) -> None:
    """What vLLM does on P/D's decode side (PR #34616): a prompt that
    arrived whole is registered, then its last token is computed again, into
    a block the prefix cache holds. The block's hash chains every token up
    to it: the same tokens' KV at the same positions."""
    m = manager()
    a = request("a", PROMPT[:32] + [6])
    schedule(m, a)  # two full blocks registered
    before = adapter.cached_rewrites
    a.num_computed_tokens = 31  # the last token of the second block again
    m.allocate_slots(a, 2)
    assert take(adapter, found) == []
    assert adapter.cached_rewrites == before + 1
    monkeypatch.setattr(adapter, "strict_cached_rewrites", True)
    m.allocate_slots(a, 2)
    assert take(adapter, found) == ["foreign-write"]
    finish(m, a)


def test_a_write_of_other_tokens_into_a_cached_block_is_reported(adapter: Any, found: list[Any]) -> None:
    """The neighbour that is not a recompute: a request whose own tokens
    differ writes into a block registered under another prompt's hash."""
    m = manager()
    a = request("a", PROMPT[:32] + [6])
    schedule(m, a)
    cached = m.coordinator.single_type_managers[0].req_to_blocks["a"][1]
    b = request("b", [3] * 40)
    schedule(m, b, 16)
    # A stale block table: B's second block is A's registered one.
    m.block_pool.touch([cached])
    m.coordinator.single_type_managers[0].req_to_blocks["b"].append(cached)
    m.allocate_slots(b, 8)
    assert "foreign-write" in take(adapter, found)


def with_full_attention(name: str, spec: Any, num_blocks: int) -> KVCacheManager:
    """A full-attention group and group ``name`` of ``spec`` on one pool."""
    init_none_hash(sha256)
    full = FullAttentionSpec(block_size=BLOCK, num_kv_heads=1, head_size=1, dtype=torch.float32)
    config = KVCacheConfig(
        num_blocks=num_blocks,
        kv_cache_tensors=[],
        kv_cache_groups=[KVCacheGroupSpec(["full"], full), KVCacheGroupSpec([name], spec)],
    )
    return KVCacheManager(
        config, max_model_len=8192, enable_caching=True, hash_block_size=BLOCK, scheduler_block_size=BLOCK
    )


def hybrid_manager(num_blocks: int = 24, window: int = 32) -> KVCacheManager:
    """A full-attention group and a sliding-window group on one pool, as
    vLLM's hybrid models have (the window's skipped prefix becomes the
    null block)."""
    from vllm.v1.kv_cache_interface import SlidingWindowSpec

    swa = SlidingWindowSpec(block_size=BLOCK, num_kv_heads=1, head_size=1, dtype=torch.float32, sliding_window=window)
    return with_full_attention("swa", swa, num_blocks)


def windowed_past_its_first_blocks(m: KVCacheManager) -> Request:
    """A request computed far enough (five blocks, a window of two) that
    its window group's first blocks are the null block."""
    req = request("windowed", list(range(1, 5 * BLOCK + 1)))
    schedule(m, req, 3 * BLOCK)
    schedule(m, req, 2 * BLOCK - 1)
    swa = m.coordinator.single_type_managers[1].req_to_blocks[req.request_id]
    assert swa[0].is_null
    return req


def test_a_window_past_its_skipped_prefix_writes_no_null_block(adapter: Any, found: list[Any]) -> None:
    m = hybrid_manager()
    req = windowed_past_its_first_blocks(m)
    schedule(m, req, 1)
    finish(m, req)
    assert take(adapter, found) == []


def test_a_step_writing_positions_whose_block_is_null_is_caught(
    adapter: Any, found: list[Any], monkeypatch: pytest.MonkeyPatch
) -> None:
    # A window that lets go of the block the step still writes (one token
    # too many skipped): the step's KV for that position goes to vLLM's
    # null block, the page every skipped or padded position names and that
    # attention takes to hold zeros.
    from vllm.v1.core.single_type_kv_cache_manager import SlidingWindowManager

    monkeypatch.setattr(SlidingWindowManager, "get_num_skipped_tokens", lambda self, n: n + 1 if n else 0)
    m = hybrid_manager()
    req = request("windowed", list(range(1, 5 * BLOCK + 1)))
    schedule(m, req, 3 * BLOCK - 1)
    schedule(m, req, 1)
    kinds = take(adapter, found)
    # The write, and the step's attention then reading the position back.
    assert kinds == ["foreign-write", "foreign-read"], found
    assert all("null block" in f.what and f.block == m.block_pool.null_block.block_id for f in found)


def test_a_window_that_lets_go_of_a_block_its_attention_still_reads_is_caught(
    adapter: Any, found: list[Any], monkeypatch: pytest.MonkeyPatch
) -> None:
    # A window that skips one block too many once it is past its first
    # window: the block is freed and its entries become the null block,
    # while the next query's window still covers its last tokens.
    from vllm.v1.core.single_type_kv_cache_manager import SlidingWindowManager

    def one_block_early(self: Any, n: int) -> int:
        return n - self.sliding_window + 1 + BLOCK if n >= self.sliding_window else 0

    monkeypatch.setattr(SlidingWindowManager, "get_num_skipped_tokens", one_block_early)
    m = hybrid_manager()
    req = windowed_past_its_first_blocks(m)
    schedule(m, req, 1)
    assert set(take(adapter, found)) == {"foreign-read"}, found
    assert all("null block in its window" in f.what for f in found)


def test_a_window_block_registered_before_its_step_writes_it_is_caught(
    adapter: Any, found: list[Any], monkeypatch: pytest.MonkeyPatch
) -> None:
    # #37152's class in a hybrid pool: the sliding-window group's blocks
    # are checked slot by slot too, so the half-written window block is
    # caught beside the full-attention group's.
    m = hybrid_manager()
    real = m.coordinator.cache_blocks
    monkeypatch.setattr(m.coordinator, "cache_blocks", lambda req, n: real(req, req.num_tokens))
    a = request("a", PROMPT)
    schedule(m, a, 20)
    assert take(adapter, found) == ["unwritten-share", "unwritten-share"], found
    window = m.coordinator.single_type_managers[1].req_to_blocks["a"][1].block_id
    assert window in {f.block for f in found}


def chunked_manager(num_blocks: int = 24, chunk: int = 2 * BLOCK) -> KVCacheManager:
    """A full-attention group and a chunked local attention group."""
    from vllm.v1.kv_cache_interface import ChunkedLocalAttentionSpec

    local = ChunkedLocalAttentionSpec(
        block_size=BLOCK, num_kv_heads=1, head_size=1, dtype=torch.float32, attention_chunk_size=chunk
    )
    return with_full_attention("local", local, num_blocks)


def test_chunked_local_attention_is_checked_slot_by_slot_and_a_clean_run_passes(adapter: Any, found: list[Any]) -> None:
    m = chunked_manager()
    req = request("local", list(range(1, 5 * BLOCK + 1)))
    for n in (3 * BLOCK, BLOCK, 1, BLOCK - 1, 1):
        schedule(m, req, n)
    local = m.coordinator.single_type_managers[1].req_to_blocks[req.request_id]
    assert local[0].is_null and not local[-1].is_null
    finish(m, req)
    assert take(adapter, found) == []


def test_a_local_chunk_freed_while_its_queries_still_read_it_is_caught(
    adapter: Any, found: list[Any], monkeypatch: pytest.MonkeyPatch
) -> None:
    # Chunked local attention that lets go of every block before the
    # current one: the current chunk's first block goes while the chunk's
    # later queries still attend to it.
    from vllm.v1.core.single_type_kv_cache_manager import ChunkedLocalAttentionManager

    monkeypatch.setattr(ChunkedLocalAttentionManager, "get_num_skipped_tokens", lambda self, n: n // BLOCK * BLOCK)
    m = chunked_manager()
    req = request("local", list(range(1, 5 * BLOCK + 1)))
    schedule(m, req, 3 * BLOCK)
    schedule(m, req, 1)
    assert "foreign-read" in take(adapter, found), found


def mamba_manager(num_blocks: int = 32) -> KVCacheManager:
    """A full-attention group and a Mamba state group on one pool, as
    vLLM's hybrid Mamba models have (state blocks at block boundaries,
    the null block elsewhere)."""
    from vllm.v1.kv_cache_interface import MambaSpec

    state = MambaSpec(block_size=BLOCK, shapes=((1, 1),), dtypes=(torch.float32,), mamba_cache_mode="align")
    return with_full_attention("mamba", state, num_blocks)


def test_a_pool_with_mamba_state_groups_is_checked_and_a_clean_run_passes(adapter: Any, found: list[Any]) -> None:
    before = (adapter.checked_pools, dict(adapter.unchecked_pools))
    m = mamba_manager()
    a = request("a", PROMPT)
    schedule(m, a, 20)
    schedule(m, a)
    b = request("b", [5] * 50)
    schedule(m, b, 24)
    schedule(m, b)
    finish(m, a)
    finish(m, b)
    assert (adapter.checked_pools, adapter.unchecked_pools) == (before[0] + 1, before[1])
    assert take(adapter, found) == []


def test_a_mamba_state_block_freed_twice_is_caught(adapter: Any, found: list[Any]) -> None:
    m = mamba_manager()
    a = request("a", PROMPT)
    schedule(m, a)
    states = [blk for blk in m.coordinator.single_type_managers[1].req_to_blocks["a"] if not blk.is_null]
    assert states
    finish(m, a)
    m.block_pool.free_blocks(states[-1:])  # a retired state block freed again
    assert take(adapter, found) == ["double-free"]


def test_a_block_its_caller_took_for_a_request_is_that_requests(adapter: Any, found: list[Any]) -> None:
    # vLLM's own manager tests take blocks from the pool themselves and
    # hand them to a request's table; the request then lets them go.
    m = manager()
    (blk,) = m.block_pool.get_new_blocks(1)
    group = m.coordinator.single_type_managers[0]
    group.req_to_blocks["r"] = [blk]
    group.free("r")
    assert take(adapter, found) == []
    # The neighbour: a block another request took in its own call, let go
    # of by a request it was never given to.
    a = request("a", PROMPT)
    schedule(m, a)
    group.req_to_blocks["r"] = group.req_to_blocks["a"][-1:]
    group.free("r")
    assert "foreign-free" in take(adapter, found)


def test_without_the_model_runner_the_scheduler_side_is_still_attached(monkeypatch: pytest.MonkeyPatch) -> None:
    import sys

    import vllm.v1.worker

    # A vLLM build or platform whose model runner does not import.
    monkeypatch.setitem(sys.modules, "vllm.v1.worker.gpu_model_runner", None)
    monkeypatch.delattr(vllm.v1.worker, "gpu_model_runner", raising=False)
    a = kvsan.vllm.Adapter(kvsan.attach())
    a.attach()
    try:
        [reason] = a.unchecked_steps
        assert reason.startswith("the model runner did not import (ModuleNotFoundError: ")
        m = manager()
        r = request("r", PROMPT)
        schedule(m, r)
        finish(m, r)
        assert a.events > 0 and a.violations == []
    finally:
        a.detach()
