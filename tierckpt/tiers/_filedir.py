"""A directory tier's directory as the tier opens it: made (or, read-only, required), and checked for
access, a read-only mount named as such."""

from __future__ import annotations

import contextlib
import errno
import os
from pathlib import Path

from tierckpt.errors import TierIOError
from tierckpt.tiers._fileread import io_error

__all__ = ["open_directory"]


def open_directory(name: str, path: Path, readonly: bool) -> None:
    """Make ``path`` (a writable tier's; a read-only tier's must exist) and check that the tier can use it.

    Raises:
        TierIOError: naming tier ``name`` and ``path``: missing (``readonly``), cannot be made, not
            readable (and writable), or on a read-only file system while the tier is to write there.
    """
    if readonly:  # a tool that only reads: a missing directory is a mistake, not one to create
        if not path.is_dir():
            raise TierIOError(errno.ENOENT, f"tier {name!r}: directory {path} does not exist", str(path))
    else:
        try:
            path.mkdir(parents=True, exist_ok=True)
        except OSError as e:
            raise io_error(name, f"cannot create directory {path}", e) from e
    if os.access(path, os.R_OK | os.X_OK if readonly else os.R_OK | os.W_OK | os.X_OK):
        return
    mounted_ro = False
    with contextlib.suppress(OSError):
        mounted_ro = bool(os.statvfs(path).f_flag & os.ST_RDONLY)
    if mounted_ro and not readonly:
        raise TierIOError(
            errno.EROFS,
            f"tier {name!r}: directory {path} is on a read-only file system: a hierarchy that saves needs to "
            "write there; to list, verify or restore its checkpoints, open it with readonly=True (the "
            "command line does)",
            str(path),
        )
    what = "readable" if readonly else "readable and writable"
    raise TierIOError(errno.EACCES, f"tier {name!r}: directory {path} is not {what}", str(path))
