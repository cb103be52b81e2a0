"""The compression policy (tierckpt.policies.compression): the ``compress:`` setting, frame kinds, and the
adaptive decision, driven by a deterministic compressor and a deterministic slow tier."""

from __future__ import annotations

import threading
from dataclasses import dataclass, field

import pytest

from tierckpt import ConfigError
from tierckpt.config import parse_config
from tierckpt.format.table import TensorTable
from tierckpt.policies.compressconfig import NONE, CompressConfig, default_compress, parse_compress, tier_compress
from tierckpt.policies.compression import (
    GAIN,
    OTHER,
    PROBE_EVERY,
    PROBE_FIRST,
    RAW,
    RECHECK_COPIES,
    SAMPLE_BYTES,
    Adaptive,
    FramePlan,
    Kind,
    frame_kinds,
    kind_of,
    pays,
)

F = 4 << 20  # frame bytes
FP32 = Kind("float32/weight", 4)
MB = 1e6


@dataclass
class Encoded:
    """What the codec returns, as far as the policy reads it."""

    width: int
    planes: int
    seconds: float
    plane_raw: tuple[int, ...]
    plane_stored: tuple[int, ...]
    streams: list[bytes] = field(default_factory=list)
    plane_seconds: tuple[float, ...] = ()


@dataclass
class Compressor:
    """A deterministic compressor: plane ``p`` of a kind shrinks to ``fractions[p]`` of its bytes, at
    ``speed`` raw bytes a second per plane byte tried."""

    fractions: tuple[float, ...]
    speed: float = 200 * MB

    def encode(self, plan: FramePlan, raw_len: int = F) -> Encoded:
        n = len(self.fractions)
        if plan.width == 0:
            return Encoded(0, 0, 0.0, (raw_len,), (raw_len,))
        plane = raw_len // n
        stored, mask, tried = [], 0, 0
        for p, f in enumerate(self.fractions):  # as the codec reports: a tried plane's zstd length, kept or not
            on = plan.try_planes >> p & 1
            stored.append(int(plane * f) if on else plane)
            mask |= (on and f < GAIN) << p
            tried += plane if on else 0
        return Encoded(plan.width if mask else 0, mask, tried / self.speed, (plane,) * n, tuple(stored))


def report(a: Adaptive, kind: Kind, comp: Compressor, plan: FramePlan) -> None:
    """Encode a frame as planned and report it, as the writer does: a sampled frame reports its sample
    (encoded as ``plan.measure`` says), a compressed one itself."""
    if plan.sample and plan.measure is not None:
        a.observe_frame(kind, comp.encode(plan.measure, plan.sample), plan.measure)
    if plan.width:
        a.observe_frame(kind, comp.encode(plan), plan)


def run(a: Adaptive, kind: Kind, comp: Compressor, frames: int, budget: float | None = None) -> list[FramePlan]:
    """Plan (for a writer paced at ``budget``), encode and report ``frames`` frames one after another."""
    plans = []
    for _ in range(frames):
        plan = a.plan(kind, budget)
        report(a, kind, comp, plan)
        plans.append(plan)
    return plans


def tried(plan: FramePlan) -> int:
    """The planes a plan tries (a sampled frame: its sample's)."""
    return (plan.measure or plan).try_planes


def steady(plans: list[FramePlan]) -> set[FramePlan]:
    """The plans of the frames that were no probes."""
    return {p for p in plans if not p.probe}


# fp32 weights: the mantissa's two low bytes do not gain, the third a little, the exponent's byte well
FP32_PLANES = (1.0, 0.99, 0.9, 0.3)


def slow_tier(a: Adaptive, rate: float) -> None:
    a.observe_tier(int(rate * 2), 2.0)  # 2 s of writes at ``rate``


