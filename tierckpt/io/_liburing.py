"""Ring backend over the PyPI ``liburing`` binding, plus a crash-safe probe for it.

The binding's wheels are built for x86-64 CPUs with AVX-512: on a CPU without it, constructing a
``Ring`` kills the process with SIGILL, which no ``try`` can catch. :func:`liburing_runs` therefore
tries the binding once in a child process before this process imports it.

Sharp edges handled here (docs/io.md, "Sharp edges of the liburing binding"):

* buffers are :func:`~tierckpt.io.buffers.ptr_mv` views that own nothing, and the ``Iovec`` stays
  alive until its CQE is reaped;
* ``Iovec`` takes a buffer export on every memoryview and never gives it back; we give it back with
  ``PyBuffer_Release`` (public C API) after the CQE, guarded by an import-time self-check;
* ``cqe.res`` raises for negative results: mapped back to ``-errno``.
"""

from __future__ import annotations

import ctypes
import functools
import hashlib
import importlib.util
import json
import logging
import os
import subprocess
import sys
from pathlib import Path
from typing import Any

from tierckpt.io.buffers import ptr_mv
from tierckpt.io.cachedir import cache_dir, replace_file

__all__ = ["LiburingRing", "liburing_runs"]

log = logging.getLogger(__name__)

_CACHE_NAME = "liburing-probe.json"

_PROBE = """
import os, liburing as L
r, c = L.Ring(), L.Cqe()
L.io_uring_queue_init(8, r, 0)
fd = os.open(os.devnull, os.O_WRONLY)
buf = bytearray(4096)
iov = L.Iovec([memoryview(buf)])
s = L.io_uring_get_sqe(r); L.io_uring_prep_writev(s, fd, iov, 0); s.user_data = 7
L.io_uring_submit_and_wait(r, 1)
L.io_uring_wait_cqe(r, c)
assert c[0].user_data == 7 and c[0].res == 4096
L.io_uring_cqe_seen(r, c[0]); L.io_uring_queue_exit(r)
"""


@functools.lru_cache(maxsize=1)
def liburing_runs() -> str | None:
    """None if the ``liburing`` binding works here, else why not.

    Checked in a child process once per machine, Python and binding: the answer is kept in a small file
    (:func:`_probe_cache`) keyed by all three, so a later process (a restart, DCP's checkpoint process)
    does not start an interpreter for it again. Probes that could not run are not kept.
    """
    key = _probe_key()
    path = _probe_cache()
    known = _read_cache(path, key) if key is not None and path is not None else None
    if known is not None:
        return known or None
    why, final = _probe()
    if final and key is not None and path is not None:
        _write_cache(path, key, why or "")
    return why


def _probe() -> tuple[str | None, bool]:
    """Run the probe in a child: (why it failed or None, whether that answer holds for this machine)."""
    try:
        p = subprocess.run([sys.executable, "-c", _PROBE], capture_output=True, timeout=60, check=False)
    except (OSError, subprocess.TimeoutExpired) as e:
        return f"probe could not run: {e}", False
    if p.returncode == 0:
        return None, True
    if p.returncode == -4:  # SIGILL
        return "the liburing wheel needs CPU instructions (AVX-512) that this CPU lacks", True
    err = p.stderr.decode(errors="replace").strip().splitlines()
    return (err[-1] if err else f"probe exited with status {p.returncode}"), False


def _probe_cache() -> Path | None:
    """The file that keeps probe answers, in the user's cache (:func:`~tierckpt.io.cachedir.cache_dir`;
    None: none kept)."""
    where = cache_dir()
    return where / _CACHE_NAME if where is not None else None


def _probe_key() -> str | None:
    """What the answer depends on: this interpreter, the binding's files, the kernel and the CPU's flags."""
    try:
        spec = importlib.util.find_spec("liburing")
        origin = spec.origin if spec is not None else None
        if origin is None:
            return None
        flags = next((ln for ln in Path("/proc/cpuinfo").read_text().splitlines() if ln.startswith("flags")), "")
        st = os.stat(origin)
        parts = (sys.executable, sys.version, origin, str(st.st_size), str(st.st_mtime_ns), os.uname().release, flags)
    except (OSError, ImportError, ValueError):
        return None
    return hashlib.sha256("\0".join(parts).encode()).hexdigest()


def _read_cache(path: Path, key: str) -> str | None:
    """The kept answer for ``key`` ("" where the binding works), or None where there is none."""
    try:
        answers = json.loads(path.read_text())
        got = answers.get(key) if isinstance(answers, dict) else None
    except (OSError, ValueError):
        return None
    return got if isinstance(got, str) else None


