"""What the mover reads of a tier's declared write limits: the chunk size within its part sizes (its
geometry's, tierckpt.io.geometry), the memory alignment its I/O needs of a buffer it is handed, and the
order of writes to a tier that takes them in order only (tierckpt.datapath.blobcopy); a copy or a pack
that fails cancels its writer before it waits for the writes in flight."""

from __future__ import annotations

import errno
import threading
from collections.abc import Callable
from concurrent.futures import Future
from dataclasses import replace

import pytest
import torch

from tierckpt.datapath.blobcopy import copy_blobs, writer_for
from tierckpt.format.manifest import BlobEntry
from tierckpt.io.buffers import StagingPool, aligned_empty, memmove
from tierckpt.tiers.base import CheckpointKey, TierReader, TierWriter
from tierckpt.tiers.host import HostTier

MiB = 1 << 20
BLOBS = [BlobEntry(f"blob-{i:05d}.bin", n) for i, n in enumerate([15, 7, 0, 1])]


def tier(**caps: object) -> HostTier:
    t = HostTier("obj", 64 * MiB)
    t.capabilities = replace(t.capabilities, **caps)  # type: ignore[arg-type]  # the test's declarations
    return t


class Recording(TierWriter):
    """Records the writes it is handed; each completes when the test says (or at once)."""

    def __init__(self, fail_at: int | None = None) -> None:
        self.writes: list[tuple[int, int, int]] = []
        self.addrs: list[int] = []
        self.pending: list[Future[int]] = []
        self.fail_at = fail_at

    def write(self, blob: int, offset: int, addr: int, nbytes: int) -> Future[int]:
        assert all(f.done() for f in self.pending), "a write was handed over before the previous one completed"
        self.writes.append((blob, offset, nbytes))
        self.addrs.append(addr)
        f: Future[int] = Future()
        if self.fail_at == len(self.writes) - 1:
            f.set_exception(OSError(errno.EIO, "upload failed"))
        else:
            f.set_result(nbytes)
        self.pending.append(f)
        return f

    def commit(self, manifest: bytes) -> None:
        self.committed = manifest

    def abort(self) -> None:
        self.aborted = True


def test_the_write_chunk_stays_within_the_declared_part_sizes() -> None:
    t = tier(min_part_bytes=8 * MiB, max_part_bytes=16 * MiB)
    t.chunk_bytes = 1 * MiB
    assert t.geometry.chunk_bytes == 8 * MiB
    t.chunk_bytes = 64 * MiB
    assert t.geometry.chunk_bytes == 16 * MiB
    t.chunk_bytes = 10 * MiB + 100
    assert t.geometry.chunk_bytes == 10 * MiB  # a multiple of the alignment
    assert tier().geometry.chunk_bytes == HostTier.chunk_bytes
    odd = tier(min_part_bytes=5 * MiB + 1)
    odd.chunk_bytes = 1 * MiB
    assert odd.geometry.chunk_bytes == 5 * MiB + 4096  # rounded up to the alignment, never below the minimum


def test_a_tier_with_random_writes_gets_the_writer_as_it_is() -> None:
    inner = Recording()
    assert writer_for(tier(), inner, BLOBS) is inner


def test_a_sequential_tier_gets_each_blobs_writes_in_order_one_at_a_time() -> None:
    inner = Recording()
    w = writer_for(tier(sequential_writes=True), inner, BLOBS)
    for blob, off, n in [(0, 0, 10), (0, 10, 5), (1, 0, 7), (3, 0, 1)]:  # blob 2 is empty: skipped
        assert w.write(blob, off, 0, n).result() == n
    w.commit(b"m")
    assert inner.writes == [(0, 0, 10), (0, 10, 5), (1, 0, 7), (3, 0, 1)] and inner.committed == b"m"


@pytest.mark.parametrize(("blob", "off"), [(0, 20), (0, 0), (1, 5), (1, 0), (3, 0)])
def test_a_sequential_tier_refuses_a_write_out_of_order(blob: int, off: int) -> None:
    w = writer_for(tier(sequential_writes=True), Recording(), BLOBS)
    w.write(0, 0, 0, 10)
    with pytest.raises(ValueError, match="takes writes in order only"):
        w.write(blob, off, 0, 5)


def test_after_a_failed_write_a_sequential_tier_gets_no_more() -> None:
    inner = Recording(fail_at=0)
    w = writer_for(tier(sequential_writes=True), inner, BLOBS)
    first = w.write(0, 0, 0, 10)
    second = w.write(0, 10, 0, 5)
    third = w.write(1, 0, 0, 7)  # the tier's error, not an ordering one
    assert isinstance(second.exception(), OSError) and second is first and third is first
    assert inner.writes == [(0, 0, 10)]


