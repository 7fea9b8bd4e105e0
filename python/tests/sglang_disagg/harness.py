"""SGLang's disaggregated (prefill/decode) queues, driven on the CPU in one
process, for the SGLang release the path selects (0.5.20, 0.5.22, 0.5.23).

Two nodes stand where two SGLang servers would:

* :class:`PrefillNode`: SGLang's KV pool (``MHATokenToKVPool``), token
  allocator (``TokenToKVPoolAllocator``, one slot per page: the paged
  allocator's ``alloc_extend`` is a Triton kernel), ``ReqToTokenPool``,
  ``RadixCache`` (prefix sharing; a release's own default would be its
  ``UnifiedRadixCache``), metadata buffers and the real
  ``PrefillBootstrapQueue``. The scheduler's steps after a forward are
  SGLang's own (``SchedulerDisaggregationPrefillMixin`` bound to a stub
  scheduler): ``process_batch_result_disagg_prefill`` (which caches and
  sends with ``send_kv_chunk``, or retires an aborted request) and
  ``process_disagg_prefill_inflight_queue``.
* :class:`DecodeNode`: the same pools with ``DecodeReqToTokenPool``, the tree
  cache the release picks for a decode server without a radix cache, the
  real ``DecodePreallocQueue`` and ``DecodeTransferQueue``
  (``pop_preallocated``, ``pop_transferred`` and its
  ``_commit_transfer_to_req``).

Only the model is missing. :meth:`PrefillNode.prefill` does what the
scheduler does around a prefill forward (match the prefix, lock it,
``ScheduleBatch.init_new`` and ``prepare_for_extend`` allocate the row and
the slots and write the row, ``ForwardBatch.init_new`` builds the forward's
batch) and stores made-up KV (:func:`expected_kv`) for the new tokens with
``set_kv_buffer``; :meth:`DecodeNode.decode` builds the decode side's
prebuilt batch and one decode step the same way. Each ``ForwardBatch`` is
handed to the node's ``on_forward`` callback, if set.

Between the nodes, :class:`Loopback` is the KV transfer backend: the fake
backend's classes (``TransferBackend.FAKE``), subclassed so that a send
copies each page into the receiver's destination page, as Mooncake would,
and the receiver reports success only once the sender has sent its last
chunk. SGLang's queues are not changed.

The scheduler is a stub (:class:`SchedulerStub`): the attributes each
release reads on this path are set from :func:`PREFILL_SCHEDULER` and
:func:`DECODE_SCHEDULER`; anything else raises ``AttributeError``. The
process joins a one-process gloo group (the queues all-reduce their polls
over it), publishes a ``ServerArgs`` with ``override_server_args`` (SGLang's
own way to give tests a runtime config) and states its ranks with
``get_parallel().override``; :class:`Harness` sets all of it up and puts it
back.
"""

from __future__ import annotations

import contextlib
import ctypes
import inspect
import os
import tempfile
import types
from array import array
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import sglang
import torch
import torch.distributed as dist
from sglang.srt.disaggregation import decode as sg_decode
from sglang.srt.disaggregation import fake as sg_fake
from sglang.srt.disaggregation import prefill as sg_prefill
from sglang.srt.disaggregation.base import KVPoll
from sglang.srt.disaggregation.fake.conn import FakeKVManager, FakeKVReceiver, FakeKVSender
from sglang.srt.disaggregation.utils import MetadataBuffers, ReqToMetadataIdxAllocator, TransferBackend
from sglang.srt.managers.schedule_batch import Req, ScheduleBatch
from sglang.srt.managers.utils import validate_input_length
from sglang.srt.mem_cache.allocator import TokenToKVPoolAllocator
from sglang.srt.mem_cache.base_prefix_cache import CacheRequestOutcome
from sglang.srt.mem_cache.cache_init_params import CacheInitParams
from sglang.srt.mem_cache.memory_pool import MHATokenToKVPool, ReqToTokenPool
from sglang.srt.mem_cache.radix_cache import RadixCache
from sglang.srt.model_executor.forward_batch_info import ForwardBatch
from sglang.srt.runtime_context import get_context, get_parallel
from sglang.srt.sampling.sampling_params import SamplingParams
from sglang.srt.speculative.spec_info import SpeculativeAlgorithm

RELEASE: str = sglang.__version__
#: The releases the harness was written against.
RELEASES = ("0.5.20", "0.5.22", "0.5.23")
#: 0.5.22 added the door check (``is_unadmitted_reject``) to both queues.
DOOR_CHECK = RELEASE in ("0.5.22", "0.5.23")


def _accepted(fn: Callable[..., Any], **available: Any) -> dict[str, Any]:
    """The keyword arguments ``fn`` takes out of ``available``: the queues'
    constructors dropped their rank arguments in 0.5.22 (they read
    ``get_parallel()`` instead)."""
    names = inspect.signature(fn).parameters
    return {k: v for k, v in available.items() if k in names}


# ---- the transport ------------------------------------------------------------


def copy_page_plain(
    room: int, index: int, src_kv_pool: MHATokenToKVPool, src_page: int, dst_kv_pool: MHATokenToKVPool, dst_page: int
) -> bool:
    """What an RDMA write does for one page: every layer's K and V slots of
    ``src_page`` copied into ``dst_page`` (pages and slots are the same here:
    page size 1)."""
    ps = src_kv_pool.page_size
    src = slice(src_page * ps, (src_page + 1) * ps)
    dst = slice(dst_page * ps, (dst_page + 1) * ps)
    for layer in range(len(src_kv_pool.k_buffer)):
        dst_kv_pool.k_buffer[layer][dst] = src_kv_pool.k_buffer[layer][src]
        dst_kv_pool.v_buffer[layer][dst] = src_kv_pool.v_buffer[layer][src]
    return True


