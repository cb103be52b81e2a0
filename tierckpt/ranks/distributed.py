"""The ranks of a job agree through torch.distributed's key-value store (docs/distributed.md,
"Coordination").

:class:`StoreCoordinator` implements :class:`~tierckpt.ranks.coordinator.Coordinator` on a
``torch.distributed.Store`` (the job's TCPStore, a FileStore, an in-process HashStore): every call is a
*gather* under a key. Each rank other than 0 appends its value to the key's value list and counts itself
in; the rank that completes the count marks the key full; rank 0 waits for that mark, reads the list,
runs the decision and publishes the result under the key, which every other rank waits for. A rank
that does not arrive in time makes rank 0 publish a failure naming it, so the others fail at once; rank
0 not answering makes the others time out naming rank 0. Nothing here touches a process group, so the
training thread's collectives never race it and any thread may call it.

:func:`distributed_coordinator` builds one on the store of torch.distributed's default process group;
:func:`default_coordinator` is what a :class:`~tierckpt.hierarchy.Hierarchy` uses when it is given none.
"""

from __future__ import annotations

import logging
import threading
import time
from collections import deque
from collections.abc import Callable
from datetime import timedelta
from typing import TYPE_CHECKING, Any, TypeVar

import msgpack

from tierckpt.configvalues import Launch, check_timeout, launched, launched_rank
from tierckpt.errors import ConfigError, CoordinationError
from tierckpt.ranks.coordinator import SoloCoordinator, check_rank, dist_rank
from tierckpt.ranks.nodegather import NodeGather
from tierckpt.ranks.storekeys import KeyNames, Keys, check_key, decode, encode, failure, parse_values
from tierckpt.tiers.jobs import resolve_job

if TYPE_CHECKING:
    from torch.distributed import Store

    from tierckpt.ranks.coordinator import Coordinator

__all__ = [
    "DEFAULT_TIMEOUT",
    "StoreCoordinator",
    "default_coordinator",
    "distributed_coordinator",
    "min_step",
    "shared_job",
]

log = logging.getLogger("tierckpt.coordination")
T = TypeVar("T")
V = TypeVar("V")
#: how long a rank waits for the others by default (seconds): the skew a save's ranks may have
DEFAULT_TIMEOUT = 600.0
#: a rank's value, packed, may be at most this large by default (a result: world_size times it)
DEFAULT_MAX_BYTES = 1 << 20
_SWEEP_KEEP = 1024  # rank 0 remembers at most this many decided keys whose entries may linger


