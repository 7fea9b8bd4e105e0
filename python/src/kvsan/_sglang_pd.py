"""kvsan on SGLang's disaggregated (prefill/decode) path: the part of
:class:`kvsan.sglang.Adapter` that follows a request through the prefill
bootstrap queue, its KV sender, the decode preallocation and transfer
queues and the commit of a transfer.

==============================================  ================================
SGLang                                          kvsan
==============================================  ================================
``Req.set_finish_with_abort`` on a request no   the request is ``rejected``
queue has taken (intake: the one-token stub)    (told to the node whose door it
                                                reaches next)
``PrefillBootstrapQueue.add``,                  the node's door: a request left
``DecodePreallocQueue.add``                     in the queue is ``queued``
                                                there (a rejected one so is
                                                ``terminal-request-activity``)
``ReqToTokenPool.alloc``,                       the row is the request's: its
``DecodeReqToTokenPool.alloc``                  pages are the request's, and it
                                                is ``admitted`` on the node
a KV sender's ``send(page_indices)``            ``transfer_send`` of those pages
                                                for the chunk's tokens: each
                                                must be written by the request
a KV receiver's ``send_metadata(page_indices,   ``transfer_recv``: the
decode_prefix_len)``                            destination pages must be the
                                                request's; they are reserved
:meth:`Adapter.land` / :meth:`checked_copy`     ``transfer_land`` before a copy
(the transfer backend's copy into a page)       writes: only what lands there
                                                counts as written
``DecodeTransferQueue._commit_transfer_to_req`` ``transfer_commit``: every slot
                                                of the row up to the prompt's
                                                length must have landed
                                                (``short-transfer``)
==============================================  ================================

A request is one kvsan owner on both nodes (keyed by ``rid``); each node
keeps its own view of it (the kvsan pool of the node's allocator), as two
SGLang servers would. An abort is not told to kvsan as a lifecycle event:
SGLang aborts a request before it releases its pages (and the radix cache
may keep them), so the pages it still holds are followed instead: a copy
landing in a page released by an abort is caught there. The releases whose disaggregation code this follows
are :data:`RELEASES`; on another release the path is refused by name.
"""

from __future__ import annotations

import hashlib
import struct
import weakref
from typing import Any, Callable

import numpy as np

from ._abi import Owner, PageRef
from ._hooks import host_array

#: SGLang releases whose disaggregated path the adapter follows.
RELEASES = ("0.5.20", "0.5.22", "0.5.23")


class _Transfer:
    """One request's transfer into a decode node, as its receiver published
    it: the destination pages in token order from ``first_token``."""

    def __init__(self, req: Any, st: Any, first_token: int, tokens: int, pages: np.ndarray) -> None:
        self.req = weakref.ref(req)
        self.st = st
        self.first_token = first_token
        self.tokens = tokens
        self.pages = pages


class _Send:
    """One prefill request's sender: the tokens it has shipped so far."""

    def __init__(self, req: Any, st: Any) -> None:
        self.req = weakref.ref(req)
        self.st = st
        self.next_token: int | None = None


