"""The codec writer (tierckpt.datapath.codecwrite): raw writes in every order and size, each blob's stored
stream out in frame order in the tier's chunks, decodable to the raw blob; errors, abort, the plain
manifest when nothing gained, and what it tells the tier's Adaptive."""

from __future__ import annotations

import ctypes
import dataclasses
import errno
import os
import random
import threading
import time
import types
import weakref
from collections.abc import Callable, Sequence
from concurrent.futures import Future, ThreadPoolExecutor
from pathlib import Path
from typing import Any

import pytest
import torch

from tierckpt.datapath.blobcopy import ordered_writer
from tierckpt.datapath.codecwrite import CodecWriter, codec_writer, frame_bytes_for
from tierckpt.datapath.storing import compresses, set_compression
from tierckpt.errors import ConfigError, DeviceFullError, TierFullError, TierIOError
from tierckpt.format.codec import Encoded, decode_frame
from tierckpt.format.frameindex import MIN_FRAME_BYTES
from tierckpt.format.frames import held_sizes, unwrap_manifest
from tierckpt.format.layout import round_up
from tierckpt.format.manifest import BlobEntry, Manifest, TensorTable, encode_manifest
from tierckpt.io.budget import Budget
from tierckpt.io.buffers import aligned_empty
from tierckpt.policies.compressconfig import CompressConfig
from tierckpt.policies.compression import PROBE_FIRST, RAW, Adaptive, FramePlan, Kind
from tierckpt.testing.faulty import FaultyTier
from tierckpt.tiers.base import CheckpointKey, Tier, TierWriter
from tierckpt.tiers.host import HostTier
from tierckpt.tiers.local import LocalTier

F = MIN_FRAME_BYTES  # 64 KiB frames: a few MiB of data make many
ALIGN = 4096
CHUNK = 4 * F


class Recorder(TierWriter):
    """A tier's writer that keeps what it is given, checks each write against the tier's rules (aligned,
    whole chunks but a blob's last, each blob front to back when ``ordered``), and completes writes on a
    thread after ``delay`` (or fails the ``fail_at``-th with ``error``; ``inline``: completes each in
    ``write``, its future resolved when it returns)."""

    def __init__(
        self, sizes: Sequence[int], *, delay: float = 0.0, fail_at: int | None = None, inline: bool = False
    ) -> None:
        self.data = [bytearray(n) for n in sizes]
        self.ends = [0] * len(sizes)  # per blob: where its writes reached
        self.writes: list[tuple[int, int, int]] = []
        self.manifest: bytes | None = None
        self.aborted = False
        self.delay, self.fail_at, self.inline = delay, fail_at, inline
        self.error = OSError(5, "injected write failure")
        self._pool = ThreadPoolExecutor(4)
        self._lock = threading.Lock()

    def write(self, blob: int, offset: int, addr: int, nbytes: int) -> Future[int]:
        assert offset % ALIGN == 0 and nbytes % ALIGN == 0 and addr % ALIGN == 0, (blob, offset, nbytes)
        assert nbytes <= CHUNK and offset % CHUNK == 0
        with self._lock:
            assert offset == self.ends[blob], f"blob {blob}: a write at {offset}, expected {self.ends[blob]}"
            self.ends[blob] = offset + nbytes
            self.writes.append((blob, offset, nbytes))
            n = len(self.writes)
        data = ctypes.string_at(addr, nbytes)  # as a tier would send it: read before the future resolves

        def land() -> int:
            time.sleep(self.delay)
            if self.fail_at is not None and n >= self.fail_at:
                raise self.error
            self.data[blob][offset : offset + nbytes] = data
            return nbytes

        if self.inline:
            done: Future[int] = Future()
            done.set_result(land())
            return done
        return self._pool.submit(land)

    def commit(self, manifest: bytes) -> None:
        self.manifest = manifest

    def abort(self) -> None:
        self.aborted = True


class _Tier:
    """What the codec writer reads of its tier: a name and a budget."""

    def __init__(self, budget: Budget | None = None, memory_align: int = ALIGN) -> None:
        self.name, self.budget = "t", budget
        self.geometry = types.SimpleNamespace(memory_alignment_bytes=memory_align)


def _manifest(tensors: Sequence[tuple[str, str, int]], blob_sizes: Sequence[int] | None = None) -> Manifest:
    """One blob per tensor ``(path, dtype, nbytes)``, each holding it from offset 0 (sizes rounded up to
    the alignment unless ``blob_sizes`` says otherwise)."""
    sizes = list(blob_sizes or [round_up(n, ALIGN) for _, _, n in tensors])
    table = TensorTable(
        [p for p, _, _ in tensors], [d for _, d, _ in tensors], [(n,) for _, _, n in tensors],
        list(range(len(tensors))), [0] * len(tensors), [n for _, _, n in tensors], [0] * len(tensors),
    )  # fmt: skip
    blobs = tuple(BlobEntry(f"blob-{i:05d}.bin", s) for i, s in enumerate(sizes))
    return Manifest(step=3, rank=0, world_size=1, align=ALIGN, blobs=blobs, tensors=table, tree=b"\x80",
                    has_pickle=False, chunk_bytes=F)  # fmt: skip


