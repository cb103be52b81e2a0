"""Compression per tier: tensor kinds and the adaptive decision (the ``compress:`` setting itself:
:mod:`tierckpt.policies.compressconfig`). Pure: no I/O,
no threads (one lock: an :class:`Adaptive` is shared by every copy written to its tier).

What a frame is and how it is stored (raw, one zstd stream, or byte planes each zstd or raw) is the
format's (docs/format.md, :mod:`tierckpt.format.codec`); this module only decides, for each frame a
writer is about to encode, a :class:`FramePlan`: the width to split it by and the planes to try.

**Kinds.** A frame's kind is that of the tensor holding most of its bytes (:func:`frame_kinds`): the
dtype and the role its key path names (Adam's ``exp_avg`` and ``exp_avg_sq``, SGD's
``momentum_buffer``, else ``weight``). Elements of 2, 4 or 8 bytes, floating-point or integer, are split
into that many byte planes (complex numbers by their component's size); one-byte elements (bool,
uint8, int8, fp8) are one stream. Integers are grouped too because it pays: a buffer of int64 token
ids compressed 30× grouped against 10× as one zstd stream (docs/benchmarks.md). Statistics are kept per kind, and per plane within a kind, so a plane that does not gain
(the low mantissa bytes) is left raw while the exponent plane is compressed.

**The decision** (``auto``). With ``T`` compressor threads, a kind's measured per-thread speed ``s``
(raw bytes a second, with the planes it compresses: each plane's compression is timed apart, an
exponent plane taking several times a noisy mantissa plane's time, plus the split into planes) and ratio ``r`` (raw / stored bytes), and the
tier's write throughput ``bw`` (stored bytes a second: the smaller of the tier's measured busy-time
throughput and the bandwidth budget that paces the writer asking, if one does), a raw byte costs
``1/bw`` stored as it is, and ``max(1/(T*s), 1/(r*bw))`` compressed (compressing and writing overlap,
so the slower of the two sets the pace), unless the CPUs are the limit: with ``C`` CPUs and writing
costing ``k`` CPU seconds a stored byte (measured: the client's work, a FUSE daemon's, servers' on the
same machine, and whatever else runs on those CPUs meanwhile), a raw byte takes ``(1/s + k/r)/C`` of
all of them. The kind is compressed iff the largest of the three is below ``(1 - margin)/bw``
(``margin`` 5 %): the transfer must get shorter by more than the measurements' noise. So a kind that
gains nothing (``r`` ≈ 1) is never compressed, nor anything on a tier faster than ``T*s``, nor on one
whose writes already keep the CPUs busy.

**Budgets are per writer.** A budget bounds what one writer is paced at, not the tier: a background
demotion paced at 200 MB/s and a blocking save at full speed may write to one tier at once. So each
writer passes its own to :meth:`Adaptive.plan`, nothing of it is kept here, and the tier's measured
throughput excludes the time writes wait for a budget (it measures the tier, not a writer's pace).

**Measurements.** Speeds and ratios are exponentially weighted averages over the frames the writer
reports back (:meth:`Adaptive.observe_frame`); the tier's throughput likewise
(:meth:`Adaptive.observe_tier`), and the CPU time the tier's writes take (:meth:`Adaptive.observe_cpu`). To keep them fresh whatever was decided, the first
:data:`PROBE_FIRST` frames of each kind are *probes*, and then one in :data:`PROBE_EVERY`: a probe
tries every plane. Until a kind has been measured its frames are probes too. Under ``auto``, a probe of
a kind that is not compressed (not measured yet, or not paying) compresses only the first
:data:`SAMPLE_BYTES` of the frame, to measure them, and the frame is stored raw: so a fast tier pays a
sixteenth of a frame's compression per probe, and a copy ``auto`` decides not to compress stays a plain
copy. Until the tier's throughput is known (measured by the writer after its first writes, or bounded
by the writer's budget), and, where the CPUs are counted (``cpus``), what its writes cost them, ``auto``
stores frames raw.

**Across processes.** :meth:`Adaptive.export` gives the measurements as plain data and
:meth:`Adaptive.start_from` takes them (checked, :mod:`tierckpt.policies.kindstats`): a new process
starts from what the last one measured of the same tier (:mod:`tierckpt.datapath.measured` keeps them),
decides from them at once (its kinds need no first probes; a copy in which nothing pays is plain from
the first), and keeps measuring as above, so measurements gone stale correct themselves.

``zstd`` compresses every frame, leaving raw the planes that never gain (except on probes, which try
them again); ``none`` stores every frame raw.
"""