# -- the model ------------------------------------------------------------------------------------------
def test_pays_is_the_pipeline_inequality() -> None:
    # ratio 1.25 at 400 MB/s a thread, 2 threads: 800 MB/s of compression, 1.25x fewer bytes
    assert pays(400 * MB, 1.25, 2, 100 * MB)  # tier-bound: 1/(1.25 bw) beats 1/bw
    assert not pays(400 * MB, 1.25, 2, 2000 * MB)  # compressor-bound: 1/(800 MB/s) is slower than 2 GB/s raw
    assert not pays(400 * MB, 1.0, 8, 1 * MB)  # no gain: never
    assert not pays(400 * MB, 1.04, 8, 1 * MB)  # a gain inside the margin: never
    assert pays(400 * MB, 1.06, 8, 1 * MB)


def test_a_tier_slower_than_the_compressor_gets_compressed_frames() -> None:
    a = Adaptive(CompressConfig("auto"), threads=2)
    slow_tier(a, 100 * MB)
    plans = run(a, FP32, Compressor(FP32_PLANES), 100)
    assert steady(plans) == {FramePlan(4, 0b1100)}  # the two planes that gain
    snap = a.snapshot()["kinds"]["float32/weight"]
    assert snap["ratio"] == pytest.approx(4 / (1 + 1 + 0.9 + 0.3), rel=1e-3)
    assert snap["speed_bytes_per_sec"] == pytest.approx(400 * MB, rel=1e-3)  # half the bytes are tried
    assert snap["planes"] == 0b1100


def test_a_tier_faster_than_the_compressor_gets_raw_frames() -> None:
    a = Adaptive(CompressConfig("auto"), threads=2)
    slow_tier(a, 2000 * MB)
    plans = run(a, FP32, Compressor(FP32_PLANES), 100)
    assert steady(plans) == {RAW}
    assert a.snapshot()["kinds"]["float32/weight"]["planes"] == 0


@dataclass
class PlaneTimed(Compressor):
    """A compressor that tells each plane's time apart: plane ``p`` takes ``plane_secs[p]`` seconds a
    raw byte of it, and the split into planes ``split`` seconds a raw byte of the frame."""

    plane_secs: tuple[float, ...] = ()
    split: float = 0.0
    timed: bool = True

    def encode(self, plan: FramePlan, raw_len: int = F) -> Encoded:
        e = super().encode(plan, raw_len)
        if plan.width == 0:
            return e
        per = [c * r if plan.try_planes >> p & 1 else 0.0 for p, (c, r) in enumerate(zip(self.plane_secs, e.plane_raw))]
        e.seconds = self.split * raw_len + sum(per)
        e.plane_seconds = tuple(per) if self.timed else ()
        return e


@pytest.mark.parametrize("timed", [True, False])
def test_each_plane_costs_its_own_time(timed: bool) -> None:
    # the exponent plane takes 20x a mantissa plane's time: compressing it alone is about as slow as
    # compressing every plane, not four times faster (what sharing the time out evenly would assume)
    comp = PlaneTimed((1.0, 1.0, 1.0, 0.25), plane_secs=(0.1e-9, 0.1e-9, 0.1e-9, 2e-9), split=0.3e-9 / 4, timed=timed)
    a = Adaptive(CompressConfig("auto"), threads=2)
    slow_tier(a, 5000 * MB)
    plans = run(a, FP32, comp, 100)
    if timed:
        speed = a.snapshot()["kinds"]["float32/weight"][
            "speed_bytes_per_sec"
        ]  # 1 / (split + a quarter of the exponent plane's cost): 1.7 GB/s a thread, 3.5 on two < 5 GB/s
        assert speed == pytest.approx(1 / (0.3e-9 / 4 + 2e-9 / 4), rel=1e-3)
        assert steady(plans) == {RAW}
    else:  # the time shared out evenly: 6 GB/s a thread after the probes, which would pay (until the
        # compressed frames' own times, charged to the one plane, tell otherwise)
        assert FramePlan(4, 0b1000) in steady(plans)


