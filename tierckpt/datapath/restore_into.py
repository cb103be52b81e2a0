"""In-place restore: stream a checkpoint through a few reused staging buffers into existing tensors.

``restore(into=state)`` is the restart path of a training job: the model and optimizer already exist,
so their memory is allocated and touched. Reading the blobs into fresh buffers first (what a restore
into new tensors must do) would pay a page fault per 4 KiB of new memory, which on a VM costs more
than the disk read (docs/benchmarks.md), and then a second copy. Here each chunk is read into a slot
of a small reusable pool (faulted once per process), and the tensors it holds are hashed there and
copied into the target's tensors while the next chunks are being read, so the disk, not the fault
rate, sets the speed (docs/restore.md).

A contiguous CUDA tensor is filled from the same slots (pinned host memory where CUDA is present), or
from a memory tier's buffers: a small tensor's bytes are copied once verified, a long one's block by
block as they are hashed, as into a CPU tensor (so a restore into a model on the GPU reads the disk
once and moves each byte over the bus once).

What cannot be streamed into (a tensor on another kind of device, a non-contiguous tensor, a key only the
checkpoint has with ``strict=False``, a value the target leaves to the checkpoint such as ``None``, or
one manifest tensor that two target tensors share) gets a fresh CPU tensor, which
is copied or assigned into the target once every checksum has been verified.
"""

from __future__ import annotations

import contextlib
import threading
from collections import deque
from collections.abc import Callable, Sequence
from concurrent.futures import Future
from typing import TYPE_CHECKING, Any

import torch

from tierckpt.datapath.keymap import KeyMap
from tierckpt.datapath.manifests import absent, load_head, load_rest
from tierckpt.datapath.matching import Match, holds_dtensor, match_target
from tierckpt.datapath.openblobs import open_blobs
from tierckpt.datapath.reshard import restore_sharded
from tierckpt.datapath.verifier import BlobVerifier, Where
from tierckpt.errors import CheckpointNotFoundError
from tierckpt.format.layout import round_up
from tierckpt.format.manifest import Manifest, ManifestHead
from tierckpt.format.tree import resolve_tree
from tierckpt.io.buffers import StagingPool
from tierckpt.io.geometry import CheckpointGeometry
from tierckpt.tiers.base import CheckpointKey, Tier, TierReader

if TYPE_CHECKING:
    from tierckpt.datapath.replicas import ReplicaExchange

__all__ = ["RestoreStaging", "restore_into"]

# longest tensor checked before it is copied (longer ones: hashed block by block as copied): a unit of
# hashing while the bytes are in the CPU's cache, not an I/O size (those are the tier's geometry's)
_BLOCK_BYTES = 1 << 20


class RestoreStaging:
    """The staging buffers of a hierarchy's in-place restores: allocated on first use, kept for the next
    restore (so their pages are faulted once per process), one restore at a time.

    Args:
        geometry: the hierarchy's checkpoint geometry: its ``read_slots`` are the reads in flight or
            being copied out (the engine's queue depth caps those in flight), of ``read_slot_bytes`` each.
        tiers: the hierarchy's tiers, fastest first: a resharding restore takes another rank's copy
            from them where the tier it reads lacks it.
    """

    def __init__(self, geometry: CheckpointGeometry, tiers: Sequence[Tier] = ()) -> None:
        self.geometry, self.tiers = geometry, tuple(tiers)
        self._pool: StagingPool | None = None
        self.lock = threading.Lock()

    def pool(self, align: int) -> StagingPool:
        """The pool, its slots in the alignment ``align`` of the copy read
        (:meth:`~tierckpt.io.geometry.CheckpointGeometry.read_staging`; re-made when a copy needs a larger one)."""
        slot_bytes, mem_align = self.geometry.read_staging(align)
        if self._pool is None or self._pool.slot_bytes % align or self._pool.align % mem_align:
            self._pool = StagingPool(self.geometry.read_slots, slot_bytes, mem_align)
        return self._pool

    def release(self) -> None:
        """Free the buffers (the next restore allocates them again)."""
        with self.lock:
            self._pool = None

    def restore(
        self,
        tier: Tier,
        key: CheckpointKey,
        target: Any,
        *,
        allow_pickle: bool,
        strict: bool = True,
        replicas: ReplicaExchange | None = None,
        key_map: KeyMap | None = None,
    ) -> Any:
        """:func:`restore_into` through these buffers; concurrent calls take turns."""
        others = [t for t in self.tiers if t is not tier]
        with self.lock:
            return restore_into(
                tier, key, target, self.pool, allow_pickle=allow_pickle, strict=strict, others=others,
                replicas=replicas, key_map=key_map,
            )  # fmt: skip


