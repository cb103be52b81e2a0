"""Fixtures shared by the integration tests."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest


@pytest.fixture
def chain_config(tmp_path: Path) -> Callable[..., dict[str, Any]]:
    """A factory: ``chain_config(**policy)`` is the config of host (256 MiB) → ssd (local) → pfs under
    ``tmp_path``, 1 MiB chunks, with that policy."""

    def make(**policy: Any) -> dict[str, Any]:
        return {
            "tiers": [
                {"name": "host", "kind": "host", "capacity": "256MiB"},
                {"name": "ssd", "kind": "local", "path": str(tmp_path / "ssd")},
                {"name": "pfs", "kind": "pfs", "path": str(tmp_path / "pfs")},
            ],
            "io": {"chunk": "1MiB"},
            "policy": policy,
        }

    return make


def _run_ranks(n: int, body: Callable[[int], Any], timeout: float = 60.0) -> list[Any]:
    """``body(rank)`` on ``n`` threads, one a rank; each rank's result, or the exception it raised."""
    import threading

    out: list[Any] = [None] * n

    def one(r: int) -> None:
        try:
            out[r] = body(r)
        except BaseException as e:  # handed to the test
            out[r] = e

    threads = [threading.Thread(target=one, args=(r,), daemon=True) for r in range(n)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout)
    assert not any(t.is_alive() for t in threads), "a rank hung"
    return out


@pytest.fixture
def run_ranks() -> Callable[..., list[Any]]:
    """``run_ranks(n, body)``: a job of ``n`` ranks as threads of this process (see :func:`_run_ranks`)."""
    return _run_ranks


@pytest.fixture
def coordinators() -> Callable[..., list[Any]]:
    """``coordinators(n, timeout=…)``: one StoreCoordinator a rank on an in-process HashStore."""
    import torch.distributed as dist

    from tierckpt.ranks.distributed import StoreCoordinator

    def make(n: int, timeout: float = 20.0) -> list[Any]:
        store = dist.HashStore()
        got = _run_ranks(n, lambda r: StoreCoordinator(store, r, n, timeout=timeout))
        for c in got:
            assert isinstance(c, StoreCoordinator), c
        return got

    return make


@pytest.fixture
def saved_by_ranks(tmp_path: Path) -> Callable[..., Path]:
    """A factory: ``saved_by_ranks(ssd, steps)`` saves ``steps`` from a job of 4 ranks (threads of this
    process agreeing through a StoreCoordinator), ranks 0-1 on node 0 and 2-3 on node 1, each rank's
    state ``{"w": torch.full((1000,), 100 * step + rank)}``, on an ssd directory ``ssd`` under tmp_path
    (its ``{node}`` and ``{rank}`` filled) and one ``pfs`` directory; returns the YAML a tool reads them with."""
    import torch
    import torch.distributed as dist

    from tierckpt import Hierarchy
    from tierckpt.io import make_engine
    from tierckpt.ranks.distributed import StoreCoordinator
    from tierckpt.tiers.local import LocalTier
    from tierckpt.tiers.pfs import PfsTier

    def make(ssd: str, steps: tuple[int, ...] = (1,), n: int = 4) -> Path:
        store = dist.HashStore()
        cs = _run_ranks(n, lambda r: StoreCoordinator(store, r, n, timeout=20.0, node=r // 2))
        engine = make_engine("threads", 4)

        def save(r: int) -> None:
            c = cs[r]
            where = tmp_path / ssd.format(rank=r, node=c.node)
            tiers = [LocalTier("ssd", where, engine, job="j"), PfsTier("pfs", tmp_path / "pfs", engine, job="j")]
            with Hierarchy(tiers, coordinator=c, job="j") as h:
                for step in steps:
                    h.save({"w": torch.full((1000,), float(100 * step + r))}, step=step, blocking=True)

        try:
            assert _run_ranks(n, save) == [None] * n
        finally:
            engine.close()
        yml = tmp_path / "h.yaml"
        yml.write_text(
            f"tiers:\n  - {{name: ssd, kind: local, path: '{ssd}'}}\n  - {{name: pfs, kind: pfs, path: pfs}}\n"
        )
        return yml

    return make