class StoreCoordinator:
    """Rank-wide agreement over a torch.distributed ``Store``: linear in ranks, with timeouts.

    Every rank of the job builds one, in the same order relative to the other coordinators it builds
    on the same store (a construction is itself a gather: it fails with :class:`CoordinationError` when
    a rank does not build its own within ``timeout``).

    Args:
        store: the job's store (``torch.distributed.TCPStore``, ``FileStore``, ``HashStore``, a
            ``PrefixStore``); each thread talks to it through a clone of its own.
        rank: this process's rank.
        world_size: the number of ranks.
        timeout: seconds a rank waits for the others at each call (default :data:`DEFAULT_TIMEOUT`).
        node: this rank's node (default: from the environment, see :func:`~tierckpt.configvalues.node_identity`).
        prefix: where in the store its keys live.
        max_bytes: the largest value a rank may send, packed (a result may be ``world_size`` times it).

    Attributes:
        node: this rank's node.
        local_rank: this rank's position among the ranks of its node (ascending global ranks).
        generation: this coordinator's number among those built on ``store`` under ``prefix``.
        connects_ranks: True: the ranks of the job agree through it.

    Raises:
        ConfigError: a bad rank, world size, node or timeout.
        CoordinationError: some rank did not build its coordinator in time.
    """

    connects_ranks: bool = True  #: every rank gets rank 0's answer, made from every rank's value

    def __init__(
        self,
        store: Store,
        rank: int,
        world_size: int,
        *,
        timeout: float | None = None,
        node: int | None = None,
        prefix: str = "tierckpt",
        max_bytes: int = DEFAULT_MAX_BYTES,
    ) -> None:
        me = SoloCoordinator(rank, world_size, node=node)  # checks rank, world size and node
        self.rank, self.world_size, self.node = me.rank, me.world_size, me.node
        self.timeout = check_timeout(DEFAULT_TIMEOUT if timeout is None else timeout, "timeout")
        self.max_bytes = max_bytes
        self._store = store
        self._local = threading.local()
        self._lock = threading.Lock()
        self._calls = 0  # foreground calls made so far: their keys
        self._node_gather: NodeGather | None = None  # made on first use (it needs the ranks on the node)
        self._decided: deque[tuple[float, str, bool]] = deque()  # rank 0: (when, key, ok) of its calls
        #: seconds after which rank 0 deletes whatever is left of a key (a failure's outcome, kept for
        #: the ranks that arrive late; the values of ranks that arrived after it)
        self.linger = 4 * self.timeout + 60.0
        self.generation = (self._op(store.add, f"{prefix}/members", 1, what="construction") - 1) // world_size
        self._names = KeyNames(f"{prefix}/{self.generation}")
        try:
            nodes: list[int] = self.gather(self._next("construction"), self.node, list)
        except CoordinationError as e:
            raise CoordinationError(
                f"{e}: every rank of the job builds its coordinator (its hierarchy) in the same order; to "
                "build one on some ranks only, give it coordinator=SoloCoordinator()",
                e.ranks,
            ) from e
        self._on_node = [r for r, n in enumerate(nodes) if n == self.node]
        self.local_rank = self._on_node.index(self.rank)

    def ranks_on_node(self) -> list[int]:
        """The global ranks on this rank's node, ascending."""
        return list(self._on_node)

    # -- the foreground collectives: keyed by the order in which every rank calls them -----------------
    def barrier(self, timeout: float | None = None) -> None:
        """Return once every rank has called it."""
        self.gather(self._next("barrier"), None, _none, timeout)

    def broadcast(self, obj: T, src: int = 0, timeout: float | None = None) -> T:
        """Rank ``src``'s ``obj`` on every rank (msgpack plain data: tuples come back as lists)."""
        check_rank(src, self.world_size, "src")
        pick: Callable[[list[T | None]], T] = _pick(src)
        return self.gather(self._next(f"broadcast-{src}"), obj if self.rank == src else None, pick, timeout)

    def all_gather(self, obj: T, timeout: float | None = None) -> list[T]:
        """Every rank's ``obj``, in rank order."""
        return self.gather(self._next("all_gather"), obj, list, timeout)

    def agree_step(self, newest: int | None, timeout: float | None = None) -> int | None:
        """The smallest of the ranks' ``newest``, or None when some rank has None."""
        return self.gather(self._next("agree_step"), newest, min_step, timeout)

    def _next(self, what: str) -> str:
        with self._lock:
            self._calls += 1
            return f"#{self._calls}/{what}"

    # -- the keyed calls: any thread, any order ------------------------------------------------------------
    def decide(self, key: str, fn: Callable[[], T], timeout: float | None = None) -> T:
        """Run ``fn`` on rank 0 and return its result on every rank; ``key`` names the decision."""
        return self.gather(key, None, lambda _: fn(), timeout)

    def gather(self, key: str, value: V, fn: Callable[[list[V]], T], timeout: float | None = None) -> T:
        """Every rank sends ``value``; rank 0 runs ``fn(values in rank order)``; every rank returns its
        result (as msgpack decodes it: tuples come back as lists).

        Args:
            key: names the call: identical on every rank, unique in the job (``commit/ssd/100/3``); a key
                may be used again once every rank has returned from its previous call and that call
                succeeded, not after it failed (its outcome stays for :attr:`linger` seconds, for the
                ranks that arrive late).
            value: small plain data (None, bool, int, float, str, bytes, lists and dicts of them).
            fn: the decision, run on rank 0 only.
            timeout: seconds to wait for the other ranks (None: the coordinator's).

        Raises:
            CoordinationError: a rank did not arrive in time (``ranks`` names it), a rank's value cannot
                be sent, ``fn`` raised on rank 0 (carrying its message), or the store failed.
        """
        check_key(key)
        wait = self.timeout if timeout is None else check_timeout(timeout, "timeout")
        result: T  # what fn returned, through msgpack (the same plain data)
        if self.world_size == 1:
            result = decode(encode(fn([decode(encode(value, self.max_bytes, key))]), self._result_bytes, key))
        elif self.rank == 0:
            result = self._decide(key, value, fn, wait)
        else:
            result = self._follow(key, value, wait)
        return result

    def node_gather(self, key: str, value: V, fn: Callable[[list[V]], T], timeout: float | None = None) -> T:
        """:meth:`gather` among the ranks of this rank's node only, decided by the node's first rank
        (tierckpt.ranks.nodegather): a per-node data file's one exchange per save and node."""
        wait = self.timeout if timeout is None else check_timeout(timeout, "timeout")
        return self._node().gather(key, value, fn, wait)

    def node_fail(self, key: str, why: str) -> None:
        """This rank will not take part in the :meth:`node_gather` ``key`` (its part failed first): the
        ranks of its node fail it at once, naming this rank and ``why``."""
        self._node().fail(key, why)

    def _node(self) -> NodeGather:
        with self._lock:
            if self._node_gather is None:
                ns = f"{self._names.namespace}/node-{self.node}"
                waits = lambda st, k, secs: self._wait(st, k, secs, "node exchange")  # noqa: E731
                self._node_gather = NodeGather(
                    ns, self.rank, self._on_node, self._st, waits, self.max_bytes, self.linger
                )
            return self._node_gather

    @property
    def _result_bytes(self) -> int:
        return self.max_bytes * self.world_size

    def _st(self) -> Store:
        """This thread's clone of the store: a TCPStore client runs one request at a time, so a thread
        blocked in ``wait`` would hold up every other thread's calls."""
        st = getattr(self._local, "store", None)
        if st is None:
            try:
                st = self._store.clone()  # type: ignore[attr-defined]  # torch's Store has it; its stubs do not
            except Exception:  # a store without clone(): shared (its calls may serialize)
                st = self._store
            self._local.store = st
        return st

    def _op(self, fn: Callable[..., Any], *args: Any, what: str) -> Any:
        """One store call; a store that fails (e.g. its server is gone) is a CoordinationError."""
        try:
            return fn(*args)
        except Exception as e:
            raise CoordinationError(f"rank {self.rank}: {what}: the store failed: {e}") from e

    def _wait(self, st: Store, key: str, secs: float, what: str) -> bool:
        """Wait up to ``secs`` for ``key``; False on a timeout (other store failures raise)."""
        try:
            st.wait([key], timedelta(seconds=secs))
            return True
        except Exception as e:
            if "timeout" in str(e).lower() or "timed out" in str(e).lower():
                return False
            raise CoordinationError(f"rank {self.rank}: {what}: the store failed: {e}") from e

    # -- rank 0 --------------------------------------------------------------------------------------------
    def _decide(self, key: str, value: Any, fn: Callable[[list[Any]], Any], wait: float) -> Any:
        st = self._st()
        self._sweep(st)
        ok = False
        try:
            out = self._decide_key(st, key, value, fn, wait)
            ok = True
            return out
        finally:
            with self._lock:
                self._decided.append((time.monotonic(), key, ok))

    def _decide_key(self, st: Store, key: str, value: Any, fn: Callable[[list[Any]], Any], wait: float) -> Any:
        k = self._names.of(key)
        # claimed on arrival: a rank that times out meanwhile knows rank 0 is here and keeps waiting
        if self._op(st.compare_set, k.claim, "", "0", what=key) != b"0":
            return self._raise(self._result(st, k, key, wait))  # the others gave up on rank 0 first
        try:
            own = encode(value, self.max_bytes, key)
        except CoordinationError as e:
            return self._raise(self._fail(st, k, failure(str(e), (0,))))
        start = time.monotonic()
        full = self._wait(st, k.full, wait, key)
        blob = self._op(st.get, k.values, what=key) if self._op(st.check, [k.values], what=key) else b""
        values, problem = parse_values(blob, self.world_size, key)
        if problem is None and len(values) < self.world_size - 1:
            missing = tuple(r for r in range(1, self.world_size) if r not in values)
            problem = failure(
                f"{key!r}: rank(s) {_ranks(missing)} did not arrive within {time.monotonic() - start:.1f} s "
                f"(rank 0 waited; timeout {wait:g} s)",
                missing,
            )
        elif not full and problem is None:
            log.debug("%s: every value arrived as the wait timed out", key)
        if problem is not None:
            return self._raise(self._fail(st, k, problem))
        try:
            out = fn([decode(own), *(decode(values[r]) for r in range(1, self.world_size))])
            payload = encode({"ok": out}, self._result_bytes, key)
        except Exception as e:
            failed = failure(f"{key!r}: rank 0's decision failed: {type(e).__name__}: {e}", ())
            self._fail(st, k, failed)
            raise CoordinationError(decode(failed)["err"]) from e
        self._op(st.set, k.result, payload, what=key)
        self._delete(st, k, k.values, k.counter, k.full)
        return decode(payload)["ok"]

    def _fail(self, st: Store, k: Keys, outcome: bytes) -> bytes:
        """Publish rank 0's failure (a rank arriving late reads only the outcome); the outcome."""
        self._op(st.set, k.result, outcome, what=k.key)
        self._delete(st, k, k.values, k.counter, k.full)
        return outcome

    def _delete(self, st: Store, k: Keys, *names: str) -> None:
        for name in names:
            self._op(st.delete_key, name, what=k.key)

    def _result(self, st: Store, k: Keys, key: str, wait: float) -> bytes:
        """The outcome another rank is publishing under ``k``."""
        if not self._wait(st, k.result, wait, key):
            raise CoordinationError(f"{key!r}: no outcome within {wait:g} s (rank {self.rank} waited)", (0,))
        outcome: bytes = self._op(st.get, k.result, what=key)
        return outcome

    def _sweep(self, st: Store) -> None:
        """Delete what lingers of keys decided :attr:`linger` seconds ago: the outcome of a failed key
        (kept for the ranks that arrive late) and the values of ranks that arrived after it; an outcome
        that a rank which died never read."""
        due: list[tuple[float, str, bool]] = []
        with self._lock:
            while self._decided and (
                time.monotonic() - self._decided[0][0] > self.linger or len(self._decided) > _SWEEP_KEEP
            ):
                due.append(self._decided.popleft())
        for _, key, ok in due:
            k = self._names.of(key)
            # after a success rank 0 deleted the values and the last reader the outcome: one check
            if not ok or self._op(st.check, [k.result], what=key):
                self._delete(st, k, *k.all())

    # -- the other ranks -----------------------------------------------------------------------------------
    def _follow(self, key: str, value: Any, wait: float) -> Any:
        st, k = self._st(), self._names.of(key)
        if not self._op(st.check, [k.result], what=key):  # a failed key's outcome is there already
            try:
                frame = msgpack.packb([self.rank, True, encode(value, self.max_bytes, key)])
            except CoordinationError as e:
                frame = msgpack.packb([self.rank, False, str(e)])
            self._op(st.append, k.values, frame, what=key)  # type: ignore[attr-defined]  # as clone()
            if self._op(st.add, k.counter, 1, what=key) == self.world_size - 1:
                self._op(st.set, k.full, b"1", what=key)
            # rank 0's failure naming a missing rank must come before this rank gives up on rank 0
            if not self._wait(st, k.result, wait + _grace(wait), key):
                self._give_up(st, k, key, wait)
        payload = self._op(st.get, k.result, what=key)
        # the last reader of rank 0's outcome cleans up; an outcome a rank published because rank 0 did
        # not answer stays (its claim keeps a rank 0 that comes back from deciding) until rank 0 sweeps it
        if decode(payload).get("by", 0) == 0 and self._op(st.add, k.read, 1, what=key) == self.world_size - 1:
            self._delete(st, k, k.result, k.read, k.claim)
        return self._raise(payload)

    def _give_up(self, st: Store, k: Keys, key: str, wait: float) -> None:
        """Rank 0 did not publish in time: claim the key and publish that (so that a rank 0 that comes
        back does not run the decision), or, when rank 0 claimed it on arrival (it is waiting for a rank,
        or deciding), wait once more for its outcome."""
        gave_up = failure(
            f"{key!r}: rank 0 did not answer within {wait + _grace(wait):.1f} s (rank {self.rank} waited)",
            (0,),
            by=self.rank,
        )
        won = self._op(st.compare_set, k.claim, "", str(self.rank), what=key)
        if won == str(self.rank).encode():
            self._op(st.set, k.result, gave_up, what=key)
        elif won == b"0" and not self._wait(st, k.result, wait + _grace(wait), key):
            # rank 0 is here (waiting for a rank, or deciding) but published nothing in time
            raise CoordinationError(
                f"{key!r}: rank 0 arrived but published no outcome within {wait:g} s (it may have decided: "
                "the outcome is unknown)",
                (0,),
                undecided=True,
            )
        elif won != b"0" and not self._wait(st, k.result, wait, key):
            raise CoordinationError(decode(gave_up)["err"], (0,))

    def _raise(self, payload: bytes) -> Any:
        """The outcome's result, or its failure raised as a CoordinationError."""
        out = decode(payload)
        if "ok" in out:
            return out["ok"]
        raise CoordinationError(out["err"], tuple(out["ranks"]))

    def __repr__(self) -> str:
        return (
            f"StoreCoordinator(rank={self.rank}, world_size={self.world_size}, node={self.node}, "
            f"timeout={self.timeout:g}, generation={self.generation})"
        )