def _floats(n: int, seed: int, dtype: torch.dtype = torch.bfloat16) -> torch.Tensor:
    """``n`` bytes of normally distributed floats (their exponent bytes compress), in aligned memory."""
    g = torch.Generator().manual_seed(seed)
    vals = torch.randn(n // torch.tensor([], dtype=dtype).element_size(), generator=g).to(dtype)
    out = aligned_empty(n, ALIGN, pin=False)
    out.copy_(vals.view(torch.uint8))
    return out


def _noise(n: int, seed: int) -> torch.Tensor:
    out = aligned_empty(n, ALIGN, pin=False)
    out.copy_(torch.randint(0, 256, (n,), dtype=torch.uint8, generator=torch.Generator().manual_seed(seed)))
    return out


def _write_all(w: TierWriter, blobs: Sequence[torch.Tensor], size: int, order: str, seed: int = 0) -> None:
    """Write every blob in writes of ``size`` bytes, in ``order``, all at once; wait for them."""
    ops = [(b, o, min(size, t.numel() - o)) for b, t in enumerate(blobs) for o in range(0, t.numel(), size)]
    if order == "backward":
        ops.reverse()
    elif order == "shuffled":
        random.Random(seed).shuffle(ops)
    futs = [w.write(b, o, blobs[b].data_ptr() + o, n) for b, o, n in ops]
    for f in futs:
        assert f.result() > 0


def _decoded(manifest: bytes, stored: Sequence[bytes | bytearray]) -> list[bytes]:
    """Each blob's raw bytes, decoded from its stored stream as the copy's index says."""
    _, index = unwrap_manifest(manifest)
    assert index is not None
    out = []
    for b, data in enumerate(stored):
        raw = bytearray(index.sizes[b])
        assert len(data) >= round_up(index.held[b], ALIGN) and not any(data[index.held[b] :])  # zero padding
        for k in range(index.count(b)):
            fr = index.frame(b, k)
            view = memoryview(bytes(data))[fr.stored_offset : fr.stored_offset + fr.stored_len]
            decode_frame(view, fr, memoryview(raw)[fr.raw_offset : fr.raw_offset + fr.raw_len])
        out.append(bytes(raw))
    return out


ZSTD = CompressConfig("zstd")


def _writer(inner: TierWriter, m: Manifest, cfg: CompressConfig = ZSTD, **kw: Any) -> CodecWriter:
    adaptive = kw.pop("adaptive", None) or Adaptive(cfg, 2)
    end = kw.pop("end", lambda b, n: None)
    tier = kw.pop("tier", _Tier())
    return codec_writer(tier, inner, end, m, adaptive, chunk_bytes=kw.pop("chunk", CHUNK), **kw)


# -- every order and size ---------------------------------------------------------------------------------
@pytest.mark.parametrize("order", ["forward", "backward", "shuffled"])
@pytest.mark.parametrize("size", [F // 4 + ALIGN, F, 3 * F, 5 * F + ALIGN, 1 << 30])
def test_any_order_and_chunk_decodes_to_the_raw_blobs(order: str, size: int) -> None:
    lens = [9 * F + 3 * ALIGN, 2 * F, ALIGN, 4 * F - 6]  # last frames of every length, one frame, one short one
    m = _manifest([("s['w']", "bfloat16", lens[0]), ("s['exp_avg']", "float32", lens[1]),
                   ("s['step']", "int64", lens[2]), ("s['x']", "float16", lens[3])])  # fmt: skip
    blobs = [_floats(b.size, i) for i, b in enumerate(m.blobs)]
    blobs[2] = _noise(m.blobs[2].size, 9)
    inner = Recorder([b.size for b in m.blobs])
    w = _writer(inner, m)
    _write_all(w, blobs, min(size, max(b.size for b in m.blobs)), order)
    w.commit(encode_manifest(m))
    assert inner.manifest is not None
    inner_manifest, index = unwrap_manifest(inner.manifest)
    assert inner_manifest == encode_manifest(m) and index is not None and index.frame_bytes == F
    assert _decoded(inner.manifest, inner.data) == [bytes(t.numpy()) for t in blobs]
    assert index.compressed_frames() > 0 and index.held[2] == m.blobs[2].size  # noise stays raw
    assert held_sizes(inner.manifest) == [round_up(h, ALIGN) for h in index.held] == inner.ends
    assert index.held[0] < m.blobs[0].size


def test_partial_frames_from_reused_staging_slots() -> None:
    """A caller that reuses its staging slot once a write's future resolves (a file→file copy) and
    scribbles over it: the writer never reads it after that."""
    m = _manifest([("s['w']", "float32", 7 * F + ALIGN), ("s['v']", "bfloat16", 3 * F)])
    blobs = [_floats(b.size, i, torch.float32) for i, b in enumerate(m.blobs)]
    inner = Recorder([b.size for b in m.blobs], delay=0.002)
    w = _writer(inner, m)
    _through_slots(w, blobs, F // 2 + ALIGN)
    w.commit(encode_manifest(m))
    assert inner.manifest is not None
    assert _decoded(inner.manifest, inner.data) == [bytes(t.numpy()) for t in blobs]


def _through_slots(w: TierWriter, blobs: Sequence[torch.Tensor], slot_bytes: int) -> None:
    """Write ``blobs`` in order through two staging slots of ``slot_bytes``, each reused (and scribbled
    over) once its write resolved, as a file→file copy does."""
    slots = [aligned_empty(slot_bytes, ALIGN, pin=False) for _ in range(2)]
    inflight: list[tuple[torch.Tensor, Future[int]]] = []
    for b, t in enumerate(blobs):
        for o in range(0, t.numel(), slot_bytes):
            if len(inflight) == len(slots):
                slot, f = inflight.pop(0)
                f.result(timeout=60)
                slot.fill_(0xAA)  # the caller's next bytes
                slots.append(slot)
            slot = slots.pop()
            n = min(slot_bytes, t.numel() - o)
            slot[:n].copy_(t[o : o + n])
            inflight.append((slot, w.write(b, o, slot.data_ptr(), n)))
    for slot, f in inflight:
        f.result(timeout=60)
        slot.fill_(0xAA)


def test_whole_frames_raw_are_released_only_once_copied_out() -> None:
    """Frames stored raw are read where the caller wrote them until they are copied into the output: a
    caller reusing its memory once the future resolves finds its bytes stored as they were."""
    m = _manifest([("s['n']", "uint8", 6 * F)])
    blob = _noise(m.blobs[0].size, 3)
    inner = Recorder([blob.numel()], delay=0.005)
    w = _writer(inner, m)
    slot = aligned_empty(2 * F, ALIGN, pin=False)
    for o in range(0, blob.numel(), slot.numel()):
        slot.copy_(blob[o : o + slot.numel()])
        w.write(0, o, slot.data_ptr(), slot.numel()).result()
        slot.fill_(0)
    w.commit(encode_manifest(m))
    assert inner.manifest == encode_manifest(m)  # nothing gained: the plain manifest
    assert bytes(inner.data[0]) == bytes(blob.numpy())


class AddrRecorder(Recorder):
    """A :class:`Recorder` that also keeps the memory each write came from."""

    def __init__(self, sizes: Sequence[int], **kw: Any) -> None:
        super().__init__(sizes, **kw)
        self.addrs: list[tuple[int, int, int]] = []  # (blob, offset, address)

    def write(self, blob: int, offset: int, addr: int, nbytes: int) -> Future[int]:
        self.addrs.append((blob, offset, addr))
        return super().write(blob, offset, addr, nbytes)


@pytest.mark.parametrize("aligned", [True, False])
def test_raw_frames_are_written_from_the_callers_memory(aligned: bool) -> None:
    """A blob whose frames stay raw goes to the tier from the caller's memory in the tier's chunks (the
    last one short), where that memory is aligned as the tier needs; each write's memory is given back
    only once the tier's write completed: the caller then scribbles over it, and the copy is intact.
    A blob that compresses still goes through output chunks."""
    m = _manifest([("s['n']", "uint8", 9 * F + ALIGN), ("s['w']", "bfloat16", 3 * F)])
    blobs = [_noise(m.blobs[0].size, 5), _floats(m.blobs[1].size, 6)]
    want = [bytes(t.numpy()) for t in blobs]
    inner = AddrRecorder([b.size for b in m.blobs], delay=0.005)
    adaptive = Adaptive(ZSTD, 2)
    w = _writer(inner, m, tier=_Tier(memory_align=ALIGN if aligned else 1 << 40), adaptive=adaptive)
    futs = [w.write(b, 0, t.data_ptr(), t.numel()) for b, t in enumerate(blobs)]
    for f in futs:
        f.result(timeout=60)
    for t in blobs:
        t.fill_(0xAA)  # the caller's memory is its own again
    w.commit(encode_manifest(m))
    assert inner.manifest is not None
    assert _decoded(inner.manifest, inner.data) == want
    direct = [(b, o) for b, o, a in inner.addrs if a == blobs[b].data_ptr() + o]
    assert direct == ([(0, 0), (0, CHUNK), (0, 2 * CHUNK)] if aligned else [])
    assert [n for b, _, n in inner.writes if b == 0] == [CHUNK, CHUNK, F + ALIGN]
    snap = adaptive.snapshot()  # the tier's count of each: for benchmarks and logs
    assert snap["written_from_memory_bytes"] == (2 * CHUNK + F + ALIGN if aligned else 0)
    assert snap["written_from_memory_bytes"] + snap["written_copied_bytes"] == sum(n for _, _, n in inner.writes)


def test_a_run_waits_for_frames_whose_bytes_are_in(monkeypatch: pytest.MonkeyPatch) -> None:
    """Frames whose bytes all arrived but that take longer to encode than the emitter waits with a run
    (a loaded machine) do not break the run: only a frame whose bytes are still to come does."""
    from tierckpt.datapath import codecwrite

    real = codecwrite.encode_frame

    def slow(*args: Any) -> Encoded:
        time.sleep(5 * codecwrite.SETTLE_SECS)
        return real(*args)

    monkeypatch.setattr(codecwrite, "encode_frame", slow)
    m = _manifest([("s['n']", "uint8", 8 * F)])
    blob = _noise(m.blobs[0].size, 8)
    inner = AddrRecorder([blob.numel()])
    w = _writer(inner, m)
    w.write(0, 0, blob.data_ptr(), blob.numel()).result(timeout=60)
    w.commit(encode_manifest(m))
    assert bytes(inner.data[0]) == bytes(blob.numpy())
    assert [a - blob.data_ptr() for _, _, a in inner.addrs] == [0, CHUNK]


def test_a_run_held_back_is_copied_out_when_the_caller_waits_for_it() -> None:
    """A caller that writes less than a chunk and waits for it before writing more (its memory reused)
    gets its future: the emitter copies the run out instead of waiting for frames that cannot come."""
    m = _manifest([("s['n']", "uint8", 6 * F)])
    blob = _noise(m.blobs[0].size, 7)
    inner = AddrRecorder([blob.numel()])
    w = _writer(inner, m)
    slot = aligned_empty(F, ALIGN, pin=False)
    for o in range(0, blob.numel(), F):
        slot.copy_(blob[o : o + F])
        w.write(0, o, slot.data_ptr(), F).result(timeout=60)
        slot.fill_(0)
    w.commit(encode_manifest(m))
    assert bytes(inner.data[0]) == bytes(blob.numpy())
    assert not [a for _, _, a in inner.addrs if a == slot.data_ptr()], "no chunk was whole in one write"


def test_writes_twice_outside_or_missing_are_refused() -> None:
    m = _manifest([("s['w']", "bfloat16", 3 * F)])
    blob = _floats(m.blobs[0].size, 1)
    inner = Recorder([blob.numel()])
    w = _writer(inner, m)
    with pytest.raises(ValueError, match="outside blob 0"):
        w.write(0, 2 * F, blob.data_ptr(), 2 * F)
    w.write(0, 0, blob.data_ptr(), F + ALIGN).result()
    with pytest.raises(ValueError, match="written twice"):
        w.write(0, F, blob.data_ptr(), ALIGN)
    with pytest.raises(ValueError, match="blob 0 frame 1 was not written"):
        w.commit(encode_manifest(m))
    w.write(0, F + ALIGN, blob.data_ptr() + F + ALIGN, 2 * F - ALIGN).result()
    w.commit(encode_manifest(m))  # the writer was left as it was: completed now
    assert inner.manifest is not None
    assert _decoded(inner.manifest, inner.data) == [bytes(blob.numpy())]


# -- a tier that takes its writes in order ----------------------------------------------------------------
def test_a_sequential_tier_gets_each_blob_front_to_back(tmp_path: Path) -> None:
    local = LocalTier("ssd", tmp_path)
    tier = FaultyTier(local, capabilities={"sequential_writes": True})
    m = _manifest([("s['w']", "bfloat16", 6 * F), ("s['b']", "bool", 2 * F), ("s['v']", "float32", 5 * F)])
    blobs = [_floats(b.size, i) for i, b in enumerate(m.blobs)]
    blobs[1] = torch.zeros_like(blobs[1])
    key = CheckpointKey(3)
    try:
        ordered, end = ordered_writer(tier, tier.reserve(key, m.blobs), m.blobs)
        w = _writer(ordered, m, end=end, tier=tier, chunk=2 * F)
        futs = [w.write(b, o, t.data_ptr() + o, min(F, t.numel() - o)) for b, t in enumerate(blobs)
                for o in range(0, t.numel(), F)]  # fmt: skip
        for f in futs:
            f.result()
        w.commit(encode_manifest(m))
        manifest = (tmp_path / "step-000000000003" / "rank-00000" / "manifest").read_bytes()
        held = held_sizes(manifest)
        assert held is not None and held[1] < m.blobs[1].size
        files = [(tmp_path / "step-000000000003" / "rank-00000" / b.name).read_bytes() for b in m.blobs]
        assert [len(f) for f in files] == held  # each blob file cut to what it holds
        assert _decoded(manifest, files) == [bytes(t.numpy()) for t in blobs]
    finally:
        local.close()


# -- errors and abort -------------------------------------------------------------------------------------
def test_an_inner_write_error_surfaces_at_commit_and_abort_cleans_up() -> None:
    m = _manifest([("s['w']", "bfloat16", 12 * F), ("s['v']", "float32", 6 * F)])
    blobs = [_floats(b.size, i) for i, b in enumerate(m.blobs)]
    inner = Recorder([b.size for b in m.blobs], fail_at=2)
    w = _writer(inner, m)
    futs = [w.write(b, o, t.data_ptr() + o, F) for b, t in enumerate(blobs) for o in range(0, t.numel(), F)]
    for f in futs:  # every write resolves, in error or not (the caller's memory is free either way)
        f.exception(timeout=30)
    with pytest.raises(OSError, match="injected write failure"):
        w.commit(encode_manifest(m))
    assert inner.manifest is None and not inner.aborted
    w.abort()
    w.abort()  # idempotent
    assert inner.aborted
    with pytest.raises(OSError, match="injected write failure"):
        w.write(0, 0, blobs[0].data_ptr(), F)


@pytest.mark.parametrize("full", [TierFullError("bucket quota exceeded"), DeviceFullError(28, "device full")])
def test_a_write_refused_for_room_fails_the_commit_as_an_io_error(full: TierFullError) -> None:
    """A write the tier refused for room (an S3 part over the quota, a full device) cannot be made again
    by committing again: the commit raises a TierIOError (ENOSPC, caused by the tier's error), not a
    TierFullError, so that the mover does not make room and retry it. Again at every commit."""
    m = _manifest([("s['w']", "bfloat16", 8 * F)])
    blob = _floats(m.blobs[0].size, 4)
    inner = Recorder([blob.numel()], fail_at=2)
    inner.error = full
    w = _writer(inner, m)
    _write_all(w, [blob], F, "forward")
    for _ in range(2):
        with pytest.raises(TierIOError) as e:
            w.commit(encode_manifest(m))
        assert not isinstance(e.value, TierFullError) and e.value.errno == errno.ENOSPC
        assert e.value.__cause__ is full and str(full) in str(e.value)
    w.abort()
    assert inner.aborted and inner.manifest is None


def test_abort_mid_copy_leaves_nothing_on_a_local_tier(tmp_path: Path) -> None:
    tier = LocalTier("ssd", tmp_path)
    m = _manifest([("s['w']", "bfloat16", 16 * F)])
    blob = _floats(m.blobs[0].size, 2)
    try:
        w = _writer(tier.reserve(CheckpointKey(3), m.blobs), m, tier=tier)
        futs = [w.write(0, o, blob.data_ptr() + o, F) for o in range(0, 8 * F, F)]  # half of it
        w.abort()
        for f in futs:
            f.exception(timeout=30)
        assert tier.list_committed() == [] and not list(tmp_path.glob("step-*/*"))
    finally:
        tier.close()


class Stuck(TierWriter):
    """A tier's writer whose writes hang (parts in their retries, to a server that is down) until it is
    cancelled or aborted; it records the calls, and how many writes were still in flight at its abort
    (a tier's abort may free what they write to: a file tier closes its descriptors)."""

    def __init__(self) -> None:
        self.issued: list[Future[int]] = []
        self.calls: list[str] = []
        self.inflight_at_abort: int | None = None
        self._lock = threading.Lock()
        self._given_up = False

    def write(self, blob: int, offset: int, addr: int, nbytes: int) -> Future[int]:
        f: Future[int] = Future()
        with self._lock:
            self.issued.append(f)
            if not self._given_up:
                return f
        f.set_exception(OSError(125, "cancelled"))
        return f

    def _give_up(self) -> None:
        with self._lock:
            self._given_up = True
            hung = [f for f in self.issued if not f.done()]
        for f in hung:
            f.set_exception(OSError(125, "the part's retries gave up"))

    def cancel(self) -> None:
        self.calls.append("cancel")
        self._give_up()

    def commit(self, manifest: bytes) -> None:
        raise AssertionError("not committed")

    def abort(self) -> None:
        self.calls.append("abort")
        self.inflight_at_abort = sum(not f.done() for f in self.issued)
        self._give_up()


def _in_thread(fn: Callable[[], None], limit: float = 30.0) -> bool:
    """Whether ``fn()`` returned within ``limit`` seconds (a hang detector: it normally takes
    milliseconds)."""
    t = threading.Thread(target=fn, daemon=True)
    t.start()
    t.join(limit)
    return not t.is_alive()


@pytest.mark.parametrize("during", ["writes", "commit"])
def test_abort_does_not_wait_for_writes_the_tier_holds(during: str) -> None:
    """The tier's writes hang (an S3 part in retries): abort cancels the tier's writer first, so that they
    fail, then waits for them, and only then aborts it. The same for an abort from another thread while
    commit waits for the writes."""
    m = _manifest([("s['w']", "bfloat16", 16 * F)])
    blob = _floats(m.blobs[0].size, 3)
    inner = Stuck()
    w = _writer(inner, m, chunk=F)
    try:
        futs = [w.write(0, o, blob.data_ptr() + o, F) for o in range(0, blob.numel(), F)]
        deadline = time.monotonic() + 30
        while not inner.issued and time.monotonic() < deadline:
            time.sleep(0.01)
        assert inner.issued, "nothing reached the tier"
        if during == "commit":
            errors: list[BaseException] = []

            def commit() -> None:
                try:
                    w.commit(encode_manifest(m))
                except BaseException as e:
                    errors.append(e)

            committing = threading.Thread(target=commit, daemon=True)
            committing.start()
        assert _in_thread(w.abort), "abort waited for the tier's writes"
        assert inner.calls == ["cancel", "abort"] and inner.inflight_at_abort == 0
        for f in futs:  # every write resolved (the frames encoded before the abort without an error)
            f.exception(timeout=30)
        if during == "commit":
            committing.join(30)
            assert not committing.is_alive() and len(errors) == 1 and "aborted" in str(errors[0])
    finally:
        inner.cancel()  # a hung writer's threads go (where abort did not come back)


def test_an_encoder_error_surfaces_at_commit(monkeypatch: pytest.MonkeyPatch) -> None:
    import tierckpt.datapath.codecwrite as cw

    def broken(*a: object) -> Encoded:
        raise MemoryError("no room to encode")

    monkeypatch.setattr(cw, "encode_frame", broken)
    m = _manifest([("s['w']", "bfloat16", 4 * F)])
    blob = _floats(m.blobs[0].size, 2)
    inner = Recorder([blob.numel()])
    w = _writer(inner, m)
    with pytest.raises(MemoryError, match="no room to encode"):  # a write once it stopped: its error
        for o in range(0, blob.numel(), F):
            w.write(0, o, blob.data_ptr() + o, F).exception(timeout=30)
            time.sleep(0.05)
    with pytest.raises(MemoryError, match="no room to encode"):
        w.commit(encode_manifest(m))
    w.abort()
    assert inner.aborted and inner.manifest is None


# -- what is decided, and with what --------------------------------------------------------------------
class FakeAdaptive(Adaptive):
    """An Adaptive whose plans are given, recording what the writer tells it."""

    def __init__(self, plan: Callable[[Kind], FramePlan]) -> None:
        super().__init__(CompressConfig("auto"), 2)
        self._plan = plan
        self.tier: list[tuple[int, float]] = []
        self.frames: list[tuple[Kind, int]] = []
        self.budgets: list[float | None] = []

    def plan(self, kind: Kind, budget: float | None = None) -> FramePlan:
        self.budgets.append(budget)
        return self._plan(kind)

    def observe_frame(self, kind: Kind, enc: Any, plan: FramePlan | None = None) -> None:
        self.frames.append((kind, enc.width))

    def observe_tier(self, stored_bytes: int, busy_seconds: float) -> None:
        self.tier.append((stored_bytes, busy_seconds))


def test_no_frame_compressed_commits_the_plain_manifest() -> None:
    m = _manifest([("s['w']", "bfloat16", 5 * F), ("s['v']", "float32", 3 * F - ALIGN)])
    blobs = [_floats(b.size, i) for i, b in enumerate(m.blobs)]
    fake = FakeAdaptive(lambda kind: RAW)
    inner = Recorder([b.size for b in m.blobs])
    w = _writer(inner, m, adaptive=fake)
    _write_all(w, blobs, 2 * F + ALIGN, "shuffled")
    w.commit(encode_manifest(m))
    assert inner.manifest == encode_manifest(m) and fake.frames == []  # nothing encoded, nothing observed
    assert [bytes(d) for d in inner.data] == [bytes(t.numpy()) for t in blobs]


def test_plans_are_followed_per_kind_and_the_tier_is_measured() -> None:
    m = _manifest([("s['w']", "bfloat16", 4 * F), ("s['exp_avg']", "float32", 4 * F)])
    blobs = [_floats(m.blobs[0].size, 1), _floats(m.blobs[1].size, 2, torch.float32)]
    fake = FakeAdaptive(lambda kind: FramePlan(kind.width, 0b10) if kind.width == 2 else RAW)
    inner = Recorder([b.size for b in m.blobs], delay=0.001)
    w = _writer(inner, m, adaptive=fake, tier=_Tier(Budget(50e6)))
    _write_all(w, blobs, F, "forward")
    w.commit(encode_manifest(m))
    assert inner.manifest is not None
    _, index = unwrap_manifest(inner.manifest)
    assert index is not None
    assert [index.frame(0, k).width for k in range(4)] == [2] * 4 and [index.frame(0, k).planes for k in range(4)] == [
        2
    ] * 4
    assert [index.frame(1, k).width for k in range(4)] == [0] * 4
    assert [k.name for k, _ in fake.frames] == ["bfloat16/weight"] * 4
    assert set(fake.budgets) == {50e6}  # the budget paces background work: the throughput is at most it
    # every write but the copy's first completed one (which pays for starting the copy) is reported
    assert sum(inner.ends) - sum(n for n, _ in fake.tier) in {n for _, _, n in inner.writes}
    assert len(fake.tier) == len(inner.writes) - 1 and all(s > 0 for _, s in fake.tier)


def test_a_foreground_copy_is_not_bounded_by_the_budget() -> None:
    m = _manifest([("s['w']", "bfloat16", 2 * F)])
    blob = _floats(m.blobs[0].size, 1)
    fake = FakeAdaptive(lambda kind: RAW)
    w = _writer(Recorder([blob.numel()]), m, adaptive=fake, tier=_Tier(Budget(50e6)), background=False)
    _write_all(w, [blob], F, "forward")
    w.commit(encode_manifest(m))
    assert fake.budgets == [None, None]


class _Measured(Adaptive):
    """An Adaptive that keeps the tier's throughput it was given (not the test's recorder's)."""

    def observe_tier(self, stored_bytes: int, busy_seconds: float) -> None:
        pass


def _copy_with(adaptive: Adaptive, tier: _Tier, frames: int = 64) -> tuple[int, int]:
    """(compressed frames, frames) of a copy of bf16 weights written with ``adaptive`` to ``tier``."""
    m = _manifest([("s['w']", "bfloat16", frames * F)])
    blob = _floats(m.blobs[0].size, 5)
    inner = Recorder([blob.numel()])
    w = _writer(inner, m, adaptive=adaptive, tier=tier)
    _write_all(w, [blob], 4 * F, "forward")
    w.commit(encode_manifest(m))
    assert inner.manifest is not None
    _, index = unwrap_manifest(inner.manifest)
    return (0 if index is None else index.compressed_frames()), frames


def test_auto_compresses_on_a_slow_budgeted_tier_and_not_on_a_fast_one() -> None:
    """``auto`` with the figures a slow tier gives (a budget of 2 MB/s: any compressor is faster) and a
    fast one (10 GB/s measured: none is): after the probes, the slow tier's frames are compressed and
    the fast tier's raw."""
    slow = Adaptive(CompressConfig("auto"), 2)
    got, total = _copy_with(slow, _Tier(Budget(2e6)))  # the writer gives it the tier's budget
    assert got >= total - PROBE_FIRST  # all but the first frames, stored raw while their samples are measured
    fast = _Measured(CompressConfig("auto"), 2)
    Adaptive.observe_tier(fast, 10 << 30, 1.0)  # what a fast tier's writes would report
    got, total = _copy_with(fast, _Tier())
    assert got == 0  # the probes compress samples only; the frames stay raw


def test_two_writers_of_one_tier_decide_with_their_own_budgets() -> None:
    """A tier that does 10 GB/s, shared by a background demotion its budget paces at 2 MB/s and a
    blocking save it does not pace, written at once through the tier's one Adaptive: the paced copy is
    compressed, the other stays raw (neither writer's budget is the other's)."""
    shared = _Measured(CompressConfig("auto"), 2)
    Adaptive.observe_tier(shared, 10 << 30, 1.0)
    tier = _Tier(Budget(2e6))
    m = _manifest([("s['w']", "bfloat16", 48 * F)])
    blob = _floats(m.blobs[0].size, 5)
    paced, full = Recorder([blob.numel()]), Recorder([blob.numel()])
    writers = [
        _writer(paced, m, adaptive=shared, tier=tier),
        _writer(full, m, adaptive=shared, tier=tier, background=False),
    ]
    futs = [w.write(0, o, blob.data_ptr() + o, F) for o in range(0, blob.numel(), F) for w in writers]  # interleaved
    for f in futs:
        f.result()
    for w in writers:
        w.commit(encode_manifest(m))
    assert paced.manifest is not None and full.manifest is not None
    _, index = unwrap_manifest(paced.manifest)
    assert index is not None and index.compressed_frames() >= 48 - 2 * PROBE_FIRST  # after the probes' samples
    assert full.manifest == encode_manifest(m)  # nothing compressed: the plain copy


def test_a_paced_write_is_timed_from_when_the_budget_let_it_go(monkeypatch: pytest.MonkeyPatch) -> None:
    """The tier's throughput excludes the budget's waits: a clock that moves only while the budget makes
    a write wait reads no busy time at all for writes that complete as they are handed over."""
    import tierckpt.datapath.codecemit as ce
    from tierckpt.datapath.throttle import throttled_writer

    now = [0.0]

    def sleep(secs: float) -> None:
        now[0] += secs

    monkeypatch.setattr(ce, "perf_counter", lambda: now[0])
    budget = Budget(1e6, burst_bytes=CHUNK, clock=lambda: now[0], sleep=sleep)
    m = _manifest([("s['n']", "uint8", 16 * F)])
    blob = _noise(m.blobs[0].size, 2)
    tier = _Tier(budget)
    fake = FakeAdaptive(lambda kind: RAW)
    inner = Recorder([blob.numel()], inline=True)
    w = _writer(throttled_writer(tier, inner, background=True), m, adaptive=fake, tier=tier)  # type: ignore[arg-type]
    _write_all(w, [blob], F, "forward")
    w.commit(encode_manifest(m))
    assert budget.stats().waited_secs > 0 and sum(n for n, _ in fake.tier) == blob.numel() - CHUNK  # not the first
    assert sum(s for _, s in fake.tier) == 0.0


# -- the setting on tiers ---------------------------------------------------------------------------------
def test_set_compression_defaults_and_keeps_one_adaptive_per_tier(tmp_path: Path) -> None:
    host, local = HostTier("host"), LocalTier("ssd", tmp_path)
    try:
        assert set_compression(host).mode == "none" and not compresses(host)
        assert set_compression(local).mode == "none"  # a node's own disk
        local.compress = CompressConfig("zstd", 3)
        assert set_compression(local) == CompressConfig("zstd", 3) and compresses(local)
        adaptive = local.adaptive
        set_compression(local)
        assert local.adaptive is adaptive
        set_compression(local, CompressConfig("auto"))
        assert local.adaptive is not adaptive and local.adaptive is not None and local.adaptive.cfg.mode == "auto"
    finally:
        local.close()


def test_auto_writes_a_copy_plain_once_it_measured_that_nothing_pays(tmp_path: Path) -> None:
    """A copy to an ``auto`` tier whose measurements say no kind of it pays gets the tier's own writer,
    as under ``none`` (one in RECHECK_COPIES still goes through the codec writer to measure again)."""
    from tierckpt.datapath.storing import storing_writer
    from tierckpt.policies.compression import RECHECK_COPIES

    tier = LocalTier("ssd", tmp_path)
    m = _manifest([("s['n']", "uint8", 4 * F), ("s['w']", "bfloat16", 4 * F)])
    blobs = [_noise(m.blobs[0].size, 9), _floats(m.blobs[1].size, 9)]
    try:
        set_compression(tier, CompressConfig("auto"))
        adaptive = tier.adaptive
        assert adaptive is not None

        def writer(step: int) -> TierWriter:
            inner = tier.reserve(CheckpointKey(step), m.blobs)
            return storing_writer(tier, inner, m.blobs, chunk_bytes=CHUNK, background=True, codec=m)

        first = writer(1)
        assert isinstance(first, CodecWriter)  # nothing measured yet
        _write_all(first, blobs, CHUNK, "forward")
        first.commit(encode_manifest(m))
        adaptive.observe_tier(100 << 30, 1.0)  # a tier faster than any compressor
        adaptive.observe_cpu(0.0, 1 << 30)
        plain = [writer(2 + i) for i in range(RECHECK_COPIES)]
        assert [isinstance(w, CodecWriter) for w in plain] == [False] * (RECHECK_COPIES - 1) + [True]
        for w in plain:
            w.abort()
    finally:
        tier.close()


class _Cuda(HostTier):
    """A tier whose bytes live in device memory, as far as its capabilities say."""

    def __init__(self) -> None:
        super().__init__("dev")
        self.capabilities = dataclasses.replace(self.capabilities, device="cuda")


def test_a_gpu_tier_refuses_compression() -> None:
    from tierckpt.tiers.gpu import GpuTier

    gpu: Tier = GpuTier("gpu", device="cpu")
    assert set_compression(gpu).mode == "none" and not compresses(gpu)
    gpu.compress = CompressConfig("zstd")  # its copies are device copies: it stores none compressed
    with pytest.raises(ConfigError, match="encoded_copies"):
        set_compression(gpu)
    assert not compresses(gpu)
    with pytest.raises(ConfigError, match="tiers\\[0\\].compress: a gpu tier"):
        set_compression(_Cuda(), CompressConfig("zstd"), "tiers[0].compress")


def test_frame_bytes_follow_the_checksum_chunk() -> None:
    m = _manifest([("s['w']", "bfloat16", F)])
    assert frame_bytes_for(m) == F
    assert frame_bytes_for(dataclasses.replace(m, chunk_bytes=4096)) == F  # at least 64 KiB
    assert frame_bytes_for(dataclasses.replace(m, chunk_bytes=3 << 20)) == 4 << 20  # no power of two
    assert frame_bytes_for(dataclasses.replace(m, chunk_bytes=1 << 30)) == 64 << 20
    assert frame_bytes_for(dataclasses.replace(m, version=4)) == 4 << 20


@pytest.mark.parametrize("order", ["forward", "shuffled"])
def test_a_window_of_one_frame_and_one_output_chunk_still_gets_through(order: str) -> None:
    """The tightest bounds: one frame in the pool (the one the emitter waits for always goes) and one
    output chunk in flight, on a slow tier, with writes arriving out of order."""
    m = _manifest([("s['w']", "bfloat16", 10 * F + ALIGN), ("s['v']", "float32", 7 * F)])
    blobs = [_floats(b.size, i) for i, b in enumerate(m.blobs)]
    inner = Recorder([b.size for b in m.blobs], delay=0.001)
    w = CodecWriter(_Tier(), inner, lambda b, n: None, m, Adaptive(ZSTD, 2), chunk_bytes=CHUNK, window=1, out_slots=1)
    _write_all(w, blobs, F // 2 + ALIGN, order, seed=4)
    w.commit(encode_manifest(m))
    assert inner.manifest is not None
    assert _decoded(inner.manifest, inner.data) == [bytes(t.numpy()) for t in blobs]


class _Buffers:
    """Counts the frame buffers alive (made by ``codecframes.frame_buffer``, gone once freed)."""

    def __init__(self, monkeypatch: pytest.MonkeyPatch) -> None:
        from tierckpt.datapath import codecframes

        self.alive = self.peak = self.made = 0
        self._lock = threading.Lock()
        real = codecframes.frame_buffer

        def counted(nbytes: int) -> torch.Tensor:
            buf = real(nbytes)
            with self._lock:
                self.alive += 1
                self.made += 1
                self.peak = max(self.peak, self.alive)
            weakref.finalize(buf, self._gone)
            return buf

        monkeypatch.setattr(codecframes, "frame_buffer", counted)

    def _gone(self) -> None:
        with self._lock:
            self.alive -= 1


def _quarters(blob: torch.Tensor) -> list[tuple[int, int]]:
    """Writes of a quarter frame: the first quarter of every frame, then every second quarter, and so on
    (a frame fills only once the last quarters come)."""
    q = F // 4
    return [(o, q) for part in range(4) for o in range(part * q, blob.numel(), F)]


@pytest.mark.parametrize(("order", "window", "buffers"), [("quarters", 2, 2), ("quarters", 1, 1), ("forward", 2, 2)])
def test_frame_buffers_are_bounded_whatever_the_order(
    monkeypatch: pytest.MonkeyPatch, order: str, window: int, buffers: int
) -> None:
    """Writes smaller than a frame (an ``io: {chunk: 1MiB}`` under 4 MiB frames), every one issued
    before any is waited for, to a slow tier: in order, or so that each frame fills only once the last
    quarters come. At most ``buffers + window + 1`` frame buffers are alive at once (the parts beyond
    are held where the caller put them, or their writes wait), and the copy is whole."""
    counted = _Buffers(monkeypatch)
    m = _manifest([("s['w']", "bfloat16", 32 * F)])
    blob = _floats(m.blobs[0].size, 6)
    inner = Recorder([blob.numel()], delay=0.002)
    w = _writer(inner, m, window=window, buffers=buffers)
    ops = _quarters(blob) if order == "quarters" else [(o, F // 4) for o in range(0, blob.numel(), F // 4)]
    futs = [w.write(0, o, blob.data_ptr() + o, n) for o, n in ops[:32]]
    if order == "quarters":  # the first quarters beyond the buffers are held: their writes wait for their frames
        assert not any(f.done() for f in futs[buffers:])
    futs += [w.write(0, o, blob.data_ptr() + o, n) for o, n in ops[32:]]
    for f in futs:
        f.result(timeout=60)
    w.commit(encode_manifest(m))
    assert inner.manifest is not None
    assert _decoded(inner.manifest, inner.data) == [bytes(blob.numpy())]
    assert 0 < counted.peak <= buffers + window + 1, counted.peak


def test_a_caller_with_less_memory_than_a_frame_gets_through(monkeypatch: pytest.MonkeyPatch) -> None:
    """A copy through two staging slots of a quarter frame (and a page: its writes straddle frames),
    each slot reused once its write resolved, into the tightest bounds on a slow tier: its writes
    wait for frame buffers, and it never waits forever."""
    counted = _Buffers(monkeypatch)
    m = _manifest([("s['w']", "float32", 12 * F + ALIGN), ("s['v']", "bfloat16", 5 * F)])
    blobs = [_floats(b.size, i, torch.float32) for i, b in enumerate(m.blobs)]
    inner = Recorder([b.size for b in m.blobs], delay=0.002)
    w = _writer(inner, m, window=1, buffers=1, out_slots=1)
    _through_slots(w, blobs, F // 4 + ALIGN)
    w.commit(encode_manifest(m))
    assert inner.manifest is not None
    assert _decoded(inner.manifest, inner.data) == [bytes(t.numpy()) for t in blobs]
    assert counted.peak <= 3


def _punches(where: Path) -> bool:
    """Whether the file system at ``where`` punches holes."""
    from tierckpt.tiers._filewrite import punch_hole

    probe = where / "punch-probe"
    with probe.open("wb") as f:
        os.posix_fallocate(f.fileno(), 0, 1 << 20)
        return punch_hole(f.fileno(), 0, 1 << 20)


def test_one_data_file_keeps_each_blob_in_place_and_frees_the_tails(tmp_path: Path) -> None:
    """A tier with one data.bin a copy: blob i stays at the sum of the sizes before it; what a blob does
    not hold of its region is punched out where the file system can (ext4, xfs, tmpfs)."""
    from tierckpt.format.layout import data_offsets
    from tierckpt.tiers.pfs import PfsTier

    (tmp_path / "t").mkdir()
    tier = PfsTier("pfs", tmp_path / "t", direct=False)
    m = _manifest([("s['z']", "float32", 32 * F), ("s['n']", "uint8", 3 * F), ("s['w']", "bfloat16", 16 * F)])
    blobs = [torch.zeros(m.blobs[0].size, dtype=torch.uint8), _noise(m.blobs[1].size, 1), _floats(m.blobs[2].size, 2)]
    try:
        w = _writer(tier.reserve(CheckpointKey(3), m.blobs), m, tier=tier)
        _write_all(w, blobs, 2 * F, "shuffled")
        w.commit(encode_manifest(m))
        rank_dir = tmp_path / "t" / "step-000000000003" / "rank-00000"
        manifest = (rank_dir / "manifest").read_bytes()
        held = held_sizes(manifest)
        data = (rank_dir / "data.bin").read_bytes()
        assert held is not None and len(data) == sum(b.size for b in m.blobs)
        starts = data_offsets(m.blobs)
        assert _decoded(manifest, [data[o : o + h] for o, h in zip(starts, held)]) == [bytes(t.numpy()) for t in blobs]
        if _punches(tmp_path):
            allocated = (rank_dir / "data.bin").stat().st_blocks * 512
            assert allocated < sum(held) + 3 * 65536  # the tails are holes (a block or so each, at most)
    finally:
        tier.close()


def test_the_codec_pool_grows_and_its_executor_outlives_the_old_pool() -> None:
    from tierckpt.datapath import codecpool

    assert 1 <= codecpool.default_threads() <= codecpool.DEFAULT_MAX_THREADS
    executor = codecpool.get_pool()
    before = codecpool.ensure()
    assert codecpool.ensure(before + 1) == before + 1 == codecpool.size()
    assert codecpool.ensure(1) == before + 1  # never smaller
    assert executor.submit(lambda x, y=0: x + y, 2, y=3).result() == 5  # the same executor, the new pool
    executor.shutdown()  # one user cannot shut the process's pool down
    assert codecpool.submit(len, b"abc").result() == 3


class _Plain(HostTier):
    """A tier from elsewhere, shared and persistent, that does not declare it can store compressed copies."""

    def __init__(self) -> None:
        super().__init__("theirs")
        self.capabilities = dataclasses.replace(
            self.capabilities, device="object", shared=True, persistent=True, encoded_copies=False
        )


def test_a_tier_that_cannot_store_compressed_copies_gets_none() -> None:
    theirs: Tier = _Plain()
    assert set_compression(theirs).mode == "none" and not compresses(theirs)  # not auto, as s3 would get
    for asked in ("zstd", "auto"):
        with pytest.raises(ConfigError, match="tiers\\[1\\].compress: .*encoded_copies.*" + asked):
            set_compression(theirs, CompressConfig(asked), "tiers[1].compress")
    assert set_compression(theirs, CompressConfig("none")).mode == "none"
