"""The per-user cache directory: small files a later process reuses instead of finding out again (the
``liburing`` probe's answer, what ``compress: auto`` measured of each tier). Nothing kept there is needed:
every reader treats a missing, unreadable or malformed file as no answer, and a write that fails costs
only the finding out again.

Where: ``$TIERCKPT_CACHE_DIR`` (empty: nothing is kept), else ``$XDG_CACHE_HOME/tierckpt``, else
``~/.cache/tierckpt`` (docs/config.md).
"""

from __future__ import annotations

import contextlib
import os
import stat
import tempfile
from pathlib import Path

__all__ = ["ENV", "cache_dir", "read_small", "replace_file"]

#: the variable that says where the cache is (empty: none)
ENV = "TIERCKPT_CACHE_DIR"


def cache_dir() -> Path | None:
    """The cache directory (not created here), or None where ``$TIERCKPT_CACHE_DIR`` is set empty."""
    where = os.environ.get(ENV)
    if where is not None:
        return Path(where) if where else None
    base = os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache")
    return Path(base) / "tierckpt"


def read_small(path: Path, max_bytes: int) -> bytes:
    """The bytes of the regular file ``path``, refused unless it holds at most ``max_bytes``.

    Raises:
        OSError: it cannot be opened or read (missing, a directory, permissions).
        ValueError: it is not a regular file, or it is larger than ``max_bytes``.
    """
    fd = os.open(path, os.O_RDONLY | os.O_NOFOLLOW | getattr(os, "O_NONBLOCK", 0))
    with os.fdopen(fd, "rb") as f:
        if not stat.S_ISREG(os.fstat(fd).st_mode):
            raise ValueError(f"{path}: not a regular file")
        data = f.read(max_bytes + 1)
    if len(data) > max_bytes:
        raise ValueError(f"{path}: larger than {max_bytes} bytes")
    return data


def replace_file(path: Path, data: bytes) -> None:
    """Replace ``path`` whole with ``data``: written to a temporary file in its directory (made if
    missing), then renamed over it, so that a reader (another process) sees the old file or the new one,
    never a part, and of writers at once the last rename wins. Not synced: what a crash loses is a
    cache's, and a reader refuses what it cannot parse.

    Raises:
        OSError: the directory cannot be made or written (read-only, full), or the rename failed.
    """
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=f".{path.name}.", suffix=".tmp")
    try:
        with os.fdopen(fd, "wb") as f:
            f.write(data)
        os.replace(tmp, path)
    except BaseException:
        with contextlib.suppress(OSError):
            os.unlink(tmp)
        raise
