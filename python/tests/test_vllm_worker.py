"""kvsan.vllm at vLLM's worker: the slot mappings and block tables vLLM's
model runner hands its KV store and attention kernels, checked as the
kernels take them.

vLLM's ``GPUModelRunner`` (the V1 runner; ``CPUModelRunner`` is one) is
driven on the CPU with a real scheduler: each step the scheduler makes
goes through the runner's own input preparation, in ``execute_model``'s
order (``_update_states``, ``_prepare_inputs`` with vLLM's Triton
slot-mapping kernel, ``_get_slot_mappings``,
``_build_attention_metadata``), and the worker's report goes back to the
scheduler. The model's forward is not run: vLLM's CUDA wheel has no CPU
attention kernels. Triton runs the slot-mapping kernel in its interpreter
(``TRITON_INTERPRET=1``; ``CUDA_VISIBLE_DEVICES=`` keeps vLLM from
replacing Triton when it sees no GPU driver), so the slot mapping checked
is the one vLLM's kernel wrote.
"""

from __future__ import annotations

import os
from typing import Any, Iterator

import pytest
from vllm_support import gloo_group, vllm_test_helpers

if os.environ.get("TRITON_INTERPRET") != "1" or os.environ.get("CUDA_VISIBLE_DEVICES") != "":
    pytest.skip(
        "runs vLLM's Triton kernel on the CPU: TRITON_INTERPRET=1 CUDA_VISIBLE_DEVICES= (scripts/vllm-tests run)",
        allow_module_level=True,
    )
vllm_test_helpers("vllm.v1.worker.gpu_model_runner")

import numpy as np  # noqa: E402
import torch  # noqa: E402

from tests.v1.core.utils import EOS_TOKEN_ID, create_requests, create_scheduler  # noqa: E402
from vllm.config import set_current_vllm_config  # noqa: E402
from vllm.model_executor.layers.attention import Attention  # noqa: E402
from vllm.v1.kv_cache_interface import (  # noqa: E402
    FullAttentionSpec,
    KVCacheConfig,
    KVCacheGroupSpec,
    KVCacheTensor,
    MambaSpec,
    SlidingWindowSpec,
)
from vllm.model_executor.layers.mamba.abstract import MambaBase  # noqa: E402
from vllm.v1.attention.backends.registry import MambaAttentionBackendEnum  # noqa: E402
from vllm.v1.structured_output import StructuredOutputManager  # noqa: E402
from vllm.utils.hashing import sha256  # noqa: E402
from vllm.v1.core.kv_cache_utils import get_request_block_hasher  # noqa: E402
from vllm.v1.outputs import ModelRunnerOutput  # noqa: E402
from vllm.v1.request import Request  # noqa: E402
from vllm.v1.worker import block_table as vllm_block_table  # noqa: E402
from vllm.v1.worker.gpu_input_batch import InputBatch  # noqa: E402
from vllm.v1.worker.gpu_model_runner import GPUModelRunner  # noqa: E402

import kvsan.vllm  # noqa: E402

BLOCK = 32
BLOCKS = 24


@pytest.fixture(scope="module")
def distributed() -> Iterator[None]:
    with gloo_group(create_scheduler(num_blocks=BLOCKS, block_size=BLOCK).vllm_config):
        yield


@pytest.fixture(autouse=True)
def metadata_passed_through(monkeypatch: pytest.MonkeyPatch) -> None:
    """vLLM's CPU attention backend builds its metadata with vLLM's CPU
    kernels, which vLLM's CUDA wheel lacks: its builder hands the common
    metadata (the buffers checked) through instead."""
    from vllm.v1.attention.backends.cpu_attn import CPUAttentionMetadataBuilder

    monkeypatch.setattr(CPUAttentionMetadataBuilder, "build", lambda self, prefix, common, *a, **kw: common)


@pytest.fixture
def adapter() -> Iterator[kvsan.vllm.Adapter]:
    a = kvsan.vllm.attach()
    a.take_violations()
    yield a
    a.detach()


class TinyMamba(torch.nn.Module, MambaBase):
    """A Mamba layer as the runner sees one: its state's shape and type,
    and vLLM's Mamba1 backend (whose metadata builder runs on the CPU)."""

    def get_state_shape(self) -> tuple[tuple[int, ...], ...]:
        return ((1, 1),)

    def get_state_dtype(self) -> tuple[torch.dtype, ...]:
        return (torch.float32,)

    @property
    def mamba_type(self) -> MambaAttentionBackendEnum:
        return MambaAttentionBackendEnum.MAMBA1


