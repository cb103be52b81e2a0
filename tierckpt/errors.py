"""One exception tree for tierckpt.

Every error subclasses :class:`TierckptError` and, where one fits, the matching builtin, so that
``except FileNotFoundError`` or ``except ValueError`` in user code keeps working.
"""

from __future__ import annotations

import errno

__all__ = [
    "CheckpointNotFoundError",
    "ConfigError",
    "CorruptCheckpointError",
    "StateError",
    "TierFullError",
    "TierIOError",
    "TierckptError",
    "UnsupportedFormatError",
]


class TierckptError(Exception):
    """Base class of every error raised by tierckpt."""


class ConfigError(TierckptError, ValueError):
    """A configuration (YAML, dict or constructor argument) is invalid; the message names the key."""


class StateError(TierckptError, TypeError):
    """A state dict holds a value that cannot be saved, or does not match a restore target.

    The message names the key path, e.g. ``state['optim']['param_groups'][0]['betas_fn']``.
    """


class CheckpointNotFoundError(TierckptError, FileNotFoundError):
    """No committed checkpoint matches the request."""


class CorruptCheckpointError(TierckptError, OSError):
    """Stored bytes fail validation: bad manifest, truncated blob or checksum mismatch.

    Attributes:
        tier: name of the tier that holds the bad copy (or None when unknown).
        step: checkpoint step.
        blob: blob file name, when the damage is inside a blob.
        key: key path of the damaged tensor, when known.
    """

    def __init__(
        self,
        message: str,
        *,
        tier: str | None = None,
        step: int | None = None,
        blob: str | None = None,
        key: str | None = None,
    ) -> None:
        where = [f"{k}={v}" for k, v in (("tier", tier), ("step", step), ("blob", blob), ("key", key)) if v is not None]
        super().__init__(errno.EBADMSG, f"{message} [{', '.join(where)}]" if where else message)
        self.tier, self.step, self.blob, self.key = tier, step, blob, key

    def __str__(self) -> str:
        return str(self.strerror)


class UnsupportedFormatError(TierckptError, OSError):
    """An intact checkpoint written in a newer format version than this reader knows (upgrade tierckpt).

    An OSError like :class:`CorruptCheckpointError`, so that a restore tries the next tier's copy, but
    never reported as damage: the file's checksum holds.
    """

    def __init__(self, message: str) -> None:
        super().__init__(errno.EPROTONOSUPPORT, message)

    def __str__(self) -> str:
        return str(self.strerror)


class TierIOError(TierckptError, OSError):
    """An I/O operation on a tier failed; ``errno`` and ``filename`` come from the underlying OSError."""


class TierFullError(TierckptError, OSError):
    """A tier has no room for a checkpoint (capacity reached)."""

    def __init__(self, message: str) -> None:
        super().__init__(errno.ENOSPC, message)

    def __str__(self) -> str:
        return str(self.strerror)
