"""What a directory tier holds, as its directory lists it: the names of steps, rank copies and commit
records (docs/format.md), and which of them are checkpoints.

Names are matched whole (``step-…\\n`` is junk, not a step); a symbolic link is never followed, and an
entry named like a checkpoint that is none (a link, an empty directory, a copy missing its manifest) is
skipped with one warning, so that it never counts toward ``keep`` nor hides the newest good step.
"""

from __future__ import annotations

import contextlib
import logging
import os
import re
import stat
from pathlib import Path

from tierckpt.format.location import NODE_FILE_RE
from tierckpt.tiers._fileread import MANIFEST_NAME, io_error
from tierckpt.tiers.base import CheckpointKey

__all__ = ["RANK_RE", "RECORD_NAME", "STEP_RE", "FileListing", "rank_dir_name", "step_dir_name"]

log = logging.getLogger(__name__)

STEP_RE = re.compile(r"step-(\d{12})")
RANK_RE = re.compile(r"rank-(\d{5})")
RECORD_NAME = "commit"  # a step's commit record, beside its rank directories (docs/format.md)


def step_dir_name(step: int) -> str:
    """The name of ``step``'s directory: ``step-`` and twelve digits."""
    return f"step-{step:012d}"


def rank_dir_name(rank: int) -> str:
    """The name of ``rank``'s copy in a step directory: ``rank-`` and five digits."""
    return f"rank-{rank:05d}"


def _names(directory: Path, pattern: re.Pattern[str]) -> list[str]:
    """The names in ``directory`` that match ``pattern`` whole and are not links."""
    with os.scandir(directory) as it:
        return [e.name for e in it if pattern.fullmatch(e.name) and not e.is_symlink()]


def _is_node_file(e: os.DirEntry[str]) -> bool:
    """Whether ``e`` is a node file (a regular file named like one)."""
    return NODE_FILE_RE.fullmatch(e.name) is not None and e.is_file(follow_symlinks=False)


def _is_file(p: Path) -> bool:
    """Whether ``p`` is a regular file itself (not a link to one)."""
    try:
        return stat.S_ISREG(os.stat(p, follow_symlinks=False).st_mode)
    except OSError:
        return False


class FileListing:
    """The listing of the directory ``path`` of the tier ``tier`` (named in warnings and errors).

    It remembers the entries it warned about, so that each is warned about once.
    """

    def __init__(self, tier: str, path: Path) -> None:
        self.tier, self.path = tier, path
        self._junk: set[Path] = set()  # rank-like entries that are not checkpoints (warned about once)

    def rank_dir(self, key: CheckpointKey) -> Path:
        """Where ``key``'s copy is (or would be): ``<path>/step-…/rank-…``."""
        return self.path / step_dir_name(key.step) / rank_dir_name(key.rank)

    def step_dirs(self) -> list[Path]:
        """Step directories, oldest first; a link named like one is skipped (with one warning).

        Raises:
            TierIOError: the tier's directory cannot be listed (a missing one holds no step).
        """
        try:
            with os.scandir(self.path) as it:
                entries = [e for e in it if STEP_RE.fullmatch(e.name)]
        except FileNotFoundError:
            return []
        except OSError as e:
            raise io_error(self.tier, f"cannot list {self.path}", e) from e
        return sorted(Path(e.path) for e in entries if not self._linked(e))

    def _linked(self, e: os.DirEntry[str]) -> bool:
        """Whether a listed entry is a symbolic link (warned about once: links are not followed)."""
        try:
            linked = e.is_symlink()
        except OSError:
            return True
        if linked:
            self._warn_link(Path(e.path))
        return linked

    def _warn_link(self, p: Path) -> None:
        if p not in self._junk:
            self._junk.add(p)
            log.warning(
                "tier %r: %s is a symbolic link: not a checkpoint (links are not followed), skipped", self.tier, p
            )

    def committed(self, rank: int | None = None) -> list[CheckpointKey]:
        """Every ``step-…/rank-…`` directory (of ``rank``, if given) that holds a ``manifest`` file (see
        :meth:`tierckpt.tiers._files.FileTier.list_committed`)."""
        out = []
        for step in self.step_dirs():
            s = int(step.name.removeprefix("step-"))  # the name matched STEP_RE when the entry was listed
            if rank is not None:  # one stat, not a listing of every rank's entry (N ranks: N x N entries)
                if self.holds(CheckpointKey(s, rank)):
                    out.append(CheckpointKey(s, rank))
                continue
            try:
                with os.scandir(step) as it:
                    entries = [e for e in it if RANK_RE.fullmatch(e.name)]
            except OSError:
                continue
            for e in entries:
                if not self._linked(e) and self._has_manifest(Path(e.path)):
                    out.append(CheckpointKey(s, int(e.name[5:])))
        return sorted(out)

    def _has_manifest(self, rank_dir: Path) -> bool:
        if _is_file(rank_dir / MANIFEST_NAME):
            return True
        if rank_dir not in self._junk and os.path.lexists(rank_dir):
            self._junk.add(rank_dir)
            log.warning("tier %r: %s holds no manifest file: not a checkpoint, skipped", self.tier, rank_dir)
        return False

    def holds(self, key: CheckpointKey) -> bool:
        """Whether ``key``'s rank directory holds a manifest file, its step and rank directories no links
        (one ``stat`` each)."""
        rank_dir = self.rank_dir(key)
        for p in (rank_dir.parent, rank_dir):
            if os.path.islink(p):  # links are not followed (warned about once)
                self._warn_link(p)
                return False
        return self._has_manifest(rank_dir)

    def records(self) -> list[int]:
        """Steps whose directory holds a ``commit`` file (one ``stat`` a step)."""
        return [int(step.name[5:]) for step in self.step_dirs() if _is_file(step / RECORD_NAME)]

    def used_bytes(self) -> int:
        """Bytes of the files of every committed copy, and of every node file (``files: per_node``: one
        a node and step, counted once however many copies it holds)."""
        total = 0
        for step in self.step_dirs():
            with contextlib.suppress(OSError), os.scandir(step) as it:
                total += sum(e.stat(follow_symlinks=False).st_size for e in it if _is_node_file(e))
        for key in self.committed():
            with contextlib.suppress(OSError):
                total += sum(
                    e.stat(follow_symlinks=False).st_size
                    for e in os.scandir(self.rank_dir(key))
                    if e.is_file(follow_symlinks=False)
                )
        return total

    def sample(self) -> Path | None:
        """A manifest of one of the newest copies (to try O_DIRECT on without writing); None when there is
        none. Links are not followed."""
        with contextlib.suppress(OSError):
            for step in sorted(_names(self.path, STEP_RE), reverse=True)[:4]:
                for rank in _names(self.path / step, RANK_RE)[:4]:
                    if _is_file(p := self.path / step / rank / MANIFEST_NAME):
                        return p
        return None