def _grace(wait: float) -> float:
    """How much longer than rank 0 the other ranks wait, so that rank 0's report naming a missing rank
    reaches them before they give up on rank 0 itself."""
    return min(5.0, 0.5 + wait / 4)


def _ranks(ranks: tuple[int, ...]) -> str:
    shown = ", ".join(map(str, ranks[:16]))
    return shown + (f" and {len(ranks) - 16} more" if len(ranks) > 16 else "")


def _none(_: list[Any]) -> None:
    return None


def _pick(src: int) -> Callable[[list[Any]], Any]:
    return lambda values: values[src]


def min_step(steps: list[int | None]) -> int | None:
    """The step every rank can restore: the smallest newest step, None when some rank has none.

    Raises:
        TypeError: a rank sent something that is not a step.
    """
    for r, s in enumerate(steps):
        if s is not None and (type(s) is not int or s < 0):
            raise TypeError(f"rank {r} sent {s!r} as its newest step (expected a non-negative int or None)")
    held = [s for s in steps if s is not None]
    return min(held) if len(held) == len(steps) else None


def distributed_coordinator(
    *, timeout: float | None = None, node: int | None = None, prefix: str = "tierckpt/coord"
) -> StoreCoordinator:
    """A :class:`StoreCoordinator` on the store of torch.distributed's default process group (every rank
    must call it, in the same order as its other coordinators).

    Raises:
        ConfigError: torch.distributed is not initialized, or this torch has no default store.
        CoordinationError: some rank did not build its coordinator in time.
    """
    try:
        import torch.distributed as dist
        from torch.distributed import distributed_c10d

        if not (dist.is_available() and dist.is_initialized()):
            raise ConfigError("coordinator: torch.distributed is not initialized (call init_process_group first)")
        store = distributed_c10d._get_default_store()
    except (ImportError, AttributeError) as e:  # pragma: no cover - a torch without the default store
        raise ConfigError(
            f"coordinator: this torch has no default store ({e}); give coordinator=StoreCoordinator(store, ...)"
        ) from e
    return StoreCoordinator(store, dist.get_rank(), dist.get_world_size(), timeout=timeout, node=node, prefix=prefix)


