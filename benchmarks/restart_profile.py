"""Time per phase of ``restore()`` into fresh tensors, for ``bench_restart.py --profile`` (perf is not
installed here): wraps the phases of :mod:`tierckpt.datapath.restore` with wall and thread-CPU clocks.

Phases: ``manifest`` (read and validate it), ``tree`` (decode the state tree), ``alloc`` (map the blob
buffers), ``populate`` (fault pages in, in the helper threads: summed thread CPU), ``wait`` (the main
thread blocked on a chunk's read), ``verify+carve`` (checksums and padding checks, tensor views), and
``resolve`` (rebuild the state).
"""

from __future__ import annotations

import threading
import time
from collections import defaultdict
from collections.abc import Callable
from concurrent.futures import Future
from typing import Any

import tierckpt.datapath.restore as r
from tierckpt.io import buffers

_wall: dict[str, float] = defaultdict(float)
_cpu: dict[str, float] = defaultdict(float)
_lock = threading.Lock()


def _add(name: str, wall: float, cpu: float) -> None:
    with _lock:
        _wall[name] += wall
        _cpu[name] += cpu


def _timed(name: str, fn: Callable[..., Any]) -> Callable[..., Any]:
    def run(*a: Any, **k: Any) -> Any:
        w, c = time.perf_counter(), time.thread_time()
        try:
            return fn(*a, **k)
        finally:
            _add(name, time.perf_counter() - w, time.thread_time() - c)

    return run


def _read_blobs(orig: Callable[..., Any]) -> Callable[..., Any]:
    def run(*args: Any) -> Any:  # (tier, key, manifest, reader, on_data): on_data is the last
        return orig(*args[:-1], _timed("verify+carve", args[-1]))

    return run


def _waited(orig: Callable[..., Any]) -> Callable[..., Any]:
    def result(self: Future[Any], timeout: float | None = None) -> Any:
        if threading.current_thread() is not threading.main_thread():
            return orig(self, timeout)
        w, c = time.perf_counter(), time.thread_time()
        try:
            return orig(self, timeout)
        finally:
            _add("wait", time.perf_counter() - w, time.thread_time() - c)

    return result


def install() -> None:
    """Wrap the phases (for this process; there is no uninstall: the process ends after one restore)."""
    r.load_manifest = _timed("manifest", r.load_manifest)
    r.load_tree = _timed("tree", r.load_tree)
    r.resolve_tree = _timed("resolve", r.resolve_tree)
    r._read_blobs = _read_blobs(r._read_blobs)
    buffers.MappedBuffer.populate = _timed("populate", buffers.MappedBuffer.populate)  # type: ignore[method-assign]
    buffers.MappedBuffer.__init__ = _timed("alloc", buffers.MappedBuffer.__init__)  # type: ignore[method-assign]
    Future.result = _waited(Future.result)  # type: ignore[method-assign]


def report() -> dict[str, dict[str, float]]:
    """{phase: {"wall": seconds, "cpu": thread-CPU seconds}} so far."""
    return {k: {"wall": round(_wall[k], 4), "cpu": round(_cpu[k], 4)} for k in sorted(_wall)}