from __future__ import annotations

import re
import threading
from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from tierckpt.policies.compressconfig import CompressConfig
from tierckpt.policies.kindstats import EWMA_WEIGHT, GAIN, STATE_VERSION, FrameStats, KindStats, ewma, parse_state

if TYPE_CHECKING:
    from tierckpt.format.table import TensorTable

__all__ = [
    "EWMA_WEIGHT",
    "GAIN",
    "MARGIN",
    "OTHER",
    "PROBE_EVERY",
    "PROBE_FIRST",
    "RAW",
    "RECHECK_COPIES",
    "SAMPLE_BYTES",
    "Adaptive",
    "FramePlan",
    "FrameStats",
    "Kind",
    "frame_kinds",
    "kind_of",
    "pays",
]

#: the transfer must get shorter by this fraction for ``auto`` to compress
MARGIN = 0.05
#: the first frames of each kind that are probes, and then one in this many
PROBE_FIRST = 4
#: the bytes of a frame ``auto`` compresses only to measure them, while the frame itself is stored raw
SAMPLE_BYTES = 256 << 10
PROBE_EVERY = 32
#: under ``auto``, once the measurements say no kind of a copy pays, the copies after it are written plain
#: (as ``none`` writes them), but one in this many goes through the codec writer to measure again
RECHECK_COPIES = 8


# -- kinds ----------------------------------------------------------------------------------------------
@dataclass(frozen=True)
class Kind:
    """What a frame holds, for statistics: ``float32/exp_avg_sq``, ``bfloat16/weight``, ``int64``.

    Attributes:
        name: dtype, and for floating-point data the role (``weight``, ``exp_avg``, ``exp_avg_sq``,
            ``momentum_buffer``).
        width: bytes per element to split the frame by (2, 4, 8), or 1: one stream.
    """

    name: str
    width: int


OTHER = Kind("other", 1)
_ROLE_RE = re.compile(r"(?:^|[.\[/'])(exp_avg_sq|exp_avg|momentum_buffer)'?\]?$")


def kind_of(dtype: str, path: str) -> Kind:
    """The kind of a tensor of manifest dtype ``dtype`` at key path ``path`` (``state['optim']…['exp_avg']``,
    or a dotted DCP key); an unknown dtype is :data:`OTHER`."""
    from tierckpt.format.table import DTYPES  # torch: not imported with the config

    dt = DTYPES.get(dtype)
    if dt is None:
        return OTHER
    item = dt.itemsize // 2 if dt.is_complex else dt.itemsize  # a complex number: two floats
    width = item if item in (2, 4, 8) else 1
    if not (dt.is_floating_point or dt.is_complex):
        return Kind(dtype, width)
    m = _ROLE_RE.search(path)
    return Kind(f"{dtype}/{m.group(1) if m else 'weight'}", width)