def default_coordinator(
    rank: int | None = None,
    world_size: int | None = None,
    *,
    timeout: float | None = None,
    node: int | None = None,
    readonly: bool = False,
) -> Coordinator:
    """The coordinator of a hierarchy given none: a :func:`distributed_coordinator` when torch.distributed
    is initialized with more than one rank (and ``rank`` / ``world_size``, if given, are its), else a
    :class:`SoloCoordinator` (every rank alone).

    Where no process group is initialized and no ``world_size`` is given, in a process that a launcher
    started as one of several (:func:`~tierckpt.configvalues.launched`: ``$WORLD_SIZE``,
    ``$OMPI_COMM_WORLD_SIZE``, ``$PMI_SIZE``, ...): a writable hierarchy is refused (every rank would take
    itself for rank 0 of 1 and save into rank 0's place); a read-only one, which needs no coordination,
    is the launcher's rank of its ranks (``$RANK``, ``$OMPI_COMM_WORLD_RANK``, ``$PMI_RANK``, ...), so each
    process reads its own part.

    Raises:
        ConfigError: that refusal, naming the variable and the ways out; a read-only hierarchy whose
            launcher says how many ranks the job has but not which one this is; a bad rank, world size,
            node or timeout.
        CoordinationError: some rank did not build its coordinator in time.
    """
    dr, dw = dist_rank()
    if dw > 1 and rank in (None, dr) and world_size in (None, dw):
        return distributed_coordinator(timeout=timeout, node=node)
    if timeout is not None:
        check_timeout(timeout, "timeout")
    launch = None if world_size is not None or _process_group() else launched()
    if launch is not None and launch.size > 1:
        if not readonly:
            raise ConfigError(_refusal(launch))
        rank, world_size = launched_rank(launch) if rank is None else rank, launch.size
    return SoloCoordinator(rank, world_size, node=node)


