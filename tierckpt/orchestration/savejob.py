"""The job that packs a save's tensors into one tier and commits it there (run on that tier's worker)."""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import TYPE_CHECKING

from tierckpt.errors import TierckptError
from tierckpt.format.layout import Layout
from tierckpt.format.manifest import BlobEntry
from tierckpt.format.tree import FlatState
from tierckpt.orchestration.catalog import SaveHandle
from tierckpt.orchestration.packing import build_manifest, pack_and_write
from tierckpt.orchestration.runtime import gc_paused
from tierckpt.tiers.base import CheckpointKey, Tier, TierWriter

if TYPE_CHECKING:
    from tierckpt.orchestration.mover import Mover

__all__ = ["make_stage_job"]


def make_stage_job(
    mover: Mover,
    tier: Tier,
    handle: SaveHandle,
    flat: FlatState,
    layout: Layout,
    blobs: Sequence[BlobEntry],
    key: CheckpointKey,
    *,
    first: bool,
    last: bool,
    world_size: int,
    align: int,
) -> Callable[[], None]:
    """A job that reserves room on ``tier``, packs the caller's tensors into it (resolving
    ``handle.staged`` once the last byte is copied out of them), and commits.

    ``first``: ``tier`` is the save's top destination. A lower destination runs this only as the fallback
    when every tier above it failed, and only while the state is not staged yet: once ``staged`` has
    resolved the caller may have changed the tensors, so they are never packed again.
    ``last``: no fallback comes after this one, so a failure here also fails ``staged``.
    """

    def stage() -> None:
        writer: TierWriter | None = None
        try:
            if not first and handle.staged.done():
                raise TierckptError(
                    f"step {key.step}: every tier above {tier.name!r} failed after the state was staged; "
                    "the caller may have changed it since, so it is not packed again"
                )
            with gc_paused():
                writer = mover.reserve(tier, key, blobs)
                failed: dict[str, BaseException] = {}
                pool = mover.workers[tier.name].pool
                on_staged = lambda: handle.staged.set_result(None)  # noqa: E731
                srcs = [r.tensor for r in flat.tensors]
                manifest = b""

                def encode(checksums: list[int]) -> None:
                    nonlocal manifest
                    manifest = build_manifest(
                        flat, srcs, layout, blobs, checksums, step=key.step, rank=key.rank,
                        world_size=world_size, align=align,
                    )  # fmt: skip

                checksums = tier.pack(writer, flat, layout, pool, on_staged)  # a tier that packs itself (gpu)
                if checksums is not None:
                    encode(checksums)
                else:  # the manifest is encoded while the last chunks are still being written
                    pack_and_write(
                        flat, layout, {tier.name: writer}, failed, pool, pool().slot_bytes, on_staged, encode
                    )
                if failed:
                    raise failed[tier.name]
                writer.commit(manifest)
        except BaseException as e:
            if writer is not None:
                writer.abort()
            if last and not handle.staged.done():
                handle.staged.set_exception(e)
            raise

    return stage
