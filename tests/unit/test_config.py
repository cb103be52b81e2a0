from __future__ import annotations

from pathlib import Path

import pytest

from tierckpt import ConfigError, Hierarchy
from tierckpt.config import format_size, load_config, parse_config, parse_size

BASE = {"tiers": [{"name": "host", "kind": "host"}, {"name": "ssd", "kind": "local", "path": "/tmp/x"}]}


def with_(**kw: object) -> dict:
    return {**BASE, **kw}


@pytest.mark.parametrize(
    ("value", "expected"),
    [("64GiB", 64 << 30), ("100 MB", 100_000_000), (4096, 4096), ("4k", 4096), ("1.5GiB", 3 << 29), ("0", 0)],
)
def test_sizes(value: object, expected: int) -> None:
    assert parse_size(value, "k") == expected


def test_format_size_round_trips() -> None:
    assert parse_size(format_size(64 << 20), "k") == 64 << 20


@pytest.mark.parametrize(
    ("cfg", "message"),
    [
        ({"tiers": [{"name": "h", "kind": "host"}, {"name": "s", "kind": "local", "path": "/x", "capacity": "lots"}]},
         r"tiers\[1\]\.capacity: expected a size like '64GiB', got 'lots'"),
        (with_(io={"engine": "fast"}), r"io\.engine: expected one of auto, uring, threads"),
        (with_(io={"queue_depth": 0}), r"io\.queue_depth"),
        (with_(io={"chunk": "1000"}), r"io\.chunk: expected a multiple of 4KiB"),
        (with_(io={"direct": "yes"}), r"io\.direct: expected true or false"),
        (with_(colour="blue"), r"config\.colour: unknown key"),
        ({"tiers": [{"name": "h", "kind": "host", "speed": 3}]}, r"tiers\[0\]\.speed: unknown key"),
        ({"tiers": [{"name": "h"}]}, r"tiers\[0\]\.kind: required key is missing"),
        ({"tiers": []}, r"tiers: expected a non-empty list"),
        ({"tiers": [{"name": "a", "kind": "host"}, {"name": "a", "kind": "host"}]}, "used twice"),
        ({"tiers": [{"name": "a/b", "kind": "host"}]}, r"tiers\[0\]\.name"),
        (with_(policy={"keep": {"nvme": 2}}), r"policy\.keep\.nvme: unknown key"),
        (with_(policy={"keep": {"ssd": 0}}), r"policy\.keep\.ssd: expected an integer"),
        (with_(layout={"align": 3000}), r"layout\.align: expected a power of two"),
        (with_(layout={"blob_size": "1KiB"}), r"layout\.blob_size: expected at least 1MiB"),
        ({"tiers": [{"name": "s", "kind": "local", "path": "/x", "io": {"chunk": "3MiB", "bogus": 1}}]},
         r"tiers\[0\]\.io\.bogus: unknown key"),
        ("just a string", "config: expected a mapping"),
        (with_(policy={"demote": {"host": {"every": 2}}}), r"policy\.demote\.host: 'host' is the top tier"),
        (with_(policy={"demote": {"ssd": {"every": 0}}}), r"policy\.demote\.ssd\.every: expected an integer"),
        (with_(policy={"demote": {"ssd": {"every": "5"}}}), r"policy\.demote\.ssd\.every: expected an integer"),
        (with_(policy={"demote": {"ssd": {"every_secs": -1}}}), r"policy\.demote\.ssd\.every_secs: expected a positive"),
        (with_(policy={"demote": {"ssd": {"every_secs": True}}}), r"policy\.demote\.ssd\.every_secs: expected a positive"),
        (with_(policy={"demote": {"ssd": {"on_close": "yes"}}}), r"policy\.demote\.ssd\.on_close: expected true or false"),
        (with_(policy={"demote": {"ssd": {"evry": 5}}}), r"policy\.demote\.ssd\.evry: unknown key"),
        (with_(policy={"demote": {"tape": {"every": 5}}}), r"policy\.demote\.tape: unknown key"),
        (with_(policy={"demote": {"ssd": 5}}), r"policy\.demote\.ssd: expected a mapping"),
        (with_(policy={"promote": {"on_restore": 1}}), r"policy\.promote\.on_restore: expected true or false"),
        (with_(policy={"promote": {"eager": True}}), r"policy\.promote\.eager: unknown key"),
        (with_(policy={"evict": {}}), r"policy\.evict: unknown key"),
        ({"tiers": [{"name": "h", "kind": "host", "on_full": "drop"}]}, r"tiers\[0\]\.on_full: expected one of wait, fail"),
    ],
)  # fmt: skip
def test_errors_name_the_key(cfg: object, message: str) -> None:
    with pytest.raises(ConfigError, match=message):
        parse_config(cfg)


