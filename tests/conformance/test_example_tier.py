"""The example third-party tier (examples/objdir_tier) passes the conformance suite and works in a
hierarchy built from YAML, below a host tier."""

from __future__ import annotations

import re
import sys
from collections.abc import Iterator
from pathlib import Path

import pytest
import torch

from tierckpt import ConfigError, Hierarchy, get_tier_class, register_tier
from tierckpt.testing.conformance import SMALL_CAPACITY_BYTES, TierConformanceTests
from tierckpt.tiers.base import Tier

EXAMPLE = Path(__file__).resolve().parents[2] / "examples" / "objdir_tier"
sys.path.insert(0, str(EXAMPLE))  # as if installed (pip install examples/objdir_tier)

from objdir_tier import ObjdirTier  # noqa: E402

# what the installed entry point does (the line of examples/objdir_tier/pyproject.toml)
ENTRY = re.search(r'^objdir = "(.+)"$', (EXAMPLE / "pyproject.toml").read_text(), re.MULTILINE)
assert ENTRY is not None
register_tier("objdir", ENTRY.group(1))


class TestObjdirTier(TierConformanceTests):
    @pytest.fixture
    def tier(self, tmp_path: Path) -> Iterator[Tier]:
        t = ObjdirTier("obj", tmp_path / "bucket", part_size=64 << 10)
        yield t
        t.close()

    @pytest.fixture
    def small_tier(self, tmp_path: Path) -> Iterator[Tier]:
        t = ObjdirTier("obj", tmp_path / "small", part_size=64 << 10, capacity_bytes=SMALL_CAPACITY_BYTES)
        yield t
        t.close()


def test_the_entry_point_names_the_class() -> None:
    assert get_tier_class("objdir") is ObjdirTier


def config(tmp_path: Path, location: str, options: str = "{part_size: 64KiB}") -> Path:
    yml = tmp_path / "h.yaml"
    yml.write_text(
        "tiers:\n"
        "  - {name: host, kind: host, capacity: 64MiB}\n"
        f"  - {{name: obj, kind: objdir, path: '{location}', options: {options}}}\n"
        "io: {chunk: 1MiB}\n"
        "policy: {keep: {host: 1, obj: 2}}\n"
    )
    return yml


def test_hierarchy_saves_to_and_restores_from_it(tmp_path: Path) -> None:
    yml = config(tmp_path, f"objdir://{tmp_path}/bucket")
    states = {s: {"w": torch.randn(300_000, generator=torch.Generator().manual_seed(s)), "step": s} for s in (1, 2, 3)}
    with Hierarchy.from_yaml(yml) as h:
        assert h.tier("obj").capabilities.device == "object"
        for s, state in states.items():
            h.save(state, step=s).wait()
        assert [c.step for c in h.checkpoints() if "obj" in c.tiers] == [2, 3]  # keep: 2 evicted step 1
    with Hierarchy.from_yaml(yml, readonly=True) as h:  # what `tierckpt ls` opens
        assert [c.step for c in h.checkpoints()] == [2, 3]
    with Hierarchy.from_yaml(yml) as h:  # a new process: host is empty, obj holds steps 2 and 3
        for s in (2, 3):
            back = h.restore(step=s)
            assert torch.equal(back["w"], states[s]["w"]) and back["step"] == s
            assert h.last_restore == (s, "obj")


def test_readonly_needs_the_bucket(tmp_path: Path) -> None:
    with pytest.raises(FileNotFoundError, match="no bucket at"):
        Hierarchy.from_yaml(config(tmp_path, f"objdir://{tmp_path}/missing"), readonly=True)
    assert not (tmp_path / "missing").exists()


@pytest.mark.parametrize(
    ("location", "options", "message"),
    [("/plain/dir", "{}", r"h\.yaml: tiers\[1\]\.path: expected a location like objdir:///absolute/path, got '/plain/dir'"),
     ("objdir://host/dir", "{}", r"tiers\[1\]\.path: expected a location like objdir:///absolute/path"),
     ("objdir:///x", "{part_size: 1KiB}", r"tiers\[1\]\.options\.part_size: expected a size from 4096 to"),
     ("objdir:///x", "{endpoint: x}", r"tiers\[1\]\.options\.endpoint: unknown option \(a objdir tier takes: part_size\)")],
)  # fmt: skip
def test_it_checks_its_location_and_options(tmp_path: Path, location: str, options: str, message: str) -> None:
    with pytest.raises(ConfigError, match=message):
        Hierarchy.from_yaml(config(tmp_path, location, options))


@pytest.mark.parametrize("where", ["top", "fallback"])
def test_packing_into_it_honours_its_part_size(tmp_path: Path, where: str) -> None:
    """The default part_size (8 MiB) above the hierarchy's io chunk: packing straight into the tier (as
    the top tier, or as the fallback when the host above refuses the save) writes parts of at least
    that size, in order; a 20 MiB state spans several parts and a short last one."""
    state = {"w": torch.randn(5 << 20, generator=torch.Generator().manual_seed(7))}  # 20 MiB
    obj = ObjdirTier("obj", tmp_path / "bucket")
    tiers: list[Tier] = [obj] if where == "top" else []
    policy = {}
    if where == "fallback":
        from tierckpt.tiers.host import HostTier

        tiers = [HostTier("host", capacity_bytes=1 << 20), obj]
        policy = {"on_full": {"host": "fail"}}
    with Hierarchy(tiers, policy=policy) as h:
        handle = h.save(state, step=1)
        if where == "fallback":
            with pytest.raises(OSError):
                handle.wait(tier="host")
        handle.wait(tier="obj")
        assert torch.equal(h.restore(step=1, tier="obj")["w"], state["w"])
