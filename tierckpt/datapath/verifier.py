"""The one verifier of the bytes a reader takes from a copy: every tensor's checksum, and every byte no
tensor covers zero (docs/format.md: gaps and padding are zero), so that damage anywhere in a blob is
found. Its callers:

* ``restore()`` into fresh tensors and ``verify()`` (datapath/restore.py): a blob's chunks arrive in
  fresh buffers and are checked where they are (:class:`BlobVerifier`, nothing copied);
* ``restore(into=)`` (datapath/restore_into.py): pieces arrive in staging slots (or straight in a target
  tensor) and each tensor's bytes are checked and copied to its target (:class:`BlobVerifier` with
  destinations);
* the range reads of a resharding restore (datapath/shardread.py): whole checksum chunks of one row
  (:func:`verify_range`);

and every read's length (:meth:`Where.check_read`). The loop over whole tensors is the C one of
:mod:`tierckpt.format.native` (GIL-free, a long run split over threads) where it was built, else the
Python loop below, with the same results and the same errors; a tensor that crosses a piece, or is
longer than the caller's ``max_len``, is hashed block by block as its pieces arrive. Every error is a
:class:`~tierckpt.errors.CorruptCheckpointError` naming the tier, the step, the blob and the tensor's
key path (and the rank, for another rank's copy).
"""

from __future__ import annotations

from array import array
from collections.abc import Mapping, Sequence
from dataclasses import dataclass

import torch
import xxhash

from tierckpt.errors import CorruptCheckpointError
from tierckpt.format import native as nat
from tierckpt.format.manifest import BlobEntry
from tierckpt.format.table import TensorTable, blob_spans
from tierckpt.io.buffers import memmove, ptr_mv

__all__ = ["UNBOUNDED", "BlobVerifier", "Where", "scan", "verify_range"]

#: a ``max_len`` that takes every whole tensor into the loop
UNBOUNDED = (1 << 64) - 1
# copy-then-hash unit of a long tensor: the hash reads the bytes while they are in the CPU's cache (not an
# I/O size: the reads are the tier's geometry's)
_BLOCK_BYTES = 1 << 20
_ZEROS = bytes(4096)  # padding shorter than this is compared with it: not an I/O size
_digest = xxhash.xxh3_64_intdigest


@dataclass(frozen=True)
class Where:
    """The copy whose bytes are checked, as errors name it.

    Attributes:
        tier: the tier's name.
        step: the step.
        rank: the rank whose copy it is, where errors must say it (another rank's copy, or a verify of
            every rank's); None: not named.
    """

    tier: str
    step: int
    rank: int | None = None

    def error(self, message: str, *, blob: str | None = None, key: str | None = None) -> CorruptCheckpointError:
        """A damage error naming this copy (``… (rank 1's copy) [tier=…, step=…, blob=…, key=…]``)."""
        if self.rank is not None:
            message += f" (rank {self.rank}'s copy)"
        return CorruptCheckpointError(message, tier=self.tier, step=self.step, blob=blob, key=key, rank=self.rank)

    def check_read(self, blob: str, offset: int, want: int, got: int) -> None:
        """Raise if a read of ``want`` bytes at ``offset`` of ``blob`` returned ``got`` (a short blob)."""
        if got != want:
            raise self.error(f"blob is truncated: read {got} of {want} bytes at offset {offset}", blob=blob)


def scan(
    table: array[int], k: int, stop: int, base: int, p0: int, n: int, cursor: int, max_len: int
) -> tuple[int, int, int, int, int]:
    """Check (and copy out) records ``[k, stop)`` of ``table`` against a piece of a blob: its bytes
    ``[p0, p0 + n)``, found at address ``base``. A record is 4 uint64: offset, length, checksum,
    destination (0: none). For each record wholly inside the piece and at most ``max_len`` long, in
    order: the bytes from ``cursor`` to its offset must be zero, its checksum must match, then it is
    copied to its destination (unless 0, or already there). Stops at the first record that does not
    qualify.

    Returns:
        ``(k, cursor, err, a, b)``: the next record, the blob offset up to which everything was checked,
        and ``err``: 0; 1, record ``k``'s checksum does not match; 2, bytes ``[a, b)`` are not zero.
    """
    if nat.native is not None:
        got: tuple[int, int, int, int, int] = nat.native.scatter(
            table, k, stop, base, p0, n, cursor, max_len, nat.THREADS
        )
        return got
    p1 = p0 + n
    view = ptr_mv(base, n, writable=False)  # sliced per tensor: cheaper than a view each
    while k < stop:
        o, length, checksum, dst = table[4 * k : 4 * k + 4]
        end = o + length
        if o < p0 or end > p1 or length > max_len:
            break
        if o > cursor and not _zero(view, base, cursor - p0, o - p0):
            return k, cursor, 2, cursor, o
        src = o - p0
        if _digest(view[src : src + length]) != checksum:
            return k, o, 1, 0, 0
        if dst and dst != base + src:
            memmove(dst, base + src, length)
        cursor, k = end, k + 1
    return k, cursor, 0, 0, 0


