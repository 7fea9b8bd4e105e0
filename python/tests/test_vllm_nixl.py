"""kvsan.vllm on vLLM's P/D path through its NIXL connector: the READs a
decode engine's worker posts, checked at the descriptors NIXL is given.

Two vLLM engines in one process, each a real scheduler and a real NIXL
connector worker (``NixlConnector``, worker role) whose KV caches are CPU
tensors registered by vLLM's own ``register_kv_caches``: a prefill engine
computes a request's KV (its "forward" fills the request's blocks with
the request's mark) and hands the blocks out; a decode engine pulls them
with vLLM's worker (``start_load_kv``, ``_read_blocks``) and goes on
decoding. NIXL itself is an agent in this file that does what NIXL does
between two processes: it prepares descriptor lists, and a READ copies the
bytes the descriptors name (``ctypes.memmove``) and delivers the
notification to the producer's agent, whose worker then reports the send
over. So what lands in the decode engine's KV cache is what vLLM's
descriptors really named.
"""

from __future__ import annotations

import ctypes
import time
from collections import defaultdict
from typing import Any, Iterator

import pytest
from vllm_support import gloo_group, vllm_test_helpers

vllm_test_helpers("vllm.distributed.kv_transfer.kv_connector.v1.nixl")

import msgspec  # noqa: E402
import numpy as np  # noqa: E402
import torch  # noqa: E402

from tests.v1.attention.utils import dense_kv_cache_views  # noqa: E402
from tests.v1.kv_connector.unit.utils import (  # noqa: E402
    create_model_runner_output,
    create_request,
    create_scheduler,
    create_vllm_config,
)
from vllm.config import set_current_vllm_config  # noqa: E402
from vllm.distributed.kv_transfer.kv_connector.v1.base import KVConnectorRole  # noqa: E402
from vllm.distributed.kv_transfer.kv_connector.v1.nixl import NixlConnector  # noqa: E402
from vllm.distributed.kv_transfer.kv_connector.v1.nixl import base_worker  # noqa: E402
from vllm.distributed.kv_transfer.kv_connector.v1.nixl.metadata import NixlAgentMetadata  # noqa: E402
from vllm.forward_context import ForwardContext  # noqa: E402
from vllm.v1.kv_cache_interface import (  # noqa: E402
    FullAttentionSpec,
    KVCacheConfig,
    KVCacheGroupSpec,
    KVCacheLayout,
)
from vllm.v1.request import RequestStatus  # noqa: E402

import kvsan.vllm  # noqa: E402

# vLLM's CPU attention backend takes block sizes in multiples of 32.
BLOCK = 32
BLOCKS = 8
PROMPT = 70  # three blocks of 32, the last one partly filled


class Agent:
    """NIXL between the engines of this process: prepared descriptor lists,
    READs that copy the bytes they name, notifications to the peer."""

    agents: dict[str, "Agent"] = {}

    def __init__(self, name: str, *args: Any, **kwargs: Any) -> None:
        self.name = name
        Agent.agents[name] = self
        self.dlists: dict[int, list[tuple[int, int]]] = {}
        self.xfers: dict[int, tuple[str, int, list[int], int, list[int], bytes | None]] = {}
        self.notifs: defaultdict[str, list[bytes]] = defaultdict(list)
        self.handles = 0

    def _handle(self) -> int:
        self.handles += 1
        return self.handles

    def get_reg_descs(self, data: Any, mem: str) -> Any:
        return list(data)

    def register_memory(self, descs: Any, backends: Any = None) -> None:
        pass

    def deregister_memory(self, descs: Any) -> None:
        pass

    def get_xfer_descs(self, data: Any, mem: str) -> Any:
        return data

    def prep_xfer_dlist(self, agent: str, descs: Any, mem_type: str | None = None, **kw: Any) -> int:
        rows = []
        for addr, length, _dev, stride, count in np.asarray(descs, dtype=np.uint64).reshape(-1, 5).tolist():
            rows += [(addr + j * stride, length) for j in range(count)]
        h = self._handle()
        self.dlists[h] = rows
        return h

    def get_agent_metadata(self) -> bytes:
        return self.name.encode()

    def add_remote_agent(self, meta: bytes) -> str:
        return meta.decode()

    def remove_remote_agent(self, agent: str) -> None:
        pass

    def check_remote_metadata(self, agent: str) -> bool:
        return True

    def make_prepped_xfer(self, op: str, local: int, local_ids: Any, remote: int, remote_ids: Any, notif_msg: bytes | None = None, **kw: Any) -> int:
        h = self._handle()
        self.xfers[h] = (op, local, list(local_ids), remote, list(remote_ids), notif_msg)
        return h

    def transfer(self, h: int) -> str:
        op, local, local_ids, remote, remote_ids, notif = self.xfers[h]
        assert op == "READ"
        for lid, rid in zip(local_ids, remote_ids):
            (dst, n), (src, m) = self.dlists[local][lid], self.dlists[remote][rid]
            assert n == m, "a READ between descriptors of different lengths"
            ctypes.memmove(dst, src, n)
        if notif is not None:
            for agent in Agent.agents.values():
                if agent is not self:
                    agent.notifs[self.name].append(notif)
        return "PROC"

    def check_xfer_state(self, h: int) -> str:
        return "DONE"

    def release_xfer_handle(self, h: int) -> None:
        pass

    def release_dlist_handle(self, h: int) -> None:
        pass

    def send_notif(self, agent: str, notif_msg: bytes) -> None:
        Agent.agents[agent].notifs[self.name].append(notif_msg)

    def get_new_notifs(self) -> dict[str, list[bytes]]:
        out = dict(self.notifs)
        self.notifs.clear()
        return out

    def get_xfer_telemetry(self, h: int) -> Any:
        _, _, ids, _, _, _ = self.xfers[h]
        return Telemetry(xferDuration=1.0, postDuration=1.0, totalBytes=sum(self.dlists[self.xfers[h][1]][i][1] for i in ids), descCount=len(ids))


