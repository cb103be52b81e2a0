"""``gpu`` tier: checkpoints kept in accelerator memory, the fastest place a snapshot can go.

A save to a ``gpu`` top tier copies every tensor device-to-device into packed blob buffers on a side
stream (ordered after the work already queued on the caller's stream), so ``staged`` resolves after a
few memory-bandwidth copies instead of a PCIe transfer. The checksums are computed afterwards, off the
caller's path, from chunks copied to pinned host buffers. Demotion to ``host`` copies whole blobs with
non-blocking copies on a side stream into the host tier's pinned buffers; other reads and writes (a
promotion from a file tier, a restore) go through host staging buffers.

The arena (capacity, reuse of buffers of the same size, eviction) is the ``host`` tier's. Without CUDA
the tier can still be built on ``device="cpu"``, which runs the same packing and copy logic with plain
tensor copies: that is how the test suite covers it on machines without a GPU.
"""

from __future__ import annotations

import contextlib
import threading
from collections.abc import Callable, Sequence
from concurrent.futures import Future

import torch
import xxhash

from tierckpt.config import TierConfig
from tierckpt.errors import ConfigError
from tierckpt.format.layout import Layout
from tierckpt.format.tree import FlatState
from tierckpt.io.buffers import StagingPool, ptr_mv
from tierckpt.io.geometry import PAGE
from tierckpt.tiers.base import EngineSource, TierCapabilities, TierWriter
from tierckpt.tiers.host import HostTier, _HostReader, _HostWriter, done_future
from tierckpt.tiers.options import Option, check_options, refuse_location, text

__all__ = ["GpuTier", "device_copy"]

OPTIONS = {"device": Option(text(r"cuda(:[0-9]{1,4})?"), default=None, doc="the CUDA device, e.g. cuda:1")}

_EMPTY_DIGEST = xxhash.xxh3_64_intdigest(b"")
_streams: dict[torch.device, torch.cuda.Stream] = {}
_streams_lock = threading.Lock()


def side_stream(device: torch.device) -> torch.cuda.Stream | None:
    """One non-default stream per CUDA device for tierckpt's copies (None for non-CUDA devices)."""
    if device.type != "cuda":
        return None
    dev = torch.device("cuda", device.index if device.index is not None else torch.cuda.current_device())
    with _streams_lock:
        s = _streams.get(dev)
        if s is None:
            s = _streams[dev] = torch.cuda.Stream(dev)
        return s


def device_copy(dst: torch.Tensor, src: torch.Tensor, nbytes: int) -> None:
    """Copy ``nbytes`` between two uint8 buffers of which at least one is not in host memory: on a side
    stream, non-blocking (pinned host buffers make it an asynchronous DMA), then wait for it."""
    dev = dst.device if dst.device.type != "cpu" else src.device
    stream = side_stream(dev)
    if stream is None:
        dst[:nbytes].copy_(src[:nbytes])
        return
    stream.wait_stream(torch.cuda.current_stream(dev))
    with torch.cuda.stream(stream):
        dst[:nbytes].copy_(src[:nbytes], non_blocking=True)
    stream.synchronize()


def _own_buffer(writer: TierWriter, blob: int) -> torch.Tensor:
    """The blob's device buffer of a writer this tier reserved (its writers always have one)."""
    buf = writer.buffer(blob)
    if buf is None:
        raise TypeError(
            f"GpuTier.pack: {type(writer).__name__} has no buffer for blob {blob} (not a gpu tier's writer)"
        )
    return buf


def _host_view(addr: int, nbytes: int) -> torch.Tensor:
    return torch.frombuffer(ptr_mv(addr, nbytes), dtype=torch.uint8)


def _as_bytes(t: torch.Tensor) -> torch.Tensor:
    """The tensor's bytes as a flat uint8 tensor on its device (a copy only where not contiguous)."""
    t = t.detach().resolve_conj().resolve_neg()
    if not t.is_contiguous():
        t = t.contiguous()
    return t.reshape(-1).view(torch.uint8)


