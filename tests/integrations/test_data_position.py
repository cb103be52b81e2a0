"""The data position as a TrainState part: a plain ``DataLoader`` through :class:`tierckpt.ResumableLoader`
and torchdata's ``StatefulDataLoader``, with worker processes, killed mid-epoch and resumed in new
processes (one rank, and two ranks each with its own loaders), hand out exactly the batches of an
uninterrupted run (tests/integrations/loader_job.py); and ResumableLoader's own rules, in this process."""

from __future__ import annotations

import importlib.util
import json
import signal
from pathlib import Path
from typing import Any

import pytest
import torch
from launch import run_ranks  # tests/integrations/launch.py
from torch.utils.data import DataLoader, DistributedSampler, RandomSampler

from tierckpt import Hierarchy, ResumableLoader, StateError, TrainState

JOB = Path(__file__).with_name("loader_job.py")
CONFIG = """\
tiers:
  - {name: host, kind: host, capacity: 64MiB}
  - {name: ssd, kind: local, path: ssd}
policy:
  keep: {host: 1, ssd: 2}
"""
STEPS = 30  # epochs of 11 batches on one rank, 6 on each of two: a resumed run crosses an epoch boundary
HAS_TORCHDATA = importlib.util.find_spec("torchdata") is not None
LOADERS = "plain,stateful" if HAS_TORCHDATA else "plain"


def _run(d: Path, world: int, *args: str) -> list[int]:
    """loader_job.py on ``world`` ranks (processes) in ``d``; their exit codes."""
    d.mkdir(exist_ok=True)
    (d / "cfg.yaml").write_text(CONFIG)
    return run_ranks(JOB, d, world, "--config", "cfg.yaml", "--steps", str(STEPS), "--loaders", LOADERS, *args)


def _seen(d: Path, rank: int) -> dict[str, Any]:
    return dict(json.loads((d / f"out-{rank}.json").read_text()))


@pytest.fixture(scope="module")
def uninterrupted(tmp_path_factory: pytest.TempPathFactory) -> dict[int, list[dict[str, Any]]]:
    """Uninterrupted runs on one and on two ranks: per world size, each rank's batches of every step."""
    out = {}
    for world in (1, 2):
        d = tmp_path_factory.mktemp(f"reference-{world}")
        assert _run(d, world) == [0] * world
        out[world] = [_seen(d, r) for r in range(world)]
    return out


