"""The Python API over the shim: page events, verdicts, refusals, the batch
checks over kernel buffers, and buffers passed without copies."""

from __future__ import annotations

import array
import ctypes
import itertools

import pytest

import kvsan
from kvsan._arrays import as_c_array

SLOTS, LAYERS = 4, 2
_ids = itertools.count(1000)


@pytest.fixture(scope="module")
def san() -> kvsan.Sanitizer:
    return kvsan.attach()


def owner(tenant: int = 1) -> kvsan.Owner:
    return kvsan.Owner(next(_ids), tenant)


def running(san: kvsan.Sanitizer, *who: kvsan.Owner) -> None:
    for o in who:
        for event in ("queued", "admitted", "decoding"):
            assert san.request_event(o, event).ok


def pool(san: kvsan.Sanitizer, pages: int = 8) -> kvsan.Pool:
    return san.register_pool(pages=pages, page_slots=SLOTS, layers=LAYERS, bytes_per_slot=128, node="pytest")


def test_the_incident_in_miniature_is_a_stale_read_with_a_report(san, capfd):
    p = pool(san, 4)
    victim, probe, neighbour = owner(7), owner(9), owner(9)
    running(san, victim, probe, neighbour)
    page = p.alloc(victim, 0)
    assert page.verdict.ok
    assert p.write(victim, page, range(0, 4)).ok
    assert p.read(victim, [page], 4).ok
    assert p.free(victim, page).ok
    again = p.alloc(probe, 0)
    assert again.page == 0 and again.generation != page.generation
    assert p.write(probe, again, range(0, 1)).ok
    before = san.violation_count("stale-read")
    verdict = p.read(probe, [again], 4)
    assert not verdict.ok and verdict.kind == "stale-read"
    assert verdict.violation and verdict.violation.startswith("KV-")
    assert san.violation_count("stale-read") == before + 1
    err = capfd.readouterr().err
    assert f"kvsan: ERROR: stale-read in request {probe.request}" in err
    assert verdict.violation in err
    other = p.alloc(neighbour, 1)
    assert p.write(neighbour, other, (0, 3)).ok
    assert p.read(neighbour, [other], 3).ok


def test_with_raise_on_violation_a_violation_raises(san):
    raising = kvsan.attach(raise_on_violation=True)
    p = pool(raising)
    a, b = owner(1), owner(2)
    running(raising, a, b)
    page = p.alloc(a, 2)
    p.write(a, page, range(0, SLOTS))
    with pytest.raises(kvsan.Violation) as caught:
        p.read(b, [page], SLOTS)
    assert caught.value.verdict.kind == "foreign-read"


def test_a_transfer_is_written_where_it_lands_and_committed_only_when_complete(san):
    # Prefill ships 6 tokens; decode reserves two pages, and only the copies
    # it reports land: a commit of what did not land is a short transfer.
    pre = san.register_pool(pages=4, page_slots=SLOTS, layers=LAYERS, role="prefill", node="pytest-p")
    dec = san.register_pool(
        pages=4, page_slots=SLOTS, layers=LAYERS, role="decode", node="pytest-d", reports_landing=True
    )
    for short in (False, True):
        req = owner()
        for event in ("queued", "admitted"):
            assert san.request_event(req, event, pre).ok and san.request_event(req, event, dec).ok
        src = [pre.alloc(req, 0), pre.alloc(req, 1)]
        assert pre.write(req, src[0], range(0, SLOTS)).ok and pre.write(req, src[1], range(0, 2)).ok
        assert pre.transfer_send(req, src, 0, 6).ok
        dst = [dec.alloc(req, 2), dec.alloc(req, 3)]
        assert dec.transfer_recv(req, dst, 0, 6).ok
        assert dec.transfer_land(req, dst[0], 0, range(0, SLOTS)).ok
        if not short:
            assert dec.transfer_land(req, dst[1], SLOTS, range(0, 2)).ok
        v = dec.transfer_commit(req, dst, 6)
        assert v.ok is not short and (v.kind == "short-transfer") is short
        for page in dst:
            dec.free(req, page)
        for page in src:
            pre.free(req, page)
    # A copy into a page the request holds but did not reserve is refused
    # before it writes; sending slots prefill never wrote is refused too.
    req, other = owner(), owner()
    running(san, req, other)
    mine, theirs = dec.alloc(req, 0), dec.alloc(other, 1)
    assert dec.transfer_recv(req, [mine], 0, 2).ok
    assert dec.transfer_land(req, theirs, 0, range(0, 2)).kind == "misdirected-transfer"
    assert dec.transfer_verify(req, mine, 0, range(0, 2), 7, 8).kind == "transfer-digest-mismatch"
    assert dec.transfer_verify(req, mine, 0, range(0, 2), 7, 7).ok
    assert dec.transfer_commit(req, [mine], 2).ok
    unwritten = pre.alloc(req, 3)
    assert pre.transfer_send(req, [unwritten], 0, 1).kind == "unwritten-transfer"