def frame_kinds(blob_sizes: Sequence[int], table: TensorTable, frame_bytes: int) -> list[list[Kind]]:
    """Each frame's kind, per blob: the kind of the tensor holding most of the frame's bytes (ties: the
    first), :data:`OTHER` where bytes of no tensor (padding, gaps) are the most.

    Args:
        blob_sizes: raw size of each blob.
        table: the manifest's tensor table (its extents lie inside the blobs).
        frame_bytes: F; frame ``k`` of a blob is raw bytes ``[k*F, (k+1)*F)``.
    """
    if frame_bytes <= 0:
        raise ValueError(f"frame_bytes: expected a positive size, got {frame_bytes}")
    cover: list[list[dict[Kind, int]]] = [[{} for _ in range(-(-n // frame_bytes))] for n in blob_sizes]
    cache: dict[tuple[str, str], Kind] = {}
    for i in table.order():
        blob, lo, n = table.blobs[i], table.offsets[i], table.lengths[i]
        frames = cover[blob]
        kind = cache.get((table.dtypes[i], table.paths[i]))
        if kind is None:
            kind = cache[table.dtypes[i], table.paths[i]] = kind_of(table.dtypes[i], table.paths[i])
        hi = lo + n
        for k in range(lo // frame_bytes, -(-hi // frame_bytes)):
            part = min(hi, (k + 1) * frame_bytes) - max(lo, k * frame_bytes)
            frames[k][kind] = frames[k].get(kind, 0) + part
    out: list[list[Kind]] = []
    for size, frames in zip(blob_sizes, cover):
        kinds = []
        for k, held in enumerate(frames):
            gap = min(size, (k + 1) * frame_bytes) - k * frame_bytes - sum(held.values())
            best = max(held.items(), key=lambda kv: kv[1], default=(OTHER, 0))
            kinds.append(best[0] if best[1] >= gap else OTHER)
        out.append(kinds)
    return out


# -- the decision ---------------------------------------------------------------------------------------
@dataclass(frozen=True)
class FramePlan:
    """How to encode one frame.

    Attributes:
        width: 0 (store raw), 1 (one zstd stream) or the plane width (2, 4, 8).
        try_planes: bit ``p`` set: try compressing plane ``p`` (width 1: bit 0).
        probe: every plane is tried to measure them (report the result to :meth:`Adaptive.observe_frame`).
        sample: a frame stored raw (``width`` 0) whose first ``sample`` bytes are compressed as ``measure``
            says only to measure them (the result is reported, then dropped): how ``auto`` keeps a kind it
            does not compress measured at a fraction of a frame's cost. 0: no sample.
        measure: the plan the sample is encoded with (every plane of the kind tried).
    """

    width: int
    try_planes: int
    probe: bool = False
    sample: int = 0
    measure: FramePlan | None = None


RAW = FramePlan(0, 0)


def pays(
    speed: float,
    ratio: float,
    threads: int,
    bw: float,
    margin: float = MARGIN,
    *,
    cpus: int | None = None,
    io_cpu: float = 0.0,
) -> bool:
    """Whether compressing at ``speed`` raw B/s a thread, ``ratio`` raw/stored, on ``threads`` threads,
    makes writing to a tier of ``bw`` stored B/s shorter by more than ``margin``:
    ``max(1/(threads*speed), 1/(ratio*bw), (1/speed + io_cpu/ratio)/cpus) < (1 - margin)/bw``, where
    ``io_cpu`` is the CPU seconds writing a stored byte costs and ``cpus`` the CPUs there are (None:
    unknown, the last term left out)."""
    t = max(1.0 / (threads * speed), 1.0 / (ratio * bw))
    if cpus is not None:
        t = max(t, (1.0 / speed + io_cpu / ratio) / cpus)
    return t < (1.0 - margin) / bw


def _check_budget(budget: float | None) -> None:
    if budget is not None and (isinstance(budget, bool) or not budget > 0):
        raise ValueError(f"budget: expected a positive number of bytes a second or None, got {budget!r}")


class Adaptive:
    """The compression decisions for one tier, kept up to date from what its writers measure.

    One per tier and process, shared by every copy written to that tier; thread-safe. The writer asks
    :meth:`plan` for each frame (with its own budget: what one writer is paced at is no property of
    the tier, so nothing of it is kept here), encodes it as planned (in its compressor pool), reports
    the result to :meth:`observe_frame`, and reports what the tier took to :meth:`observe_tier`.

    Args:
        cfg: the tier's setting.
        threads: the compressor threads the writer runs (``T`` of the model).
        cpus: the CPUs the process may run on (``C``), where what the tier's writes cost them is measured
            (:meth:`observe_cpu`; nothing is compressed before it is); None: not measured, the CPU
            term left out.
    """

    def __init__(self, cfg: CompressConfig, threads: int, cpus: int | None = None) -> None:
        if threads < 1:
            raise ValueError(f"threads: expected at least 1, got {threads}")
        if cpus is not None and cpus < 1:
            raise ValueError(f"cpus: expected at least 1 or None, got {cpus}")
        self.cfg, self.threads, self.cpus = cfg, threads, cpus
        self._cpu_secs: float | None = None  # running averages of what observe_cpu reports
        self._cpu_bytes: float | None = None
        self._lock = threading.Lock()
        self._kinds: dict[Kind, KindStats] = {}
        self._tier_bytes: float | None = None  # running averages of what observe_tier reports
        self._tier_secs: float | None = None
        self._plain_copies = 0  # copies written plain in a row, their kinds measured as not paying
        self._written = [0, 0]  # stored bytes the codec writers wrote from the caller's memory, and copied
        self._revision = 0  # measurements taken (each observe_* that learnt something)
        self._started_from = False  # whether it started from plain data (start_from)

    @property
    def level(self) -> int:
        """The zstd level to encode with."""
        return self.cfg.level

    def plan(self, kind: Kind, budget: float | None = None) -> FramePlan:
        """How to encode the next frame of ``kind``, for a writer paced at ``budget`` stored bytes a second
        (the tier's bandwidth budget where it paces that writer; None: unpaced): the throughput the
        decision assumes is at most that.

        Raises:
            ValueError: a budget that is not a positive number.
        """
        _check_budget(budget)
        if self.cfg.mode == "none":
            return RAW
        with self._lock:
            st = self._stats(kind)
            st.frames += 1
            everything = (1 << st.planes) - 1
            bw = self._bandwidth(budget)
            first = st.frames <= PROBE_FIRST and not st.loaded  # a kind started from plain data: no first probes
            probe = first or st.frames % PROBE_EVERY == 0 or not st.measured()
            mask = self._decide(st, bw) if st.measured() else 0
            if probe:
                st.probes += 1
                full = FramePlan(kind.width, everything, True)
                if self.cfg.mode == "auto" and not mask:  # not compressed (yet): measured on a sample
                    return FramePlan(0, 0, True, SAMPLE_BYTES, full)
                return full
            return FramePlan(kind.width, mask) if mask else RAW

    def encode_copy(self, kinds: Iterable[Kind], budget: float | None = None) -> bool:
        """Whether a copy whose frames are of ``kinds``, by a writer paced at ``budget``, goes through the
        codec writer: always under ``zstd``; under ``auto`` unless every kind was measured, the tier's
        throughput (and, where counted, its CPU cost) is known, and no kind pays, in which case the
        copy is written plain, as ``none`` writes it (no frame is planned or sampled), except one in
        :data:`RECHECK_COPIES`, which measures again. Never under ``none``.

        Raises:
            ValueError: a budget that is not a positive number.
        """
        _check_budget(budget)
        if self.cfg.mode != "auto":
            return self.cfg.mode == "zstd"
        with self._lock:
            bw = self._bandwidth(budget)
            known = bw is not None and (self.cpus is None or self._io_cpu() is not None)
            stats = [self._kinds.get(k) for k in set(kinds)]
            if not known or any(st is None or not st.measured() for st in stats):
                self._plain_copies = 0
                return True
            if any(self._decide(st, bw) for st in stats if st is not None):
                self._plain_copies = 0
                return True
            self._plain_copies += 1
            if self._plain_copies >= RECHECK_COPIES:
                self._plain_copies = 0
                return True
            return False

    def _decide(self, st: KindStats, bw: float | None) -> int:
        """The planes to compress in a frame that is no probe (0: store it raw)."""
        mask = st.gaining()
        if mask and self.cfg.mode == "auto" and (bw is None or not self._pays(*st.model(mask), bw)):
            return 0
        return mask

    def _pays(self, speed: float, ratio: float, bw: float) -> bool:
        io_cpu = self._io_cpu()
        if self.cpus is not None and io_cpu is None:  # not known yet what the writes cost the CPUs
            return False
        return pays(speed, ratio, self.threads, bw, cpus=self.cpus, io_cpu=io_cpu or 0.0)

    def _io_cpu(self) -> float | None:
        return self._cpu_secs / self._cpu_bytes if self._cpu_secs is not None and self._cpu_bytes else None

    def observe_frame(self, kind: Kind, enc: FrameStats, plan: FramePlan | None = None) -> None:
        """Learn from an encoded frame of ``kind``: the compressor's time, and each tried plane's ratio.

        Args:
            kind: the frame's kind, as given to :meth:`plan`.
            enc: the encoded frame (its seconds and per-plane raw and stored bytes).
            plan: the plan it was encoded with: which planes were tried. Without it every plane
                counts as tried (a plane left raw as not gaining).
        """
        if self.cfg.mode == "none" or (plan is not None and not (plan.width and plan.try_planes)):
            return  # nothing was tried
        with self._lock:
            st = self._stats(kind)
            tried = (1 << st.planes) - 1 if plan is None else plan.try_planes
            raw, stored = enc.plane_raw, enc.plane_stored
            if len(raw) == st.planes and len(stored) == st.planes:
                for p in range(st.planes):
                    if tried >> p & 1 and raw[p] > 0:
                        st.fraction[p] = ewma(st.fraction[p], min(1.0, stored[p] / raw[p]))
                nbytes = sum(raw[p] for p in range(st.planes) if tried >> p & 1)
                st.observe_planes(enc, tried)
            else:  # tried otherwise (a frame whose length is no multiple of the width): its time only
                nbytes = sum(raw)
            if nbytes > 0 and enc.seconds > 0:
                st.cost = ewma(st.cost, enc.seconds / nbytes)
            st.observed += 1
            self._revision += 1

    def observe_tier(self, stored_bytes: int, busy_seconds: float) -> None:
        """Learn the tier's write throughput: ``stored_bytes`` written in ``busy_seconds`` of the tier
        being busy (writes in flight; not the time a write waited for a budget before it went)."""
        if stored_bytes <= 0 or not busy_seconds > 0:
            return
        with self._lock:
            self._tier_bytes = ewma(self._tier_bytes, float(stored_bytes))
            self._tier_secs = ewma(self._tier_secs, float(busy_seconds))
            self._revision += 1

    def observe_written(self, stored_bytes: int, *, copied: bool) -> None:
        """Count ``stored_bytes`` a codec writer wrote to the tier: from the caller's memory as they were
        (raw frames), or ``copied`` through an output chunk (for :meth:`snapshot`; no decision uses it)."""
        if stored_bytes > 0:
            with self._lock:
                self._written[copied] += stored_bytes

    def observe_cpu(self, cpu_seconds: float, stored_bytes: int) -> None:
        """Learn what writing to the tier costs the CPUs: ``cpu_seconds`` of CPU time (every process's on
        the CPUs this one may use, the codec threads' own left out) while ``stored_bytes`` were written."""
        if stored_bytes <= 0 or not cpu_seconds >= 0:
            return
        with self._lock:
            self._cpu_secs = ewma(self._cpu_secs, float(cpu_seconds))
            self._cpu_bytes = ewma(self._cpu_bytes, float(stored_bytes))
            self._revision += 1

    @property
    def revision(self) -> int:
        """How many measurements it has taken (grows with each one: what a keeper of them compares)."""
        with self._lock:
            return self._revision

    def export(self) -> dict[str, Any]:
        """Its measurements as plain data (:mod:`tierckpt.policies.kindstats`), for a later process to
        :meth:`start_from`: the running averages of the tier's throughput, of what its writes cost the
        CPUs, and of each kind measured; no counts, no decision."""
        with self._lock:
            tier = [self._tier_bytes, self._tier_secs] if self._tier_bytes and self._tier_secs else None
            cpu = [self._cpu_secs, self._cpu_bytes] if self._cpu_secs is not None and self._cpu_bytes else None
            kinds = [
                {"kind": k.name, "width": k.width, **st.export()} for k, st in self._kinds.items() if st.has_measured()
            ]
            return {"version": STATE_VERSION, "tier": tier, "cpu": cpu, "kinds": kinds}

    def start_from(self, data: object) -> None:
        """Take ``data`` (what :meth:`export` gave, maybe in another process) as its measurements so far:
        the decisions rest on them at once (a kind started from them needs no first probes), and later
        measurements update them as they would their own. Nothing is taken unless all of ``data`` is well
        formed (:func:`~tierckpt.policies.kindstats.parse_state`) and every kind it names is one
        :func:`kind_of` can return.

        Raises:
            ValueError: naming what is wrong with ``data``.
        """
        state = parse_state(data)
        kinds = {_known_kind(name, width): st for (name, width), st in state.kinds.items()}
        with self._lock:
            self._kinds.update(kinds)
            if state.tier is not None:
                self._tier_bytes, self._tier_secs = state.tier
            if state.cpu is not None:
                self._cpu_secs, self._cpu_bytes = state.cpu
            self._started_from = True

    def bandwidth(self, budget: float | None = None) -> float | None:
        """The write throughput the decisions of a writer paced at ``budget`` (None: unpaced) use, in
        stored B/s: the tier's measured one, at most ``budget``; None while neither is known."""
        _check_budget(budget)
        with self._lock:
            return self._bandwidth(budget)

    def _bandwidth(self, budget: float | None) -> float | None:
        measured = self._tier_bytes / self._tier_secs if self._tier_bytes and self._tier_secs else None
        if measured is None or budget is None:
            return measured if measured is not None else budget
        return min(measured, budget)

    def _stats(self, kind: Kind) -> KindStats:
        st = self._kinds.get(kind)
        if st is None:
            st = self._kinds[kind] = KindStats(max(1, kind.width))
        return st

    def snapshot(self, budget: float | None = None) -> dict[str, Any]:
        """What the decisions of a writer paced at ``budget`` (None: unpaced) rest on, for ``tierckpt
        inspect``, benchmarks and logs (plain values)."""
        _check_budget(budget)
        with self._lock:
            bw = self._bandwidth(budget)
            kinds = {}
            for kind, st in self._kinds.items():
                mask = self._decide(st, bw) if st.measured() and self.cfg.mode != "none" else 0
                speed, ratio = st.model(st.gaining()) if st.measured() else (None, None)
                kinds[kind.name] = {
                    "width": kind.width,
                    "frames": st.frames,
                    "probes": st.probes,
                    "observed": st.observed,
                    "speed_bytes_per_sec": speed,
                    "ratio": ratio,
                    "plane_fraction": list(st.fraction),
                    "planes": mask,  # compressed in frames that are no probes (0: stored raw)
                }
            return {
                "mode": self.cfg.mode,
                "level": self.cfg.level,
                "threads": self.threads,
                "cpus": self.cpus,
                "io_cpu_seconds_per_byte": self._io_cpu(),
                "bandwidth_bytes_per_sec": bw,
                "budget_bytes_per_sec": budget,
                "kinds": kinds,
                "written_from_memory_bytes": self._written[False],
                "written_copied_bytes": self._written[True],
                "started_from_saved": self._started_from,  # began from an earlier process's measurements
            }


def _known_kind(name: str, width: int) -> Kind:
    """The kind named ``name`` of ``width``, if :func:`kind_of` can return it (else ValueError)."""
    dtype, _, role = name.partition("/")
    kind = OTHER if name == OTHER.name else kind_of(dtype, "" if role == "weight" else f"state['{role}']")
    if kind != Kind(name, width):
        raise ValueError(f"kinds: {name!r} of width {width} is not a kind of this version")
    return kind
