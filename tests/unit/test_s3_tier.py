"""The s3 tier's own rules, on moto's in-process S3 (fast; the real server's tests are in tests/s3):
locations and options, the retry loop's bounds and errors, part checks, replace, damage, the sweep."""

from __future__ import annotations

import time
from collections.abc import Iterator
from typing import Any

import pytest
import torch

from tierckpt.config import parse_config
from tierckpt.errors import CheckpointEvictedError, ConfigError, CorruptCheckpointError, TierFullError
from tierckpt.format.manifest import BlobEntry
from tierckpt.io.buffers import aligned_empty
from tierckpt.registry import get_tier_class
from tierckpt.tiers._s3client import S3Error, S3Settings
from tierckpt.tiers.base import CheckpointKey
from tierckpt.tiers.s3 import S3Tier, parse_s3_url

moto = pytest.importorskip("moto")
from botocore.exceptions import ClientError, EndpointConnectionError  # noqa: E402

PART = 5 << 20
BUCKET = "tierckpt-unit"


@pytest.fixture
def s3(monkeypatch: pytest.MonkeyPatch) -> Iterator[Any]:
    """moto's S3 with one bucket; credentials in the environment."""
    for k, v in {
        "AWS_ACCESS_KEY_ID": "testing",
        "AWS_SECRET_ACCESS_KEY": "testing",
        "AWS_DEFAULT_REGION": "us-east-1",
    }.items():
        monkeypatch.setenv(k, v)
    with moto.mock_aws():
        import boto3

        client = boto3.client("s3", region_name="us-east-1")
        client.create_bucket(Bucket=BUCKET)
        yield client


def _tier(**kw: Any) -> S3Tier:
    settings = kw.pop("settings", S3Settings(attempts=3, deadline_s=5))
    return S3Tier("obj", BUCKET, kw.pop("prefix", "run/"), settings, part_size=PART, **kw)


def _blob(size: int, seed: int) -> torch.Tensor:
    t = aligned_empty(size)
    t.copy_(torch.randint(0, 256, (size,), dtype=torch.uint8, generator=torch.Generator().manual_seed(seed)))
    return t


def _save(tier: S3Tier, key: CheckpointKey, blobs: list[torch.Tensor], manifest: bytes = b"m") -> None:
    entries = [BlobEntry(f"blob-{i:05d}.bin", b.numel()) for i, b in enumerate(blobs)]
    w = tier.reserve(key, entries)
    futs = [
        w.write(i, o, b.data_ptr() + o, min(PART, b.numel() - o))
        for i, b in enumerate(blobs)
        for o in range(0, b.numel(), PART)
    ]
    for f in futs:
        f.result()
    w.commit(manifest)


def _load(tier: S3Tier, key: CheckpointKey, sizes: list[int]) -> list[torch.Tensor]:
    with tier.open_copy(key) as copy:
        r = copy.reader([BlobEntry(f"blob-{i:05d}.bin", s) for i, s in enumerate(sizes)])
        out = []
        for i, s in enumerate(sizes):
            buf = aligned_empty(s)
            assert r.read(i, 0, buf.data_ptr(), s).result() == s
            out.append(buf)
        return out


def _keys(client: Any, prefix: str = "") -> list[str]:
    return sorted(o["Key"] for o in client.list_objects_v2(Bucket=BUCKET, Prefix=prefix).get("Contents", []))


def _uploads(client: Any) -> list[str]:
    return [u["Key"] for u in client.list_multipart_uploads(Bucket=BUCKET).get("Uploads", [])]


# -- locations and options --------------------------------------------------------------------------------
@pytest.mark.parametrize(
    ("url", "want"),
    [
        ("s3://bkt/a/b", ("bkt", "a/b/")),
        ("s3://bkt", ("bkt", "")),
        ("s3://bkt/", ("bkt", "")),
        ("s3://my.bkt-1/x/", ("my.bkt-1", "x/")),
    ],
)
def test_urls(url: str, want: tuple[str, str]) -> None:
    assert parse_s3_url(url, "tiers[1].path") == want


