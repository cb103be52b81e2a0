"""The background mover: lazy saves, demotion cadence, order per tier, retention safety, backpressure, prefetch."""

from __future__ import annotations

import threading
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
import torch

from tierckpt import Hierarchy, TierFullError
from tierckpt.testing import FaultyTier
from tierckpt.tiers.host import HostTier
from tierckpt.tiers.local import LocalTier
from tierckpt.tiers.pfs import PfsTier

MiB = 1 << 20


def steps_on(h: Hierarchy, tier: str) -> list[int]:
    return [k.step for k in h.tier(tier).list_committed()]


def test_issue_policy_example(chain_config: Callable[..., dict[str, Any]], tmp_path: Path) -> None:
    """keep {host: 1, ssd: 2}, demote {pfs: every 5}: after steps 1..10, host 10, ssd 9-10, pfs 5 and 10."""
    with Hierarchy.from_config(chain_config(keep={"host": 1, "ssd": 2}, demote={"pfs": {"every": 5}})) as h:
        handles = [h.save({"w": torch.full((1000,), float(s)), "step": s}, step=s) for s in range(1, 11)]
        assert set(handles[4].durable) == {"host", "ssd", "pfs"}
        assert set(handles[5].durable) == {"host", "ssd"}
        h.wait()
        assert steps_on(h, "host") == [10]
        assert steps_on(h, "ssd") == [9, 10]
        assert steps_on(h, "pfs") == [5, 10]
        assert [(c.step, c.tiers) for c in h.checkpoints()] == [
            (5, ("pfs",)), (9, ("ssd",)), (10, ("host", "ssd", "pfs")),
        ]  # fmt: skip
        assert h.checkpoints()[-1].states == {"host": "committed", "ssd": "committed", "pfs": "committed"}
        assert all(err is None for _, _, err in h.verify())
        assert h.restore(step=5)["step"] == 5


def test_staged_snapshot_holds_pre_mutation_values(chain_config: Callable[..., dict[str, Any]], tmp_path: Path) -> None:
    """Parameters mutated in place right after ``staged`` resolves: the checkpoint has the old values."""
    torch.manual_seed(0)
    model = torch.nn.Sequential(*[torch.nn.Linear(512, 512) for _ in range(8)])  # ~8 MiB
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    model(torch.randn(4, 512)).sum().backward()
    opt.step()
    with Hierarchy.from_config(chain_config()) as h:
        before = {k: v.clone() for k, v in model.state_dict().items()}
        handle = h.save({"model": model.state_dict(), "optim": opt.state_dict()}, step=1)
        handle.staged.result()
        with torch.no_grad():
            for p in model.parameters():
                p.add_(1.0)  # what optimizer.step() would do
        handle.wait()
        for tier in ("host", "ssd", "pfs"):
            got = h.restore(step=1, tier=tier)["model"]
            assert all(torch.equal(got[k], before[k]) for k in before), tier


def test_save_returns_before_the_copy_and_blocking_waits(tmp_path: Path) -> None:
    gate = threading.Event()
    host = FaultyTier(HostTier("host"), gates={"reserve": gate})
    with Hierarchy([host, LocalTier("ssd", tmp_path / "ssd", _engine())]) as h:
        try:
            handle = h.save({"w": torch.ones(1 << 20)}, step=1)
            assert not handle.staged.done() and not handle.durable["ssd"].done()
            # the host tier's worker marks the step "writing" when it picks the job up, which may be
            # a moment after save() returns: wait for that (bounded), then look
            deadline = time.monotonic() + 30
            while (states := h.checkpoints()[0].states)["host"] == "pending" and time.monotonic() < deadline:
                time.sleep(0.005)
            assert not handle.staged.done()
        finally:
            gate.set()
        assert states == {"host": "writing", "ssd": "pending"}
        handle.wait()
        blocking = h.save({"w": torch.ones(8)}, step=2, blocking=True)
        assert blocking.done() and not blocking.errors()


def test_a_handle_settles_without_raising_a_tiers_failure(tmp_path: Path) -> None:
    gate = threading.Event()
    ssd = FaultyTier(
        LocalTier("ssd", tmp_path / "ssd", _engine()), fail={"commit": OSError(5, "EIO")}, gates={"commit": gate}
    )
    with Hierarchy([HostTier("host"), ssd]) as h:
        try:
            handle = h.save({"w": torch.ones(8)}, step=1)
            assert handle.settle(timeout=0.05) is False  # the ssd's commit is held
        finally:
            gate.set()
        assert handle.settle() is True and handle.done()  # the failure is not raised here
        assert set(handle.errors()) == {"ssd"}
        with pytest.raises(OSError, match="EIO"):
            handle.wait()
        assert h.save({"w": torch.ones(8)}, step=2, blocking=True).errors().keys() == {"ssd"}
        with pytest.raises(OSError, match="EIO"):
            h.wait()


def _engine():  # type: ignore[no-untyped-def]
    from tierckpt.io.engine import make_engine

    return make_engine("threads", 4)


