"""A gather among the ranks of one node, through the job's store: what the per-node data file's one
exchange per save and node needs (docs/distributed.md, "A per-node data file").

Each rank of the node other than its first appends its value under the call's key and counts itself in;
the one that completes the count marks the key full; the node's first rank waits for that mark (at
most the timeout), runs the decision on the values and publishes its outcome, which the others wait
for (the timeout and a grace). A rank that does not arrive in time makes the first rank publish a
failure naming it; a first rank that publishes nothing in time makes the others fail naming it. The keys
live under the coordinator's namespace and the node, so that calls of different nodes never meet.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from typing import Any, Protocol, TypeVar

import msgpack

from tierckpt.errors import CoordinationError
from tierckpt.ranks.storekeys import check_key, decode, encode, failure, parse_values

__all__ = ["NodeGather"]

T = TypeVar("T")


class _Store(Protocol):
    """What a :class:`NodeGather` needs of its coordinator's store (a thread's clone of it)."""

    def append(self, key: str, value: bytes) -> None: ...
    def add(self, key: str, amount: int) -> int: ...
    def set(self, key: str, value: bytes) -> None: ...
    def get(self, key: str) -> bytes: ...
    def check(self, keys: list[str]) -> bool: ...
    def delete_key(self, key: str) -> bool: ...


class NodeGather:
    """The node-scoped gathers of one rank (see the module docstring).

    Args:
        namespace: where its keys live (the coordinator's namespace and this node).
        rank: this rank.
        on_node: the global ranks of this rank's node, ascending; the first decides.
        store: this thread's store client.
        wait: waits for the store: ``wait(store, key, secs)``, False on a timeout.
        max_bytes: the largest value a rank may send, packed.
    """

    def __init__(
        self,
        namespace: str,
        rank: int,
        on_node: list[int],
        store: Callable[[], Any],
        wait: Callable[[Any, str, float], bool],
        max_bytes: int,
    ) -> None:
        self.namespace, self.rank, self.on_node = namespace, rank, list(on_node)
        self._store: Callable[[], _Store] = store
        self._wait, self.max_bytes = wait, max_bytes

    def gather(self, key: str, value: Any, fn: Callable[[list[Any]], T], wait: float) -> T:
        """Every rank of the node sends ``value``; the node's first rank runs ``fn(values, in rank
        order)`` and every rank of the node returns its result (as msgpack decodes it).

        Raises:
            CoordinationError: a rank of the node did not arrive within ``wait`` seconds (``ranks`` names
                it), the first rank published nothing in time, or ``fn`` raised on the first rank (on
                the first rank itself, ``fn``'s own exception is raised instead).
        """
        check_key(key)
        n = len(self.on_node)
        if n == 1:
            return decode(encode(fn([decode(encode(value, self.max_bytes, key))]), self.max_bytes * n, key))  # type: ignore[no-any-return]
        base = f"{self.namespace}/{len(key)}:{key}/"
        k = {s: base + s for s in ("v", "n", "f", "r", "d")}
        if self.rank == self.on_node[0]:
            return self._decide(key, k, value, fn, wait)
        return self._follow(key, k, value, wait)  # type: ignore[no-any-return]

    def _decide(self, key: str, k: dict[str, str], value: Any, fn: Callable[[list[Any]], T], wait: float) -> T:
        st, n = self._store(), len(self.on_node)
        own = encode(value, self.max_bytes, key)
        start = time.monotonic()
        self._wait(st, k["f"], wait)
        blob = st.get(k["v"]) if st.check([k["v"]]) else b""
        values, problem = parse_values(blob, n, key)  # frames carry the rank's index on the node
        if problem is None and len(values) < n - 1:
            missing = tuple(r for i, r in enumerate(self.on_node) if i and i not in values)
            problem = failure(
                f"{key!r}: rank(s) {', '.join(map(str, missing))} of the node did not arrive within "
                f"{time.monotonic() - start:.1f} s (rank {self.rank}, the node's first, waited)",
                missing,
            )
        for name in ("v", "n", "f"):
            st.delete_key(k[name])
        if problem is not None:
            st.set(k["r"], problem)
            out = decode(problem)
            raise CoordinationError(out["err"], tuple(out["ranks"]))
        try:
            result = fn([decode(own), *(decode(values[i]) for i in range(1, n))])
            payload = encode({"ok": result}, self.max_bytes * n, key)
        except BaseException as e:
            st.set(k["r"], failure(f"{key!r}: rank {self.rank}, the node's first, failed: {type(e).__name__}: {e}", ()))
            raise
        st.set(k["r"], payload)
        return decode(payload)["ok"]  # type: ignore[no-any-return]

    def _follow(self, key: str, k: dict[str, str], value: Any, wait: float) -> Any:
        st, n = self._store(), len(self.on_node)
        first = self.on_node[0]
        if not st.check([k["r"]]):  # a failed call's outcome is there already
            try:
                frame = msgpack.packb([self.on_node.index(self.rank), True, encode(value, self.max_bytes, key)])
            except CoordinationError as e:
                frame = msgpack.packb([self.on_node.index(self.rank), False, str(e)])
            st.append(k["v"], frame)
            if st.add(k["n"], 1) == n - 1:
                st.set(k["f"], b"1")
            grace = min(5.0, 0.5 + wait / 4)  # the first rank's report of a missing rank comes first
            if not self._wait(st, k["r"], wait + grace):
                raise CoordinationError(
                    f"{key!r}: rank {first}, the node's first, published no outcome within {wait + grace:.1f} s "
                    f"(rank {self.rank} waited)",
                    (first,),
                )
        out = decode(st.get(k["r"]))
        if "ok" in out and st.add(k["d"], 1) == n - 1:  # the last reader of a success cleans up
            st.delete_key(k["r"])
            st.delete_key(k["d"])
        if "ok" in out:
            return out["ok"]
        raise CoordinationError(out["err"], tuple(out["ranks"]))
