"""The disaggregation harness on plain SGLang (no kvsan): what each release's
prefill and decode queues do with a clean transfer, an abort, an oversize
prompt rejected at the prefill node's intake, and a transfer cut short.

Runs on the release the path selects (``PYTHONPATH=target/sglang/<version>``,
see ``scripts/sglang-releases``); skipped where SGLang's disaggregation
modules do not import.
"""

from __future__ import annotations

from collections.abc import Iterator

import pytest

pytest.importorskip("sglang.srt.disaggregation.decode")

import torch  # noqa: E402
from sglang.srt.managers.schedule_batch import FINISH_ABORT, Req  # noqa: E402
from sglang.srt.model_executor.forward_batch_info import ForwardMode  # noqa: E402

from .harness import DOOR_CHECK, RELEASE, Harness, reject_at_intake  # noqa: E402

SHARED = list(range(101, 117))  # a 16-token prefix two prompts share


@pytest.fixture
def pd() -> Iterator[Harness]:
    with Harness() as h:
        yield h


def raw(t: torch.Tensor) -> bytes:
    return t.contiguous().view(torch.uint8).numpy().tobytes()


def same_kv(pd: Harness, slots: list[int], tokens: list[int], start: int = 0) -> bool:
    """The decode pool's K and V at ``slots`` are, byte for byte, what the
    prefill node computed for ``tokens`` at positions ``start`` on (one
    slot per token), stored in the pool's dtype."""
    dtype = pd.decode.kv_pool.dtype
    got = pd.decode.kv_of_slots(slots)
    want = pd.prefill.expected_kv(tokens)
    end = start + len(slots)
    return all(
        raw(g) == raw(w[start:end].to(dtype)) for (gk, gv), (wk, wv) in zip(got, want) for g, w in ((gk, wk), (gv, wv))
    )


def pools_idle(pd: Harness) -> None:
    """Both nodes hold nothing for a request any more: every decode slot
    and row free, every prefill row free (its slots are the radix cache's
    or free), no metadata buffer taken, no queue holding a request."""
    p, d = pd.prefill, pd.decode
    assert d.allocator.available_size() == d.max_total_num_tokens - _decode_running_slots(pd)
    assert (
        p.allocator.available_size() + p.tree_cache.evictable_size() + p.tree_cache.protected_size()
        == p.max_total_num_tokens
    )
    assert p.req_to_token_pool.available_size() == p.req_to_token_pool.size
    assert p.metadata_allocator.available_size() == p.metadata_allocator.size
    assert d.metadata_allocator.available_size() == d.metadata_allocator.size
    assert not p.bootstrap_queue.queue and not p.waiting_queue and not p.inflight_queue
    assert not d.prealloc_queue.queue and not d.transfer_queue.queue


def _decode_running_slots(pd: Harness) -> int:
    return sum(len(r.origin_input_ids) + len(r.output_ids) - 1 for r in pd.decode.running)


def prefill_and_send(pd: Harness, rid: str, tokens: list[int], room: int) -> tuple[Req, Req]:
    """One request through both doors, preallocated on decode, prefilled
    and sent: what decode's next ``pop_transferred`` finds."""
    p_req, d_req = pd.make_reqs(rid, tokens, room)
    assert pd.decode.intake(d_req) and pd.prefill.intake(p_req)
    pd.decode.pop_preallocated()
    pd.prefill.pop_bootstrapped()
    pd.prefill.prefill([p_req])
    assert pd.prefill.process_inflight_queue() == [p_req]
    return p_req, d_req


def test_release_is_selected():
    import sglang

    assert sglang.__version__ == RELEASE


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_clean_flow(dtype: torch.dtype):
    """Three requests, two sharing a prefix on the prefill node: each is
    preallocated on decode, bootstrapped, prefilled (the second reusing the
    first's cached prefix), sent, committed on decode with a row whose
    pages hold exactly what prefill computed; then one decode step."""
    with Harness(prefill={"dtype": dtype}, decode={"dtype": dtype}) as pd:
        clean_flow(pd)