class Engine:
    """A vLLM scheduler and a model runner on the CPU for its steps."""

    def __init__(
        self,
        adapter: kvsan.vllm.Adapter,
        prefix_caching: bool = False,
        batched_tokens: int = 8192,
        async_scheduling: bool = False,
        window: int | None = None,
        mamba: bool = False,
    ):
        """``window``: a second attention layer, with a sliding window of
        that many tokens, in a KV cache group of its own (a hybrid model);
        ``mamba``: a Mamba layer's state group beside the attention."""
        self.scheduler = create_scheduler(
            num_blocks=BLOCKS,
            block_size=BLOCK,
            async_scheduling=async_scheduling,
            enable_prefix_caching=prefix_caching,
            max_num_batched_tokens=batched_tokens,
            max_model_len=BLOCKS * BLOCK,
            use_v2_model_runner=False,
        )
        config = self.scheduler.vllm_config
        with set_current_vllm_config(config):
            model = config.model_config
            heads, head_size = model.get_num_kv_heads(config.parallel_config), model.get_head_size()
            layers = config.compilation_config.static_forward_context
            layers["layer"] = Attention(heads, head_size, 0.1, prefix="layer")
            self.runner = GPUModelRunner(config, torch.device("cpu"))
            spec = FullAttentionSpec(block_size=BLOCK, num_kv_heads=heads, head_size=head_size, dtype=self.runner.kv_cache_dtype)
            groups = [KVCacheGroupSpec(layer_names=["layer"], kv_cache_spec=spec)]
            if window is not None:
                layers["swa"] = Attention(heads, head_size, 0.1, per_layer_sliding_window=window, prefix="swa")
                swa = SlidingWindowSpec(
                    block_size=BLOCK, num_kv_heads=heads, head_size=head_size, dtype=self.runner.kv_cache_dtype, sliding_window=window
                )
                groups.append(KVCacheGroupSpec(layer_names=["swa"], kv_cache_spec=swa))
            if mamba:
                # State blocks of the attention's block size, one per block
                # boundary (vLLM's "align" mode; in "none" mode a state
                # block spans the whole model length, and such pools are
                # left unchecked).
                config.cache_config.mamba_cache_mode = "align"
                layers["mamba"] = TinyMamba()
                state = MambaSpec(
                    block_size=BLOCK,
                    shapes=tuple(layers["mamba"].get_state_shape()),
                    dtypes=layers["mamba"].get_state_dtype(),
                    mamba_type=layers["mamba"].mamba_type,
                    mamba_cache_mode="align",
                    page_size_padded=spec.page_size_bytes,
                )
                groups.append(KVCacheGroupSpec(layer_names=["mamba"], kv_cache_spec=state))
            size = spec.page_size_bytes * BLOCKS
            names = [g.layer_names[0] for g in groups]
            kv = KVCacheConfig(
                num_blocks=BLOCKS,
                kv_cache_tensors=[KVCacheTensor(size=size, layers=names, layer_stride=size, block_stride=spec.page_size_bytes)],
                kv_cache_groups=groups,
            )
            if len(groups) > 1:
                # The scheduler of the same engine, over every group.
                self.scheduler = type(self.scheduler)(
                    vllm_config=config,
                    kv_cache_config=kv,
                    block_size=BLOCK,
                    log_stats=True,
                    structured_output_manager=StructuredOutputManager(config),
                )
                self.scheduler.use_v2_model_runner = False
            self.runner.kv_cache_config = kv
            self.runner.input_batch = InputBatch(
                max_num_reqs=self.runner.max_num_reqs,
                max_model_len=self.runner.max_model_len,
                max_num_batched_tokens=self.runner.max_num_tokens,
                device=self.runner.device,
                vocab_size=model.get_vocab_size(),
                block_sizes=[BLOCK] * len(groups),
                max_num_blocks_per_req=[BLOCKS] * len(groups),
            )
            self.runner.initialize_attn_backend(kv)
            self.runner.initialize_metadata_builders(kv, [BLOCK] * len(groups))
        adapter.watch_runner(self.runner, self.scheduler)

    def add(self, requests: list[Any]) -> None:
        for r in requests:
            self.scheduler.add_request(r)

    def step(self, pad_to: int | None = None, pad_reqs: int | None = None) -> Any:
        """One step: scheduled, prepared by the runner as ``execute_model``
        prepares it, and reported back (each request that finished its
        prompt samples token 0)."""
        out = self.scheduler.schedule()
        self.prepare(out, pad_to, pad_reqs)
        self.scheduler.update_from_output(out, self.report(out))
        return out

    def prepare(self, out: Any, pad_to: int | None = None, pad_reqs: int | None = None) -> None:
        """The runner prepares step ``out`` as ``execute_model`` does, up to
        the forward (with ``pad_reqs``: a batch padded to that many rows, as
        for a CUDA graph)."""
        if out.total_num_scheduled_tokens:
            by_group = self.inputs(out, pad_to, pad_reqs)
            self.metadata(out, self.runner.input_batch.num_reqs, by_group, pad_to, pad_reqs)

    def inputs(self, out: Any, pad_to: int | None = None, pad_reqs: int | None = None) -> dict[int, Any]:
        """The runner's inputs for ``out`` (its state, positions and slot
        mappings, padded to ``pad_to`` tokens): the slot mappings by group."""
        runner = self.runner
        with set_current_vllm_config(self.scheduler.vllm_config):
            runner._update_states(out)
            num_reqs = runner.input_batch.num_reqs
            runner._prepare_inputs(out, self.tokens(out))
            n = out.total_num_scheduled_tokens
            by_group, _ = runner._get_slot_mappings(
                num_tokens_padded=pad_to or n, num_reqs_padded=pad_reqs or num_reqs, num_tokens_unpadded=n
            )
        return by_group

    def metadata(
        self, out: Any, num_reqs: int, by_group: dict[int, Any], pad_to: int | None = None, pad_reqs: int | None = None
    ) -> Any:
        """The attention metadata for ``out``, over ``num_reqs`` rows (by
        layer)."""
        with set_current_vllm_config(self.scheduler.vllm_config):
            by_layer, _ = self.runner._build_attention_metadata(
                num_tokens=out.total_num_scheduled_tokens,
                num_reqs=num_reqs,
                max_query_len=int(self.tokens(out).max()),
                num_tokens_padded=pad_to,
                num_reqs_padded=pad_reqs,
                num_scheduled_tokens=out.num_scheduled_tokens,
                slot_mappings=by_group,
            )
        return by_layer

    def tokens(self, out: Any) -> Any:
        """The tokens ``out`` schedules for each row of the input batch."""
        ids = self.runner.input_batch.req_ids
        return np.array([out.num_scheduled_tokens[i] for i in ids], dtype=np.int32)

    def report(self, out: Any, eos: frozenset[str] = frozenset()) -> ModelRunnerOutput:
        """The worker's output for ``out``: token 0 for each request past
        its prompt, the end-of-sequence token for those in ``eos``."""
        ids = list(out.num_scheduled_tokens)
        sampled = []
        for rid in ids:
            r = self.scheduler.requests[rid]
            done = r.num_computed_tokens >= r.num_prompt_tokens
            sampled.append([EOS_TOKEN_ID if rid in eos else 0] if done else [])
        return ModelRunnerOutput(
            req_ids=ids,
            req_id_to_index={r: i for i, r in enumerate(ids)},
            sampled_token_ids=sampled,
            logprobs=None,
            prompt_logprobs_dict={},
            pooler_output=None,
        )


