"""One exception tree for tierckpt.

Every error subclasses :class:`TierckptError` and, where one fits, the matching builtin, so that
``except FileNotFoundError`` or ``except ValueError`` in user code keeps working.
"""

from __future__ import annotations

import errno
from typing import Any

__all__ = [
    "CheckpointEvictedError",
    "CheckpointNotFoundError",
    "ConfigError",
    "CoordinationError",
    "CorruptCheckpointError",
    "DeviceFullError",
    "StateError",
    "TierBusyError",
    "TierFullError",
    "TierIOError",
    "TierckptError",
    "UnsupportedFormatError",
]


class TierckptError(Exception):
    """Base class of every error raised by tierckpt."""


def _by_message(self: OSError) -> tuple[Any, ...]:
    """How pickle rebuilds an OSError subclass built from its message alone (its ``args`` are errno and
    message, which its constructor does not take): DCP hands a rank's exception to the others pickled."""
    return type(self), (self.strerror,), self.__dict__


class ConfigError(TierckptError, ValueError):
    """A configuration (YAML, dict or constructor argument) is invalid; the message names the key."""


class StateError(TierckptError, TypeError):
    """A state dict holds a value that cannot be saved, or does not match a restore target.

    The message names the key path, e.g. ``state['optim']['param_groups'][0]['betas_fn']``.
    """


class CheckpointNotFoundError(TierckptError, FileNotFoundError):
    """No committed checkpoint matches the request."""


class CheckpointEvictedError(CheckpointNotFoundError):
    """A committed checkpoint went away (evicted, or replaced by a new save of its step, by another
    process) while it was being opened for reading; what had been opened is dropped, nothing was read."""


class CorruptCheckpointError(TierckptError, OSError):
    """Stored bytes fail validation: bad manifest, truncated blob or checksum mismatch.

    Attributes:
        tier: name of the tier that holds the bad copy (or None when unknown).
        step: checkpoint step.
        blob: blob file name, when the damage is inside a blob.
        key: key path of the damaged tensor, when known.
        rank: the rank whose copy it is, where the message names it ("rank 1's copy": another rank's).
    """

    def __init__(
        self,
        message: str,
        *,
        tier: str | None = None,
        step: int | None = None,
        blob: str | None = None,
        key: str | None = None,
        rank: int | None = None,
    ) -> None:
        where = [f"{k}={v}" for k, v in (("tier", tier), ("step", step), ("blob", blob), ("key", key)) if v is not None]
        super().__init__(errno.EBADMSG, f"{message} [{', '.join(where)}]" if where else message)
        self.tier, self.step, self.blob, self.key, self.rank = tier, step, blob, key, rank

    def __str__(self) -> str:
        return str(self.strerror)

    __reduce__ = _by_message


class UnsupportedFormatError(TierckptError, OSError):
    """An intact checkpoint written in a newer format version than this reader knows (upgrade tierckpt).

    An OSError like :class:`CorruptCheckpointError`, so that a restore tries the next tier's copy, but
    never reported as damage: the file's checksum holds.
    """

    def __init__(self, message: str) -> None:
        super().__init__(errno.EPROTONOSUPPORT, message)

    def __str__(self) -> str:
        return str(self.strerror)

    __reduce__ = _by_message


class TierIOError(TierckptError, OSError):
    """An I/O operation on a tier failed; ``errno`` and ``filename`` come from the underlying OSError."""


class TierFullError(TierckptError, OSError):
    """A tier has no room for a checkpoint (capacity reached)."""

    def __init__(self, message: str) -> None:
        super().__init__(errno.ENOSPC, message)

    def __str__(self) -> str:
        return str(self.strerror)

    __reduce__ = _by_message


class DeviceFullError(TierFullError, TierIOError):
    """A tier's device (its file system) has no room for a checkpoint that would fit on it empty: a
    :class:`TierFullError`, so the hierarchy makes room as for a full ``capacity`` (evicting the oldest
    copies a lower tier holds), and a :class:`TierIOError` with the device's ``errno`` (``ENOSPC``,
    ``EDQUOT``), as it was before it was told apart."""

    def __init__(self, errno_: int, message: str, filename: str | None = None) -> None:
        OSError.__init__(self, errno_, message, filename)

    def __str__(self) -> str:
        return str(self.strerror)

    def __reduce__(self) -> tuple[Any, ...]:
        """Pickled whole (not by its message alone, as :class:`TierFullError` is): errno, message and
        file name are its constructor's arguments."""
        return type(self), (self.errno, self.strerror, self.filename), self.__dict__


class TierBusyError(TierckptError, BlockingIOError):
    """A tier directory is leased by another job, or this process lost its lease on it (docs/jobs.md).

    A ``BlockingIOError`` (errno ``EBUSY``), as ``fcntl.flock(LOCK_NB)`` raises for a lock held
    elsewhere: code written for lock files keeps working, and it is not mistaken for a missing
    file (``FileExistsError``) or a permission problem (``PermissionError``).

    Attributes:
        tier: the tier's name.
        lease_file: the lease file of the holder.
        job: the holder's job identity (None when unknown).
        host: the host of one of the holder's processes (None when unknown).
        pid: that process's pid.
        started_at: that process's start time (seconds since the epoch), where known.
    """

    def __init__(
        self,
        message: str,
        *,
        tier: str | None = None,
        lease_file: str | None = None,
        job: str | None = None,
        host: str | None = None,
        pid: int | None = None,
        started_at: float | None = None,
    ) -> None:
        super().__init__(errno.EBUSY, message)
        self.tier, self.lease_file, self.job = tier, lease_file, job
        self.host, self.pid, self.started_at = host, pid, started_at

    def __str__(self) -> str:
        return str(self.strerror)

    __reduce__ = _by_message


class CoordinationError(TierckptError, RuntimeError):
    """The ranks of a job could not agree in time (a rank died, hung or left): the step or restore in
    question fails on every rank that waited, naming the ranks that did not answer; training goes on.

    Not an ``OSError`` (nor a ``TimeoutError``, which is one): a restore must not take it for a damaged
    copy and try the next tier, and a tier's I/O error handling must not swallow it.

    Attributes:
        ranks: the ranks that did not answer (empty when unknown).
        undecided: whether rank 0 may have made the decision all the same: it had taken the call up
            (claimed it) but published no outcome in time, so it may have acted on it (a commit's
            record may be written) before it died or while it was stuck; a rank cannot tell.
    """

    def __init__(self, message: str, ranks: tuple[int, ...] = (), *, undecided: bool = False) -> None:
        super().__init__(message)
        self.ranks = ranks
        self.undecided = undecided
