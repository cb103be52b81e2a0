"""A gather among the ranks of one node, through the job's store: what the per-node data file's one
exchange per save and node needs (docs/distributed.md, "A per-node data file").

Each rank of the node other than its first appends its value under the call's key and counts itself in;
the one that completes the count marks the key full. The node's first rank claims the key on arrival,
waits for that mark (at most the timeout), runs the decision on the values and publishes its outcome.
The others wait for it: the timeout and a grace, then, where the first rank claimed the key (it is
there, waiting for a rank or deciding), as long again; where it did not, they claim the key and publish
that it did not come, so that a first rank arriving later fails at once instead of deciding. A rank whose
part failed before the exchange (:meth:`NodeGather.fail`) tells the node at once: a failed value from
another rank, a failed outcome from the first. Every store call that fails is a CoordinationError naming
the call's key. The keys live under the coordinator's namespace and the node, so that calls of different
nodes never meet; what a call leaves (a failure's outcome, kept for ranks that arrive late, and their
values) is deleted by the node's first rank once it is :attr:`NodeGather.linger` seconds old.
"""

from __future__ import annotations

import threading
import time
from collections import deque
from collections.abc import Callable
from typing import Any, Protocol, TypeVar

import msgpack

from tierckpt.errors import CoordinationError
from tierckpt.ranks.storekeys import check_key, decode, encode, failure, parse_values

__all__ = ["NodeGather"]

T = TypeVar("T")
_KEEP = 1024  # the first rank remembers at most this many decided keys whose entries may linger
_FIRST = "first"  # the first rank's claim


class _Store(Protocol):
    """What a :class:`NodeGather` needs of its coordinator's store (a thread's clone of it)."""

    def append(self, key: str, value: bytes) -> None: ...
    def add(self, key: str, amount: int) -> int: ...
    def set(self, key: str, value: bytes) -> None: ...
    def get(self, key: str) -> bytes: ...
    def check(self, keys: list[str]) -> bool: ...
    def delete_key(self, key: str) -> bool: ...
    def compare_set(self, key: str, expected: str, desired: str) -> bytes: ...


def _grace(wait: float) -> float:
    """How much longer than the first rank the others wait, so that its report naming a missing rank
    reaches them before they give up on it."""
    return min(5.0, 0.5 + wait / 4)


