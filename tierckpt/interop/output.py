"""Where an export's files go: a scratch directory beside the output, published by rename once every file
is written and synced, so the output directory is never seen half-written; an existing non-empty output
is replaced only when asked (``force``), and then whole.
"""

from __future__ import annotations

import contextlib
import os
import secrets
import shutil
from collections.abc import Iterator
from pathlib import Path

from tierckpt.errors import TierckptError

__all__ = ["OutputExistsError", "OutputFailed", "check_output", "discard", "output_errors", "publish", "scratch"]


class OutputExistsError(TierckptError, FileExistsError):
    """The output directory exists and is not empty (export replaces it only with ``force``)."""


class OutputFailed(Exception):
    """An error writing the output (``error``, an OSError), carried through the choice of copies (which
    would take an OSError for an unreadable copy and try the next tier) and raised as it was."""

    def __init__(self, error: OSError) -> None:
        super().__init__(str(error))
        self.error = error


@contextlib.contextmanager
def output_errors() -> Iterator[None]:
    """Turn an OSError of the output's writes into :class:`OutputFailed`."""
    try:
        yield
    except OSError as e:
        raise OutputFailed(e) from e


def check_output(out: Path, *, force: bool) -> None:
    """Refuse an output that exists, is not empty, and may not be replaced.

    Raises:
        OutputExistsError: it is a non-empty directory or a file, and not ``force``.
    """
    if force or not os.path.lexists(out):
        return
    if out.is_dir() and not out.is_symlink() and not any(out.iterdir()):
        return
    what = "a non-empty directory" if out.is_dir() else "a file"
    raise OutputExistsError(f"{out} exists and is {what}: choose another output, or replace it (force=True, --force)")


def scratch(out: Path) -> Path:
    """A new scratch directory beside ``out`` (``.NAME.export-<random>``), on the same file system so that
    :func:`publish` renames it; its parent is made if missing."""
    out.parent.mkdir(parents=True, exist_ok=True)
    tmp = out.parent / f".{out.name}.export-{secrets.token_hex(4)}"
    tmp.mkdir()
    return tmp


def _sync_dir(d: Path) -> None:
    fd = os.open(d, os.O_RDONLY | getattr(os, "O_DIRECTORY", 0))
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def publish(tmp: Path, out: Path, *, force: bool) -> None:
    """Make ``tmp`` (every file in it synced) the directory ``out``: renamed into place, where ``out`` is
    missing or empty; with ``force``, an existing ``out`` is first renamed aside, then removed once the new
    one is in place (a reader sees the old output or the new one, whole).

    Raises:
        OutputExistsError: ``out`` became non-empty meanwhile, and not ``force``.
    """
    _sync_dir(tmp)
    check_output(out, force=force)
    old = None
    if os.path.lexists(out):
        if out.is_dir() and not out.is_symlink() and not any(out.iterdir()):
            out.rmdir()
        else:
            old = out.parent / f".{out.name}.replaced-{secrets.token_hex(4)}"
            os.rename(out, old)
    os.rename(tmp, out)
    _sync_dir(out.parent)
    if old is not None:
        if old.is_dir() and not old.is_symlink():
            shutil.rmtree(old)
        else:
            old.unlink()


def discard(tmp: Path) -> None:
    """Remove a scratch directory (what a failed export wrote)."""
    shutil.rmtree(tmp, ignore_errors=True)