def test_saves_keep_their_order_on_a_slow_tier(tmp_path: Path) -> None:
    gate = threading.Event()
    order: list[int] = []
    pfs = FaultyTier(PfsTier("pfs", tmp_path / "pfs", _engine()), gates={"commit": gate})
    real_commit = pfs.inner.reserve

    def reserve(key, blobs):  # type: ignore[no-untyped-def]
        order.append(key.step)
        return real_commit(key, blobs)

    pfs.inner.reserve = reserve  # type: ignore[method-assign]
    with Hierarchy([HostTier("host"), LocalTier("ssd", tmp_path / "ssd", _engine()), pfs]) as h:
        hs = [h.save({"w": torch.full((256,), float(s))}, step=s) for s in range(1, 5)]
        for hd in hs:
            hd.wait(tier="ssd")  # the fast tiers are not held up by the slow one
        assert not hs[0].durable["pfs"].done()
        states = {c.step: c.states["pfs"] for c in h.checkpoints()}
        assert states[1] == "writing" and all(states[s] == "pending" for s in (2, 3, 4))
        gate.set()
        h.wait()
        assert order == [1, 2, 3, 4]
        assert steps_on(h, "pfs") == [1, 2, 3, 4]


def test_upper_copy_stays_until_the_lower_copy_is_committed(tmp_path: Path) -> None:
    gate = threading.Event()
    ssd = FaultyTier(LocalTier("ssd", tmp_path / "ssd", _engine()), gates={"commit": gate})
    with Hierarchy([HostTier("host"), ssd], policy={"keep": {"host": 1}}) as h:
        h.save({"w": torch.ones(64)}, step=1).wait(tier="host")
        h.save({"w": torch.ones(64) * 2}, step=2).wait(tier="host")
        assert steps_on(h, "host") == [1, 2]  # keep 1, but step 1 is not on the ssd yet
        gate.set()
        h.wait()
        assert steps_on(h, "host") == [2]
        assert steps_on(h, "ssd") == [1, 2]


