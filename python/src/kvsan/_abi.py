"""The C ABI of the kvsan shim (``shim/include/kvsan.h``): structs, codes,
and the library with every function's signature declared."""

from __future__ import annotations

import ctypes
import os
from ctypes import (
    POINTER,
    Structure,
    c_char,
    c_char_p,
    c_int32,
    c_int64,
    c_size_t,
    c_uint32,
    c_uint64,
)
from pathlib import Path
from typing import Any

ABI_VERSION_MAJOR = 1
ABI_VERSION_MINOR = 6
ABI_VERSION = (ABI_VERSION_MAJOR << 16) | ABI_VERSION_MINOR
# KVSAN_PREFIX_CACHE_REQUEST: the request id of the prefix cache as a page
# holder (share to register a page, free to evict it); never a request's.
PREFIX_CACHE_REQUEST = (1 << 64) - 1
KVSAN_OK = 0
KVSAN_ERR_OUT_OF_RANGE_NAME = "KVSAN_ERR_OUT_OF_RANGE"
VERDICT_CONTINUE = 0
VERDICT_ABORT = 1

ROLES = {"unified": 0, "prefill": 1, "decode": 2}
# OR'd into a pool's role (since ABI 1.5): the engine reports where received
# KV lands (transfer_land, transfer_verify); transfer_recv only reserves.
POOL_REPORTS_LANDING = 0x100
EVENTS = {
    "queued": 0,
    "admitted": 1,
    "prefilling": 2,
    "transferring": 3,
    "decoding": 4,
    "finished": 5,
    "rejected": 6,
    "aborted": 7,
}


class Owner(Structure):
    """A request and the tenant it is billed to."""

    _fields_ = [("request", c_uint64), ("tenant", c_uint32), ("reserved", c_uint32)]

    def __init__(self, request: int, tenant: int = 0) -> None:
        super().__init__(request, tenant, 0)

    def __repr__(self) -> str:
        return f"Owner(request={self.request}, tenant={self.tenant})"


class PageRef(Structure):
    """A block-table entry: page index and the generation it was taken at."""

    _fields_ = [("page", c_uint32), ("generation", c_uint32)]

    def __repr__(self) -> str:
        return f"PageRef(page={self.page}, generation={self.generation})"

    def __eq__(self, other: object) -> bool:
        return (
            isinstance(other, PageRef)
            and (self.page, self.generation) == (other.page, other.generation)
        )

    def __hash__(self) -> int:
        return hash((self.page, self.generation))


class CRange(Structure):
    _fields_ = [("start", c_uint32), ("end", c_uint32)]


class PoolGeometry(Structure):
    _fields_ = [
        ("pages", c_uint32),
        ("page_slots", c_uint32),
        ("layers", c_uint32),
        ("role", c_uint32),
        ("bytes_per_slot", c_uint64),
        ("node", c_char_p),
        ("node_len", c_size_t),
    ]


class Manifest(Structure):
    """What a KV transfer claims to carry (block tables from token 0)."""

    _fields_ = [
        ("request", Owner),
        ("src_pool", c_uint32),
        ("dst_pool", c_uint32),
        ("src_pages", POINTER(PageRef)),
        ("src_len", c_size_t),
        ("dst_pages", POINTER(PageRef)),
        ("dst_len", c_size_t),
        ("first_token", c_uint32),
        ("tokens", c_uint32),
        ("layers", CRange),
        ("checksum", c_uint64),
    ]


class PageLanding(Structure):
    """One destination page of a transfer: which tokens land in which slots
    (since ABI 1.5)."""

    _fields_ = [
        ("request", Owner),
        ("page", PageRef),
        ("first_token", c_uint64),
        ("slots", CRange),
        ("layers", CRange),
        ("sent_digest", c_uint64),
        ("landed_digest", c_uint64),
    ]


class CVerdict(Structure):
    _fields_ = [("code", c_uint32), ("kind", c_uint32), ("violation_id", c_uint64)]