@pytest.mark.parametrize(("world", "kill_after"), [(1, 14), (1, 4), (2, 9)])
def test_killed_mid_epoch_then_resumed_hands_out_the_uninterrupted_batches(
    tmp_path: Path, uninterrupted: dict[int, list[dict[str, Any]]], world: int, kill_after: int
) -> None:
    """SIGKILLed after the save of step ``kill_after`` (mid-epoch), resumed in new processes: every later
    step's batches (indices and the workers' random draws) and global RNG draw equal the uninterrupted
    run's, on every rank; on two ranks, each rank's own.

    One exception, as torchdata 0.11 does it: a StatefulDataLoader over a DistributedSampler draws its
    workers' seeds again after a resume, so from the epoch after the resumed one its workers' draws
    differ (its indices do not); docs/resume.md, "Data position"."""
    assert _run(tmp_path, world, "--kill-after", str(kill_after)) == [-signal.SIGKILL] * world
    killed = [_seen(tmp_path, r) for r in range(world)]
    assert _run(tmp_path, world) == [0] * world
    next_epoch = (kill_after // 6 + 1) * 6  # on two ranks: 6 batches an epoch
    for rank in range(world):
        resumed, ref = _seen(tmp_path, rank), uninterrupted[world][rank]
        assert sorted(map(int, killed[rank])) == list(range(kill_after))
        assert sorted(map(int, resumed)) == list(range(kill_after, STEPS))
        got = {**killed[rank], **resumed}
        if world == 2 and HAS_TORCHDATA:
            for step in range(next_epoch, STEPS):
                ids = [[i for i, *_ in b] for b in (got[str(step)].pop("stateful"), ref[str(step)]["stateful"])]
                assert ids[0] == ids[1], step
            ref = {k: {n: v for n, v in x.items() if n != "stateful" or int(k) < next_epoch} for k, x in ref.items()}
        assert got == ref
    if world == 2:  # the ranks' loaders are their own: different batches
        assert uninterrupted[2][0]["10"]["plain"] != uninterrupted[2][1]["10"]["plain"]
    if not HAS_TORCHDATA:
        pytest.skip("torchdata is not installed: only the plain DataLoader was checked (pip install torchdata)")


# -- ResumableLoader, in this process ----------------------------------------------------------------


class Draws(torch.utils.data.Dataset[torch.Tensor]):
    def __len__(self) -> int:
        return 10

    def __getitem__(self, i: int) -> torch.Tensor:
        return torch.tensor([float(i), torch.rand(()).item()])


def _h(tmp_path: Path) -> Hierarchy:
    return Hierarchy.from_config({"tiers": [{"name": "ssd", "kind": "local", "path": str(tmp_path / "ssd")}]})


@pytest.mark.parametrize("source", ["global", "loader", "sampler"])
def test_resume_in_process_without_workers_and_the_global_rng_is_left_alone(tmp_path: Path, source: str) -> None:
    """No workers (the dataset draws from the main process's generator, between the training's draws),
    shuffled from torch's global generator, ``loader.generator`` or a generator of the sampler's own;
    saved after 3 batches of epoch 1 and restored into a fresh loader: the rest of the epoch and the
    next are the uninterrupted run's, and the replay of the skipped batches leaves the global generator
    where the restore put it."""

    def make() -> ResumableLoader:
        ds = Draws()
        if source == "sampler":
            sampler = RandomSampler(ds, generator=torch.Generator().manual_seed(4))
            return ResumableLoader(DataLoader(ds, batch_size=2, sampler=sampler))
        g = torch.Generator().manual_seed(3) if source == "loader" else None
        return ResumableLoader(DataLoader(ds, batch_size=2, shuffle=True, generator=g))

    def run(loader: ResumableLoader, epochs: int) -> list[torch.Tensor]:
        out = []
        for _ in range(epochs):
            for b in loader:
                out.append(b)
                out.append(torch.rand(2))  # the training step's draw
        return out

    torch.manual_seed(0)
    ref = run(make(), 3)
    torch.manual_seed(0)
    loader = make()
    job = TrainState(data=loader)
    first = run(loader, 1)  # epoch 0
    it = iter(loader)
    for _ in range(3):  # 3 batches of epoch 1
        first += [next(it), torch.rand(2)]
    with _h(tmp_path) as h:
        job.save(h, step=1, blocking=True)
        assert job.state_dict()["data"]["epoch"] == 1 and job.state_dict()["data"]["batches"] == 3
        torch.manual_seed(99)  # what the restore replaces
        loader2 = make()
        assert TrainState(data=loader2).restore(h) == 1
    rest = [b for pair in ((b, torch.rand(2)) for b in loader2) for b in pair] + run(loader2, 1)
    assert len(first + rest) == len(ref)
    assert all(torch.equal(a, b) for a, b in zip(first + rest, ref))


def test_set_epoch_is_called_and_a_finished_epoch_resumes_at_the_next() -> None:
    ds = Draws()
    sampler = DistributedSampler(ds, num_replicas=2, rank=1, shuffle=True, seed=1)
    loader = ResumableLoader(DataLoader(ds, batch_size=2, sampler=sampler))
    for _ in range(2):
        list(loader)
    assert sampler.epoch == 1 and loader.state_dict() == {"epoch": 2, "batches": 0}
    again = ResumableLoader(DataLoader(ds, batch_size=2, sampler=sampler))
    again.load_state_dict(loader.state_dict())
    assert [b[:, 0].tolist() for b in again] == [b[:, 0].tolist() for b in loader]  # both epoch 2
    assert sampler.epoch == 2


def test_bad_input_is_refused() -> None:
    with pytest.raises(StateError, match="takes a torch.utils.data.DataLoader"):
        ResumableLoader([1, 2, 3])  # type: ignore[arg-type]
    with pytest.raises(StateError, match="persistent_workers=True"):
        ResumableLoader(DataLoader(Draws(), num_workers=1, persistent_workers=True))
    loader = ResumableLoader(DataLoader(Draws()))
    with pytest.raises(StateError, match="expected"):
        loader.load_state_dict({"epoch": 1, "batches": 2})  # no start state
    start = {"torch": torch.get_rng_state(), "generators": [torch.get_rng_state()]}
    with pytest.raises(StateError, match="0 generator"):  # saved by a loader with a generator
        loader.load_state_dict({"epoch": 1, "batches": 2, "start": start})
    with pytest.raises(StateError, match="expected"):
        loader.load_state_dict({"pos": 3})
