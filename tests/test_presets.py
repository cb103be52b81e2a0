"""Every YAML preset in tiers/ and policies/ loads, so they never rot."""

from __future__ import annotations

import shutil
from pathlib import Path

import pytest
import torch

from tierckpt import ConfigError, Hierarchy
from tierckpt.config import load_config, parse_config
from tierckpt.tiers.host import HostTier
from tierckpt.tiers.options import check_options, local_directory
from tierckpt.tiers.s3 import OPTIONS as S3_OPTIONS
from tierckpt.tiers.s3 import parse_s3_url

ROOT = Path(__file__).resolve().parent.parent
TIER_PRESETS = sorted((ROOT / "tiers").glob("*.yaml"))
POLICY_PRESETS = sorted((ROOT / "policies").glob("*.yaml"))


def test_presets_exist() -> None:
    assert TIER_PRESETS and POLICY_PRESETS


@pytest.mark.parametrize("path", TIER_PRESETS, ids=lambda p: p.name)
def test_tier_preset_loads(path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("USER", "tester")  # the dgx presets put their directories under $USER
    cfg = load_config(path)
    assert cfg.tiers
    for t in cfg.tiers:
        if t.kind == "s3":  # a bucket and a prefix; building the tier needs a server (tests/s3)
            assert parse_s3_url(t.location or "", t.key) == ("checkpoints", "tester/tierckpt/")
            check_options(t, S3_OPTIONS)
        else:
            assert t.location is None or local_directory(t).is_absolute()


def test_a_preset_path_with_an_unset_variable_is_refused(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("USER", raising=False)
    cfg = load_config(ROOT / "tiers" / "dgx-lustre.yaml")  # the kind resolves the path, when it is built
    with pytest.raises(ConfigError, match=r"dgx-lustre.yaml: tiers\[1\].path: \$USER is not set"):
        local_directory(cfg.tiers[1])


@pytest.mark.parametrize("path", POLICY_PRESETS, ids=lambda p: p.name)
def test_policy_preset_loads(path: Path) -> None:
    tiers = [{"name": n, "kind": "host"} for n in ("host", "ssd", "pfs")]
    cfg = parse_config({"tiers": tiers, "policy": path.name}, base_dir=path.parent)
    assert cfg.policy.keep or cfg.policy.demote or cfg.policy.promote_on_restore
    assert set(cfg.policy.keep) | set(cfg.policy.demote) <= {"host", "ssd", "pfs"}
    # and a hierarchy runs with it
    h = Hierarchy([HostTier(n) for n in ("host", "ssd", "pfs")], policy=cfg.policy)
    with h:
        for s in range(1, 7):
            h.save({"w": torch.full((4,), float(s))}, step=s)
        h.wait()
        assert h.checkpoints()[-1].tiers[0] == "host"
        assert torch.equal(h.restore()["w"], torch.full((4,), 6.0))


def test_default_local_hierarchy_saves_and_restores(tmp_path: Path) -> None:
    shutil.copytree(ROOT / "tiers", tmp_path / "tiers")
    shutil.copytree(ROOT / "policies", tmp_path / "policies")
    with Hierarchy.from_yaml(tmp_path / "tiers" / "local.yaml") as h:
        h.save({"w": torch.ones(3)}, step=1).wait()
        assert [c.tiers for c in h.checkpoints()] == [("host", "ssd", "pfs")]
    assert (tmp_path / ".tierckpt" / "ssd" / "step-000000000001").is_dir()
