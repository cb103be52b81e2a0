"""The s3 tier everywhere a slow tier goes, on the session's radosgw: a demotion target, a prefetch
source, ``on_close``, a fallback on restore, with a bandwidth budget, alone, under the DCP backend, and
from the YAML preset; the open's errors; the sweep's grace."""

from __future__ import annotations

import time
from pathlib import Path
from typing import Any

import pytest
import torch
import torch.distributed.checkpoint as dcp

from tierckpt import ConfigError, Hierarchy
from tierckpt.config import load_config
from tierckpt.dcp import HierarchyReader, HierarchyWriter
from tierckpt.tiers._s3client import S3Error, S3Settings
from tierckpt.tiers.s3 import S3Tier

pytestmark = pytest.mark.remote
ROOT = Path(__file__).resolve().parents[2]


def _state(seed: int, n: int = 3_000_000) -> dict[str, Any]:
    g = torch.Generator().manual_seed(seed)
    return {"w": torch.randn(n, generator=g), "small": [torch.randn(100, generator=g) for _ in range(20)], "step": seed}


def _same(a: dict[str, Any], b: dict[str, Any]) -> bool:
    return (
        torch.equal(a["w"], b["w"])
        and all(torch.equal(x, y) for x, y in zip(a["small"], b["small"]))
        and a["step"] == b["step"]
    )


def _obj(s3_bucket: Any, **options: Any) -> dict[str, Any]:
    return s3_bucket.tier_entry("obj", "run", part_size="5MiB", **options)


def test_demote_then_restore_in_a_new_process_shape(s3_bucket: Any) -> None:
    cfg = {"tiers": [{"name": "host", "kind": "host"}, _obj(s3_bucket)], "policy": {"keep": {"host": 1, "obj": 2}}}
    with Hierarchy.from_config(cfg) as h:
        for s in (1, 2, 3):
            h.save(_state(s), step=s)
        h.wait()
        assert [(c.step, c.states["obj"]) for c in h.checkpoints()] == [(2, "committed"), (3, "committed")]
    with Hierarchy.from_config({"tiers": [_obj(s3_bucket)]}) as h:  # a restart: only the bucket is left
        assert _same(h.restore(), _state(3))
        assert _same(h.restore(step=2), _state(2))
    keys = s3_bucket.keys()
    assert not any("step-000000000001" in k for k in keys)  # evicted: head, blobs and record
    assert s3_bucket.uploads() == []


def test_prefetch_from_s3_and_fallback_on_restore(s3_bucket: Any, tmp_path: Path) -> None:
    cfg = {"tiers": [{"name": "ssd", "kind": "local", "path": str(tmp_path / "ssd")}, _obj(s3_bucket)]}
    with Hierarchy.from_config(cfg) as h:
        h.save(_state(5), step=5).wait()
        h.wait()
    cfg2 = {"tiers": [{"name": "host", "kind": "host"}, _obj(s3_bucket)]}
    with Hierarchy.from_config(cfg2) as h:
        assert h.prefetch().result() == "host"
        assert _same(h.restore(), _state(5)) and h.last_restore == (5, "host")
    # the ssd copy damaged: the restore falls back to the bucket's
    (blob,) = [p for p in (tmp_path / "ssd").rglob("*.bin") if p.stat().st_size > 1 << 20][:1]
    with open(blob, "r+b") as f:
        f.seek(1000)
        f.write(b"\xff" * 8)
    with Hierarchy.from_config(cfg) as h:
        assert _same(h.restore(), _state(5)) and h.last_restore == (5, "obj")


def test_s3_alone_and_on_close(s3_bucket: Any) -> None:
    with Hierarchy.from_config({"tiers": [_obj(s3_bucket)]}) as h:
        h.save(_state(1), step=1, blocking=True)
    cfg = {
        "tiers": [{"name": "host", "kind": "host"}, _obj(s3_bucket)],
        "policy": {"demote": {"obj": {"on_close": True}}},
    }
    with Hierarchy.from_config(cfg) as h:
        h.save(_state(2), step=2).wait()
        assert h.checkpoints()[-1].tiers == ("host",)
    with Hierarchy.from_config({"tiers": [_obj(s3_bucket)]}) as h:
        assert [c.step for c in h.checkpoints()] == [1, 2] and _same(h.restore(), _state(2))