def _refusal(launch: Launch) -> str:
    """Why a writable hierarchy of one of the processes of ``launch`` with no process group is refused."""
    var, n = launch.size_var, launch.size
    return (
        f"${var} is {n}: this process is one of the {n} ranks of a job, but torch.distributed is not "
        "initialized, so it would save as rank 0 of 1, into the place of every other rank's rank 0 (one "
        "rank's checkpoints lost). Call torch.distributed.init_process_group() before building the "
        "hierarchy, or pass coordinator=StoreCoordinator(store, rank, world_size) on a store every rank "
        "reaches; a process that saves alone passes world_size=1 (or coordinator=SoloCoordinator()); "
        "reading needs none (readonly=True)"
    )


def _process_group() -> bool:
    """Whether torch.distributed's default process group is initialized (of any size)."""
    try:
        import torch.distributed as dist

        return bool(dist.is_available() and dist.is_initialized())
    except Exception:  # pragma: no cover - a broken torch.distributed is not a process group
        return False


def shared_job(coordinator: Coordinator, job: str | None) -> str | None:
    """The job identity every rank leases its tiers for: ``job`` (or the environment's) where every rank
    has one, else rank 0's own (docs/jobs.md, "Many ranks"); one all-gather when the job has several
    ranks and a coordinator that connects them.

    Raises:
        ConfigError: a bad identity, or ranks that resolve different identities from ``job=`` or their
            environments.
        CoordinationError: some rank did not take part in time.
    """
    if coordinator.world_size == 1 or not coordinator.connects_ranks:
        return job
    mine = resolve_job(job)
    explicit = None if mine.source == "process" else mine.value
    got = coordinator.all_gather([explicit, mine.value])
    named: dict[str, int] = {e: r for r, (e, _) in reversed(list(enumerate(got))) if e is not None}
    if len(named) > 1:
        two = sorted(named.items(), key=lambda item: item[1])[:2]
        raise ConfigError(
            f"job: the ranks of this job resolve different job identities: rank {two[0][1]} {two[0][0]!r}, "
            f"rank {two[1][1]} {two[1][0]!r} (give every rank the same job= or $TIERCKPT_JOB)"
        )
    agreed = next(iter(named)) if named else str(got[0][1])
    return job if agreed == mine.value else agreed