@dataclass
class Channel:
    """One bootstrap room's transfer: what the decode receiver published and
    what the prefill sender sent into it."""

    room: int
    dst_pages: list[int] | None = None  # the receiver's send_metadata
    sent_pages: list[int] = field(default_factory=list)  # the sender's sends, in order
    landed: int = 0  # how many of sent_pages were copied into dst_pages
    src_aux: int | None = None  # the sender's metadata buffer index (init)
    dst_aux: int | None = None  # the receiver's metadata buffer index (send_metadata)
    aux_landed: bool = False
    last_sent: bool = False
    sender_failed: bool = False
    receiver_failed: bool = False
    #: The prefill node let the request go without a sender (refused at its
    #: door): a real backend's receiver never meets a sender for the room
    #: and its bootstrap fails.
    retired: bool = False


class Loopback:
    """The KV transfer backend between the two nodes (Mooncake's part),
    pairing a prefill sender and a decode receiver by ``bootstrap_room``.

    ``copy_page(room, i, src_kv_pool, src_page, dst_kv_pool, dst_page)``
    moves one page, page ``i`` of the sends into destination page ``i``
    (replaceable; :func:`copy_page_plain` by default). With
    ``drop_last_pages=n`` the last ``n`` pages of each transfer are never
    copied, and the transfer is reported complete all the same.

    Its classes are the fake backend's (``FakeKVManager``, ``FakeKVSender``,
    ``FakeKVReceiver``), each release's own, with what a real backend adds:
    the manager knows the prefill server's parallel info (one DP rank); a
    sender is ``Bootstrapping`` until the receiver has published its
    destination pages; ``send`` copies pages, and the last chunk also the
    request's row of the metadata buffers (``init``'s and ``send_metadata``'s
    aux index: the first output token, the cached-token counts, the
    bootstrap room); both sides conclude ``Success`` only after the last
    chunk (the fake ones at the first send, or at ``send_metadata``), and
    ``Failed`` once the other side aborted or, for the receiver, once the
    prefill node let the request go without a sender (a real receiver's
    bootstrap times out; here it fails at once).
    """

    def __init__(self) -> None:
        self.channels: dict[int, Channel] = {}
        self.copy_page: Callable[[int, int, Any, int, Any, int], bool] = copy_page_plain
        self.drop_last_pages = 0
        self.src_kv_pool: MHATokenToKVPool | None = None
        self.dst_kv_pool: MHATokenToKVPool | None = None
        self.src_metadata: MetadataBuffers | None = None
        self.dst_metadata: MetadataBuffers | None = None
        self.manager_class, self.sender_class, self.receiver_class = _loopback_classes(self)

    def channel(self, room: int) -> Channel:
        ch = self.channels.get(room)
        if ch is None:
            ch = self.channels[room] = Channel(room)
        return ch

    def retire(self, room: int) -> None:
        """The prefill node let the request of ``room`` go without a sender."""
        self.channel(room).retired = True

    def land(self, ch: Channel) -> None:
        """Copies what was sent and has a destination; the last
        ``drop_last_pages`` pages sent are held back (and, once the last
        chunk is in, never copied)."""
        if ch.dst_pages is None:
            return
        n = min(max(0, len(ch.sent_pages) - self.drop_last_pages), len(ch.dst_pages))
        while ch.landed < n:
            i = ch.landed
            self.copy_page(ch.room, i, self.src_kv_pool, ch.sent_pages[i], self.dst_kv_pool, ch.dst_pages[i])
            ch.landed += 1
        if ch.last_sent and not ch.aux_landed and ch.src_aux is not None and ch.dst_aux is not None:
            # the last chunk carries the request's metadata (first output
            # token, cached-token counts, bootstrap room): every metadata
            # buffer's row, as the backend copies it
            src = self.src_metadata.get_buf_infos()
            dst = self.dst_metadata.get_buf_infos()
            for sp, dp, item in zip(src[0], dst[0], src[2]):
                ctypes.memmove(dp + ch.dst_aux * item, sp + ch.src_aux * item, item)
            ch.aux_landed = True


class _PrefillInfoTable(dict):
    """Every bootstrap address names one prefill server with one DP rank (what
    a real manager learns from the prefill's bootstrap server)."""

    def get(self, addr: Any, default: Any = None) -> Any:
        return types.SimpleNamespace(dp_size=1, follow_bootstrap_room=True)


def _loopback_classes(transport: Loopback) -> tuple[type, type, type]:
    class LoopbackKVManager(FakeKVManager):
        """The fake manager, with the prefill server's parallel info known
        (the decode queue asks for it for requests not on the fake host)."""

        def __init__(self, *a: Any, **kw: Any) -> None:
            super().__init__(*a, **kw)
            self.prefill_info_table = _PrefillInfoTable()

        def try_ensure_parallel_info(self, bootstrap_addr: str) -> bool:
            return True

    class LoopbackKVSender(FakeKVSender):
        __doc__ = Loopback.__doc__

        def __init__(self, mgr: Any, bootstrap_addr: str, bootstrap_room: int, *a: Any, **kw: Any) -> None:
            super().__init__(mgr, bootstrap_addr, bootstrap_room, *a, **kw)
            self.channel = transport.channel(bootstrap_room)

        def init(self, num_kv_indices: Any, aux_index: int | None = None) -> None:
            super().init(num_kv_indices, aux_index)
            self.channel.src_aux = aux_index

        def send(self, kv_indices: Any, state_indices: Any = None, *a: Any, **kw: Any) -> None:
            super().send(kv_indices, state_indices, *a, **kw)
            ch = self.channel
            ch.sent_pages.extend(int(p) for p in kv_indices)
            # send_kv_chunk passes state_indices (one entry per state type,
            # [] for a plain KV pool) with the last chunk only
            if state_indices is not None:
                ch.last_sent = True
            transport.land(ch)

        def poll(self) -> KVPoll:
            ch = self.channel
            if self.conclude_state is None and ch.receiver_failed:
                self.conclude_state = KVPoll.Failed
            if self.conclude_state is not None:
                return self.conclude_state
            if ch.dst_pages is None:
                return KVPoll.Bootstrapping
            state = super().poll()
            if state == KVPoll.Success and not ch.last_sent:
                self.conclude_state = None
                return KVPoll.Transferring
            return state

        def abort(self) -> None:
            super().abort()
            self.channel.sender_failed = True

    class LoopbackKVReceiver(FakeKVReceiver):
        __doc__ = Loopback.__doc__

        def __init__(
            self, mgr: Any, bootstrap_addr: str, bootstrap_room: int | None = None, *a: Any, **kw: Any
        ) -> None:
            super().__init__(mgr, bootstrap_addr, bootstrap_room, *a, **kw)
            self.channel = transport.channel(bootstrap_room)

        def send_metadata(self, kv_indices: Any, *a: Any, **kw: Any) -> None:
            super().send_metadata(kv_indices, *a, **kw)
            self.channel.dst_pages = [int(p) for p in kv_indices]
            self.channel.dst_aux = a[0] if a else kw.get("aux_index")
            transport.land(self.channel)

        def poll(self) -> KVPoll:
            ch = self.channel
            if self.conclude_state is None and (ch.sender_failed or ch.retired):
                self.conclude_state = KVPoll.Failed
            if self.conclude_state is not None:
                return self.conclude_state
            state = super().poll()
            if state == KVPoll.Success and not ch.last_sent:
                self.conclude_state = None
                return KVPoll.Transferring if ch.sent_pages else KVPoll.WaitingForInput
            return state

        def abort(self) -> None:
            super().abort()
            self.channel.receiver_failed = True

        def failure_exception(self) -> None:
            if self.channel.retired:
                raise Exception(f"no prefill sender for bootstrap room {self.channel.room}")
            super().failure_exception()

    return LoopbackKVManager, LoopbackKVSender, LoopbackKVReceiver


