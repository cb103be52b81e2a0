"""The side-by-side comparison: every peer on every workload, interleaved per repeat.

For each repeat the peers run in a rotated order (so a slow minute of a shared disk hits each of them);
each one saves (API return, safe to mutate, durable), restores with a cold page cache, then again with
whatever the first read left in the cache (warm), and deletes its checkpoint. The first repeat checks
every restore against the saved state, outside the timing.
"""

from __future__ import annotations

import gc
import logging
import os
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from tierckpt.bench.metrics import Recorder, Sample
from tierckpt.bench.peers import (
    Fio,
    Memcpy,
    Peer,
    Pending,
    RawBuffers,
    RawIO,
    Tierckpt,
    TierckptInto,
    TierckptLazy,
    TorchSave,
)  # fmt: skip
from tierckpt.bench.peers_ext import DcpAsync, DcpSave, Safetensors, TorchSnapshot
from tierckpt.bench.system import files_under, make_cold, measure, resident_fraction
from tierckpt.bench.workloads import Workload
from tierckpt.io.engine import IOEngine

__all__ = ["Harness", "Progress", "all_peers", "select_peers", "total_units"]

log = logging.getLogger(__name__)


class Progress:
    """A console progress bar (tqdm when installed, else a counter in each line) whose ``write`` prints
    above the bar."""

    def __init__(self, total: int, enabled: bool = True) -> None:
        self.total, self.n = total, 0
        self.t0 = time.perf_counter()
        self._bar: Any = None
        if enabled:
            try:
                from tqdm import tqdm

                self._bar = tqdm(total=total, unit="op", dynamic_ncols=True, leave=False)
            except ImportError:
                self._bar = None

    def write(self, msg: str) -> None:
        """Print a line (above the bar)."""
        if self._bar is not None:
            self._bar.write(msg)
        else:
            print(f"[{self.n}/{self.total} {time.perf_counter() - self.t0:5.0f}s] {msg}", flush=True)

    def describe(self, what: str) -> None:
        """Say what runs now."""
        if self._bar is not None:
            self._bar.set_description_str(what)

    def update(self, n: int = 1) -> None:
        """Advance the bar."""
        self.n += n
        if self._bar is not None:
            self._bar.update(n)

    def close(self) -> None:
        """Remove the bar."""
        if self._bar is not None:
            self._bar.close()


def all_peers(engine: IOEngine, bufs: RawBuffers, io: dict[str, Any] | None = None) -> list[Peer]:
    """Every peer, in report order: tierckpt's rows, the peers, then the limits.

    Args:
        engine: tierckpt I/O engine for the ``raw:<engine>`` limit.
        bufs: buffers the raw peers share.
        io: tierckpt ``io:`` settings for tierckpt's rows.
    """
    return [
        Tierckpt(io),
        TierckptInto(io),
        TierckptLazy(io),
        TorchSave(),
        DcpSave(1),
        DcpSave(2),
        DcpAsync("default"),
        DcpAsync("reused"),
        DcpAsync("background"),
        TorchSnapshot(),
        TorchSnapshot(asynchronous=True),
        Safetensors(),
        RawIO(bufs),
        RawIO(bufs, engine),
        Fio(),
        Memcpy(),
        Memcpy(prefaulted=True),
    ]


def select_peers(peers: Sequence[Peer], spec: str | None) -> list[Peer]:
    """The peers named in ``spec`` (comma-separated names or name prefixes, e.g. ``tierckpt,dcp,raw``),
    always with the raw limits and memcpy (the ratios need them); all of them when ``spec`` is empty.

    Raises:
        ValueError: a name that matches no peer.
    """
    if not spec:
        return list(peers)
    want = [w.strip() for w in spec.split(",") if w.strip()]
    for w in want:
        if not any(p.name == w or p.name.startswith(w) for p in peers):
            raise ValueError(f"--peers: no peer called {w!r} (peers: {', '.join(p.name for p in peers)})")
    limits = ("raw", "memcpy", "fio")
    return [p for p in peers if p.name.startswith(limits) or any(p.name == w or p.name.startswith(w) for w in want)]


def _why(e: BaseException) -> str:
    return f"{type(e).__name__}: {e}".splitlines()[0][:300]