def test_a_tier_block_carries_its_pages_identity_out_and_back(san):
    # A preempted request's page goes to the host tier (block 40) and comes
    # back into another page: what it wrote is readable, the rest is not;
    # another request may not have the block, and a second page may not
    # share it.
    p = pool(san)
    a, b = owner(3), owner(4)
    running(san, a, b)
    host, block = 0, 40
    page = p.alloc(a, 0)
    assert p.write(a, page, range(0, 3)).ok
    assert p.tier_store(a, page, host, block).ok
    assert san.tier_store_done(host, block, digest=0x51).ok
    assert p.free(a, page).ok
    back = p.alloc(a, 1)
    assert p.tier_load(a, back, host, block).ok
    assert p.tier_verify(a, back, host, block, 0x51).ok
    assert p.read(a, [back], 3).ok
    assert p.read(a, [back], 4).kind == "stale-read"
    theirs = p.alloc(b, 2)
    assert p.write(b, theirs, range(0, SLOTS)).ok
    assert p.tier_store(b, theirs, host, block).kind == "tier-block-aliased"
    assert p.tier_load(b, theirs, host, block).kind == "tier-foreign-load"
    assert p.tier_verify(a, back, host, block, 0x52).kind == "tier-digest-mismatch"
    assert san.tier_release(host, block).ok
    assert p.tier_load(a, back, host, block).kind == "tier-load-unstored"


def test_a_call_the_library_refuses_raises_naming_the_limit(san):
    p = pool(san)
    a = owner()
    running(san, a)
    page = p.alloc(a, 3)
    with pytest.raises(kvsan.KvsanError) as caught:
        p.write(a, page, range(0, SLOTS + 1))
    assert caught.value.status == "KVSAN_ERR_OUT_OF_RANGE"
    assert "a page has 4 slots" in caught.value.message


def test_an_array_array_is_passed_by_address_and_a_list_is_copied():
    buf = array.array("i", [5, 6, 7])
    c = as_c_array(buf, ctypes.c_int32, "t")
    assert not c.copied and c.length == 3
    assert ctypes.cast(c.pointer, ctypes.c_void_p).value == buf.buffer_info()[0]
    c = as_c_array([1, 2], ctypes.c_int32, "t")
    assert c.copied and list(c.pointer[0:2]) == [1, 2]
    with pytest.raises(TypeError, match="expected int32"):
        as_c_array(array.array("q", [1]), ctypes.c_int32, "seq_lens")


def filled(san, p):
    """Request a: page 0 full and page 1 slots 0..2; b: page 2 full, page 3 slot 0."""
    a, b = owner(1), owner(2)
    running(san, a, b)
    for who, page, slots in ((a, 0, 4), (a, 1, 2), (b, 2, 4), (b, 3, 1)):
        ref = p.alloc(who, page)
        assert p.write(who, ref, range(0, slots)).ok
    return a, b


def test_block_table_checks_pass_as_built_and_catch_swapped_rows(san):
    p = pool(san)
    a, b = filled(san, p)
    lens = array.array("i", [6, 5])
    ok = p.check_block_table([a, b], array.array("i", [0, 1, 2, 3]), 2, lens)
    assert [v.ok for v in ok] == [True, True]
    swapped = p.check_block_table([a, b], array.array("i", [2, 3, 0, 1]), 2, lens)
    assert [v.kind for v in swapped] == ["foreign-read", "foreign-read"]
    with pytest.raises(kvsan.KvsanError, match="row 1"):
        p.check_block_table([a, b], [0, 1, 2], 2, lens)