# ---- the process: gloo group, runtime config, parallel ranks ------------------


class Runtime:
    """What a scheduler process has before its queues are built: a gloo
    group (world size 1) for the polls' all-reduce, SGLang's published
    runtime config (``override_server_args``), this process's ranks
    (``get_parallel().override``), and the transport put where the fake
    backend's classes are looked up (``sglang.srt.disaggregation.fake``,
    which ``get_kv_class`` imports from at each call)."""

    def __init__(self, transport: Loopback, **server_args: Any) -> None:
        self.transport = transport
        self._stack = contextlib.ExitStack()
        self.owns_process_group = False
        if not dist.is_initialized():
            fd, path = tempfile.mkstemp(prefix="sglang-disagg-gloo-")
            os.close(fd)
            os.unlink(path)
            dist.init_process_group("gloo", init_method=f"file://{path}", world_size=1, rank=0)
            self.owns_process_group = True
        self.cpu_group = dist.new_group(ranks=[0], backend="gloo")
        fields = dict(
            device="cpu",
            attention_backend="torch_native",
            disaggregation_transfer_backend="fake",
            disaggregation_decode_enable_radix_cache=False,
        )
        fields.update(server_args)
        try:
            override = get_context().override_server_args(**fields)
            self.server_args = override.install()
            self._stack.callback(override.restore)
            self._stack.enter_context(get_parallel().override(**self._ranks()))
            for name, cls in (
                ("FakeKVManager", transport.manager_class),
                ("FakeKVSender", transport.sender_class),
                ("FakeKVReceiver", transport.receiver_class),
            ):
                self._stack.callback(setattr, sg_fake, name, getattr(sg_fake, name))
                setattr(sg_fake, name, cls)
        except BaseException:
            self.close()
            raise

    def _ranks(self) -> dict[str, Any]:
        group = types.SimpleNamespace(cpu_group=self.cpu_group, world_size=1, rank_in_group=0)
        wanted = dict(
            tp_rank=0,
            pp_rank=0,
            dp_rank=0,
            attn_tp_rank=0,
            attn_cp_rank=0,
            attn_dp_rank=0,
            tp_group=group,
            attn_tp_group=group,
            attn_cp_group=group,
            pp_group=group,
        )
        try:
            from sglang.srt.runtime_context import _parallel_fields

            names = _parallel_fields()
        except ImportError:  # 0.5.20
            from sglang.srt.runtime_context import _PARALLEL_FIELDS as names
        return {k: v for k, v in wanted.items() if k in names}

    def close(self) -> None:
        self._stack.close()
        dist.destroy_process_group(self.cpu_group)
        if self.owns_process_group:
            dist.destroy_process_group()


# ---- the scheduler stub -------------------------------------------------------


class OutputStreamer:
    """The scheduler's ``output_streamer``: what it would send to the
    tokenizer, kept."""

    def __init__(self) -> None:
        self.streamed: list[Req] = []

    def stream_output(self, reqs: list[Req], *a: Any, **kw: Any) -> None:
        self.streamed.extend(reqs)


class BatchResultProcessor:
    """The scheduler's ``batch_result_processor`` for results with no
    logprobs, no auxiliary outputs and no reasoning parser: nothing to do."""

    def snapshot_auxiliary_output_starts(self, batch: Any, result: Any) -> None:
        return None

    def move_logprobs_to_cpu(self, **kw: Any) -> None:
        return None

    def _maybe_update_reasoning_tokens(self, req: Req, token_id: int) -> None:
        return None


class MetricsReporter:
    """The scheduler's ``metrics_reporter`` with metrics off."""

    enable_metrics = False
    current_scheduler_metrics_enabled = False

    def report_prefill_stats(self, **kw: Any) -> None:
        return None


class SchedulerStub:
    """Stands in for SGLang's ``Scheduler``: the attributes the queues and
    the disaggregation mixin read, set by the node; any other raises
    ``AttributeError``. A node's stub class also derives from the release's
    ``SchedulerDisaggregation{Prefill,Decode}Mixin``, so the mixin's methods
    run unchanged on it."""

    def retire_unadmitted_request(self, req: Req) -> None:
        """``Scheduler.retire_unadmitted_request`` (0.5.22, 0.5.23), for a
        request with no session and no beam group: drop its cache handle
        (``_release_aborted_request``), finish it with its intake verdict,
        stream it."""
        self._release_aborted_request(req)
        reason = req.finished_reason or req.to_finish
        req.time_stats.trace_ctx.abort(abort_info={"reason": reason.message})
        req.update_finish_state()
        self.output_streamer.stream_output([req], req.return_logprob)
        self.retired.append(req)

    def _release_aborted_request(self, req: Req) -> None:
        """``Scheduler._release_aborted_request`` for a request without
        multimodal inputs or a streaming session."""
        self.tree_cache.finish(req.cache_request_handle, CacheRequestOutcome.ABORT)

    def maybe_send_health_check_signal(self) -> None:
        """No health check is pending."""