def kinds(adapter: kvsan.vllm.Adapter) -> list[str]:
    return sorted({f.kind for f in adapter.take_violations()})


def test_steps_of_a_batch_are_checked_and_clean(distributed: None, adapter: Any) -> None:
    engine = Engine(adapter)
    engine.add(create_requests(3, num_tokens=40, max_tokens=4, block_size=BLOCK))
    for _ in range(6):
        engine.step()
    assert adapter.checked_steps == 4  # the prompt, then three decodes
    assert adapter.unchecked_steps == {}
    assert kinds(adapter) == []


def requests(*spec: tuple[str, int, int], prompts: dict[str, list[int]] | None = None) -> list[Any]:
    """Requests ``(id, prompt tokens, tokens to generate)``: each prompt its
    own tokens, or the one ``prompts`` gives."""
    out = []
    for i, (rid, prompt, generate) in enumerate(spec):
        (like,) = create_requests(1, num_tokens=prompt, max_tokens=generate, block_size=BLOCK)
        tokens = (prompts or {}).get(rid) or [100 * (i + 1) + t % 50 for t in range(prompt)]
        out.append(
            Request(
                request_id=rid,
                prompt_token_ids=tokens,
                sampling_params=like.sampling_params,
                pooling_params=None,
                block_hasher=get_request_block_hasher(BLOCK, sha256),
            )
        )
    return out


