"""kvsan.vllm on vLLM's scheduler with a KV connector: a connector's tokens
are written when its load lands, never when their blocks are allocated.

Driven as vLLM's own connector unit tests drive the scheduler (their
helpers, from the release's source tree: ``VLLM_SRC``, set by
``scripts/vllm-tests run``), with a mock connector that answers
``get_num_new_matched_tokens`` and the worker's output that says which
loads finished or failed.
"""

from __future__ import annotations

from typing import Any, Iterator

import pytest
from vllm_support import vllm_test_helpers

vllm_test_helpers("vllm.v1.core.sched.scheduler")

from tests.v1.kv_connector.unit.utils import (  # noqa: E402
    create_mock_connector,
    create_model_runner_output,
    create_request,
    create_scheduler,
    create_vllm_config,
)
from vllm.v1.request import RequestStatus  # noqa: E402

import kvsan.vllm  # noqa: E402

LOADED_BLOCKS = 2


@pytest.fixture
def adapter() -> Iterator[kvsan.vllm.Adapter]:
    a = kvsan.vllm.attach()
    a.take_violations()
    yield a
    a.detach()


def kinds(adapter: kvsan.vllm.Adapter) -> list[str]:
    return [f.kind for f in adapter.take_violations()]


def loading(policy: str = "recompute") -> tuple[Any, Any]:
    """A scheduler whose connector loads the first ``LOADED_BLOCKS`` blocks
    of request ``A`` asynchronously, and A scheduled: its blocks are
    allocated and it waits for the load."""
    scheduler = create_scheduler(create_vllm_config(kv_load_failure_policy=policy))
    block = scheduler.block_size
    a = create_request(request_id=1, num_tokens=3 * block)
    scheduler.add_request(a)
    scheduler.connector = create_mock_connector()
    scheduler.connector.get_loaded_kv_cache_group_ids.return_value = (0,)
    scheduler.connector.request_finished.return_value = (False, None)
    scheduler.connector.take_events.return_value = ()
    answers = {a.request_id: LOADED_BLOCKS * block}
    scheduler.connector.get_num_new_matched_tokens.side_effect = lambda r, _n: (
        (answers.pop(r.request_id), True) if r.request_id in answers else (0, False)
    )
    out = scheduler.schedule()
    assert a.status == RequestStatus.WAITING_FOR_REMOTE_KVS
    scheduler.update_from_output(out, create_model_runner_output([]))
    return scheduler, a


def land(scheduler: Any, a: Any, invalid: set[int] | None = None) -> None:
    """The worker reports A's load over (with ``invalid`` blocks failed)."""
    out = scheduler.schedule()
    runner = create_model_runner_output([], finished_recving={a.request_id}, invalid_block_ids=invalid)
    scheduler.update_from_output(out, runner)


def block_ids(scheduler: Any, a: Any) -> list[int]:
    return [b.block_id for b in scheduler.kv_cache_manager.coordinator.single_type_managers[0].req_to_blocks[a.request_id]]


def hit_by_a_second_request(scheduler: Any, a: Any) -> int:
    """Tokens a request with A's prompt finds in the prefix cache."""
    b = create_request(request_id=1, num_tokens=a.num_prompt_tokens)  # A's tokens
    assert b.prompt_token_ids == a.prompt_token_ids
    _, hit, *_ = scheduler.kv_cache_manager.get_computed_blocks(b)
    return hit


def test_a_load_that_lands_is_written_and_its_blocks_are_shared_cleanly(adapter: Any) -> None:
    scheduler, a = loading()
    land(scheduler, a)
    scheduler.schedule()  # A resumes; vLLM registers the landed blocks
    assert kinds(adapter) == []
    # vLLM registered the loaded blocks once they landed.
    assert hit_by_a_second_request(scheduler, a) == LOADED_BLOCKS * scheduler.block_size
    assert kinds(adapter) == []


