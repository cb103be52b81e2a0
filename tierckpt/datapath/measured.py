"""What ``compress: auto`` measured of a tier, kept for the next process (docs/tiers.md, "Compression").

A tier's :class:`~tierckpt.policies.compression.Adaptive` learns the compressor's speed and ratio per
tensor kind, the tier's write throughput and what its writes cost the CPUs; a new process would learn
them again on its first copy to each tier. Here they are kept in a small JSON file in the user's cache
(:func:`~tierckpt.io.cachedir.cache_dir`, subdirectory ``measured/``), one per key, and a new
``Adaptive`` of the same key starts from them (:func:`start_from_kept`).

**The key**: what makes measurements transferable: the tier's kind and location
(:meth:`~tierckpt.tiers.base.Tier.location`: a file tier's resolved directory, an S3 tier's bucket,
prefix and endpoint), the machine (its host name), and the compressor's threads and zstd level. A tier
without a location (process memory) keeps nothing; a tier whose setting is not ``auto`` neither.

**Never trusted**: a file larger than :data:`MAX_FILE_BYTES`, not JSON, of another format or a newer
version, of another key, older than :data:`MAX_AGE_SECS` (or dated in the future), or whose measurements
:meth:`~tierckpt.policies.compression.Adaptive.start_from` refuses, is ignored (a debug log line) and the
tier starts fresh.

**Writes**: after a copy's codec writer commits (:func:`keeping_writer`, in the thread that commits it), at most every
:data:`KEEP_EVERY_SECS` a tier and only when something new was measured, handed to one background thread
(the copy never waits for the cache); and at the hierarchy's close, at once (:func:`keep`). A file is
replaced whole (a temporary file renamed over it): processes writing one key at once (ranks on a node)
leave the last one's. A cache directory that cannot be written (read-only, full) is skipped (debug log).

``TIERCKPT_NO_MEASURE_CACHE=1`` (or ``TIERCKPT_CACHE_DIR`` set empty) keeps nothing and reads nothing.
"""

from __future__ import annotations

import hashlib
import json
import logging
import math
import os
import socket
import threading
import time
import weakref
from collections.abc import Mapping
from concurrent.futures import Future
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

from tierckpt.io.cachedir import cache_dir, read_small, replace_file
from tierckpt.policies.compression import Adaptive
from tierckpt.tiers.base import Tier, TierWriter

if TYPE_CHECKING:
    import torch

__all__ = [
    "ENV_OFF",
    "FILE_VERSION",
    "KEEP_EVERY_SECS",
    "MAX_AGE_SECS",
    "MAX_FILE_BYTES",
    "keep",
    "keeping_writer",
    "kept_path",
    "measure_key",
    "start_from_kept",
]

log = logging.getLogger(__name__)

#: set to anything but ``0`` or empty: measurements are neither kept nor read
ENV_OFF = "TIERCKPT_NO_MEASURE_CACHE"
#: measurements older than this are stale: the tier, its load or its file system may have changed since
MAX_AGE_SECS = 7 * 24 * 3600
#: a kept file is read only up to this size (a real one is a few KB)
MAX_FILE_BYTES = 256 << 10
#: a tier's measurements are written at most this often after copies (and at the hierarchy's close)
KEEP_EVERY_SECS = 5.0
#: the version of the file (its ``measured`` part has its own: :mod:`tierckpt.policies.kindstats`)
FILE_VERSION = 1
_FORMAT = "tierckpt-measured"
_SUBDIR = "measured"
_FUTURE_SECS = 300.0  # a file dated later than now by more than this (clocks apart) is refused


def _enabled() -> bool:
    return os.environ.get(ENV_OFF, "") in ("", "0")


def measure_key(tier: Tier) -> dict[str, Any] | None:
    """What ``tier``'s measurements are kept under (None: nothing kept: not ``auto``, or no location)."""
    adaptive, cfg = tier.adaptive, tier.compress
    if adaptive is None or cfg is None or cfg.mode != "auto":
        return None
    location = tier.location()
    if location is None:
        return None
    host = socket.gethostname()
    return {"tier": tier.kind, "location": location, "host": host, "threads": adaptive.threads, "level": adaptive.level}