def test_a_copy_is_written_plain_once_no_kind_of_it_pays_and_rechecked_now_and_then() -> None:
    fast = Adaptive(CompressConfig("auto"), threads=2)
    assert fast.encode_copy([FP32])  # nothing known: the codec writer measures
    slow_tier(fast, 2000 * MB)
    assert fast.encode_copy([FP32])  # the tier known, the kind not yet
    run(fast, FP32, Compressor(FP32_PLANES), 10)
    decisions = [fast.encode_copy([FP32]) for _ in range(2 * RECHECK_COPIES)]
    assert decisions == ([False] * (RECHECK_COPIES - 1) + [True]) * 2  # plain, but one in RECHECK_COPIES
    assert fast.encode_copy([FP32, Kind("int64", 8)])  # a kind never measured: through the codec writer
    assert fast.encode_copy([FP32], budget=50 * MB)  # a writer paced at 50 MB/s: compressing pays there
    slow = Adaptive(CompressConfig("auto"), threads=2)
    slow_tier(slow, 50 * MB)
    run(slow, FP32, Compressor(FP32_PLANES), 10)
    assert all(slow.encode_copy([FP32]) for _ in range(2 * RECHECK_COPIES))
    assert Adaptive(CompressConfig("zstd"), threads=2).encode_copy([FP32])
    assert not Adaptive(CompressConfig("none"), threads=2).encode_copy([FP32])


def test_more_threads_make_a_compressor_bound_tier_worth_compressing() -> None:
    comp = Compressor(FP32_PLANES)  # 400 MB/s a thread, ratio 1.25
    decided = {}
    for threads in (1, 4):
        a = Adaptive(CompressConfig("auto"), threads=threads)
        slow_tier(a, 500 * MB)
        decided[threads] = steady(run(a, FP32, comp, 64))
    assert decided == {1: {RAW}, 4: {FramePlan(4, 0b1100)}}


def test_pays_counts_the_cpus_the_transfer_needs() -> None:
    # 250 MB/s a thread, 2 threads, ratio 1.22, a 150 MB/s tier: pays on CPUs that do nothing else
    assert pays(250 * MB, 1.22, 2, 150 * MB)
    assert pays(250 * MB, 1.22, 2, 150 * MB, cpus=2)
    # writing costs 1.8 CPUs at 150 MB/s (servers on the same machine): 2 CPUs cannot compress beside it
    assert not pays(250 * MB, 1.22, 2, 150 * MB, cpus=2, io_cpu=1.8 / (150 * MB))
    assert pays(250 * MB, 1.22, 2, 150 * MB, cpus=16, io_cpu=1.8 / (150 * MB))  # plenty of CPUs: it does
    # 1.5 CPUs: compressing frees some of the writes' CPU (1/r of the bytes), enough to pay for itself
    assert pays(250 * MB, 1.22, 2, 150 * MB, cpus=2, io_cpu=1.5 / (150 * MB))
    # more threads than CPUs: the CPUs bound the compressor, not the threads
    assert pays(100 * MB, 1.5, 8, 300 * MB)
    assert not pays(100 * MB, 1.5, 8, 300 * MB, cpus=2)


