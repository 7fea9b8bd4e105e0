"""The Pythonic face of the kvsan shim: a sanitizer, its pools, verdicts."""

from __future__ import annotations

import ctypes
import os
from ctypes import byref, c_size_t, c_uint32, c_uint64
from dataclasses import dataclass
from typing import Any, Iterable, Sequence

from . import _abi
from ._abi import CRange, CVerdict, Owner, PageRef
from ._arrays import DeviceArray, as_c_array, as_device_array, on_device


class KvsanError(Exception):
    """A call the library refused: a negative ``KVSAN_ERR_*`` status, with
    the library's message (which names the argument and the limit)."""

    def __init__(self, call: str, status: str, message: str) -> None:
        super().__init__(f"{call}: {status}: {message}")
        self.call = call
        self.status = status
        self.message = message


@dataclass(frozen=True)
class Verdict:
    """What a check found: ``ok``, or the violation's kind and id (the
    report, on stderr or in the log file, carries the same id)."""

    ok: bool
    kind: str | None = None
    violation_id: int | None = None

    @property
    def violation(self) -> str | None:
        """``KV-000123`` for a violation, else ``None``."""
        return None if self.violation_id is None else f"KV-{self.violation_id:06d}"


class Violation(Exception):
    """Raised for a violation when the sanitizer was attached with
    ``raise_on_violation=True``: the request must be aborted."""

    def __init__(self, verdict: Verdict, what: str) -> None:
        super().__init__(f"{what}: {verdict.kind} ({verdict.violation})")
        self.verdict = verdict


def _range(r: range | tuple[int, int] | None, default_end: int) -> CRange:
    if r is None:
        return CRange(0, default_end)
    if isinstance(r, range):
        if r.step != 1:
            raise ValueError(f"a range of step 1, not {r}")
        return CRange(r.start, r.stop)
    start, end = r
    return CRange(start, end)


