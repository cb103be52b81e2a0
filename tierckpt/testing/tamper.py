"""Hostile edits of a file tier's copies, for tests of what a reader refuses."""

from __future__ import annotations

from pathlib import Path

from tierckpt.format.manifest import HEADER
from tierckpt.format.record import RECORDS_SINCE, decode_record, encode_record, manifest_tag

__all__ = ["rewrite_manifest"]


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