def finish_first_then_decode(engine: Engine) -> None:
    """A finishes with its prompt's step; the next step removes its row and
    condenses the batch: C, the last row, moves into A's."""
    engine.add(requests(("A", 40, 1), ("B", 70, 4), ("C", 50, 4)))
    engine.step()
    assert engine.runner.input_batch.req_id_to_index["C"] == 2
    engine.step()
    assert "A" not in engine.scheduler.requests
    assert engine.runner.input_batch.req_id_to_index["C"] == 0
    engine.step()


def test_a_condensed_batch_is_clean(distributed: None, adapter: Any) -> None:
    engine = Engine(adapter)
    finish_first_then_decode(engine)
    assert adapter.checked_steps == 3
    assert kinds(adapter) == []


def test_a_row_condense_leaves_in_place_is_caught(distributed: None, adapter: Any, monkeypatch: pytest.MonkeyPatch) -> None:
    # The class: the input batch moves a request into a vacated row but
    # the block table row is not moved with it, so the row still lists the
    # blocks of the request that left (vLLM's move_row now clears the
    # vacated row for this reason: a stale row was read as a live one).
    tables = vllm_block_table.MultiGroupBlockTable
    monkeypatch.setattr(tables, "move_row", lambda self, src, tgt: None)
    monkeypatch.setattr(tables, "clear_row", lambda self, row: None)
    engine = Engine(adapter)
    finish_first_then_decode(engine)
    found = adapter.take_violations()
    # C's decode token is stored in, and C's attention reads, A's freed
    # block: nothing the scheduler gave C.
    assert {f.request for f in found} == {"C"}
    assert {f.kind for f in found} == {"write-after-free", "read-free-page"}
    assert any("slot_mapping" in f.what for f in found)
    assert any("block table" in f.what for f in found)


def test_a_moved_request_left_with_a_cleared_row_writes_the_null_block(
    distributed: None, adapter: Any, monkeypatch: pytest.MonkeyPatch
) -> None:
    # The same class on vLLM 0.33.0, which clears a request's row when it
    # leaves: the move skipped, the moved request's row lists block 0,
    # vLLM's null block, which attention takes to hold zeros.
    monkeypatch.setattr(vllm_block_table.MultiGroupBlockTable, "move_row", lambda self, src, tgt: None)
    engine = Engine(adapter)
    finish_first_then_decode(engine)
    found = adapter.take_violations()
    assert {f.request for f in found} == {"C"}
    assert {f.kind for f in found} == {"foreign-write", "foreign-read"}


def test_a_slot_mapping_from_another_row_is_caught(distributed: None, adapter: Any, monkeypatch: pytest.MonkeyPatch) -> None:
    # The class: the slot-mapping kernel runs over the block table of
    # another row (a table reordered after the slots were mapped, an index
    # off by one): each request's KV is stored in another's blocks.
    kernel = vllm_block_table._COMPUTE_SLOT_MAPPING_KERNEL

    def shifted(self: Any, num_reqs: int, query_start_loc: Any, positions: Any) -> None:
        table = self.block_table.gpu
        rolled = torch.roll(table[:num_reqs], 1, dims=0).contiguous()
        kernel(
            num_reqs, positions.shape[0], self.max_num_batched_tokens, query_start_loc, positions,
            rolled, table.stride(0), self.slot_mapping.gpu, self.block_size, 1, 0, 1,
        )

    monkeypatch.setattr(vllm_block_table.BlockTable, "compute_slot_mapping", shifted)
    engine = Engine(adapter)
    engine.add(requests(("A", 40, 2), ("B", 40, 2)))
    engine.step()
    found = adapter.take_violations()
    assert {f.kind for f in found} == {"foreign-write"}
    assert {f.request for f in found} == {"A", "B"}
    assert all("slot_mapping" in f.what for f in found)


def test_padding_tokens_stored_nowhere_are_clean(distributed: None, adapter: Any) -> None:
    engine = Engine(adapter)
    engine.add(requests(("A", 40, 3), ("B", 40, 3)))
    engine.step()
    engine.step(pad_to=8)  # two decode tokens, padded as a CUDA graph pads
    assert adapter.checked_steps == 2
    assert kinds(adapter) == []


