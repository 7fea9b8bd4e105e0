"""What the engine adapters (:mod:`kvsan.vllm`, :mod:`kvsan.sglang`) share:
wrapping an engine's methods in place and keeping kvsan's verdicts."""

from __future__ import annotations

import functools
import gc
import weakref
from dataclasses import dataclass
from typing import Any, Callable

from .sanitizer import Pool, Sanitizer, Verdict

__all__ = ["Finding", "Hooks", "host_array", "subclasses"]

# kvsan keeps at most 256 pools and has no unregister: past this many, the
# pools of engine objects that are gone are found and reused first.
_RECYCLE_AT = 64


@dataclass(frozen=True)
class Finding:
    """One violation kvsan reported while the engine ran."""

    kind: str
    violation: str
    what: str
    block: int | None
    request: str | None

    def __str__(self) -> str:
        where = f" block {self.block}" if self.block is not None else ""
        who = f" request {self.request}" if self.request is not None else ""
        return f"{self.violation} {self.kind}: {self.what}{where}{who}"


class Hooks:
    """Methods wrapped in place, put back by :meth:`detach`; the findings."""

    #: The engine's name and the version the adapter follows, for errors.
    engine = ""
    follows = ""
    #: The engine reports where received KV lands (a disaggregated path is
    #: checked): its pools are registered so that a receive only reserves.
    reports_landing = False

    def __init__(self, san: Sanitizer) -> None:
        self.san = san
        #: kvsan's violations while the engine ran, oldest first.
        self.violations: list[Finding] = []
        #: Page events and checks reported to kvsan.
        self.events = 0
        self._patches: list[tuple[type, str, Any]] = []
        # kvsan pools of engine pools that are gone, by page size, with
        # their page counts; the states of pools just gone.
        self._spare: dict[int, list[tuple[int, Pool]]] = {}
        self._dead: list[Any] = []
        self._registered = 0

    def detach(self) -> None:
        """Puts the engine's methods back."""
        for cls, name, original in reversed(self._patches):
            setattr(cls, name, original)
        self._patches.clear()

    def attach(self) -> "Hooks":
        raise NotImplementedError

    def __enter__(self) -> "Hooks":
        return self.attach()

    def __exit__(self, *exc: object) -> None:
        self.detach()

    def _wrap(self, cls: type, name: str, hook: Callable[..., Any], optional: bool = False) -> None:
        """Replaces ``cls.name`` by a call of ``hook(original, *args)``."""
        original = vars(cls).get(name)
        if original is None:
            if optional:
                return
            self.detach()
            raise RuntimeError(
                f"kvsan.{self.engine}: {self._engine_version()} has no {cls.__name__}.{name}; "
                f"the adapter follows {self.follows}"
            )
        if isinstance(original, classmethod):
            fn = original.__func__

            @functools.wraps(fn)
            def bound(klass: Any, *args: Any, **kwargs: Any) -> Any:
                return hook(fn.__get__(klass), *args, **kwargs)

            wrapper: Any = classmethod(bound)
        else:

            @functools.wraps(original)
            def plain(*args: Any, **kwargs: Any) -> Any:
                return hook(original, *args, **kwargs)

            wrapper = plain
        self._patches.append((cls, name, original))
        setattr(cls, name, wrapper)

    # ---- kvsan pools, one per engine pool, reused once it is gone ---------------

    def _kvsan_pool(self, pages: int, page_slots: int) -> tuple[Pool, int]:
        """A spare kvsan pool of this page size and at least ``pages``
        pages, or a new one; with its page count."""
        self._bury()
        for attempt in range(2):
            spares = self._spare.get(page_slots, [])
            for i, (n, pool) in enumerate(spares):
                if n >= pages:
                    del spares[i]
                    return pool, n
            if attempt == 0 and self._registered >= _RECYCLE_AT:
                # Many engine pools made and dropped (a test session): let
                # the garbage collector find the dead ones.
                gc.collect()
                self._bury()
        capacity = 1 << max(0, (pages - 1).bit_length())
        pool = self.san.register_pool(
            capacity, page_slots, 1, node=self.engine, reports_landing=self.reports_landing
        )
        self._registered += 1
        return pool, capacity

    def _watch(self, engine_pool: Any, state: Any) -> None:
        """``state`` is retired once ``engine_pool`` is gone."""
        weakref.finalize(engine_pool, self._dead.append, state)

    def _bury(self) -> None:
        while self._dead:
            self._retire(self._dead.pop())

    def _retire(self, state: Any) -> None:
        """An engine pool is gone: every holder of its pages lets go, and
        its kvsan pool goes back with :meth:`_spare_pool`."""
        raise NotImplementedError

    def _spare_pool(self, page_slots: int, pages: int, pool: Pool) -> None:
        self._spare.setdefault(page_slots, []).append((pages, pool))

    def _engine_version(self) -> str:
        try:
            module = __import__(self.engine)
            return f"{self.engine} {module.__version__}"
        except Exception:  # the version is only for the message
            return self.engine

    def _request_name(self, n: int) -> str | None:
        return None

    def _note(self, v: Verdict, what: str, block: int | None, n: int | None, name: str | None = None) -> None:
        """Counts a check; keeps a violation, naming the request ``name``,
        else the engine's name of kvsan's request ``n``."""
        self.events += 1
        if v.ok:
            return
        self.violations.append(
            Finding(
                kind=v.kind or "?",
                violation=v.violation or "?",
                what=what,
                block=block,
                request=name or (None if n is None else (self._request_name(n) or f"#{n}")),
            )
        )

    def take_violations(self) -> list[Finding]:
        """The violations since the last call."""
        out, self.violations = self.violations, []
        return out


def subclasses(cls: type) -> list[type]:
    """``cls`` and every class derived from it, loaded so far."""
    out, todo = [], [cls]
    while todo:
        c = todo.pop()
        out.append(c)
        todo.extend(c.__subclasses__())
    return out


def host_array(t: Any) -> Any:
    """A host copy (numpy) of a torch tensor, or the array itself."""
    import numpy as np

    if hasattr(t, "detach"):
        t = t.detach()
        if t.device.type != "cpu":
            t = t.cpu()
        return t.numpy()
    return np.asarray(t)