def _zero(view: memoryview, base: int, a: int, b: int) -> bool:
    """Whether bytes ``[a, b)`` of ``view`` (at address ``base``) are all zero."""
    if b - a <= len(_ZEROS):
        return view[a:b] == _ZEROS[: b - a]
    return nat.all_zero(base + a, b - a)


class BlobVerifier:
    """Checks a copy's blobs as their bytes arrive, piece by piece, in order (blob by blob, each from its
    first byte to its last): every tensor's checksum, and every other byte zero; with destinations
    (:meth:`set_destinations`), each tensor's bytes are also copied to its destination.

    A small tensor's bytes are checked before they are copied; one longer than ``max_len``, or one that
    crosses a piece, is hashed (and copied) block by block as it arrives and checked once its last byte
    is in, so its destination may hold unverified bytes when it is found damaged.

    Args:
        where: the copy, for errors.
        tensors: its tensor table.
        blobs: its blobs.
        max_len: the longest tensor the whole-tensor loop takes (:func:`scan`).
    """

    def __init__(
        self, where: Where, tensors: TensorTable, blobs: Sequence[BlobEntry], *, max_len: int = UNBOUNDED
    ) -> None:
        self.where, self.tensors, self.blobs, self.max_len = where, tensors, blobs, max_len
        self.order = tensors.order()  # non-empty tensors by (blob, offset)
        self.spans = blob_spans(self.order, tensors.blobs)
        self.k = 0  # position in order of the next tensor (or of the one partly in)
        self.dsts: Sequence[int] = ()
        self.devices: Mapping[int, torch.Tensor] = {}
        self._copied = False  # device copies issued from the piece being fed
        self._table: array[int] | None = None
        self._hasher = xxhash.xxh3_64()

    def set_destinations(self, dsts: Sequence[int]) -> None:
        """Copy tensor ``i``'s verified bytes to address ``dsts[i]`` (0: nowhere); before any piece."""
        self.dsts, self._table = dsts, None

    def set_devices(self, devices: Mapping[int, torch.Tensor]) -> None:
        """Copy tensor ``i``'s verified bytes into the CUDA byte tensor ``devices[i]`` (a tensor without a
        host destination); before any piece. Each :meth:`feed` waits for its copies before it returns, so
        the piece's memory may be reused at once."""
        self.devices = devices

    def feed(self, bi: int, p0: int, n: int, base: int) -> tuple[int, int]:
        """Take bytes ``[p0, p0 + n)`` of blob ``bi``, found at address ``base`` (the piece after the one
        fed before). Returns ``(start, stop)``: the tensors ``order[start:stop]`` are complete and verified."""
        try:
            return self._feed(bi, p0, n, base)
        finally:
            if self._copied:  # the copies read the piece's memory: done before anyone reuses it
                self._copied = False
                torch.cuda.synchronize()

    def _feed(self, bi: int, p0: int, n: int, base: int) -> tuple[int, int]:
        if self._table is None:
            t = self.tensors
            self._table = nat.records(self.order, t.offsets, t.lengths, t.checksums, self.dsts or None).table
        t, order, p1 = self.tensors, self.order, p0 + n
        k0 = k = self.k
        stop = self.spans.get(bi, (k, k))[1]
        cursor = p0  # bytes before it are accounted for (tensors checked, gaps found zero)
        try:
            while k < stop:
                k1 = k
                k, cursor, err, a, b = scan(self._table, k, stop, base, p0, n, cursor, self.max_len)
                if self.devices:  # tensors order[k1:k] are whole in the piece and verified
                    self._to_devices(k1, k, base, p0)
                if err == 1:
                    raise self._mismatch(bi, order[k])
                if err == 2:
                    raise self._padding(bi, a, b)
                if k == stop:
                    break
                i = order[k]
                o = t.offsets[i]
                if o >= p1:
                    break
                if o > cursor:
                    self._check_zero(bi, base, p0, cursor, o)
                cursor = min(o + t.lengths[i], p1)
                if not self._part(bi, i, base, p0, n):
                    return k0, k  # the tensor goes on in the next piece
                k += 1
            if cursor < p1:
                self._check_zero(bi, base, p0, cursor, p1)
        finally:
            self.k = k
        return k0, k

    def finish(self) -> None:
        """Every piece was fed: raise if a tensor's bytes never came (ruled out by a valid manifest)."""
        if self.k != len(self.order):
            raise self.where.error("blobs end before the tensors do")

    def _part(self, bi: int, i: int, base: int, p0: int, n: int) -> bool:
        """Hash (and copy) the part of tensor ``i`` that the piece holds, in blocks; True once its last
        byte is in and its checksum matched."""
        t = self.tensors
        o, end = t.offsets[i], t.offsets[i] + t.lengths[i]
        a, z = max(o, p0), min(end, p0 + n)
        if a == o:
            self._hasher.reset()
        view = ptr_mv(base + a - p0, z - a, writable=False)
        dst = self.dsts[i] if self.dsts else 0
        dev = self.devices.get(i)
        if dev is not None:  # a CUDA destination: hashed, then copied (a small tensor, checked before)
            self._hasher.update(view)
            if a == o and z == end and self._hasher.intdigest() != t.checksums[i]:
                raise self._mismatch(bi, i)
            self._device_copy(dev, a - o, base + a - p0, z - a)
        elif not dst or dst - o == base - p0:  # nowhere to copy, or read straight into its destination
            self._hasher.update(view)
        else:
            for q in range(0, z - a, _BLOCK_BYTES):
                c = min(_BLOCK_BYTES, z - a - q)
                self._hasher.update(view[q : q + c])
                memmove(dst + a - o + q, base + a - p0 + q, c)
        if z < end:
            return False
        if self._hasher.intdigest() != t.checksums[i]:
            raise self._mismatch(bi, i)
        return True

    def _to_devices(self, k0: int, k1: int, base: int, p0: int) -> None:
        """Copy the verified tensors ``order[k0:k1]`` (whole in the piece at ``base``) that have CUDA
        destinations."""
        devices, offsets, lengths = self.devices, self.tensors.offsets, self.tensors.lengths
        for i in self.order[k0:k1]:
            dev = devices.get(i)
            if dev is not None:
                self._device_copy(dev, 0, base + offsets[i] - p0, lengths[i])

    def _device_copy(self, dev: torch.Tensor, at: int, src: int, n: int) -> None:
        """Bytes ``[at, at + n)`` of ``dev`` from host address ``src`` (asynchronous from pinned memory,
        waited for at the end of the :meth:`feed`)."""
        if n:
            host = torch.frombuffer(ptr_mv(src, n), dtype=torch.uint8)
            dev[at : at + n].copy_(host, non_blocking=True)
            self._copied = True

    def _check_zero(self, bi: int, base: int, p0: int, a: int, b: int) -> None:
        """Bytes ``[a, b)`` of blob ``bi`` (the piece from ``p0`` at ``base``) must be zero."""
        if not _zero(ptr_mv(base, b - p0, writable=False), base, a - p0, b - p0):
            raise self._padding(bi, a, b)

    def _mismatch(self, bi: int, i: int) -> CorruptCheckpointError:
        return self.where.error("checksum mismatch", blob=self.blobs[bi].name, key=self.tensors.paths[i])

    def _padding(self, bi: int, a: int, b: int) -> CorruptCheckpointError:
        return self.where.error(f"padding bytes [{a}, {b}) are not zero", blob=self.blobs[bi].name)


def verify_range(
    where: Where,
    addr: int,
    c0: int,
    c1: int,
    *,
    length: int,
    checksum: int,
    chunk_bytes: int,
    chunks: Sequence[int],
    blob: str,
    key: str,
) -> None:
    """Check bytes ``[c0, c1)`` of one tensor's extent (whole checksum chunks), found at ``addr``:
    against the tensor's ``checksum`` where they are all of its ``length`` bytes, else against each
    chunk's checksum (``chunks``, one per ``chunk_bytes``)."""
    if c0 == 0 and c1 == length:
        offs, lens, sums = [0], [length], [checksum]
    else:
        offs = list(range(c0, c1, chunk_bytes))
        lens = [min(c1, o + chunk_bytes) - o for o in offs]
        sums = [chunks[o // chunk_bytes] for o in offs]
    table = nat.records(range(len(offs)), offs, lens, sums).table
    k, _, err, _, _ = scan(table, 0, len(offs), addr, c0, c1 - c0, c0, UNBOUNDED)
    if err or k != len(offs):
        raise where.error(f"checksum mismatch in bytes [{c0}, {c1}) of the tensor", blob=blob, key=key)
