"""The adapter examples of docs/python.md run as printed, each in a fresh
process, and say what the page says they say."""

from __future__ import annotations

import pathlib
import re
import subprocess
import sys

import pytest

PAGE = pathlib.Path(__file__).resolve().parents[2] / "docs" / "python.md"


def example(heading: str) -> str:
    text = PAGE.read_text()
    start = text.index(heading)
    block = re.search(r"```python\n(.*?)```", text[start:], re.S)
    assert block, f"no python example under {heading}"
    return block.group(1)


@pytest.mark.parametrize(
    "heading, module, finding",
    [
        ("## vLLM: `kvsan.vllm`", "vllm.v1.core.kv_cache_manager", "double-free"),
        ("## SGLang: `kvsan.sglang`", "sglang.srt.mem_cache.radix_cache", "double-alloc"),
    ],
)
def test_adapter_example_runs(heading, module, finding, tmp_path):
    pytest.importorskip(module)
    run = subprocess.run(
        [sys.executable, "-c", example(heading)],
        capture_output=True,
        text=True,
        timeout=600,
        cwd=tmp_path,
        env={"KVSAN_OPTIONS": f"log_path={tmp_path}/kvsan", "PATH": "/usr/bin:/bin", "HOME": str(tmp_path)},
    )
    assert run.returncode == 0, run.stderr[-3000:]
    lines = run.stdout.splitlines()
    assert len(lines) == 2, run.stdout
    assert f"kind='{finding}'" in lines[0] or f" {finding}: " in lines[0], lines[0]
    assert re.match(rf"kvsan: \d+ violations? \({finding}: \d+\)", lines[1]), lines[1]