class Harness:
    """Runs peers on workloads and records samples.

    Args:
        rec: where samples, skips and notes go.
        scratch: folder for checkpoints (on the disk being measured).
        repeats: repeats per peer and workload.
        cold: how to empty the page cache (``auto``, ``drop_caches``, ``fadvise``).
        check: compare every restore of the first repeat with the saved state.
        progress: the console bar.
    """

    def __init__(self, rec: Recorder, scratch: Path, repeats: int, cold: str, check: bool, progress: Progress) -> None:
        self.rec, self.scratch, self.repeats, self.cold, self.check = rec, scratch, repeats, cold, check
        self.progress = progress
        self.cold_methods: set[str] = set()

    @staticmethod
    def usable(peers: Sequence[Peer], rec: Recorder) -> list[Peer]:
        """The peers whose ``check`` passes; the others are recorded as skipped with the reason."""
        out = []
        for p in peers:
            try:
                p.check()
            except ModuleNotFoundError as e:
                rec.skip(p.name, f"{e.name} is not installed (pip install 'tierckpt[bench]')")
            except ImportError as e:
                rec.skip(p.name, str(e))
            except Exception as e:
                rec.skip(p.name, f"cannot run here: {_why(e)}")
            else:
                out.append(p)
        return out

    def run_workload(self, wl: Workload, peers: Sequence[Peer]) -> None:
        """Every peer on ``wl``, ``repeats`` times, order rotated per repeat."""
        root = self.scratch / wl.name
        active: list[Peer] = []
        for p in peers:
            try:
                p.open(root, wl)
                p.warmup(wl.state)
                active.append(p)
            except Exception as e:
                self.rec.skip(p.name, _why(e), wl.name)
                self.progress.update(self.repeats)
                self._close(p)
        gc.collect()
        gc.freeze()  # what exists now (imports, the state) is never garbage: keep the per-op collections cheap
        try:
            for rep in range(self.repeats):
                k = rep % max(1, len(active))
                for p in active[k:] + active[:k]:
                    if any(s.peer == p.name and s.workload == wl.name for s in self.rec.skips):
                        self.progress.update()
                        continue
                    self.progress.describe(f"{wl.name} r{rep} {p.name}")
                    try:
                        self.one(p, wl, rep)
                    except Exception as e:
                        log.debug("%s on %s failed", p.name, wl.name, exc_info=True)
                        self.rec.skip(p.name, _why(e), wl.name)
                        with _suppress():
                            p.discard(rep)
                    self.progress.update()
        finally:
            gc.unfreeze()
            for p in active:
                self._close(p)

    @staticmethod
    def _close(p: Peer) -> None:
        with _suppress():
            p.close()

    def one(self, p: Peer, wl: Workload, rep: int) -> None:
        """One repeat of one peer: save, restores, discard."""
        if p.saves:
            gc.collect()
            os.sync()  # write back other dirty pages: the save's fsync should wait for its own bytes
            with measure() as u:
                t0 = time.perf_counter()
                pend = p.save(wl.state, rep)
                api = time.perf_counter() - t0
                pend.staged()
                blocking = time.perf_counter() - t0
                pend.durable()
            self.rec.add(
                Sample(wl.name, p.name, "save", rep, wl.nbytes, pend.reported_secs or u.wall_secs, api_secs=api,
                       blocking_secs=blocking, cpu_secs=u.cpu_secs, peak_extra_rss_bytes=u.peak_extra_rss_bytes,
                       file_bytes=_size(p.files(rep)) or None)
            )  # fmt: skip
        for cache in p.caches:
            self.restore_once(p, wl, rep, cache)
        p.discard(rep)

    def restore_once(self, p: Peer, wl: Workload, rep: int, cache: str) -> None:
        """One timed restore of checkpoint ``rep`` with the page cache ``cold``, ``warm`` or ``memory``."""
        paths = p.files(rep)
        method = None
        if cache == "cold":
            method = make_cold(paths, self.cold)
            self.cold_methods.add(method)
        resident = resident_fraction(paths) if cache != "memory" else None
        arg = p.prepare_restore(rep, wl.state)
        gc.collect()
        with measure() as u:
            out = p.restore(rep, arg, cache)
        secs = out.reported_secs if isinstance(out, Pending) and out.reported_secs else u.wall_secs
        self.rec.add(
            Sample(wl.name, p.name, "restore", rep, wl.nbytes, secs, cache=cache, resident=resident,
                   cold_method=method, cpu_secs=u.cpu_secs, peak_extra_rss_bytes=u.peak_extra_rss_bytes,
                   file_bytes=_size(paths) or None)
        )  # fmt: skip
        first = self.check and rep == 0 and cache == p.caches[0]
        if first and out is not None and not isinstance(out, Pending) and not p.same(wl.state, out):
            raise AssertionError(f"{p.name}: the restored state differs from the saved one")
        del out, arg


class _suppress:
    """Log and swallow an exception (cleanup paths)."""

    def __enter__(self) -> None:
        return None

    def __exit__(self, et: type[BaseException] | None, e: BaseException | None, tb: object) -> bool:
        if e is not None and isinstance(e, Exception):
            log.warning("cleanup failed: %s", _why(e))
            return True
        return False


def _size(paths: Sequence[Path]) -> int:
    return sum(f.stat().st_size for f in files_under(paths) if f.exists())


def total_units(n_workloads: int, n_peers: int, repeats: int) -> int:
    """Progress units of a comparison: one per peer, workload and repeat."""
    return n_workloads * n_peers * repeats