def _kept_where(tier: Tier) -> tuple[dict[str, Any], Path] | None:
    """``tier``'s key and the file its measurements are kept in (None: none kept, or keeping is off)."""
    key = measure_key(tier)
    where = cache_dir() if key is not None and _enabled() else None
    if key is None or where is None:
        return None
    digest = hashlib.sha256(json.dumps(key, sort_keys=True).encode()).hexdigest()[:32]
    return key, where / _SUBDIR / f"{digest}.json"


def kept_path(tier: Tier) -> Path | None:
    """The file ``tier``'s measurements are kept in (None: none kept, or keeping is turned off)."""
    kept = _kept_where(tier)
    return None if kept is None else kept[1]


def _measurements(doc: object, key: Mapping[str, Any], now: float) -> object:
    """The ``measured`` part of a kept file's document, if the file is one of this key, fresh."""
    if not isinstance(doc, dict) or doc.get("format") != _FORMAT:
        raise ValueError("not a file of kept measurements")
    version = doc.get("version")
    if not isinstance(version, int) or isinstance(version, bool) or version != FILE_VERSION:
        raise ValueError(f"version {version!r}: this version reads {FILE_VERSION}")
    if doc.get("key") != key:
        raise ValueError("kept for another key")
    saved = doc.get("saved_at")
    if isinstance(saved, bool) or not isinstance(saved, (int, float)) or not math.isfinite(saved):
        raise ValueError("saved_at: expected a time")
    if not -_FUTURE_SECS <= now - saved <= MAX_AGE_SECS:
        raise ValueError(f"stale: saved {now - saved:.0f} s ago (kept at most {MAX_AGE_SECS} s)")
    return doc.get("measured")


def start_from_kept(tier: Tier) -> bool:
    """Start ``tier``'s new ``Adaptive`` from the measurements kept for its key; whether it did. Anything
    wrong with the file (missing, unreadable, malformed, hostile, stale) is a debug log line and a fresh
    start, never an exception."""
    adaptive = tier.adaptive
    try:
        kept = _kept_where(tier)
        if kept is None or adaptive is None:
            return False
        key, path = kept
        doc = json.loads(read_small(path, MAX_FILE_BYTES))
        adaptive.start_from(_measurements(doc, key, time.time()))
    except FileNotFoundError:
        return False
    except Exception as e:  # a cache: nothing in it may fail the open of a hierarchy
        log.debug("tier %r: kept measurements ignored: %s: %s", tier.name, type(e).__name__, e)
        return False
    _state(adaptive).revision = adaptive.revision  # nothing new to keep yet
    log.debug("tier %r: started from the measurements kept in %s", tier.name, path)
    return True


@dataclass
class _Kept:
    revision: int = 0  # the adaptive's revision last written (or started from)
    at: float = -math.inf  # when (monotonic)


_kept: weakref.WeakKeyDictionary[Adaptive, _Kept] = weakref.WeakKeyDictionary()
_kept_lock = threading.Lock()


def _state(adaptive: Adaptive) -> _Kept:
    with _kept_lock:
        got = _kept.get(adaptive)
        if got is None:
            got = _kept[adaptive] = _Kept()
        return got


