"""What ``dcp.async_save`` needs of the DCP backend beyond a plain save, in one process: writers and
readers that pickle as their hierarchy's configuration (DCP's process executor; the multi-rank run is
tests/multiproc/test_dcp_process.py), and ``HierarchyStager``, DCP's ``AsyncStager`` with buffers kept
across saves."""

from __future__ import annotations

import gc
import pickle
from collections import OrderedDict
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import torch

dcp = pytest.importorskip("torch.distributed.checkpoint")

from torch.distributed.checkpoint.staging import AsyncStager  # noqa: E402

from tierckpt import Hierarchy  # noqa: E402
from tierckpt.dcp import HierarchyReader, HierarchyStager, HierarchyWriter  # noqa: E402
from tierckpt.dcp._source import close_opened  # noqa: E402
from tierckpt.errors import TierckptError  # noqa: E402
from tierckpt.tiers.pfs import PfsTier  # noqa: E402

pytestmark = pytest.mark.filterwarnings("ignore::UserWarning", "ignore::FutureWarning")


def _config(tmp: Path) -> dict[str, Any]:
    return {"tiers": [{"name": "host", "kind": "host"}, {"name": "pfs", "kind": "pfs", "path": str(tmp / "pfs")}]}


@pytest.fixture
def h(tmp_path: Path) -> Iterator[Hierarchy]:
    with Hierarchy.from_config(_config(tmp_path), job="dcp-async-test") as hier:
        yield hier
    close_opened()  # what the writers and readers opened from the configuration


def _state(seed: int) -> dict[str, Any]:
    g = torch.Generator().manual_seed(seed)
    w = torch.randn(64, 33, generator=g)
    return {
        "model": OrderedDict(w=w, b=torch.randn(33, generator=g).to(torch.bfloat16), tied=w),
        "ids": torch.randint(0, 1 << 40, (17,), generator=g),
        "step": seed,
        "sched": {"milestones": [seed, seed + 1], "name": f"run-{seed}"},
    }


def _zeros() -> dict[str, Any]:
    got = _state(0)
    for t in (got["model"]["w"], got["model"]["b"], got["ids"]):
        t.zero_()
    return {**got, "step": -1, "sched": {"milestones": [], "name": ""}}


def _assert_same(got: dict[str, Any], want: dict[str, Any]) -> None:
    for k in ("w", "b", "tied"):
        a, b = got["model"][k], want["model"][k]
        assert a.dtype == b.dtype and torch.equal(a, b), k
    assert torch.equal(got["ids"], want["ids"])
    assert (got["step"], got["sched"]) == (want["step"], want["sched"])


def _clone(sd: dict[str, Any]) -> dict[str, Any]:
    return pickle.loads(pickle.dumps(sd))


# -- pickling -------------------------------------------------------------------------------------------------
def test_a_writer_pickles_as_its_configuration_and_opens_it_where_it_writes(h: Hierarchy, tmp_path: Path) -> None:
    w = pickle.loads(pickle.dumps(HierarchyWriter(h, step=5, durable="all")))
    assert not w._source.opened and (w.step, w.durable) == (5, "all")
    sd = _state(5)
    dcp.save(sd, storage_writer=w)
    assert w._source.opened and w.h is not h and w.h.job == h.job  # its own hierarchy, under h's job identity
    got = _zeros()
    dcp.load(got, storage_reader=pickle.loads(pickle.dumps(HierarchyReader(h, step=5))))
    _assert_same(got, sd)


def test_a_writer_takes_a_configuration_yaml_or_mapping(h: Hierarchy, tmp_path: Path) -> None:
    yaml = tmp_path / "tiers.yaml"
    yaml.write_text(f"tiers:\n  - {{name: host, kind: host}}\n  - {{name: pfs, kind: pfs, path: {tmp_path}/pfs}}\n")
    sd = _state(6)
    w = HierarchyWriter(str(yaml), step=6, job=h.job)
    assert not w._source.opened  # opened by the save, not by the constructor
    dcp.save(sd, storage_writer=w)
    got = _zeros()
    dcp.load(got, storage_reader=HierarchyReader(_config(tmp_path), step=6))
    _assert_same(got, sd)
    assert 6 in [c.step for c in h.checkpoints()]