def _stub(mixin: type, **attrs: Any) -> SchedulerStub:
    cls = type(f"{mixin.__name__}Stub", (SchedulerStub, mixin), {})
    stub = cls()
    stub.__dict__.update(attrs)
    return stub


def _model_config(layers: int, kv_heads: int, vocab_size: int) -> types.SimpleNamespace:
    """The ``ModelConfig`` fields the queues and batches read."""
    return types.SimpleNamespace(
        num_hidden_layers=layers,
        num_key_value_heads=kv_heads,
        get_total_num_kv_heads=lambda: kv_heads,
        hf_text_config=types.SimpleNamespace(),
        vocab_size=vocab_size,
        is_encoder_decoder=False,
        is_multimodal=False,
        model_is_mrope=False,
        requires_mm_token_modalities=False,
        hf_eos_token_id=None,
    )


# ---- requests -----------------------------------------------------------------

VOCAB_SIZE = 1000
#: The prefill server's bootstrap host, as the router hands it to both nodes.
BOOTSTRAP_HOST = "127.0.0.1"


def make_req(rid: str, input_ids: list[int], bootstrap_room: int, max_new_tokens: int = 4) -> Req:
    """A ``Req`` as ``Scheduler.handle_generate_request`` builds it for a
    disaggregated request (the constructor's keyword arguments differ
    between releases; these are common to all three). Addressed to a real
    bootstrap host: the queues take it through their real-backend path
    (which the nodes' transfer backend, the loopback, serves), not as a
    fake transfer (``FAKE_BOOTSTRAP_HOST`` marks a warmup request, which
    SGLang keeps out of the radix cache and commits with a made-up token)."""
    sampling_params = SamplingParams(max_new_tokens=max_new_tokens)
    sampling_params.normalize(None)
    sampling_params.verify(VOCAB_SIZE)
    return Req(
        rid,
        "",
        array("q", input_ids),
        sampling_params,
        bootstrap_host=BOOTSTRAP_HOST,
        bootstrap_port=8998,
        bootstrap_room=bootstrap_room,
        vocab_size=VOCAB_SIZE,
    )


def reject_at_intake(req: Req, max_tokens: int) -> str | None:
    """``Scheduler.handle_generate_request``'s prompt-length check:
    ``validate_input_length`` against the node's limit (no auto-truncate),
    and on a prompt too long ``req.set_finish_with_abort(error_msg)``, which
    makes the request the one-token stub (``origin_input_ids = [0]``, the
    verdict in ``to_finish``). The scheduler then hands the request to
    ``_add_request_to_queue`` all the same: the node's ``intake``."""
    error_msg = validate_input_length(req, max_tokens, False)
    if error_msg:
        req.set_finish_with_abort(error_msg)
    return error_msg


def expected_kv(tokens: list[int], layer: int, head_num: int, head_dim: int) -> tuple[torch.Tensor, torch.Tensor]:
    """What the made-up model computes for ``tokens``: position ``i``'s K and
    V depend on ``tokens[: i + 1]`` and the layer (so a shared prefix has the
    same KV, as the radix cache assumes). In float32; a bfloat16 pool
    rounds them, so compare in the pool's dtype."""
    n = len(tokens)
    k = torch.empty((n, head_num, head_dim), dtype=torch.float32)
    v = torch.empty_like(k)
    base = torch.arange(head_num * head_dim, dtype=torch.float32).view(head_num, head_dim)
    h = 17 + layer
    for i, t in enumerate(tokens):
        h = (h * 31 + t + 1) % 251
        k[i] = h + base / 8
        v[i] = -(h + base / 4)
    return k, v


# ---- the nodes ----------------------------------------------------------------


