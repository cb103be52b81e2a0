"""Evicted copies are deleted beside the tiers' workers (tierckpt/background/reclaim.py), overlapping the next
copy, with the two rules that keep what deleting them on the worker gave: a later save's outcome resolves
only once the earlier evictions' files are gone, and a full device waits for the deletions in flight
before it makes room (or, with ``on_full: fail``, fails)."""

from __future__ import annotations

import threading
from collections.abc import Callable
from concurrent.futures import TimeoutError as FutureTimeout
from contextlib import AbstractContextManager
from pathlib import Path

import pytest
import torch

from tierckpt import Hierarchy
from tierckpt.io import make_engine
from tierckpt.testing import FaultyTier
from tierckpt.tiers.local import LocalTier

MiB = 1 << 20


def state(step: int, mib: int) -> dict[str, torch.Tensor]:
    return {"w": torch.full((mib * MiB,), step, dtype=torch.uint8)}


def test_a_later_save_resolves_once_the_earlier_evictions_are_deleted(tmp_path: Path) -> None:
    gate = threading.Event()
    eng = make_engine("threads", 2)
    ssd = FaultyTier(LocalTier("ssd", tmp_path / "ssd", eng), gates={"reclaim": gate})
    try:
        with Hierarchy([ssd], policy={"keep": {"ssd": 1}}) as h:
            try:  # the gate opens before close(), which waits for the deletions queued
                h.save(state(1, 1), step=1, blocking=True)
                h.save(state(2, 1), step=2, blocking=True)  # evicts step 1: its deletion waits at the gate
                handle = h.save(state(3, 1), step=3)
                with pytest.raises(FutureTimeout):  # written and committed, but step 1's files are still there
                    handle.durable["ssd"].result(timeout=0.5)
                assert (tmp_path / "ssd" / "step-000000000001").exists()
            finally:
                gate.set()
            handle.wait()
            assert not (tmp_path / "ssd" / "step-000000000001").exists()
            assert [c.step for c in h.checkpoints()] == [3]
    finally:
        eng.close()


@pytest.mark.root
def test_a_full_device_waits_for_the_deletions_in_flight(
    tmp_path: Path, mount_tmpfs: Callable[[Path, int], AbstractContextManager[Path]]
) -> None:
    """Two 40 MiB copies fit on the 100 MiB device, three do not: step 3 starts while step 1's files are
    still being deleted, and nothing else can make room (step 2 is the only copy, ``on_full: fail``)."""
    with mount_tmpfs(tmp_path / "dev", 100 * MiB) as dev:
        gate = threading.Event()
        eng = make_engine("threads", 2)
        ssd = FaultyTier(LocalTier("ssd", dev, eng, chunk_bytes=4 * MiB), gates={"reclaim": gate})
        timer = threading.Timer(0.3, gate.set)
        try:
            with Hierarchy([ssd], policy={"keep": {"ssd": 1}, "on_full": {"ssd": "fail"}}) as h:
                try:  # the gate opens before close(), which waits for the deletions queued
                    h.save(state(1, 40), step=1, blocking=True)
                    h.save(state(2, 40), step=2, blocking=True)  # evicts step 1: its deletion waits at the gate
                    timer.start()
                    h.save(state(3, 40), step=3).wait()  # no room until the deletion goes through: it waits
                finally:
                    gate.set()
                assert [c.step for c in h.checkpoints()] == [3]
                assert h.restore()["w"][0].item() == 3
        finally:
            timer.cancel()
            eng.close()