def clean_flow(pd: Harness) -> None:
    prompts = {
        "a": SHARED + [1, 2, 3],
        "b": SHARED + [4, 5, 6, 7, 8],
        "c": [9, 8, 7, 6, 5],
    }
    reqs = {rid: pd.make_reqs(rid, tokens, room) for room, (rid, tokens) in enumerate(prompts.items(), start=1)}
    for p_req, d_req in reqs.values():
        assert pd.decode.intake(d_req)
        assert pd.prefill.intake(p_req)
    assert len(pd.decode.pop_preallocated()) == 3
    for rid, (_, d_req) in reqs.items():
        assert len(pd.transport.channels[d_req.bootstrap_room].dst_pages) == len(prompts[rid])
    assert len(pd.prefill.pop_bootstrapped()) == 3

    a, b, c = (reqs[rid][0] for rid in "abc")
    fb = pd.prefill.prefill([a])
    assert fb.forward_mode == ForwardMode.EXTEND
    assert fb.seq_lens.tolist() == [len(prompts["a"])]
    fb = pd.prefill.prefill([b, c])
    # b's forward stored only what the radix cache did not have
    assert fb.extend_prefix_lens_cpu == [len(SHARED), 0]
    assert fb.out_cache_loc.numel() == (len(prompts["b"]) - len(SHARED)) + len(prompts["c"])
    assert pd.prefill.row(b)[: len(SHARED)] == pd.prefill.row(a)[: len(SHARED)]

    done = pd.prefill.process_inflight_queue()
    assert {r.rid for r in done} == set(prompts)
    assert all(not isinstance(r.finished_reason, FINISH_ABORT) for r in done)
    committed = pd.decode.pop_transferred()
    assert {r.rid for r in committed} == set(prompts)
    for rid, (_, d_req) in reqs.items():
        n = len(prompts[rid])
        ch = pd.transport.channels[d_req.bootstrap_room]
        assert ch.landed == len(ch.sent_pages) == n
        assert same_kv(pd, pd.decode.row(d_req, n), prompts[rid])
        # the metadata came with the last chunk: prefill's token, its cache hit
        assert list(d_req.output_ids) == [7]
        assert d_req.cached_tokens == (len(SHARED) if rid == "b" else 0)

    fb = pd.decode.decode()
    assert fb.forward_mode == ForwardMode.DECODE
    d_reqs = [reqs[rid][1] for rid in prompts]
    assert fb.seq_lens.tolist() == [len(prompts[rid]) + 1 for rid in prompts]
    assert fb.out_cache_loc.tolist() == [pd.decode.row(r, len(r.origin_input_ids) + 1)[-1] for r in d_reqs]
    pools_idle(pd)


def test_decode_abort_during_transfer(pd: Harness):
    """A request aborted on the decode node while its transfer is pending:
    the transfer queue reports it failed and SGLang releases its row and
    slots; nothing is committed, and the prefill node, told by its sender,
    drops it too."""
    p_req, d_req = pd.make_reqs("x", SHARED, 7)
    assert pd.decode.intake(d_req) and pd.prefill.intake(p_req)
    assert len(pd.decode.pop_preallocated()) == 1
    assert pd.decode.allocator.available_size() == pd.decode.max_total_num_tokens - len(SHARED)
    pd.decode.abort("x")
    assert pd.decode.pop_transferred() == []
    assert isinstance(d_req.finished_reason, FINISH_ABORT)
    assert pd.prefill.pop_bootstrapped() == []
    assert isinstance(p_req.finished_reason, FINISH_ABORT)
    assert pd.transport.channels[7].sent_pages == []
    pools_idle(pd)


