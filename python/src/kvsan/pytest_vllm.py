"""A pytest plugin that runs vLLM's own tests with kvsan attached.

``pytest -p kvsan.pytest_vllm tests/v1/core/...`` (from a vLLM source
tree) attaches :mod:`kvsan.vllm` before the first test. A test during which
kvsan reports a violation fails with the findings (violation id, kind,
block, request); the reports themselves go where ``KVSAN_OPTIONS`` says.
The run ends with the adapter's counts and kvsan's summary line.
"""

from __future__ import annotations

import os
from typing import Any, Iterator

import pytest

from . import vllm as _vllm

_adapter: _vllm.Adapter | None = None
_failed: list[str] = []


def pytest_configure(config: pytest.Config) -> None:
    global _adapter
    if _adapter is None:
        strict = os.environ.get("KVSAN_VLLM_STRICT_CACHED_REWRITES", "") not in ("", "0")
        _adapter = _vllm.attach(strict_cached_rewrites=strict)


def pytest_unconfigure(config: pytest.Config) -> None:
    global _adapter
    if _adapter is not None:
        _adapter.detach()
        _adapter = None


@pytest.hookimpl(wrapper=True)
def pytest_runtest_call(item: pytest.Item) -> Iterator[None]:
    assert _adapter is not None
    _adapter.take_violations()
    result = yield
    found = _adapter.take_violations()
    if found:
        _failed.append(item.nodeid)
        lines = "\n".join(f"  {f}" for f in found)
        raise pytest.fail.Exception(f"kvsan: {len(found)} violation(s) while the test ran:\n{lines}", pytrace=False)
    return result


def pytest_terminal_summary(terminalreporter: Any) -> None:
    if _adapter is None:
        return
    tr = terminalreporter
    tr.section("kvsan")
    tr.write_line(
        f"kvsan.vllm: {_adapter.events} block events checked in {_adapter.checked_pools} pool(s), "
        f"{len(_failed)} test(s) with violations, "
        f"{_adapter.unchecked_blocks} partial-entry block(s) left unchecked"
    )
    if _adapter.strict_cached_rewrites:
        tr.write_line("  strict: a request recomputing a cached block's own tokens is reported (foreign-write)")
    else:
        tr.write_line(
            f"  {_adapter.cached_rewrites} write(s) of a cached block's own tokens by a request "
            "recomputing them (not violations; KVSAN_VLLM_STRICT_CACHED_REWRITES=1 reports them)"
        )
    for reason, n in sorted(_adapter.unchecked_pools.items()):
        tr.write_line(f"  {n} pool(s) left unchecked: {reason}")
    tr.write_line(f"  {_adapter.checked_steps} model runner step(s) checked (slot mappings, block tables)")
    for reason, n in sorted(_adapter.unchecked_steps.items()):
        tr.write_line(f"  {n} model runner step(s) left unchecked: {reason}")
    tr.write_line(f"  {_adapter.checked_transfers} NIXL READ(s) checked (descriptors: destination and source blocks)")
    for reason, n in sorted(_adapter.unchecked_transfers.items()):
        tr.write_line(f"  {n} NIXL transfer(s) left unchecked: {reason}")
    for nodeid in _failed:
        tr.write_line(f"  violations in {nodeid}")
    tr.write_line(_adapter.san.summary())
