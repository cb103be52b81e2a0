"""The coordination seam: every decision that must be identical on every rank of a job goes through a
:class:`Coordinator`.

A hierarchy asks its coordinator

* which step to restore (:meth:`Coordinator.agree_step`: the newest step every rank can get),
* whether a step is committed on a tier, and which steps a shared tier evicts (:meth:`Coordinator.gather`:
  every rank reports its copy, rank 0 writes the step's record and decides the evictions);
* whether a time-based demotion is due (:meth:`Coordinator.decide`: every rank plans with rank 0's clock).

:class:`SoloCoordinator`: every rank decides alone, as in a single process (or in a job whose ranks
share nothing). :class:`~tierckpt.ranks.distributed.StoreCoordinator` is the multi-rank one: it
agrees through torch.distributed's key-value store (never the training thread's collectives), and a
hierarchy picks it by default when a process group of several ranks is initialized. Callers never test a
coordinator's type: what they need to know is declared (:attr:`Coordinator.connects_ranks`). Every method takes a
``timeout`` (None: the coordinator's own default, set when it is built) and raises
:class:`~tierckpt.errors.CoordinationError` naming the ranks that did not answer, so a dead rank fails a
step instead of hanging the job. Decisions are named (``decide(key, fn)``, ``gather(key, value, fn)``):
the background workers of different ranks reach them in different orders, so an implementation matches
them by key, never by call order; the foreground collectives (``barrier``, ``broadcast``, ``all_gather``,
``agree_step``) are made by every rank in the same order, from the training thread.
"""

from __future__ import annotations

import sys
import warnings
from collections.abc import Callable
from typing import Any, Protocol, TypeVar, runtime_checkable

from tierckpt.configvalues import check_node, node_identity
from tierckpt.errors import ConfigError

__all__ = ["Coordinator", "SoloCoordinator", "check_coordinator", "check_rank", "dist_rank"]

T = TypeVar("T")
V = TypeVar("V")
MAX_RANK = 10**5  #: file tiers name a rank with 5 decimal digits (docs/format.md)
_DECLARED = "connects_ranks"  # what a coordinator declares besides the calls (check_coordinator)


@runtime_checkable
class Coordinator(Protocol):
    """Rank-wide agreement on small decisions, with timeouts.

    Attributes:
        rank: this process's rank in the job.
        world_size: the number of ranks.
        node: this rank's node (ranks on one node share its node-local tiers).
        local_rank: this rank's position among the ranks of its node.
        connects_ranks: whether the ranks of the job agree through this coordinator: True when
            ``gather``/``decide`` run on rank 0 with every rank's value, so every rank gets one answer
            (:class:`~tierckpt.ranks.distributed.StoreCoordinator`); False when each rank decides
            alone (:class:`SoloCoordinator`, whatever its world size). A writable hierarchy of several
            ranks needs True (its commits wait for every rank's copy); a restore exchanges replicated
            DTensors between the ranks only with True; the job identity is agreed only with True.
            Every coordinator declares it; one that does not is taken to connect its ranks when it has
            several, with a ``DeprecationWarning`` (:func:`check_coordinator`).
    """

    rank: int
    world_size: int
    node: int
    local_rank: int

    @property
    def connects_ranks(self) -> bool:
        """Whether the ranks of the job agree through this coordinator (see the class docstring)."""
        ...

    def ranks_on_node(self) -> list[int]:
        """The global ranks on this rank's node, ascending."""
        ...

    def barrier(self, timeout: float | None = None) -> None:
        """Return once every rank has called it."""
        ...

    def broadcast(self, obj: T, src: int = 0, timeout: float | None = None) -> T:
        """Rank ``src``'s ``obj`` on every rank (small, msgpack-able or picklable plain data)."""
        ...

    def all_gather(self, obj: T, timeout: float | None = None) -> list[T]:
        """Every rank's ``obj``, in rank order."""
        ...

    def agree_step(self, newest: int | None, timeout: float | None = None) -> int | None:
        """The step every rank restores: the smallest of the ranks' ``newest`` (the newest step each can
        get from some tier), or None when some rank has none."""
        ...

    def decide(self, key: str, fn: Callable[[], T], timeout: float | None = None) -> T:
        """Run ``fn`` on one rank (rank 0) and return its result on every rank; ``key`` names the
        decision, the same on every rank and unique in the job (``save/100/1``, ``commit/pfs/100/1``)."""
        ...

    def gather(self, key: str, value: V, fn: Callable[[list[V]], T], timeout: float | None = None) -> T:
        """Every rank sends ``value`` (small plain data: None, bool, int, str, bytes, lists/dicts of
        them); once all ranks have, rank 0 runs ``fn(values in rank order)`` and every rank returns its
        result. ``key`` names the call (unique in the job, identical on every rank, e.g.
        ``commit/ssd/100/3``); keyed calls may be made from any thread, in any order across keys."""
        ...


