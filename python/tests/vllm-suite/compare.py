"""Compares two junit reports of the same vLLM tests, without and with
kvsan attached: every test that passed without kvsan must pass with it.

usage: compare.py WITHOUT.xml WITH.xml FINDINGS.txt [MIN_PASSED]

A test listed in FINDINGS.txt (test, violation kind) must instead fail with
that kvsan violation, which the file explains.
"""

from __future__ import annotations

import sys
import xml.etree.ElementTree as ET
from collections import Counter


def outcomes(path: str) -> dict[str, tuple[str, str]]:
    """Each test's outcome and, if it did not pass, its failure text."""
    out: dict[str, tuple[str, str]] = {}
    for case in ET.parse(path).iter("testcase"):
        name = f"{case.get('classname')}::{case.get('name')}"
        state, message = "passed", ""
        for child in case:
            if child.tag in ("failure", "error", "skipped"):
                state, message = child.tag, (child.get("message") or "") + "\n" + (child.text or "")
        out[name] = (state, message)
    return out


def first(message: str) -> str:
    return message.strip().splitlines()[0][:160] if message.strip() else ""


def findings(path: str) -> dict[str, str]:
    out = {}
    for line in open(path):
        line = line.split("#")[0].split()
        if line:
            out[line[0]] = line[1]
    return out


def main() -> int:
    without, with_kvsan = outcomes(sys.argv[1]), outcomes(sys.argv[2])
    known = findings(sys.argv[3])
    least = int(sys.argv[4]) if len(sys.argv) > 4 else 500
    passed = [t for t, (s, _) in without.items() if s == "passed"]
    lost = [t for t in passed if with_kvsan.get(t, ("missing", ""))[0] != "passed"]
    status = 0
    found = 0
    for t, kind in known.items():
        state, message = with_kvsan.get(t, ("missing", ""))
        if t in lost and f" {kind}: " in message and "violation(s) while the test ran" in message:
            lost.remove(t)
            found += 1
            print(f"  FOUND by kvsan ({kind}), as findings.txt explains: {t}")
        else:
            print(f"  listed finding not found: {t} ({kind}): {state}: {first(message)}")
            status = 1
    others = Counter(first(m).split(" for ")[0].split(", line ")[0] for t, (s, m) in without.items() if s != "passed")
    print(f"vLLM tests: {len(without)} run; {len(passed)} pass without kvsan; "
          f"{len(passed) - len(lost) - found} of them pass with kvsan attached, "
          f"{found} fail with a listed kvsan finding, {len(lost)} fail otherwise")
    for message, n in others.most_common():
        print(f"  {n} fail without kvsan too: {message}")
    for t in lost:
        state, message = with_kvsan.get(t, ("missing", ""))
        print(f"  LOST with kvsan: {t}: {state}: {first(message)}")
    if len(passed) < least:
        print(f"only {len(passed)} tests pass without kvsan (at least {least} expected): the setup is broken")
        return 1
    return 1 if lost else status


if __name__ == "__main__":
    sys.exit(main())
