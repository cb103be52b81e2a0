"""Fault-injecting tier wrapper for tests (like DCP's ``FaultyStorageWriter``)."""

from __future__ import annotations

import threading
from collections.abc import Mapping, Sequence
from concurrent.futures import Future
from dataclasses import replace
from typing import TYPE_CHECKING, Any

import torch

from tierckpt.errors import ConfigError
from tierckpt.format.manifest import BlobEntry
from tierckpt.tiers.base import CheckpointKey, EngineSource, Tier, TierCopy, TierReader, TierWriter

if TYPE_CHECKING:
    from tierckpt.config import TierConfig
    from tierckpt.io.geometry import IOGeometry
    from tierckpt.ioconfig import IOConfig

__all__ = ["FaultyTier"]

METHODS = (
    "reserve", "write", "commit", "list_committed", "holds", "read_manifest", "read", "evict", "reclaim",
    "write_record", "read_record", "remove_record", "list_records",
)  # fmt: skip


class FaultyTier(Tier):
    """Wraps a tier and raises chosen exceptions from chosen methods.

    Args:
        inner: the real tier (its name and capabilities are reused, but for ``capabilities``).
        fail: method name → exception to raise (methods: :data:`METHODS`). ``write`` and ``read``
            failures arrive through the future.
        after: let this many calls of each failing method succeed first.
        gates: method name → event; each call of that method first waits until the event is set
            (to hold a tier mid-copy and look at the hierarchy meanwhile).
        capabilities: fields of the inner tier's capabilities to declare otherwise (``{"cheap_listing":
            False, "shared": True}``: a directory that a hierarchy treats as an object store, listed by
            one rank; with ``calls``, the listings counted).

    Attributes:
        calls: how often each method was called.
    """

    def __init__(
        self,
        inner: Tier,
        fail: Mapping[str, BaseException] | None = None,
        after: int = 0,
        gates: Mapping[str, threading.Event] | None = None,
        capabilities: Mapping[str, Any] | None = None,
    ) -> None:
        super().__init__(inner.name)
        fail, gates = fail or {}, gates or {}
        unknown = (set(fail) | set(gates)) - set(METHODS)
        if unknown:
            raise ValueError(f"cannot inject into {sorted(unknown)}; methods: {', '.join(METHODS)}")
        self.inner, self.fail, self.after, self.gates = inner, dict(fail), after, dict(gates)
        self.kind = f"faulty-{inner.kind}"
        self.capabilities = replace(inner.capabilities, **(capabilities or {}))
        self.preferred_blob_bytes = inner.preferred_blob_bytes
        self.chunk_bytes = inner.chunk_bytes
        self.calls: dict[str, int] = dict.fromkeys(METHODS, 0)
        self._lock = threading.Lock()

    @classmethod
    def from_config(cls, cfg: TierConfig, engines: EngineSource) -> FaultyTier:
        """Not buildable from a config: it wraps a tier built in Python, with Python exceptions.

        Raises:
            ConfigError: always, naming ``tiers[i].kind``.
        """
        raise ConfigError(
            f"{cfg.key}.kind: a FaultyTier wraps a tier object built in Python (FaultyTier(inner, fail=...)) "
            f"and cannot be built from a config"
        )

    def plan_geometry(self, io: IOConfig) -> IOGeometry:
        """The inner tier's geometry, as it uses it (a wrapper does not pass the hierarchy's io on)."""
        return self.inner.geometry

    def _hit(self, method: str) -> BaseException | None:
        gate = self.gates.get(method)
        if gate is not None:
            gate.wait()
        with self._lock:
            self.calls[method] += 1
            if method in self.fail and self.calls[method] > self.after:
                return self.fail[method]
        return None

    def _check(self, method: str) -> None:
        err = self._hit(method)
        if err is not None:
            raise err

    def reserve(self, key: CheckpointKey, blobs: Sequence[BlobEntry]) -> TierWriter:
        self._check("reserve")
        return _FaultyWriter(self, self.inner.reserve(key, blobs))

    def list_committed(self, rank: int | None = None) -> list[CheckpointKey]:
        self._check("list_committed")
        return self.inner.list_committed(rank)

    def holds(self, key: CheckpointKey) -> bool:
        self._check("holds")
        return self.inner.holds(key)

    def read_manifest(self, key: CheckpointKey) -> bytes:
        self._check("read_manifest")
        return self.inner.read_manifest(key)

    def reader(self, key: CheckpointKey, blobs: Sequence[BlobEntry]) -> TierReader:
        return _FaultyReader(self, self.inner.reader(key, blobs))

    def open_copy(self, key: CheckpointKey) -> TierCopy:
        return _FaultyCopy(self, key, self.inner.open_copy(key))

    def evict(self, key: CheckpointKey, *, free: bool = True) -> None:
        self._check("evict")
        self.inner.evict(key, free=free)

    def reclaim(self) -> None:
        self._check("reclaim")
        self.inner.reclaim()

    def write_record(self, step: int, data: bytes) -> None:
        self._check("write_record")
        self.inner.write_record(step, data)

    def read_record(self, step: int) -> bytes | None:
        self._check("read_record")
        return self.inner.read_record(step)

    def remove_record(self, step: int) -> None:
        self._check("remove_record")
        self.inner.remove_record(step)

    def list_records(self) -> list[int]:
        self._check("list_records")
        return self.inner.list_records()

    def used_bytes(self) -> int:
        return self.inner.used_bytes()

    def describe(self) -> str:
        return f"faulty({self.inner.describe()})"

    def location(self) -> str | None:
        return self.inner.location()

    def lease_job(self) -> str | None:
        return self.inner.lease_job()

    def close(self) -> None:
        self.inner.close()