def test_the_cpu_a_tier_s_writes_take_flips_the_decision() -> None:
    comp = Compressor(FP32_PLANES)  # 400 MB/s a thread, ratio 1.25 on the planes that gain
    a = Adaptive(CompressConfig("auto"), threads=2, cpus=2)
    slow_tier(a, 300 * MB)
    assert steady(run(a, FP32, comp, 40)) == {RAW}  # what the writes cost the CPUs is not known yet
    a.observe_cpu(0.1, int(300 * MB))
    assert steady(run(a, FP32, comp, 40)) == {FramePlan(4, 0b1100)}
    for _ in range(30):  # the tier's writes keep 1.8 CPUs busy at 300 MB/s
        a.observe_cpu(1.8, int(300 * MB))
    assert a.snapshot()["io_cpu_seconds_per_byte"] == pytest.approx(1.8 / (300 * MB), rel=1e-3)
    assert steady(run(a, FP32, comp, 40)) == {RAW}
    for _ in range(30):  # the servers moved elsewhere: the client's 0.1 CPU
        a.observe_cpu(0.1, int(300 * MB))
    assert steady(run(a, FP32, comp, 40)) == {FramePlan(4, 0b1100)}
    a.observe_cpu(1.0, 0)  # nothing written, or a negative time: ignored
    a.observe_cpu(-1.0, 100)
    assert a.snapshot()["io_cpu_seconds_per_byte"] == pytest.approx(0.1 / (300 * MB), rel=0.01)
    assert a.snapshot()["cpus"] == 2
    with pytest.raises(ValueError, match="cpus"):
        Adaptive(CompressConfig("auto"), threads=2, cpus=0)


def test_a_budget_lowers_the_bandwidth_and_flips_the_decision() -> None:
    a = Adaptive(CompressConfig("auto"), threads=2)
    slow_tier(a, 2000 * MB)
    comp = Compressor(FP32_PLANES)
    assert steady(run(a, FP32, comp, 40)) == {RAW}
    assert a.bandwidth(200 * MB) == pytest.approx(200 * MB) and a.bandwidth() == pytest.approx(2000 * MB)
    assert steady(run(a, FP32, comp, 40, budget=200 * MB)) == {FramePlan(4, 0b1100)}
    assert steady(run(a, FP32, comp, 40)) == {RAW}  # nothing of the budget was kept
    for bad in (0, -1.0, True):
        with pytest.raises(ValueError, match="budget"):
            a.plan(FP32, bad)


def test_two_writers_with_their_own_budgets_decide_apart() -> None:
    """One Adaptive per tier, two writers at once: a background demotion paced at 100 MB/s and a
    blocking save at full speed (the tier does 2 GB/s). Interleaved frame by frame, the paced one
    compresses and the other does not: neither decides with the other's budget."""
    a = Adaptive(CompressConfig("auto"), threads=2)
    slow_tier(a, 2000 * MB)
    comp = Compressor(FP32_PLANES)
    paced: list[FramePlan] = []
    full: list[FramePlan] = []
    for _ in range(60):
        paced += run(a, FP32, comp, 1, budget=100 * MB)
        full += run(a, FP32, comp, 1)
    assert steady(paced[-20:]) == {FramePlan(4, 0b1100)} and steady(full[-20:]) == {RAW}
    assert a.snapshot(100 * MB)["kinds"]["float32/weight"]["planes"] == 0b1100
    assert a.snapshot()["kinds"]["float32/weight"]["planes"] == 0


def test_the_measured_throughput_is_kept_up_to_date() -> None:
    a = Adaptive(CompressConfig("auto"), threads=2)
    comp = Compressor(FP32_PLANES)
    slow_tier(a, 2000 * MB)
    assert steady(run(a, FP32, comp, 40)) == {RAW}
    for _ in range(30):  # the tier slows down (another job took it)
        slow_tier(a, 50 * MB)
    assert a.bandwidth() == pytest.approx(50 * MB, rel=0.01)
    assert steady(run(a, FP32, comp, 40)) == {FramePlan(4, 0b1100)}
    a.observe_tier(0, 1.0)  # nothing written, or no time: ignored
    a.observe_tier(100, 0.0)
    assert a.bandwidth() == pytest.approx(50 * MB, rel=0.01)


def test_a_budget_alone_is_enough_to_decide() -> None:
    a = Adaptive(CompressConfig("auto"), threads=2)
    assert steady(run(a, FP32, Compressor(FP32_PLANES), 40, budget=100 * MB)) == {FramePlan(4, 0b1100)}


