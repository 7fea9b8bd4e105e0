"""The ctypes description of the C ABI (``kvsan._abi``) against the C header
it describes (``shim/include/kvsan.h``): a signature or struct that drifted
from the library's would pass the wrong bytes to a memory sanitizer without
any error, so every declared function is compared with its prototype, every
struct's size and field offsets with what the C compiler lays out, and the
event and role codes with the header's."""

from __future__ import annotations

import ctypes
import os
import re
import shutil
import subprocess
from pathlib import Path

import pytest

from kvsan import _abi

HEADER = Path(__file__).resolve().parents[2] / "shim" / "include" / "kvsan.h"

# C type (as the header writes it, `const` dropped) → the ctypes type that
# passes it. On LP64 `size_t` and `uint64_t` are one ctypes type.
SCALARS = {
    "uint32_t": ctypes.c_uint32,
    "int32_t": ctypes.c_int32,
    "uint64_t": ctypes.c_uint64,
    "int64_t": ctypes.c_int64,
    "size_t": ctypes.c_size_t,
    "char": ctypes.c_char,
}
STRUCTS = {
    "KvsanOwner": _abi.Owner,
    "KvsanPageRef": _abi.PageRef,
    "KvsanRange": _abi.CRange,
    "KvsanPoolGeometry": _abi.PoolGeometry,
    "KvsanVerdict": _abi.CVerdict,
    "KvsanManifest": _abi.Manifest,
    "KvsanPageLanding": _abi.PageLanding,
}


def header() -> str:
    text = HEADER.read_text()
    # Comments out, so a prototype quoted in prose is not taken for one.
    text = re.sub(r"/\*.*?\*/", " ", text, flags=re.S)
    return re.sub(r"//[^\n]*", " ", text)


def prototypes() -> dict[str, tuple[str, list[str]]]:
    """Every ``kvsan_*`` function the header declares: return type and
    argument types, whitespace normalised, `const` kept."""
    found = {}
    for m in re.finditer(r"([A-Za-z_][\w \t*]*?)\b(kvsan_\w+)\s*\(([^)]*)\)\s*;", header()):
        ret, name, args = m.group(1), m.group(2), m.group(3)
        if "typedef" in ret:
            continue
        params = [] if args.strip() in ("", "void") else [a.strip() for a in args.split(",")]
        # Drop each parameter's name: what is left is its type.
        types = [re.sub(r"\s*\b\w+$", "", " ".join(p.split())) for p in params]
        found[name] = (" ".join(ret.split()), types)
    return found


def ctype_of(c: str):
    """The ctypes type that passes the C type `c`."""
    c = c.replace("const ", "").strip()
    if c.endswith("*"):
        inner = c[:-1].strip()
        if inner == "char":
            return "char*"
        return ctypes.POINTER(ctype_of(inner))
    if c in SCALARS:
        return SCALARS[c]
    if c in STRUCTS:
        return STRUCTS[c]
    raise AssertionError(f"the test does not know the C type {c!r}")


def same(py, c: str) -> bool:
    want = ctype_of(c)
    if want == "char*":
        return py is ctypes.c_char_p or py == ctypes.POINTER(ctypes.c_char)
    return py == want


def test_every_declared_function_has_the_headers_signature():
    protos = prototypes()
    assert len(protos) >= 30, f"parsed only {sorted(protos)}"
    for name, (restype, argtypes) in _abi.SIGNATURES.items():
        assert name in protos, f"{name} is declared in Python but not in kvsan.h"
        c_ret, c_args = protos[name]
        assert same(restype, c_ret), f"{name}: returns {c_ret}, Python says {restype}"
        assert len(argtypes) == len(c_args), f"{name}: {len(c_args)} arguments in kvsan.h ({c_args}), {len(argtypes)} in Python"
        for i, (py, c) in enumerate(zip(argtypes, c_args)):
            assert same(py, c), f"{name}: argument {i} is {c} in kvsan.h, {py} in Python"


def test_a_drifted_signature_is_caught():
    # The check itself: an argument type swapped, or one left out, fails it.
    protos = prototypes()
    c_ret, c_args = protos["kvsan_free"]
    swapped = [ctypes.c_uint64 if a is _abi.PageRef else a for a in _abi.SIGNATURES["kvsan_free"][1]]
    assert not all(same(py, c) for py, c in zip(swapped, c_args))
    assert not same(ctypes.POINTER(_abi.Owner), "const KvsanPageRef *")
    assert not same(ctypes.c_int32, "uint32_t")


def test_event_and_role_codes_are_the_headers():
    defines = dict(re.findall(r"#define (KVSAN_(?:EVENT|ROLE)_\w+) (\d+)u", HEADER.read_text()))
    for name, code in _abi.EVENTS.items():
        assert int(defines[f"KVSAN_EVENT_{name.upper()}"]) == code, name
    for name, code in _abi.ROLES.items():
        assert int(defines[f"KVSAN_ROLE_{name.upper()}"]) == code, name
    assert len([d for d in defines if d.startswith("KVSAN_EVENT_")]) == len(_abi.EVENTS)
    landing = re.search(r"#define KVSAN_POOL_REPORTS_LANDING (0x[0-9a-fA-F]+)u", HEADER.read_text())
    assert int(landing.group(1), 16) == _abi.POOL_REPORTS_LANDING


def test_the_python_abi_version_is_one_the_header_still_speaks():
    text = HEADER.read_text()
    major = int(re.search(r"#define KVSAN_ABI_VERSION_MAJOR (\d+)", text).group(1))
    minor = int(re.search(r"#define KVSAN_ABI_VERSION_MINOR (\d+)", text).group(1))
    assert _abi.ABI_VERSION_MAJOR == major
    assert _abi.ABI_VERSION_MINOR <= minor


@pytest.mark.skipif(shutil.which(os.environ.get("CC", "cc")) is None, reason="requires a C compiler")
def test_every_struct_is_laid_out_as_the_c_compiler_lays_it_out(tmp_path):
    lines = ['#include <stddef.h>', '#include <stdio.h>', '#include "kvsan.h"', "int main(void) {"]
    for c_name, py in STRUCTS.items():
        lines.append(f'printf("{c_name} size %zu\\n", sizeof({c_name}));')
        for field, _ in py._fields_:
            lines.append(f'printf("{c_name} {field} %zu\\n", offsetof({c_name}, {field}));')
    lines += ["return 0;", "}"]
    src = tmp_path / "layout.c"
    src.write_text("\n".join(lines))
    exe = tmp_path / "layout"
    subprocess.run(
        [os.environ.get("CC", "cc"), "-std=c11", "-I", str(HEADER.parent), str(src), "-o", str(exe)],
        check=True,
    )
    out = subprocess.run([str(exe)], check=True, capture_output=True, text=True).stdout
    c_layout = {tuple(line.rsplit(" ", 1)[0].split(" ", 1)): int(line.rsplit(" ", 1)[1]) for line in out.splitlines()}
    for c_name, py in STRUCTS.items():
        assert ctypes.sizeof(py) == c_layout[(c_name, "size")], c_name
        for field, _ in py._fields_:
            assert getattr(py, field).offset == c_layout[(c_name, field)], f"{c_name}.{field}"
