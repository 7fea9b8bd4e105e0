"""kvsan.sglang on SGLang's disaggregated path, in SGLang's own queues: the
flows of ``test_harness_plain.py`` run again with kvsan attached (no
violation where SGLang does right), then the incident and the transfer cut
short, each caught with a report naming the violation.

Runs on the release the path selects (``PYTHONPATH=target/sglang/<version>``,
see ``scripts/sglang-releases``).
"""

from __future__ import annotations

from collections.abc import Iterator

import pytest

pytest.importorskip("sglang.srt.disaggregation.decode")

from sglang.srt.managers.schedule_batch import FINISH_ABORT  # noqa: E402

import kvsan  # noqa: E402
from kvsan import sglang as ks  # noqa: E402

from . import test_harness_plain as plain  # noqa: E402
from .harness import DOOR_CHECK, RELEASE, Harness, copy_page_plain, reject_at_intake  # noqa: E402

SHARED = plain.SHARED


@pytest.fixture(scope="module")
def san() -> kvsan.Sanitizer:
    return kvsan.attach()


@pytest.fixture(params=[False, True], ids=["report", "abort"])
def adapter(request, san) -> Iterator[ks.Adapter]:
    a = ks.attach(san, abort=request.param, disaggregation=True)
    yield a
    a.detach()


@pytest.fixture
def pd(adapter) -> Iterator[Harness]:
    with Harness() as h:
        # The transfer backend copies through kvsan's checked copy.
        h.transport.copy_page = adapter.checked_copy
        yield h


def kinds(adapter: ks.Adapter) -> list[str]:
    return [f.kind for f in adapter.take_violations()]


def test_the_adapter_follows_this_release(adapter):
    assert RELEASE in ks.RELEASES
    assert adapter.disaggregation == f"checked (SGLang {RELEASE})"


def test_clean_flows_have_no_violation(adapter, san, pd):
    """Three requests (two sharing a prefix on prefill), each sent, landed
    through the checked copy, committed and decoded: every transfer hook
    ran, none found anything."""
    before = san.check_count()
    plain.clean_flow(pd)
    assert adapter.take_violations() == []
    assert adapter.unchecked_transfers == {}
    # 3 sends, 3 receives, 38 landings (one slot a page), 3 commits at least
    assert san.check_count() - before >= 3 + 3 + 38 + 3
    assert adapter.forwards >= 3


def test_aborts_during_transfer_have_no_violation(adapter, pd):
    plain.test_decode_abort_during_transfer(pd)
    assert adapter.take_violations() == []
    with Harness() as again:
        again.transport.copy_page = adapter.checked_copy
        plain.test_prefill_abort_during_transfer(again)
    assert adapter.take_violations() == []


def test_the_incident_oversize_prompt_rejected_into_a_stub(adapter, pd):
    """The prefill node rejects a 24-token prompt at intake (the one-token
    stub); the decode node admits it and preallocates all 24 slots. Before
    the door check (0.5.20) the stub passes the prefill door and takes a row
    and a slot: activity of a rejected request, reported at the door. From
    0.5.22 the door retires it and kvsan reports nothing. Either way SGLang
    sends no page and decode, told the transfer failed, reads nothing."""
    tokens = list(range(1, 25))
    p_req, d_req = pd.make_reqs("big", tokens, 9)
    assert reject_at_intake(p_req, 16) is not None
    assert reject_at_intake(d_req, 256) is None
    assert pd.decode.intake(d_req)
    assert len(pd.decode.pop_preallocated()) == 1
    kept = pd.prefill.intake(p_req)
    found = adapter.take_violations()
    if DOOR_CHECK:
        assert not kept and found == []
    else:
        assert kept
        first = found[0]
        assert (first.kind, first.what, first.request) == (
            "terminal-request-activity",
            "the prefill bootstrap queue queues the request",
            "rid big",
        )
        assert first.violation.startswith("KV-")
        pd.prefill.pop_bootstrapped()
        pd.prefill.prefill()
        # the stub takes a row and stores its one token: more of the same
        later = kinds(adapter)
        assert later and set(later) == {"terminal-request-activity"}
    assert pd.transport.channels[9].sent_pages == []
    assert pd.decode.pop_transferred() == []
    assert isinstance(d_req.finished_reason, FINISH_ABORT)
    assert kinds(adapter) == []
    plain.pools_idle(pd)