class DisaggregatedPath:
    """The disaggregated path's hooks (mixed into the SGLang adapter)."""

    def _init_pd(self, abort: bool) -> None:
        #: Abort (SGLang's ``prepare_abort``) a request kvsan found a
        #: violation in on this path, with a message naming the violation.
        self.abort = abort
        self._owner_ids: dict[str, int] = {}
        self._reqs: weakref.WeakValueDictionary[int, Any] = weakref.WeakValueDictionary()
        self._node: weakref.WeakKeyDictionary[Any, Any] = weakref.WeakKeyDictionary()
        self._rejected: weakref.WeakKeyDictionary[Any, bool] = weakref.WeakKeyDictionary()
        self._req_rows: weakref.WeakKeyDictionary[Any, tuple[Any, int]] = weakref.WeakKeyDictionary()
        self._senders: weakref.WeakKeyDictionary[Any, _Send] = weakref.WeakKeyDictionary()
        self._receivers: weakref.WeakKeyDictionary[Any, Any] = weakref.WeakKeyDictionary()
        self._transfers: dict[int, _Transfer] = {}
        self._binding: list[int] = []
        self._prepare_abort: Callable[..., Any] | None = None
        #: Disaggregation hooks that saw an object they could not follow, by
        #: the reason (a sender of a request no door saw, ...).
        self.unchecked_transfers: dict[str, int] = {}
        #: Whether the disaggregated path is checked, and if not, why.
        self.disaggregation: str = "not attached"

    # ---- attaching -----------------------------------------------------------

    def _attach_pd(self, mode: bool | None) -> None:
        """Wraps the disaggregated path. ``mode`` None: when the release is
        one of :data:`RELEASES`; True: that, or refuse; False: never."""
        if mode is False:
            self.disaggregation = "off"
            return
        import sglang

        version = getattr(sglang, "__version__", "?")
        if version not in RELEASES:
            why = (
                f"kvsan.sglang: SGLang {version}'s disaggregated path is not supported "
                f"(the adapter follows {', '.join(RELEASES)})"
            )
            if mode:
                self.detach()
                raise RuntimeError(why)
            self.disaggregation = why
            return
        try:
            from sglang.srt.disaggregation import decode, prefill, utils
            from sglang.srt.disaggregation.base import conn
            from sglang.srt.disaggregation.fake import conn as _fake  # noqa: F401 (its classes)
            from sglang.srt.managers import schedule_batch
            from sglang.srt.mem_cache import memory_pool
        except ImportError as e:
            why = f"kvsan.sglang: SGLang {version}'s disaggregation modules do not import ({e})"
            if mode:
                self.detach()
                raise RuntimeError(why) from e
            self.disaggregation = why
            return
        self._prepare_abort = utils.prepare_abort
        self._wrap(schedule_batch.Req, "set_finish_with_abort", self._on_set_finish_with_abort)
        self._wrap(memory_pool.ReqToTokenPool, "alloc", self._on_rows_for_reqs)
        drtp = decode.DecodeReqToTokenPool
        self._wrap(drtp, "alloc", self._on_decode_rows_for_reqs)
        self._wrap(drtp, "free", self._on_decode_row_free)
        self._wrap(drtp, "write", self._on_row_write)
        self._wrap(drtp, "clear", self._on_rows_clear)
        self._wrap(prefill.PrefillBootstrapQueue, "add", self._on_prefill_door)
        self._wrap(decode.DecodePreallocQueue, "add", self._on_decode_door)
        self._wrap(decode.DecodeTransferQueue, "_commit_transfer_to_req", self._on_commit)
        for cls in _defining(conn.BaseKVSender, "send"):
            self._wrap(cls, "send", self._on_send)
        for cls in _defining(conn.BaseKVReceiver, "send_metadata"):
            self._wrap(cls, "send_metadata", self._on_send_metadata)
        self.disaggregation = f"checked (SGLang {version})"

    # ---- requests ------------------------------------------------------------

    def _owner_of(self, req: Any) -> int:
        rid = str(req.rid)
        n = self._owner_ids.get(rid)
        if n is None:
            n = self._next
            self._next += 1
            self._owner_ids[rid] = n
            self._names[n] = f"rid {rid}"
        self._reqs[n] = req
        return n

    def _event(self, req: Any, st: Any, event: str, what: str) -> None:
        n = self._owner_of(req)
        self._note(self.san.request_event(Owner(n, 0), event, st.pool), what, None, n)

    def _arrive(self, req: Any, st: Any, queued: bool, door: str) -> None:
        """``req`` reached a node's door; ``queued``: the door let it in."""
        first = req not in self._node
        self._node[req] = st
        if self._rejected.pop(req, False):
            # Rejected at intake, before any door: the node learns it now.
            self._event(req, st, "queued", "the request arrives")
            self._event(req, st, "rejected", "the request was rejected at intake")
        if queued:
            self._event(req, st, "queued", f"{door} queues the request")
        elif first:
            self._node.pop(req, None)

    def _on_set_finish_with_abort(self, original: Callable[..., Any], req: Any, *a: Any, **kw: Any) -> Any:
        out = original(req, *a, **kw)
        with self._lock:
            if req not in self._node:
                self._rejected[req] = True
        return out

    def _abort_for(self, n: int | None) -> None:
        """In abort mode, the request of owner ``n`` is aborted the way the
        disaggregation queues abort one, naming the violation."""
        if not self.abort or n is None or self._prepare_abort is None or not self.violations:
            return
        req = self._reqs.get(n)
        if req is None or getattr(req, "finished_reason", None) is not None:
            return
        f = self.violations[-1]
        self._prepare_abort(req, f"kvsan: {f.violation} {f.kind} ({f.what})", status_code=500)

    # ---- doors ---------------------------------------------------------------

    def _on_prefill_door(self, original: Callable[..., Any], queue: Any, req: Any, *a: Any, **kw: Any) -> Any:
        out = original(queue, req, *a, **kw)
        with self._lock:
            scheduler = getattr(queue, "scheduler", None)
            st = self._state(getattr(scheduler, "token_to_kv_pool_allocator", None))
            if st is None:
                self._skip_transfer("prefill queues of an unchecked allocator")
                return out
            rtp = getattr(scheduler, "req_to_token_pool", None)
            if rtp is not None:
                self._pairs.setdefault(rtp, scheduler.token_to_kv_pool_allocator)
            queued = any(r is req for r in queue.queue)
            self._arrive(req, st, queued, "the prefill bootstrap queue")
            sender = getattr(req, "disagg_kv_sender", None)
            if queued and sender is not None:
                self._senders[sender] = _Send(req, st)
        return out

    def _on_decode_door(self, original: Callable[..., Any], queue: Any, req: Any, *a: Any, **kw: Any) -> Any:
        out = original(queue, req, *a, **kw)
        with self._lock:
            allocator = queue.token_to_kv_pool_allocator
            st = self._state(allocator)
            if st is None:
                self._skip_transfer("decode queues of an unchecked allocator")
                return out
            self._pairs.setdefault(queue.req_to_token_pool, allocator)
            entry = next((d for d in queue.queue if d.req is req), None)
            queued = entry is not None or any(r is req for r in getattr(queue, "retracted_queue", ()))
            self._arrive(req, st, queued, "the decode preallocation queue")
            if entry is not None and entry.kv_receiver is not None:
                self._receivers[entry.kv_receiver] = req
        return out

    # ---- rows bound to requests ----------------------------------------------

    def _bind(self, rtp: Any, reqs: list[Any], rows: list[int] | None) -> None:
        for req, row in zip(reqs, rows or ()):
            self._req_rows[req] = (rtp, int(row))
            st = self._node.get(req)
            if st is not None:
                self._event(req, st, "admitted", "the request takes a req_to_token row")

    def _on_rows_for_reqs(self, original: Callable[..., Any], rtp: Any, reqs: Any, *a: Any, **kw: Any) -> Any:
        new = [r for r in reqs if not r.kv.holds_kv]
        with self._lock:
            self._binding = [self._owner_of(r) for r in new]
        try:
            rows = original(rtp, reqs, *a, **kw)
        finally:
            self._binding = []
        if rows is not None:
            with self._lock:
                self._bind(rtp, new, [r.kv.req_pool_idx for r in new])
        return rows

    def _on_decode_rows_for_reqs(self, original: Callable[..., Any], rtp: Any, reqs: Any, *a: Any, **kw: Any) -> Any:
        new = [r for r in reqs if not r.kv.holds_kv]
        rows = original(rtp, reqs, *a, **kw)
        if rows is not None:
            with self._lock:
                for r in new:
                    row = int(r.kv.req_pool_idx)
                    old = self._row_table(rtp).get(row)
                    if old is not None:
                        self._let_go_row(rtp, old)
                    self._new_row(rtp, row, self._owner_of(r))
                self._bind(rtp, new, [r.kv.req_pool_idx for r in new])
        return rows

    def _on_decode_row_free(self, original: Callable[..., Any], rtp: Any, req: Any, *a: Any, **kw: Any) -> Any:
        with self._lock:
            idx = req.kv.req_pool_idx
            if idx is not None:
                r = self._row_table(rtp).pop(int(idx), None)
                if r is not None:
                    self._let_go_row(rtp, r)
            self._req_rows.pop(req, None)
        return original(rtp, req, *a, **kw)

    # ---- the transfer ----------------------------------------------------------

    def _refs(self, st: Any, pages: np.ndarray) -> list[PageRef]:
        out = []
        for p in pages:
            pg = st.pages.get(int(p))
            ref = pg.ref if pg is not None and pg.ref is not None else None
            out.append(PageRef(int(p), ref.generation if ref is not None else 0))
        return out

    def _table(self, st: Any, first_token: int, pages: np.ndarray) -> list[PageRef]:
        """A block table from token 0 whose entries from ``first_token``'s
        page on are ``pages`` (the ones before are not looked at)."""
        return [PageRef(0, 0)] * (first_token // st.page_size) + self._refs(st, pages)

    def _on_send(self, original: Callable[..., Any], sender: Any, kv_indices: Any, *a: Any, **kw: Any) -> Any:
        with self._lock:
            send = self._senders.get(sender)
            req = send.req() if send is not None else None
            if send is None or req is None:
                self._skip_transfer("senders of requests no prefill door saw")
            else:
                st = send.st
                pages = np.atleast_1d(host_array(kv_indices)).astype(np.int64)
                first = send.next_token
                if first is None:
                    first = int(getattr(req, "start_send_idx", 0) or 0)
                n_tokens = kw.get("num_kv_tokens", a[1] if len(a) > 1 else None)
                room = len(pages) * st.page_size - first % st.page_size
                tokens = max(0, min(room, int(n_tokens) if n_tokens is not None else room))
                tokens = min(tokens, max(0, len(req.origin_input_ids) - first))
                send.next_token = first + tokens
                n = self._owner_of(req)
                if tokens and self._in_pool(st, pages):
                    v = st.pool.transfer_send(Owner(n, 0), self._table(st, first, pages), first, tokens)
                    self._note(v, "prefill sends the request's KV (the sender's pages)", None, n)
                    self._abort_for(n if not v.ok else None)
        return original(sender, kv_indices, *a, **kw)

    def _on_send_metadata(
        self, original: Callable[..., Any], receiver: Any, kv_indices: Any, *a: Any, **kw: Any
    ) -> Any:
        out = original(receiver, kv_indices, *a, **kw)
        with self._lock:
            req = self._receivers.get(receiver)
            st = self._node.get(req) if req is not None else None
            if req is None or st is None:
                self._skip_transfer("receivers of requests no decode door saw")
                return out
            prefix = kw.get("decode_prefix_len", a[2] if len(a) > 2 else None)
            first = int(prefix or 0)
            pages = np.atleast_1d(host_array(kv_indices)).astype(np.int64)
            ps = st.page_size
            tokens = max(0, min(len(pages) * ps - first % ps, len(req.origin_input_ids) - first))
            n = self._owner_of(req)
            self._event(req, st, "transferring", "the receiver publishes the request's destination")
            room = getattr(req, "bootstrap_room", None)
            if room is not None:
                self._transfers[int(room)] = _Transfer(req, st, first, tokens, pages)
            if tokens and self._in_pool(st, pages):
                v = st.pool.transfer_recv(Owner(n, 0), self._table(st, first, pages), first, tokens)
                self._note(v, "the receiver reserves the request's destination pages", None, n)
                self._abort_for(n if not v.ok else None)
        return out

    def _in_pool(self, st: Any, pages: np.ndarray) -> bool:
        if len(pages) and (pages.min() < 0 or pages.max() >= st.capacity):
            self._skip_transfer("transfer pages beyond the pool")
            return False
        return True

    def _landing_of(self, room: int, index: int, dst_kv_pool: Any, dst_page: int) -> tuple[Any, Any, int, range] | None:
        """Whose tokens page ``index`` of ``room``'s transfer carries, and
        into which slots of ``dst_page``: (request, pool state, first
        token, slots); None (counted unchecked) where kvsan cannot say."""
        t = self._transfers.get(int(room))
        req = t.req() if t is not None else None
        if t is None or req is None:
            self._skip_transfer("landings of transfers no receiver published")
            return None
        st = self._kv_state(dst_kv_pool)
        if st is None:
            self._skip_transfer("landings in an unchecked pool")
            return None
        ps = st.page_size
        base = (t.first_token // ps + index) * ps
        lo = max(t.first_token, base) - base
        hi = min(t.first_token + t.tokens, base + ps) - base
        if hi <= lo or not 0 <= dst_page < st.capacity:
            self._skip_transfer("landings outside the published tokens")
            return None
        return req, st, base + lo, range(lo, hi)

    def slots_of(self, room: int, index: int, dst_kv_pool: Any, dst_page: int) -> tuple[int, range] | None:
        """The first token and the slots that page ``index`` of ``room``'s
        transfer fills (what a sender's digest must cover), or None."""
        with self._lock:
            found = self._landing_of(room, index, dst_kv_pool, dst_page)
        return None if found is None else (found[2], found[3])

    def land(self, room: int, index: int, dst_kv_pool: Any, dst_page: int) -> bool:
        """A transfer backend is about to copy the ``index``-th page of the
        KV of request ``room`` (its bootstrap room) into page ``dst_page`` of
        the decode pool ``dst_kv_pool``: True when the copy may write (the
        page is one the receiver published for those tokens and the request
        holds it); the landed slots then count as written. Call it before
        the copy, as :meth:`checked_copy` does."""
        return self._landing(
            room, index, dst_kv_pool, dst_page, "the transfer's copy lands in the page", None
        )

    def verify(self, room: int, index: int, dst_kv_pool: Any, dst_page: int, sent_digest: int) -> bool:
        """For a landing no copy showed (an RDMA WRITE): page ``dst_page``
        now holds page ``index`` of ``room``'s transfer, whose KV the sender
        digested as ``sent_digest`` (:func:`kv_digest` over its page, for
        the tokens and slots :meth:`slots_of` gives). kvsan digests what
        the page holds; equal digests mark the slots written, different ones
        are ``transfer-digest-mismatch``. True on a match."""
        return self._landing(
            room,
            index,
            dst_kv_pool,
            dst_page,
            "the KV found in the page is checked against the sender's",
            sent_digest,
        )

    def _landing(
        self, room: int, index: int, dst_kv_pool: Any, dst_page: int, what: str, sent_digest: int | None
    ) -> bool:
        """``transfer_land`` (no digest) or ``transfer_verify`` of page
        ``index`` of ``room``'s transfer in ``dst_page``; True: go on."""
        with self._lock:
            found = self._landing_of(room, index, dst_kv_pool, dst_page)
            if found is None:
                return True
            req, st, first, slots = found
            n = self._owner_of(req)
            (ref,) = self._refs(st, np.array([dst_page]))
            if sent_digest is None:
                v = st.pool.transfer_land(Owner(n, 0), ref, first, slots)
            else:
                landed = kv_digest(dst_kv_pool, dst_page, first, slots)
                v = st.pool.transfer_verify(Owner(n, 0), ref, first, slots, sent_digest, landed)
            self._note(v, what, int(dst_page), n)
            self._abort_for(n if not v.ok else None)
            return v.ok

    def checked_copy(
        self, room: int, index: int, src_kv_pool: Any, src_page: int, dst_kv_pool: Any, dst_page: int
    ) -> bool:
        """The checked copy: :meth:`land`, then, only if it passes, every
        layer's K and V of page ``src_page`` of ``src_kv_pool`` copied into
        page ``dst_page`` of ``dst_kv_pool`` (SGLang's MHA pool layout).
        False when the copy was refused and nothing was written."""
        if not self.land(room, index, dst_kv_pool, dst_page):
            return False
        ps = int(src_kv_pool.page_size)
        src = slice(src_page * ps, (src_page + 1) * ps)
        dst = slice(dst_page * ps, (dst_page + 1) * ps)
        for bufs in ("k_buffer", "v_buffer"):
            for s, d in zip(getattr(src_kv_pool, bufs), getattr(dst_kv_pool, bufs)):
                d[dst].copy_(s[src])
        return True

    def _on_commit(self, original: Callable[..., Any], queue: Any, decode_req: Any, *a: Any, **kw: Any) -> Any:
        req = decode_req.req
        out = original(queue, decode_req, *a, **kw)
        with self._lock:
            if getattr(req, "finished_reason", None) is not None:
                return out  # SGLang refused the commit itself
            st = self._node.get(req)
            where = self._req_rows.get(req)
            if st is None or where is None:
                self._skip_transfer("commits of requests no decode door saw")
                return out
            rtp, row = where
            committed = len(req.origin_input_ids)
            ps = st.page_size
            slots = host_array(rtp.req_to_token[row, :committed]).astype(np.int64)
            pages = slots[::ps] // ps
            n = self._owner_of(req)
            if self._in_pool(st, pages):
                v = st.pool.transfer_commit(Owner(n, 0), self._refs(st, pages), committed)
                self._note(v, "decode commits the transfer to the request's row", None, n)
                self._abort_for(n if not v.ok else None)
            self._event(req, st, "decoding", "decode starts the request")
            self._transfers.pop(int(getattr(req, "bootstrap_room", -1) or -1), None)
        return out

    def _skip_transfer(self, reason: str) -> None:
        self.unchecked_transfers[reason] = self.unchecked_transfers.get(reason, 0) + 1


def kv_digest(kv_pool: Any, page: int, first_token: int, slots: range) -> int:
    """A 64-bit digest (BLAKE2b) of the K and V that ``slots`` of ``page``
    hold in every layer of an SGLang MHA pool, seeded with the token range:
    what a sender computes over its page and the receiver over the page the
    KV landed in. kvsan compares digests, never the KV."""
    import torch

    h = hashlib.blake2b(digest_size=8)
    h.update(struct.pack("<QQ", first_token, len(slots)))
    ps = int(kv_pool.page_size)
    cut = slice(page * ps + slots.start, page * ps + slots.stop)
    for bufs in ("k_buffer", "v_buffer"):
        for layer in getattr(kv_pool, bufs):
            h.update(layer[cut].contiguous().view(-1).view(torch.uint8).numpy().tobytes())
    return int.from_bytes(h.digest(), "little")


def _defining(base: type, name: str) -> list[type]:
    """``base`` and its loaded subclasses that define ``name`` themselves."""
    out, todo = [], [base]
    while todo:
        c = todo.pop()
        if name in vars(c):
            out.append(c)
        todo.extend(c.__subclasses__())
    return out