def _write_cache(path: Path, key: str, answer: str) -> None:
    """Keep ``answer`` under ``key`` (replacing the file whole; a failure only costs a probe next time)."""
    try:
        try:
            answers = json.loads(path.read_text())
        except (OSError, ValueError):
            answers = {}
        if not isinstance(answers, dict) or len(answers) > 64:
            answers = {}
        answers[key] = answer
        replace_file(path, json.dumps(answers).encode())
    except OSError as e:
        log.debug("could not keep the liburing probe's answer in %s: %s", path, e)


class _PyBuffer(ctypes.Structure):
    _fields_ = [
        ("buf", ctypes.c_void_p), ("obj", ctypes.c_void_p), ("len", ctypes.c_ssize_t),
        ("itemsize", ctypes.c_ssize_t), ("readonly", ctypes.c_int), ("ndim", ctypes.c_int),
        ("format", ctypes.c_char_p), ("shape", ctypes.c_void_p), ("strides", ctypes.c_void_p),
        ("suboffsets", ctypes.c_void_p), ("internal", ctypes.c_void_p),
    ]  # fmt: skip


_PyBuffer_Release = ctypes.pythonapi.PyBuffer_Release
_PyBuffer_Release.argtypes = [ctypes.POINTER(_PyBuffer)]
_PyBuffer_Release.restype = None


def _release_export(mv: memoryview) -> None:
    """Give back the buffer export (and reference) that ``Iovec`` took on ``mv`` and kept."""
    view = _PyBuffer()
    view.obj = id(mv)
    _PyBuffer_Release(ctypes.byref(view))


class LiburingRing:
    """The ring interface of :mod:`tierckpt.io.uring` over the ``liburing`` package."""

    def __init__(self, entries: int) -> None:
        import liburing

        self._L = L = liburing
        self._ring, self._cqe = L.Ring(), L.Cqe()
        L.io_uring_queue_init(entries, self._ring, 0)
        self.ring_fd: int = self._ring.ring_fd
        self._iovs: dict[int, tuple[memoryview, Any]] = {}
        self._leaks = self._iovec_leaks()
        self._closed = False

    def _iovec_leaks(self) -> bool:
        buf = ctypes.create_string_buffer(64)
        mv = ptr_mv(ctypes.addressof(buf), 64)
        before = sys.getrefcount(mv)
        iov = self._L.Iovec([mv])
        del iov
        if sys.getrefcount(mv) == before:
            return False
        _release_export(mv)
        if sys.getrefcount(mv) != before:  # pragma: no cover - our model of the leak would be wrong
            raise RuntimeError("liburing Iovec buffer-export fix failed its self-check")
        mv.release()  # raises BufferError if an export were still held
        return True

    def sq_space_left(self) -> int:
        return int(self._L.io_uring_sq_space_left(self._ring))

    def _sqe(self) -> Any:
        sqe = self._L.io_uring_get_sqe(self._ring)
        if sqe is None:
            raise RuntimeError("submission queue is full")
        return sqe

    def prep_rw(self, write: bool, fd: int, addr: int, nbytes: int, offset: int, user_data: int) -> None:
        L = self._L
        sqe = self._sqe()
        try:
            mv = ptr_mv(addr, nbytes, writable=not write)
            iov = L.Iovec([mv])
            (L.io_uring_prep_writev if write else L.io_uring_prep_readv)(sqe, fd, iov, offset)
        except Exception:
            L.io_uring_prep_nop(sqe)  # a failed prep still consumes its SQE
            sqe.user_data = user_data
            raise
        sqe.user_data = user_data
        self._iovs[user_data] = (mv, iov)

    def prep_fsync(self, fd: int, user_data: int) -> None:
        sqe = self._sqe()
        self._L.io_uring_prep_fsync(sqe, fd, 0)
        sqe.user_data = user_data

    def prep_nop(self, user_data: int) -> None:
        sqe = self._sqe()
        self._L.io_uring_prep_nop(sqe)
        sqe.user_data = user_data

    def submit(self) -> int:
        while True:
            try:
                return int(self._L.io_uring_submit(self._ring))
            except InterruptedError:
                continue

    def cq_ready(self) -> int:
        return int(self._L.io_uring_cq_ready(self._ring))

    def reap(self) -> list[tuple[int, int]]:
        L, cqe, out = self._L, self._cqe, []
        for _ in L.CqeIter(self._ring, cqe):
            c = cqe[0]
            ud = c.user_data
            try:
                res = c.res
            except OSError as e:
                res = -(e.errno or 5)
            out.append((ud, res))
            held = self._iovs.pop(ud, None)
            if held is not None:
                mv, iov = held
                del iov, held
                if self._leaks:
                    _release_export(mv)
        if out:
            L.io_uring_cq_advance(self._ring, len(out))
        return out

    def close(self) -> None:
        if not self._closed:
            self._closed = True
            self._L.io_uring_queue_exit(self._ring)