class InMemory(TierReader):
    """A memory tier's blob, handed out as its buffer (and read out of it where the copy stages)."""

    def __init__(self, buf: torch.Tensor) -> None:
        self.buf = buf

    def buffer(self, blob: int) -> torch.Tensor | None:
        return self.buf

    def read(self, blob: int, offset: int, addr: int, nbytes: int) -> Future[int]:
        memmove(addr, self.buf.data_ptr() + offset, nbytes)
        f: Future[int] = Future()
        f.set_result(nbytes)
        return f


@pytest.mark.parametrize(("align", "direct"), [(1, True), (1024, True), (4096, False)])
def test_a_buffer_goes_to_the_destination_as_it_is_where_its_geometry_takes_its_alignment(
    align: int, direct: bool
) -> None:
    """A memory tier's blob 2 KiB past a page boundary: written straight from its memory to a tier whose
    I/O takes memory so aligned (its geometry's ``memory_alignment_bytes``: here its capabilities'
    alignment), through a staging slot to one that needs a page (O_DIRECT's)."""
    n = 64 << 10
    buf = aligned_empty(n + 4096)[2048 : 2048 + n]
    dst = tier(device="object", alignment_bytes=align)
    w = Recording()
    pool = StagingPool(2, 16 << 10, 4096)
    copy_blobs(
        tier(), InMemory(buf), dst, w, CheckpointKey(1), [BlobEntry("blob-00000.bin", n)], 16 << 10, lambda: pool
    )
    base = buf.data_ptr()
    assert (w.addrs == [base + o for o in range(0, n, 16 << 10)]) is direct
    assert [o for _, o, _ in w.writes] == list(range(0, n, 16 << 10))


class Hung(TierWriter):
    """A writer whose first write fails and whose others hang (parts in their retries) until it is
    cancelled."""

    def __init__(self) -> None:
        self.issued: list[Future[int]] = []
        self.cancelled = False

    def write(self, blob: int, offset: int, addr: int, nbytes: int) -> Future[int]:
        f: Future[int] = Future()
        if not self.issued or self.cancelled:
            f.set_exception(OSError(errno.EIO, "upload failed"))
        self.issued.append(f)
        return f

    def cancel(self) -> None:
        self.cancelled = True
        for f in self.issued:
            if not f.done():
                f.set_exception(OSError(errno.ECANCELED, "given up"))

    def commit(self, manifest: bytes) -> None:
        raise AssertionError("not committed")

    def abort(self) -> None:
        pass


class Staged(InMemory):
    """The same blob, read only (no buffer of its own handed out): copied through staging slots."""

    def buffer(self, blob: int) -> torch.Tensor | None:
        return None


def _raised(fn: Callable[[], object], w: Hung) -> BaseException:
    """What ``fn()`` raised, on a thread: it must not wait for the writes ``w`` holds (a hang detector:
    it takes milliseconds); then ``w`` is cancelled anyway, to let a hung one go."""
    errors: list[BaseException] = []

    def run() -> None:
        try:
            fn()
        except BaseException as e:
            errors.append(e)

    t = threading.Thread(target=run, daemon=True)
    t.start()
    t.join(30)
    stuck = t.is_alive()
    w.cancel()
    assert not stuck, "it waited for the writes the tier holds"
    assert len(errors) == 1 and len(w.issued) > 1
    return errors[0]


@pytest.mark.parametrize("source", [InMemory, Staged])
def test_a_failed_copy_cancels_the_writer_before_waiting_for_its_writes(source: type[InMemory]) -> None:
    """A write fails while others hang in the tier (an S3 part in retries): the copy cancels the writer,
    so that they fail soon, and raises; it does not wait them out."""
    n = 256 << 10
    w = Hung()
    pool = StagingPool(4, 16 << 10, 4096)
    error = _raised(
        lambda: copy_blobs(tier(), source(aligned_empty(n)), tier(device="object"), w, CheckpointKey(1),
                           [BlobEntry("blob-00000.bin", n)], 16 << 10, lambda: pool), w,
    )  # fmt: skip
    assert isinstance(error, OSError) and error.errno == errno.EIO


def test_a_failed_pack_cancels_its_writers_before_waiting_for_their_writes() -> None:
    """The packing fails (here: the caller's callback once the state is staged) while the tier holds the
    writes (an S3 part in retries): the writer is cancelled, so they fail soon, and the error comes."""
    from tierckpt.datapath.packing import pack_and_write
    from tierckpt.format.layout import plan
    from tierckpt.format.tree import flatten

    flat = flatten({"w": torch.arange(64 << 10, dtype=torch.float32)})
    layout = plan(flat.nbytes, align=4096, blob_bytes=1 << 20)
    w = Hung()
    w.issued.append(Future())  # no write fails: every one hangs until the cancel
    pool = StagingPool(4, 64 << 10, 4096)  # slots of the chunk the packer packs

    def staged() -> None:
        raise RuntimeError("the caller's callback failed")

    error = _raised(lambda: pack_and_write(flat, layout, {"obj": w}, {}, lambda: pool, 64 << 10, on_staged=staged), w)
    assert isinstance(error, RuntimeError) and w.cancelled
