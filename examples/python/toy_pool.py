#!/usr/bin/env python3
"""A toy engine in Python that annotates its own KV page pool with kvsan.

Standard library only (ctypes). The same lifecycle as shim/examples/toy_pool.c:
a pool of 4 pages x 4 slots x 2 layers with a LIFO free list that does not
clear pages on reuse;

  victim    allocates page 0, computes 4 slots, reads them, frees the page
  probe     gets page 0 back, computes only slot 0, attention reads 4 slots
            -> kvsan: abort, stale-read (the report goes to stderr)
  neighbour allocates page 1, computes 3 slots, reads 3 -> continue

Usage:  python3 examples/python/toy_pool.py [path/to/libkvsan_shim.so]
(default: $KVSAN_SHIM, else target/debug/libkvsan_shim.so). Exit status 0
when every verdict is the expected one.
"""

import ctypes
import os
import sys
from ctypes import POINTER, Structure, byref, c_char, c_char_p, c_int32, c_size_t, c_uint16
from ctypes import c_uint32, c_uint64, c_void_p, sizeof

ABI_VERSION = (1 << 16) | 0  # KVSAN_ABI_VERSION of shim/include/kvsan.h
KVSAN_OK = 0
VERDICT_CONTINUE, VERDICT_ABORT = 0, 1
ROLE_UNIFIED = 0
QUEUED, ADMITTED, PREFILLING, TRANSFERRING, DECODING, FINISHED, REJECTED, ABORTED = range(8)


class Owner(Structure):
    _fields_ = [("request", c_uint64), ("tenant", c_uint32), ("reserved", c_uint32)]


class PageRef(Structure):
    _fields_ = [("page", c_uint32), ("generation", c_uint32)]


class Range(Structure):
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


class Verdict(Structure):
    _fields_ = [("code", c_uint32), ("kind", c_uint32), ("violation_id", c_uint64)]


class KvsanError(Exception):
    """A call the library refused (a negative KVSAN_ERR_* status)."""


class Kvsan:
    """The C functions of libkvsan_shim.so, with their signatures declared."""

    def __init__(self, path):
        lib = ctypes.CDLL(path)
        sigs = {
            "kvsan_check_version": (c_int32, [c_uint32]),
            "kvsan_pool_register": (c_int32, [POINTER(PoolGeometry), c_size_t, POINTER(c_uint32)]),
            "kvsan_request_event": (c_int32, [Owner, c_uint32, POINTER(Verdict)]),
            "kvsan_alloc": (c_int32, [c_uint32, Owner, c_uint32, c_uint64, POINTER(PageRef), POINTER(Verdict)]),
            "kvsan_free": (c_int32, [c_uint32, Owner, PageRef, c_uint64, POINTER(Verdict)]),
            "kvsan_write": (c_int32, [c_uint32, Owner, PageRef, Range, Range, c_uint64, POINTER(Verdict)]),
            "kvsan_read": (c_int32, [c_uint32, Owner, POINTER(PageRef), c_size_t, c_uint64, Range, c_uint64, POINTER(Verdict)]),
            "kvsan_violation_count": (c_int32, [POINTER(c_uint64)]),
            "kvsan_summary": (c_int32, [POINTER(c_char), c_size_t, POINTER(c_size_t)]),
            "kvsan_last_error": (c_size_t, [POINTER(c_char), c_size_t]),
            "kvsan_violation_kind_name": (c_char_p, [c_uint32]),
            "kvsan_status_name": (c_char_p, [c_int32]),
        }
        for name, (restype, argtypes) in sigs.items():
            f = getattr(lib, name)
            f.restype, f.argtypes = restype, argtypes
        self.lib = lib

    def call(self, name, *args):
        status = getattr(self.lib, name)(*args)
        if status != KVSAN_OK:
            buf = ctypes.create_string_buffer(512)
            self.lib.kvsan_last_error(buf, len(buf))
            code = self.lib.kvsan_status_name(status)
            raise KvsanError(f"{name}: {code.decode() if code else status}: {buf.value.decode()}")

    def checked(self, name, *args):
        """Calls a check and returns its Verdict."""
        v = Verdict()
        self.call(name, *args, byref(v))
        return v

    def kind(self, v):
        return self.lib.kvsan_violation_kind_name(v.kind).decode()