def test_without_a_tier_measurement_auto_probes() -> None:
    a = Adaptive(CompressConfig("auto"), threads=2)
    plans = run(a, FP32, Compressor(FP32_PLANES), 50)
    assert steady(plans) == {RAW}  # stored raw until the tier is measured
    assert all(p.sample == SAMPLE_BYTES and tried(p) == 0b1111 and p.width == 0 for p in plans if p.probe)
    assert a.bandwidth() is None


def test_a_kind_that_does_not_compress_is_stored_raw_even_on_a_slow_tier() -> None:
    a = Adaptive(CompressConfig("auto"), threads=8)
    slow_tier(a, 1 * MB)
    plans = run(a, FP32, Compressor((1.0, 1.0, 0.98, 0.99)), 64)
    assert steady(plans) == {RAW}


def test_kinds_are_decided_separately() -> None:
    a = Adaptive(CompressConfig("auto"), threads=2)
    slow_tier(a, 100 * MB)
    noise, flags = Kind("bfloat16/exp_avg", 2), Kind("bool", 1)
    assert steady(run(a, noise, Compressor((1.0, 1.0)), 40)) == {RAW}
    assert steady(run(a, flags, Compressor((0.2,)), 40)) == {FramePlan(1, 1)}
    assert steady(run(a, FP32, Compressor(FP32_PLANES), 40)) == {FramePlan(4, 0b1100)}
    assert set(a.snapshot()["kinds"]) == {"bfloat16/exp_avg", "bool", "float32/weight"}


# -- planes ---------------------------------------------------------------------------------------------
def test_planes_that_do_not_gain_are_left_raw() -> None:
    a = Adaptive(CompressConfig("zstd"), threads=1)
    plans = run(a, FP32, Compressor((0.999, 1.0, 0.5, 0.2)), 64)
    assert steady(plans) == {FramePlan(4, 0b1100)}
    assert {p.try_planes for p in plans if p.probe} == {0b1111}  # probes try them again


def test_a_plane_that_starts_gaining_is_picked_up_by_the_probes() -> None:
    a = Adaptive(CompressConfig("zstd"), threads=1)
    run(a, FP32, Compressor((1.0, 1.0, 1.0, 0.3)), 32)
    assert a.plan(FP32).try_planes == 0b1000
    plans = run(a, FP32, Compressor((1.0, 1.0, 0.5, 0.3)), 12 * PROBE_EVERY)
    assert plans[-1] == FramePlan(4, 0b1100)


def test_zstd_compresses_every_frame_that_gains() -> None:
    a = Adaptive(CompressConfig("zstd", level=3), threads=1)
    slow_tier(a, 10_000 * MB)  # a tier faster than anything: zstd does not look
    assert a.level == 3
    assert steady(run(a, FP32, Compressor(FP32_PLANES), 64)) == {FramePlan(4, 0b1100)}
    # a kind where no plane gains: raw, but probed again now and then
    plans = run(a, Kind("uint8", 1), Compressor((1.0,)), 64)
    assert steady(plans) == {RAW} and {p for p in plans if p.probe} == {FramePlan(1, 1, probe=True)}


def test_none_stores_every_frame_raw() -> None:
    a = Adaptive(NONE, threads=4)
    slow_tier(a, 1 * MB)
    assert set(run(a, FP32, Compressor(FP32_PLANES), 40)) == {RAW}
    assert a.snapshot()["kinds"] == {}


def test_an_observation_without_its_plan_counts_every_plane_as_tried() -> None:
    a = Adaptive(CompressConfig("zstd"), threads=1)
    comp = Compressor(FP32_PLANES)
    for _ in range(PROBE_FIRST):
        a.observe_frame(FP32, comp.encode(a.plan(FP32)))
    assert a.plan(FP32) == FramePlan(4, 0b1100)
    # a frame that did not gain: its zstd stream was longer than the frame
    a.observe_frame(Kind("uint8", 1), Encoded(0, 0, 0.01, (F,), (F + 100,)))
    assert a.snapshot()["kinds"]["uint8"]["plane_fraction"] == [1.0]
    # a frame whose length is no multiple of the width was tried whole: its time counts, not its planes
    a.observe_frame(Kind("float16/weight", 2), Encoded(1, 1, 0.5, (1001,), (10,)))
    snap = a.snapshot()["kinds"]["float16/weight"]
    assert snap["plane_fraction"] == [None, None] and snap["observed"] == 1


