"""Process-wide helpers of the hierarchy: shared I/O engines, the GC pause, the torch.distributed rank."""

from __future__ import annotations

import contextlib
import gc
import logging
import os
import signal
import threading
from collections.abc import Callable, Iterator, Sequence
from types import FrameType

from tierckpt.io.engine import IOEngine, make_engine
from tierckpt.tiers.base import EngineSource

__all__ = ["Engines", "dist_rank", "gc_paused", "install_flush_handler"]

log = logging.getLogger("tierckpt.hierarchy")


class Engines(EngineSource):
    """One engine per (kind, queue depth), shared by the tiers of a hierarchy and closed with it."""

    def __init__(self) -> None:
        self._engines: dict[tuple[str, int], IOEngine] = {}
        self._lock = threading.Lock()

    def get(self, engine: str, queue_depth: int) -> IOEngine:
        with self._lock:
            e = self._engines.get((engine, queue_depth))
            if e is None:
                e = self._engines[(engine, queue_depth)] = make_engine(engine, queue_depth)
            return e

    def close(self) -> None:
        with self._lock:
            engines, self._engines = list(self._engines.values()), {}
        for e in engines:
            e.close()


_gc_lock = threading.Lock()
_gc_state = {"depth": 0, "was_enabled": False}


@contextlib.contextmanager
def gc_paused() -> Iterator[None]:
    """Pause the cyclic garbage collector (re-entrant, thread-safe; also a decorator). With 20,000 tensors it otherwise
    runs dozens of times per save or restore and doubles the Python-side cost; reference counting
    still frees everything meanwhile."""
    with _gc_lock:
        if _gc_state["depth"] == 0:
            _gc_state["was_enabled"] = gc.isenabled()
            gc.disable()
        _gc_state["depth"] += 1
    try:
        yield
    finally:
        with _gc_lock:
            _gc_state["depth"] -= 1
            if _gc_state["depth"] == 0 and _gc_state["was_enabled"]:
                gc.enable()


def dist_rank() -> tuple[int, int]:
    try:
        import torch.distributed as dist

        if dist.is_available() and dist.is_initialized():
            return dist.get_rank(), dist.get_world_size()
    except Exception:  # pragma: no cover
        pass
    return 0, 1


def install_flush_handler(
    flush: Callable[[], bool], deadline: float, signals: Sequence[int] = (signal.SIGTERM,)
) -> None:
    """On each of ``signals``: run ``flush`` (which should give up after ``deadline`` seconds and return
    False if it did), then let the signal do what it did before — call the previous handler, or for
    the default action re-raise the signal so the process dies of it. Call from the main thread."""
    previous = {s: signal.getsignal(s) for s in signals}

    def handler(signum: int, frame: FrameType | None) -> None:
        log.warning("signal %d: flushing checkpoints (deadline %.0f s)", signum, deadline)
        try:
            if not flush():
                log.error("signal %d: the flush did not finish within %.0f s", signum, deadline)
        finally:
            prev = previous[signum]
            signal.signal(signum, prev)
            if callable(prev):
                prev(signum, frame)
            elif prev == signal.SIG_DFL:
                os.kill(os.getpid(), signum)

    for s in signals:
        signal.signal(s, handler)