def test_a_hierarchy_of_tier_objects_does_not_pickle_and_says_why(tmp_path: Path) -> None:
    with Hierarchy([PfsTier("pfs", str(tmp_path / "loose"))]) as loose:
        with pytest.raises(TierckptError, match=r"built from tier objects.*from_config"):
            pickle.dumps(HierarchyWriter(loose, step=1))
        with pytest.raises(TierckptError, match="HierarchyReader"):
            pickle.dumps(HierarchyReader(loose, step=1))


def test_a_read_only_configuration_cannot_be_written(tmp_path: Path) -> None:
    with Hierarchy.from_config(_config(tmp_path)) as hw:
        hw.save({"x": torch.ones(1)}, step=0).wait()
    with Hierarchy.from_config(_config(tmp_path), readonly=True) as ro, pytest.raises(TierckptError, match="read-only"):
        HierarchyWriter(ro, step=1)
    with pytest.raises(TypeError, match="YAML path"):
        HierarchyWriter(42, step=1)  # type: ignore[arg-type]


# -- the stager -------------------------------------------------------------------------------------------------
def test_stager_is_dcps_async_stager_and_saves_bit_exact(h: Hierarchy) -> None:
    stager = HierarchyStager()
    assert isinstance(stager, AsyncStager)
    try:
        for step in range(3):
            sd = _state(step)
            fut = dcp.async_save(sd, storage_writer=HierarchyWriter(h, step=step), async_stager=stager)
            fut.result(timeout=60)
            got = _zeros()
            dcp.load(got, storage_reader=HierarchyReader(h, step=step))
            _assert_same(got, sd)
        assert stager.allocations == 1  # one arena, reused by the second and third saves
    finally:
        stager.close()


def test_a_state_changed_after_staging_does_not_change_the_saved_copy(h: Hierarchy) -> None:
    for stager in (HierarchyStager(), HierarchyStager(background=True)):
        sd, step = _state(7), 7 + int(stager._pool is not None)
        want = _clone(sd)
        out = dcp.async_save(sd, storage_writer=HierarchyWriter(h, step=step), async_stager=stager)
        if stager._pool is not None:  # DCP's AsyncSaveResponse: the state may change once staging completes
            out.staging_completion.result(timeout=60)
            out = out.upload_completion
        sd["model"]["w"].add_(1.0)
        sd["ids"].zero_()
        sd["sched"]["milestones"].append(99)
        out.result(timeout=60)
        got = _zeros()
        dcp.load(got, storage_reader=HierarchyReader(h, step=step))
        _assert_same(got, want)
        stager.close()


def test_staged_copy_keeps_types_and_aliases_and_an_arena_in_use_is_not_reused() -> None:
    stager = HierarchyStager(arenas=2)
    sd = _state(3)
    staged = stager.stage(sd)
    assert isinstance(staged, dict) and isinstance(staged["model"], OrderedDict)
    assert staged["model"]["w"] is staged["model"]["tied"]  # one tensor in the state: one in the copy
    assert staged["model"]["w"].data_ptr() != sd["model"]["w"].data_ptr()
    _assert_same(staged, sd)
    again = stager.stage(_state(4))  # the first copy is still held: a second arena
    assert stager.allocations == 2
    first_ptr = staged["ids"].data_ptr()
    del staged
    gc.collect()
    third = stager.stage(_state(5))  # the first arena is free again
    assert stager.allocations == 2 and third["ids"].data_ptr() == first_ptr
    _assert_same(third, _state(5))
    _assert_same(again, _state(4))
    stager.close()
    with pytest.raises(RuntimeError, match="after close"):
        stager.stage(sd)


def test_background_staging_returns_a_future_and_synchronizes() -> None:
    stager = HierarchyStager(background=True)
    fut = stager.stage(_state(2))
    assert not isinstance(fut, dict)
    stager.synchronize_staging()
    assert fut.done()
    _assert_same(fut.result(), _state(2))
    stager.close()