# -- probes ---------------------------------------------------------------------------------------------
@pytest.mark.parametrize("mode", ["zstd", "auto"])
def test_probes_happen_at_the_stated_rate(mode: str) -> None:
    a = Adaptive(CompressConfig(mode), threads=2)
    slow_tier(a, 2000 * MB)  # auto: raw between the probes
    n = 10 * PROBE_EVERY
    plans = run(a, FP32, Compressor(FP32_PLANES), n)
    probes = [i + 1 for i, p in enumerate(plans) if p.probe]
    assert probes == [*range(1, PROBE_FIRST + 1), *range(PROBE_EVERY, n + 1, PROBE_EVERY)]
    assert all(tried(plans[i - 1]) == 0b1111 for i in probes)
    snap = a.snapshot()["kinds"]["float32/weight"]
    assert (snap["frames"], snap["probes"], snap["observed"]) == (n, len(probes), len(probes) + (n - len(probes)) * (mode == "zstd"))  # fmt: skip


def test_frames_planned_before_any_result_returns_are_probes() -> None:
    a = Adaptive(CompressConfig("auto"), threads=4)
    first = [a.plan(FP32, 100 * MB) for _ in range(10)]  # all in flight at once in the writer's pool
    assert all(p.probe and tried(p) == 0b1111 and p.sample for p in first)  # sampled: not measured yet
    comp = Compressor(FP32_PLANES)
    for p in first:
        report(a, FP32, comp, p)
    assert a.plan(FP32, 100 * MB) == FramePlan(4, 0b1100)