class Telemetry(dict):
    """NIXL's transfer telemetry (read as attributes)."""

    __getattr__ = dict.__getitem__


@pytest.fixture(scope="module")
def distributed() -> Iterator[None]:
    with gloo_group(create_vllm_config(block_size=BLOCK)):
        yield


@pytest.fixture
def adapter(distributed: None, monkeypatch: pytest.MonkeyPatch) -> Iterator[kvsan.vllm.Adapter]:
    monkeypatch.setattr(base_worker, "NixlWrapper", Agent)
    a = kvsan.vllm.attach()
    a.take_violations()
    yield a
    a.detach()
    Agent.agents.clear()


CTX = ForwardContext(no_compile_layers={}, attn_metadata={}, slot_mapping={})


class Engine:
    """One vLLM engine: its scheduler, its NIXL connector worker, its KV."""

    def __init__(self, role: str, block: int = BLOCK, blocks: int = BLOCKS) -> None:
        self.config = create_vllm_config(block_size=block, kv_role=role, max_num_batched_tokens=1024)
        spec = FullAttentionSpec(block_size=block, num_kv_heads=2, head_size=16, dtype=torch.float16)
        kv = KVCacheConfig(num_blocks=blocks, kv_cache_tensors=[], kv_cache_groups=[KVCacheGroupSpec(["layer0", "layer1"], spec)])
        self.scheduler = create_scheduler(self.config, num_blocks=blocks, kv_cache_config=kv)
        with set_current_vllm_config(self.config):
            self.connector = NixlConnector(self.config, KVConnectorRole.WORKER, kv)
            self.raw = torch.zeros(spec.page_size_bytes * blocks * 2, dtype=torch.int8)
            self.caches = dense_kv_cache_views(self.raw, spec, blocks, num_layers=2, layout=KVCacheLayout.LBNHC)
            self.connector.register_kv_caches(dict(zip(("layer0", "layer1"), self.caches)))
        self.worker = self.connector.connector_worker

    def metadata(self) -> NixlAgentMetadata:
        payload = self.worker.xfer_handshake_metadata.agent_metadata_bytes
        return msgspec.msgpack.Decoder(NixlAgentMetadata).decode(payload)

    def pairs_with(self, producer: "Engine") -> None:
        """The handshake (vLLM's goes over ZMQ): the producer's metadata."""
        meta = producer.metadata()
        self.worker._nixl_handshake = lambda *a, **kw: ({(0, 0): self.worker.add_remote_agent(meta, 0, 1)}, 0.0)

    def blocks(self, rid: str) -> list[int]:
        manager = self.scheduler.kv_cache_manager.coordinator.single_type_managers[0]
        return [b.block_id for b in manager.req_to_blocks.get(rid) or []]

    def mark(self, block: int) -> int:
        """The byte a block holds (the mark of the request that wrote it)."""
        return int(self.caches[0][block].flatten()[0])

    def step(self) -> Any:
        """One step: the worker's connector work and, on the prefill engine,
        the "forward" (each request the step computes writes its mark into
        its blocks), then the worker's report back to the scheduler."""
        out = self.scheduler.schedule()
        self.connector.bind_connector_metadata(out.kv_connector_metadata)
        self.connector.start_load_kv(CTX)
        for rid in out.num_scheduled_tokens if self.config.kv_transfer_config.kv_role == "kv_producer" else ():
            for b in self.blocks(rid):
                for cache in self.caches:
                    cache[b].fill_(MARKS.setdefault(rid, len(MARKS) + 1))
        self.connector.wait_for_save()
        sending, recving = self.connector.get_finished(set())
        deadline = time.monotonic() + 10
        while out.kv_connector_metadata.reqs_to_recv and not recving and time.monotonic() < deadline:
            # vLLM's handshake runs on a thread: its READs are posted on a
            # later call, as in vLLM's own asynchronous load tests.
            time.sleep(0.05)
            self.connector.bind_connector_metadata(type(out.kv_connector_metadata)())
            self.connector.start_load_kv(CTX)
            more_sending, recving = self.connector.get_finished(set())
            sending |= more_sending
        self.connector.clear_connector_metadata()
        reqs = [self.scheduler.requests[r] for r in out.num_scheduled_tokens]
        runner = create_model_runner_output(reqs, finished_sending=sending or None, finished_recving=recving or None)
        return self.scheduler.update_from_output(out, runner)


