"""DCP checkpoint ids as tierckpt steps (docs/distributed.md, "DCP backend", "checkpoint_id").

A ``checkpoint_id`` is one of:

* an int, or a str of its decimal digits: that step;
* the directory of one of the hierarchy's file tiers (its ``location()``): the hierarchy itself, so the
  step stays the one the writer (reader) was given;
* ``<a file tier's directory>/step-<N>``: the directory where that tier keeps step N (with or without
  the zero padding the tier writes: ``step-12`` and ``step-000000000012`` are step 12).

Anything else (another directory, a URL, a path under the tier that is not a step's directory) is
refused: it would put the step somewhere other than where the caller asked.
"""

from __future__ import annotations

import os
import re
from collections.abc import Sequence
from typing import TYPE_CHECKING

from tierckpt.facade.checks import check_step

if TYPE_CHECKING:
    from tierckpt.hierarchy import Hierarchy

__all__ = ["step_of", "tier_dirs", "valid_id"]

_STEP_DIR = re.compile(r"step-([0-9]+)")


def _digits(raw: object) -> int | None:
    if type(raw) is int:
        return check_step(raw)
    if isinstance(raw, str) and raw.isdecimal() and raw.isascii():
        return int(raw)
    return None


def _local(root: str) -> bool:
    return "://" not in root and os.path.isabs(root)


def step_of(checkpoint_id: object, roots: Sequence[str], current: int | None) -> int | None:
    """The step ``checkpoint_id`` names; ``current`` where it names the hierarchy itself.

    Args:
        checkpoint_id: what DCP passes to ``reset``.
        roots: the hierarchy's file tiers' directories (resolved).
        current: the step given to the writer (reader) so far.

    Raises:
        ValueError: an id that names no step of this hierarchy (the message says what would).
        TypeError: an id that is neither an int, a str nor a path.
    """
    if isinstance(checkpoint_id, bool) or not isinstance(checkpoint_id, (int, str, os.PathLike)):
        raise TypeError(
            f"checkpoint_id: expected a step (int), its digits or a path, got {type(checkpoint_id).__name__}"
        )
    raw = os.fspath(checkpoint_id) if isinstance(checkpoint_id, os.PathLike) else checkpoint_id
    step = _digits(raw)
    if step is not None:
        return step
    assert isinstance(raw, str)  # an int is a step or raised above
    dirs = [r for r in roots if _local(r)]
    if raw and "://" not in raw:
        path = os.path.realpath(raw)
        if path in dirs:
            return current
        m = _STEP_DIR.fullmatch(os.path.basename(path))
        if m and os.path.dirname(path) in dirs:
            return check_step(int(m.group(1)))
    where = (
        f"a file tier's directory ({', '.join(dirs)}: the step given to the constructor) or <that directory>/step-N"
        if dirs
        else "(this hierarchy has no file tier, so no path names one of its steps)"
    )
    raise ValueError(
        f"checkpoint_id {raw!r} names no step of this hierarchy: pass a step (an int or its digits), {where}"
    )


def tier_dirs(h: Hierarchy) -> list[str]:
    """The directories of ``h``'s tiers that keep their bytes in one (resolved)."""
    return [loc for t in h.tiers if (loc := t.location()) is not None and _local(loc)]


def valid_id(checkpoint_id: object) -> bool:
    """Whether ``checkpoint_id`` has the form of one (a step, its digits, or a local path; not a URL): the
    instance's ``reset`` checks that a path is the hierarchy's."""
    if isinstance(checkpoint_id, bool) or not isinstance(checkpoint_id, (int, str, os.PathLike)):
        return False
    raw = os.fspath(checkpoint_id) if isinstance(checkpoint_id, os.PathLike) else checkpoint_id
    if isinstance(raw, int):
        return raw >= 0
    if not isinstance(raw, str) or re.fullmatch(r"[+-][0-9]+", raw):  # a number, not a step: "-1"
        return False
    return bool(raw) and "://" not in raw
