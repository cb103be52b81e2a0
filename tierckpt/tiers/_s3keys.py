"""Where the ``s3`` tier keeps what under its prefix (docs/format.md, "Copies on an object store")::

    PREFIX/records/step-000000000012                          a step's commit record
    PREFIX/manifests/step-000000000012/rank-00003             a copy's head object: published last
    PREFIX/data/[HH/]step-000000000012/rank-00003/VERSION/NAME  a copy's blobs, one object each

``HH`` (with ``hashed_prefixes: N``) is the first N hex digits of a hash of the step and rank, which
spreads the data of a step's ranks over 16**N key prefixes (S3 limits request rates per prefix).
"""

from __future__ import annotations

import re
import secrets
import time

import xxhash

from tierckpt.tiers.base import CheckpointKey

__all__ = ["S3Keys", "new_version"]

_HEAD = re.compile(r"step-(\d{12})/rank-(\d{5})")
_RECORD = re.compile(r"step-(\d{12})")
_DATA = re.compile(r"(?:[0-9a-f]{1,4}/)?step-(\d{12})/rank-(\d{5})/([0-9a-z][0-9a-z-]{0,63})/[^/]+")


def new_version() -> str:
    """A new copy's version: its key prefix, later ones sorting later (the clock, then random)."""
    return f"{time.time_ns():016x}-{secrets.token_hex(4)}"


def _ckpt(key: CheckpointKey) -> str:
    return f"step-{key.step:012d}/rank-{key.rank:05d}"


class S3Keys:
    """The keys of one tier (see the module docstring).

    Args:
        prefix: the tier's prefix in the bucket ("" or ending in "/").
        hashed: hex digits of hashed prefix before each copy's data (0: none).
    """

    def __init__(self, prefix: str, hashed: int = 0) -> None:
        self.prefix, self.hashed = prefix, hashed
        self.records = f"{prefix}records/"
        self.heads = f"{prefix}manifests/"
        self.data_root = f"{prefix}data/"

    def record(self, step: int) -> str:
        return f"{self.records}step-{step:012d}"

    def head(self, key: CheckpointKey) -> str:
        return f"{self.heads}{_ckpt(key)}"

    def spread(self, key: CheckpointKey) -> str:
        """The hashed prefix a new copy of ``key`` puts in front of its blobs ("" without ``hashed``)."""
        return xxhash.xxh3_64_hexdigest(_ckpt(key).encode())[: self.hashed] if self.hashed else ""

    def data(self, key: CheckpointKey, version: str, spread: str) -> str:
        """The key prefix of one version of a copy's blobs (ends in "/"), under its hashed prefix
        ``spread`` (the copy's head says which: the option may have changed since it was written)."""
        return f"{self.data_root}{spread + '/' if spread else ''}{_ckpt(key)}/{version}/"

    def parse_record(self, k: str) -> int | None:
        m = _RECORD.fullmatch(k[len(self.records) :]) if k.startswith(self.records) else None
        return int(m.group(1)) if m else None

    def parse_head(self, k: str) -> CheckpointKey | None:
        m = _HEAD.fullmatch(k[len(self.heads) :]) if k.startswith(self.heads) else None
        return CheckpointKey(int(m.group(1)), int(m.group(2))) if m else None

    def parse_data(self, k: str) -> tuple[CheckpointKey, str] | None:
        """(copy, version) of a data object's key; None for a key the tier does not write."""
        m = _DATA.fullmatch(k[len(self.data_root) :]) if k.startswith(self.data_root) else None
        return (CheckpointKey(int(m.group(1)), int(m.group(2))), m.group(3)) if m else None