@pytest.mark.parametrize(
    "url", ["s3:/bkt", "http://bkt/x", "s3://B/x", "s3://ab/x", "s3://bkt/a//b", "s3://bkt/a/../b", "s3://bkt/{rank}"]
)
def test_bad_urls(url: str) -> None:
    with pytest.raises(ConfigError, match=r"tiers\[1\]\.path"):
        parse_s3_url(url, "tiers[1].path")


def test_url_variables(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("RUN", "exp7")
    assert parse_s3_url("s3://bkt/ckpt/$RUN/x", "k") == ("bkt", "ckpt/exp7/x/")
    monkeypatch.delenv("RUN")
    with pytest.raises(ConfigError, match=r"k: \$RUN is not set"):
        parse_s3_url("s3://bkt/ckpt/$RUN", "k")
    with pytest.raises(ConfigError, match="shared by every rank"):
        parse_s3_url("s3://bkt/ckpt/{rank}", "k")


def _entry(**kw: Any) -> Any:
    entry = {"name": "obj", "kind": "s3", "path": f"s3://{BUCKET}/run"} | kw
    return parse_config({"tiers": [{"name": "host", "kind": "host"}, entry]}).tiers[1]


@pytest.mark.parametrize(
    ("kw", "match"),
    [
        ({"options": {"part_size": "1MiB"}}, r"tiers\[1\]\.options\.part_size"),
        ({"options": {"endpoint": "http://x"}}, r"tiers\[1\]\.options\.endpoint: unknown option"),
        ({"options": {"endpoint_url": "127.0.0.1:9000"}}, r"tiers\[1\]\.options\.endpoint_url"),
        ({"options": {"addressing_style": "dns"}}, r"tiers\[1\]\.options\.addressing_style"),
        ({"capacity": "1GiB"}, r"tiers\[1\]\.capacity: an s3 tier takes no capacity"),
        ({"path": "/data/ckpt"}, r"tiers\[1\]\.path: expected s3://"),
    ],
)
def test_bad_options(kw: dict[str, Any], match: str, s3: Any) -> None:
    with pytest.raises(ConfigError, match=match):
        get_tier_class("s3").from_config(_entry(**kw), None)  # type: ignore[arg-type]


def test_from_config(s3: Any) -> None:
    t = get_tier_class("s3").from_config(_entry(options={"part_size": "8MiB", "concurrency": 3}), None)  # type: ignore[arg-type]
    try:
        assert isinstance(t, S3Tier) and t.part_bytes == 8 << 20 and t.bucket.settings.concurrency == 3
        caps = t.capabilities
        assert caps.device == "object" and not caps.cheap_listing and caps.shared and caps.persistent
        assert caps.min_part_bytes == caps.max_part_bytes == 8 << 20 and t.geometry.chunk_bytes == 8 << 20
        assert t.location() == f"s3://{BUCKET}/run/ at {t.bucket.endpoint}"
    finally:
        t.close()


def test_missing_bucket_is_named_at_open(s3: Any) -> None:
    with pytest.raises(ConfigError, match=r"tiers\[1\]: bucket 'nope-bucket' does not exist at .*create_bucket"):
        get_tier_class("s3").from_config(_entry(path="s3://nope-bucket/x"), None)  # type: ignore[arg-type]
    t = S3Tier("obj", "made-bucket", "", S3Settings(), create_bucket=True)
    t.close()
    assert "made-bucket" in [b["Name"] for b in s3.list_buckets()["Buckets"]]


# -- retries ------------------------------------------------------------------------------------------------
def _slowdown(op: str) -> ClientError:
    return ClientError({"Error": {"Code": "SlowDown", "Message": "Please reduce your request rate."},
                        "ResponseMetadata": {"HTTPStatusCode": 503}}, op)  # fmt: skip


def test_transient_errors_are_retried(s3: Any) -> None:
    t = _tier(settings=S3Settings(attempts=4, deadline_s=30))
    calls: list[int] = []

    def flaky() -> str:
        calls.append(1)
        if len(calls) == 1:
            raise _slowdown("PutObject")
        if len(calls) == 2:
            raise EndpointConnectionError(endpoint_url="http://x")
        return "ok"

    try:
        assert t.bucket.call("PutObject", "k", flaky) == "ok" and len(calls) == 3
    finally:
        t.close()


def test_retries_are_bounded_and_the_error_names_everything(s3: Any) -> None:
    t = _tier(settings=S3Settings(attempts=3, deadline_s=30))
    calls: list[int] = []

    def always() -> None:
        calls.append(1)
        raise _slowdown("UploadPart")

    try:
        with pytest.raises(S3Error) as e:
            t.bucket.call("UploadPart", "run/data/x", always)
        assert len(calls) == 3
        msg = str(e.value)
        assert "UploadPart" in msg and f"s3://{BUCKET}/run/data/x" in msg and t.bucket.endpoint in msg
        assert "after 3 tries" in msg and "SlowDown" in msg and e.value.status == 503
    finally:
        t.close()


def test_retries_stop_at_the_deadline(s3: Any) -> None:
    t = _tier(settings=S3Settings(attempts=1000, deadline_s=0.5))
    start = time.monotonic()
    try:
        with pytest.raises(S3Error, match="tries in"):
            t.bucket.call("GetObject", "k", lambda: (_ for _ in ()).throw(_slowdown("GetObject")))
        assert time.monotonic() - start < 0.5 + 8.5  # the last backoff never starts past the deadline
    finally:
        t.close()


def test_a_request_told_to_stop_gives_up_in_its_backoff(s3: Any) -> None:
    """``give_up`` turns true while the request waits to be retried: it is not tried again (nor does it
    sleep out its backoff)."""
    t = _tier(settings=S3Settings(attempts=1000, deadline_s=120))
    calls: list[int] = []
    asked: list[int] = []

    def always() -> None:
        calls.append(1)
        raise _slowdown("UploadPart")

    def give_up() -> bool:
        asked.append(1)
        return len(asked) > 1  # not when it failed; while it waits

    try:
        with pytest.raises(S3Error, match="SlowDown"):
            t.bucket.call("UploadPart", "k", always, give_up=give_up)
        assert len(calls) == 1
    finally:
        t.close()


def test_permanent_errors_are_not_retried(s3: Any) -> None:
    t = _tier()
    calls: list[int] = []

    def denied() -> None:
        calls.append(1)
        raise ClientError({"Error": {"Code": "AccessDenied"}, "ResponseMetadata": {"HTTPStatusCode": 403}}, "PutObject")

    try:
        with pytest.raises(S3Error, match="AccessDenied"):
            t.bucket.call("PutObject", "k", denied)
        assert calls == [1]
    finally:
        t.close()


# -- writes, replaces, damage --------------------------------------------------------------------------
def test_round_trip_and_requests_without_listing(s3: Any) -> None:
    t = _tier(hashed_prefixes=2)
    try:
        blobs = [_blob(PART * 2 + 123, 1), _blob(1000, 2), _blob(0, 3)]
        _save(t, CheckpointKey(7, 3), blobs, b"manifest")
        got = _load(t, CheckpointKey(7, 3), [b.numel() for b in blobs])
        assert all(torch.equal(a, b) for a, b in zip(got, blobs))
        assert t.read_manifest(CheckpointKey(7, 3)) == b"manifest"
        keys = _keys(s3)
        assert "run/manifests/step-000000000007/rank-00003" in keys
        data = [k for k in keys if k.startswith("run/data/")]
        assert len(data) == 2 and all(k.split("/")[2] != "step-000000000007" for k in data)  # hashed prefix
        assert _uploads(s3) == []
    finally:
        t.close()


def test_writes_must_be_whole_parts(s3: Any) -> None:
    t = _tier()
    b = _blob(PART + 10, 1)
    w = t.reserve(CheckpointKey(1), [BlobEntry("blob-00000.bin", b.numel())])
    try:
        with pytest.raises(ValueError, match="not one of its parts"):
            w.write(0, 0, b.data_ptr(), PART + 4096)
        with pytest.raises(ValueError, match="not one of its parts"):
            w.write(0, 4096, b.data_ptr(), PART)
        w.write(0, 0, b.data_ptr(), PART).result()
        with pytest.raises(ValueError, match=r"has parts \[1\] of \[5242880\] bytes, not its 2 parts"):
            w.commit(b"m")  # the commit fails and aborts: nothing listed, no upload left
        assert t.list_committed() == [] and _uploads(s3) == []
    finally:
        w.abort()
        t.close()


def test_too_many_parts_is_refused(s3: Any) -> None:
    t = _tier()
    try:
        with pytest.raises(ValueError, match="more than 10000 parts"):
            t.reserve(CheckpointKey(1), [BlobEntry("blob-00000.bin", PART * 10_000 + 1)])
    finally:
        t.close()


def test_abort_leaves_no_upload(s3: Any) -> None:
    t = _tier()
    b = _blob(PART * 2, 1)
    w = t.reserve(CheckpointKey(1), [BlobEntry("blob-00000.bin", b.numel())])
    w.write(0, 0, b.data_ptr(), PART).result()
    assert len(_uploads(s3)) == 1
    w.abort()
    try:
        assert _uploads(s3) == [] and _keys(s3) == [] and t.list_committed() == []
    finally:
        t.close()


def test_replace_deletes_the_old_version(s3: Any) -> None:
    t = _tier()
    try:
        _save(t, CheckpointKey(1), [_blob(100, 1)])
        first = _keys(s3, "run/data/")
        with t.open_copy(CheckpointKey(1)) as old:
            _save(t, CheckpointKey(1), [_blob(100, 2)])
            second = _keys(s3, "run/data/")
            assert len(first) == len(second) == 1 and first != second
            r = old.reader([BlobEntry("blob-00000.bin", 100)])
            buf = aligned_empty(100)
            with pytest.raises(CheckpointEvictedError):  # the old version is gone, never mixed with the new
                r.read(0, 0, buf.data_ptr(), 100).result()
        assert torch.equal(_load(t, CheckpointKey(1), [100])[0], _blob(100, 2))
    finally:
        t.close()


def test_damage_is_reported_as_damage(s3: Any) -> None:
    t = _tier()
    try:
        _save(t, CheckpointKey(1), [_blob(100, 1)])
        _save(t, CheckpointKey(2), [_blob(100, 1)])
        (k1,) = _keys(s3, "run/data/step-000000000001/")
        s3.put_object(Bucket=BUCKET, Key=k1, Body=b"short")
        with pytest.raises(CorruptCheckpointError, match="holds 5 bytes"):
            _load(t, CheckpointKey(1), [100])
        (k2,) = _keys(s3, "run/data/step-000000000002/")
        s3.delete_object(Bucket=BUCKET, Key=k2)
        with pytest.raises(CorruptCheckpointError, match="is missing"):
            _load(t, CheckpointKey(2), [100])
        s3.put_object(Bucket=BUCKET, Key="run/manifests/step-000000000002/rank-00000", Body=b"TCKPOBJ1 garbage")
        with pytest.raises(CorruptCheckpointError, match="not a copy's head object"):
            t.read_manifest(CheckpointKey(2))
    finally:
        t.close()


def test_evict_unlists_first_and_reclaim_frees(s3: Any) -> None:
    t = _tier()
    try:
        _save(t, CheckpointKey(1), [_blob(100, 1), _blob(200, 2)])
        used = t.used_bytes()
        assert used >= 300
        t.evict(CheckpointKey(1), free=False)
        assert t.list_committed() == [] and len(_keys(s3, "run/data/")) == 2
        t.reclaim()
        assert _keys(s3) == [] and t.used_bytes() == 0
    finally:
        t.close()


def test_records(s3: Any) -> None:
    t = _tier()
    try:
        t.write_record(3, b"r3")
        t.write_record(12, b"r12")
        assert t.list_records() == [3, 12] and t.read_record(12) == b"r12" and t.read_record(4) is None
        t.remove_record(3)
        t.remove_record(99)
        assert t.list_records() == [12]
    finally:
        t.close()


def test_sweep_takes_what_a_crash_left(s3: Any) -> None:
    t = _tier()
    _save(t, CheckpointKey(1), [_blob(100, 1)])
    b = _blob(PART * 2, 2)
    w = t.reserve(CheckpointKey(2), [BlobEntry("blob-00000.bin", b.numel())])
    w.write(0, 0, b.data_ptr(), PART).result()  # a crash here leaves an upload
    s3.put_object(Bucket=BUCKET, Key="run/data/step-000000000003/rank-00000/0-abc/blob-00000.bin", Body=b"x")
    t.close()  # (no abort: as if the process died)
    assert len(_uploads(s3)) == 1 and len(_keys(s3, "run/data/")) == 2
    # (moto dates every upload in 2010: the grace is tested on the real server, tests/s3)
    swept = _tier(sweep_grace_s=0)
    try:
        assert _uploads(s3) == []
        assert _keys(s3, "run/data/") == _keys(s3, "run/data/step-000000000001/")
        assert swept.list_committed() == [CheckpointKey(1)]
    finally:
        swept.close()


# -- what the audit found: ambiguous answers, a full bucket, options changed, hostile answers ------------
def test_a_changed_hashed_prefixes_still_finds_every_copy(s3: Any) -> None:
    t = _tier(hashed_prefixes=0)
    _save(t, CheckpointKey(1), [_blob(100, 1)])
    t.close()
    t = _tier(hashed_prefixes=2)
    try:
        assert torch.equal(_load(t, CheckpointKey(1), [100])[0], _blob(100, 1))
        _save(t, CheckpointKey(2), [_blob(100, 2)])
        t.evict(CheckpointKey(1))
        assert [k for k in _keys(s3, "run/data/") if "step-000000000001" in k] == []
    finally:
        t.close()


def test_a_head_put_whose_answer_is_lost_is_a_commit(s3: Any, monkeypatch: pytest.MonkeyPatch) -> None:
    t = _tier(settings=S3Settings(attempts=1, deadline_s=1))
    real = t.bucket.client.put_object

    def applied_then_lost(**kw: Any) -> Any:
        real(**kw)
        if kw["Key"].startswith("run/manifests/"):
            raise EndpointConnectionError(endpoint_url="http://lost")
        return None

    monkeypatch.setattr(t.bucket.client, "put_object", applied_then_lost)
    try:
        _save(t, CheckpointKey(1), [_blob(100, 1)])  # no error: the head is in place
        monkeypatch.undo()
        assert torch.equal(_load(t, CheckpointKey(1), [100])[0], _blob(100, 1))
    finally:
        t.close()


def test_a_full_bucket_at_commit_leaves_the_writer_to_commit_again(s3: Any, monkeypatch: pytest.MonkeyPatch) -> None:
    t = _tier()
    real, calls = t.bucket.client.put_object, []

    def quota(**kw: Any) -> Any:
        calls.append(1)
        if len(calls) == 1:
            raise ClientError(
                {"Error": {"Code": "QuotaExceeded"}, "ResponseMetadata": {"HTTPStatusCode": 403}}, "PutObject"
            )
        return real(**kw)

    monkeypatch.setattr(t.bucket.client, "put_object", quota)
    b = _blob(PART + 5, 1)
    w = t.reserve(CheckpointKey(1), [BlobEntry("blob-00000.bin", b.numel())])
    try:
        for o in (0, PART):
            w.write(0, o, b.data_ptr() + o, min(PART, b.numel() - o)).result()
        with pytest.raises(TierFullError):
            w.commit(b"m")
        w.commit(b"m")  # room made: the same writer commits
        assert torch.equal(_load(t, CheckpointKey(1), [b.numel()])[0], b)
    finally:
        w.abort()
        t.close()


def test_a_lost_complete_answer_is_not_a_failure(s3: Any, monkeypatch: pytest.MonkeyPatch) -> None:
    t = _tier()
    real = t.bucket.client.complete_multipart_upload
    lost: list[int] = []

    def applied_then_lost(**kw: Any) -> Any:
        if not lost:
            lost.append(1)
            real(**kw)
            raise EndpointConnectionError(endpoint_url="http://lost")
        raise ClientError({"Error": {"Code": "NoSuchUpload"}, "ResponseMetadata": {"HTTPStatusCode": 404}}, "Complete")

    monkeypatch.setattr(t.bucket.client, "complete_multipart_upload", applied_then_lost)
    try:
        _save(t, CheckpointKey(1), [_blob(100, 1)])
        assert torch.equal(_load(t, CheckpointKey(1), [100])[0], _blob(100, 1))
    finally:
        t.close()


def test_a_failing_copy_fails_fast_not_once_per_part(s3: Any, monkeypatch: pytest.MonkeyPatch) -> None:
    t = _tier(settings=S3Settings(attempts=3, deadline_s=30))
    calls: list[int] = []

    def down(**kw: Any) -> Any:
        calls.append(1)
        raise ClientError(
            {"Error": {"Code": "AccessDenied"}, "ResponseMetadata": {"HTTPStatusCode": 403}}, "UploadPart"
        )

    monkeypatch.setattr(t.bucket.client, "upload_part", down)
    b = _blob(PART * 12, 1)
    w = t.reserve(CheckpointKey(1), [BlobEntry("blob-00000.bin", b.numel())])
    futs = [w.write(0, o, b.data_ptr() + o, PART) for o in range(0, b.numel(), PART)]
    try:
        errors = [f.exception() for f in futs]
        assert all(isinstance(e, S3Error) for e in errors) and len(calls) < 12
    finally:
        w.abort()
        t.close()
    assert _uploads(s3) == []


def _throttled_forever(t: S3Tier, monkeypatch: pytest.MonkeyPatch) -> list[int]:
    """Every UploadPart of ``t`` answered 503 SlowDown; the tries, counted."""
    calls: list[int] = []

    def slow(**kw: Any) -> Any:
        calls.append(1)
        raise _slowdown("UploadPart")

    monkeypatch.setattr(t.bucket.client, "upload_part", slow)
    return calls


def test_cancel_makes_parts_in_their_retries_give_up(s3: Any, monkeypatch: pytest.MonkeyPatch) -> None:
    """A server that throttles every part, retries allowed for minutes: after ``cancel`` the parts fail
    (within a backoff's poll), later writes fail at once, and abort leaves no upload."""
    t = _tier(settings=S3Settings(attempts=1000, deadline_s=600))
    calls = _throttled_forever(t, monkeypatch)
    b = _blob(PART * 3, 1)
    w = t.reserve(CheckpointKey(1), [BlobEntry("blob-00000.bin", b.numel())])
    try:
        futs = [w.write(0, o, b.data_ptr() + o, PART) for o in range(0, b.numel(), PART)]
        deadline = time.monotonic() + 30
        while not calls and time.monotonic() < deadline:
            time.sleep(0.01)
        assert calls, "no part was sent"
        w.cancel()
        assert all(isinstance(f.exception(timeout=30), (S3Error, RuntimeError)) for f in futs)
        with pytest.raises((S3Error, RuntimeError)):  # the first part's error, or "aborted"
            w.write(0, 0, b.data_ptr(), PART).result(timeout=30)
        w.abort()
    finally:
        w.abort()
        t.close()
    assert _uploads(s3) == []


def test_aborting_a_compressed_copy_does_not_wait_out_the_part_retries(
    s3: Any, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A compressed copy to a server that throttles every part (retries allowed for minutes) is aborted
    (its source failed, the save was killed): the abort returns as soon as the parts give up, and leaves
    no upload."""
    import threading

    from tierckpt.datapath.blobcopy import ordered_writer
    from tierckpt.datapath.codecwrite import codec_writer
    from tierckpt.format.manifest import Manifest, TensorTable
    from tierckpt.policies.compressconfig import CompressConfig
    from tierckpt.policies.compression import Adaptive

    t = _tier(settings=S3Settings(attempts=1000, deadline_s=600))
    calls = _throttled_forever(t, monkeypatch)
    size = 4 * PART
    table = TensorTable(["w"], ["uint8"], [(size,)], [0], [0], [size], [0])
    blobs = (BlobEntry("blob-00000.bin", size),)
    m = Manifest(step=4, rank=0, world_size=1, align=4096, blobs=blobs, tensors=table, tree=b"\x80",
                 has_pickle=False, chunk_bytes=1 << 20)  # fmt: skip
    data = _blob(size, 3)  # noise: stored raw, every part whole
    try:
        ordered, end = ordered_writer(t, t.reserve(CheckpointKey(4), blobs), blobs)
        w = codec_writer(t, ordered, end, m, Adaptive(CompressConfig("zstd"), 2), chunk_bytes=PART)
        futs = [w.write(0, o, data.data_ptr() + o, PART) for o in range(0, size, PART)]
        deadline = time.monotonic() + 30
        while not calls and time.monotonic() < deadline:
            time.sleep(0.01)
        assert calls, "no part was sent"
        aborting = threading.Thread(target=w.abort, daemon=True)
        aborting.start()
        aborting.join(30)  # the part's retries go on for minutes
        assert not aborting.is_alive(), "the abort waited for the part's retries"
        for f in futs:
            f.exception(timeout=30)
    finally:
        t.close()
    assert _uploads(s3) == []


def test_oversized_heads_and_ignored_ranges_are_refused(s3: Any, monkeypatch: pytest.MonkeyPatch) -> None:
    t = _tier()
    try:
        _save(t, CheckpointKey(1), [_blob(PART + 100, 1)])
        with pytest.raises(CorruptCheckpointError, match="more than"):
            t.bucket.get("run/manifests/step-000000000001/rank-00000", 10)
        real = t.bucket.client.get_object

        def whole(**kw: Any) -> Any:
            kw.pop("Range", None)
            return real(**kw)

        monkeypatch.setattr(t.bucket.client, "get_object", whole)
        with t.open_copy(CheckpointKey(1)) as copy:
            r = copy.reader([BlobEntry("blob-00000.bin", PART + 100)])
            buf = aligned_empty(100)
            with pytest.raises(S3Error, match="RangeError"):
                r.read(0, PART, buf.data_ptr(), 100).result()
    finally:
        t.close()


def test_a_compressed_copy_holds_its_stored_streams_and_its_head_says_so(s3: Any) -> None:
    """A copy written through a codec writer: each object is its blob's stored stream (padded to the
    alignment, its last part short), and the head records those lengths (docs/format.md)."""
    from tierckpt.datapath.blobcopy import ordered_writer
    from tierckpt.datapath.codecwrite import codec_writer
    from tierckpt.format.frames import held_sizes
    from tierckpt.format.manifest import Manifest, TensorTable, encode_manifest
    from tierckpt.policies.compressconfig import CompressConfig
    from tierckpt.policies.compression import Adaptive

    t = _tier()
    sizes = [3 * PART, 3 * 4096]
    table = TensorTable(
        ["w", "n"], ["float32", "uint8"], [(sizes[0] // 4,), (sizes[1],)], [0, 1], [0, 0], sizes, [0, 0]
    )
    blobs = tuple(BlobEntry(f"blob-{i:05d}.bin", s) for i, s in enumerate(sizes))
    m = Manifest(step=4, rank=0, world_size=1, align=4096, blobs=blobs, tensors=table, tree=b"\x80",
                 has_pickle=False, chunk_bytes=1 << 20)  # fmt: skip
    data = [aligned_empty(sizes[0]).zero_(), _blob(sizes[1], 7)]
    key = CheckpointKey(4)
    try:
        ordered, end = ordered_writer(t, t.reserve(key, blobs), blobs)
        w = codec_writer(t, ordered, end, m, Adaptive(CompressConfig("zstd"), 2), chunk_bytes=PART)
        futs = [w.write(i, o, d.data_ptr() + o, min(PART, d.numel() - o)) for i, d in enumerate(data)
                for o in range(0, d.numel(), PART)]  # fmt: skip
        for f in futs:
            f.result()
        w.commit(encode_manifest(m))
        head = t.read_head(key)
        assert head is not None
        held = held_sizes(head.manifest)
        assert held is not None and held[0] < PART and held[1] == sizes[1]  # zeros shrink, noise does not
        assert [s for _, s in head.blobs] == held
        prefix = t.keys.data(key, head.version, head.spread)
        lengths = [s3.head_object(Bucket=BUCKET, Key=prefix + b.name)["ContentLength"] for b in blobs]
        assert lengths == held and _uploads(s3) == []
    finally:
        t.close()
