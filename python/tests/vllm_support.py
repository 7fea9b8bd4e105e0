"""What the tests that drive vLLM's own classes share: the release's test
helpers on the path, and the one-process gloo group vLLM's workers need."""

from __future__ import annotations

import contextlib
import os
import sys
import tempfile
from typing import Any, Iterator

import pytest


def vllm_test_helpers(module: str) -> None:
    """Skips the calling test module unless vLLM (``module`` of it) imports
    and the release's tests are there (``VLLM_SRC``, set by ``bash
    scripts/vllm-tests run``); puts those tests on the path."""
    pytest.importorskip(module)
    if not os.environ.get("VLLM_SRC"):
        pytest.skip("needs vLLM's test helpers: VLLM_SRC (bash scripts/vllm-tests setup)", allow_module_level=True)
    sys.path.insert(0, os.environ["VLLM_SRC"])


@contextlib.contextmanager
def gloo_group(config: Any) -> Iterator[None]:
    """One-process gloo group, as vLLM's ``dist_init`` fixture makes."""
    from vllm.config import set_current_vllm_config
    from vllm.distributed import cleanup_dist_env_and_memory
    from vllm.distributed.parallel_state import init_distributed_environment, initialize_model_parallel

    fd, path = tempfile.mkstemp()
    os.close(fd)
    with set_current_vllm_config(config):
        init_distributed_environment(world_size=1, rank=0, distributed_init_method=f"file://{path}", local_rank=0, backend="gloo")
        initialize_model_parallel(1, 1)
    try:
        yield
    finally:
        cleanup_dist_env_and_memory()
        with contextlib.suppress(FileNotFoundError):
            os.unlink(path)