class _Node:
    """The memory a node's scheduler owns."""

    def __init__(
        self,
        runtime: Runtime,
        *,
        tokens: int,
        layers: int,
        head_num: int,
        head_dim: int,
        dtype: torch.dtype,
    ) -> None:
        self.runtime = runtime
        self.layers, self.head_num, self.head_dim = layers, head_num, head_dim
        self.kv_pool = MHATokenToKVPool(
            tokens,
            page_size=1,
            dtype=dtype,
            head_num=head_num,
            head_dim=head_dim,
            layer_num=layers,
            device="cpu",
            enable_memory_saver=False,
        )
        self.allocator = TokenToKVPoolAllocator(tokens, dtype, "cpu", self.kv_pool, False)
        self.model_config = _model_config(layers, head_num, VOCAB_SIZE)
        self.max_total_num_tokens = tokens
        self.forward_batches: list[ForwardBatch] = []
        #: Called with each ForwardBatch the node builds, and the node.
        self.on_forward: Callable[[ForwardBatch, _Node], None] | None = None

    def _metadata(self, buffer_size: int) -> None:
        """The node's metadata buffers (first token, cached-token counts,
        bootstrap room: what travels with the last chunk), their index
        allocator, and where finished requests are streamed."""
        self.metadata_allocator = ReqToMetadataIdxAllocator(buffer_size)
        self.metadata_buffers = MetadataBuffers(
            **_accepted(
                MetadataBuffers,
                size=buffer_size,
                hidden_size=16,
                hidden_states_dtype=torch.float32,
                max_sampling_mask_tokens=0,
                custom_mem_pool=None,
            )
        )
        self.output_streamer = OutputStreamer()

    def kv_of_slots(self, slots: list[int]) -> list[tuple[torch.Tensor, torch.Tensor]]:
        """Each layer's (K, V) at ``slots``, in the pool's dtype."""
        idx = torch.tensor(slots, dtype=torch.int64)
        return [
            (self.kv_pool.get_key_buffer(layer)[idx], self.kv_pool.get_value_buffer(layer)[idx])
            for layer in range(self.layers)
        ]

    def row(self, req: Req, n: int | None = None) -> list[int]:
        """The request's ``req_to_token`` row, its first ``n`` slots."""
        row = self.req_to_token_pool.req_to_token[req.kv.req_pool_idx]
        return [int(x) for x in row[: n if n is not None else len(req.origin_input_ids)]]

    def _forward_batch(self, batch: ScheduleBatch) -> ForwardBatch:
        """``ForwardBatch.init_new`` on the scheduled batch, as
        ``ModelRunner.forward`` gets it (the model runner is a stub holding
        the node's pools)."""
        fb = ForwardBatch.init_new(batch, self.model_runner, return_hidden_states_before_norm=False)
        self.forward_batches.append(fb)
        if self.on_forward is not None:
            self.on_forward(fb, self)
        return fb

    def _model_runner(self) -> types.SimpleNamespace:
        """The ``ModelRunner`` fields the queues and ``ForwardBatch.init_new``
        read, with SGLang's own ``KVIndexTranslator``."""
        from sglang.srt.mem_cache.kv_index_translator import KVIndexTranslator

        translator = KVIndexTranslator(
            **_accepted(
                KVIndexTranslator,
                req_to_token=self.req_to_token_pool.req_to_token,
                token_to_kv_pool_allocator=self.allocator,
                token_to_kv_pool=self.kv_pool,
                page_size=1,
                device="cpu",
                is_draft_worker=False,
            )
        )
        return types.SimpleNamespace(
            req_to_token_pool=self.req_to_token_pool,
            token_to_kv_pool_allocator=self.allocator,
            token_to_kv_pool=self.kv_pool,
            kv_index_translator=translator,
            model_config=self.model_config,
            device="cpu",
            is_draft_worker=False,
            lora_manager=None,
            ngram_embedding_manager=types.SimpleNamespace(enabled=False),
            prefill_attention_backend_str="torch_native",
            ps=types.SimpleNamespace(attn_dcp_size=1, attn_dcp_rank=0),
            effective_max_total_num_tokens=self.max_total_num_tokens,
            effective_logical_max_total_num_tokens=self.max_total_num_tokens,
            max_token_pool_size=self.max_total_num_tokens,
            kv_cache_dtype_str="auto",
        )


class PrefillNode(_Node):
    """A prefill server: its scheduler's memory, its bootstrap queue, its
    inflight queue, and the scheduler's steps on them."""

    def __init__(
        self,
        runtime: Runtime,
        *,
        tokens: int = 256,
        rows: int = 8,
        ctx: int = 128,
        layers: int = 2,
        head_num: int = 1,
        head_dim: int = 4,
        dtype: torch.dtype = torch.float32,
        max_running_requests: int = 8,
    ) -> None:
        super().__init__(runtime, tokens=tokens, layers=layers, head_num=head_num, head_dim=head_dim, dtype=dtype)
        self.req_to_token_pool = ReqToTokenPool(rows, ctx, "cpu", False)
        self.tree_cache = RadixCache(
            CacheInitParams(
                disable=False,
                req_to_token_pool=self.req_to_token_pool,
                token_to_kv_pool_allocator=self.allocator,
                page_size=1,
            )
        )
        self.model_runner = self._model_runner()
        self._metadata(max_running_requests * 2)
        self.scheduler = _stub(
            sg_prefill.SchedulerDisaggregationPrefillMixin,
            **PREFILL_SCHEDULER(self),
        )
        self.bootstrap_queue = sg_prefill.PrefillBootstrapQueue(
            **_accepted(
                sg_prefill.PrefillBootstrapQueue,
                token_to_kv_pool=self.kv_pool,
                draft_token_to_kv_pool=None,
                req_to_metadata_buffer_idx_allocator=self.metadata_allocator,
                metadata_buffers=self.metadata_buffers,
                tp_rank=0,
                tp_size=1,
                gpu_id=0,
                bootstrap_port=8998,
                gloo_group=runtime.cpu_group,
                max_total_num_tokens=tokens,
                scheduler=self.scheduler,
                scheduler_stage_metrics=None,
                pp_rank=0,
                pp_size=1,
                transfer_backend=TransferBackend.FAKE,
            )
        )
        self.scheduler.disagg_prefill_bootstrap_queue = self.bootstrap_queue
        self.waiting_queue: list[Req] = []

    @property
    def inflight_queue(self) -> list[Req]:
        return self.scheduler.disagg_prefill_inflight_queue

    def intake(self, req: Req) -> bool:
        """``Scheduler._add_request_to_queue`` on a prefill node:
        ``PrefillBootstrapQueue.add(req, num_key_value_heads)``. True when
        the queue kept the request (it has a sender and waits for its
        bootstrap); a request it let go never gets a sender, and the
        transport fails its room on the decode side."""
        self.bootstrap_queue.add(req, self.model_config.num_key_value_heads)
        kept = any(r is req for r in self.bootstrap_queue.queue)
        if not kept:
            self.runtime.transport.retire(req.bootstrap_room)
        return kept

    def pop_bootstrapped(self) -> list[Req]:
        """``PrefillBootstrapQueue.pop_bootstrapped`` into the waiting queue,
        as the prefill event loop does."""
        reqs = self.bootstrap_queue.pop_bootstrapped()
        self.waiting_queue.extend(reqs)
        return reqs

    def prefill(self, reqs: list[Req] | None = None, next_token_id: int = 7) -> ForwardBatch | None:
        """One prefill batch of waiting requests (all of them by default),
        the way the scheduler runs it, with a made-up model.

        ``get_new_batch_prefill``: each request's prefix matched in the radix
        cache (``Req.init_next_round_input``) and locked, the whole prompt
        admitted; ``ScheduleBatch.init_new`` and ``prepare_for_extend``
        allocate the rows (``ReqToTokenPool.alloc``) and slots and write the
        rows. ``run_batch``: ``ForwardBatch.init_new``, then the model's KV
        stores for the new tokens (``set_kv_buffer``). Then the mixin's own
        ``process_batch_result_disagg_prefill`` on a result carrying
        ``next_token_id`` for each request: it appends the token, caches the
        KV in the tree (``maybe_cache_unfinished_req``; 0.5.22:
        ``checkpoint_disagg_prefill``), puts the request on the inflight
        queue and sends its KV (``send_kv_chunk``, last chunk), or, for a
        request aborted meanwhile (``is_aborted``, which reads ``to_finish``
        too), retires it instead (``_retire_aborted_prefill_result``: its
        sender aborted, its row released)."""
        if reqs is None:
            reqs = list(self.waiting_queue)
        self.waiting_queue = [r for r in self.waiting_queue if all(r is not q for q in reqs)]
        if not reqs:
            return None
        for req in reqs:
            _admit(req, self.tree_cache)
        batch = ScheduleBatch.init_new(
            reqs,
            self.req_to_token_pool,
            self.allocator,
            self.tree_cache,
            self.model_config,
            False,
            SpeculativeAlgorithm.NONE,
        )
        batch.prepare_for_extend()
        fb = self._forward_batch(batch)
        self._store_kv(reqs)
        result = types.SimpleNamespace(
            logits_output=None,
            next_token_ids=torch.full((len(reqs),), next_token_id, dtype=torch.int64),
            extend_input_len_per_req=None,
            extend_logprob_start_len_per_req=None,
            copy_done=None,
            auxiliary_host_output=None,
            routed_experts_output=None,
            indexer_topk_output=None,
            next_draft_input=None,
            can_run_cuda_graph=False,
        )
        self.scheduler.process_batch_result_disagg_prefill(batch, result)
        return fb

    def _store_kv(self, reqs: list[Req]) -> None:
        """The model's stores: each new token's K and V, in every layer, at
        the slot its row holds (what the attention layers write through
        ``set_kv_buffer``)."""
        for req in reqs:
            tokens = list(req.origin_input_ids)
            start = _prefix_len(req)
            loc = torch.tensor(self.row(req, len(tokens))[start:], dtype=torch.int64)
            for layer in range(self.layers):
                k, v = expected_kv(tokens, layer, self.head_num, self.head_dim)
                self.kv_pool.set_kv_buffer(None, loc, k[start:], v[start:], layer_id_override=layer)

    def abort(self, rid: str) -> None:
        """``Scheduler.abort_request`` on a prefill node (one pipeline
        stage): a request still in the bootstrap queue has its cache handle
        dropped and its sender aborted; one on the inflight queue has its
        sender aborted. The queues themselves notice at their next poll."""
        for req in self.bootstrap_queue.queue:
            if req.rid.startswith(rid):
                self.scheduler._release_aborted_request(req)
                req.disagg_kv_sender.abort()
        for req in self.scheduler.disagg_prefill_inflight_queue:
            if req.rid.startswith(rid):
                req.disagg_kv_sender.abort()

    def process_inflight_queue(self) -> list[Req]:
        """``process_disagg_prefill_inflight_queue``: each sender polled; a
        request whose transfer is done (Success or Failed) has its KV
        released (``release_kv_cache``: cached in the tree, the row freed)
        and leaves the queue."""
        return self.scheduler.process_disagg_prefill_inflight_queue()

    def expected_kv(self, tokens: list[int]) -> list[tuple[torch.Tensor, torch.Tensor]]:
        return [expected_kv(tokens, layer, self.head_num, self.head_dim) for layer in range(self.layers)]