class ToyPool:
    """4 pages x 4 slots x 2 layers; a LIFO free list; pages never cleared."""

    PAGES, SLOTS, LAYERS = 4, 4, 2

    def __init__(self, kv):
        self.kv = kv
        self.node = b"toy-python"
        g = PoolGeometry(self.PAGES, self.SLOTS, self.LAYERS, ROLE_UNIFIED, 128, self.node, len(self.node))
        pool = c_uint32()
        kv.call("kvsan_pool_register", byref(g), sizeof(g), byref(pool))
        self.pool = pool.value
        self.free_list = list(reversed(range(self.PAGES)))

    def alloc(self, who):
        ref = PageRef()
        self.kv.checked("kvsan_alloc", self.pool, who, self.free_list.pop(), 0, byref(ref))
        return ref

    def free(self, who, ref):
        self.kv.checked("kvsan_free", self.pool, who, ref, 0)
        self.free_list.append(ref.page)

    def compute_and_read(self, who, ref, computed, read):
        layers = Range(0, self.LAYERS)
        self.kv.checked("kvsan_write", self.pool, who, ref, Range(0, computed), layers, 1)
        table = (PageRef * 1)(ref)
        return self.kv.checked("kvsan_read", self.pool, who, table, 1, read, layers, 2)


def main():
    default = os.environ.get("KVSAN_SHIM", os.path.join("target", "debug", "libkvsan_shim.so"))
    kv = Kvsan(sys.argv[1] if len(sys.argv) > 1 else default)
    kv.call("kvsan_check_version", ABI_VERSION)
    pool = ToyPool(kv)
    failures = 0

    def events(who, *codes):
        for code in codes:
            kv.checked("kvsan_request_event", who, code)

    def expect(who_name, v, code, kind=None):
        nonlocal failures
        shown = "continue" if v.code == VERDICT_CONTINUE else f"abort {kv.kind(v)} KV-{v.violation_id:06d}"
        print(f"{who_name} read: {shown}")
        if v.code != code or (kind is not None and kv.kind(v) != kind):
            print(f"{who_name}: unexpected verdict")
            failures += 1

    victim, probe, neighbour = Owner(1, 7, 0), Owner(2, 9, 0), Owner(3, 9, 0)

    events(victim, QUEUED, ADMITTED, DECODING)
    v_page = pool.alloc(victim)
    expect("victim", pool.compute_and_read(victim, v_page, 4, 4), VERDICT_CONTINUE)
    pool.free(victim, v_page)
    events(victim, FINISHED)

    events(probe, QUEUED, ADMITTED, DECODING)
    p_page = pool.alloc(probe)
    if p_page.page != v_page.page:
        print("probe did not get the victim's page back")
        failures += 1
    expect("probe", pool.compute_and_read(probe, p_page, 1, 4), VERDICT_ABORT, "stale-read")
    pool.free(probe, p_page)  # the engine aborts the probe: free, then the event
    events(probe, ABORTED)

    events(neighbour, QUEUED, ADMITTED, DECODING)
    n_page = pool.alloc(neighbour)
    expect("neighbour", pool.compute_and_read(neighbour, n_page, 3, 3), VERDICT_CONTINUE)
    pool.free(neighbour, n_page)
    events(neighbour, FINISHED)

    count = c_uint64()
    kv.call("kvsan_violation_count", byref(count))
    buf, n = ctypes.create_string_buffer(256), c_size_t()
    kv.call("kvsan_summary", buf, len(buf), byref(n))
    print(f"violations: {count.value}\nsummary: {buf.value.decode()}")
    if count.value != 1:
        failures += 1

    # A malformed call is an exception carrying the library's message, not a crash.
    try:
        kv.checked("kvsan_request_event", Owner(4, 0, 0), 42)
        print("an unknown event code was accepted")
        failures += 1
    except KvsanError as e:
        print(f"refused: {e}")

    return 0 if failures == 0 else 1


if __name__ == "__main__":
    sys.exit(main())
