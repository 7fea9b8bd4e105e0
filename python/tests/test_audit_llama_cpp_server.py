"""`kvsan audit` against a server no one here wrote: llama.cpp's server
through llama-cpp-python, on the same GGUF file kvsan serves.

What it shows about that server, asserted: it is deterministic, it refuses
prompts over its context with a 400 naming the limit, and its prompt cache
is shared across API keys (the server has no tenants: a prefix one client
sent makes another client's first token faster) — found by the timing
test, exit status 1. It accepts `cache_salt` and ignores it: a prefix
cached under one salt serves the same key's request with another salt,
and another key's with the same salt (the salt assertions, each paired
with the control that hits). The scheduling-order phase is not run here:
the server answers one request at a time in arrival order (docs/audit.md
shows the phase's run on it).

`scripts/test` builds llama-cpp-python from source into this virtual
environment and names the `kvsan` binary and the model in `KVSAN_BIN` and
`KVSAN_MODEL`.
"""

from __future__ import annotations

import json
import os
import socket
import subprocess
import sys
import time
import urllib.request
from pathlib import Path

import pytest

llama_cpp = pytest.importorskip("llama_cpp", reason="llama-cpp-python is not installed (scripts/test installs it)")

CONTEXT = 256


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _path(var: str) -> Path:
    value = os.environ.get(var)
    if not value:
        pytest.fail(f"{var} is not set: run the tests through scripts/test")
    path = Path(value)
    assert path.exists(), f"{var}={path} does not exist"
    return path


def _server_state(server: subprocess.Popen, log: Path) -> str:
    """Whether the server still runs (its exit status if not) and the end
    of its log: what a failure here needs to be told apart from kvsan's."""
    code = server.poll()
    state = "still running" if code is None else f"exited with status {code}"
    return f"llama_cpp.server {state}; the end of its log:\n{log.read_text(errors='replace')[-3000:]}"


@pytest.fixture(scope="module")
def llama_server(tmp_path_factory):
    model = _path("KVSAN_MODEL")
    port = _free_port()
    log = tmp_path_factory.mktemp("llama") / "server.log"
    server = subprocess.Popen(
        [sys.executable, "-m", "llama_cpp.server", "--model", str(model), "--n_ctx", str(CONTEXT),
         "--host", "127.0.0.1", "--port", str(port), "--n_threads", "1"],
        stdout=subprocess.DEVNULL,
        stderr=log.open("wb"),
    )
    url = f"http://127.0.0.1:{port}"
    deadline = time.monotonic() + 120
    while True:
        try:
            with urllib.request.urlopen(f"{url}/v1/models", timeout=2) as r:
                if r.status == 200:
                    break
        except OSError:
            pass
        if server.poll() is not None or time.monotonic() > deadline:
            server.kill()
            pytest.fail(f"llama_cpp.server did not start on {url}: {_server_state(server, log)}")
        time.sleep(0.5)
    # One completion before the audit: a server that cannot decode (a
    # build for another CPU dies in its first decode) fails here, named,
    # rather than as an audit that found the server unresponsive.
    body = json.dumps({"prompt": "One", "max_tokens": 1, "temperature": 0}).encode()
    request = urllib.request.Request(f"{url}/v1/completions", data=body,
                                     headers={"content-type": "application/json"})
    try:
        with urllib.request.urlopen(request, timeout=120) as r:
            assert r.status == 200, r.status
    except OSError as e:
        server.kill()
        server.wait()
        pytest.fail(f"llama_cpp.server on {url} answered no completion ({e}): {_server_state(server, log)}")
    yield url, server, log
    server.terminate()
    try:
        server.wait(timeout=10)
    except subprocess.TimeoutExpired:
        server.kill()


@pytest.fixture(scope="module")
def audit(llama_server):
    """One audit of the server: limits, prefix timing and the salt
    assertions, six timed samples per arm. The third element, for the
    assertion messages, is the end of the audit's stderr and the server's
    state."""
    url, server, log = llama_server
    kvsan = _path("KVSAN_BIN")
    out = subprocess.run(
        [str(kvsan), "audit", "--base-url", url, "--api-key", "sk-a", "--other-api-key", "sk-b",
         "--context-length", str(CONTEXT), "--phases", "limits,timing,salt", "--timing-samples", "6",
         "--budget", "200", "--seed", "1", "--json"],
        capture_output=True,
        text=True,
        timeout=1200,
    )
    return out.returncode, json.loads(out.stdout), out.stderr[-2000:] + "\n" + _server_state(server, log)


def test_the_audit_finds_llama_cpp_servers_prompt_cache_shared_across_keys(audit):
    code, report, stderr = audit
    assert code == 1, (code, report, stderr)
    assert all(n.startswith("phases not run") for n in report["notes"]), report
    assert report["determinism"]["deterministic"], report
    same, other = report["timing"]
    assert same["verdict"].startswith("cache detected"), report
    assert other["verdict"].startswith("hit across keys"), report
    assert "cross-key-prefix-cache" in [f["rule"] for f in report["findings"]], report
    limits = {probe["name"]: probe for probe in report["limits"]}
    for over in ("just over the context", "twice the context"):
        assert limits[over]["status"] == 400, limits[over]
        assert "maximum context length is 256 tokens" in limits[over]["outcome"], limits[over]


def test_llama_cpp_server_accepts_cache_salt_and_ignores_it(audit):
    code, report, stderr = audit
    rules = sorted(f["rule"] for f in report["findings"])
    assert rules == ["cross-key-prefix-cache", "salt-not-isolating", "salt-not-isolating",
                     "salt-shared-across-keys"], (code, report, stderr)
    arms = {arm["name"]: arm for arm in report["salt"]}
    assert arms["same key, same salt"]["hit"], arms
    assert arms["same key, same salt"]["verdict"].startswith("hit"), arms
    for name in ("same key, other salt", "same key, no salt", "other key, same salt"):
        assert arms[name]["hit"], arms[name]
        assert "(finding)" in arms[name]["verdict"], arms[name]
