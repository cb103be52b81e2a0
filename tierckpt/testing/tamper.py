"""Hostile edits of a file tier's copies, for tests of what a reader refuses."""

from __future__ import annotations

from pathlib import Path

from tierckpt.format.layout import data_offsets
from tierckpt.format.manifest import HEADER, decode_manifest
from tierckpt.format.record import RECORDS_SINCE, decode_record, encode_record, manifest_tag

__all__ = ["blob_file", "rewrite_manifest"]


def rewrite_manifest(path: Path, data: bytes) -> None:
    """Replace the manifest file ``path`` (``…/step-N/rank-R/manifest``) with ``data`` and, where the
    step has a commit record, make the record name the new manifest, so that a reader meets the
    manifest's own defects (what such a test is about) rather than a copy the record does not name."""
    path.write_bytes(data)
    record_path = path.parent.parent / "commit"
    if not record_path.is_file() or len(data) < HEADER.size or HEADER.unpack_from(data)[1] < RECORDS_SINCE:
        return
    record = decode_record(record_path.read_bytes())
    rank = int(path.parent.name.rpartition("-")[2])
    tags = list(record.manifests)
    tags[rank] = manifest_tag(data)
    record_path.write_bytes(encode_record(type(record)(record.step, record.world_size, tuple(tags))))


def blob_file(rank_dir: Path, blob: int = 0) -> tuple[Path, int]:
    """Where blob ``blob`` of the copy in ``rank_dir`` lies: its file and its offset in it (0 for a file a
    blob; the sum of the sizes before it in a ``data.bin`` holding all of them, see
    tierckpt.tiers._filewrite)."""
    blobs = decode_manifest((rank_dir / "manifest").read_bytes()).blobs
    data = rank_dir / "data.bin"
    if not data.exists():
        return rank_dir / blobs[blob].name, 0
    return data, data_offsets(blobs)[blob]