def test_csr_token_table_and_store_slots(san):
    p = pool(san)
    a, b = filled(san, p)
    csr = p.check_paged_csr([a, b], [0, 2, 4], [0, 1, 2, 3], [2, 2])
    assert [v.kind for v in csr] == [None, "stale-read"]
    r2t = [0, 1, 2, 3, 4, 5, 0, 0, 8, 9, 10, 11, 12, 0, 0, 0]
    tok = p.check_req_to_token([a, b], r2t, 8, [1, 0], [6, 5])
    assert [v.kind for v in tok] == ["foreign-read", "foreign-read"]
    store = p.check_slot_mapping([a, b], [0, 2, 3], array.array("q", [6, -1, 3]))
    assert [v.kind for v in store] == [None, "foreign-write"]


def test_numpy_arrays_go_without_copies():
    np = pytest.importorskip("numpy")
    table = np.arange(4, dtype=np.int32).reshape(2, 2)
    c = as_c_array(table, ctypes.c_int32, "block_table")
    assert not c.copied and c.length == 4
    assert ctypes.cast(c.pointer, ctypes.c_void_p).value == table.ctypes.data
    with pytest.raises(TypeError, match="expected int32"):
        as_c_array(table.astype(np.int64), ctypes.c_int32, "block_table")


def test_the_prefix_cache_shares_within_a_tenant_only(san):
    p = pool(san)
    writer, same, other = owner(3), owner(3), owner(4)
    running(san, writer, same, other)
    page = p.alloc(writer, 5)
    assert p.write(writer, page, range(0, SLOTS)).ok
    assert p.share(page, same).ok
    assert p.read(same, [page], SLOTS).ok
    refused = p.share(page, other)
    assert refused.kind == "cross-domain-share"


class FakeGpuArray:
    """A GPU array as far as the protocol goes (``__cuda_array_interface__``,
    version 3) at a device address no driver knows: what reaches the shim
    is the address, the length, the type and the device ordinal."""

    def __init__(self, address: int, n: int, typestr: str = "<i4", strides=None) -> None:
        self.__cuda_array_interface__ = {
            "shape": (n,),
            "typestr": typestr,
            "data": (address, False),
            "strides": strides,
            "version": 3,
        }


def test_gpu_arrays_go_to_the_device_check_by_address(san):
    p = pool(san)
    a, b = filled(san, p)
    table, lens = FakeGpuArray(0x7F0000000000, 4), FakeGpuArray(0x7F0000001000, 2)
    # The device check is reached (the arguments passed its checks) and says
    # why it cannot run: without a CUDA driver, that there is none; with one,
    # that these made-up addresses are in no allocation of the device (they
    # are refused before any kernel reads them: the context stays usable).
    with pytest.raises(kvsan.KvsanError) as refused:
        p.check_block_table([a, b], table, 2, lens)
    assert refused.value.status == "KVSAN_ERR_DEVICE"
    assert refused.value.call == "kvsan_check_block_table_device"
    assert "device check could not run" in refused.value.message
    with pytest.raises(kvsan.KvsanError) as null:
        p.check_slot_mapping([a, b], FakeGpuArray(0, 3), FakeGpuArray(0x7F0000002000, 3, "<i8"))
    assert null.value.status == "KVSAN_ERR_NULL" and "query_start_loc" in null.value.message
    with pytest.raises(kvsan.KvsanError) as misaligned:
        p.check_paged_csr([a, b], FakeGpuArray(0x7F0000000002, 3), table, lens)
    assert misaligned.value.status == "KVSAN_ERR_INVALID_ARGUMENT"


