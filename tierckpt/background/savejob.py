"""A save's job, from its plan to its last demotion (:class:`SaveJob`).

The lifecycle of one save:

1. **plan** — in the caller's thread: the state is flattened and laid out into blobs
   (:meth:`SaveJob.lay_out`), and placement (:func:`~tierckpt.policies.place`) names the destination
   tiers and each copy's sources (:class:`~tierckpt.policies.SavePlan`);
2. **stage** — on the top tier's worker: room is reserved there and the caller's tensors are packed into
   it; ``handle.staged`` resolves once the last byte is copied out of them;
3. **commit** — the top tier publishes the copy (``handle.durable[top]``);
4. **demote** — each lower destination copies it from the nearest tier above that committed it, on its
   own worker, in order. Where every tier above failed before the state was staged, the lower tier packs
   the caller's state itself (the plan's fallback); once staged, the caller may have changed the tensors,
   so they are never packed again.
"""

from __future__ import annotations

from tierckpt.background.handles import SaveHandle
from tierckpt.background.mover import Mover, Room
from tierckpt.background.process import gc_paused
from tierckpt.datapath.packing import build_manifest, pack_and_write, planned_manifest, shard_chunk_sums
from tierckpt.errors import TierckptError
from tierckpt.format.layout import Layout, plan
from tierckpt.format.manifest import BlobEntry, Manifest
from tierckpt.format.tree import FlatState
from tierckpt.io.geometry import CheckpointGeometry
from tierckpt.policies.placement import SavePlan
from tierckpt.tiers.base import CheckpointKey, TierWriter

__all__ = ["SaveJob"]


class SaveJob:
    """One save of one rank's state, executed by the mover as its plan says (the packing runs in the
    :class:`~tierckpt.background.mover.Room` the mover lends it: it never reaches back into the mover).

    Args:
        mover: executes the copies.
        plan: where the save goes.
        handle: the futures the caller waits on.
        flat: the flattened state.
        layout: where each tensor's bytes go, and the blobs' sizes.
        key: the step and this rank.
        world_size: the number of ranks (recorded in the manifest).
        align: the checkpoint's alignment.
        background: whether its writes are background work, which the tiers' bandwidth budgets pace
            (False: a blocking save, which its caller waits for).
    """

    def __init__(
        self,
        mover: Mover,
        plan: SavePlan,
        handle: SaveHandle,
        flat: FlatState,
        layout: Layout,
        key: CheckpointKey,
        *,
        world_size: int,
        align: int,
        background: bool = True,
    ) -> None:
        self.mover, self.plan, self.handle, self.flat, self.layout, self.key = mover, plan, handle, flat, layout, key
        self.world_size, self.align, self.background = world_size, align, background
        self.blobs = tuple(BlobEntry(f"blob-{i:05d}.bin", s) for i, s in enumerate(layout.blob_sizes))

    @staticmethod
    def lay_out(flat: FlatState, geometry: CheckpointGeometry) -> Layout:
        """The blobs of a save: the checkpoint geometry's blob size and alignment (``layout.blob_size``,
        else the largest blob size any tier prefers), each blob a whole multiple of every tier's blob
        granule (a parallel file system's stripe width)."""
        return plan(
            flat.nbytes,
            align=geometry.align_bytes,
            blob_bytes=geometry.blob_bytes,
            blob_align=geometry.blob_align_bytes,
        )

    def start(self) -> None:
        """Record the plan in the catalog (its tiers pending and wanted, the cadences as it leaves them),
        queue the stage-and-commit on the top tier, then every demotion (see the module docstring)."""
        catalog, step = self.mover.catalog, self.key.step
        catalog.plan(step, self.plan.tiers)
        catalog.saved(step, self.plan.tiers)
        catalog.set_sent(self.plan.sent)
        top, *lower = self.plan.copies
        durable = self.handle.durable
        self.mover.run_commit(top.dst, self.key.step, self._stage, durable[top.dst], background=self.background)
        for c in lower:
            self.mover.copy(
                self.key, c, durable[c.dst], durable, self.blobs, fallback=self._stage, background=self.background
            )

    def _stage(self, room: Room) -> bytes:
        """Reserve room on ``tier``, pack the caller's tensors into it, commit; the manifest committed. A
        failure on the save's last destination (no fallback comes after it) also fails ``staged``."""
        tier, handle = room.tier, self.handle
        first = tier.name == self.plan.tiers[0]
        writer: TierWriter | None = None
        try:
            if not first and handle.staged.done():
                raise TierckptError(
                    f"step {self.key.step}: every tier above {tier.name!r} failed after the state was staged; "
                    "the caller may have changed it since, so it is not packed again"
                )
            with gc_paused():
                writer = room.reserve(self.key, self.blobs, codec=self._planned() if room.compresses else None)
                manifest = self._pack(room, writer)
                writer.commit(manifest)
                return manifest
        except BaseException as e:
            if writer is not None:
                writer.abort()
            if tier.name == self.plan.tiers[-1] and not handle.staged.done():
                handle.staged.set_exception(e)
            raise

    def _planned(self) -> Manifest:
        """The save's manifest but for its checksums and tree: what a tier that compresses plans from."""
        return planned_manifest(
            self.flat, self.layout, self.blobs, step=self.key.step, rank=self.key.rank,
            world_size=self.world_size, align=self.align,
        )  # fmt: skip

    def _pack(self, room: Room, writer: TierWriter) -> bytes:
        """Pack the state into ``writer``; return the manifest (encoded while the last chunks are still
        being written, or after a tier that packs itself, such as gpu, returned the checksums)."""
        flat, layout, key, tier, pool = self.flat, self.layout, self.key, room.tier, room.staging
        srcs = [r.tensor for r in flat.tensors]
        manifest = b""
        size, chunks = shard_chunk_sums(flat)  # from the caller's tensors: before they are staged

        def on_staged() -> None:
            self.handle.staged.set_result(None)

        def encode(checksums: list[int]) -> None:
            nonlocal manifest
            manifest = build_manifest(
                flat, srcs, layout, self.blobs, checksums, step=key.step, rank=key.rank,
                world_size=self.world_size, align=self.align, chunks=chunks, chunk_bytes=size,
            )  # fmt: skip

        checksums = tier.pack(writer, flat, layout, pool, on_staged)
        if checksums is not None:
            encode(checksums)
            return manifest
        failed: dict[str, BaseException] = {}
        chunk, piece = room.geometry.staging_slot_bytes, room.geometry.piece_bytes  # a staging slot, in pieces
        pack_and_write(flat, layout, {tier.name: writer}, failed, pool, chunk, on_staged, encode, piece)
        if failed:
            raise failed[tier.name]
        return manifest