def test_loaded_blocks_registered_before_the_load_lands_are_caught(adapter: Any) -> None:
    # The class: a connector's blocks put in the prefix cache at allocation
    # (the scheduler's delay_cache_blocks not honoured), so a second request
    # can hit them while they still hold whatever the pool left there.
    scheduler, a = loading()
    scheduler.kv_cache_manager.cache_blocks(a, LOADED_BLOCKS * scheduler.block_size)
    assert kinds(adapter) == ["unwritten-share"] * LOADED_BLOCKS
    assert hit_by_a_second_request(scheduler, a) == LOADED_BLOCKS * scheduler.block_size


def test_after_a_failed_block_only_the_valid_prefix_is_written(adapter: Any) -> None:
    scheduler, a = loading()
    second = block_ids(scheduler, a)[1]
    land(scheduler, a, invalid={second})
    # vLLM keeps the first block (the valid prefix) and recomputes from the
    # second: the clean run reports nothing.
    assert a.num_computed_tokens == scheduler.block_size
    scheduler.schedule()
    assert kinds(adapter) == []


def test_a_failed_block_registered_as_loaded_is_caught(adapter: Any) -> None:
    # The class: a failed load still counted as a hit (dynamo#15079): the
    # block that failed is registered as if it had landed.
    scheduler, a = loading()
    second = block_ids(scheduler, a)[1]
    out = scheduler.schedule()
    runner = create_model_runner_output([], finished_recving={a.request_id}, invalid_block_ids={second})
    scheduler.update_from_output(out, runner)
    real = scheduler._update_waiting_for_remote_kv

    def as_if_loaded(request: Any) -> None:
        request.num_computed_tokens = LOADED_BLOCKS * scheduler.block_size
        real(request)

    scheduler._update_waiting_for_remote_kv = as_if_loaded
    scheduler.schedule()
    assert "unwritten-share" in kinds(adapter)


def test_a_load_abandoned_with_its_request_marks_nothing_written(adapter: Any) -> None:
    scheduler, a = loading()
    scheduler.finish_requests(a.request_id, RequestStatus.FINISHED_ABORTED)
    # The worker's late report of the abandoned load.
    out = scheduler.schedule()
    scheduler.update_from_output(out, create_model_runner_output([], finished_recving={a.request_id}))
    # Nothing is written into blocks the request no longer holds.
    assert kinds(adapter) == []