def _prefix_len(req: Req) -> int:
    prefix_len = getattr(req, "prefix_len", None)
    if prefix_len is None:  # 0.5.20
        return len(req.prefix_indices)
    return prefix_len


def _admit(req: Req, tree_cache: Any) -> None:
    """``PrefillAdder``'s part for a whole prompt: the prefix matched
    (``init_next_round_input``), the extend range set to the prompt's end and
    the matched node locked (0.5.20: ``set_extend_range`` and
    ``inc_lock_ref``; 0.5.22: ``extend_end`` and ``lock``)."""
    req.init_next_round_input(tree_cache)
    end = len(req.full_untruncated_fill_ids)
    if hasattr(req, "set_extend_range"):
        req.set_extend_range(_prefix_len(req), end)
        req.lock_receipt = tree_cache.inc_lock_ref(req.last_node).to_dec_params()
    else:
        req.extend_end = end
        req.lock = tree_cache.lock(req.last_node)


def PREFILL_SCHEDULER(node: PrefillNode) -> dict[str, Any]:
    """The prefill scheduler's attributes that the bootstrap queue and the
    prefill mixin (``process_batch_result_disagg_prefill``, ``send_kv_chunk``,
    ``process_disagg_prefill_inflight_queue`` and what they call) read on
    this path. All three releases read the first group; the others are read
    by the releases named."""
    group = node.runtime.cpu_group
    return {
        "server_args": node.runtime.server_args,
        "model_config": node.model_config,
        "tp_worker": types.SimpleNamespace(model_runner=node.model_runner, is_hybrid_swa=False),
        "rust_server": None,
        "attn_tp_cpu_group": group,
        "attn_cp_cpu_group": group,
        "req_to_token_pool": node.req_to_token_pool,
        "token_to_kv_pool_allocator": node.allocator,
        "tree_cache": node.tree_cache,
        "req_to_metadata_buffer_idx_allocator": node.metadata_allocator,
        "disagg_metadata_buffers": node.metadata_buffers,
        "disagg_prefill_bootstrap_queue": None,  # set once the queue is built
        "disagg_prefill_inflight_queue": [],
        "disagg_prefill_pending_chunk_rids": set(),
        "output_streamer": node.output_streamer,
        "metrics_reporter": MetricsReporter(),
        "batch_result_processor": BatchResultProcessor(),
        "spec_algorithm": SpeculativeAlgorithm.NONE,
        "scheduler_stage_metrics": None,
        "processed_tokens_counter": 0,
        "enable_staging": False,
        # 0.5.20: the ranks came from the scheduler, not get_parallel()
        "ps": types.SimpleNamespace(tp_rank=0, pp_rank=0, pp_size=1, dp_rank=0, gpu_id=0),
        "enable_hicache_storage": False,
        # 0.5.22, 0.5.23 (set by the bootstrap queue, read by send_kv_chunk)
        "kv_checksum_computer": None,
        # 0.5.23
        "kv_shard_widening": 1,
        # the harness's record of retire_unadmitted_request (0.5.22, 0.5.23)
        "retired": [],
    }


