"""The benchmark harness (``tierckpt bench``) on tiny workloads: files produced, peers skipped cleanly,
prefetch and sweep runs. No timing assertions: the numbers of a few-MB run mean nothing."""

from __future__ import annotations

import json
import mmap
import sys
from pathlib import Path
from typing import Any

import pytest

from tierckpt.bench import plots, runner
from tierckpt.bench.compare import Harness, Progress, all_peers
from tierckpt.bench.metrics import Recorder
from tierckpt.bench.peers import RawBuffers
from tierckpt.bench.prefetch import break_even, run_prefetch
from tierckpt.bench.sweep import Setting, run_sweep
from tierckpt.bench.system import make_cold, measure, resident_fraction
from tierckpt.bench.workloads import build_workload, llm_dims_for, make_mixed_state, same_state, state_bytes
from tierckpt.cli import main as cli_main
from tierckpt.io.engine import make_engine

pytestmark = pytest.mark.bench

TINY = ["--llm-size", "3MB", "--small-count", "40", "--mixed-size", "3MB", "--mixed-small", "20",
        "--prefetch-size", "3MB", "--sweep-size", "2MB", "--repeats", "1", "--cold", "fadvise", "--no-progress"]  # fmt: skip


def records(out: Path, prefix: str) -> list[dict[str, Any]]:
    (path,) = out.glob(f"{prefix}-*.jsonl")
    return [json.loads(line) for line in path.read_text().splitlines()]


def tiny(name: str) -> Any:
    return build_workload(name, llm_bytes=3 << 20, small_count=40, mixed_bytes=3 << 20, mixed_small=20)