def restore_into(
    tier: Tier,
    key: CheckpointKey,
    target: Any,
    pool: Callable[[int], StagingPool],
    *,
    allow_pickle: bool,
    strict: bool = True,
    others: Sequence[Tier] = (),
    replicas: ReplicaExchange | None = None,
    key_map: KeyMap | None = None,
) -> Any:
    """Restore ``key`` from ``tier`` into ``target``'s tensors in place; returns ``target``.

    The target's structure, shapes and dtypes are checked against the manifest (while the first reads
    are under way) before any of its bytes is changed.
    Every checksum and every padding byte is verified as the bytes stream in.

    Args:
        tier: the tier to read from.
        key: the checkpoint.
        target: nested dicts/lists whose tensors receive the bytes.
        pool: staging buffers for the reads, given the checkpoint's alignment (used by this call alone).
        allow_pickle: accept checkpoints that hold pickled values.
        strict: every dict of ``target`` must have exactly the checkpoint's keys; else a key only the
            target has is left as it is and one only the checkpoint has is added (with a warning).
        others: for a sharded checkpoint or DTensor target (datapath/reshard.py), the tiers to
            take another rank's copy from where ``tier`` lacks it.
        replicas: for a DTensor target in a job, the exchange that splits the reads of its replicated
            shards among their replicas (datapath/replicas.py; the caller settles it).
        key_map: the checkpoint's key paths mapped to the target's (datapath/keymap.py).

    Raises:
        StateError: ``target`` does not match the checkpoint (nothing was changed; every mismatch is
            listed), or pickled values.
        CorruptCheckpointError: a checksum or padding mismatch (names tier, blob and key). Tensors of
            ``target`` streamed before the damaged one already hold the checkpoint's bytes then, and
            so may large ones further on whose bodies were being read straight into them (the reads in
            flight); no value is assigned and no other tensor is changed.
    """

    def sharded() -> Any:  # datapath/reshard.py, for any saved layout
        return restore_sharded(
            tier, key, target, allow_pickle=allow_pickle, strict=strict, others=others, replicas=replicas,
            key_map=key_map,
        )  # fmt: skip

    if holds_dtensor(target):  # sharded for this run: read what overlaps each shard (any saved layout)
        return sharded()
    try:
        opened = tier.open_copy(key)
    except CheckpointNotFoundError as e:
        if absent(tier, key, e) is e:  # gone: the restore looks again
            raise
        # never here (a step saved by another number of ranks): the base copy is rank 0's, or this
        # rank's from another tier (datapath/reshard.py), or the error says which copy no tier holds
        return sharded()
    with opened as copy:  # one copy; each blob's size is checked against its file here
        head = load_head(tier, key, allow_pickle=allow_pickle, copy=copy)
        if head.meshes:  # a sharded checkpoint: plain targets take whole global tensors
            return sharded()
        reader = open_blobs(tier, copy, head, background=False)
    try:
        stream = _Stream(tier, key, head, reader, lambda: pool(head.align))
        try:
            # The first reads go into the staging slots while the rest of the manifest is validated and
            # the target is matched: no byte read is looked at before both are done.
            stream.fill()
            m = load_rest(tier, key, head)
            stream.attach(m)
            todo = match_target(
                m, target, stream.addrs, allow_pickle=allow_pickle, tier=tier, key=key, strict=strict, devices=True,
                key_map=key_map,
            )  # fmt: skip
            stream.verifier.set_devices(todo.device)
            stream.read_direct()
            stream.reads = tier.geometry.steady_reads  # a shared tier's: every slot (a striped file)
            stream.run()
        finally:
            stream.close()
    finally:
        reader.close()
    _apply(todo, len(m.tensors))
    return target