def test_full_host_waits_for_demotion_then_goes_on(tmp_path: Path) -> None:
    """Backpressure: a host tier with room for two checkpoints, a slow SSD: the third save waits for
    room instead of failing, and the host never holds more than its capacity."""
    gate = threading.Event()
    ssd = FaultyTier(LocalTier("ssd", tmp_path / "ssd", _engine()), gates={"commit": gate})
    host = HostTier("host", capacity_bytes=2 * MiB)
    with Hierarchy([host, ssd], policy={"keep": {"host": 1}}) as h:
        state = {"w": torch.ones(MiB // 4)}  # 1 MiB
        h1 = h.save(state, step=1)
        h2 = h.save(state, step=2)
        h2.wait(tier="host")
        h3 = h.save(state, step=3)
        with pytest.raises(TimeoutError):
            h3.staged.result(timeout=0.5)  # waiting for room: steps 1 and 2 are pinned until the ssd has them
        assert host.used_bytes() <= 2 * MiB
        gate.set()
        for hd in (h1, h2, h3):
            hd.wait()
        assert steps_on(h, "host") == [3]
        assert steps_on(h, "ssd") == [1, 2, 3]


def test_full_host_fails_when_asked_to(tmp_path: Path) -> None:
    gate = threading.Event()
    ssd = FaultyTier(LocalTier("ssd", tmp_path / "ssd", _engine()), gates={"commit": gate})
    host = HostTier("host", capacity_bytes=2 * MiB)
    with Hierarchy([host, ssd], policy={"on_full": {"host": "fail"}}) as h:
        state = {"w": torch.ones(MiB // 4)}
        h.save(state, step=1).wait(tier="host")
        h.save(state, step=2).wait(tier="host")
        h3 = h.save(state, step=3)
        with pytest.raises(TierFullError):
            h3.durable["host"].result(timeout=30)  # refused at once: steps 1 and 2 are pinned
        gate.set()
        h3.staged.result(timeout=30)  # the host refused it, so it was packed straight into the ssd
        with pytest.raises(TierFullError):
            h3.wait()
        h.wait()  # h3's failure was observed through its handle: the hierarchy has nothing more to raise
        assert steps_on(h, "ssd") == [1, 2, 3]


def test_full_single_memory_tier_fails_instead_of_waiting_forever() -> None:
    with Hierarchy([HostTier("host", capacity_bytes=MiB)]) as h:
        h.save({"w": torch.ones(MiB // 6)}, step=1).wait()
        h2 = h.save({"w": torch.ones(MiB // 6)}, step=2)
        with pytest.raises(TierFullError):
            h2.wait(timeout=30)
        assert h.restore()["w"].shape == (MiB // 6,)


def test_prefetch_climbs_and_restore_reads_memory(chain_config: Callable[..., dict[str, Any]], tmp_path: Path) -> None:
    with Hierarchy.from_config(chain_config(keep={"host": 1, "ssd": 1})) as h:
        for s in (1, 2, 3):
            h.save({"w": torch.full((4096,), float(s))}, step=s)
        h.wait()
        assert steps_on(h, "pfs") == [1, 2, 3] and steps_on(h, "host") == [3]
        fut = h.prefetch(step=1)
        assert fut.result(timeout=60) == "host"
        assert 1 in steps_on(h, "host")
        h.wait()  # the ssd's copy is made from the host's, after it
        assert 1 in steps_on(h, "ssd")
        assert torch.equal(h.restore(step=1)["w"], torch.full((4096,), 1.0))
        assert h.last_restore == (1, "host")
        assert h.prefetch(step=3).result(timeout=5) == "host"  # already there
        assert h.prefetch(step=2, to="ssd").result(timeout=60) == "ssd"
        assert 2 not in steps_on(h, "host")
        with pytest.raises(Exception, match="not committed"):
            h.prefetch(step=99).result(timeout=5)


def test_prefetch_reads_the_source_once_and_fills_the_tiers_between_from_the_top(
    chain_config: Callable[..., dict[str, Any]],
) -> None:
    with Hierarchy.from_config(chain_config(keep={"host": 1, "ssd": 1})) as h:
        for s in (1, 2):
            h.save({"w": torch.full((4096,), float(s))}, step=s)
        h.wait()
    with Hierarchy.from_config(chain_config()) as h:  # a new process: host empty, step 1 only on pfs
        assert [(c.step, c.tiers) for c in h.checkpoints()] == [(1, ("pfs",)), (2, ("ssd", "pfs"))]
        reads: list[str] = []
        for t in h.tiers:
            t.open_copy = lambda key, _o=t.open_copy, _n=t.name: (reads.append(_n), _o(key))[1]  # type: ignore[method-assign]
        gate = threading.Event()
        ssd = h.tier("ssd")
        ssd.reserve = lambda *a, _r=ssd.reserve: (gate.wait(30), _r(*a))[1]  # type: ignore[method-assign]
        assert h.prefetch(step=1).result(timeout=60) == "host"  # the host's copy does not wait for the ssd's
        assert steps_on(h, "host") == [1] and steps_on(h, "ssd") == [2]
        gate.set()
        h.wait()
        assert steps_on(h, "ssd") == [1, 2]
        assert reads == ["pfs", "host"]  # pfs read once (→ host), the ssd filled from host memory
        assert torch.equal(h.restore(step=1, tier="ssd")["w"], torch.full((4096,), 1.0))


def test_restore_from_lower_tier_promotes_when_asked(
    chain_config: Callable[..., dict[str, Any]], tmp_path: Path
) -> None:
    with Hierarchy.from_config(chain_config()) as h:
        h.save({"w": torch.ones(16)}, step=1).wait()
    with Hierarchy.from_config(chain_config(promote={"on_restore": True})) as h:  # a new process: host is empty
        assert h.checkpoints()[0].tiers == ("ssd", "pfs")
        h.restore()
        assert h.last_restore == (1, "ssd")
        h.wait()
        assert h.checkpoints()[0].tiers == ("host", "ssd", "pfs")


def test_on_close_flushes_the_newest_checkpoint(chain_config: Callable[..., dict[str, Any]], tmp_path: Path) -> None:
    with Hierarchy.from_config(chain_config(demote={"pfs": {"on_close": True}})) as h:
        for s in (1, 2, 3):
            h.save({"w": torch.full((16,), float(s))}, step=s)
        h.wait()
        assert steps_on(h, "pfs") == []
    assert [k.step for k in PfsTier("p", tmp_path / "pfs", _engine()).list_committed()] == [3]


def test_every_secs_cadence(
    chain_config: Callable[..., dict[str, Any]], tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    import tierckpt.hierarchy as hmod

    now = [1000.0]
    monkeypatch.setattr(hmod, "_clock", lambda: now[0])
    with Hierarchy.from_config(chain_config(demote={"pfs": {"every_secs": 60}})) as h:
        sent = []
        for s in range(1, 8):
            now[0] += 25.0
            sent.append("pfs" in h.save({"w": torch.ones(4)}, step=s).durable)
        h.wait()
    assert sent == [False, False, True, False, False, True, False]  # 75 s after the start, then 75 s later


def test_host_reuses_its_buffers_after_a_size_change(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """Steady state allocates nothing: a cached buffer of the wanted size is reused even when the cache
    also holds one of an earlier, different size that has to be dropped to stay within capacity."""
    import tierckpt.tiers.host as host_mod

    allocs: list[int] = []
    real = host_mod.aligned_empty
    monkeypatch.setattr(host_mod, "aligned_empty", lambda n, *a, **k: allocs.append(n) or real(n, *a, **k))
    small, big = {"w": torch.zeros(4 * MiB)}, {"w": torch.zeros(4 * MiB), "m": torch.zeros(8 * MiB)}
    host = HostTier("host", capacity_bytes=3 * 48 * MiB + 3 * 64 * 1024)
    with Hierarchy([host, LocalTier("ssd", tmp_path / "ssd", _engine())], policy={"keep": {"host": 1}}) as h:
        h.save(small, step=0).wait()
        for s in range(1, 8):
            h.save(big, step=s).wait()
    assert [n // MiB for n in allocs] == [16, 48, 48]  # two sets: one committed, one being written
