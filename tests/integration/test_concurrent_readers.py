"""Readers while another process saves and evicts on the same tiers (issue 19, item 5): an evaluation
job following a training run. docs/restore.md, "What a reader sees": every restore returns exactly one
saved state, never a mix, and a healthy copy is never reported damaged because it went away."""

from __future__ import annotations

import json
import subprocess
import sys
import textwrap
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
import torch

from tierckpt import CheckpointNotFoundError, Hierarchy

WRITER = textwrap.dedent(
    """
    import json, pathlib, sys
    import torch
    from tierckpt import Hierarchy

    cfg, stop = json.loads(sys.argv[1]), pathlib.Path(sys.argv[2])
    with Hierarchy.from_config(cfg) as h:
        for step in range(1, 100000):
            for version in (0, 1):  # version 1: the same step saved again (its copies are swapped)
                v = step * 10 + version
                state = {"a": torch.full((100000,), v, dtype=torch.int64), "b": torch.full((100000,), float(v)),
                         "c": torch.full((5,), v, dtype=torch.int16), "step": step, "version": version}
                h.save(state, step=step, blocking=True).wait()
            print(step, flush=True)
            if stop.exists():
                break
    """
)


def config(tmp_path: Path) -> dict[str, Any]:
    return {
        "tiers": [
            {"name": "ssd", "kind": "local", "path": str(tmp_path / "ssd")},
            {"name": "pfs", "kind": "pfs", "path": str(tmp_path / "pfs")},
        ],
        "io": {"engine": "threads"},
        "layout": {"blob_size": "1MiB"},  # two blobs: a reader opens several files per copy
        "policy": {"keep": {"ssd": 1, "pfs": 1}},
    }


def check(state: dict[str, Any], step: int) -> None:
    """``state`` is exactly what the writer saved as ``step`` (one of its two versions)."""
    v = step * 10 + state["version"]
    assert state["step"] == step and state["version"] in (0, 1)
    assert torch.equal(state["a"], torch.full((100000,), v, dtype=torch.int64))
    assert torch.equal(state["b"], torch.full((100000,), float(v)))
    assert torch.equal(state["c"], torch.full((5,), v, dtype=torch.int16))


def target() -> dict[str, Any]:
    return {
        "a": torch.zeros(100000, dtype=torch.int64),
        "b": torch.zeros(100000),
        "c": torch.zeros(5, dtype=torch.int16),
        "step": -1,
        "version": -1,
    }


def test_a_reader_beside_a_writer_that_evicts_and_saves_again(tmp_path: Path) -> None:
    cfg, stop = config(tmp_path), tmp_path / "stop"
    writer = subprocess.Popen(
        [sys.executable, "-c", WRITER, json.dumps(cfg), str(stop)], stdout=subprocess.PIPE, text=True
    )
    try:
        assert writer.stdout is not None and writer.stdout.readline().strip() == "1", "the writer did not start"
        first_seen, last_seen, missing = None, 0, 0
        newest: dict[str, int] = {}
        with Hierarchy.from_config(cfg, readonly=True) as h:
            deadline = time.monotonic() + 90
            for i in range(200):
                assert time.monotonic() < deadline, f"only {i} restores in 90 s"
                mode = i % 5
                if mode == 0:
                    state = h.restore()
                elif mode == 1:
                    state = h.restore(tier="pfs")
                elif mode == 2:
                    state = h.restore(into=target())
                elif mode == 3:  # an explicit step, listed a moment ago: restored, or evicted meanwhile
                    listed = h.checkpoints()
                    try:
                        state = h.restore(step=listed[-1].step)
                    except CheckpointNotFoundError as e:
                        assert "evicted or replaced" in str(e) or "is not committed" in str(e), e
                        missing += 1
                        continue
                else:
                    bad = [(s, t, e) for s, t, e in h.verify() if e is not None]
                    assert not bad, bad
                    continue
                step, tier = h.last_restore
                assert tier == "pfs" if mode == 1 else tier in ("ssd", "pfs")
                check(state, step)
                assert step >= newest.get(tier, 0), (tier, step, newest)  # a tier never goes back to an evicted step
                newest[tier] = step
                first_seen = step if first_seen is None else first_seen
                last_seen = max(last_seen, step)
        assert last_seen - first_seen >= 3, "the writer made too little progress to test anything"
    finally:
        stop.touch()
        writer.communicate(timeout=60)
    assert writer.returncode == 0


def restore_after(h: Hierarchy, action: Callable[[], object], monkeypatch: pytest.MonkeyPatch) -> Any:
    """``h.restore()``, with ``action`` run after the copy is opened and before its blobs are read."""
    import tierckpt.datapath.restore as r

    real = r._read_blobs

    def then_act(*a: Any) -> Any:
        action()
        return real(*a)

    with monkeypatch.context() as m:
        m.setattr(r, "_read_blobs", then_act)
        return h.restore()


@pytest.mark.parametrize("kind", ["local", "pfs"])
def test_a_copy_replaced_or_evicted_after_it_is_opened_is_still_read_whole(
    tmp_path: Path, kind: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Deterministic form of the race: the copy is opened, then (between opening and reading) the
    step is saved again, or evicted; the reader returns the copy it opened."""
    cfg = {"tiers": [{"name": "t", "kind": kind, "path": str(tmp_path / "t")}], "io": {"engine": "threads"}}
    with Hierarchy.from_config(cfg) as w, Hierarchy.from_config(cfg, readonly=True) as h:
        w.save({"a": torch.full((5000,), 1.0), "step": 1}, step=1).wait()
        again = restore_after(h, lambda: w.save({"a": torch.full((5000,), 2.0), "step": 1}, step=1).wait(), monkeypatch)
        assert torch.equal(again["a"], torch.full((5000,), 1.0))  # the copy opened, not the one swapped in
        assert torch.equal(h.restore()["a"], torch.full((5000,), 2.0))
        evicted = restore_after(h, lambda: w.tier("t").evict(w.tier("t").list_committed()[0]), monkeypatch)
        assert torch.equal(evicted["a"], torch.full((5000,), 2.0)) and h.checkpoints() == []