class SoloCoordinator:
    """Every rank decides alone: the behaviour of a single process, and of ranks that share nothing.

    ``gather`` runs ``fn`` on this rank's value alone (``fn([value])``, whatever the world size), and
    :meth:`ranks_on_node` is this rank alone: it connects no ranks (``connects_ranks`` is False).

    Args:
        rank: this process's rank (default: torch.distributed's, else 0).
        world_size: the number of ranks (default: torch.distributed's, else 1).
        node: this rank's node (default: from the environment,
            :func:`~tierckpt.configvalues.node_identity`).

    Raises:
        ConfigError: ``rank`` is not in ``[0, world_size)`` or does not fit a rank directory's name; a
            bad node (or node variable in the environment).
    """

    connects_ranks: bool = False  #: every rank decides alone

    def __init__(self, rank: int | None = None, world_size: int | None = None, *, node: int | None = None) -> None:
        dr, dw = dist_rank()
        self.rank = dr if rank is None else rank
        self.world_size = dw if world_size is None else world_size
        if type(self.world_size) is not int or self.world_size < 1:
            raise ConfigError(f"world_size: expected a positive int, got {self.world_size!r}")
        check_rank(self.rank, self.world_size, "rank")
        if self.rank >= MAX_RANK:
            raise ConfigError(f"rank: {self.rank}: a file tier names ranks with 5 digits (at most {MAX_RANK - 1})")
        self.node, self.local_rank = node_identity(self.rank, None if node is None else check_node(node, "node"))

    def ranks_on_node(self) -> list[int]:
        return [self.rank]

    def barrier(self, timeout: float | None = None) -> None:
        """Nothing to wait for."""

    def broadcast(self, obj: T, src: int = 0, timeout: float | None = None) -> T:
        return obj

    def all_gather(self, obj: T, timeout: float | None = None) -> list[T]:
        return [obj]

    def agree_step(self, newest: int | None, timeout: float | None = None) -> int | None:
        return newest

    def decide(self, key: str, fn: Callable[[], T], timeout: float | None = None) -> T:
        return fn()

    def gather(self, key: str, value: V, fn: Callable[[list[V]], T], timeout: float | None = None) -> T:
        return fn([value])

    def __repr__(self) -> str:
        return f"SoloCoordinator(rank={self.rank}, world_size={self.world_size}, node={self.node})"


def check_rank(rank: object, world_size: int, key: str) -> int:
    """A rank of a job of ``world_size`` ranks.

    Raises:
        ConfigError: naming ``key`` when ``rank`` is not an int in ``[0, world_size)``.
    """
    if type(rank) is not int:
        raise ConfigError(f"{key}: expected an int, got {rank!r}")
    if not 0 <= rank < world_size:
        raise ConfigError(f"{key}: {rank} is not in [0, {world_size})")
    return rank


