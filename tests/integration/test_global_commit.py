"""The global commit per tier (docs/distributed.md): ranks as threads of one process, agreeing through a
StoreCoordinator on an in-process HashStore; two simulated nodes, each with its own node-local tier
directory, and one shared pfs directory."""

from __future__ import annotations

import contextlib
import os
import re
import shutil
import threading
import time
from pathlib import Path
from typing import Any

import pytest
import torch
import torch.distributed as dist

from tierckpt import CheckpointNotFoundError, Hierarchy
from tierckpt.errors import CoordinationError, TierckptError
from tierckpt.format.record import decode_record
from tierckpt.io import make_engine
from tierckpt.ranks.distributed import StoreCoordinator
from tierckpt.testing import FaultyTier
from tierckpt.tiers.host import HostTier
from tierckpt.tiers.local import LocalTier
from tierckpt.tiers.pfs import PfsTier

N = 4  # ranks; ranks 0-1 on node 0, 2-3 on node 1
MiB = 1 << 20


@pytest.fixture
def engine() -> Any:
    eng = make_engine("threads", 4)
    yield eng
    eng.close()


def job(tmp_path: Path, run_ranks: Any, timeout: float = 20.0) -> list[StoreCoordinator]:
    store = dist.HashStore()
    return run_ranks(N, lambda r: StoreCoordinator(store, r, N, timeout=timeout, node=r // 2))


def open_rank(tmp_path: Path, c: StoreCoordinator, engine: Any, *, pfs: Any = None, **kw: Any) -> Hierarchy:
    tiers = [
        HostTier("host", 64 * MiB),
        LocalTier("ssd", tmp_path / f"node{c.node}" / "ssd", engine, job="j"),
        pfs or PfsTier("pfs", tmp_path / "pfs", engine, job="j"),
    ]
    return Hierarchy(tiers, coordinator=c, job="j", **kw)


def state(rank: int, step: int) -> dict[str, Any]:
    return {"w": torch.full((1000,), float(100 * step + rank)), "step": step}


def test_every_tier_lists_a_step_once_every_ranks_copy_is_in(tmp_path: Path, run_ranks: Any, engine: Any) -> None:
    cs = job(tmp_path, run_ranks)

    def body(r: int) -> Any:
        with open_rank(tmp_path, cs[r], engine) as h:
            for step in (1, 2, 3):
                h.save(state(r, step), step=step).wait()
            listed = [(c.step, c.tiers) for c in h.checkpoints()]
            got = h.restore()
            return listed, got["w"][0].item(), got["step"], h.last_restore

    out = run_ranks(N, body)
    for r, o in enumerate(out):
        assert not isinstance(o, BaseException), o
        listed, w, step, last = o
        assert listed == out[0][0] and listed[-1] == (3, ("host", "ssd", "pfs"))
        assert (w, step, last) == (300 + r, 3, (3, "host"))
    step_dir = tmp_path / "pfs" / "step-000000000003"
    assert sorted(os.listdir(step_dir)) == ["commit", *(f"rank-{r:05d}" for r in range(N))]
    record = decode_record((step_dir / "commit").read_bytes(), 3)
    assert record.world_size == N
    for node in (0, 1):  # a node-local directory holds its own ranks' copies and the step's record
        here = sorted(os.listdir(tmp_path / f"node{node}" / "ssd" / "step-000000000003"))
        assert here == ["commit", f"rank-{2 * node:05d}", f"rank-{2 * node + 1:05d}"]


def test_a_failed_copy_fails_the_step_on_every_rank_and_leaves_nothing(
    tmp_path: Path, run_ranks: Any, engine: Any
) -> None:
    cs = job(tmp_path, run_ranks)

    def body(r: int) -> Any:
        pfs: Any = PfsTier("pfs", tmp_path / "pfs", engine, job="j")
        if r == 2:  # rank 2's pfs copy of its first save fails
            pfs = FaultyTier(pfs, fail={"commit": OSError(28, "No space left on device")})
        with open_rank(tmp_path, cs[r], engine, pfs=pfs) as h:
            first = h.save(state(r, 1), step=1)
            with pytest.raises((TierckptError, OSError)) as ei:  # the injected error on rank 2
                first.wait()
            err = first.durable["pfs"].exception()
            assert ei.value is err or ei.value.__cause__ is err or "pfs" in str(ei.value)
            first.durable["ssd"].result(timeout=30)
            if r == 2:
                pfs.fail.clear()
            h.save(state(r, 2), step=2).wait()
            return err, [(c.step, c.tiers) for c in h.checkpoints()]

    out = run_ranks(N, body)
    assert not [o for o in out if isinstance(o, BaseException)], out
    for r, (err, listed) in enumerate(out):
        assert isinstance(err, OSError if r == 2 else TierckptError), err
        if r != 2:
            assert "ranks [2]" in str(err)
        assert listed == [(1, ("host", "ssd")), (2, ("host", "ssd", "pfs"))]
    assert not (tmp_path / "pfs" / "step-000000000001").exists()  # every rank removed its copy


def test_a_rank_that_never_commits_fails_the_step_within_the_timeout(
    tmp_path: Path, run_ranks: Any, engine: Any
) -> None:
    cs = job(tmp_path, run_ranks, timeout=3.0)

    def body(r: int) -> Any:
        pfs = PfsTier("pfs", tmp_path / "pfs", engine, job="j")
        with Hierarchy([pfs], coordinator=cs[r], job="j") as h:
            if r != 3:  # rank 3 is hung: it never saves step 1
                t0 = time.monotonic()
                first = h.save(state(r, 1), step=1)
                with pytest.raises(CoordinationError):
                    first.wait()
                err = first.durable["pfs"].exception()
                took = time.monotonic() - t0
            else:
                err, took = None, 0.0
                time.sleep(3.5)  # past the others' timeout: they give up step 1, then wait for it at step 2
            h.save(state(r, 2), step=2).wait()  # back: the next save commits on every rank
            return err, took, [c.step for c in h.checkpoints()]

    out = run_ranks(N, body)
    for r, (err, took, listed) in enumerate(out):
        if r != 3:
            assert isinstance(err, CoordinationError) and err.ranks == (3,), err
            # the meaning, not the clock: rank 3 named as missing, after the configured timeout (the
            # figure of the wait itself is the clock's, 3.1 s on a loaded machine)
            assert re.search(r"rank\(s\) 3 did not arrive within [0-9.]+ s \(rank 0 waited; timeout 3 s\)", str(err))
            assert took < 30
        assert listed == [2]
    assert not (tmp_path / "pfs" / "step-000000000001").exists()


def test_a_copy_the_record_does_not_name_is_refused_and_orphans_are_swept(
    tmp_path: Path, run_ranks: Any, engine: Any
) -> None:
    cs = job(tmp_path, run_ranks)

    def save(r: int) -> None:
        with Hierarchy([PfsTier("pfs", tmp_path / "pfs", engine, job="j")], coordinator=cs[r], job="j") as h:
            h.save(state(r, 1), step=1).wait()
            h.save(state(r, 2), step=2).wait()

    assert run_ranks(N, save) == [None] * N
    pfs = tmp_path / "pfs"
    # rank 1's copy of step 2 replaced by its copy of step 1 (as a save whose commit never completed would)
    shutil.rmtree(pfs / "step-000000000002" / "rank-00001")
    shutil.copytree(pfs / "step-000000000001" / "rank-00001", pfs / "step-000000000002" / "rank-00001")
    reader = PfsTier("pfs", pfs, engine, readonly=True)
    with (
        Hierarchy([reader], rank=1, world_size=N, readonly=True) as h,
        pytest.raises(CheckpointNotFoundError, match="rank 1's copy is not the one the step's commit record names"),
    ):
        h.restore(step=2)
    # a step whose record never came: never listed, and the next save's retention removes it
    shutil.copytree(pfs / "step-000000000001" / "rank-00000", pfs / "step-000000000009" / "rank-00000")
    with Hierarchy([PfsTier("pfs", pfs, engine, readonly=True)], readonly=True) as h:
        assert [c.step for c in h.checkpoints()] == [1, 2]

    def again(r: int) -> Any:
        with Hierarchy([PfsTier("pfs", pfs, engine, job="j")], coordinator=cs[r], job="j") as h:
            h.save(state(r, 3), step=3).wait()
            return [c.step for c in h.checkpoints()]

    assert run_ranks(N, again) == [[1, 2, 3]] * N
    assert not (pfs / "step-000000000009").exists()


def test_a_node_that_lost_its_local_copies_reads_the_shared_tier_and_every_rank_restores_one_step(
    tmp_path: Path, run_ranks: Any, engine: Any
) -> None:
    cs = job(tmp_path, run_ranks)
    policy = {"demote": {"pfs": {"every": 2}}}  # pfs gets steps 2 and 4; the ssd every step

    def save(r: int) -> None:
        with open_rank(tmp_path, cs[r], engine, policy=policy) as h:
            for step in (1, 2, 3):
                h.save(state(r, step), step=step).wait()

    assert run_ranks(N, save) == [None] * N
    shutil.rmtree(tmp_path / "node1")  # node 1 was replaced: its SSD is empty
    again = job(tmp_path, run_ranks)  # the restarted job

    def restore(r: int) -> Any:
        with open_rank(tmp_path, again[r], engine, policy=policy) as h:
            got = h.restore()
            return got["step"], got["w"][0].item(), h.last_restore

    out = run_ranks(N, restore)
    # node 0 holds step 3 on its SSD, node 1 only what the pfs has: every rank restores step 2
    assert out == [(2, 200.0 + r, (2, "ssd" if r < 2 else "pfs")) for r in range(N)]


def test_a_steady_state_save_costs_one_gather_per_tier_commit(tmp_path: Path, run_ranks: Any, engine: Any) -> None:
    """Evictions from the shared tier ride on the commits' gathers: no other collective per save."""
    cs = job(tmp_path, run_ranks)
    calls: list[list[str]] = [[] for _ in range(N)]
    for r, c in enumerate(cs):
        for name in ("gather", "decide", "barrier", "broadcast", "all_gather", "agree_step"):
            real = getattr(c, name)

            def counted(*a: Any, _real: Any = real, _name: str = name, _r: int = r, **k: Any) -> Any:
                calls[_r].append(_name)
                return _real(*a, **k)

            setattr(c, name, counted)
    policy = {"keep": {"host": 1, "ssd": 1, "pfs": 1}}

    def body(r: int) -> Any:
        with open_rank(tmp_path, cs[r], engine, policy=policy) as h:
            for step in (1, 2, 3, 4):
                h.save(state(r, step), step=step).wait()
            return [(c.step, c.tiers) for c in h.checkpoints() if c.tiers]

    out = run_ranks(N, body)
    assert out == [[(4, ("host", "ssd", "pfs"))]] * N
    assert calls == [["gather"] * 12] * N  # 4 saves x 3 tiers
    assert sorted(p.name for p in (tmp_path / "pfs").glob("step-*")) == ["step-000000000004"]


def test_a_read_only_evaluation_process_follows_a_job_that_saves_and_evicts(
    tmp_path: Path, run_ranks: Any, engine: Any
) -> None:
    """An evaluator (one process, read-only, rank 0's view) restores while 4 ranks save and evict: it
    only ever sees committed steps, each whole, never going back."""
    import threading

    cs = job(tmp_path, run_ranks)
    stop = threading.Event()
    seen: list[int] = []
    errors: list[BaseException] = []

    def evaluate() -> None:
        try:
            pfs = PfsTier("pfs", tmp_path / "pfs", engine, readonly=True)
            with Hierarchy([pfs], readonly=True) as h:
                while not stop.is_set():
                    try:
                        got = h.restore()
                    except CheckpointNotFoundError:
                        continue  # nothing committed yet, or the step went away while it was opened
                    assert got["w"][0].item() == 100 * got["step"], got["step"]  # rank 0's part, whole
                    assert not seen or got["step"] >= seen[-1]
                    seen.append(got["step"])
        except BaseException as e:
            errors.append(e)

    (tmp_path / "pfs").mkdir()
    evaluator = threading.Thread(target=evaluate, daemon=True)
    evaluator.start()

    def body(r: int) -> None:
        pfs = PfsTier("pfs", tmp_path / "pfs", engine, job="j")
        with Hierarchy([HostTier("host", 64 * MiB), pfs], coordinator=cs[r], job="j", policy={"keep": {"pfs": 2}}) as h:
            for step in range(1, 9):
                h.save(state(r, step), step=step).wait()
                time.sleep(0.05)

    try:
        assert run_ranks(N, body) == [None] * N
    finally:
        stop.set()
        evaluator.join(30)
    assert not errors, errors
    assert seen and seen[-1] >= 6, seen


def test_a_full_shared_tier_unlists_the_step_whose_copy_a_rank_evicts_for_room(
    tmp_path: Path, run_ranks: Any, engine: Any
) -> None:
    """A full shared tier makes a rank evict its oldest copy there that another tier holds: the step's
    record goes with it (a record naming a gone copy would list a step some rank cannot read), and the
    other ranks' copies of it are orphans that their retention removes. Whatever the ranks' races for
    room (a save may fail on the full tier), every step the shared tier lists is readable there by
    every rank."""
    cs = job(tmp_path, run_ranks)
    big = 64 << 10  # 256 KiB a rank

    def body(r: int) -> Any:
        pfs = PfsTier("pfs", tmp_path / "pfs", engine, job="j", capacity_bytes=5 * N * (big * 4 + 8192) // 2)
        tiers = [LocalTier("ssd", tmp_path / f"node{cs[r].node}" / "ssd", engine, job="j"), pfs]
        with Hierarchy(tiers, coordinator=cs[r], job="j") as h:
            for step in range(1, 7):
                with contextlib.suppress(TierckptError):  # the tier may be full for this rank's copy
                    h.save({"w": torch.full((big,), float(100 * step + r))}, step=step).wait()
            with contextlib.suppress(TierckptError):
                h.wait()
            on_pfs = [c.step for c in h.checkpoints() if "pfs" in c.tiers]
            read = [h.restore(s, tier="pfs")["w"][0].item() for s in on_pfs]
            return on_pfs, read

    out = run_ranks(N, body)
    for r, o in enumerate(out):
        assert not isinstance(o, BaseException), o
        on_pfs, read = o
        assert on_pfs == out[0][0] and len(on_pfs) < 6, on_pfs  # some step was evicted for room
        assert read == [float(100 * s + r) for s in on_pfs]


def test_a_rank_that_cannot_write_its_nodes_record_leaves_the_committed_step_as_it_is(
    tmp_path: Path, run_ranks: Any, engine: Any
) -> None:
    """The commit of step 1 on the ssd is decided for every rank; rank 1 (node 0) fails to write its
    node's record (EIO), after rank 0 wrote the same record and returned (a DCP save durable on the ssd
    returns there). Rank 1's save fails on the ssd, but neither the record rank 0 wrote nor rank 1's copy
    it names is removed: every rank lists and restores step 1 from its node's ssd. Before, rank 1
    removed the record and its copy, undoing a commit rank 0 had returned on."""
    cs = job(tmp_path, run_ranks)
    written = threading.Event()

    def body(r: int) -> Any:
        ssd: Any = LocalTier("ssd", tmp_path / f"node{cs[r].node}" / "ssd", engine, job="j")
        if r == 1:
            ssd = FaultyTier(
                ssd, fail={"write_record": OSError(5, "Input/output error")}, gates={"write_record": written}
            )
        tiers = [HostTier("host", 64 * MiB), ssd, PfsTier("pfs", tmp_path / "pfs", engine, job="j")]
        with Hierarchy(tiers, coordinator=cs[r], job="j") as h:
            handle = h.save(state(r, 1), step=1)
            err = handle.durable["ssd"].exception(timeout=30)
            if r == 0:
                written.set()
            handle.durable["pfs"].result(timeout=30)
            with contextlib.suppress(Exception):
                handle.wait()
            cs[r].barrier()  # every rank's record write is over
            got = h.restore(tier="ssd")  # every rank: the ranks agree on the step
            return err, [(c.step, c.tiers) for c in h.checkpoints()], got

    out = run_ranks(N, body)
    assert not [o for o in out if isinstance(o, BaseException)], out
    errors = [o[0] for o in out]
    assert errors[0] is None and errors[2] is None and errors[3] is None, errors
    assert isinstance(errors[1], OSError), errors
    for r in range(N):
        _, listed, got = out[r]
        assert listed == [(1, ("host", "ssd", "pfs"))], (r, listed)
        assert torch.equal(got["w"], state(r, 1)["w"]), r
    here = sorted(os.listdir(tmp_path / "node0" / "ssd" / "step-000000000001"))
    assert here == ["commit", "rank-00000", "rank-00001"], here