MARKS: dict[str, int] = {}


def prefill(p: Engine, request_id: int, tokens: int = PROMPT) -> dict[str, Any]:
    """The prefill engine computes a request for a remote decode and hands
    its blocks out: the ``kv_transfer_params`` it returns."""
    a = create_request(request_id=request_id, num_tokens=tokens, do_remote_decode=True, block_size=p.config.cache_config.block_size)
    p.scheduler.add_request(a)
    outputs = p.step()
    assert a.status == RequestStatus.FINISHED_LENGTH_CAPPED
    return next(o.kv_transfer_params for v in outputs.values() for o in v.outputs)


def decode(d: Engine, name: str, params: dict[str, Any], request_id: int, tokens: int = PROMPT) -> Any:
    """The decode engine takes a request (the prompt of the prefill's
    ``request_id``) with the prefill's params, loads its KV and decodes one
    token."""
    r = create_request(request_id=request_id, num_tokens=tokens, do_remote_prefill=True, block_size=d.config.cache_config.block_size)
    r.request_id = name
    r.kv_transfer_params = dict(params, do_remote_prefill=True, do_remote_decode=False)
    d.scheduler.add_request(r)
    d.step()  # the load is posted and lands
    d.step()  # the request resumes and decodes
    return r


def finish_send(p: Engine) -> None:
    """The producer's worker hears the reader's notification: the send is
    over and vLLM frees the blocks."""
    p.step()


def kinds(adapter: kvsan.vllm.Adapter) -> list[str]:
    return sorted({f.kind for f in adapter.take_violations()})


def test_a_remote_prefill_pulled_by_nixl_is_checked_and_clean(adapter: kvsan.vllm.Adapter) -> None:
    p, d = Engine("kv_producer"), Engine("kv_consumer")
    d.pairs_with(p)
    params = prefill(p, 1)
    r = decode(d, "decode-1", params, 1)
    finish_send(p)
    assert r.status == RequestStatus.RUNNING and r.num_computed_tokens == PROMPT
    # The READ really moved the prefill's KV (its mark) into the decode's blocks.
    assert [d.mark(b) for b in d.blocks("decode-1")] == [p.mark(b) for b in params["remote_block_ids"][0]]
    assert kinds(adapter) == []
    assert adapter.checked_transfers >= 1
    assert adapter.unchecked_transfers == {}


def test_a_consumed_transfer_reused_after_the_producer_recycled_its_blocks_is_caught(adapter: kvsan.vllm.Adapter) -> None:
    # The class (vLLM #52234's): a decode engine reads a prefill's blocks
    # again with a transfer reference already consumed (here a client
    # retrying a decode with the kv_transfer_params it was given once).
    # The producer freed the blocks when the first read's notification
    # came, and its next request computed into them: the second read
    # copies that request's KV.
    p, d = Engine("kv_producer"), Engine("kv_consumer")
    d.pairs_with(p)
    params = prefill(p, 1)
    decode(d, "decode-1", params, 1)
    finish_send(p)
    assert kinds(adapter) == []
    prefill(p, 2, tokens=6 * BLOCK)  # takes the blocks request 1 let go of
    recycled = set(params["remote_block_ids"][0]) & set(p.blocks("id-2"))
    assert recycled
    decode(d, "decode-2", params, 1)  # the same prompt: its first blocks hit decode's cache
    assert any(d.mark(b) == MARKS["id-2"] for b in d.blocks("decode-2")), "the retry copied request 2's KV"
    assert "terminal-request-activity" in kinds(adapter)