class DecodeNode(_Node):
    """A decode server: its scheduler's memory, the preallocation and
    transfer queues, and the scheduler's steps on them
    (``process_decode_queue``, then a decode batch)."""

    def __init__(
        self,
        runtime: Runtime,
        *,
        tokens: int = 256,
        rows: int = 8,
        ctx: int = 128,
        layers: int = 2,
        head_num: int = 1,
        head_dim: int = 4,
        dtype: torch.dtype = torch.float32,
        pre_alloc_size: int = 8,
        num_reserved_decode_tokens: int = 8,
    ) -> None:
        super().__init__(runtime, tokens=tokens, layers=layers, head_num=head_num, head_dim=head_dim, dtype=dtype)
        self.req_to_token_pool = sg_decode.DecodeReqToTokenPool(rows, ctx, "cpu", False, pre_alloc_size)
        self.tree_cache = _decode_tree_cache(self)
        self.model_runner = self._model_runner()
        self._metadata(rows * 2)
        self.scheduler = _stub(sg_decode.SchedulerDisaggregationDecodeMixin, **DECODE_SCHEDULER(self))
        self.transfer_queue = sg_decode.DecodeTransferQueue(
            **_accepted(
                sg_decode.DecodeTransferQueue,
                gloo_group=runtime.cpu_group,
                req_to_metadata_buffer_idx_allocator=self.metadata_allocator,
                tp_rank=0,
                metadata_buffers=self.metadata_buffers,
                scheduler=self.scheduler,
                tree_cache=self.tree_cache,
            )
        )
        self.prealloc_queue = sg_decode.DecodePreallocQueue(
            **_accepted(
                sg_decode.DecodePreallocQueue,
                req_to_token_pool=self.req_to_token_pool,
                token_to_kv_pool_allocator=self.allocator,
                draft_token_to_kv_pool=None,
                req_to_metadata_buffer_idx_allocator=self.metadata_allocator,
                metadata_buffers=self.metadata_buffers,
                scheduler=self.scheduler,
                transfer_queue=self.transfer_queue,
                tree_cache=self.tree_cache,
                gloo_group=runtime.cpu_group,
                tp_rank=0,
                tp_size=1,
                dp_size=1,
                gpu_id=0,
                bootstrap_port=8998,
                max_total_num_tokens=tokens,
                pp_rank=0,
                num_reserved_decode_tokens=num_reserved_decode_tokens,
                transfer_backend=TransferBackend.FAKE,
            )
        )
        self.scheduler.disagg_decode_prealloc_queue = self.prealloc_queue
        #: Requests that ran a decode step.
        self.running: list[Req] = []

    @property
    def waiting_queue(self) -> list[Req]:
        return self.scheduler.waiting_queue

    def intake(self, req: Req) -> bool:
        """``Scheduler._add_request_to_queue`` on a decode node:
        ``DecodePreallocQueue.add(req)`` (which makes the receiver). True when
        the queue kept the request."""
        self.prealloc_queue.add(req)
        return any(d.req is req for d in self.prealloc_queue.queue)

    def pop_preallocated(self) -> list[Any]:
        """``process_decode_queue``'s first half: ``pop_preallocated`` (a row
        and the prompt's slots for each request that fits, and its
        receiver's ``send_metadata``), the preallocated requests onto the
        transfer queue. Returns their ``DecodeRequest``\\ s."""
        preallocated, _failed = self.prealloc_queue.pop_preallocated()
        self.transfer_queue.extend(preallocated)
        return preallocated

    def pop_transferred(self) -> list[Req]:
        """``process_decode_queue``'s second half: ``pop_transferred`` (each
        receiver polled; a finished transfer committed to its request by
        ``_commit_transfer_to_req``, a failed one's row and slots released),
        the committed requests into the waiting queue."""
        reqs = self.transfer_queue.pop_transferred()
        self.scheduler.waiting_queue.extend(reqs)
        return reqs

    def abort(self, rid: str) -> None:
        """``Scheduler.abort_request`` on a decode node: the receiver of a
        request in the preallocation or the transfer queue is aborted; the
        queues release it at their next poll (the transfer queue frees its
        row and slots, ``release_kv_cache`` without caching)."""
        for decode_req in self.prealloc_queue.queue:
            if decode_req.req.rid.startswith(rid):
                decode_req.kv_receiver.abort()
        for decode_req in self.transfer_queue.queue:
            if decode_req.req.rid.startswith(rid):
                decode_req.kv_receiver.abort()

    def decode(self, reqs: list[Req] | None = None, next_token_id: int = 5) -> ForwardBatch | None:
        """One decode step of committed requests (the waiting queue by
        default), the way the decode scheduler gets there.

        ``get_new_prebuilt_batch``: each request's next round set up
        (``init_next_round_input`` and the extend range cut to the committed
        KV), ``ScheduleBatch.init_new``, ``prepare_for_prebuilt`` (no forward:
        the prompt's KV came by transfer) and ``process_prebuilt`` (the
        prefill's token relayed as the next input). Then the running batch's
        ``prepare_for_decode`` (a slot per request, written into its row at
        the prompt's end; ``seq_lens`` one past it) and ``run_batch``:
        ``ForwardBatch.init_new`` (the rows read up to ``seq_lens``, one
        token stored each) and the new tokens' KV stored."""
        if reqs is None:
            reqs = list(self.scheduler.waiting_queue)
        self.scheduler.waiting_queue = [r for r in self.scheduler.waiting_queue if all(r is not q for q in reqs)]
        if not reqs:
            return None
        for req in reqs:
            req.init_next_round_input(self.tree_cache)
            if req.kv.kv_committed_len is not None:
                if hasattr(req, "set_extend_range"):  # 0.5.20
                    req.set_extend_range(len(req.prefix_indices), req.kv.kv_committed_len)
                else:
                    req.extend_end = req.kv.kv_committed_len
        batch = ScheduleBatch.init_new(
            reqs,
            self.req_to_token_pool,
            self.allocator,
            self.tree_cache,
            self.model_config,
            False,
            SpeculativeAlgorithm.NONE,
        )
        batch.prepare_for_prebuilt()
        relay = _Relay()
        batch.process_prebuilt(relay)
        batch.input_ids = relay.bonus_tokens
        batch.prepare_for_decode()
        fb = self._forward_batch(batch)
        for req, loc in zip(reqs, fb.out_cache_loc.tolist()):
            tokens = list(req.origin_input_ids) + list(req.output_ids)
            for layer in range(self.layers):
                k, v = expected_kv(tokens, layer, self.head_num, self.head_dim)
                slot = torch.tensor([loc], dtype=torch.int64)
                self.kv_pool.set_kv_buffer(None, slot, k[-1:], v[-1:], layer_id_override=layer)
            req.output_ids.append(next_token_id)
        self.running.extend(reqs)
        return fb