class Sanitizer:
    """The sanitizer in this process, through the shim's C ABI."""

    def __init__(self, lib: ctypes.CDLL, raise_on_violation: bool) -> None:
        self._lib = lib
        self.raise_on_violation = raise_on_violation
        self._check("kvsan_check_version", lib.kvsan_check_version(_abi.ABI_VERSION))

    # ---- plumbing ---------------------------------------------------------

    def _check(self, call: str, status: int) -> None:
        if status == _abi.KVSAN_OK:
            return
        name = self._lib.kvsan_status_name(status)
        buf = ctypes.create_string_buffer(1024)
        self._lib.kvsan_last_error(buf, len(buf))
        raise KvsanError(
            call,
            name.decode() if name else f"status {status}",
            buf.value.decode(errors="replace"),
        )

    def _verdict(self, v: CVerdict, what: str) -> Verdict:
        if v.code == _abi.VERDICT_CONTINUE:
            return Verdict(ok=True)
        name = self._lib.kvsan_violation_kind_name(v.kind)
        verdict = Verdict(
            ok=False,
            kind=name.decode() if name else f"kind {v.kind}",
            violation_id=int(v.violation_id),
        )
        if self.raise_on_violation:
            raise Violation(verdict, what)
        return verdict

    def _call(self, name: str, *args: Any) -> Verdict:
        v = CVerdict()
        self._check(name, getattr(self._lib, name)(*args, byref(v)))
        return self._verdict(v, name)

    # ---- the process's sanitizer --------------------------------------------

    @property
    def attached(self) -> bool:
        """Whether the library's sanitizer is attached (a bad
        ``KVSAN_OPTIONS`` leaves it detached, and every call refused)."""
        return self._lib.kvsan_attached() == 1

    def register_pool(
        self,
        pages: int,
        page_slots: int,
        layers: int,
        bytes_per_slot: int = 0,
        role: str = "unified",
        node: str = "python",
        reports_landing: bool = False,
    ) -> "Pool":
        """Registers a KV page pool and returns it. ``reports_landing``: the
        engine reports where received KV lands (:meth:`Pool.transfer_land`,
        :meth:`Pool.transfer_verify`), so :meth:`Pool.transfer_recv` only
        reserves the destination pages; without it a receive marks the
        manifest's slots written."""
        if role not in _abi.ROLES:
            raise ValueError(f"role {role!r}: one of {', '.join(_abi.ROLES)}")
        name = node.encode()
        code = _abi.ROLES[role] | (_abi.POOL_REPORTS_LANDING if reports_landing else 0)
        g = _abi.PoolGeometry(pages, page_slots, layers, code, bytes_per_slot, name, len(name))
        pool = c_uint32()
        self._check(
            "kvsan_pool_register",
            self._lib.kvsan_pool_register(byref(g), ctypes.sizeof(g), byref(pool)),
        )
        return Pool(self, pool.value, page_slots, layers)

    def request_event(self, owner: Owner, event: str, pool: "Pool | None" = None) -> Verdict:
        """The request entered state ``event`` (``queued``, ``admitted``,
        ``prefilling``, ``transferring``, ``decoding``, ``finished``,
        ``rejected``, ``aborted``) — as the node owning ``pool`` sees it,
        when given."""
        code = _abi.EVENTS.get(event)
        if code is None:
            raise ValueError(f"event {event!r}: one of {', '.join(_abi.EVENTS)}")
        if pool is None:
            return self._call("kvsan_request_event", owner, code)
        return self._call("kvsan_request_event_at", pool.id, owner, code)

    def declare_salt(self, owner: Owner, salt: int) -> Verdict:
        """``owner``'s cache salt (a 64-bit hash of it; 0: none), before it
        takes pages (``KVSAN_OPTIONS=prefix_share=salt``)."""
        return self._call("kvsan_declare_salt", owner, salt)

    def tier_store_done(self, tier: int, block: int, digest: int, stored: bool = True) -> Verdict:
        """The store into block ``block`` of tier ``tier`` completed
        (``stored``, with the engine's ``digest`` of what the tier holds) or
        failed (the block is then never loaded). A source page freed or
        re-allocated before it completed is ``tier-store-source-reused``."""
        return self._call("kvsan_tier_store_done", tier, block, digest, 1 if stored else 0)

    def tier_release(self, tier: int, block: int) -> Verdict:
        """The tier let go of the block: it may not be loaded again."""
        return self._call("kvsan_tier_release", tier, block)

    def violation_count(self, kind: str | None = None) -> int:
        """Violations so far (of ``kind`` when given, e.g. ``"stale-read"``)."""
        n = c_uint64()
        if kind is None:
            self._check("kvsan_violation_count", self._lib.kvsan_violation_count(byref(n)))
            return n.value
        for code in range(256):
            name = self._lib.kvsan_violation_kind_name(code)
            if name is None:
                break
            if name.decode() == kind:
                self._check(
                    "kvsan_violation_count_of",
                    self._lib.kvsan_violation_count_of(code, byref(n)),
                )
                return n.value
        raise ValueError(f"no violation kind {kind!r}")

    def check_count(self) -> int:
        """Checks performed so far."""
        n = c_uint64()
        self._check("kvsan_check_count", self._lib.kvsan_check_count(byref(n)))
        return n.value

    def summary(self) -> str:
        """The ``kvsan: N violations (...)`` line."""
        buf = ctypes.create_string_buffer(4096)
        length = c_size_t()
        self._check("kvsan_summary", self._lib.kvsan_summary(buf, len(buf), byref(length)))
        return buf.value.decode()


