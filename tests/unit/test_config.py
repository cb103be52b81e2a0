from __future__ import annotations

from pathlib import Path

import pytest
import torch

from tierckpt import ConfigError, Hierarchy
from tierckpt.config import format_size, load_config, parse_config, parse_size
from tierckpt.tiers.options import local_directory

BASE = {"tiers": [{"name": "host", "kind": "host"}, {"name": "ssd", "kind": "local", "path": "/tmp/x"}]}


def with_(**kw: object) -> dict:
    return {**BASE, **kw}


@pytest.mark.parametrize(
    ("value", "expected"),
    [("64GiB", 64 << 30), ("100 MB", 100_000_000), (4096, 4096), ("4k", 4096), ("1.5GiB", 3 << 29), ("0", 0),
     (" 2 TB\n", 2 * 10**12), ("0.25KiB", 256), ("9007199254740993", 2**53 + 1), (str(2**63 - 1), 2**63 - 1),
     (2**63 - 1, 2**63 - 1), ("0" * 30 + "1.5000000000k", 1536)],
)  # fmt: skip
def test_sizes(value: object, expected: int) -> None:
    assert parse_size(value, "k") == expected


@pytest.mark.parametrize(
    ("value", "message"),
    [pytest.param("9" * 400, "expected a size below 8EiB", id="400-digits"), pytest.param("9" * 320 + "GiB", "below 8EiB", id="320-digits-GiB"),
     pytest.param("9" * 5000, "below 8EiB", id="5000-digits"), (str(2**63), "below 8EiB"), ("8EiB", "like '64GiB'"),
     (2**63, "below 8EiB"), pytest.param(16**5000, "below 8EiB .* got <an integer of 20001 bits>", id="int-2**20000"),
     ("8388608TiB", "below 8EiB"), ("1.000000000000000001GiB", "expected a whole number of bytes"),
     pytest.param("1." + "1" * 5000 + "GiB", "whole number of bytes", id="5000-decimals"), ("0.5", "whole number of bytes"),
     ("\u0661\u0662", "like '64GiB'"), ("\uff16\uff14GiB", "like '64GiB'"), ("64\u00a0GiB", "like '64GiB'"),
     ("-1k", "like '64GiB'"), (-1, "non-negative"), (1.5, "like '64GiB'")],
)  # fmt: skip
def test_bad_sizes_name_the_key(value: object, message: str) -> None:
    """Exact integer arithmetic, ASCII digits only, at most 2**63 - 1 bytes, and a short message."""
    with pytest.raises(ConfigError, match=r"^tiers\[1\]\.capacity: .*" + message) as e:
        parse_size(value, "tiers[1].capacity")
    assert len(str(e.value)) < 200


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
        ({"tiers": [{"name": "ssd\n", "kind": "host"}]}, r"tiers\[0\]\.name: expected a name"),
        ({"tiers": [{"name": "h", "kind": "host", "capacity": 0}]}, r"tiers\[0\]\.capacity: expected a positive size, got 0$"),
        ({"tiers": [{"name": "h", "kind": "host", "capacity": "0GiB"}]}, r"tiers\[0\]\.capacity: expected a positive size, got '0GiB'"),
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
    assert ssd.location == "../data/ssd" and ssd.base_dir == yml.parent.resolve()  # kept as written
    assert local_directory(ssd) == (tmp_path / "data" / "ssd").resolve()  # resolved by the kind
    assert ssd.io.queue_depth == 4 and ssd.io.chunk_bytes == 8 << 20 and ssd.io.engine == "threads"
    assert pfs.io.queue_depth == 16 and str(local_directory(pfs)) == "/abs/pfs"


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
        assert h.policy.on_full == {"host": "fail"}  # the tier entry's on_full is policy
        assert h.policy.promote_on_restore
        from tierckpt.policies import AnyOf, Every, EverySecs, Never

        assert h.demotion["ssd"].rule == AnyOf((Every(2), EverySecs(30.0))) and not h.demotion["ssd"].on_close
        assert h.demotion["pfs"].rule == Never() and h.demotion["pfs"].on_close