def check_coordinator(coordinator: Coordinator) -> Coordinator:
    """``coordinator``, once it declares what a hierarchy reads besides the calls: ``connects_ranks``,
    a bool.

    A coordinator that does not declare it (a third-party one written before ``connects_ranks``) keeps
    working as it did: it is taken to connect its ranks when it has several (before ``connects_ranks``,
    only a :class:`SoloCoordinator` was taken for ranks deciding alone), with a ``DeprecationWarning``
    naming the attribute, once: the attribute is set on it (on a wrapper that forwards every call to it,
    for an object that takes no new attributes).

    Raises:
        ConfigError: ``connects_ranks`` is declared but is not a bool.
    """
    if not hasattr(coordinator, _DECLARED):
        return _undeclared(coordinator)
    connects = getattr(coordinator, _DECLARED)
    if type(connects) is not bool:
        raise ConfigError(
            f"coordinator: {type(coordinator).__name__}.connects_ranks is {connects!r}, not True or False: a "
            "coordinator says whether the ranks of the job agree through it (True, as StoreCoordinator: gather "
            "and decide run on rank 0 with every rank's value) or each rank decides alone (False, as "
            'SoloCoordinator); see tierckpt.Coordinator and docs/distributed.md, "Coordination"'
        )
    return coordinator


def _undeclared(coordinator: Coordinator) -> Coordinator:
    """``coordinator``, which does not declare ``connects_ranks``, declaring what it meant before the
    attribute existed (see :func:`check_coordinator`)."""
    world = coordinator.world_size
    connects = type(world) is int and world > 1
    name = type(coordinator).__name__
    warnings.warn(
        f"coordinator: {name} does not declare connects_ranks; it is taken as {connects} (it has {world!r} "
        f"ranks{', so they are taken to agree through it' if connects else ''}). Declare connects_ranks = True "
        "when the ranks agree through it (gather and decide run on rank 0 with every rank's value) or False when "
        "each rank decides alone: a coordinator that does not will be refused in a later release",
        DeprecationWarning,
        stacklevel=_outside_tierckpt(),
    )
    try:
        setattr(coordinator, _DECLARED, connects)
    except (AttributeError, TypeError):  # __slots__, a frozen dataclass: it takes no new attribute
        return _Declaring(coordinator, connects)
    return coordinator


def _outside_tierckpt() -> int:
    """The ``stacklevel`` that makes a warning issued by this function's caller name the first caller
    outside tierckpt (the user's line that built the hierarchy)."""
    level, frame = 2, sys._getframe(2)  # 1: the caller, which warns; 2: its caller
    while frame.f_back is not None and str(frame.f_globals.get("__name__", "")).split(".")[0] == "tierckpt":
        frame, level = frame.f_back, level + 1
    return level


class _Declaring:
    """A coordinator that takes no new attribute, with ``connects_ranks``: every call goes to it."""

    def __init__(self, inner: Coordinator, connects: bool) -> None:
        self.inner = inner
        self.connects_ranks = connects
        self.rank, self.world_size = inner.rank, inner.world_size
        self.node, self.local_rank = inner.node, inner.local_rank

    def __getattr__(self, name: str) -> Any:  # what else the hierarchy's user reads of their coordinator
        return getattr(self.inner, name)

    def ranks_on_node(self) -> list[int]:
        return self.inner.ranks_on_node()

    def barrier(self, timeout: float | None = None) -> None:
        self.inner.barrier(timeout)

    def broadcast(self, obj: T, src: int = 0, timeout: float | None = None) -> T:
        return self.inner.broadcast(obj, src, timeout)

    def all_gather(self, obj: T, timeout: float | None = None) -> list[T]:
        return self.inner.all_gather(obj, timeout)

    def agree_step(self, newest: int | None, timeout: float | None = None) -> int | None:
        return self.inner.agree_step(newest, timeout)

    def decide(self, key: str, fn: Callable[[], T], timeout: float | None = None) -> T:
        return self.inner.decide(key, fn, timeout)

    def gather(self, key: str, value: V, fn: Callable[[list[V]], T], timeout: float | None = None) -> T:
        return self.inner.gather(key, value, fn, timeout)

    def __repr__(self) -> str:
        return repr(self.inner)


def dist_rank() -> tuple[int, int]:
    """torch.distributed's (rank, world size) when a process group is initialized, else (0, 1)."""
    try:
        import torch.distributed as dist

        if dist.is_available() and dist.is_initialized():
            return dist.get_rank(), dist.get_world_size()
    except Exception:  # pragma: no cover - a broken torch.distributed is not a process group
        pass
    return 0, 1
