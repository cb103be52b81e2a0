"""Pointer files: the small file a framework sees at a checkpoint's path, naming the hierarchy's step.

Frameworks that think of a checkpoint as a file (Lightning's ``last.ckpt``, its top-k files) look for
files: they list a directory, compare modification times, test that a path exists. A pointer file is
what they find there: a few hundred bytes of JSON naming the step of the hierarchy that holds the
checkpoint and an id that the saved state carries too, so that a pointer whose step now holds another
checkpoint is detected instead of loaded. Written atomically (a temporary name in the same directory,
fsync, rename, fsync of the directory). Pure file handling: no framework and no hierarchy here.
"""

from __future__ import annotations

import contextlib
import json
import os
import secrets
from collections.abc import Iterable
from dataclasses import dataclass
from pathlib import Path

__all__ = ["FORMAT", "Pointer", "new_id", "read_pointer", "referenced_steps", "write_pointer"]

FORMAT = "tierckpt-pointer"  #: the value of a pointer file's first key, ``format``
_VERSION = 1
_MAX_BYTES = 64 << 10  # a pointer is a few hundred bytes; anything longer is not one


@dataclass(frozen=True)
class Pointer:
    """What a pointer file says.

    Attributes:
        step: the hierarchy's step holding the checkpoint.
        id: a random id the saved state carries too (a step saved again under another id is not this
            checkpoint).
        global_step: the framework's own step counter at the save (for people reading the file).
    """

    step: int
    id: str
    global_step: int | None = None


def new_id() -> str:
    """A fresh random id for a save (128 bits, hex)."""
    return secrets.token_hex(16)


def write_pointer(path: str | os.PathLike[str], pointer: Pointer) -> None:
    """Write ``pointer`` at ``path`` atomically: a reader sees the old file or the new one, whole.

    Raises:
        OSError: the directory cannot be written.
    """
    path = Path(path)
    body = {
        "format": FORMAT,
        "version": _VERSION,
        "step": pointer.step,
        "id": pointer.id,
        "global_step": pointer.global_step,
        "note": "a checkpoint held by a tierckpt hierarchy, not a torch.save file: load it with "
        "tierckpt.integrations.lightning.HierarchyCheckpointIO, or write it out with `tierckpt export`",
    }
    data = (json.dumps(body, indent=1) + "\n").encode()
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.parent / f".{path.name}.tmp-{os.getpid()}-{secrets.token_hex(4)}"
    fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o644)
    try:
        try:
            os.write(fd, data)
            os.fsync(fd)
        finally:
            os.close(fd)
        os.replace(tmp, path)
    except BaseException:
        with contextlib.suppress(OSError):
            os.unlink(tmp)
        raise
    dfd = os.open(path.parent, os.O_RDONLY | os.O_DIRECTORY)
    try:
        os.fsync(dfd)
    finally:
        os.close(dfd)


def read_pointer(path: str | os.PathLike[str]) -> Pointer | None:
    """The pointer at ``path`` (through a symbolic link), or None where the file is not a pointer (a
    ``torch.save`` file, say).

    Raises:
        FileNotFoundError: nothing is at ``path`` (or a link there leads nowhere).
        ValueError: the file starts as a pointer but is malformed (naming the path and what is wrong).
    """
    with open(path, "rb") as f:
        data = f.read(_MAX_BYTES + 1)
    if len(data) > _MAX_BYTES or FORMAT.encode() not in data[:200] or not data.lstrip().startswith(b"{"):
        return None  # a torch.save file starts with "PK" (a zip) or a pickle's opcode
    try:
        body = json.loads(data)
    except ValueError as e:
        raise ValueError(f"{os.fspath(path)}: a damaged tierckpt pointer file ({e})") from None
    if not isinstance(body, dict) or body.get("format") != FORMAT:
        return None
    step, ident, gs = body.get("step"), body.get("id"), body.get("global_step")
    if body.get("version") != _VERSION or type(step) is not int or step < 0 or not isinstance(ident, str):
        raise ValueError(
            f"{os.fspath(path)}: not a tierckpt pointer of version {_VERSION} with an int step and a str id: {body!r}"
        )
    return Pointer(step, ident, gs if type(gs) is int else None)


def referenced_steps(dirs: Iterable[str | os.PathLike[str]]) -> set[int]:
    """The steps that the pointer files in ``dirs`` (not their subdirectories) name; files that are not
    pointers, links that lead nowhere and directories that do not exist are skipped."""
    steps: set[int] = set()
    for d in dirs:
        try:
            entries = list(os.scandir(d))
        except (FileNotFoundError, NotADirectoryError):
            continue
        for e in entries:
            if e.name.startswith(".") or not e.is_file():  # is_file follows links: a dangling one is False
                continue
            with contextlib.suppress(FileNotFoundError, ValueError, IsADirectoryError):
                p = read_pointer(e.path)
                if p is not None:
                    steps.add(p.step)
    return steps
