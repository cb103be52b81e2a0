"""The tier contract's declared parts: capabilities, the abstract ``from_config``, the options helper."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest

from tierckpt import ConfigError
from tierckpt.config import TierConfig, parse_config
from tierckpt.registry import get_tier_class, register_tier
from tierckpt.testing import FaultyTier
from tierckpt.tiers.base import DEVICES, Tier, TierCapabilities
from tierckpt.tiers.host import HostTier
from tierckpt.tiers.options import (
    Option,
    boolean,
    check_options,
    choice,
    integer,
    local_directory,
    number,
    refuse_location,
    size,
    text,
)

BASE: dict[str, Any] = {"persistent": True, "shared": False, "device": "file", "alignment_bytes": 4096}


def test_capability_defaults_fit_todays_tiers() -> None:
    caps = TierCapabilities(**BASE)
    assert not caps.sequential_writes and caps.min_part_bytes == 0 and caps.max_part_bytes is None
    assert caps.cheap_listing
    assert DEVICES == ("cpu", "cuda", "file", "object")
    assert TierCapabilities(**{**BASE, "device": "object", "sequential_writes": True, "min_part_bytes": 5 << 20,
                               "max_part_bytes": 5 << 30, "cheap_listing": False, "alignment_bytes": 1})  # fmt: skip


@pytest.mark.parametrize(
    ("change", "message"),
    [({"device": "tape"}, r"TierCapabilities\.device: expected one of cpu, cuda, file, object, got 'tape'"),
     ({"device": "mps"}, r"TierCapabilities\.device"),
     ({"alignment_bytes": 3000}, r"TierCapabilities\.alignment_bytes: expected a power of two"),
     ({"alignment_bytes": 0}, r"TierCapabilities\.alignment_bytes"),
     ({"alignment_bytes": True}, r"TierCapabilities\.alignment_bytes"),
     ({"min_part_bytes": -1}, r"TierCapabilities\.min_part_bytes: expected an int >= 0"),
     ({"min_part_bytes": 8192, "max_part_bytes": 4096}, r"TierCapabilities\.max_part_bytes: .*>= min_part_bytes \(8192\)"),
     ({"max_part_bytes": 512}, r"TierCapabilities\.max_part_bytes: .*>= alignment_bytes \(4096\)"),
     ({"persistent": "yes"}, r"TierCapabilities\.persistent: expected True or False"),
     ({"cheap_listing": None}, r"TierCapabilities\.cheap_listing"),
     ({"sequential_writes": 1}, r"TierCapabilities\.sequential_writes")],
)  # fmt: skip
def test_capabilities_are_checked(change: dict[str, Any], message: str) -> None:
    with pytest.raises(ValueError, match=message):
        TierCapabilities(**{**BASE, **change})


def test_atomic_rename_is_gone() -> None:
    """How a tier makes its commit atomic is its own business: nothing declares it."""
    with pytest.raises(TypeError):
        TierCapabilities(**BASE, atomic_rename=True)
    assert not hasattr(Tier, "on_full")  # on_full is policy (PolicyConfig.on_full)


def test_from_config_is_abstract() -> None:
    class NoConfig(HostTier):
        pass

    NoConfig("fine")  # inherits HostTier's

    class Bare(Tier):
        kind = "bare"

        def reserve(self, key, blobs):  # type: ignore[no-untyped-def]
            raise NotImplementedError

        def list_committed(self, rank=None):  # type: ignore[no-untyped-def]
            return []

        def read_manifest(self, key):  # type: ignore[no-untyped-def]
            raise NotImplementedError

        def reader(self, key, blobs):  # type: ignore[no-untyped-def]
            raise NotImplementedError

        def evict(self, key, *, free=True):  # type: ignore[no-untyped-def]
            pass

    with pytest.raises(TypeError, match="from_config"):
        Bare("b")  # type: ignore[abstract]


def test_faulty_tier_is_not_built_from_a_config() -> None:
    cfg = parse_config({"tiers": [{"name": "f", "kind": "faulty"}]}).tiers[0]
    with pytest.raises(ConfigError, match=r"^tiers\[0\]\.kind: a FaultyTier wraps a tier object built in Python"):
        FaultyTier.from_config(cfg, None)  # type: ignore[arg-type]
    assert not hasattr(FaultyTier(HostTier("h")), "on_full")


def test_registry_refuses_a_class_that_is_no_tier() -> None:
    register_tier("not-a-tier-test", "tierckpt.config:TierConfig")
    with pytest.raises(ConfigError, match=r"tiers\[0\]\.kind: tier kind 'not-a-tier-test' .* is not a .*Tier subclass"):
        get_tier_class("not-a-tier-test", "tiers[0].kind")


SPEC = {
    "bucket": Option(text(r"[a-z0-9.-]{3,63}"), doc="the bucket"),
    "part_size": Option(size(lo=5 << 20, hi=5 << 30), default=8 << 20),
    "retries": Option(integer(0, 10), default=3),
    "timeout_secs": Option(number(0.1, 600), default=30.0),
    "verify": Option(boolean(), default=True),
    "storage_class": Option(choice("STANDARD", "GLACIER"), default="STANDARD"),
}


def entry(options: dict[str, Any], location: str | None = None) -> TierConfig:
    return TierConfig(name="obj", kind="s3", location=location, options=options, key="tiers[2]")


def test_check_options_parses_and_defaults() -> None:
    got = check_options(entry({"bucket": "my-bucket", "part_size": "16MiB", "timeout_secs": 2}), SPEC)
    assert got == {"bucket": "my-bucket", "part_size": 16 << 20, "retries": 3, "timeout_secs": 2.0,
                   "verify": True, "storage_class": "STANDARD"}  # fmt: skip


@pytest.mark.parametrize(
    ("options", "message"),
    [({}, r"^tiers\[2\]\.options\.bucket: required option of a s3 tier is missing \(the bucket\)"),
     ({"bucket": "b", "region": "x"}, r"^tiers\[2\]\.options\.region: unknown option \(a s3 tier takes: bucket, part_size, retries, storage_class, timeout_secs, verify\)"),
     ({"bucket": "No_Caps"}, r"^tiers\[2\]\.options\.bucket: expected a string matching"),
     ({"bucket": "bkt", "part_size": "1MiB"}, r"^tiers\[2\]\.options\.part_size: expected a size from 5242880 to 5368709120 bytes, got '1MiB'"),
     ({"bucket": "bkt", "part_size": "lots"}, r"^tiers\[2\]\.options\.part_size: expected a size like '64GiB'"),
     ({"bucket": "bkt", "retries": True}, r"^tiers\[2\]\.options\.retries: expected an integer in \[0, 10\]"),
     ({"bucket": "bkt", "timeout_secs": "5"}, r"^tiers\[2\]\.options\.timeout_secs: expected a number"),
     ({"bucket": "bkt", "verify": "yes"}, r"^tiers\[2\]\.options\.verify: expected true or false"),
     ({"bucket": "bkt", "storage_class": "COLD"}, r"^tiers\[2\]\.options\.storage_class: expected one of STANDARD, GLACIER")],
)  # fmt: skip
def test_check_options_names_the_key(options: dict[str, Any], message: str) -> None:
    with pytest.raises(ConfigError, match=message):
        check_options(entry(options), SPEC)


def test_locations(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("CKPT_ROOT", str(tmp_path))
    rel = TierConfig(name="s", kind="local", location="sub/dir", base_dir=tmp_path, key="tiers[1]")
    assert local_directory(rel) == (tmp_path / "sub" / "dir").resolve()
    assert local_directory(TierConfig(name="s", kind="local", location="$CKPT_ROOT/x")) == tmp_path / "x"
    with pytest.raises(ConfigError, match=r"^tiers\[1\]\.path: a local tier needs a directory path"):
        local_directory(TierConfig(name="s", kind="local", key="tiers[1]"))
    with pytest.raises(ConfigError, match=r"^tiers\[2\]\.path: a s3 tier takes a directory, not a URL"):
        local_directory(entry({}, "s3://b/p"))
    refuse_location(entry({}), "never raised")
    with pytest.raises(ConfigError, match=r"^tiers\[2\]\.path: takes none"):
        refuse_location(entry({}, "/x"), "takes none")
