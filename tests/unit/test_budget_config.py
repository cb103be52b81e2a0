"""A tier's bandwidth budget in its config (``tiers[i].io: {bandwidth: 300MB/s, throttle: all}``) and as a
file tier's constructor argument: rates with units, errors naming the key, and where a budget is refused
(the hierarchy-wide ``io``, a memory tier)."""

from __future__ import annotations

from pathlib import Path

import pytest

from tierckpt import ConfigError, Hierarchy, IOConfig
from tierckpt.config import parse_config
from tierckpt.configvalues import parse_rate
from tierckpt.io.budget import Budget
from tierckpt.tiers.host import HostTier
from tierckpt.tiers.local import LocalTier


def config(io: dict, top_io: dict | None = None, where: str = "/tmp/x") -> dict:
    cfg: dict = {"tiers": [{"name": "host", "kind": "host"}, {"name": "pfs", "kind": "pfs", "path": where, "io": io}]}
    if top_io is not None:
        cfg["io"] = top_io
    return cfg


@pytest.mark.parametrize(
    ("value", "expected"),
    [("300MB/s", 300 * 10**6), ("300 MB/s", 300 * 10**6), ("1.5GiB/s", 3 << 29), ("100MiB/s", 100 << 20),
     ("2GB/s", 2 * 10**9), ("512KiB/s", 512 << 10), ("800KB/s", 800_000), ("5000000B/s", 5 * 10**6),
     ("300mb/S", 300 * 10**6), (250_000_000, 250_000_000)],
)  # fmt: skip
def test_rates(value: object, expected: int) -> None:
    assert parse_rate(value, "k") == expected


@pytest.mark.parametrize("value", ["300MB", "fast", "/s", "MB/s", "-3MB/s", "1.5B/s", True, 2.5, None, "300MB/h"])
def test_bad_rates_name_the_key(value: object) -> None:
    with pytest.raises(ConfigError, match=r"^tiers\[1\]\.io\.bandwidth: expected a rate like '300MB/s', got "):
        parse_rate(value, "tiers[1].io.bandwidth")


def test_a_tier_entry_takes_a_budget_over_the_hierarchy_wide_io() -> None:
    cfg = parse_config(config({"bandwidth": "300MB/s", "throttle": "all"}, top_io={"chunk": "8MiB"}))
    host, pfs = cfg.tiers
    assert pfs.io.bandwidth_bytes_per_sec == 300 * 10**6 and pfs.io.throttle == "all"
    assert pfs.io.chunk_bytes == 8 << 20  # the hierarchy's io under it
    assert host.io.bandwidth_bytes_per_sec is None and cfg.io.bandwidth_bytes_per_sec is None
    assert parse_config(config({"bandwidth": "1GB/s"})).tiers[1].io.throttle == "background"  # the default


@pytest.mark.parametrize(
    ("cfg", "message"),
    [(config({}, top_io={"bandwidth": "300MB/s"}), r"^io\.bandwidth: a bandwidth budget is one tier's: give it in that tier's entry"),
     (config({}, top_io={"throttle": "all"}), r"^io\.throttle: a bandwidth budget is one tier's"),
     (config({"bandwidth": "300MB"}), r"^tiers\[1\]\.io\.bandwidth: expected a rate like '300MB/s', got '300MB'"),
     (config({"bandwidth": "0MB/s"}), r"^tiers\[1\]\.io\.bandwidth: expected a rate of at least 1MB/s"),
     (config({"bandwidth": "500KB/s"}), r"^tiers\[1\]\.io\.bandwidth: expected a rate of at least 1MB/s"),
     (config({"throttle": "all"}), r"^tiers\[1\]\.io\.throttle: there is no tiers\[1\]\.io\.bandwidth for it"),
     (config({"bandwidth": "1GB/s", "throttle": "some"}), r"^tiers\[1\]\.io\.throttle: expected one of background, all, got 'some'"),
     (config({"bandwdth": "1GB/s"}), r"^tiers\[1\]\.io\.bandwdth: unknown key \(allowed: bandwidth, chunk, direct")],
)  # fmt: skip
def test_bad_budgets_name_the_key(cfg: dict, message: str) -> None:
    with pytest.raises(ConfigError, match=message):
        parse_config(cfg)


def test_a_yaml_file_names_itself_too(tmp_path: Path) -> None:
    yml = tmp_path / "h.yaml"
    yml.write_text("tiers:\n  - {name: ssd, kind: local, path: ssd, io: {bandwidth: lots}}\n")
    with pytest.raises(ConfigError, match=r"h\.yaml: tiers\[0\]\.io\.bandwidth: expected a rate like '300MB/s'"):
        Hierarchy.from_yaml(yml)


def test_a_file_tier_gets_a_bucket_of_one_chunk(tmp_path: Path) -> None:
    d = {
        "tiers": [
            {"name": "ssd", "kind": "local", "path": str(tmp_path / "ssd"), "io": {"chunk": "4MiB", "bandwidth": "50MB/s"}},
            {"name": "pfs", "kind": "pfs", "path": str(tmp_path / "pfs")},
        ],
        "io": {"engine": "threads"},
    }  # fmt: skip
    with Hierarchy.from_config(d) as h:
        budget = h.tier("ssd").budget
        assert isinstance(budget, Budget)
        assert (budget.bytes_per_sec, budget.burst_bytes, budget.throttle) == (50e6, 4 << 20, "background")
        assert h.tier("pfs").budget is None
        assert "50MB/s (background) budget" in h.tier("ssd").describe()


def test_the_constructor_takes_one(tmp_path: Path) -> None:
    t = LocalTier("ssd", tmp_path / "ssd", chunk_bytes=2 << 20, bandwidth_bytes_per_sec=10**8, throttle="all")
    try:
        assert t.budget is not None and t.budget.bytes_per_sec == 1e8 and t.budget.burst_bytes == 2 << 20
        assert t.budget.throttle == "all"
    finally:
        t.close()
    with pytest.raises(ValueError, match="throttle: expected one of background, all"):
        LocalTier("ssd", tmp_path / "other", bandwidth_bytes_per_sec=10**8, throttle="sometimes")
    assert not (tmp_path / "other").exists()  # refused before anything was made


def test_a_memory_tier_takes_none(tmp_path: Path) -> None:
    """A memory tier's copies are memcpys that a budget does not see: refused, naming the key."""
    d = {"tiers": [{"name": "host", "kind": "host", "io": {"bandwidth": "1GB/s"}}]}
    with pytest.raises(ConfigError, match=r"^tiers\[0\]\.io\.bandwidth: a host tier's copies are memory copies"):
        Hierarchy.from_config(d)
    host = HostTier("host", 1 << 20)
    host.budget = Budget(10**9)
    with pytest.raises(ConfigError, match=r"^tiers\[0\] \('host'\): a host tier's copies are memory copies"):
        Hierarchy([host])


def test_the_hierarchys_io_holds_no_budget(tmp_path: Path) -> None:
    with pytest.raises(ConfigError, match=r"^io\.bandwidth_bytes_per_sec: a bandwidth budget is one tier's"):
        Hierarchy([HostTier("host", 1 << 20)], io=IOConfig(bandwidth_bytes_per_sec=10**8))