def _failed(err: BaseException) -> Future[int]:
    f: Future[int] = Future()
    f.set_exception(err)
    return f


class _FaultyCopy(TierCopy):
    """The inner tier's copy (a snapshot where it is one), with the wrapper's faults."""

    def __init__(self, tier: FaultyTier, key: CheckpointKey, inner: TierCopy) -> None:
        super().__init__(tier, key)
        self.ftier, self.inner = tier, inner

    def read_manifest(self) -> bytes:
        self.ftier._check("read_manifest")
        return self.inner.read_manifest()

    def reader(self, blobs: Sequence[BlobEntry]) -> TierReader:
        return _FaultyReader(self.ftier, self.inner.reader(blobs))

    def close(self) -> None:
        self.inner.close()


class _FaultyWriter(TierWriter):
    def __init__(self, tier: FaultyTier, inner: TierWriter) -> None:
        self.tier, self.inner = tier, inner

    def buffer(self, blob: int) -> torch.Tensor | None:
        return None if "write" in self.tier.fail or "write" in self.tier.gates else self.inner.buffer(blob)

    def write(self, blob: int, offset: int, addr: int, nbytes: int) -> Future[int]:
        err = self.tier._hit("write")
        return _failed(err) if err is not None else self.inner.write(blob, offset, addr, nbytes)

    def commit(self, manifest: bytes) -> None:
        err = self.tier._hit("commit")
        if err is not None:
            self.inner.abort()
            raise err
        self.inner.commit(manifest)

    def abort(self) -> None:
        self.inner.abort()

    def cancel(self) -> None:
        self.inner.cancel()


class _FaultyReader(TierReader):
    def __init__(self, tier: FaultyTier, inner: TierReader) -> None:
        self.tier, self.inner = tier, inner

    def buffer(self, blob: int) -> torch.Tensor | None:
        return None if "read" in self.tier.fail or "read" in self.tier.gates else self.inner.buffer(blob)

    def read(self, blob: int, offset: int, addr: int, nbytes: int) -> Future[int]:
        err = self.tier._hit("read")
        return _failed(err) if err is not None else self.inner.read(blob, offset, addr, nbytes)

    def read_alignment(self, blob: int) -> tuple[int, int] | None:
        return self.inner.read_alignment(blob)

    def close(self) -> None:
        self.inner.close()