def test_padding_tokens_with_stale_slots_are_caught(distributed: None, adapter: Any, monkeypatch: pytest.MonkeyPatch) -> None:
    # The class: padding slots that are not -1. The kernel's own padding
    # pass and the runner's fill both take the padded count for the real
    # one, so the padding keeps the previous step's slots, and the store
    # kernel writes the padding tokens' KV into another request's blocks.
    table = vllm_block_table.BlockTable
    compute = table.compute_slot_mapping

    def unpadded(self: Any, num_reqs: int, query_start_loc: Any, positions: Any) -> None:
        keep, self.max_num_batched_tokens = self.max_num_batched_tokens, positions.shape[0]
        try:
            compute(self, num_reqs, query_start_loc, positions)
        finally:
            self.max_num_batched_tokens = keep

    slots = GPUModelRunner._get_slot_mappings

    def unfilled(self: Any, num_tokens_padded: int, num_reqs_padded: int, num_tokens_unpadded: int, **kw: Any) -> Any:
        return slots(self, num_tokens_padded, num_reqs_padded, num_tokens_padded, **kw)

    monkeypatch.setattr(table, "compute_slot_mapping", unpadded)
    monkeypatch.setattr(GPUModelRunner, "_get_slot_mappings", unfilled)
    engine = Engine(adapter)
    engine.add(requests(("A", 40, 3), ("B", 40, 3)))
    engine.step()
    assert kinds(adapter) == []
    engine.step(pad_to=8)
    found = adapter.take_violations()
    assert {f.request for f in found} == {"the step's padding tokens"}
    assert {f.kind for f in found} == {"foreign-write"}


def test_a_runner_is_linked_to_the_one_scheduler_of_its_config(distributed: None, adapter: Any) -> None:
    # In one process vLLM's engine builds its scheduler and its runner from
    # one config: the runner needs no watch_runner.
    engine = Engine(adapter)
    adapter._runners.clear()
    engine.add(requests(("A", 40, 2)))
    engine.step()
    assert adapter.checked_steps == 1
    assert adapter.unchecked_steps == {}


def test_a_runner_without_its_scheduler_is_counted_unchecked(distributed: None, adapter: Any) -> None:
    # Two schedulers of one config (as in a test): which one feeds the
    # runner is not known, so its steps are counted, not checked.
    engine = Engine(adapter)
    adapter._runners.clear()
    s = engine.scheduler
    other = type(s)(
        vllm_config=s.vllm_config,
        kv_cache_config=s.kv_cache_config,
        block_size=BLOCK,
        log_stats=True,
        structured_output_manager=StructuredOutputManager(s.vllm_config),
    )
    other.schedule()
    engine.add(requests(("A", 40, 2)))
    engine.step()
    assert adapter.checked_steps == 0
    assert adapter.unchecked_steps == {"model runners not linked to a scheduler (Adapter.watch_runner)": 1}


def test_blocks_shared_through_the_prefix_cache_are_read_cleanly(distributed: None, adapter: Any) -> None:
    engine = Engine(adapter, prefix_caching=True)
    (a,) = requests(("A", 3 * BLOCK + 8, 3))
    engine.add([a])
    engine.step()
    shared = a.prompt_token_ids[: 2 * BLOCK] + [7] * (BLOCK + 8)
    engine.add(requests(("B", len(shared), 3), prompts={"B": shared}))
    out = engine.step()
    (b,) = out.scheduled_new_reqs
    assert b.num_computed_tokens == 2 * BLOCK  # two blocks hit in A's
    engine.step()
    assert adapter.checked_steps == 3
    assert kinds(adapter) == []


def test_a_request_recomputing_its_own_cached_tokens_is_reported_only_when_strict(
    distributed: None, adapter: Any, monkeypatch: pytest.MonkeyPatch
) -> None:
    """vLLM's decode side of P/D computes a whole-arrived prompt's last
    token again, into a block the prefix cache holds (PR #34616): the same
    tokens' KV at the same positions. Re-created here by taking the
    request's count back into its second, registered block."""
    engine = Engine(adapter, prefix_caching=True)
    (a,) = requests(("A", 2 * BLOCK + 8, 4))
    engine.add([a])
    engine.step()
    engine.step()
    assert kinds(adapter) == []
    before = adapter.cached_rewrites
    a.num_computed_tokens = 2 * BLOCK - 1
    engine.step()
    assert kinds(adapter) == []
    assert adapter.cached_rewrites > before
    monkeypatch.setattr(adapter, "strict_cached_rewrites", True)
    a.num_computed_tokens = 2 * BLOCK - 1
    engine.step()
    found = adapter.take_violations()
    assert {f.kind for f in found} == {"foreign-write"}
    assert any("slot_mapping" in f.what for f in found)


