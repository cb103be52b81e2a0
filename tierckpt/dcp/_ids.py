"""DCP checkpoint ids as tierckpt steps: an int, or a str of its decimal digits."""

from __future__ import annotations

import os

from tierckpt.facade.checks import check_step

__all__ = ["step_of", "valid_id"]


def step_of(checkpoint_id: object) -> int:
    """The step a DCP ``checkpoint_id`` names: an int, or a str of its decimal digits."""
    raw = os.fspath(checkpoint_id) if isinstance(checkpoint_id, (str, os.PathLike)) else checkpoint_id
    step = int(raw) if isinstance(raw, str) and raw.isdecimal() and raw.isascii() else raw
    return check_step(step)


def valid_id(checkpoint_id: object) -> bool:
    try:
        step_of(checkpoint_id)
    except (ValueError, TypeError):
        return False
    return True