class Pool:
    """A registered KV page pool: its page events and its batch checks."""

    def __init__(self, san: Sanitizer, pool_id: int, page_slots: int, layers: int) -> None:
        self.san = san
        self.id = pool_id
        self.page_slots = page_slots
        self.layers = layers

    def __repr__(self) -> str:
        return f"Pool(id={self.id}, page_slots={self.page_slots}, layers={self.layers})"

    # ---- page events --------------------------------------------------------

    def alloc(self, owner: Owner, page: int, step: int = 0) -> PageRef:
        """The engine took ``page`` for ``owner``: its tag for the block
        table. A violation (``double-alloc``, a terminal owner) raises or is
        returned as the tag's ``verdict`` attribute."""
        ref, v = PageRef(), CVerdict()
        lib = self.san._lib
        self.san._check("kvsan_alloc", lib.kvsan_alloc(self.id, owner, page, step, byref(ref), byref(v)))
        ref.verdict = self.san._verdict(v, "kvsan_alloc")
        return ref

    def free(self, owner: Owner, page: PageRef, step: int = 0) -> Verdict:
        """``owner`` returns ``page`` (its own, or its share of it)."""
        return self.san._call("kvsan_free", self.id, owner, page, step)

    def share(self, page: PageRef, sharer: Owner) -> Verdict:
        """The prefix cache hands ``page`` read-only to ``sharer``."""
        return self.san._call("kvsan_share", self.id, page, sharer)

    def write(
        self,
        owner: Owner,
        page: PageRef,
        slots: range | tuple[int, int],
        layers: range | tuple[int, int] | None = None,
        step: int = 0,
    ) -> Verdict:
        """``owner`` computed KV into ``slots`` × ``layers`` (default: all) of ``page``."""
        return self.san._call(
            "kvsan_write", self.id, owner, page, _range(slots, 0), _range(layers, self.layers), step
        )

    def read(
        self,
        owner: Owner,
        table: Sequence[PageRef],
        tokens: int,
        layers: range | tuple[int, int] | None = None,
        step: int = 0,
    ) -> Verdict:
        """Attention of ``owner`` reads the first ``tokens`` positions of
        ``table`` for ``layers`` (default: all)."""
        refs = (PageRef * len(table))(*table)
        return self.san._call(
            "kvsan_read", self.id, owner, refs, len(table), tokens, _range(layers, self.layers), step
        )

    # ---- transfers between a prefill and a decode node ----------------------

    def _manifest(
        self,
        owner: Owner,
        pages: Sequence[PageRef],
        first_token: int,
        tokens: int,
        layers: range | tuple[int, int] | None,
        sending: bool,
    ) -> _abi.Manifest:
        refs = (PageRef * len(pages))(*pages)
        m = _abi.Manifest(request=owner, first_token=first_token, tokens=tokens)
        m.layers = _range(layers, self.layers)
        if sending:
            m.src_pool, m.src_pages, m.src_len = self.id, refs, len(pages)
        else:
            m.dst_pool, m.dst_pages, m.dst_len = self.id, refs, len(pages)
        m._keep = refs  # the array lives as long as the manifest
        return m

    def transfer_send(
        self,
        owner: Owner,
        table: Sequence[PageRef],
        first_token: int,
        tokens: int,
        layers: range | tuple[int, int] | None = None,
    ) -> Verdict:
        """This (prefill) pool ships tokens ``first_token ..
        first_token + tokens`` of ``owner``, held at those positions of
        ``table`` (a block table from token 0): each must be written."""
        m = self._manifest(owner, table, first_token, tokens, layers, True)
        return self.san._call("kvsan_transfer_send", self.id, byref(m), ctypes.sizeof(m))

    def transfer_recv(
        self,
        owner: Owner,
        table: Sequence[PageRef],
        first_token: int,
        tokens: int,
        layers: range | tuple[int, int] | None = None,
    ) -> Verdict:
        """A transfer of those tokens of ``owner`` is to land in this
        (decode) pool at those positions of ``table``: the pages must be
        ``owner``'s; they are reserved for it."""
        m = self._manifest(owner, table, first_token, tokens, layers, False)
        return self.san._call("kvsan_transfer_recv", self.id, byref(m), ctypes.sizeof(m))

    def _landing(
        self,
        owner: Owner,
        page: PageRef,
        first_token: int,
        slots: range | tuple[int, int],
        layers: range | tuple[int, int] | None,
        digests: tuple[int, int],
    ) -> _abi.PageLanding:
        return _abi.PageLanding(
            owner, page, first_token, _range(slots, 0), _range(layers, self.layers), *digests
        )

    def transfer_land(
        self,
        owner: Owner,
        page: PageRef,
        first_token: int,
        slots: range | tuple[int, int],
        layers: range | tuple[int, int] | None = None,
    ) -> Verdict:
        """A copy is about to write received tokens ``first_token ..`` of
        ``owner`` into ``slots`` of ``page``: only if this passes may it
        write, and then those slots count as written."""
        landing = self._landing(owner, page, first_token, slots, layers, (0, 0))
        return self.san._call("kvsan_transfer_land", self.id, byref(landing), ctypes.sizeof(landing))

    def transfer_verify(
        self,
        owner: Owner,
        page: PageRef,
        first_token: int,
        slots: range | tuple[int, int],
        sent_digest: int,
        landed_digest: int,
        layers: range | tuple[int, int] | None = None,
    ) -> Verdict:
        """Received KV is in ``slots`` of ``page``: the receiver's digest of
        what they hold must equal the sender's digest of those tokens; a
        match marks them written (a landing no copy showed)."""
        landing = self._landing(owner, page, first_token, slots, layers, (sent_digest, landed_digest))
        return self.san._call("kvsan_transfer_verify", self.id, byref(landing), ctypes.sizeof(landing))

    # ---- KV tiers (host memory, disk): a page's identity out and back --------

    def tier_store(self, owner: Owner, page: PageRef, tier: int, block: int, step: int = 0) -> Verdict:
        """A store of ``page`` into block ``block`` of tier ``tier`` starts,
        for ``owner`` (a preempted request, or the prefix cache's owner
        evicting a cached page). A block that still holds or is storing
        another page is ``tier-block-aliased``."""
        return self.san._call("kvsan_tier_store", self.id, owner, page, tier, block, step)

    def tier_load(self, owner: Owner, page: PageRef, tier: int, block: int, step: int = 0) -> Verdict:
        """A load of the block is about to copy it into ``page`` for
        ``owner``: only if this passes may it write, and then the slots the
        store found written count as written (``tier-load-unstored``,
        ``tier-foreign-load`` otherwise)."""
        return self.san._call("kvsan_tier_load", self.id, owner, page, tier, block, step)

    def tier_verify(self, owner: Owner, page: PageRef, tier: int, block: int, digest: int) -> Verdict:
        """The loaded KV is in ``page``: ``digest``, the engine's digest of
        what it holds, must equal the store's (``tier-digest-mismatch``)."""
        return self.san._call("kvsan_tier_verify", self.id, owner, page, tier, block, digest)

    def transfer_commit(self, owner: Owner, table: Sequence[PageRef], committed_tokens: int) -> Verdict:
        """Decode starts using the first ``committed_tokens`` positions of
        ``table``: every one must have been written (``short-transfer``)."""
        refs = (PageRef * len(table))(*table)
        return self.san._call("kvsan_transfer_commit", self.id, owner, refs, len(table), committed_tokens)

    # ---- batch checks over the kernels' own buffers ---------------------------

    def _batch(self, name: str, owners: Sequence[Owner], *args: Any) -> list[Verdict]:
        rows = len(owners)
        c_owners = (Owner * rows)(*owners)
        out = (CVerdict * rows)()
        self.san._check(name, getattr(self.san._lib, name)(self.id, c_owners, rows, *args, out))
        return [self.san._verdict(v, f"{name} row {i}") for i, v in enumerate(out)]

    def _device_batch(
        self, name: str, owners: Sequence[Owner], arrays: Sequence[DeviceArray], *args: Any
    ) -> list[Verdict]:
        devices = {a.device for a in arrays}
        if len(devices) != 1:
            raise ValueError(f"{name}: the buffers are on CUDA devices {sorted(devices)}; one launch reads one")
        rows = len(owners)
        c_owners = (Owner * rows)(*owners)
        out = (CVerdict * rows)()
        fn = getattr(self.san._lib, name)
        self.san._check(name, fn(self.id, devices.pop(), c_owners, rows, *args, out))
        return [self.san._verdict(v, f"{name} row {i}") for i, v in enumerate(out)]

    def _check_layout(
        self,
        layout: str,
        owners: Sequence[Owner],
        layers: range | tuple[int, int] | None,
        step: int,
        **given: Any,
    ) -> list[Verdict]:
        """The batch check of ``layout`` (see ``_abi.BATCH_LAYOUTS``): each
        buffer converted and its length held to the rows, in the C
        function's order; on the GPU when the buffers are (see
        :func:`_on_device`)."""
        params = _abi.BATCH_LAYOUTS[layout]
        device = _on_device(**{name: given[name] for name, value, _ in params if value is not None})
        rows = len(owners)
        args: list[Any] = []
        arrays = []
        for name, value, length in params:
            if value is None:
                args.append(given[name])
                continue
            array = (as_device_array if device else as_c_array)(given[name], value, name)
            if length == "rows" and array.length != rows:
                raise ValueError(f"{name} has {array.length} entries for {rows} rows")
            if length == "offsets" and array.length != rows + 1:
                raise ValueError(f"{name} has {array.length} entries; {rows} rows need {rows + 1}")
            args.append(array.address if device else array.pointer)
            if length not in ("rows", "offsets"):
                args.append(array.length)
            arrays.append(array)
        args += [_range(layers, self.layers), step]
        if device:
            return self._device_batch(f"kvsan_check_{layout}_device", owners, arrays, *args)
        return self._batch(f"kvsan_check_{layout}", owners, *args)

    def check_block_table(
        self,
        owners: Sequence[Owner],
        block_table: Any,
        stride: int,
        seq_lens: Any,
        layers: range | tuple[int, int] | None = None,
        step: int = 0,
    ) -> list[Verdict]:
        """A padded block table (vLLM, FlashAttention), ``int32``: row ``r``
        reads ``seq_lens[r]`` tokens through ``block_table[r * stride ...]``.
        GPU arrays (CUDA tensors) are checked where they lie, by kvsan's
        CUDA check kernel (see :func:`_on_device`)."""
        return self._check_layout(
            "block_table", owners, layers, step, block_table=block_table, stride=stride, seq_lens=seq_lens
        )

    def check_paged_csr(
        self,
        owners: Sequence[Owner],
        indptr: Any,
        indices: Any,
        last_page_len: Any,
        layers: range | tuple[int, int] | None = None,
        step: int = 0,
    ) -> list[Verdict]:
        """Pages in CSR form (FlashInfer), ``int32``; GPU arrays are
        checked on the GPU."""
        return self._check_layout(
            "paged_csr", owners, layers, step, indptr=indptr, indices=indices, last_page_len=last_page_len
        )

    def check_req_to_token(
        self,
        owners: Sequence[Owner],
        req_to_token: Any,
        stride: int,
        req_indices: Any,
        seq_lens: Any,
        layers: range | tuple[int, int] | None = None,
        step: int = 0,
    ) -> list[Verdict]:
        """A token-level table (SGLang's ``req_to_token``), ``int32``; GPU
        arrays are checked on the GPU."""
        return self._check_layout(
            "req_to_token",
            owners,
            layers,
            step,
            req_to_token=req_to_token,
            stride=stride,
            req_indices=req_indices,
            seq_lens=seq_lens,
        )

    def check_slot_mapping(
        self,
        owners: Sequence[Owner],
        query_start_loc: Any,
        slot_mapping: Any,
        layers: range | tuple[int, int] | None = None,
        step: int = 0,
    ) -> list[Verdict]:
        """A store kernel's ``slot_mapping`` (``int64``, −1 padding) with
        ``query_start_loc`` (``int32``, rows + 1); the slots stored are
        recorded written. GPU arrays are checked on the GPU."""
        return self._check_layout(
            "slot_mapping", owners, layers, step, query_start_loc=query_start_loc, slot_mapping=slot_mapping
        )