def test_a_second_decode_with_its_own_transfer_is_clean(adapter: kvsan.vllm.Adapter) -> None:
    p, d = Engine("kv_producer"), Engine("kv_consumer")
    d.pairs_with(p)
    decode(d, "decode-1", prefill(p, 1), 1)
    finish_send(p)
    decode(d, "decode-2", prefill(p, 2, tokens=4 * BLOCK), 2, tokens=4 * BLOCK)
    finish_send(p)
    assert kinds(adapter) == []
    assert adapter.checked_transfers >= 2


def test_a_decode_with_blocks_twice_the_prefills_is_clean(adapter: kvsan.vllm.Adapter) -> None:
    # vLLM maps each 64-token decode block to two 32-token prefill blocks
    # (a second local descriptor list of half-blocks): every decode block
    # is covered whole, in both layers.
    p, d = Engine("kv_producer"), Engine("kv_consumer", block=2 * BLOCK)
    d.pairs_with(p)
    params = prefill(p, 1)
    r = decode(d, "decode-1", params, 1)
    finish_send(p)
    assert r.num_computed_tokens == PROMPT
    assert kinds(adapter) == []
    assert adapter.checked_transfers >= 1


def first_halves_only(worker: Any, local: Any, remote: Any, ratio: int) -> tuple[list[list[int]], list[list[int]]]:
    """A block-size mix-up: each decode block taken as one prefill block
    (its first sub-block), and the prefill's blocks paired one to one."""
    mapped = [[b * ratio for b in group] for group in local]
    return mapped, [list(group)[: len(m)] for group, m in zip(remote, mapped)]


def test_a_block_size_mixed_up_between_prefill_and_decode_is_caught(adapter: kvsan.vllm.Adapter, monkeypatch: pytest.MonkeyPatch) -> None:
    # The class (vLLM #28677's): decode's blocks hold twice the prefill's
    # tokens, and the transfer moves one prefill block into each: the
    # second half of each decode block keeps what the pool left there.
    # vLLM still reports the load done, and the scheduler counts every
    # token computed.
    monkeypatch.setattr(base_worker.NixlBaseConnectorWorker, "_map_block_ids_for_block_size_ratio", first_halves_only)
    p, d = Engine("kv_producer"), Engine("kv_consumer", block=2 * BLOCK)
    d.pairs_with(p)
    params = prefill(p, 1)
    r = decode(d, "decode-1", params, 1)
    assert r.num_computed_tokens == PROMPT
    first = d.blocks("decode-1")[0]
    assert d.caches[0][first].flatten()[-1] == 0, "the block's second half never landed"
    assert "stale-read" in kinds(adapter)


@pytest.mark.parametrize(("shift", "kind"), [(-1, "foreign-write"), (1, "write-after-free")])
def test_a_read_landing_in_a_block_the_request_does_not_hold_is_caught(
    adapter: kvsan.vllm.Adapter, monkeypatch: pytest.MonkeyPatch, shift: int, kind: str
) -> None:
    # A worker whose local block list is off by one: the READ lands in the
    # block before the request's first (the previous request's last), or
    # in the block after its last (one the pool never handed out).
    from vllm.distributed.kv_transfer.kv_connector.v1.nixl import pull_worker

    start = pull_worker.NixlPullConnectorWorker.start_load_kv

    def shifted(worker: Any, metadata: Any) -> None:
        for rid, meta in metadata.reqs_to_recv.items():
            if rid == "decode-2":
                meta.local_block_ids = tuple([b + shift for b in group] for group in meta.local_block_ids)
        start(worker, metadata)

    monkeypatch.setattr(pull_worker.NixlPullConnectorWorker, "start_load_kv", shifted)
    p, d = Engine("kv_producer"), Engine("kv_consumer")
    d.pairs_with(p)
    decode(d, "decode-1", prefill(p, 1), 1)
    finish_send(p)
    assert kinds(adapter) == []
    decode(d, "decode-2", prefill(p, 2), 2)
    assert d.blocks("decode-1")[-1] + 1 == d.blocks("decode-2")[0]
    assert d.blocks("decode-2")[-1] + 1 < BLOCKS
    assert kind in kinds(adapter)


def test_a_transfer_naming_a_block_its_request_did_not_hand_out_is_caught(adapter: kvsan.vllm.Adapter) -> None:
    # The decode's transfer parameters name the prefill's blocks one off:
    # the last is the next request's first, which the prefill still holds.
    p, d = Engine("kv_producer"), Engine("kv_consumer")
    d.pairs_with(p)
    params = prefill(p, 1)
    prefill(p, 2)
    ids = params["remote_block_ids"][0]
    assert p.blocks("id-2")[0] == ids[-1] + 1
    decode(d, "decode-1", dict(params, remote_block_ids=([b + 1 for b in ids],)), 1)
    assert d.mark(d.blocks("decode-1")[-1]) == MARKS["id-2"]
    assert "foreign-read" in kinds(adapter)