def test_the_adaptive_is_shared_by_threads() -> None:
    a = Adaptive(CompressConfig("auto"), threads=4)
    comp = Compressor(FP32_PLANES)

    def writer() -> None:
        run(a, FP32, comp, 200, budget=100 * MB)
        for _ in range(50):
            slow_tier(a, 100 * MB)

    threads = [threading.Thread(target=writer) for _ in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    snap = a.snapshot()["kinds"]["float32/weight"]
    assert snap["frames"] == 800 and snap["observed"] == 800
    assert a.plan(FP32) == FramePlan(4, 0b1100)


def test_adaptive_needs_a_thread() -> None:
    with pytest.raises(ValueError, match="threads"):
        Adaptive(CompressConfig("auto"), threads=0)


# -- kinds ----------------------------------------------------------------------------------------------
@pytest.mark.parametrize(
    ("dtype", "path", "kind"),
    [
        ("bfloat16", "state['model']['layers.0.w']", Kind("bfloat16/weight", 2)),
        ("float32", "state['optim']['state'][3]['master']", Kind("float32/weight", 4)),
        ("float32", "state['optim']['state'][3]['exp_avg']", Kind("float32/exp_avg", 4)),
        ("float32", "state['optim']['state'][3]['exp_avg_sq']", Kind("float32/exp_avg_sq", 4)),
        ("float16", "optim.state.layer.momentum_buffer", Kind("float16/momentum_buffer", 2)),
        ("float32", "state['my_exp_avg']", Kind("float32/weight", 4)),
        ("float64", "state['x']", Kind("float64/weight", 8)),
        ("float8_e4m3fn", "state['w']", Kind("float8_e4m3fn/weight", 1)),
        ("complex64", "state['z']", Kind("complex64/weight", 4)),
        ("int64", "state['optim']['state'][0]['exp_avg']", Kind("int64", 8)),
        ("int16", "state['ids']", Kind("int16", 2)),
        ("int8", "state['q']", Kind("int8", 1)),
        ("bool", "state['mask']", Kind("bool", 1)),
        ("uint8", "state['rng']", Kind("uint8", 1)),
        ("no_such_dtype", "state['x']", OTHER),
    ],
)
def test_kind_of_a_tensor(dtype: str, path: str, kind: Kind) -> None:
    assert kind_of(dtype, path) == kind


def table(rows: list[tuple[str, str, int, int, int]]) -> TensorTable:
    """(path, dtype, blob, offset, length) rows."""
    n = len(rows)
    return TensorTable(
        [r[0] for r in rows], [r[1] for r in rows], [(r[4],) for r in rows],
        [r[2] for r in rows], [r[3] for r in rows], [r[4] for r in rows], [0] * n,
    )  # fmt: skip


def test_frame_kinds_take_the_tensor_holding_most_of_each_frame() -> None:
    k = 1 << 10
    t = table(
        [
            ("state['w']", "bfloat16", 0, 0, 9 * k),  # frames 0, 1, and 1 KiB of frame 2
            ("state['i']", "int64", 0, 9 * k, 4 * k),  # the rest of frame 2, 1 KiB of frame 3
            ("state['o'][0]['exp_avg_sq']", "float32", 1, 8 * k, 4 * k),  # blob 1: frame 2
            ("state['e']", "float32", 1, 16 * k, 0),  # empty: nothing
        ]
    )
    kinds = frame_kinds([16 * k, 13 * k], t, 4 * k)
    bf16 = Kind("bfloat16/weight", 2)
    assert kinds == [
        [bf16, bf16, Kind("int64", 8), OTHER],  # frame 3: 1 KiB of int64, 3 KiB of nothing
        [OTHER, OTHER, Kind("float32/exp_avg_sq", 4), OTHER],  # the last frame is 1 KiB, of nothing
    ]
    # a tie goes to the first tensor of the frame
    assert frame_kinds([8 * k], table([("a", "int32", 0, 0, 2 * k), ("b", "float16", 0, 2 * k, 2 * k)]), 4 * k) == [
        [Kind("int32", 4), OTHER]
    ]
    assert frame_kinds([0], table([]), 4 * k) == [[]]
    with pytest.raises(ValueError, match="frame_bytes"):
        frame_kinds([1], table([]), 0)


# -- the setting ----------------------------------------------------------------------------------------
@pytest.mark.parametrize(
    ("value", "cfg"),
    [
        ("none", CompressConfig("none")),
        (False, CompressConfig("none")),  # what YAML makes of `off`
        ("zstd", CompressConfig("zstd", 1)),
        ("auto", CompressConfig("auto", 1)),
        ("zstd:3", CompressConfig("zstd", 3)),
        ("zstd:-7", CompressConfig("zstd", -7)),
        ("auto:19", CompressConfig("auto", 19)),
        ({"mode": "zstd", "level": 3, "threads": 2}, CompressConfig("zstd", 3, 2)),
        ({"mode": "auto"}, CompressConfig("auto")),
        ({"mode": "none"}, CompressConfig("none")),
        (None, None),
    ],
)
def test_parse_compress_accepts(value: object, cfg: CompressConfig | None) -> None:
    assert parse_compress(value, "tiers[2].compress") == cfg


@pytest.mark.parametrize(
    ("value", "message"),
    [
        ("gzip", r"tiers\[2\]\.compress: expected none, zstd, auto, 'zstd:LEVEL' or a mapping .*got 'gzip'"),
        ("ZSTD", r"tiers\[2\]\.compress: expected .*got 'ZSTD'"),
        ("zstd:20", r"tiers\[2\]\.compress: expected a zstd level from -7 \(fastest\) to 19, got 20"),
        ("zstd:-8", r"tiers\[2\]\.compress: expected a zstd level .* got -8"),
        ("zstd:", r"tiers\[2\]\.compress: expected none"),
        ("none:3", r"tiers\[2\]\.compress: expected none"),
        (True, r"tiers\[2\]\.compress: expected .*got True \(true is ambiguous: say zstd or auto\)"),
        (3, r"tiers\[2\]\.compress: expected .*got 3"),
        ({"level": 3}, r"tiers\[2\]\.compress\.mode: required key is missing"),
        ({"mode": "lz4"}, r"tiers\[2\]\.compress\.mode: expected one of none, zstd, auto, got 'lz4'"),
        ({"mode": "zstd", "level": 1.5}, r"tiers\[2\]\.compress\.level: expected a zstd level"),
        ({"mode": "zstd", "level": True}, r"tiers\[2\]\.compress\.level: expected a zstd level"),
        ({"mode": "zstd", "threads": 0}, r"tiers\[2\]\.compress\.threads: expected an integer in \[1, 256\]"),
        ({"mode": "auto", "speed": 1}, r"tiers\[2\]\.compress\.speed: unknown key"),
        ({"mode": "none", "level": 3}, r"tiers\[2\]\.compress\.level: mode none compresses nothing"),
    ],
)
def test_parse_compress_refuses(value: object, message: str) -> None:
    with pytest.raises(ConfigError, match=message):
        parse_compress(value, "tiers[2].compress")


def test_compress_config_checks_itself() -> None:
    for bad in ({"mode": "lz4"}, {"mode": "zstd", "level": 22}, {"mode": "zstd", "threads": 0}):
        with pytest.raises(ValueError):
            CompressConfig(**bad)  # type: ignore[arg-type]


@pytest.mark.parametrize(
    ("device", "shared", "persistent", "mode"),
    [
        ("file", True, True, "auto"),  # pfs
        ("object", True, True, "auto"),  # s3
        ("file", False, True, "none"),  # a node-local disk
        ("cpu", False, False, "none"),  # host memory
        ("cuda", False, False, "none"),
    ],
)
def test_default_compress(device: str, shared: bool, persistent: bool, mode: str) -> None:
    assert default_compress(device, shared, persistent).mode == mode
    assert tier_compress(None, device, shared, persistent, "tiers[0].compress").mode == mode


def test_a_gpu_tier_refuses_compression() -> None:
    with pytest.raises(ConfigError, match=r"tiers\[0\]\.compress: a gpu tier .*compresses nothing, got zstd"):
        tier_compress(CompressConfig("zstd"), "cuda", False, False, "tiers[0].compress")
    assert tier_compress(NONE, "cuda", False, False, "tiers[0].compress") == NONE
    assert tier_compress(CompressConfig("zstd"), "cpu", False, False, "x") == CompressConfig("zstd")


def test_the_config_reads_each_tiers_compress() -> None:
    cfg = parse_config(
        {
            "tiers": [
                {"name": "host", "kind": "host"},
                {"name": "pfs", "kind": "pfs", "path": "/x", "compress": "zstd:3"},
                {"name": "s3", "kind": "s3", "path": "s3://b/p", "compress": {"mode": "auto", "threads": 4}},
            ]
        }
    )
    assert [t.compress for t in cfg.tiers] == [None, CompressConfig("zstd", 3), CompressConfig("auto", 1, 4)]
    with pytest.raises(ConfigError, match=r"^tiers\[1\]\.compress: expected none"):
        parse_config({"tiers": [{"name": "a", "kind": "host"}, {"name": "b", "kind": "pfs", "compress": "fast"}]})


def test_the_policy_and_the_codec_agree_on_gain_and_levels() -> None:
    from tierckpt.format import codec
    from tierckpt.policies import compressconfig, compression

    assert compression.GAIN == codec.PLANE_GAIN  # a plane the policy calls gaining is one the codec keeps
    assert compressconfig.LEVELS == codec.LEVELS