def _on_device(**buffers: Any) -> bool:
    """Whether the buffers are GPU arrays (``__cuda_array_interface__``):
    then the check runs on their device, by kvsan's CUDA check kernel over
    the buffers in place (the shim built with its ``cuda`` feature; else,
    or without a CUDA driver, :class:`KvsanError` ``KVSAN_ERR_DEVICE``).
    All of one call's buffers are on the GPU, or none."""
    where = {name: on_device(b) for name, b in buffers.items()}
    if all(where.values()):
        return True
    if any(where.values()):
        gpu = ", ".join(n for n, d in where.items() if d)
        host = ", ".join(n for n, d in where.items() if not d)
        raise TypeError(f"{gpu} on the GPU but {host} in host memory: pass all of them on one side")
    return False


def attach(
    library: str | os.PathLike[str] | None = None, raise_on_violation: bool = False
) -> Sanitizer:
    """The sanitizer of this process: the shim at ``library``, or
    ``$KVSAN_SHIM``, or the one preloaded, or the one packaged (see
    ``kvsan._abi.load``). With ``raise_on_violation``, a violation raises
    :class:`Violation` instead of being returned as a :class:`Verdict`."""
    return Sanitizer(_abi.load(library), raise_on_violation)


def owners(pairs: Iterable[tuple[int, int]]) -> list[Owner]:
    """``[(request, tenant), ...]`` as owners."""
    return [Owner(r, t) for r, t in pairs]