def test_a_runner_the_adapter_cannot_see_is_refused_by_name(distributed: None, adapter: Any) -> None:
    # vLLM's V2 model runner builds its buffers elsewhere: linking it would
    # check nothing, silently.
    from vllm.v1.worker.gpu.model_runner import GPUModelRunner as V2Runner

    engine = Engine(adapter)
    v2 = V2Runner.__new__(V2Runner)
    with pytest.raises(TypeError, match=r"V1 model runner .* not of vllm\.v1\.worker\.gpu\.model_runner\.GPUModelRunner.*VLLM_USE_V2_MODEL_RUNNER=0"):
        adapter.watch_runner(v2, engine.scheduler)


def test_a_step_in_flight_when_its_request_finished_is_not_a_finding(distributed: None, adapter: Any) -> None:
    """Under async scheduling the next step is scheduled before the last
    one's output comes back: a request that finishes in that output is
    freed (vLLM frees at once without a KV connector) while the step that
    still computes it is prepared. Its write lands in its freed block and
    the next owner computes into that block itself, after it on the same
    stream: what vLLM relies on, not a finding."""
    engine = Engine(adapter, async_scheduling=True)
    engine.add(requests(("A", 40, 6), ("B", 40, 6)))
    first = engine.scheduler.schedule()
    engine.prepare(first)
    second = engine.scheduler.schedule()  # A samples its end here
    engine.prepare(second)
    engine.scheduler.update_from_output(first, engine.report(first))
    third = engine.scheduler.schedule()  # scheduled before A is seen done
    assert "A" in third.num_scheduled_tokens
    engine.scheduler.update_from_output(second, engine.report(second, eos=frozenset({"A"})))
    assert "A" not in engine.scheduler.requests  # finished and freed
    engine.prepare(third)
    assert kinds(adapter) == []
    assert adapter.unchecked_steps == {"rows of requests finished while their step was in flight": 1}


def test_a_slot_past_the_pool_is_named_and_the_step_goes_on(
    distributed: None, adapter: Any, monkeypatch: pytest.MonkeyPatch
) -> None:
    # A slot the store kernel would write outside the KV cache: kvsan
    # refuses the buffer, the adapter names it, and vLLM's step goes on.
    table = vllm_block_table.BlockTable
    compute = table.compute_slot_mapping

    def past_the_pool(self: Any, num_reqs: int, query_start_loc: Any, positions: Any) -> None:
        compute(self, num_reqs, query_start_loc, positions)
        self.slot_mapping.gpu[0] = 10**6

    monkeypatch.setattr(table, "compute_slot_mapping", past_the_pool)
    engine = Engine(adapter)
    engine.add(requests(("A", 40, 2)))
    engine.step()
    found = adapter.take_violations()
    assert [f.kind for f in found] == ["bad-batch"]
    assert "group 0" in found[0].what and "row 0: page index 31250 is outside the pool" in found[0].what


def test_a_dummy_run_and_rows_without_requests_are_counted_not_checked(distributed: None, adapter: Any) -> None:
    engine = Engine(adapter)
    engine.add(requests(("A", 40, 2), ("B", 40, 2)))
    out = engine.scheduler.schedule()
    by_group = engine.inputs(out)
    runner = engine.runner

    def build(num_reqs: int) -> None:
        engine.metadata(out, num_reqs, by_group)

    # A dummy batch (profiling, warm-up, an idle data-parallel rank) goes
    # through GPUModelRunner._dummy_run, whose rows are no request's.
    adapter._on_dummy_run(lambda r: build(2), runner)
    # A batch that names more rows than the input batch has requests.
    build(4)
    assert adapter.checked_steps == 0
    assert adapter.unchecked_steps == {
        "dummy runs (profiling, warm-up, idle data-parallel ranks)": 1,
        "steps with more rows than the input batch has requests": 1,
    }
    build(2)  # the same batch, as a step: checked
    assert adapter.checked_steps == 1
    assert kinds(adapter) == []