def producing(num_blocks: int, hand_out: Any = None, others: int = 0, prompt: int = 48) -> tuple[Any, Any]:
    """P/D's prefill side: a pool of ``num_blocks`` blocks, request A
    (``prompt`` tokens: three blocks, one token to produce) computed and finished,
    its blocks handed to a remote reader (the connector delays their free).
    ``hand_out(request, block_ids)``: the connector's ``kv_transfer_params``
    for the reader (default: none, the reader reads A's blocks). ``others``
    requests of one block each run beside A."""
    scheduler = create_scheduler(create_vllm_config(kv_role="kv_producer"), num_blocks=num_blocks)
    scheduler.connector = create_mock_connector()
    scheduler.connector.get_num_new_matched_tokens.return_value = (0, False)
    scheduler.connector.request_finished.side_effect = lambda r, ids: (
        (True, hand_out(r, ids)) if r.request_id == "id-1" else (False, None)
    )
    if hand_out is None:
        scheduler.connector.request_finished.side_effect = None
        scheduler.connector.request_finished.return_value = (True, {"remote": "decode"})
    scheduler.connector.take_events.return_value = ()
    a = create_request(request_id=1, num_tokens=prompt, do_remote_decode=True)
    scheduler.add_request(a)
    beside = [create_request(request_id=10 + i, num_tokens=scheduler.block_size // 2, max_tokens=4) for i in range(others)]
    for r in beside:
        scheduler.add_request(r)
    out = scheduler.schedule()
    scheduler.update_from_output(out, create_model_runner_output([a, *beside]))
    assert a.is_finished() and a.request_id in scheduler.requests  # blocks kept for the reader
    return scheduler, a


def another_request_takes_every_block(scheduler: Any) -> None:
    b = create_request(request_id=7, num_tokens=3 * scheduler.block_size)
    scheduler.add_request(b)
    out = scheduler.schedule()
    assert b.request_id in out.num_scheduled_tokens


def test_blocks_held_for_a_remote_reader_until_it_is_done_pass(adapter: Any) -> None:
    scheduler, a = producing(num_blocks=4)
    out = scheduler.schedule()
    scheduler.update_from_output(out, create_model_runner_output([], finished_sending={a.request_id}))
    assert a.request_id not in scheduler.requests
    another_request_takes_every_block(scheduler)
    assert kinds(adapter) == []


def test_blocks_freed_while_the_remote_reader_still_reads_them_are_caught(adapter: Any) -> None:
    # The delayed-free contract broken: a finished request's blocks go back
    # to the pool while the transfer that reads them is still in flight.
    scheduler, a = producing(num_blocks=4)
    scheduler.kv_cache_manager.free(a)  # without waiting for finished_sending
    another_request_takes_every_block(scheduler)
    assert kinds(adapter) == []  # vLLM's own books balance
    out = scheduler.schedule()
    scheduler.update_from_output(out, create_model_runner_output([], finished_sending={a.request_id}))
    # The request ended when vLLM freed its blocks; the remote read of its
    # KV comes after that, from blocks another request now holds.
    assert kinds(adapter) == ["terminal-request-activity"]


def nixl_params(r: Any, ids: Any) -> dict[str, Any]:
    """What vLLM's NIXL connector hands a remote decoder: the block ids per
    KV cache group and the tokens computed."""
    return {"do_remote_prefill": True, "remote_block_ids": ids, "remote_num_tokens": r.num_computed_tokens}


def send_over(scheduler: Any, a: Any) -> None:
    """A step whose report says the remote reader is done with A."""
    out = scheduler.schedule()
    running = [scheduler.requests[rid] for rid in out.num_scheduled_tokens]
    scheduler.update_from_output(out, create_model_runner_output(running, finished_sending={a.request_id}))


def test_the_blocks_and_tokens_the_connector_hands_out_are_what_is_checked(adapter: Any) -> None:
    scheduler, a = producing(num_blocks=6, hand_out=nixl_params, others=1)
    send_over(scheduler, a)
    assert kinds(adapter) == []


def test_a_block_handed_out_that_the_request_does_not_hold_is_caught(adapter: Any) -> None:
    # The connector's block list is off: its last entry is the block of the
    # request running beside A.
    def off(r: Any, ids: Any) -> dict[str, Any]:
        return nixl_params(r, [*ids[:-1], ids[-1] + 1])

    scheduler, a = producing(num_blocks=6, hand_out=off, others=1)
    beside = scheduler.kv_cache_manager.coordinator.single_type_managers[0].req_to_blocks["id-10"]
    assert [b.block_id for b in beside] == [block_ids(scheduler, a)[-1] + 1]
    send_over(scheduler, a)
    assert kinds(adapter) == ["foreign-read"]


def test_tokens_handed_out_beyond_those_computed_are_caught(adapter: Any) -> None:
    # The reader is told of one token more than A's KV holds: it reads a
    # slot of A's last block that A never wrote.
    def long(r: Any, ids: Any) -> dict[str, Any]:
        return nixl_params(r, ids) | {"remote_num_tokens": r.num_computed_tokens + 1}

    scheduler, a = producing(num_blocks=6, hand_out=long, prompt=44)
    send_over(scheduler, a)
    assert kinds(adapter) == ["stale-read"]


# ---- a finished request's blocks freed while a step still writes them ----


def async_consumer(defer: bool, load_async: bool = True) -> tuple[Any, Any, Any, Any, list[int]]:
    """An asynchronously scheduling consumer with room for three blocks:
    request A's prefill (three blocks) and a decode step over-scheduled
    behind it, then A stops on its prefill's token while the decode step
    is still in flight. ``defer`` is vLLM's fix (PR #45357): the return of
    A's blocks waits for the in-flight step's output. Returns the
    scheduler, A, B (a remote prefill of two blocks, not yet scheduled),
    the decode step and A's blocks. ``load_async``: B's load lands after
    the step that allocates it, else within it."""
    config = create_vllm_config()
    config.scheduler_config.async_scheduling = True
    scheduler = create_scheduler(config, num_blocks=4)
    scheduler.defer_block_free = defer
    scheduler.connector = create_mock_connector()
    scheduler.connector.get_loaded_kv_cache_group_ids.return_value = (0,)
    scheduler.connector.request_finished.return_value = (False, None)
    scheduler.connector.take_events.return_value = ()
    block = scheduler.block_size
    b_id = "id-2"
    scheduler.connector.get_num_new_matched_tokens.side_effect = lambda r, _n: (
        (2 * block, load_async) if r.request_id == b_id and r.num_computed_tokens == 0 else (0, False)
    )
    a = create_request(request_id=1, num_tokens=2 * block + 1, max_tokens=5)
    scheduler.add_request(a)
    prefill = scheduler.schedule()
    decode = scheduler.schedule()
    assert decode.num_scheduled_tokens[a.request_id] == 1
    a_blocks = block_ids(scheduler, a)
    scheduler.update_from_output(prefill, create_model_runner_output([a], use_eos=True))
    assert a.is_finished()
    b = create_request(request_id=2, num_tokens=2 * block + 1, do_remote_prefill=True)
    assert b.request_id == b_id
    scheduler.add_request(b)
    return scheduler, a, b, decode, a_blocks


@pytest.mark.parametrize("load_async", [True, False], ids=["async-load", "sync-load"])
def test_blocks_freed_while_a_step_still_writes_them_and_loaded_into_are_caught(adapter: Any, load_async: bool) -> None:
    scheduler, a, b, decode, a_blocks = async_consumer(defer=False, load_async=load_async)
    scheduler.schedule()
    # B's load was given A's last block while A's decode step may still
    # write it.
    assert b.status == (RequestStatus.WAITING_FOR_REMOTE_KVS if load_async else RequestStatus.RUNNING)
    assert a_blocks[-1] in block_ids(scheduler, b)
    found = adapter.take_violations()
    assert [f.kind for f in found] == ["generation-mismatch"], found
    assert "still in flight" in found[0].what and found[0].request == a.request_id
    scheduler.update_from_output(decode, create_model_runner_output([]))
    assert kinds(adapter) == []


def test_blocks_whose_free_waits_for_the_in_flight_step_pass(adapter: Any) -> None:
    scheduler, a, b, decode, a_blocks = async_consumer(defer=True)
    scheduler.schedule()
    # No block is free until the decode step's output is processed.
    assert block_ids_or_none(scheduler, b) == []
    scheduler.update_from_output(decode, create_model_runner_output([]))
    out = scheduler.schedule()
    assert b.status == RequestStatus.WAITING_FOR_REMOTE_KVS
    assert a_blocks[-1] in block_ids(scheduler, b)
    scheduler.update_from_output(out, create_model_runner_output([], finished_recving={b.request_id}))
    assert kinds(adapter) == []


def test_freed_blocks_the_next_request_computes_into_itself_pass(adapter: Any) -> None:
    """Without a connector load the next owner's writes follow the stale
    one on the same stream: vLLM frees at once, and so may it."""
    scheduler, a, b, decode, a_blocks = async_consumer(defer=False)
    scheduler.connector.get_num_new_matched_tokens.side_effect = lambda r, _n: (0, False)
    scheduler.schedule()
    assert a_blocks[-1] in block_ids(scheduler, b)
    assert kinds(adapter) == []


def block_ids_or_none(scheduler: Any, r: Any) -> list[int]:
    blocks = scheduler.kv_cache_manager.coordinator.single_type_managers[0].req_to_blocks.get(r.request_id)
    return [blk.block_id for blk in blocks or []]