def test_gpu_and_host_buffers_are_not_mixed_and_types_are_checked(san):
    p = pool(san)
    a, b = filled(san, p)
    with pytest.raises(TypeError, match="block_table on the GPU but seq_lens in host memory"):
        p.check_block_table([a, b], FakeGpuArray(0x7F0000000000, 4), 2, [6, 5])
    with pytest.raises(TypeError, match="expected int64"):
        p.check_slot_mapping([a, b], FakeGpuArray(0x7F0000000000, 3), FakeGpuArray(0x7F0000001000, 3))
    with pytest.raises(TypeError, match="not C-contiguous"):
        p.check_req_to_token(
            [a, b], FakeGpuArray(0x7F0000000000, 16, strides=(8,)), 8, FakeGpuArray(0x7F0000001000, 2),
            FakeGpuArray(0x7F0000002000, 2),
        )


def test_cuda_tensors_are_checked_on_their_gpu(san):
    torch = pytest.importorskip("torch")
    if not torch.cuda.is_available():
        pytest.skip("requires a CUDA GPU")
    p = pool(san)
    a, b = filled(san, p)
    lens = torch.tensor([6, 5], dtype=torch.int32, device="cuda")
    ok = p.check_block_table([a, b], torch.tensor([0, 1, 2, 3], dtype=torch.int32, device="cuda"), 2, lens)
    assert [v.ok for v in ok] == [True, True]
    swapped = p.check_block_table([a, b], torch.tensor([2, 3, 0, 1], dtype=torch.int32, device="cuda"), 2, lens)
    assert [v.kind for v in swapped] == ["foreign-read", "foreign-read"]


def test_every_layout_gets_the_same_verdicts_on_the_gpu_as_on_the_host(san):
    """The device check kernels against the host checks, over the same
    values: CUDA tensors (torch) on one side, host arrays on the other."""
    torch = pytest.importorskip("torch")
    if not torch.cuda.is_available():
        pytest.skip("requires a CUDA GPU")
    p = pool(san)
    a, b = filled(san, p)

    def i32(values):
        return torch.tensor(values, dtype=torch.int32, device="cuda")

    cases = [
        ("block table, as built", lambda t: p.check_block_table([a, b], t([0, 1, 2, 3]), 2, t([6, 5]))),
        ("block table, rows swapped", lambda t: p.check_block_table([a, b], t([2, 3, 0, 1]), 2, t([6, 5]))),
        ("block table, one token too many", lambda t: p.check_block_table([a, b], t([0, 1, 2, 3]), 2, t([7, 5]))),
        ("paged CSR", lambda t: p.check_paged_csr([a, b], t([0, 2, 4]), t([0, 1, 2, 3]), t([2, 2]))),
        (
            "token table",
            lambda t: p.check_req_to_token(
                [a, b], t([0, 1, 2, 3, 4, 5, 0, 0, 8, 9, 10, 11, 12, 0, 0, 0]), 8, t([1, 0]), t([6, 5])
            ),
        ),
    ]
    for name, run in cases:
        host = [v.kind for v in run(lambda values: array.array("i", values))]
        device = [v.kind for v in run(i32)]
        assert device == host, name
    host = [v.kind for v in p.check_slot_mapping([a, b], [0, 2, 3], array.array("q", [6, -1, 3]))]
    device = p.check_slot_mapping(
        [a, b], i32([0, 2, 3]), torch.tensor([6, -1, 3], dtype=torch.int64, device="cuda")
    )
    assert [v.kind for v in device] == host == [None, "foreign-write"]


def test_the_self_test_option_starts_a_sanitizer_that_catches_every_kind(tmp_path):
    # KVSAN_OPTIONS=self_test=1: the shim provokes each violation kind on
    # scratch pools before it attaches; the real checks pass, so it attaches
    # and the process's own counts stay at zero.
    import os
    import subprocess
    import sys

    code = (
        "import kvsan; s = kvsan.attach(); "
        "s.register_pool(pages=4, page_slots=4, layers=1); "
        "print(s.attached, s.violation_count())"
    )
    env = dict(os.environ, KVSAN_OPTIONS="self_test=1")
    run = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=env, timeout=120)
    assert run.returncode == 0, run.stderr
    assert run.stdout.split() == ["True", "0"], run.stdout + run.stderr
    assert "ERROR" not in run.stderr, run.stderr