WINDOW = 2 * BLOCK


def test_a_windowed_group_is_read_from_its_window_and_a_clean_run_passes(distributed: None, adapter: Any) -> None:
    # Past its window, a sliding-window group's first blocks are freed (and
    # taken by the next request) while the runner's block table row keeps
    # their ids: the kernel reads only the window, and so does the check.
    engine = Engine(adapter, window=WINDOW)
    first, second = create_requests(num_requests=2, num_tokens=4 * BLOCK, max_tokens=40, block_size=BLOCK)
    engine.add([first])
    for _ in range(3):
        engine.step()
    window = engine.scheduler.kv_cache_manager.coordinator.single_type_managers[1]
    assert window.req_to_blocks[first.request_id][0].is_null
    engine.add([second])
    for _ in range(3):
        engine.step()
    assert kinds(adapter) == []
    assert adapter.checked_steps >= 6


def test_a_window_block_freed_while_the_kernel_still_reads_it_is_caught(
    distributed: None, adapter: Any, monkeypatch: pytest.MonkeyPatch
) -> None:
    # The window lets go of one block too early: the scheduler frees it
    # (and hands it to the next request) while the block table row the
    # kernel takes still names it inside the window.
    from vllm.v1.core.single_type_kv_cache_manager import SlidingWindowManager

    def one_block_early(self: Any, n: int) -> int:
        return n - self.sliding_window + 1 + BLOCK if n >= self.sliding_window else 0

    monkeypatch.setattr(SlidingWindowManager, "get_num_skipped_tokens", one_block_early)
    engine = Engine(adapter, window=WINDOW)
    first, second = create_requests(num_requests=2, num_tokens=4 * BLOCK, max_tokens=40, block_size=BLOCK)
    engine.add([first])
    engine.step()
    engine.add([second])
    engine.step()
    engine.step()
    found = adapter.take_violations()
    # The scheduler's side: the step's window holds the null block.
    assert any(f.kind == "foreign-read" and "null block" in f.what for f in found), found
    # The kernel's side: the row still names the freed block there, which
    # the pool has handed out again (here to the same request's other
    # group, whose KV it now holds): a read of slots no one wrote for it.
    worker = [f for f in found if "attention reads block table row" in f.what]
    assert worker and {f.kind for f in worker} <= {"stale-read", "foreign-read", "read-free-page"}, found


def test_mamba_state_slots_of_a_padded_batch_are_checked_and_clean(distributed: None, adapter: Any) -> None:
    # Two requests through prompt and decode, the decode batch padded to
    # four rows (a CUDA graph's size): the padding rows name vLLM's null
    # block, each request its own state block.
    engine = Engine(adapter, mamba=True)
    engine.add(create_requests(num_requests=2, num_tokens=40, max_tokens=8, block_size=BLOCK))
    engine.step()  # align mode: the prompts up to their first block boundary
    engine.step()  # and the rest of them
    for _ in range(3):
        engine.step(pad_to=4, pad_reqs=4)
    assert kinds(adapter) == []
    assert adapter.checked_steps == 5


def test_a_padding_row_naming_a_live_state_slot_is_caught(
    distributed: None, adapter: Any, monkeypatch: pytest.MonkeyPatch
) -> None:
    # The class (sglang#36885, vllm#53919): the rows a CUDA graph pads a
    # batch with name a state slot that is a live request's, so the
    # padding's state update lands in that request's running state. Here
    # the runner fills the padding rows of the block tables with the first
    # request's state block instead of the null block.
    from vllm.v1.worker import gpu_model_runner

    engine = Engine(adapter, mamba=True)
    first, second = create_requests(num_requests=2, num_tokens=40, max_tokens=8, block_size=BLOCK)
    engine.add([first, second])
    engine.step()
    engine.step()
    state = engine.scheduler.kv_cache_manager.coordinator.single_type_managers[1].req_to_blocks[first.request_id][-1]
    monkeypatch.setattr(gpu_model_runner, "NULL_BLOCK_ID", state.block_id)
    engine.step(pad_to=4, pad_reqs=4)
    found = adapter.take_violations()
    assert {f.kind for f in found} == {"foreign-write"}, found
    assert all(f.request == "a padding row" and "state_indices" in f.what for f in found), found