def test_unreadable_files_name_the_file(tmp_path: Path) -> None:
    """Not UTF-8, nested past any real config, or an int Python will not parse: a ConfigError, not a crash."""
    (tmp_path / "latin1.yaml").write_bytes(b"tiers: [{name: h\xe9, kind: host}]\n")
    with pytest.raises(ConfigError, match=r"latin1\.yaml: not valid UTF-8"):
        load_config(tmp_path / "latin1.yaml")
    (tmp_path / "deep.yaml").write_text("tiers: " + "[" * 5000)
    with pytest.raises(ConfigError, match=r"deep\.yaml: line 1: nested more than 100 levels deep"):
        load_config(tmp_path / "deep.yaml")
    (tmp_path / "huge.yaml").write_text("tiers: [{name: h, kind: host, capacity: " + "9" * 5000 + "}]\n")
    with pytest.raises(ConfigError, match=r"huge\.yaml: not valid YAML"):
        load_config(tmp_path / "huge.yaml")
    (tmp_path / "preset.yaml").write_bytes(b"keep: {h\xff: 1}\n")
    (tmp_path / "h.yaml").write_text("tiers: [{name: h, kind: host}]\npolicy: preset.yaml\n")
    with pytest.raises(ConfigError, match=r"h\.yaml: policy: .*preset\.yaml: not valid UTF-8"):
        load_config(tmp_path / "h.yaml")


def test_duplicate_keys_name_file_line_and_key(tmp_path: Path) -> None:
    cases = {
        "twice.yaml": ("tiers: [{name: h, kind: host}]\ntiers: [{name: s, kind: host}]\n", "line 2: duplicate key 'tiers'"),
        "flow.yaml": ("tiers:\n  - {name: a, kind: host, kind: local}\n", "line 2: duplicate key 'kind'"),
        "block.yaml": ("tiers:\n  - name: a\n    kind: host\n    name: b\n", "line 4: duplicate key 'name'"),
    }  # fmt: skip
    for name, (text, message) in cases.items():
        (tmp_path / name).write_text(text)
        with pytest.raises(ConfigError, match=rf"{name}: {message}"):
            load_config(tmp_path / name)
    (tmp_path / "preset.yaml").write_text("keep: {h: 1}\nkeep: {h: 2}\n")
    with pytest.raises(ConfigError, match=r"^policy: .*preset\.yaml: line 2: duplicate key 'keep'"):
        parse_config({"tiers": [{"name": "h", "kind": "host"}], "policy": "preset.yaml"}, base_dir=tmp_path)
    # a key given again over a merge (<<), at any depth of merges, is an override, as with yaml.safe_load
    (tmp_path / "merge.yaml").write_text(
        "tiers:\n  - &a {name: a, kind: host}\n  - &b {<<: *a, name: b, kind: local, path: /x}\n  - {<<: *b, name: c}\n"
    )
    assert [(t.name, t.kind) for t in load_config(tmp_path / "merge.yaml").tiers] == [
        ("a", "host"),
        ("b", "local"),
        ("c", "local"),
    ]


