"""``auto``'s measurements kept across processes (tierckpt.datapath.measured, Adaptive.export/start_from):
the round trip, the key, every file that must be ignored, atomic writes, the switch that turns it off, and
two processes saving through one hierarchy's ``auto`` tier."""

from __future__ import annotations

import json
import logging
import math
import os
import subprocess
import sys
import textwrap
import threading
import time
from pathlib import Path
from typing import Any

import pytest

from tests.unit.test_compression_policy import Encoded
from tierckpt.datapath import measured
from tierckpt.datapath.storing import set_compression
from tierckpt.io.cachedir import replace_file
from tierckpt.policies.compressconfig import CompressConfig
from tierckpt.policies.compression import PROBE_EVERY, PROBE_FIRST, Adaptive, Kind
from tierckpt.tiers.local import LocalTier

NOISE = Kind("uint8", 1)  # a kind that never gains: a copy of it never pays
FP32 = Kind("float32/weight", 4)
F = 4 << 20
AUTO = CompressConfig("auto")


def _learn(a: Adaptive, kinds: tuple[Kind, ...] = (NOISE,), frames: int = PROBE_FIRST) -> None:
    """Measurements of a tier faster than any compressor: ``kinds`` as noise (nothing gains), the
    exponent plane of a float kind at half."""
    for kind in kinds:
        for _ in range(frames):
            plan = a.plan(kind)
            planes = max(1, kind.width)
            raw = (F // planes,) * planes
            stored = tuple(n // 2 if p == planes - 1 and planes > 1 else n for p, n in enumerate(raw))
            a.observe_frame(kind, Encoded(kind.width, planes, 0.02, raw, stored), plan.measure or plan)
    a.observe_tier(10 << 30, 1.0)
    a.observe_cpu(0.1, 1 << 30)


def _tier(path: Path, cfg: CompressConfig = AUTO) -> LocalTier:
    tier = LocalTier("pfs", path)
    set_compression(tier, cfg)
    return tier


def _kept_tier(path: Path, cfg: CompressConfig = AUTO) -> LocalTier:
    """A tier whose Adaptive learnt, its measurements kept (then the tier closed)."""
    tier = _tier(path, cfg)
    assert tier.adaptive is not None
    _learn(tier.adaptive, (NOISE, FP32))
    measured.keep(tier, now=True)
    tier.close()
    return tier


# -- the round trip and the key -----------------------------------------------------------------------------
def test_a_new_adaptive_of_the_same_key_starts_from_what_was_kept(tmp_path: Path) -> None:
    first = _kept_tier(tmp_path / "pfs")
    assert first.adaptive is not None
    path = measured.kept_path(first)
    assert path is not None and path.is_file() and path.parent.parent == Path(os.environ["TIERCKPT_CACHE_DIR"])
    again = _tier(tmp_path / "pfs")
    try:
        a = again.adaptive
        assert a is not None
        snap = a.snapshot()
        assert snap["started_from_saved"] and not first.adaptive.snapshot()["started_from_saved"]
        assert snap["bandwidth_bytes_per_sec"] == first.adaptive.snapshot()["bandwidth_bytes_per_sec"]
        assert snap["kinds"]["float32/weight"]["ratio"] == pytest.approx(8 / 7)
        assert a.encode_copy({NOISE, FP32}) is False  # plain at once: nothing pays on a fast tier
        assert all(k["frames"] == 0 for k in a.snapshot()["kinds"].values())  # not a frame planned
    finally:
        again.close()


@pytest.mark.parametrize("other", ["path", "threads", "level", "host"])
def test_another_key_starts_fresh(tmp_path: Path, other: str, monkeypatch: pytest.MonkeyPatch) -> None:
    _kept_tier(tmp_path / "pfs", CompressConfig("auto", 1, 2))
    cfg, path = CompressConfig("auto", 1, 2), tmp_path / "pfs"
    if other == "path":
        path = tmp_path / "other"
    elif other == "threads":
        cfg = CompressConfig("auto", 1, 3)
    elif other == "level":
        cfg = CompressConfig("auto", 3, 2)
    else:
        monkeypatch.setattr(measured.socket, "gethostname", lambda: "another-node")
    tier = _tier(path, cfg)
    try:
        assert tier.adaptive is not None
        assert not tier.adaptive.snapshot()["started_from_saved"] and tier.adaptive.encode_copy({NOISE})
    finally:
        tier.close()


def test_a_symlinked_root_is_the_same_tier(tmp_path: Path) -> None:
    _kept_tier(tmp_path / "pfs")
    (tmp_path / "link").symlink_to(tmp_path / "pfs")
    tier = _tier(tmp_path / "link")
    try:
        assert tier.adaptive is not None and tier.adaptive.snapshot()["started_from_saved"]
    finally:
        tier.close()


def test_only_auto_tiers_with_a_location_keep_anything(tmp_path: Path) -> None:
    from tierckpt.tiers.host import HostTier

    zstd = _tier(tmp_path / "z", CompressConfig("zstd"))
    host = HostTier("host")
    host.compress = AUTO
    set_compression(host)
    try:
        assert measured.kept_path(zstd) is None and measured.measure_key(zstd) is None
        assert host.adaptive is not None and measured.measure_key(host) is None  # process memory: no place
    finally:
        zstd.close()


# -- the adaptive side --------------------------------------------------------------------------------------
def test_start_from_takes_what_export_gave_and_keeps_measuring() -> None:
    a = Adaptive(AUTO, 4, cpus=2)
    _learn(a, (NOISE, FP32))
    b = Adaptive(AUTO, 4, cpus=2)
    b.start_from(json.loads(json.dumps(a.export())))
    assert b.export() == a.export() and b.revision == 0
    plans = [b.plan(FP32) for _ in range(PROBE_EVERY)]  # started from measurements: no first probes...
    assert [p.probe for p in plans] == [False] * (PROBE_EVERY - 1) + [True]  # ...but one in PROBE_EVERY
    b.observe_tier(1 << 20, 1.0)  # a tier that became slow: the measurements move
    assert b.revision == 1 and b.bandwidth() is not None and b.bandwidth() < a.bandwidth()  # type: ignore[operator]


def _good() -> dict[str, Any]:
    a = Adaptive(AUTO, 4)
    _learn(a, (NOISE, FP32))
    return a.export()


def _with(path: tuple[Any, ...], value: Any) -> dict[str, Any]:
    d = _good()
    at: Any = d
    for k in path[:-1]:
        at = at[k]
    at[path[-1]] = value
    return d


@pytest.mark.parametrize(
    "data",
    [
        None,
        [],
        {"version": 1},
        _with(("version",), 2),  # newer
        _with(("version",), True),
        _with(("kinds",), "float32"),
        _with(("kinds",), [{}] * 300),
        _with(("kinds", 0, "kind"), "float32/foo"),  # no such kind
        _with(("kinds", 0, "kind"), "float32/weight"),  # twice
        _with(("kinds", 1, "width"), 2),  # not its width
        _with(("kinds", 1, "width"), "4"),
        _with(("kinds", 1, "cost"), "0.1"),
        _with(("kinds", 1, "cost"), math.nan),
        _with(("kinds", 1, "cost"), -1e-9),
        _with(("kinds", 1, "cost"), math.inf),
        _with(("kinds", 1, "fraction"), [0.5]),
        _with(("kinds", 1, "fraction"), [0.5, 0.5, 0.5, 1.5]),
        _with(("kinds", 1, "plane_cost"), [None, None, None, True]),
        _with(("tier",), [1e300, 1e-300]),
        _with(("tier",), [1, 2, 3]),
        _with(("cpu",), [-1.0, 1.0]),
        {**_good(), "extra": 1},
    ],
)
def test_start_from_refuses_malformed_data_and_takes_none_of_it(data: Any) -> None:
    a = Adaptive(AUTO, 4)
    with pytest.raises(ValueError):
        a.start_from(data)
    assert a.export() == {"version": 1, "tier": None, "cpu": None, "kinds": []}
    assert not a.snapshot()["started_from_saved"]


# -- files that are ignored ---------------------------------------------------------------------------------
def _doc(tier: LocalTier, **changes: Any) -> dict[str, Any]:
    key = measured.measure_key(tier)
    doc = {"format": "tierckpt-measured", "version": 1, "key": key, "saved_at": time.time(), "measured": _good()}
    doc.update(changes)
    return doc


HOSTILE: dict[str, Any] = {
    "not json": b"\x00\xff{",
    "truncated": "TRUNCATED",
    "huge": b" " * (measured.MAX_FILE_BYTES + 1) + b"{}",
    "nested": b"[" * 200_000,
    "a list": b"[1, 2]",
    "another format": {"format": "x"},
    "a newer version": {"version": 2},
    "a newer version inside": {"measured": _with(("version",), 2)},
    "another key": {"key": {"tier": "local"}},
    "stale": {"saved_at": time.time() - measured.MAX_AGE_SECS - 60},
    "from the future": {"saved_at": time.time() + 86400},
    "no time": {"saved_at": "yesterday"},
    "NaN": {"measured": _with(("kinds", 0, "cost"), math.nan)},
    "negative": {"measured": _with(("tier",), [-1.0, 1.0])},
    "infinite": b"INF",
    "an unknown kind": {"measured": _with(("kinds", 0, "kind"), "tensor/of/doom")},
    "wrong types": {"measured": _with(("kinds", 0, "fraction"), {"a": 1})},
}


@pytest.mark.parametrize("case", sorted(HOSTILE))
def test_a_hostile_or_stale_file_is_ignored(tmp_path: Path, case: str, caplog: pytest.LogCaptureFixture) -> None:
    probe = _tier(tmp_path / "pfs")
    path = measured.kept_path(probe)
    assert path is not None
    probe.close()
    path.parent.mkdir(parents=True, exist_ok=True)
    what = HOSTILE[case]
    if what == "TRUNCATED":
        whole = json.dumps(_doc(probe)).encode()
        path.write_bytes(whole[: len(whole) // 2])
    elif what == b"INF":
        path.write_bytes(json.dumps(_doc(probe)).replace("10737418240.0", "1e999", 1).encode())  # json: inf
    elif isinstance(what, bytes):
        path.write_bytes(what)
    else:
        path.write_text(json.dumps(_doc(probe, **what)))
    with caplog.at_level(logging.DEBUG, logger="tierckpt.datapath.measured"):
        tier = _tier(tmp_path / "pfs")
    try:
        assert tier.adaptive is not None and not tier.adaptive.snapshot()["started_from_saved"]
        assert tier.adaptive.export()["kinds"] == [] and tier.adaptive.encode_copy({NOISE})
        assert any("kept measurements ignored" in r.getMessage() for r in caplog.records)
    finally:
        tier.close()


def test_a_good_file_is_taken(tmp_path: Path) -> None:
    """The control of the cases above: the document they spoil, unspoilt, is taken."""
    probe = _tier(tmp_path / "pfs")
    path = measured.kept_path(probe)
    assert path is not None
    probe.close()
    replace_file(path, json.dumps(_doc(probe)).encode())
    tier = _tier(tmp_path / "pfs")
    try:
        assert tier.adaptive is not None and tier.adaptive.snapshot()["started_from_saved"]
    finally:
        tier.close()


@pytest.mark.parametrize("kind", ["directory", "fifo", "symlink"])
def test_a_path_that_is_no_regular_file_is_ignored(tmp_path: Path, kind: str) -> None:
    probe = _tier(tmp_path / "pfs")
    path = measured.kept_path(probe)
    assert path is not None
    probe.close()
    path.parent.mkdir(parents=True, exist_ok=True)
    if kind == "directory":
        path.mkdir()
    elif kind == "fifo":
        os.mkfifo(path)  # opening it must not block
    else:
        (tmp_path / "elsewhere.json").write_text(json.dumps(_doc(probe)))
        path.symlink_to(tmp_path / "elsewhere.json")
    tier = _tier(tmp_path / "pfs")
    try:
        assert tier.adaptive is not None and not tier.adaptive.snapshot()["started_from_saved"]
    finally:
        tier.close()


# -- writes -------------------------------------------------------------------------------------------------
def test_writes_are_throttled_and_only_of_something_new(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    tier = _tier(tmp_path / "pfs")
    a = tier.adaptive
    assert a is not None
    path = measured.kept_path(tier)
    assert path is not None
    try:
        assert measured.keep(tier) is None and not path.exists()  # nothing measured yet
        _learn(a)
        done = measured.keep(tier)
        assert done is not None
        done.result(timeout=30)
        assert json.loads(path.read_text())["measured"] == a.export()
        a.observe_tier(1 << 20, 1.0)
        assert measured.keep(tier) is None  # within KEEP_EVERY_SECS of the last
        later = time.monotonic() + measured.KEEP_EVERY_SECS + 1
        monkeypatch.setattr(measured.time, "monotonic", lambda: later)
        done = measured.keep(tier)
        assert done is not None
        done.result(timeout=30)
        assert json.loads(path.read_text())["measured"] == a.export()
        assert measured.keep(tier, now=True) is None  # nothing new: not written again
    finally:
        tier.close()


def test_an_unwritable_cache_is_skipped(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    blocker = tmp_path / "file"
    blocker.write_text("")
    monkeypatch.setenv("TIERCKPT_CACHE_DIR", str(blocker / "sub"))  # a directory under a file: ENOTDIR
    tier = _tier(tmp_path / "pfs")
    try:
        assert tier.adaptive is not None
        _learn(tier.adaptive)
        with caplog.at_level(logging.DEBUG, logger="tierckpt.datapath.measured"):
            measured.keep(tier, now=True)
        assert any("could not keep measurements" in r.getMessage() for r in caplog.records)
    finally:
        tier.close()


_WRITER = """
import json, sys
from pathlib import Path
from tierckpt.io.cachedir import replace_file
path, me = Path(sys.argv[1]), int(sys.argv[2])
doc = json.dumps({"writer": me, "pad": [me] * 20000}).encode()
for _ in range(300):
    replace_file(path, doc)
"""


def test_two_processes_writing_one_file_leave_one_whole_file(tmp_path: Path) -> None:
    """Ranks on a node keep one key at once: a reader sees one writer's whole file, never a mix; the
    last rename wins; no temporary file is left."""
    path = tmp_path / "cache" / "measured" / "k.json"
    path.parent.mkdir(parents=True)
    writers = [subprocess.Popen([sys.executable, "-c", _WRITER, str(path), str(i)]) for i in (1, 2)]
    seen = set()
    while any(w.poll() is None for w in writers):
        try:
            doc = json.loads(path.read_bytes())
        except FileNotFoundError:
            continue
        assert doc["pad"] == [doc["writer"]] * 20000
        seen.add(doc["writer"])
    assert [w.wait() for w in writers] == [0, 0]
    assert json.loads(path.read_bytes())["writer"] in (1, 2) and seen
    assert [p.name for p in path.parent.iterdir()] == ["k.json"]


def test_keeper_threads_and_a_close_at_once_leave_the_newest(tmp_path: Path) -> None:
    tier = _tier(tmp_path / "pfs")
    a = tier.adaptive
    assert a is not None and (path := measured.kept_path(tier)) is not None
    try:
        _learn(a)

        def observe() -> None:
            for i in range(200):
                a.observe_tier(1 << 20 + i % 8, 1.0)
                measured.keep(tier)

        threads = [threading.Thread(target=observe) for _ in range(4)]
        for t in threads:
            t.start()
        for t in threads:
            t.join()
        measured.keep(tier, now=True)
        assert json.loads(path.read_text())["measured"] == a.export()
    finally:
        tier.close()


# -- turning it off -----------------------------------------------------------------------------------------
@pytest.mark.parametrize("how", ["TIERCKPT_NO_MEASURE_CACHE", "TIERCKPT_CACHE_DIR"])
def test_the_switch_keeps_and_reads_nothing(tmp_path: Path, how: str, monkeypatch: pytest.MonkeyPatch) -> None:
    _kept_tier(tmp_path / "pfs")  # kept before the switch
    monkeypatch.setenv(how, "1" if how == "TIERCKPT_NO_MEASURE_CACHE" else "")
    tier = _tier(tmp_path / "pfs")
    try:
        assert tier.adaptive is not None and not tier.adaptive.snapshot()["started_from_saved"]
        assert measured.kept_path(tier) is None
        _learn(tier.adaptive)
        assert measured.keep(tier, now=True) is None
    finally:
        tier.close()
    monkeypatch.delenv(how)
    again = _tier(tmp_path / "other")
    try:
        assert again.adaptive is not None and not again.adaptive.snapshot()["started_from_saved"]  # never kept
    finally:
        again.close()


# -- two processes through a hierarchy ----------------------------------------------------------------------
_SAVER = textwrap.dedent(
    """
    import json, sys
    import torch
    from tierckpt import Hierarchy
    root, first = sys.argv[1], sys.argv[2] == "first"
    cfg = {"tiers": [{"name": "pfs", "kind": "local", "path": root, "compress": "auto"}],
           "policy": {"keep": {"pfs": 1}}, "io": {"chunk": "1MiB"}}
    g = torch.Generator().manual_seed(7)
    state = {"noise": torch.randint(0, 256, (8 << 20,), dtype=torch.uint8, generator=g)}
    with Hierarchy.from_config(cfg) as h:
        a = h.tier("pfs").adaptive
        before = a.snapshot()
        step = 1
        while True:  # the first process: until the tier and what its writes cost the CPUs are measured
            h.save(state, step=step).wait()
            snap = a.snapshot()
            if not first or (snap["bandwidth_bytes_per_sec"] and snap["io_cpu_seconds_per_byte"] is not None
                              or snap["cpus"] is None) or step == 40:
                break
            step += 1
    print(json.dumps({"before": before, "after": snap, "steps": step}))
    """
)


def _save_in_a_process(root: Path, which: str) -> dict[str, Any]:
    env = {
        **os.environ,
        "PYTHONPATH": os.pathsep.join([str(Path(__file__).parents[2]), os.environ.get("PYTHONPATH", "")]),
    }
    p = subprocess.run(
        [sys.executable, "-c", _SAVER, str(root), which], capture_output=True, text=True, timeout=300, env=env
    )
    assert p.returncode == 0, p.stderr
    result: dict[str, Any] = json.loads(p.stdout.strip().splitlines()[-1])
    return result


def test_a_restarted_process_writes_its_first_copy_plain(tmp_path: Path) -> None:
    """The first process learns (its first copy through the codec writer, probing); the second starts
    from what it kept, and its first copy, of a kind measured as never paying, is written plain: no
    frame planned, nothing through the codec writer."""
    first = _save_in_a_process(tmp_path / "pfs", "first")
    assert not first["before"]["started_from_saved"] and first["after"]["kinds"]["uint8"]["frames"] > 0
    assert first["steps"] < 40, first["after"]
    second = _save_in_a_process(tmp_path / "pfs", "second")
    assert second["before"]["started_from_saved"] and second["before"]["kinds"]["uint8"]["ratio"] is not None
    after = second["after"]
    assert after["kinds"]["uint8"]["frames"] == 0 and after["kinds"]["uint8"]["probes"] == 0
    assert after["written_from_memory_bytes"] == 0 and after["written_copied_bytes"] == 0
