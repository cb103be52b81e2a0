"""What ``auto`` measured of one tensor kind (:class:`KindStats`), and every measurement of a tier as plain
data: what :meth:`~tierckpt.policies.compression.Adaptive.export` gives and
:meth:`~tierckpt.policies.compression.Adaptive.start_from` takes (a later process starts from what the
last one measured; the file is :mod:`tierckpt.datapath.measured`'s). Pure: no I/O.

**Plain data** (version :data:`STATE_VERSION`): a mapping ``{"version": 1, "tier": [bytes, seconds] or
null, "cpu": [seconds, bytes] or null, "kinds": [...]}``, the running averages of what
:meth:`~tierckpt.policies.compression.Adaptive.observe_tier` and ``observe_cpu`` were told, and per kind
``{"kind": name, "width": w, "cost", "split", "fraction": [per plane], "plane_cost": [per plane]}`` (each
number or null: not measured). :func:`parse_state` takes nothing on trust: every number must be finite
and inside the bounds a real measurement can have (:data:`_BOUNDS`), every list the kind's length, and
the whole at most :data:`MAX_KINDS` kinds, or it raises naming what is wrong.
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any, Protocol

__all__ = [
    "EWMA_WEIGHT",
    "GAIN",
    "MAX_KINDS",
    "STATE_VERSION",
    "FrameStats",
    "KindStats",
    "State",
    "ewma",
    "parse_state",
]

#: a plane is worth compressing when its stream is below this fraction of its raw bytes: the codec's
#: ``PLANE_GAIN``, not imported so that the config does not import numpy and zstd (a test checks they agree)
GAIN = 0.97
#: weight of the newest measurement in the running averages
EWMA_WEIGHT = 0.25
#: the version of the plain data this module writes and reads (a newer one is refused)
STATE_VERSION = 1
#: the most kinds plain data may hold (there are a few dozen dtypes and four roles)
MAX_KINDS = 256
#: what a measurement can be: (least, most, whether the least itself is allowed)
_BOUNDS: dict[str, tuple[float, float, bool]] = {
    "cost": (0.0, 1.0, False),  # seconds per raw byte: at most a second a byte
    "split": (0.0, 1.0, True),
    "plane_cost": (0.0, 1.0, True),
    "fraction": (0.0, 1.0, False),  # stored / raw of a plane
    "tier_bytes": (0.0, float(1 << 50), False),  # one report's stored bytes: at most a PiB
    "tier_seconds": (0.0, 1e6, False),
    "cpu_seconds": (0.0, 1e9, True),
    "cpu_bytes": (0.0, float(1 << 50), False),
}


def ewma(old: float | None, new: float) -> float:
    """The running average ``old`` moved toward ``new`` by :data:`EWMA_WEIGHT` (``new`` where there is none)."""
    return new if old is None else old + EWMA_WEIGHT * (new - old)


class FrameStats(Protocol):
    """What :meth:`~tierckpt.policies.compression.Adaptive.observe_frame` reads of an encoded frame
    (:class:`tierckpt.format.codec.Encoded`): its encoding time, and per plane tried (one entry where the
    frame was tried whole) the raw bytes, the zstd stream's length, kept or not (a plane not tried: its raw
    bytes), and the seconds its compression took (empty where not told apart: the time is then shared out
    evenly over the planes tried)."""

    @property
    def seconds(self) -> float: ...
    @property
    def plane_raw(self) -> tuple[int, ...]: ...
    @property
    def plane_stored(self) -> tuple[int, ...]: ...
    @property
    def plane_seconds(self) -> tuple[float, ...]: ...


@dataclass
class KindStats:
    """The running measurements of one kind, and the counts of its frames (``loaded``: its measurements
    came from plain data, so its first frames need no probes to start)."""

    planes: int
    frames: int = 0  # plans handed out
    probes: int = 0
    observed: int = 0
    cost: float | None = None  # seconds per raw byte of the planes tried
    fraction: list[float | None] = field(default_factory=list)  # per plane: stored / raw when compressed
    split: float | None = None  # seconds per raw byte of the frame outside the planes' compression
    plane_cost: list[float | None] = field(default_factory=list)  # per plane: seconds per byte compressed
    loaded: bool = False

    def __post_init__(self) -> None:
        self.fraction = self.fraction or [None] * self.planes
        self.plane_cost = self.plane_cost or [None] * self.planes

    def measured(self) -> bool:
        return self.cost is not None and None not in self.fraction

    def gaining(self) -> int:
        """The planes whose streams were smaller than ``GAIN`` of their raw bytes."""
        return sum(1 << p for p, f in enumerate(self.fraction) if f is not None and f < GAIN)

    def model(self, mask: int) -> tuple[float, float]:
        """``(speed, ratio)`` of a frame compressed with the planes of ``mask``: raw B/s a thread, raw/stored."""
        share = 1.0 / self.planes
        tried = sum(share for p in range(self.planes) if mask >> p & 1)
        stored = sum(share * (f if mask >> p & 1 and f is not None else 1.0) for p, f in enumerate(self.fraction))
        costs = [c for p, c in enumerate(self.plane_cost) if mask >> p & 1]
        if self.split is not None and None not in costs:  # each plane's own cost, and the split's
            cost = self.split + share * sum(c for c in costs if c is not None)
        else:  # the planes told apart by no encoder: each tried plane costs the same
            cost = (self.cost or 0.0) * tried
        return (1.0 / cost if cost > 0 else math.inf), (1.0 / stored if stored > 0 else math.inf)

    def observe_planes(self, enc: FrameStats, tried: int) -> None:
        """Each tried plane's compression cost, and the frame's own (the split), where ``enc`` tells them."""
        secs, raw = enc.plane_seconds, enc.plane_raw
        total = sum(raw)
        if len(secs) != self.planes or total <= 0 or not enc.seconds > 0:
            return
        for p in range(self.planes):
            if tried >> p & 1 and raw[p] > 0:
                self.plane_cost[p] = ewma(self.plane_cost[p], secs[p] / raw[p])
        self.split = ewma(self.split, max(0.0, enc.seconds - sum(secs)) / total)

    def has_measured(self) -> bool:
        """Whether anything of the kind was measured (worth keeping)."""
        return self.cost is not None or any(f is not None for f in self.fraction)

    def export(self) -> dict[str, Any]:
        """The measurements as plain data (the counts are this process's, not kept)."""
        return {
            "cost": self.cost,
            "split": self.split,
            "fraction": list(self.fraction),
            "plane_cost": list(self.plane_cost),
        }


@dataclass(frozen=True)
class State:
    """Plain data checked by :func:`parse_state`: each kind's ``(name, width)`` and measurements, and the
    tier's running averages (None: not measured)."""

    kinds: dict[tuple[str, int], KindStats]
    tier: tuple[float, float] | None  # stored bytes, busy seconds
    cpu: tuple[float, float] | None  # CPU seconds, stored bytes


def _number(v: object, what: str, *, optional: bool = True) -> float | None:
    """``v`` as a measurement named ``what`` (a key of :data:`_BOUNDS`), checked against its bounds."""
    if v is None and optional:
        return None
    if isinstance(v, bool) or not isinstance(v, (int, float)):
        raise ValueError(f"{what}: expected a number, got {type(v).__name__}")
    x = float(v)
    lo, hi, lo_ok = _BOUNDS[what]
    if not (math.isfinite(x) and (x >= lo if lo_ok else x > lo) and x <= hi):
        raise ValueError(f"{what}: {x!r} is outside {'[' if lo_ok else '('}{lo}, {hi}]")
    return x


def _pair(v: object, what: tuple[str, str]) -> tuple[float, float] | None:
    if v is None:
        return None
    if not isinstance(v, list) or len(v) != 2:
        raise ValueError(f"{what[0].split('_')[0]}: expected a pair of numbers or null")
    a, b = (_number(x, w, optional=False) for x, w in zip(v, what))
    assert a is not None and b is not None
    return a, b


def _kind(d: object) -> tuple[tuple[str, int], KindStats]:
    if not isinstance(d, Mapping) or set(d) != {"kind", "width", "cost", "split", "fraction", "plane_cost"}:
        raise ValueError("kinds: expected mappings of kind, width, cost, split, fraction, plane_cost")
    name, width = d["kind"], d["width"]
    if not isinstance(name, str) or not 0 < len(name) <= 64:
        raise ValueError(f"kind: expected a name, got {type(name).__name__}")
    if isinstance(width, bool) or width not in (1, 2, 4, 8):
        raise ValueError(f"{name}: width: expected 1, 2, 4 or 8, got {width!r}")
    planes = max(1, width)
    lists = []
    for key in ("fraction", "plane_cost"):
        v = d[key]
        if not isinstance(v, list) or len(v) != planes:
            raise ValueError(f"{name}: {key}: expected a list of {planes}")
        lists.append([_number(x, key) for x in v])
    st = KindStats(planes, cost=_number(d["cost"], "cost"), split=_number(d["split"], "split"), loaded=True)
    st.fraction, st.plane_cost = lists
    return (name, width), st


def parse_state(data: object) -> State:
    """Check plain data made by :meth:`~tierckpt.policies.compression.Adaptive.export` (of this version)
    and read it: nothing of it is used unless all of it is well formed.

    Raises:
        ValueError: naming what is wrong: not a mapping of the keys above, a newer (or unknown)
            version, more than :data:`MAX_KINDS` kinds or one twice, a list of the wrong length, a
            number that is no number, not finite, or out of its bounds.
    """
    if not isinstance(data, Mapping) or set(data) != {"version", "tier", "cpu", "kinds"}:
        raise ValueError("expected a mapping of version, tier, cpu and kinds")
    version = data["version"]
    if version != STATE_VERSION or isinstance(version, bool):
        raise ValueError(f"version: expected {STATE_VERSION}, got {version!r}")
    kinds_in = data["kinds"]
    if not isinstance(kinds_in, list) or len(kinds_in) > MAX_KINDS:
        raise ValueError(f"kinds: expected a list of at most {MAX_KINDS}")
    kinds: dict[tuple[str, int], KindStats] = {}
    for d in kinds_in:
        key, st = _kind(d)
        if key in kinds or any(name == key[0] for name, _ in kinds):
            raise ValueError(f"kinds: {key[0]} twice")
        kinds[key] = st
    tier = _pair(data["tier"], ("tier_bytes", "tier_seconds"))
    cpu = _pair(data["cpu"], ("cpu_seconds", "cpu_bytes"))
    return State(kinds, tier, cpu)