class NodeGather:
    """The node-scoped gathers of one rank (see the module docstring).

    Args:
        namespace: where its keys live (the coordinator's namespace and this node).
        rank: this rank.
        on_node: the global ranks of this rank's node, ascending; the first decides.
        store: this thread's store client.
        wait: waits for the store: ``wait(store, key, secs)``, False on a timeout.
        max_bytes: the largest value a rank may send, packed.
        linger: seconds after which the first rank deletes what is left of a call's keys.
    """

    def __init__(
        self,
        namespace: str,
        rank: int,
        on_node: list[int],
        store: Callable[[], Any],
        wait: Callable[[Any, str, float], bool],
        max_bytes: int,
        linger: float,
    ) -> None:
        self.namespace, self.rank, self.on_node = namespace, rank, list(on_node)
        self._store: Callable[[], _Store] = store
        self._wait, self.max_bytes, self.linger = wait, max_bytes, linger
        self._decided: deque[tuple[float, str]] = deque()  # the first rank's calls: (when, key)
        self._lock = threading.Lock()

    def gather(self, key: str, value: Any, fn: Callable[[list[Any]], T], wait: float) -> T:
        """Every rank of the node sends ``value``; the node's first rank runs ``fn(values, in rank
        order)`` and every rank of the node returns its result (as msgpack decodes it).

        Raises:
            CoordinationError: a rank of the node did not arrive within ``wait`` seconds or failed before
                the exchange (``ranks`` names it), the first rank published nothing in time, ``fn`` raised
                on the first rank (on the first rank itself, ``fn``'s own exception is raised instead), or
                the store failed.
        """
        check_key(key)
        n = len(self.on_node)
        if n == 1:
            return decode(encode(fn([decode(encode(value, self.max_bytes, key))]), self.max_bytes * n, key))  # type: ignore[no-any-return]
        if self.rank == self.on_node[0]:
            return self._decide(key, value, fn, wait)
        return self._follow(key, value, wait)  # type: ignore[no-any-return]

    def fail(self, key: str, why: str) -> None:
        """This rank will not take part in the call ``key`` (its part failed before it): the node learns it
        at once, naming this rank and ``why``. Nothing where the call is decided already.

        Raises:
            CoordinationError: the store failed.
        """
        check_key(key)
        if len(self.on_node) == 1:
            return
        st, k = self._store(), self._keys(key)
        what = f"{key!r}: rank {self.rank} failed before the node's exchange: {why}"
        if self.rank == self.on_node[0]:
            self._sweep(st)
            if self._op(st.compare_set, k["c"], "", _FIRST, what=key) == _FIRST.encode():
                self._publish(st, key, k, failure(what, (self.rank,)))
            return
        if not self._op(st.check, [k["r"]], what=key):
            self._op(st.append, k["v"], msgpack.packb([self.rank, False, what]), what=key)
            self._op(st.add, k["n"], 1, what=key)
            self._op(st.set, k["f"], b"1", what=key)  # the first rank need not wait for the others

    # -- the store -----------------------------------------------------------------------------------------
    def _keys(self, key: str) -> dict[str, str]:
        base = f"{self.namespace}/{len(key)}:{key}/"
        return {s: base + s for s in ("v", "n", "f", "r", "d", "c")}

    def _op(self, fn: Callable[..., Any], *args: Any, what: str) -> Any:
        """One store call; a store that fails (e.g. its server is gone) is a CoordinationError."""
        try:
            return fn(*args)
        except Exception as e:
            raise CoordinationError(f"rank {self.rank}: {what!r} (node exchange): the store failed: {e}") from e

    def _delete(self, st: _Store, k: dict[str, str], *names: str, what: str) -> None:
        for name in names:
            self._op(st.delete_key, k[name], what=what)

    def _publish(self, st: _Store, key: str, k: dict[str, str], outcome: bytes) -> None:
        """The first rank's outcome of ``key``, its values deleted, the call remembered for the sweep."""
        self._op(st.set, k["r"], outcome, what=key)
        self._delete(st, k, "v", "n", "f", what=key)
        with self._lock:
            self._decided.append((time.monotonic(), key))

    def _sweep(self, st: _Store) -> None:
        """Delete what is left of calls decided :attr:`linger` seconds ago: a failure's outcome, the
        values of ranks that arrived after it, an outcome a rank that died never read."""
        due = []
        with self._lock:
            while self._decided and (
                time.monotonic() - self._decided[0][0] > self.linger or len(self._decided) > _KEEP
            ):
                due.append(self._decided.popleft()[1])
        for key in due:
            self._delete(st, self._keys(key), "v", "n", "f", "r", "d", "c", what=key)

    # -- the node's first rank -------------------------------------------------------------------------------
    def _decide(self, key: str, value: Any, fn: Callable[[list[Any]], T], wait: float) -> T:
        st, k, n = self._store(), self._keys(key), len(self.on_node)
        self._sweep(st)
        # claimed on arrival: a rank that times out meanwhile knows the first rank is here and waits on
        if self._op(st.compare_set, k["c"], "", _FIRST, what=key) != _FIRST.encode():
            with self._lock:
                self._decided.append((time.monotonic(), key))
            return self._outcome(st, key, k, wait)  # type: ignore[no-any-return]  # the others gave up on it
        own = encode(value, self.max_bytes, key)
        start = time.monotonic()
        self._wait(st, k["f"], wait)
        blob = self._op(st.get, k["v"], what=key) if self._op(st.check, [k["v"]], what=key) else b""
        values, problem = self._values(key, blob)
        if problem is None and len(values) < n - 1:
            missing = tuple(r for r in self.on_node[1:] if r not in values)
            problem = failure(
                f"{key!r}: rank(s) {', '.join(map(str, missing))} of the node did not arrive within "
                f"{time.monotonic() - start:.1f} s (rank {self.rank}, the node's first, waited)",
                missing,
            )
        if problem is not None:
            self._publish(st, key, k, problem)
            out = decode(problem)
            raise CoordinationError(out["err"], tuple(out["ranks"]))
        try:
            result = fn([decode(own), *(decode(values[r]) for r in self.on_node[1:])])
            payload = encode({"ok": result}, self.max_bytes * n, key)
        except BaseException as e:
            why = f"{key!r}: rank {self.rank}, the node's first, failed: {type(e).__name__}: {e}"
            self._publish(st, key, k, failure(why, (self.rank,)))
            raise
        self._publish(st, key, k, payload)
        return decode(payload)["ok"]  # type: ignore[no-any-return]

    def _values(self, key: str, blob: bytes) -> tuple[dict[int, bytes], bytes | None]:
        """The other ranks' values by global rank, or the failure to publish."""
        values, problem = parse_values(blob, max(self.on_node) + 1, key)
        strangers = [r for r in values if r not in self.on_node[1:]]
        if problem is None and strangers:
            problem = failure(f"{key!r}: values from rank(s) {strangers}, not of this node {self.on_node}", ())
        return values, problem

    # -- the other ranks ---------------------------------------------------------------------------------------
    def _follow(self, key: str, value: Any, wait: float) -> Any:
        st, k, n = self._store(), self._keys(key), len(self.on_node)
        if not self._op(st.check, [k["r"]], what=key):  # a failed call's outcome is there already
            try:
                frame = msgpack.packb([self.rank, True, encode(value, self.max_bytes, key)])
            except CoordinationError as e:
                frame = msgpack.packb([self.rank, False, str(e)])
            self._op(st.append, k["v"], frame, what=key)
            if self._op(st.add, k["n"], 1, what=key) == n - 1:
                self._op(st.set, k["f"], b"1", what=key)
            if not self._wait(st, k["r"], wait + _grace(wait)):
                self._give_up(st, key, k, wait)
        return self._outcome(st, key, k, 0.0)

    def _give_up(self, st: _Store, key: str, k: dict[str, str], wait: float) -> None:
        """The first rank published nothing in time: where it has not claimed the key, claim it and
        publish that it did not come; where it has (it waits for a rank, or creates the file), wait as
        long again for its outcome."""
        first, waited = self.on_node[0], wait + _grace(wait)
        won = self._op(st.compare_set, k["c"], "", str(self.rank), what=key)
        if won == str(self.rank).encode():
            gone = f"{key!r}: rank {first}, the node's first, did not arrive within {waited:.1f} s (rank {self.rank} waited)"
            self._op(st.set, k["r"], failure(gone, (first,), by=self.rank), what=key)
        elif not self._wait(st, k["r"], waited):
            raise CoordinationError(
                f"{key!r}: rank {first}, the node's first, arrived but published no outcome within "
                f"{2 * waited:.1f} s (rank {self.rank} waited)",
                (first,),
                undecided=True,
            )

    def _outcome(self, st: _Store, key: str, k: dict[str, str], wait: float) -> Any:
        """The published outcome of ``key`` (waiting up to ``wait`` for it): its result, or its failure
        raised; the last rank to read a success deletes the call's last keys."""
        if wait and not self._wait(st, k["r"], wait):
            raise CoordinationError(
                f"{key!r}: no outcome within {wait:g} s (rank {self.rank} waited)", (self.on_node[0],)
            )
        out = decode(self._op(st.get, k["r"], what=key))
        if "ok" in out:
            if self._op(st.add, k["d"], 1, what=key) == len(self.on_node) - 1:
                self._delete(st, k, "r", "d", "c", what=key)
            return out["ok"]
        raise CoordinationError(out["err"], tuple(out["ranks"]))