def keep(tier: Tier, *, now: bool = False) -> Future[None] | None:
    """Keep what ``tier``'s ``Adaptive`` has measured since it was last kept: at once on this thread
    (``now``: the hierarchy's close), else, at most every :data:`KEEP_EVERY_SECS`, by the background
    keeper. Never raises; a write that fails is a debug log line.

    Returns:
        the background write's future (for tests), None where nothing was handed to it.
    """
    adaptive, where = tier.adaptive, _kept_where(tier)
    if where is None or adaptive is None:
        return None
    key, path = where
    kept, clock = _state(adaptive), time.monotonic()
    with _kept_lock:
        revision = adaptive.revision
        if revision == kept.revision or (not now and clock - kept.at < KEEP_EVERY_SECS):
            return None
        kept.revision, kept.at = revision, clock
    doc = {"format": _FORMAT, "version": FILE_VERSION, "key": key, "saved_at": time.time()}
    doc["measured"] = adaptive.export()
    if now:
        _KEEPER.write_now(path, doc)
        return None
    return _KEEPER.submit(path, doc)


class _Keeper:
    """One background thread that writes kept files (started when needed, gone after a minute idle);
    the newest document per path wins over one not yet written."""

    def __init__(self) -> None:
        self._cv = threading.Condition()
        self._pending: dict[Path, tuple[dict[str, Any], Future[None]]] = {}
        self._thread: threading.Thread | None = None
        self._write_lock = threading.Lock()  # one write at a time: a close's never overtaken by an older one

    def submit(self, path: Path, doc: dict[str, Any]) -> Future[None]:
        done: Future[None] = Future()
        with self._cv:
            old = self._pending.pop(path, None)
            if old is not None:
                old[1].set_result(None)  # replaced by a newer document
            self._pending[path] = (doc, done)
            if self._thread is None:
                self._thread = threading.Thread(target=self._run, name="tierckpt-measured", daemon=True)
                self._thread.start()
            self._cv.notify()
        return done

    def write_now(self, path: Path, doc: dict[str, Any]) -> None:
        with self._cv:
            old = self._pending.pop(path, None)
        self._write(path, doc)
        if old is not None:
            old[1].set_result(None)

    def _run(self) -> None:
        while True:
            with self._cv:
                if not self._pending and not self._cv.wait_for(lambda: bool(self._pending), timeout=60.0):
                    self._thread = None
                    return
                path, (doc, done) = next(iter(self._pending.items()))
                del self._pending[path]
            self._write(path, doc)
            done.set_result(None)

    def _write(self, path: Path, doc: dict[str, Any]) -> None:
        with self._write_lock:
            try:
                replace_file(path, json.dumps(doc).encode())
            except Exception as e:  # read-only or full cache, or a document json refuses: kept next time
                log.debug("could not keep measurements in %s: %s: %s", path, type(e).__name__, e)

    def after_fork(self) -> None:
        self._cv = threading.Condition()
        self._pending.clear()
        self._thread = None
        self._write_lock = threading.Lock()


_KEEPER = _Keeper()
if hasattr(os, "register_at_fork"):
    os.register_at_fork(after_in_child=_KEEPER.after_fork)


class _KeepingWriter(TierWriter):
    """A copy's writer whose commit, once done, keeps what the tier's ``Adaptive`` measured (:func:`keep`)."""

    def __init__(self, tier: Tier, inner: TierWriter) -> None:
        self._tier, self._inner = tier, inner

    def buffer(self, blob: int) -> torch.Tensor | None:
        return self._inner.buffer(blob)

    def write(self, blob: int, offset: int, addr: int, nbytes: int) -> Future[int]:
        return self._inner.write(blob, offset, addr, nbytes)

    def commit(self, manifest: bytes) -> None:
        self._inner.commit(manifest)
        try:
            keep(self._tier)
        except Exception as e:  # pragma: no cover - keep() catches what it expects; a save never fails here
            log.debug("tier %r: measurements not kept: %s", self._tier.name, e)

    def abort(self) -> None:
        self._inner.abort()

    def cancel(self) -> None:
        self._inner.cancel()


def keeping_writer(tier: Tier, writer: TierWriter) -> TierWriter:
    """``writer`` (of ``tier``: the one a codec writer writes through), its commit followed by :func:`keep`
    where ``tier``'s measurements are kept; ``writer`` itself where they are not."""
    return _KeepingWriter(tier, writer) if kept_path(tier) is not None else writer