def test_comparison_writes_jsonl_markdown_and_plots(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    out = tmp_path / "out"
    argv = [*TINY, "--workloads", "llm,small,mixed", "--no-prefetch", "--out", str(out), "--dir", str(tmp_path)]
    assert cli_main(["bench", *argv]) == 0
    recs = records(out, "bench")
    assert recs[0]["kind"] == "machine" and recs[0]["cores"] and recs[-1]["kind"] == "end"
    samples = [r for r in recs if r["kind"] == "sample"]
    got = {(r["workload"], r["peer"], r["op"], r.get("cache")) for r in samples}
    for wl in ("llm", "small", "mixed"):
        assert {(wl, "tierckpt", "save", None), (wl, "tierckpt", "restore", "cold"), (wl, "tierckpt", "restore", "warm"),
                (wl, "tierckpt-lazy", "save", None), (wl, "tierckpt-lazy", "restore", "memory"),
                (wl, "torch.save", "restore", "cold"), (wl, "raw:pwrite", "save", None),
                (wl, "memcpy", "restore", "memory")} <= got  # fmt: skip
    lazy = next(r for r in samples if r["peer"] == "tierckpt-lazy" and r["op"] == "save")
    assert lazy["api_secs"] <= lazy["blocking_secs"] <= lazy["wall_secs"]
    assert all(r["cpu_secs"] >= 0 for r in samples)
    cold = next(r for r in samples if r["peer"] == "tierckpt" and r.get("cache") == "cold")
    assert cold["cold_method"] == "fadvise" and 0.0 <= cold["resident"] <= 1.0
    assert not [r for r in recs if r["kind"] == "skip" and r["peer"] in ("tierckpt", "tierckpt-lazy", "torch.save")]
    (md,) = out.glob("bench-*.md")
    text = md.read_text()
    for heading in ("### llm", "### small", "### mixed", "### Targets", "### How each peer was run"):
        assert heading in text
    assert "| tierckpt |" in text and "memcpy into new memory" in text
    assert "tierckpt bench" in capsys.readouterr().out
    pngs = list(out.glob("bench-*-peers.png"))
    if plots.available() is None:
        assert len(pngs) == 1 and pngs[0].stat().st_size > 1000
    else:
        assert not pngs


def test_missing_packages_and_fio_are_skipped_with_a_note(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    for mod in ("safetensors", "safetensors.torch", "torchsnapshot"):
        monkeypatch.setitem(sys.modules, mod, None)  # import raises ModuleNotFoundError
    monkeypatch.setattr("tierckpt.bench.peers.fio_available", lambda: False)
    rec = Recorder(tmp_path / "out", echo=lambda _: None)
    engine = make_engine("threads", 2)
    try:
        usable = Harness.usable(all_peers(engine, RawBuffers()), rec)
    finally:
        engine.close()
    skipped = {k.peer: k.why for k in rec.skips}
    assert set(skipped) == {"safetensors", "torchsnapshot", "torchsnapshot-async", "fio"}
    assert "not installed" in skipped["safetensors"] and "tierckpt[bench]" in skipped["safetensors"]
    assert "fio" in skipped["fio"]
    assert {"tierckpt", "tierckpt-lazy", "torch.save", "raw:pwrite"} <= {p.name for p in usable}

    out = tmp_path / "run"
    argv = [*TINY, "--workloads", "llm", "--peers", "tierckpt,safetensors", "--no-prefetch", "--out", str(out)]
    assert runner.main(argv) == 0
    (md,) = out.glob("bench-*.md")
    assert "* `safetensors`: safetensors" in md.read_text() and "is not installed" in md.read_text()


def test_a_peer_failing_on_a_workload_is_skipped_there(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    def boom(self: Any, state: Any, rep: int) -> None:
        raise OSError(28, "No space left on device")

    monkeypatch.setattr("tierckpt.bench.peers.TorchSave.save", boom)
    rec = Recorder(tmp_path / "out", echo=lambda _: None)
    wl = tiny("llm")
    engine = make_engine("threads", 2)
    peers = [p for p in all_peers(engine, RawBuffers()) if p.name in ("torch.save", "tierckpt")]
    try:
        Harness(rec, tmp_path, 2, "fadvise", True, Progress(4, enabled=False)).run_workload(wl, peers)
    finally:
        engine.close()
    assert [(k.peer, k.workload) for k in rec.skips] == [("torch.save", "llm")]
    assert "No space left" in rec.skips[0].why
    assert len(rec.select(peer="tierckpt", op="save")) == 2


def test_prefetch_restart_with_tiny_init_times(tmp_path: Path) -> None:
    rec = Recorder(tmp_path / "out", prefix="prefetch", echo=lambda _: None)
    res = run_prefetch(rec, tiny("llm"), tmp_path, repeats=1, cold="fadvise", factors=(0.0,), init_secs=[0.0, 0.05],
                       io=None, progress=Progress(3, enabled=False))  # fmt: skip
    assert len(res.direct_secs) == 1 and sorted(res.prefetch_secs) == [0.0, 0.05]
    restarts = [r for r in records(tmp_path / "out", "prefetch") if r["kind"] == "restart"]
    assert [(r["mode"], r["last_restore"][1]) for r in restarts] == [
        ("direct", "pfs"), ("prefetch", "host"), ("prefetch", "host")
    ]  # fmt: skip
    assert all(r["prefetch_done_secs"] > 0 for r in restarts if r["mode"] == "prefetch")
    tiers = {s.peer for s in rec.samples if s.op == "restore"}
    assert tiers == {"tierckpt:host", "tierckpt:local", "tierckpt:pfs", "memcpy"}
    assert any("Break-even" in line for line in res.lines())
    if plots.available() is None:
        assert plots.plot_prefetch(res, tmp_path / "p.png").stat().st_size > 1000


def test_sweep_on_a_tiny_state_prints_the_best_io_block(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    out = tmp_path / "out"
    assert runner.main([*TINY, "--quick", "--sweep", "--out", str(out), "--dir", str(tmp_path)]) == 0
    text = capsys.readouterr().out
    assert "### io: sweep" in text and "Best on this machine" in text and "io: {engine: " in text
    best = [r for r in records(out, "sweep") if r["kind"] == "sweep_best"]
    assert len(best) == 1 and best[0]["yaml"].startswith("io: {engine: ")
    if plots.available() is None:
        assert len(list(out.glob("sweep-*-sweep.png"))) == 1

    rec = Recorder(tmp_path / "out2", prefix="sweep", echo=lambda _: None)
    knobs = {"engine": ("threads",), "direct": (True, False), "queue_depth": (2,), "chunk_bytes": (1 << 20,)}
    res = run_sweep(rec, tiny("llm"), tmp_path, repeats=1, cold="fadvise", knobs=knobs, grid=True,
                    progress=Progress(2, enabled=False))  # fmt: skip
    assert set(res.scores) == {Setting("threads", True, 2, 1 << 20), Setting("threads", False, 2, 1 << 20)}
    assert res.best.yaml() in "\n".join(res.lines())


def test_train_entry_is_skipped_without_the_script(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(runner, "find_bench_train", lambda: None)
    out = tmp_path / "out"
    argv = [*TINY, "--workloads", "llm,train", "--peers", "tierckpt", "--no-prefetch", "--out", str(out)]
    assert runner.main(argv) == 0
    skips = [r for r in records(out, "bench") if r["kind"] == "skip" and r["peer"] == "train"]
    assert len(skips) == 1 and "bench_train.py not found" in skips[0]["why"]


def test_bad_options_exit_2(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    assert runner.main(["--workloads", "llm,huge", "--out", str(tmp_path)]) == 2
    assert runner.main(["--llm-size", "lots", "--out", str(tmp_path)]) == 2
    assert runner.main(["--peers", "nosuch", "--no-progress", "--out", str(tmp_path), "--dir", str(tmp_path)]) == 2
    assert "--workloads" in capsys.readouterr().err
    with pytest.raises(SystemExit) as e:
        cli_main(["bench", "--help"])
    assert e.value.code == 0


def test_workloads_are_deterministic_and_sized() -> None:
    for target in (50e6, 2e9):
        assert abs(llm_dims_for(int(target)).state_bytes() - target) / target < 0.3
    a, b = tiny("mixed"), tiny("mixed")
    assert same_state(a.state, b.state) and a.nbytes == b.nbytes
    assert isinstance(a.state["config"]["mesh"], tuple) and a.state["dataloader"]["sampler_seed"][:2] == b"\x00\x01"
    assert len(a.state["optim"]["param_groups"]) == 4
    mixed = make_mixed_state(llm_dims_for(1 << 20), 10)
    assert state_bytes(mixed)[1] == state_bytes(mixed["model"])[1] * 5 + 10 + 1  # + rng state tensor


def test_measure_and_residency(tmp_path: Path) -> None:
    f = tmp_path / "x.bin"
    f.write_bytes(b"\x01" * (1 << 20))
    method = make_cold([f], "fadvise")
    assert method == "fadvise"
    before = resident_fraction([f])
    f.read_bytes()
    assert before is not None and resident_fraction([f]) == 1.0
    assert resident_fraction([tmp_path / "none"]) is None
    with measure() as u:
        m = mmap.mmap(-1, 64 << 20)  # fresh pages (an allocator may hand out memory already resident)
        m.write(b"\x01" * (64 << 20))
        m.close()
    assert u.wall_secs > 0 and u.cpu_secs >= 0
    assert u.peak_extra_rss_bytes is None or u.peak_extra_rss_bytes >= (32 << 20)


def test_break_even_interpolates_the_last_crossing_and_says_when_it_is_out_of_range() -> None:
    """A curve already below the direct restore at the smallest T has no break-even in range (it used to
    be reported as "break-even 0.00 s"); one noisy low point before the curve rises again is not it."""
    assert break_even(1.0, [(0.0, 2.0), (1.0, 1.5), (2.0, 0.5)]).secs == pytest.approx(1.5)
    assert break_even(1.0, [(0.0, 0.9), (1.0, 2.0), (2.0, 0.5)]).secs == pytest.approx(1 + 1 / 1.5)
    below = break_even(1.0, [(0.0, 0.5), (0.5, 0.2)])
    assert (below.secs, below.where) == (None, "below") and "no slower at every T, from T = 0.00 s" in below.sentence()
    above = break_even(1.0, [(0.0, 3.0), (2.5, 2.0)])
    assert (above.secs, above.where) == (None, "above") and "still slower at T = 2.50 s" in above.sentence()


def test_prefetch_grid_spans_the_prefetch_time_of_a_restart_process(tmp_path: Path) -> None:
    """Without explicit Ts, the init times are multiples of how long prefetch() took in the first restart
    process (not in the benchmark process, where it was 3x faster and the grid ended before the
    prefetch did), so the largest T is past the end of the prefetch."""
    rec = Recorder(tmp_path / "out", prefix="prefetch", echo=lambda _: None)
    res = run_prefetch(rec, tiny("llm"), tmp_path, repeats=2, cold="fadvise", factors=(0.0, 0.5, 1.5), init_secs=None,
                       io=None, progress=Progress(8, enabled=False))  # fmt: skip
    restarts = [r for r in records(tmp_path / "out", "prefetch") if r["kind"] == "restart"]
    assert len(restarts) == 2 + 2 * 3 and len(res.direct_secs) == 2
    first = restarts[0]
    assert first["mode"] == "prefetch" and first["init_secs"] == 0.0
    ts = sorted(res.prefetch_secs)
    assert ts == [0.0, round(0.5 * first["prefetch_done_secs"], 3), round(1.5 * first["prefetch_done_secs"], 3)]
    assert all(len(v) == 2 for v in res.prefetch_secs.values())
    assert res.break_even is not None and res.break_even.hi_secs == ts[-1]
    assert any(line.startswith("Break-even: ") for line in res.lines())