def test_kind_errors_come_from_the_registry_and_tiers() -> None:
    with pytest.raises(ConfigError, match=r"tiers\[0\]\.kind: unknown tier kind 'tape'"):
        Hierarchy.from_config({"tiers": [{"name": "t", "kind": "tape"}]})
    with pytest.raises(ConfigError, match=r"tiers\[0\]\.path: a local tier needs a directory path"):
        Hierarchy.from_config({"tiers": [{"name": "t", "kind": "local"}]})
    with pytest.raises(ConfigError, match=r"tiers\[0\]\.path: a host tier .* takes no path"):
        Hierarchy.from_config({"tiers": [{"name": "t", "kind": "host", "path": "/x"}]})


def test_per_tier_io_overrides_and_relative_paths(tmp_path: Path) -> None:
    yml = tmp_path / "conf" / "h.yaml"
    yml.parent.mkdir()
    yml.write_text(
        "tiers:\n"
        "  - {name: ssd, kind: local, path: ../data/ssd, io: {queue_depth: 4}}\n"
        "  - {name: pfs, kind: pfs, path: /abs/pfs}\n"
        "io: {engine: threads, chunk: 8MiB}\n"
    )
    cfg = load_config(yml)
    ssd, pfs = cfg.tiers
    assert ssd.path == (tmp_path / "data" / "ssd").resolve()
    assert ssd.io.queue_depth == 4 and ssd.io.chunk_bytes == 8 << 20 and ssd.io.engine == "threads"
    assert pfs.io.queue_depth == 16 and str(pfs.path) == "/abs/pfs"


def test_yaml_errors_name_the_file(tmp_path: Path) -> None:
    bad = tmp_path / "bad.yaml"
    bad.write_text("tiers: [\n")
    with pytest.raises(ConfigError, match="bad.yaml: not valid YAML"):
        load_config(bad)
    with pytest.raises(ConfigError, match="cannot read config"):
        load_config(tmp_path / "missing.yaml")


def test_engine_knob_env_var(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("TIERCKPT_ENGINE", "threads")
    assert parse_config(BASE).io.engine == "threads"
    assert parse_config(with_(io={"engine": "uring"})).io.engine == "uring"  # the file wins over the env
    monkeypatch.setenv("TIERCKPT_ENGINE", "warp")
    with pytest.raises(ConfigError, match="TIERCKPT_ENGINE"):
        parse_config(BASE)


def test_policy_keys_reach_the_hierarchy(tmp_path: Path) -> None:
    cfg = {
        "tiers": [
            {"name": "host", "kind": "host", "on_full": "fail"},
            {"name": "ssd", "kind": "local", "path": str(tmp_path / "ssd")},
            {"name": "pfs", "kind": "pfs", "path": str(tmp_path / "pfs")},
        ],
        "policy": {
            "keep": {"host": 1},
            "demote": {"ssd": {"every": 2, "every_secs": 30}, "pfs": {"on_close": True}},
            "promote": {"on_restore": True},
        },
    }
    with Hierarchy.from_config(cfg) as h:
        assert h.tier("host").on_full == "fail" and h.tier("ssd").on_full == "wait"
        assert h.policy.promote_on_restore
        from tierckpt.policies import AnyOf, Every, EverySecs, Never

        assert h.demotion["ssd"].rule == AnyOf((Every(2), EverySecs(30.0))) and not h.demotion["ssd"].on_close
        assert h.demotion["pfs"].rule == Never() and h.demotion["pfs"].on_close
