"""The I/O engines a hierarchy's file tiers share: one per (kind, queue depth), closed with the hierarchy."""

from __future__ import annotations

import threading

from tierckpt.io.engine import IOEngine, make_engine
from tierckpt.tiers.base import EngineSource

__all__ = ["Engines"]


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
