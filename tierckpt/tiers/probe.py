"""What a directory tier would make of a directory before one is opened there: the facts of its file
system (:func:`tierckpt.io.fsutil.probe_fs_explained`) and the I/O geometry a tier of a kind sizes from
them (:func:`tierckpt.io.geometry.io_geometry`, under the default io settings). ``tierckpt probe PATH``
prints :func:`probe_report`; its shape is documented in docs/tiers.md, "What tierckpt detects"."""

from __future__ import annotations

import os
from dataclasses import asdict
from pathlib import Path

from tierckpt.errors import TierIOError
from tierckpt.io.fsdetect import SHARED_FAMILIES
from tierckpt.io.fsutil import find_sample, probe_fs_explained
from tierckpt.io.geometry import FsFacts, IOGeometry, io_geometry
from tierckpt.ioconfig import IOConfig, default_io
from tierckpt.tiers._files import FileTier
from tierckpt.tiers.base import TierCapabilities
from tierckpt.tiers.local import LocalTier
from tierckpt.tiers.pfs import PfsTier

__all__ = ["KINDS", "planned_geometry", "probe_report"]

#: the directory kinds a probe sizes for
KINDS: dict[str, type[FileTier]] = {"pfs": PfsTier, "local": LocalTier}


def planned_geometry(cls: type[FileTier], facts: FsFacts, io: IOConfig) -> IOGeometry:
    """The geometry a tier of class ``cls`` (its kind's defaults: no options of its own) would have on a
    file system with ``facts`` under the io settings ``io``."""
    caps = TierCapabilities(
        persistent=True, shared=cls.shared, device="file", alignment_bytes=facts.direct_alignment_bytes
    )
    return io_geometry(
        caps, io, facts, blob_bytes=cls.preferred_blob_bytes, one_file=cls.one_file, whole_blocks=cls.whole_blocks
    )


def probe_report(path: str | os.PathLike[str], *, kind: str | None = None, write: bool = True) -> dict[str, object]:
    """What ``tierckpt probe`` shows of the directory ``path``, as JSON-ready values.

    Args:
        path: an existing directory.
        kind: the tier kind to size for (``pfs`` or ``local``); None: ``pfs`` on a shared file system
            (:data:`~tierckpt.io.fsdetect.SHARED_FAMILIES`), else ``local``.
        write: learn whether O_DIRECT works by creating and removing a probe file; else (and on a
            read-only mount) by opening an existing file under ``path`` for reading, if there is one:
            nothing is written.

    Returns:
        ``path`` (resolved), ``kind``, ``kind_from`` (``--kind`` or the family it was chosen by),
        ``wrote_probe_file``, ``facts`` (every :class:`~tierckpt.io.geometry.FsFacts` field and
        ``direct_alignment_bytes``), ``sources`` (where each fact came from, in words), ``details``
        (what else the file system said) and ``geometry`` (every
        :class:`~tierckpt.io.geometry.IOGeometry` field and ``read_staging_bytes``).

    Raises:
        TierIOError: the probe file cannot be created (``write=False`` probes without it).
        ValueError: ``kind`` is no directory kind.
    """
    if kind is not None and kind not in KINDS:
        raise ValueError(f"kind {kind!r}: expected one of {', '.join(KINDS)}")
    where = os.path.realpath(path)
    sample = find_sample(Path(where))  # used where nothing is written (--no-write, a read-only mount)
    try:
        probe = probe_fs_explained(Path(where), writable=write, sample=sample)
    except OSError as e:
        raise TierIOError(
            e.errno or 0, f"cannot write a probe file in {where} ({e.strerror}); --no-write probes without"
        ) from e
    facts = probe.facts
    chosen = kind or ("pfs" if facts.family in SHARED_FAMILIES else "local")
    geometry = planned_geometry(KINDS[chosen], facts, default_io())
    return {
        "path": where,
        "kind": chosen,
        "kind_from": "--kind" if kind else f"the family {facts.family!r}",
        "wrote_probe_file": write and not facts.readonly,
        "facts": {**asdict(facts), "direct_alignment_bytes": facts.direct_alignment_bytes},
        "sources": {**probe.sources, "direct_alignment_bytes": "the largest of a page and dio_*_align"},
        "details": dict(probe.details),
        "geometry": {**asdict(geometry), "read_staging_bytes": geometry.read_staging_bytes},
    }