def test_prefill_abort_during_transfer(pd: Harness):
    """A request aborted on the prefill node after its prefill, while the
    decode node waits for its KV: the sender's abort fails the transfer, the
    decode transfer queue releases the row and slots, nothing committed."""
    tokens = SHARED + [1, 2]
    p_req, d_req = pd.make_reqs("y", tokens, 8)
    assert pd.decode.intake(d_req) and pd.prefill.intake(p_req)
    pd.decode.pop_preallocated()
    pd.prefill.pop_bootstrapped()
    pd.transport.drop_last_pages = len(tokens)  # nothing lands before the abort
    pd.prefill.prefill()
    pd.prefill.abort("y")
    done = pd.prefill.process_inflight_queue()
    assert done == [p_req] and isinstance(p_req.finished_reason, FINISH_ABORT)
    assert pd.decode.pop_transferred() == []
    assert isinstance(d_req.finished_reason, FINISH_ABORT)
    pools_idle(pd)


def test_oversize_prompt_rejected_at_prefill_intake(pd: Harness):
    """The incident: the prefill node's limit is below the prompt (its
    intake makes the request the one-token stub), the decode node's is above
    it (decode admits and preallocates the whole prompt)."""
    tokens = list(range(1, 25))  # 24 tokens: prefill takes 16, decode 256
    p_req, d_req = pd.make_reqs("big", tokens, 9)
    assert reject_at_intake(p_req, 16) is not None
    assert list(p_req.origin_input_ids) == [0] and isinstance(p_req.to_finish, FINISH_ABORT)
    assert reject_at_intake(d_req, 256) is None

    assert pd.decode.intake(d_req)
    assert len(pd.decode.pop_preallocated()) == 1
    assert len(pd.transport.channels[9].dst_pages) == len(tokens)  # the whole prompt
    kept = pd.prefill.intake(p_req)
    ch = pd.transport.channels[9]
    if DOOR_CHECK:
        # 0.5.22, 0.5.23: PrefillBootstrapQueue.add sees is_unadmitted_reject
        # and calls Scheduler.retire_unadmitted_request: no sender, no queue.
        assert not kept
        assert pd.prefill.scheduler.retired == [p_req]
        assert getattr(p_req, "disagg_kv_sender", None) is None
        assert isinstance(p_req.finished_reason, FINISH_ABORT) and p_req.to_finish is None
        assert pd.prefill.pop_bootstrapped() == []
    else:
        # 0.5.20: the stub passes the door (a sender, the bootstrap queue),
        # bootstraps for one page and runs its one-token prefill; then
        # process_batch_result_disagg_prefill finds it aborted (to_finish)
        # and _retire_aborted_prefill_result aborts its sender: nothing sent.
        assert kept and p_req.disagg_kv_sender is not None
        assert pd.prefill.pop_bootstrapped() == [p_req]
        fb = pd.prefill.prefill()
        assert fb.seq_lens.tolist() == [1]
        assert isinstance(p_req.finished_reason, FINISH_ABORT)
        assert ch.sender_failed
        assert pd.prefill.inflight_queue == []
    assert ch.sent_pages == [] and ch.landed == 0
    # decode, told the transfer failed, releases the preallocated prompt
    assert pd.decode.pop_transferred() == []
    assert isinstance(d_req.finished_reason, FINISH_ABORT)
    pools_idle(pd)


def test_short_transfer_is_committed(pd: Harness):
    """A transfer the backend reports complete although its last page never
    landed: decode commits the request all the same, its row pointing at a
    page that holds no KV of this request (all three releases)."""
    tokens = SHARED + [1, 2, 3]
    pd.transport.drop_last_pages = 1
    _, d_req = prefill_and_send(pd, "short", tokens, 10)
    assert pd.decode.pop_transferred() == [d_req]
    ch = pd.transport.channels[10]
    assert len(ch.sent_pages) == len(tokens) and ch.landed == len(tokens) - 1
    row = pd.decode.row(d_req, len(tokens))
    assert same_kv(pd, row[:-1], tokens)
    assert not same_kv(pd, row[-1:], tokens, start=len(tokens) - 1)
    fb = pd.decode.decode()
    assert fb.seq_lens.tolist() == [len(tokens) + 1]
    pools_idle(pd)