def test_with_a_bandwidth_budget(s3_bucket: Any) -> None:
    entry = _obj(s3_bucket) | {"io": {"bandwidth": "40MB/s"}}
    cfg = {"tiers": [{"name": "host", "kind": "host"}, entry]}
    with Hierarchy.from_config(cfg) as h:
        assert h.tier("obj").budget is not None
        start = time.monotonic()
        h.save(_state(1, n=10_000_000), step=1)
        h.wait()
        took = time.monotonic() - start
    assert took > 0.5  # 40 MB at 40 MB/s, less the bucket's first burst (a bound, not a timing claim)
    with Hierarchy.from_config({"tiers": [_obj(s3_bucket)]}) as h:
        assert _same(h.restore(), _state(1, n=10_000_000))


def test_dcp_backend(s3_bucket: Any) -> None:
    sd = {"model": {"w": torch.randn(1000, 300), "b": torch.randn(300)}, "step": 3}
    cfg = {"tiers": [{"name": "host", "kind": "host"}, _obj(s3_bucket)]}
    with Hierarchy.from_config(cfg) as h:
        dcp.save(sd, storage_writer=HierarchyWriter(h, step=3))
        h.wait()
    with Hierarchy.from_config({"tiers": [_obj(s3_bucket)]}) as h:
        out = {"model": {"w": torch.zeros(1000, 300), "b": torch.zeros(300)}, "step": 0}
        dcp.load(out, storage_reader=HierarchyReader(h, step=None))
    assert torch.equal(out["model"]["w"], sd["model"]["w"]) and out["step"] == 3


def test_the_preset_runs(s3_bucket: Any, monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    monkeypatch.setenv("USER", "tester")
    cfg = load_config(ROOT / "tiers" / "s3.yaml")
    raw: dict[str, Any] = {
        "tiers": [
            {"name": "host", "kind": "host"},
            {"name": "ssd", "kind": "local", "path": str(tmp_path / "ssd")},
            {"name": "s3", "kind": "s3", "path": s3_bucket.url(cfg.tiers[2].location.split("/", 3)[3]),
             "options": dict(cfg.tiers[2].options) | {"endpoint_url": s3_bucket.endpoint, "addressing_style": "path"}},
        ],
        "policy": {"keep": dict(cfg.policy.keep)},
    }  # fmt: skip
    with Hierarchy.from_config(raw) as h:
        h.save(_state(1), step=1).wait()
        h.wait()
        assert h.checkpoints()[-1].states["s3"] == "committed"
    assert any(k.startswith("tester/tierckpt/data/") for k in list(s3_bucket.keys()))


def test_open_errors_name_the_problem(s3_bucket: Any, monkeypatch: pytest.MonkeyPatch) -> None:
    entry = _obj(s3_bucket)
    with pytest.raises(ConfigError, match=r"tiers\[0\]: bucket 'no-such-bucket-x' does not exist at http://127"):
        Hierarchy.from_config({"tiers": [entry | {"path": "s3://no-such-bucket-x/run"}]})
    monkeypatch.setenv("AWS_SECRET_ACCESS_KEY", "wrong")
    with pytest.raises(ConfigError, match=r"refused the credentials .*AWS_ACCESS_KEY_ID") as e:
        Hierarchy.from_config({"tiers": [entry]})
    assert "wrong" not in str(e.value)
    monkeypatch.delenv("AWS_SECRET_ACCESS_KEY")
    monkeypatch.delenv("AWS_ACCESS_KEY_ID")
    with pytest.raises(ConfigError, match=r"found no credentials for bucket .*AWS_ACCESS_KEY_ID"):
        Hierarchy.from_config({"tiers": [entry]})
    monkeypatch.setenv("AWS_ACCESS_KEY_ID", s3_bucket.server.access_key)
    monkeypatch.setenv("AWS_SECRET_ACCESS_KEY", s3_bucket.server.secret_key)
    bad = entry | {"options": entry["options"] | {"endpoint_url": "http://127.0.0.1:9", "retries": 1}}
    with pytest.raises(S3Error, match=r"HeadBucket of s3://.* at http://127.0.0.1:9 failed after 2 tries"):
        Hierarchy.from_config({"tiers": [bad]})


def test_the_sweep_leaves_fresh_uploads_alone(s3_bucket: Any) -> None:
    settings = S3Settings(endpoint_url=s3_bucket.endpoint, addressing_style="path")
    s3_bucket.client.create_multipart_upload(
        Bucket=s3_bucket.name, Key="run/data/step-000000000001/rank-00001/1-ab/blob-00000.bin"
    )
    S3Tier("obj", s3_bucket.name, "run/", settings, sweep_grace_s=3600).close()
    assert len(s3_bucket.uploads()) == 1  # begun just now, maybe by a rank that opened first: left
    time.sleep(1.1)
    S3Tier("obj", s3_bucket.name, "run/", settings, sweep_grace_s=0).close()
    assert s3_bucket.uploads() == []