def test_unset_path_variables_are_errors(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """``$NOT_SET/ckpt`` would create a directory named ``$NOT_SET``; an empty one would mean ``/ckpt``."""
    monkeypatch.delenv("NOT_SET_SCRATCH", raising=False)
    monkeypatch.setenv("EMPTY_SCRATCH", "")
    monkeypatch.setenv("SCRATCH_DIR", str(tmp_path))
    for path, message in [
        ("$NOT_SET_SCRATCH/ckpt", r"tiers\[1\]\.path: \$NOT_SET_SCRATCH is not set"),
        ("/a/${NOT_SET_SCRATCH}/ckpt", r"tiers\[1\]\.path: \$\{NOT_SET_SCRATCH\} is not set"),
        ("$EMPTY_SCRATCH/ckpt", r"tiers\[1\]\.path: \$EMPTY_SCRATCH is empty"),
    ]:
        cfg = {"tiers": [BASE["tiers"][0], {"name": "ssd", "kind": "local", "path": path}]}
        with pytest.raises(ConfigError, match=message):
            local_directory(parse_config(cfg).tiers[1])  # the kind resolves its location
        with pytest.raises(ConfigError, match=message):
            Hierarchy.from_config(cfg)
    ssd = parse_config({"tiers": [{"name": "ssd", "kind": "local", "path": "${SCRATCH_DIR}/a/$SCRATCH_DIR"}]}).tiers[0]
    assert local_directory(ssd) == Path(f"{tmp_path}/a/{tmp_path}")
    with pytest.raises(ConfigError, match=r"^policy: \$NOT_SET_SCRATCH is not set"):
        parse_config(with_(policy="$NOT_SET_SCRATCH/keep.yaml"), base_dir=tmp_path)


def test_error_messages_stay_short(tmp_path: Path) -> None:
    """YAML aliases make a 300-byte file hold a list whose full repr is megabytes (10**9 at depth 9)."""
    chain = ["&a0 [x, x, x, x, x, x, x, x, x, x]"] + [f"&a{i} [{', '.join([f'*a{i - 1}'] * 10)}]" for i in range(1, 6)]
    (tmp_path / "laughs.yaml").write_text(f"tiers: [[{', '.join(chain)}]]\n")
    with pytest.raises(ConfigError, match=r"laughs\.yaml: tiers\[0\]: expected a mapping, got list") as e:
        load_config(tmp_path / "laughs.yaml")
    assert len(str(e.value)) < 2000


def test_nul_bytes_in_paths_name_the_key(tmp_path: Path) -> None:
    """A NUL byte (``"\\0"`` in double-quoted YAML) reached ``open``/``realpath`` and came out as a bare
    ``ValueError: embedded null byte``, naming nothing."""
    with pytest.raises(ConfigError, match=r"^tiers\[1\]\.path: a path cannot contain a NUL byte, got 'ssd\\x00x'$"):
        parse_config({"tiers": [BASE["tiers"][0], {"name": "ssd", "kind": "local", "path": "ssd\0x"}]})
    with pytest.raises(ConfigError, match=r"^policy: a path cannot contain a NUL byte"):
        parse_config(with_(policy="keep\0.yaml"), base_dir=tmp_path)
    with pytest.raises(ConfigError, match=r"^base_dir: a path cannot contain a NUL byte"):
        parse_config(BASE, base_dir=f"{tmp_path}\0")
    with pytest.raises(ConfigError, match=r"^config file: a path cannot contain a NUL byte"):
        load_config(f"{tmp_path}/h\0.yaml")
    (tmp_path / "h.yaml").write_text('tiers:\n  - {name: ssd, kind: local, path: "a\\0b"}\n')
    with pytest.raises(
        ConfigError, match=r"h\.yaml: tiers\[0\]\.path: a path cannot contain a NUL byte, got 'a\\x00b'"
    ):
        load_config(tmp_path / "h.yaml")


def test_location_and_options_are_the_kinds(tmp_path: Path) -> None:
    """config.py keeps ``path:`` as written (a URL stays a URL) and ``options:`` as given, read-only."""
    cfg = parse_config(
        {"tiers": [{"name": "obj", "kind": "s3", "path": "s3://bucket/pre/fix", "options": {"endpoint": "http://x"}}]},
        base_dir=tmp_path,
    )
    (obj,) = cfg.tiers
    assert obj.location == "s3://bucket/pre/fix" and obj.base_dir == tmp_path
    assert dict(obj.options) == {"endpoint": "http://x"}
    with pytest.raises(TypeError):
        obj.options["endpoint"] = "changed"  # type: ignore[index]
    assert parse_config(BASE).tiers[0].options == {} and parse_config(BASE).tiers[0].location is None


@pytest.mark.parametrize(
    ("entry", "message"),
    [({"name": "h", "kind": "host", "options": [1]}, r"^tiers\[0\]\.options: expected a mapping, got list"),
     ({"name": "h", "kind": "host", "options": {1: 2}}, r"^tiers\[0\]\.options: option names are strings, got 1"),
     ({"name": "h", "kind": "host", "path": ""}, r"^tiers\[0\]\.path: expected a directory path or a URL"),
     ({"name": "h", "kind": "host", "path": 3}, r"^tiers\[0\]\.path: expected a directory path or a URL")],
)  # fmt: skip
def test_options_and_location_shape(entry: dict, message: str) -> None:
    with pytest.raises(ConfigError, match=message):
        parse_config({"tiers": [entry]})


@pytest.mark.parametrize(
    ("entry", "message"),
    [({"name": "h", "kind": "host", "options": {"pinned": True}}, r"^tiers\[0\]\.options\.pinned: unknown option \(a host tier takes: none\)"),
     ({"name": "s", "kind": "local", "path": "/tmp/x", "options": {"bucket": "b"}}, r"^tiers\[0\]\.options\.bucket: unknown option \(a local tier takes: files, one_file\)"),
     ({"name": "p", "kind": "pfs", "path": "/tmp/x", "options": {"files": "per_host"}}, r"^tiers\[0\]\.options\.files: expected one of per_rank, per_node, got 'per_host'"),
     ({"name": "p", "kind": "pfs", "path": "/tmp/x", "options": {"files": "per_node", "one_file": False}}, r"^tiers\[0\]\.options\.one_file: files: per_node keeps each rank's blobs back to back .* cannot go with one_file: false"),
     ({"name": "p", "kind": "pfs", "path": "s3://bucket/p"}, r"^tiers\[0\]\.path: a pfs tier takes a directory, not a URL, got 's3://bucket/p'"),
     ({"name": "g", "kind": "gpu", "options": {"device": "tpu:0"}}, r"^tiers\[0\]\.options\.device: expected a string matching"),
     ({"name": "g", "kind": "gpu", "options": {"dev": "cuda:0"}}, r"^tiers\[0\]\.options\.dev: unknown option \(a gpu tier takes: device\)")],
)  # fmt: skip
def test_builtin_kinds_check_their_options_and_location(entry: dict, message: str, tmp_path: Path) -> None:
    with pytest.raises(ConfigError, match=message):
        Hierarchy.from_config({"tiers": [entry]})
    assert not Path("s3:").exists()


def test_files_per_rank_is_the_default_and_per_node_writes_a_node_file(tmp_path: Path) -> None:
    layouts = {}
    for i, options in enumerate(({}, {"files": "per_rank"}, {"files": "per_node"})):
        entry = {"name": "p", "kind": "pfs", "path": str(tmp_path / str(i)), "options": options}
        with Hierarchy.from_config({"tiers": [entry]}) as h:
            h.save({"w": torch.ones(3)}, step=1).wait()
        step = tmp_path / str(i) / "step-000000000001"
        layouts[i] = (
            sorted(p.name.split("-")[0] for p in step.iterdir()),
            sorted(p.name for p in (step / "rank-00000").iterdir()),
        )
    assert layouts[0] == layouts[1] == (["commit", "rank"], ["data.bin", "manifest"])  # one data file a rank
    assert layouts[2] == (["commit", "node", "rank"], ["manifest"])  # one rank alone: a node of one rank


def test_on_full_is_policy(tmp_path: Path) -> None:
    tiers = [{"name": "host", "kind": "host"}, {"name": "ssd", "kind": "local", "path": str(tmp_path)}]
    assert parse_config({"tiers": tiers}).policy.on_full == {}
    cfg = parse_config({"tiers": tiers, "policy": {"on_full": {"ssd": "fail"}}})
    assert cfg.policy.on_full == {"ssd": "fail"}
    legacy = [{**tiers[0], "on_full": "fail"}, tiers[1]]  # the tier entry's key still works, folded in
    assert parse_config({"tiers": legacy}).policy.on_full == {"host": "fail"}
    both = parse_config({"tiers": legacy, "policy": {"on_full": {"host": "fail", "ssd": "wait"}}})
    assert both.policy.on_full == {"host": "fail", "ssd": "wait"}
    for policy, message in [
        ({"on_full": {"host": "wait"}}, r"^tiers\[0\]\.on_full: 'fail' contradicts policy\.on_full\.host: 'wait'"),
        ({"on_full": {"nvme": "wait"}}, r"^policy\.on_full\.nvme: unknown key \(allowed: host, ssd\)"),
        ({"on_full": {"ssd": "drop"}}, r"^policy\.on_full\.ssd: expected one of wait, fail, got 'drop'"),
        ({"on_full": "fail"}, r"^policy\.on_full: expected a mapping"),
    ]:
        with pytest.raises(ConfigError, match=message):
            parse_config({"tiers": legacy, "policy": policy})
    (tmp_path / "p.yaml").write_text("on_full: {ssd: fail}\n")  # a preset may set it too
    assert parse_config({"tiers": tiers, "policy": "p.yaml"}, base_dir=tmp_path).policy.on_full == {"ssd": "fail"}


def test_kind_errors_from_a_file_name_the_file(tmp_path: Path) -> None:
    (tmp_path / "h.yaml").write_text("tiers:\n  - {name: ssd, kind: local, path: $NOT_SET_AT_ALL/x}\n")
    with pytest.raises(ConfigError, match=r"h\.yaml: tiers\[0\]\.path: \$NOT_SET_AT_ALL is not set"):
        Hierarchy.from_yaml(tmp_path / "h.yaml")
