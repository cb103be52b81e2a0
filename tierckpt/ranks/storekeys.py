"""What :class:`~tierckpt.ranks.distributed.StoreCoordinator` writes to the store: the names of a
call's keys, and its values and outcomes, msgpack-encoded (never pickled) and bounded in size."""

from __future__ import annotations

from typing import Any, NamedTuple

import msgpack

from tierckpt.errors import CoordinationError

__all__ = ["KeyNames", "Keys", "check_key", "decode", "encode", "failure", "parse_values"]

MAX_KEY_CHARS = 512


class Keys(NamedTuple):
    """The store keys of one call (``key``): see docs/distributed.md, "Coordination"."""

    key: str
    values: str  #: the other ranks' values, appended as frames ``[rank, ok, packed value or error]``
    counter: str  #: how many of the other ranks appended (``add``)
    full: str  #: set by the rank whose ``add`` made the count ``world_size - 1``
    claim: str  #: who publishes the outcome (``compare_set``): "0", or a rank that gave up on rank 0
    result: str  #: the outcome: ``{"ok": result}`` or ``{"err": message, "ranks": [...]}``
    read: str  #: how many of the other ranks read the outcome (the last one deletes it)

    def all(self) -> tuple[str, ...]:
        return self.values, self.counter, self.full, self.claim, self.result, self.read


class KeyNames:
    """The keys of the calls of one coordinator, under ``namespace`` (its prefix and generation)."""

    def __init__(self, namespace: str) -> None:
        self.namespace = namespace

    def of(self, key: str) -> Keys:
        base = f"{self.namespace}/{len(key)}:{key}/"  # the length keeps "a/v" + "/n" apart from "a" + "/v/n"
        return Keys(key, *(base + s for s in ("v", "n", "f", "c", "r", "d")))


def check_key(key: object) -> None:
    """A call's key: a non-empty string of at most :data:`MAX_KEY_CHARS` characters.

    Raises:
        TypeError: ``key`` is not a string.
        ValueError: it is empty, too long or holds a NUL.
    """
    if not isinstance(key, str):
        raise TypeError(f"coordination key: expected a str, got {type(key).__name__}")
    if not key or len(key) > MAX_KEY_CHARS or "\0" in key:
        raise ValueError(f"coordination key: expected 1 to {MAX_KEY_CHARS} characters without NUL, got {key[:80]!r}")


def encode(value: Any, limit: int, key: str) -> bytes:
    """``value`` msgpack-encoded (bytes stay bytes, str stays str, tuples become lists).

    Raises:
        CoordinationError: ``value`` is not plain data, or is larger than ``limit`` bytes packed.
    """
    try:
        out: bytes = msgpack.packb(value, use_bin_type=True)
    except (TypeError, ValueError, OverflowError) as e:
        raise CoordinationError(
            f"{key!r}: a value that is not plain data (None, bool, int, float, str, bytes, lists and dicts of "
            f"them) cannot be sent: {type(e).__name__}: {e}"
        ) from None
    if len(out) > limit:
        raise CoordinationError(f"{key!r}: a value of {len(out)} bytes (packed) is larger than the limit, {limit}")
    return out


def decode(payload: bytes) -> Any:
    """What :func:`encode` or :func:`failure` packed.

    Raises:
        CoordinationError: ``payload`` is not msgpack (something else wrote the store's key).
    """
    try:
        return msgpack.unpackb(payload, raw=False, strict_map_key=False)
    except (ValueError, TypeError, msgpack.UnpackException) as e:
        raise CoordinationError(f"a coordination key of the store holds what tierckpt did not write: {e}") from None


def failure(message: str, ranks: tuple[int, ...], by: int = 0) -> bytes:
    """The outcome of a failed call: ``message``, naming ``ranks``, published by rank ``by`` (not 0: a
    rank that gave up on rank 0)."""
    packed: bytes = msgpack.packb({"err": message, "ranks": list(ranks), "by": by})
    return packed


def parse_values(blob: bytes, world_size: int, key: str) -> tuple[dict[int, bytes], bytes | None]:
    """The other ranks' packed values from the frames they appended, and the failure to publish (None
    when every frame is a good value of a rank seen once)."""
    values: dict[int, bytes] = {}
    unpacker = msgpack.Unpacker(raw=False, max_buffer_size=max(len(blob), 1))
    unpacker.feed(blob)
    try:
        for frame in unpacker:
            if not (isinstance(frame, list) and len(frame) == 3 and type(frame[0]) is int):
                return values, failure(f"{key!r}: the store holds a value that tierckpt did not write", ())
            rank, ok, packed = frame
            if not 0 < rank < world_size:
                return values, failure(f"{key!r}: a value from rank {rank}, not a rank of {world_size}", ())
            if rank in values:
                return values, failure(f"{key!r}: rank {rank} sent two values (the key is not unique)", (rank,))
            if not ok:
                return values, failure(f"{key!r}: rank {rank}: {packed}", (rank,))
            values[rank] = packed
    except (ValueError, msgpack.UnpackException) as e:
        return values, failure(f"{key!r}: the store holds a value that tierckpt did not write: {e}", ())
    return values, None