def _apply(todo: Match, n_tensors: int) -> None:
    """Once every byte is verified: the copies into the target tensors that were not streamed into,
    and the assignments of the values the target leaves to the checkpoint."""
    with torch.no_grad():
        for dst, fresh in todo.later:
            if dst.numel():
                dst.copy_(fresh)
    for container, k, v in todo.assigns:  # references checked by match_target
        container[k] = resolve_tree(v, todo.ref, todo.made.__getitem__, n_tensors)


class _Stream:
    """Copies the blobs' bytes to each tensor's destination address, verifying as it goes."""

    def __init__(
        self, tier: Tier, key: CheckpointKey, head: ManifestHead, reader: TierReader, pool: Callable[[], StagingPool]
    ) -> None:
        self.tier, self.key, self.head, self.reader = tier, key, head, reader
        bufs = [reader.buffer(bi) for bi in range(len(head.blobs))]
        cpu = [b for b in bufs if b is not None and b.device.type == "cpu"]
        # a memory tier's blobs in this process's memory: copied straight out, no reads
        self.mem_bufs: list[torch.Tensor] | None = cpu if len(cpu) == len(bufs) else None
        self.in_memory = self.mem_bufs is not None
        self.pool: StagingPool | None = None
        # reads to make, in blob order: (blob, offset, length, destination address or 0 for a staging slot)
        self.todo: deque[tuple[int, int, int, int]] = deque()
        self.inflight: deque[tuple[int, int, int, torch.Tensor | None, Future[int], int]] = deque()
        self.lock = threading.RLock()  # todo, inflight, running: shared with the engine's thread
        self.reads = 0  # reads allowed to run at once (set below, and by restore_into once matched)
        self.running = 0  # reads submitted and not yet landed
        self.closed = False
        self.error: BaseException | None = None
        self.piece = 0
        if not self.in_memory:
            self.pool = pool()
            self.piece = self.pool.slot_bytes // head.align * head.align
            if not self.piece:
                raise ValueError(
                    f"alignment {head.align} exceeds the restore staging slot ({self.pool.slot_bytes} bytes)"
                )
            self.todo = deque(x for bi, b in enumerate(head.blobs) for x in self._pieces(bi, 0, b.size))
            self.reads = self.pool.slots  # until the target is matched: fill every slot at once

    def attach(self, m: Manifest) -> None:
        """Take the validated manifest (of the head given at construction) before anything is consumed."""
        self.m = m
        self.addrs = [0] * len(m.tensors)  # destination of each tensor's bytes; set before run()
        self.order = m.tensors.order()
        # a small tensor is checked before it is copied; a long one, block by block as it is copied
        self.verifier = BlobVerifier(Where(self.tier.name, self.key.step), m.tensors, m.blobs, max_len=_BLOCK_BYTES)

    def _pieces(self, bi: int, start: int, stop: int, dest: int = 0) -> list[tuple[int, int, int, int]]:
        """Reads of at most one slot each covering ``[start, stop)`` of blob ``bi`` (into ``dest`` if set)."""
        p = self.piece
        return [(bi, o, min(p, stop - o), dest + o - start if dest else 0) for o in range(start, stop, p)]

    def read_direct(self) -> None:
        """Once ``addrs`` is set: read the bodies of large tensors (the tier's geometry's
        ``direct_read_min_bytes`` at least) straight into their destinations.

        A destination qualifies where the reader can read into any memory under an alignment that the
        destination's address meets (O_DIRECT: ``statx`` DIO alignment; on NVMe often 4 bytes, so any
        torch tensor; here 512, so page-aligned allocations such as torch's with
        ``THP_MEM_ALLOC_ENABLE=1``). Its aligned body then skips the staging slot and the copy out of
        it: only the hash reads those bytes again. Head and tail bytes (and everything else) are still
        staged. Reads already submitted are left as they are.
        """
        with self.lock:  # the engine's thread takes reads from ``todo`` as earlier ones land
            self._read_direct()

    def _read_direct(self) -> None:
        if not self.todo:
            return
        t = self.m.tensors
        blobs, offsets, lengths, addrs = t.blobs, t.offsets, t.lengths, self.addrs
        bi0, resume = self.todo[0][0], self.todo[0][1]  # reading goes on from here (a piece boundary)
        aligns: dict[int, tuple[int, int] | None] = {}
        bodies: list[tuple[int, int, int, int]] = []  # (blob, start, stop, destination of start)
        least = self.tier.geometry.direct_read_min_bytes
        for i in self.order:
            b, o, n = blobs[i], offsets[i], lengths[i]
            if n < least or not addrs[i] or (b, o + n) <= (bi0, resume):  # too small, nowhere, or read already
                continue
            if b not in aligns:
                aligns[b] = self.reader.read_alignment(b)
            al = aligns[b]
            if al is None or (addrs[i] - o) % al[0]:
                continue
            # body [f0, f1): starts aligned for both the file offset and the address, ends on a
            # multiple of the offset alignment; its head and tail stay in the staged reads
            f0 = round_up(max(o, resume) if b == bi0 else o, max(al))
            f1 = f0 + (o + n - f0) // al[1] * al[1] if o + n > f0 else f0
            if f1 - f0 >= least:
                bodies.append((b, f0, f1, addrs[i] + f0 - o))
        if not bodies:
            return
        todo: list[tuple[int, int, int, int]] = []
        k = 0
        for bi in range(bi0, len(self.head.blobs)):
            pos = resume if bi == bi0 else 0
            while k < len(bodies) and bodies[k][0] == bi:
                _, f0, f1, dest = bodies[k]
                todo += self._pieces(bi, pos, f0) + self._pieces(bi, f0, f1, dest)
                pos, k = f1, k + 1
            todo += self._pieces(bi, pos, self.head.blobs[bi].size)
        self.todo = deque(todo)

    def fill(self) -> None:
        """Submit reads while fewer than :attr:`reads` run and a slot is free (or nothing is left).

        Each read that lands submits the next one from the engine's thread (:meth:`_landed`), so the
        disk keeps reading while this thread is busy elsewhere (matching the target, copying out).
        """
        with self.lock:
            self._submit()
        if self.error is not None:
            raise self.error

    def _submit(self) -> None:  # with self.lock held
        pool = self.pool
        if pool is None:  # a copy in memory: nothing to read
            return
        # a read that run() took out of inflight has landed even where its _landed callback has not run
        # yet (running not decremented): counting it would submit nothing and end run() early
        while (
            self.todo and min(self.running, len(self.inflight)) < self.reads
            and len(self.inflight) < pool.slots
            and not self.closed and self.error is None
        ):  # fmt: skip
            bi, off, n, dest = self.todo.popleft()
            slot = None if dest else pool.acquire()  # never waits: one is free
            base = dest if slot is None else slot.data_ptr()
            try:
                fut = self.reader.read(bi, off, base, n)
            except BaseException:
                self._release(slot)
                raise
            self.running += 1
            self.inflight.append((bi, off, n, slot, fut, base))
            fut.add_done_callback(self._landed)  # runs at once, here, if the read is already done

    def _landed(self, _fut: Future[int]) -> None:
        """A read finished (engine's thread, or this one): submit the next; an error waits for :meth:`run`."""
        with self.lock:
            self.running -= 1
            try:
                self._submit()
            except BaseException as e:  # raised again in the restoring thread
                self.error = e

    def run(self) -> None:
        """Copy and verify every tensor's bytes to ``addrs``."""
        verifier = self.verifier
        verifier.set_destinations(self.addrs)
        if self.mem_bufs is not None:
            for bi, (b, buf) in enumerate(zip(self.head.blobs, self.mem_bufs)):
                if b.size:
                    verifier.feed(bi, 0, b.size, buf.data_ptr())
        else:
            while True:
                self.fill()
                with self.lock:
                    if not self.inflight:
                        break
                    bi, off, n, slot, fut, base = self.inflight[0]
                verifier.where.check_read(self.head.blobs[bi].name, off, n, fut.result())
                verifier.feed(bi, off, n, base)
                with self.lock:
                    self.inflight.popleft()
                    self._release(slot)
        verifier.finish()

    def close(self) -> None:
        """Wait for the reads still in flight and give their slots back (never reuse a slot the engine
        may still be reading into)."""
        with self.lock:
            self.closed = True  # reads that land from now on submit nothing
        while self.inflight:
            _, _, _, slot, fut, _ = self.inflight.popleft()
            with contextlib.suppress(BaseException):
                fut.exception()
            self._release(slot)

    def _release(self, slot: torch.Tensor | None) -> None:
        """Give a staging slot back (None: the read had a direct destination)."""
        if slot is not None and self.pool is not None:  # a slot comes from the pool
            self.pool.release(slot)
