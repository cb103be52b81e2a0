"""Choosing an I/O engine: :func:`make_engine` (``uring``, ``threads``, or ``auto``: io_uring where it
works, else the thread pool). The interface every engine implements is :mod:`tierckpt.io.base`
(re-exported here); the engines load lazily, so importing this module loads no io_uring binding."""

from __future__ import annotations

import logging
import threading

from tierckpt.errors import ConfigError
from tierckpt.io.base import IOEngine, op_error

__all__ = ["IOEngine", "make_engine", "op_error"]

log = logging.getLogger(__name__)
_fallback_logged = False
_fallback_lock = threading.Lock()


def make_engine(kind: str, queue_depth: int) -> IOEngine:
    """Build an engine: ``uring``, ``threads`` or ``auto`` (io_uring, else threads with one log line).

    Raises:
        ConfigError: unknown kind.
        OSError: ``uring`` was asked for and io_uring is unavailable.
    """
    from tierckpt.io.threadpool import ThreadEngine

    if kind == "threads":
        return ThreadEngine(queue_depth)
    if kind not in ("uring", "auto"):
        raise ConfigError(f"io.engine: expected one of auto, uring, threads, got {kind!r}")
    try:
        from tierckpt.io.uring import UringEngine

        return UringEngine(queue_depth)
    except Exception as e:
        if kind == "uring":
            raise
        global _fallback_logged
        with _fallback_lock:
            if not _fallback_logged:
                _fallback_logged = True
                log.warning("io_uring is unavailable (%s: %s); using the thread-pool engine", type(e).__name__, e)
        return ThreadEngine(queue_depth)
