"""Bad input around a hierarchy: junk in a tier directory, steps and ranks the format cannot name, a
step saved twice, two tiers in one directory, targets that cannot be filled, a job that goes back to an
older step. Each gets a clear error or a warning, and nothing already saved is lost."""

from __future__ import annotations

import logging
import os
import shutil
from pathlib import Path
from typing import Any

import pytest
import torch

from tierckpt import ConfigError, Hierarchy, StateError, TierIOError
from tierckpt.tiers.host import HostTier


def cfg(tmp_path: Path, *tiers: str, **extra: Any) -> dict[str, Any]:
    kinds = {
        "host": {"name": "host", "kind": "host", "capacity": "64MiB"},
        "ssd": {"name": "ssd", "kind": "local", "path": str(tmp_path / "ssd")},
        "pfs": {"name": "pfs", "kind": "pfs", "path": str(tmp_path / "pfs")},
    }
    return {"tiers": [kinds[t] for t in tiers], "io": {"engine": "threads"}, **extra}


def test_junk_named_like_a_checkpoint_is_skipped_and_never_counts_toward_keep(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    ssd = tmp_path / "ssd"
    with Hierarchy.from_config(cfg(tmp_path, "ssd", policy={"keep": {"ssd": 2}})) as h:
        for step in (1, 2):
            h.save({"w": torch.full((4,), float(step))}, step=step).wait()
    (ssd / "step-000000000999" / "rank-00000").mkdir(parents=True)  # empty
    (ssd / "step-000000000998").mkdir()
    (ssd / "step-000000000998" / "rank-00000").write_bytes(b"not a directory")
    shutil.copytree(ssd / "step-000000000002" / "rank-00000", ssd / "step-000000000997" / "rank-00000")
    (ssd / "step-000000000997" / "rank-00000" / "manifest").unlink()  # a copy missing its manifest
    with (
        caplog.at_level(logging.WARNING),
        Hierarchy.from_config(cfg(tmp_path, "ssd", policy={"keep": {"ssd": 2}})) as h,
    ):
        assert [c.step for c in h.checkpoints()] == [1, 2]
        h.save({"w": torch.full((4,), 3.0)}, step=3).wait()
        assert [c.step for c in h.checkpoints()] == [2, 3]  # keep 2 counted the good copies only
        assert h.restore()["w"][0] == 3.0 and h.restore(step=2)["w"][0] == 2.0
        h.checkpoints()
    warned = [r.getMessage() for r in caplog.records if "not a checkpoint" in r.getMessage()]
    assert len(warned) == 3 and all("holds no manifest file" in w for w in warned)  # once per entry
    for junk in ("step-000000000999", "step-000000000998", "step-000000000997"):
        assert (ssd / junk / "rank-00000").exists()  # skipped, not deleted


def test_steps_and_ranks_the_format_cannot_name_are_refused(tmp_path: Path) -> None:
    with Hierarchy.from_config(cfg(tmp_path, "host", "ssd")) as h:
        for bad in (10**12, -1, True, 1.0, "1"):
            with pytest.raises(ValueError, match=r"step must be an int in \[0, 999999999999\]"):
                h.save({"w": torch.ones(2)}, step=bad)  # type: ignore[arg-type]
        h.save({"w": torch.ones(2)}, step=10**12 - 1).wait()
        assert [c.step for c in h.checkpoints()] == [10**12 - 1]
        for bad in (True, 1.5, 10**12):
            with pytest.raises(ValueError, match="step must be an int"):
                h.restore(step=bad)  # type: ignore[arg-type]
    assert not list((tmp_path / "ssd").glob("step-1*"))
    with pytest.raises(ConfigError, match="rank: 100000: a file tier names ranks with 5 digits"):
        Hierarchy([HostTier("host")], rank=100_000, world_size=100_001)


def test_a_step_saved_again_replaces_its_older_copies_on_tiers_it_would_skip(tmp_path: Path) -> None:
    config = cfg(tmp_path, "host", "ssd", policy={"keep": {"host": 1}, "demote": {"ssd": {"every": 2}}})
    with Hierarchy.from_config(config) as h:
        asked: list[int] = []
        holds = h.tier("ssd").holds
        h.tier("ssd").holds = lambda key: asked.append(key.step) or holds(key)  # type: ignore[method-assign]
        h.save({"v": "s1"}, step=1, blocking=True)  # host
        h.save({"v": "A"}, step=2, blocking=True)  # host and ssd (every 2nd save)
        assert asked == []  # a new step asks no tier whether it holds it
        h.save({"v": "B"}, step=2, blocking=True)  # not due for ssd, but ssd holds step 2: replaced
        assert asked == [2]
        h.save({"v": "s3"}, step=3, blocking=True)  # host keeps 1: step 2 is left on ssd only
        assert h.restore(step=2) == {"v": "B"} and h.last_restore == (2, "ssd")
        assert h.verify(step=2) == [(2, "ssd", None)]


def test_two_tiers_in_one_directory_are_refused(tmp_path: Path) -> None:
    config = cfg(tmp_path, "ssd", "pfs")
    config["tiers"][1]["path"] = str(tmp_path / "ssd") + "/"
    with pytest.raises(ConfigError, match=r"tiers\[1\].path: .* is the location of tiers\[0\] \('ssd'\)"):
        Hierarchy.from_config(config)
    os.symlink(tmp_path / "ssd", tmp_path / "link")
    config["tiers"][1]["path"] = str(tmp_path / "link")
    with pytest.raises(ConfigError, match=r"tiers\[1\].path"):
        Hierarchy.from_config(config)


@pytest.mark.parametrize(
    ("make", "why"),
    [
        (lambda: torch.zeros(1, 3).expand(2, 3), "elements may share memory"),
        (lambda: torch.zeros(6).as_strided((2, 3), (1, 1)), "elements may share memory"),
        (lambda: torch.zeros(2, 3).to_sparse(), "torch.sparse_coo tensor"),
        (lambda: torch.zeros(2, 3, device="meta"), "meta tensor"),
    ],
)
def test_a_target_tensor_that_cannot_be_filled_is_named_before_anything_changes(
    tmp_path: Path, make: Any, why: str
) -> None:
    with Hierarchy.from_config(cfg(tmp_path, "ssd")) as h:
        h.save({"a": torch.arange(4.0), "b": torch.arange(6.0).reshape(2, 3), "step": 7}, step=1).wait()
        target = {"a": torch.zeros(4), "b": make(), "step": 0}
        with pytest.raises(StateError, match=rf"target\['b'\]: cannot restore into .*{why}"):
            h.restore(step=1, into=target)
        assert not target["a"].any() and target["step"] == 0


def test_a_job_that_goes_back_to_an_older_step_is_warned_and_keeps_its_saves(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    with Hierarchy.from_config(cfg(tmp_path, "ssd", policy={"keep": {"ssd": 1}})) as h:
        h.save({"w": torch.ones(2)}, step=10).wait()
    with (
        caplog.at_level(logging.WARNING),
        Hierarchy.from_config(cfg(tmp_path, "ssd", policy={"keep": {"ssd": 1}})) as h,
    ):
        h.save({"w": torch.full((2,), 5.0)}, step=5).wait()
        assert [c.step for c in h.checkpoints()] == [5, 10]  # the newest save is kept, whatever its number
        h.save({"w": torch.full((2,), 6.0)}, step=6).wait()
        assert [c.step for c in h.checkpoints()] == [6, 10]
        assert h.restore(step=6)["w"][0] == 6.0
    warned = [r.getMessage() for r in caplog.records if "older than step 10" in r.getMessage()]
    assert len(warned) == 1 and "restore() without a step picks step 10" in warned[0]


def test_a_tier_directory_that_cannot_be_listed_is_named(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    """Not a raw PermissionError: opening the tier says which tier and directory; a listing that fails
    later leaves that tier out of checkpoints() with a warning naming it."""
    real = os.scandir
    denied_dir: list[Path] = []

    def scandir(p: Any = ".") -> Any:
        if denied_dir and Path(p) == denied_dir[0]:
            raise PermissionError(13, "Permission denied", str(p))
        return real(p)

    monkeypatch.setattr(os, "scandir", scandir)
    with Hierarchy.from_config(cfg(tmp_path, "host", "ssd")) as h:
        h.save({"w": torch.ones(2)}, step=1).wait()
        denied_dir.append(tmp_path / "ssd")
        with caplog.at_level(logging.WARNING):
            assert [(c.step, c.tiers) for c in h.checkpoints()] == [(1, ("host",))]
        assert any("tier 'ssd'" in r.getMessage() and "cannot list" in r.getMessage() for r in caplog.records)
        with pytest.raises(TierIOError, match=r"tier 'ssd': cannot list .*ssd: Permission denied"):
            Hierarchy.from_config(cfg(tmp_path, "ssd"))


def test_a_corrupt_copy_is_named_once(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    from tierckpt import CorruptCheckpointError
    from tierckpt.tiers.base import TierCopy

    with Hierarchy.from_config(cfg(tmp_path, "ssd")) as h:
        h.save({"w": torch.ones(2)}, step=3).wait()

        def gone(self: Any) -> bytes:
            raise CorruptCheckpointError("manifest is missing", tier="ssd", step=3)

        class Copy(TierCopy):
            read_manifest = gone  # type: ignore[assignment]

        monkeypatch.setattr(h.tier("ssd"), "open_copy", lambda key: Copy(h.tier("ssd"), key))
        with pytest.raises(CorruptCheckpointError) as ei:
            h.restore()
        assert str(ei.value) == "manifest is missing [tier=ssd, step=3]"


def test_a_rank_lists_its_own_copies_without_looking_at_other_ranks(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, run_ranks: Any, coordinators: Any
) -> None:
    """Checking each copy's manifest costs a stat; on a shared tier a rank must not pay it for every
    other rank's copies (1,000 ranks x 100 steps would be 100,000 metadata calls per listing)."""
    from tierckpt.io import make_engine
    from tierckpt.tiers.pfs import PfsTier

    eng = make_engine("threads", 2)
    cs = coordinators(2)

    def open_rank(rank: int) -> Hierarchy:
        return Hierarchy([PfsTier("pfs", tmp_path / "pfs", eng, job="j")], coordinator=cs[rank], job="j")

    def save(rank: int) -> None:
        with open_rank(rank) as h:
            for step in (1, 2):
                h.save({"w": torch.full((2,), float(rank))}, step=step).wait()

    try:
        assert run_ranks(2, save) == [None, None]
        real, looked = os.stat, []

        def counting(p: Any, *a: Any, **k: Any) -> os.stat_result:
            looked.append(str(p))
            return real(p, *a, **k)

        pfs = PfsTier("pfs", tmp_path / "pfs", eng, readonly=True)
        with Hierarchy([pfs], rank=1, world_size=2, readonly=True) as h:  # rank 1 alone, reading
            monkeypatch.setattr(os, "stat", counting)
            assert [c.step for c in h.checkpoints()] == [1, 2]
            assert h.restore()["w"][0] == 1.0
            monkeypatch.undo()
        assert looked and not [p for p in looked if "rank-00000" in p]
    finally:
        eng.close()


def test_a_blob_replaced_by_a_directory_is_named(tmp_path: Path) -> None:
    from tierckpt import CorruptCheckpointError

    with Hierarchy.from_config(cfg(tmp_path, "ssd", "pfs")) as h:
        h.save({"w": torch.arange(4.0)}, step=1).wait()
        blob = tmp_path / "ssd" / "step-000000000001" / "rank-00000" / "blob-00000.bin"
        blob.unlink()
        blob.mkdir()
        assert torch.equal(h.restore()["w"], torch.arange(4.0)) and h.last_restore == (1, "pfs")
        [(_, _, err), (_, _, ok)] = h.verify()
        assert isinstance(err, CorruptCheckpointError) and ok is None
        assert "blob-00000.bin is not a regular file" in str(err) and err.tier == "ssd"
