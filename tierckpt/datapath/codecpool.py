"""The process-wide thread pool that encodes and decodes frames of compressed tier copies (zstd releases the
GIL, so its threads run in parallel with each other and with a training thread)."""

from __future__ import annotations

import os
import threading
from concurrent.futures import ThreadPoolExecutor

__all__ = ["get_pool"]

_pool: ThreadPoolExecutor | None = None
_lock = threading.Lock()


def get_pool() -> ThreadPoolExecutor:
    """The pool, made on first use: ``min(os.cpu_count(), 8)`` threads."""
    global _pool
    with _lock:
        if _pool is None:
            _pool = ThreadPoolExecutor(min(os.cpu_count() or 1, 8), thread_name_prefix="tierckpt-codec")
        return _pool