class _Relay:
    """The scheduler's ``FutureMap`` for ``process_prebuilt``: the relayed
    last tokens, which the first decode's ``resolve_forward_inputs`` reads
    back as ``input_ids``."""

    bonus_tokens: torch.Tensor | None = None

    def stash(self, req_pool_indices: torch.Tensor, payload: Any) -> None:
        self.bonus_tokens = payload.bonus_tokens


def _decode_tree_cache(node: DecodeNode) -> Any:
    """The tree cache a decode server without a decode radix cache gets from
    the release's own selection (``default_radix_cache_factory`` with the
    radix cache disabled): 0.5.20 a ``ChunkCache``, 0.5.22 a disabled
    ``UnifiedRadixCache``."""
    from sglang.srt.mem_cache import registry

    params = CacheInitParams(
        disable=True,
        req_to_token_pool=node.req_to_token_pool,
        token_to_kv_pool_allocator=node.allocator,
        page_size=1,
    )
    ctx = registry.TreeCacheBuildContext(
        **_accepted(
            registry.TreeCacheBuildContext,
            server_args=node.runtime.server_args,
            params=params,
            is_hybrid_swa=False,
            is_hybrid_ssm=False,
            enable_hierarchical_cache=False,
            disable_radix_cache=True,
            tp_worker=None,
            model_config=node.model_config,
            tp_size=1,
            tp_rank=0,
            tp_group=None,
            effective_chunked_prefill_size=8192,
        )
    )
    return registry.default_radix_cache_factory(ctx)


def DECODE_SCHEDULER(node: DecodeNode) -> dict[str, Any]:
    """The decode scheduler's attributes that the preallocation and transfer
    queues read on this path. All three releases read the first group; the
    others are read by the releases named."""
    return {
        "server_args": node.runtime.server_args,
        "model_config": node.model_config,
        "tp_worker": types.SimpleNamespace(model_runner=node.model_runner, is_hybrid_swa=False),
        "spec_algorithm": SpeculativeAlgorithm.NONE,
        "running_batch": types.SimpleNamespace(reqs=[]),
        "last_batch": None,
        "waiting_queue": [],
        "output_streamer": node.output_streamer,
        "metrics_reporter": MetricsReporter(),
        "batch_result_processor": BatchResultProcessor(),
        "enable_hisparse": False,
        "enable_decode_hicache": False,
        "enable_priority_scheduling": False,
        "enable_lora": False,
        "disagg_decode_prealloc_queue": None,  # set once the queue is built
        # 0.5.20: the ranks came from the scheduler, not get_parallel()
        "ps": types.SimpleNamespace(tp_rank=0, pp_rank=0, pp_size=1, dp_rank=0, gpu_id=0),
        # 0.5.22, 0.5.23 (set by the preallocation queue)
        "kv_checksum_computer": None,
        # 0.5.23
        "random_seed": 0,
        # what retire_unadmitted_request (0.5.22, 0.5.23: the decode door) uses
        "tree_cache": node.tree_cache,
        "retired": [],
    }


# ---- both nodes ---------------------------------------------------------------


class Harness:
    """A prefill node and a decode node joined by a :class:`Loopback`, in one
    process (one at a time: SGLang's runtime config is process-wide).
    Keyword arguments go to :class:`PrefillNode` (``prefill``) and
    :class:`DecodeNode` (``decode``)."""

    def __init__(
        self, prefill: dict[str, Any] | None = None, decode: dict[str, Any] | None = None, **server_args: Any
    ) -> None:
        self.transport = Loopback()
        self.runtime = Runtime(self.transport, **server_args)
        try:
            self.prefill = PrefillNode(self.runtime, **(prefill or {}))
            self.decode = DecodeNode(self.runtime, **(decode or {}))
        except BaseException:
            self.runtime.close()
            raise
        self.transport.src_kv_pool = self.prefill.kv_pool
        self.transport.dst_kv_pool = self.decode.kv_pool
        self.transport.src_metadata = self.prefill.metadata_buffers
        self.transport.dst_metadata = self.decode.metadata_buffers

    def make_reqs(
        self, rid: str, input_ids: list[int], bootstrap_room: int, max_new_tokens: int = 4
    ) -> tuple[Req, Req]:
        """The request as each server builds it from the router's copy: one
        ``Req`` on the prefill node, one on the decode node."""
        return (
            make_req(rid, input_ids, bootstrap_room, max_new_tokens),
            make_req(rid, input_ids, bootstrap_room, max_new_tokens),
        )

    def step(self) -> None:
        """One turn of both event loops without new batches: decode's
        ``process_decode_queue`` (preallocate, then collect finished
        transfers), prefill's bootstrap queue into its waiting queue and its
        inflight queue polled."""
        self.decode.pop_preallocated()
        self.prefill.pop_bootstrapped()
        self.prefill.process_inflight_queue()
        self.decode.pop_transferred()

    def close(self) -> None:
        self.runtime.close()

    def __enter__(self) -> Harness:
        return self

    def __exit__(self, *exc: Any) -> None:
        self.close()