def test_a_transfer_cut_short_is_caught_at_the_commit(adapter, pd):
    """The backend reports a transfer complete although its last page never
    landed (the class of sglang PR #38704, which every release commits):
    ``short-transfer`` when decode commits the row. Reporting only, the
    first decode step then reads the slot that never landed: ``stale-read``.
    Aborting, the request ends with kvsan's report and reads nothing."""
    pd.transport.drop_last_pages = 1
    _, d_req = plain.prefill_and_send(pd, "short", SHARED + [1, 2, 3], 10)
    assert kinds(adapter) == []
    committed = pd.decode.pop_transferred()
    found = adapter.take_violations()
    assert [(f.kind, f.what, f.request) for f in found] == [
        ("short-transfer", "decode commits the transfer to the request's row", "rid short")
    ]
    if adapter.abort:
        # SGLang retires the aborted request at once and releases its row
        assert committed == [] and isinstance(d_req.finished_reason, FINISH_ABORT)
        assert f"kvsan: {found[0].violation} short-transfer" in d_req.finished_reason.message
        assert kinds(adapter) == []
        plain.pools_idle(pd)
        return
    assert committed == [d_req] and d_req.finished_reason is None
    pd.decode.decode()
    assert kinds(adapter) == ["stale-read"]


def test_a_copy_into_another_requests_page_is_refused(adapter, pd):
    """A backend that writes a transfer's page into the destination of
    another request in flight (its destination lists crossed): the checked
    copy refuses it before it writes (``misdirected-transfer``) and the other
    request's page keeps what landed for it."""
    a_tokens, b_tokens = [1, 2, 3, 4], [5, 6, 7, 8]
    a_p, a_d = pd.make_reqs("a", a_tokens, 21)
    b_p, b_d = pd.make_reqs("b", b_tokens, 22)
    for p, d in ((a_p, a_d), (b_p, b_d)):
        assert pd.decode.intake(d) and pd.prefill.intake(p)
    pd.decode.pop_preallocated()
    pd.prefill.pop_bootstrapped()
    b_dst = list(pd.transport.channels[22].dst_pages)
    checked = pd.transport.copy_page

    def crossed(room, i, src_kv, src_page, dst_kv, dst_page):
        if room == 21 and i == 3:
            dst_page = b_dst[3]  # a's last page into b's last page
        return checked(room, i, src_kv, src_page, dst_kv, dst_page)

    pd.transport.copy_page = crossed
    pd.prefill.prefill([b_p])
    assert kinds(adapter) == []
    pd.prefill.prefill([a_p])
    found = adapter.take_violations()
    assert [(f.kind, f.request, f.block) for f in found] == [("misdirected-transfer", "rid a", b_dst[3])]
    # b's page holds b's KV: the crossed copy never wrote
    assert plain.same_kv(pd, b_dst, b_tokens)


def test_another_release_is_refused_by_name(san, monkeypatch):
    import sglang

    monkeypatch.setattr(sglang, "__version__", "0.5.21")
    with pytest.raises(RuntimeError, match=r"SGLang 0\.5\.21's disaggregated path is not supported"):
        ks.attach(san, disaggregation=True)
    a = ks.attach(san)
    try:
        assert a.disaggregation.startswith("kvsan.sglang: SGLang 0.5.21's disaggregated path")
    finally:
        a.detach()


def test_an_invisible_landing_is_written_only_by_matching_digests(adapter, pd):
    """A backend whose copy kvsan does not see (an RDMA WRITE): after each
    page lands, its digest against the sender's. Every page right: the
    commit passes. One page written from the wrong source page: that page is
    a ``transfer-digest-mismatch``, is not counted as written, and the
    commit is a ``short-transfer`` (aborting: the request ends at the
    mismatch, uncommitted)."""
    for room, wrong in ((31, None), (32, 2)):

        def rdma(room, i, src_kv, src_page, dst_kv, dst_page, wrong=wrong):
            written = src_page + 1 if i == wrong else src_page
            copy_page_plain(room, i, src_kv, written, dst_kv, dst_page)
            first, slots = adapter.slots_of(room, i, dst_kv, dst_page)
            return adapter.verify(room, i, dst_kv, dst_page, ks.kv_digest(src_kv, src_page, first, slots))

        pd.transport.copy_page = rdma
        _, d_req = plain.prefill_and_send(pd, f"rdma{room}", [room, 1, 2, 3, 4], room)
        pd.decode.pop_transferred()
        found = [(f.kind, f.request) for f in adapter.take_violations()]
        if wrong is None:
            assert found == []
        elif adapter.abort:
            # aborted where the mismatch was found: SGLang never commits it
            assert found == [("transfer-digest-mismatch", f"rid rdma{room}")]
            assert isinstance(d_req.finished_reason, FINISH_ABORT)
        else:
            assert found == [("transfer-digest-mismatch", f"rid rdma{room}"), ("short-transfer", f"rid rdma{room}")]