_V = POINTER(CVerdict)
SIGNATURES = {
    "kvsan_abi_version": (c_uint32, []),
    "kvsan_check_version": (c_int32, [c_uint32]),
    "kvsan_attached": (c_int32, []),
    "kvsan_pool_register": (c_int32, [POINTER(PoolGeometry), c_size_t, POINTER(c_uint32)]),
    "kvsan_request_event": (c_int32, [Owner, c_uint32, _V]),
    "kvsan_request_event_at": (c_int32, [c_uint32, Owner, c_uint32, _V]),
    "kvsan_alloc": (c_int32, [c_uint32, Owner, c_uint32, c_uint64, POINTER(PageRef), _V]),
    "kvsan_free": (c_int32, [c_uint32, Owner, PageRef, c_uint64, _V]),
    "kvsan_share": (c_int32, [c_uint32, PageRef, Owner, _V]),
    "kvsan_declare_salt": (c_int32, [Owner, c_uint64, _V]),
    "kvsan_write": (c_int32, [c_uint32, Owner, PageRef, CRange, CRange, c_uint64, _V]),
    "kvsan_read": (
        c_int32,
        [c_uint32, Owner, POINTER(PageRef), c_size_t, c_uint64, CRange, c_uint64, _V],
    ),
    # Transfers between a prefill and a decode node (land and verify since 1.5).
    "kvsan_transfer_send": (c_int32, [c_uint32, POINTER(Manifest), c_size_t, _V]),
    "kvsan_transfer_recv": (c_int32, [c_uint32, POINTER(Manifest), c_size_t, _V]),
    "kvsan_transfer_land": (c_int32, [c_uint32, POINTER(PageLanding), c_size_t, _V]),
    "kvsan_transfer_verify": (c_int32, [c_uint32, POINTER(PageLanding), c_size_t, _V]),
    "kvsan_transfer_commit": (c_int32, [c_uint32, Owner, POINTER(PageRef), c_size_t, c_uint64, _V]),
    # KV tiers: a page stored into a tier block and loaded back (since 1.6).
    "kvsan_tier_store": (c_int32, [c_uint32, Owner, PageRef, c_uint32, c_uint64, c_uint64, _V]),
    "kvsan_tier_store_done": (c_int32, [c_uint32, c_uint64, c_uint64, c_uint32, _V]),
    "kvsan_tier_load": (c_int32, [c_uint32, Owner, PageRef, c_uint32, c_uint64, c_uint64, _V]),
    "kvsan_tier_verify": (c_int32, [c_uint32, Owner, PageRef, c_uint32, c_uint64, c_uint64, _V]),
    "kvsan_tier_release": (c_int32, [c_uint32, c_uint64, _V]),
    "kvsan_violation_count": (c_int32, [POINTER(c_uint64)]),
    "kvsan_violation_count_of": (c_int32, [c_uint32, POINTER(c_uint64)]),
    "kvsan_check_count": (c_int32, [POINTER(c_uint64)]),
    "kvsan_summary": (c_int32, [POINTER(c_char), c_size_t, POINTER(c_size_t)]),
    "kvsan_last_error": (c_size_t, [POINTER(c_char), c_size_t]),
    "kvsan_refused_calls": (c_uint64, []),
    "kvsan_violation_kind_name": (c_char_p, [c_uint32]),
    "kvsan_status_name": (c_char_p, [c_int32]),
}

# The batch layouts, as kvsan_sanitizer::for_each_batch_layout! lists them:
# each layout's C arguments after ``rows``, in order. A buffer is (name,
# value type, length): "rows" (one value per row), "offsets" (one more), or
# the name of its own length argument, a ``size_t`` right after it; a
# scalar is (name, None, None), a ``size_t``. ``kvsan_check_<layout>`` takes
# each buffer as a pointer, ``kvsan_check_<layout>_device`` (since ABI 1.3)
# as a CUDA device address, after ``device``.
BATCH_LAYOUTS: dict[str, list[tuple[str, Any, str | None]]] = {
    "block_table": [("block_table", c_int32, "table_len"), ("stride", None, None), ("seq_lens", c_int32, "rows")],
    "paged_csr": [("indptr", c_int32, "offsets"), ("indices", c_int32, "nnz"), ("last_page_len", c_int32, "rows")],
    "req_to_token": [
        ("req_to_token", c_int32, "table_len"),
        ("stride", None, None),
        ("req_indices", c_int32, "rows"),
        ("seq_lens", c_int32, "rows"),
    ],
    "slot_mapping": [("query_start_loc", c_int32, "offsets"), ("slot_mapping", c_int64, "tokens")],
}


def _batch_signature(layout: str, device: bool) -> tuple[Any, list[Any]]:
    args: list[Any] = [c_uint32, *([c_int32] if device else []), POINTER(Owner), c_size_t]
    for _name, value, length in BATCH_LAYOUTS[layout]:
        if value is None:
            args.append(c_size_t)
            continue
        args.append(c_uint64 if device else POINTER(value))
        if length not in ("rows", "offsets"):
            args.append(c_size_t)
    return (c_int32, [*args, CRange, c_uint64, _V])


for _layout in BATCH_LAYOUTS:
    SIGNATURES[f"kvsan_check_{_layout}"] = _batch_signature(_layout, False)
    SIGNATURES[f"kvsan_check_{_layout}_device"] = _batch_signature(_layout, True)


def _declared(lib: ctypes.CDLL) -> ctypes.CDLL:
    for name, (restype, argtypes) in SIGNATURES.items():
        fn = getattr(lib, name)
        fn.restype = restype
        fn.argtypes = argtypes
    return lib


def load(path: str | os.PathLike[str] | None = None) -> ctypes.CDLL:
    """The shim library: ``path`` if given; else ``$KVSAN_SHIM``; else the
    one already in the process (``LD_PRELOAD``: never a second copy, which
    would be a second sanitizer); else the one packaged with this module."""
    if path is None:
        path = os.environ.get("KVSAN_SHIM") or None
    if path is not None:
        return _declared(ctypes.CDLL(os.fspath(path)))
    process = ctypes.CDLL(None)
    if hasattr(process, "kvsan_abi_version"):
        return _declared(process)
    here = Path(__file__).resolve().parent
    candidates = sorted(here.glob("kvsan_shim*.so")) + sorted(here.glob("libkvsan_shim*.so"))
    if not candidates:
        raise OSError(
            f"no kvsan shim library in {here} and none preloaded; "
            "install the package with `pip install ./python`, or set KVSAN_SHIM"
        )
    return _declared(ctypes.CDLL(str(candidates[0])))