class GpuTier(HostTier):
    """Accelerator-memory tier.

    Args:
        name: tier name.
        capacity_bytes: most bytes held (committed + being written + kept for reuse); default a quarter
            of the device memory free when the tier is created.
        device: the device (default: the current CUDA device). ``"cpu"`` runs the tier's logic on host
            memory, for tests on machines without a GPU.

    Raises:
        ConfigError: no CUDA device and ``device`` was not given.
        ValueError: ``device`` is neither a CUDA device nor ``cpu``.
    """

    kind = "gpu"
    preferred_blob_bytes = 1 << 30  # declared: an input of the geometry (Tier)

    def __init__(self, name: str = "gpu", capacity_bytes: int | None = None, device: str | None = None) -> None:
        if device is None:
            if not torch.cuda.is_available():
                raise ConfigError(f"tier {name!r}: kind gpu needs a CUDA device (torch.cuda.is_available() is False)")
            device = f"cuda:{torch.cuda.current_device()}"
        self.device = torch.device(device)
        if self.device.type not in ("cuda", "cpu"):
            raise ValueError(f"tier {name!r}: device must be a CUDA device (or cpu, for tests), got {device!r}")
        if capacity_bytes is None and self.device.type == "cuda":
            capacity_bytes = torch.cuda.mem_get_info(self.device)[0] // 4
        super().__init__(name, capacity_bytes)
        self.capabilities = TierCapabilities(
            persistent=False, shared=False, device=self.device.type, alignment_bytes=PAGE
        )
        self._writer_cls = _GpuWriter
        self._reader_cls = _GpuReader

    @classmethod
    def from_config(cls, cfg: TierConfig, engines: EngineSource) -> GpuTier:
        """A gpu tier takes no location; ``options: {device: cuda:1}`` picks the device (default: the
        current one)."""
        refuse_location(cfg, "a gpu tier keeps checkpoints in device memory and takes no path")
        device = check_options(cfg, OPTIONS)["device"]
        if not torch.cuda.is_available():
            raise ConfigError(f"{cfg.key}.kind: gpu needs a CUDA device, and torch.cuda.is_available() is False")
        index = torch.device(device).index if device is not None else None
        if index is not None and index >= torch.cuda.device_count():
            raise ConfigError(
                f"{cfg.key}.options.device: {device} does not exist ({torch.cuda.device_count()} CUDA devices)"
            )
        tier = cls(cfg.name, cfg.capacity_bytes, device)
        if cfg.blob_bytes:
            tier.preferred_blob_bytes = cfg.blob_bytes
        return tier

    def _alloc(self, size: int) -> torch.Tensor:
        return torch.empty(size, dtype=torch.uint8, device=self.device)

    def describe(self) -> str:
        return f"{self.device} memory, capacity {self.capacity_bytes} bytes"

    def copy_buffer(self, dst: torch.Tensor, src: torch.Tensor, nbytes: int) -> None:
        device_copy(dst, src, nbytes)

    def pack(
        self,
        writer: TierWriter,
        flat: FlatState,
        layout: Layout,
        staging: Callable[[], StagingPool],
        on_staged: Callable[[], None],
    ) -> list[int]:
        """Snapshot the state into ``writer``'s blob buffers with device copies; return the checksums.

        Tensors on this device are copied device-to-device; others (CPU step counters, RNG state) are
        uploaded. Gaps and padding are zeroed. ``on_staged`` runs once the copies out of the caller's
        tensors are complete; the checksums are computed afterwards from the packed blobs.
        """
        bufs = [_own_buffer(writer, b) for b in range(len(layout.blob_sizes))]
        stream = side_stream(self.device)
        if stream is not None:
            stream.wait_stream(torch.cuda.current_stream(self.device))  # the state as the caller queued it
        keep: list[torch.Tensor] = []  # temporaries stay alive until the stream is done with them
        with torch.cuda.stream(stream) if stream is not None else contextlib.nullcontext():
            for buf in bufs:
                buf.zero_()
            for r, e in zip(flat.tensors, layout.extents):
                if not e.length:
                    continue
                src = _as_bytes(r.tensor)
                if src.device != self.device:
                    src = src.to(self.device, non_blocking=True)
                bufs[e.blob][e.offset : e.offset + e.length].copy_(src, non_blocking=True)
                keep.append(src)
        if stream is not None:
            stream.synchronize()
        del keep
        on_staged()
        return self._checksums(bufs, layout, staging())

    def _checksums(self, bufs: Sequence[torch.Tensor], layout: Layout, pool: StagingPool) -> list[int]:
        extents = layout.extents
        sums = [_EMPTY_DIGEST] * len(extents)
        order = sorted(
            (i for i, e in enumerate(extents) if e.length), key=lambda i: (extents[i].blob, extents[i].offset)
        )
        hasher = xxhash.xxh3_64()
        k, slot = 0, pool.acquire()
        try:
            for b, buf in enumerate(bufs):
                size = layout.blob_sizes[b]
                for c0 in range(0, size, pool.slot_bytes):
                    if k >= len(order) or extents[order[k]].blob != b:
                        break  # the rest of this blob is padding
                    c1 = min(size, c0 + pool.slot_bytes)
                    device_copy(slot, buf[c0:c1], c1 - c0)
                    view = ptr_mv(slot.data_ptr(), c1 - c0)
                    while k < len(order):
                        e = extents[order[k]]
                        if e.blob != b or e.offset >= c1:
                            break
                        a, z = max(e.offset, c0), min(e.offset + e.length, c1)
                        if a == e.offset:
                            hasher.reset()
                        hasher.update(view[a - c0 : z - c0])
                        if z < e.offset + e.length:
                            break  # goes on in the next chunk
                        sums[order[k]] = hasher.intdigest()
                        k += 1
                    del view
        finally:
            pool.release(slot)
        return sums


class _GpuWriter(_HostWriter):
    def write(self, blob: int, offset: int, addr: int, nbytes: int) -> Future[int]:
        dst = self._bufs[blob]
        if offset < 0 or offset + nbytes > dst.numel():
            raise ValueError(f"write [{offset}, {offset + nbytes}) outside blob {blob} of {dst.numel()} bytes")
        if nbytes:
            device_copy(dst[offset : offset + nbytes], _host_view(addr, nbytes), nbytes)
        return done_future(nbytes)


class _GpuReader(_HostReader):
    def read(self, blob: int, offset: int, addr: int, nbytes: int) -> Future[int]:
        src = self._held.blobs[blob]
        n = max(0, min(nbytes, src.numel() - offset))
        if n:
            device_copy(_host_view(addr, n), src[offset : offset + n], n)
        return done_future(n)
