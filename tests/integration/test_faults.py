"""Fault handling of a local + pfs hierarchy: full tiers, damaged bytes, bad manifests, refused values,
vanished tier directories and replaced steps. Every failure must be loud, named and leave nothing half
written; a good copy on another tier must still be used."""

from __future__ import annotations

import dataclasses
import errno
import itertools
import logging
import math
import os
import shutil
import sys
from collections import OrderedDict
from collections.abc import Iterator
from fractions import Fraction
from pathlib import Path
from typing import Any

import pytest
import torch

from tierckpt import (
    CheckpointNotFoundError,
    CorruptCheckpointError,
    Hierarchy,
    StateError,
    TierckptError,
    TierIOError,
)
from tierckpt.bench.workloads import zeros_like_state
from tierckpt.format.manifest import BlobEntry, Manifest, decode_manifest, encode_manifest
from tierckpt.format.tree import flatten
from tierckpt.testing.tamper import blob_file, rewrite_manifest
from tierckpt.tiers._lease import LEASE_DIR

SCRATCH_PREFIXES = (".tmp-", ".old-", ".evict-")


# -- helpers ---------------------------------------------------------------------------------------------
def config(tmp_path: Path, tiers: tuple[str, ...] = ("ssd", "pfs"), **extra: Any) -> dict[str, Any]:
    kinds = {"ssd": "local", "pfs": "pfs"}
    # plain copies (compress: none): the faults are put at the raw blobs' offsets and sizes
    entries = [{"name": n, "kind": kinds[n], "path": str(tmp_path / n), "compress": "none"} for n in tiers]
    cfg: dict[str, Any] = {"tiers": entries}
    cfg.update(extra)
    return cfg


@pytest.fixture
def two(tmp_path: Path) -> Iterator[Hierarchy]:
    h = Hierarchy.from_config(config(tmp_path, layout={"blob_size": "1MiB"}))
    yield h
    h.close()


@pytest.fixture
def one(tmp_path: Path) -> Iterator[Hierarchy]:
    h = Hierarchy.from_config(config(tmp_path, ("ssd",), layout={"blob_size": "1MiB"}))
    yield h
    h.close()


def small_state(seed: int = 0) -> dict[str, Any]:
    """~1.6 MiB over several tensors of mixed dtypes; with 1 MiB blobs that is a few blobs."""
    g = torch.Generator().manual_seed(seed)
    return {
        "model": {
            "embed.weight": torch.randn(256, 512, generator=g),  # 512 KiB
            "layer0.weight": torch.randn(300, 301, generator=g).to(torch.bfloat16),
            "layer0.bias": torch.randn(301, generator=g),
            "head.weight": torch.randint(0, 1000, (100_000,), generator=g, dtype=torch.int64),  # 800 KiB
            "tiny": torch.arange(7, dtype=torch.int16),
        },
        "optim": {"param_groups": [{"lr": 1e-3, "betas": (0.9, 0.999)}], "state": {0: {"step": torch.tensor(3.0)}}},
        "step": seed,
    }


def assert_same(a: Any, b: Any, path: str = "state") -> None:
    if isinstance(a, torch.Tensor):
        assert isinstance(b, torch.Tensor), path
        assert a.dtype == b.dtype and a.shape == b.shape, path
        assert torch.equal(a, b), path
    elif isinstance(a, dict):
        assert isinstance(b, dict) and list(a) == list(b), path
        for k in a:
            assert_same(a[k], b[k], f"{path}[{k!r}]")
    elif isinstance(a, (list, tuple)):
        assert type(a) is type(b) and len(a) == len(b), path
        for i, (x, y) in enumerate(zip(a, b)):
            assert_same(x, y, f"{path}[{i}]")
    else:
        assert a == b and type(a) is type(b), path


def rank_dir(h: Hierarchy, tier: str, step: int) -> Path:
    return Path(h.tier(tier).path) / f"step-{step:012d}" / "rank-00000"  # type: ignore[attr-defined]


def scratch_entries(root: Path) -> list[Path]:
    return [p for p in root.rglob("*") if p.name.startswith(SCRATCH_PREFIXES)]


def tier_entries(root: Path) -> list[str]:
    """Every path under a tier directory, relative to it."""
    return sorted(str(p.relative_to(root)) for p in root.rglob("*") if LEASE_DIR not in p.parts)


def flip_blob_byte(rank: Path, blob: int, pos: int) -> None:
    """Flip byte ``pos`` of blob ``blob`` of the copy in ``rank`` (a file a blob, or one data file)."""
    path, base = blob_file(rank, blob)
    flip_byte(path, base + pos)


def flip_byte(path: Path, pos: int) -> None:
    with open(path, "r+b") as f:
        f.seek(pos)
        b = f.read(1)
        f.seek(pos)
        f.write(bytes([b[0] ^ 0x5A]))
        f.flush()
        os.fsync(f.fileno())


def no_blob_reads(monkeypatch: pytest.MonkeyPatch, h: Hierarchy) -> None:
    """Make opening any tier's blobs fail the test: manifest validation must come first."""
    for t in h.tiers:

        def boom(*args: Any, _name: str = t.name, **kwargs: Any) -> Any:
            raise AssertionError(f"tier {_name!r}: a blob was opened although the manifest is bad")

        def opened(key: Any, _open: Any = t.open_copy, _boom: Any = boom) -> Any:
            c = _open(key)
            c.reader = _boom
            return c

        monkeypatch.setattr(t, "reader", boom)
        monkeypatch.setattr(t, "open_copy", opened)


# -- ENOSPC on a small tmpfs -----------------------------------------------------------------------------
def big_state(mib: int, fill: int) -> dict[str, torch.Tensor]:
    return {f"t{i:02d}": torch.full((4 << 20,), (fill + i) % 251, dtype=torch.uint8) for i in range(mib // 4)}


@pytest.mark.root
def test_enospc_on_lower_tier_keeps_upper_tier_and_leaves_nothing(tmp_path: Path, tmpfs: Path) -> None:
    h = Hierarchy.from_config(config(tmp_path, layout={"blob_size": "16MiB"}))
    try:
        state = big_state(96, fill=1)  # 96 MiB > the 64 MiB tmpfs
        handle = h.save(state, step=1)
        with pytest.raises(OSError) as ei:
            handle.wait()
        assert ei.value.errno == errno.ENOSPC
        assert isinstance(ei.value, TierIOError)
        assert "pfs" in str(ei.value)
        assert handle.durable["ssd"].result() is None  # the healthy tier committed
        assert set(handle.errors()) == {"pfs"}
        assert [(c.step, c.tiers) for c in h.checkpoints()] == [(1, ("ssd",))]
        assert_same(state, h.restore())
        # nothing half-written on the full tier: no rank directory for the step, no scratch left
        assert not list(tmpfs.rglob("rank-*"))
        assert scratch_entries(tmpfs) == []
        assert h.tier("pfs").list_committed() == []

        small = big_state(8, fill=7)
        h.save(small, step=2).wait()  # both tiers take a smaller one afterwards
        assert [(c.step, c.tiers) for c in h.checkpoints()] == [(1, ("ssd",)), (2, ("ssd", "pfs"))]
        assert_same(small, h.restore(2, tier="pfs"))
        assert_same(state, h.restore(1))
    finally:
        h.close()


@pytest.mark.root
def test_enospc_when_earlier_checkpoints_fill_the_tier(tmp_path: Path, tmpfs: Path) -> None:
    """The first save fits; the second does not fit next to it and fails without touching the first."""
    h = Hierarchy.from_config(config(tmp_path, layout={"blob_size": "16MiB"}))
    try:
        first, second = big_state(40, fill=3), big_state(40, fill=5)
        h.save(first, step=1).wait()
        handle = h.save(second, step=2)
        with pytest.raises(TierIOError) as ei:
            handle.wait()
        assert ei.value.errno == errno.ENOSPC
        assert [(c.step, c.tiers) for c in h.checkpoints()] == [(1, ("ssd", "pfs")), (2, ("ssd",))]
        assert not (tmpfs / "step-000000000002").exists() or not list((tmpfs / "step-000000000002").iterdir())
        assert scratch_entries(tmpfs) == []
        assert_same(first, h.restore(1, tier="pfs"))
        assert_same(second, h.restore(2))
    finally:
        h.close()


# -- damaged blob bytes ----------------------------------------------------------------------------------
def flip_targets(m: Manifest) -> list[tuple[str, int, int, str]]:
    """(position name, blob index, byte offset, key path of the tensor holding it)."""
    big = max(m.tensors, key=lambda t: t.length)
    first = min((t for t in m.tensors if t.length), key=lambda t: (t.blob, t.offset))
    last = max((t for t in m.tensors if t.length and t.blob == 0), key=lambda t: t.offset + t.length)
    lastblob = len(m.blobs) - 1
    tail = max((t for t in m.tensors if t.length and t.blob == lastblob), key=lambda t: t.offset + t.length)
    return [
        ("first-byte", first.blob, first.offset, first.path),
        ("middle", big.blob, big.offset + big.length // 2, big.path),
        ("last-used-byte-blob0", 0, last.offset + last.length - 1, last.path),
        ("last-used-byte-last-blob", lastblob, tail.offset + tail.length - 1, tail.path),
    ]


POSITIONS = ["first-byte", "middle", "last-used-byte-blob0", "last-used-byte-last-blob"]


@pytest.mark.parametrize("position", POSITIONS)
def test_flipped_byte_single_tier_is_corrupt(one: Hierarchy, position: str, loops: str) -> None:
    one.save(small_state(), step=4).wait()
    _, m = one.inspect(4)
    assert len(m.blobs) >= 2
    _, blob, pos, key = next(t for t in flip_targets(m) if t[0] == position)
    flip_blob_byte(rank_dir(one, "ssd", 4), blob, pos)

    with pytest.raises(CorruptCheckpointError) as ei:
        one.restore()
    e = ei.value
    msg = str(e)
    assert (e.tier, e.step, e.blob, e.key) == ("ssd", 4, m.blobs[blob].name, key)
    for part in ("ssd", m.blobs[blob].name, key):
        assert part in msg
    assert e.errno == errno.EBADMSG

    [(step, tier, err)] = one.verify(4)
    assert (step, tier) == (4, "ssd") and isinstance(err, CorruptCheckpointError)
    assert err.key == key


@pytest.mark.parametrize("position", POSITIONS)
@pytest.mark.parametrize("bad", ["ssd", "pfs"])
def test_flipped_byte_falls_back_to_the_other_tier(
    two: Hierarchy, position: str, bad: str, caplog: pytest.LogCaptureFixture, loops: str
) -> None:
    state = small_state(1)
    two.save(state, step=4).wait()
    _, m = two.inspect(4)
    _, blob, pos, key = next(t for t in flip_targets(m) if t[0] == position)
    flip_blob_byte(rank_dir(two, bad, 4), blob, pos)

    with caplog.at_level(logging.WARNING, logger="tierckpt"):
        restored = two.restore()
    assert_same(state, restored)
    warnings = [r for r in caplog.records if r.levelno >= logging.WARNING and r.name.startswith("tierckpt")]
    if bad == "ssd":  # the fastest copy is damaged: a warning names it, the pfs copy is returned
        assert warnings and any("ssd" in r.getMessage() and key in r.getMessage() for r in warnings)
    else:  # the fastest copy is fine: the damage on pfs is not even read
        assert warnings == []

    report = {tier: err for step, tier, err in two.verify(4)}
    good = "pfs" if bad == "ssd" else "ssd"
    assert report[good] is None
    assert isinstance(report[bad], CorruptCheckpointError)
    assert (report[bad].tier, report[bad].blob, report[bad].key) == (bad, m.blobs[blob].name, key)

    with pytest.raises(CorruptCheckpointError):
        two.restore(4, tier=bad)
    assert_same(state, two.restore(4, tier=good))


@pytest.mark.parametrize("where", ["blob-tail-padding", "gap-between-tensors", "gap-last-byte"])
def test_damage_in_padding_is_found(two: Hierarchy, where: str, caplog: pytest.LogCaptureFixture, loops: str) -> None:
    """Bytes outside every extent (alignment gaps, blob tail) must be zero (docs/format.md): a flipped one
    is damage too, reported with the blob, and the other tier's copy is used."""
    state = small_state(2)
    two.save(state, step=1).wait()
    _, m = two.inspect(1)
    spans = sorted((t.offset, t.offset + t.length) for t in m.tensors if t.length and t.blob == 0)
    if where == "blob-tail-padding":
        pos = m.blobs[0].size - 1
        assert spans[-1][1] <= pos
    else:
        gaps = [(a_end, b_start) for (_, a_end), (b_start, _) in itertools.pairwise(spans) if b_start > a_end]
        assert gaps, spans
        pos = gaps[0][0] if where == "gap-between-tensors" else gaps[-1][1] - 1
    flip_blob_byte(rank_dir(two, "ssd", 1), 0, pos)

    with pytest.raises(CorruptCheckpointError) as ei:
        two.restore(tier="ssd")
    assert (ei.value.tier, ei.value.blob) == ("ssd", m.blobs[0].name)
    with caplog.at_level(logging.WARNING, logger="tierckpt"):
        assert_same(state, two.restore())
    assert any("ssd" in r.getMessage() for r in caplog.records if r.levelno >= logging.WARNING)
    report = {tier: err for _, tier, err in two.verify(1)}
    assert report["pfs"] is None and isinstance(report["ssd"], CorruptCheckpointError)


def test_every_copy_damaged_raises_the_first_error(two: Hierarchy, caplog: pytest.LogCaptureFixture) -> None:
    two.save(small_state(), step=2).wait()
    _, m = two.inspect(2)
    for tier in ("ssd", "pfs"):
        flip_blob_byte(rank_dir(two, tier, 2), 0, m.tensors[0].offset)
    with caplog.at_level(logging.WARNING, logger="tierckpt"), pytest.raises(CorruptCheckpointError) as ei:
        two.restore()
    assert ei.value.tier == "ssd"
    assert [e is None for _, _, e in two.verify(2)] == [False, False]


# -- truncated / missing blobs, bad manifests ------------------------------------------------------------
@pytest.mark.parametrize("keep", [0, 4096, 4096 + 100, "half", "minus-one"])
def test_truncated_blob_is_corrupt(one: Hierarchy, keep: int | str) -> None:
    one.save(small_state(), step=3).wait()
    _, m = one.inspect(3)
    blob = m.blobs[0]
    size = {"half": blob.size // 2, "minus-one": blob.size - 1}.get(keep, keep)  # type: ignore[call-overload]
    os.truncate(rank_dir(one, "ssd", 3) / blob.name, size)
    with pytest.raises(CorruptCheckpointError) as ei:
        one.restore()
    assert (ei.value.tier, ei.value.blob) == ("ssd", blob.name)
    assert blob.name in str(ei.value)


def test_missing_blob_is_corrupt(one: Hierarchy) -> None:
    one.save(small_state(), step=3).wait()
    _, m = one.inspect(3)
    (rank_dir(one, "ssd", 3) / m.blobs[-1].name).unlink()
    with pytest.raises(CorruptCheckpointError) as ei:
        one.restore()
    assert ei.value.tier == "ssd" and ei.value.blob == m.blobs[-1].name
    assert m.blobs[-1].name in str(ei.value)
    [(_, _, err)] = one.verify(3)
    assert isinstance(err, CorruptCheckpointError)


def test_missing_blob_falls_back_to_the_other_tier(two: Hierarchy, caplog: pytest.LogCaptureFixture) -> None:
    state = small_state(5)
    two.save(state, step=3).wait()
    _, m = two.inspect(3)
    (rank_dir(two, "ssd", 3) / m.blobs[0].name).unlink()
    with caplog.at_level(logging.WARNING, logger="tierckpt"):
        assert_same(state, two.restore())
    assert any("ssd" in r.getMessage() for r in caplog.records if r.levelno >= logging.WARNING)


def test_a_copy_that_lost_its_manifest_is_no_checkpoint(
    two: Hierarchy, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    """A rank directory is only published with its manifest, so one without it was never a committed
    copy (or was damaged): the tier skips it with a warning naming it, so it neither hides the step's
    good copy on another tier nor counts toward the tier's keep window."""
    state = small_state(4)
    two.save(state, step=2).wait()
    gone = rank_dir(two, "ssd", 2)
    (gone / "manifest").unlink()
    with caplog.at_level(logging.WARNING, logger="tierckpt"):
        assert two.checkpoints()[-1].tiers == ("pfs",)
        assert_same(state, two.restore())
    assert two.last_restore == (2, "pfs")
    assert any(str(gone) in r.getMessage() and "no manifest" in r.getMessage() for r in caplog.records)
    no_blob_reads(monkeypatch, two)
    with pytest.raises(CheckpointNotFoundError, match="no committed checkpoint for rank 0 on tier 'ssd'"):
        two.restore(2, tier="ssd")
    assert gone.is_dir()  # left for inspection, not deleted


def _garbage_manifests(good: bytes) -> dict[str, bytes]:
    m = decode_manifest(good)
    other_step = encode_manifest(dataclasses.replace(m, step=m.step + 1))
    flipped = bytearray(good)
    flipped[len(good) // 2] ^= 0xFF
    return {
        "empty": b"",
        "random": os.urandom(len(good)),
        "text": b"not a manifest at all\n" * 10,
        "truncated": good[: len(good) - 9],
        "extended": good + b"\0",
        "payload-flip": bytes(flipped),
        "bad-magic": b"TIERCKPX" + good[8:],
        "future-version": good[:8] + (99).to_bytes(2, "little") + good[10:],
        "other-step": other_step,
    }


@pytest.mark.parametrize(
    "kind",
    ["empty", "random", "text", "truncated", "extended", "payload-flip", "bad-magic", "future-version", "other-step"],
)
def test_bad_manifest_is_corrupt_before_any_blob_is_read(
    one: Hierarchy, kind: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    one.save(small_state(), step=6).wait()
    mpath = rank_dir(one, "ssd", 6) / "manifest"
    rewrite_manifest(mpath, _garbage_manifests(mpath.read_bytes())[kind])
    no_blob_reads(monkeypatch, one)
    with pytest.raises(CorruptCheckpointError) as ei:
        one.restore()
    assert ei.value.tier == "ssd" and ei.value.step == 6
    assert "manifest" in str(ei.value)
    [(_, _, err)] = one.verify(6)
    assert isinstance(err, CorruptCheckpointError)


@pytest.mark.parametrize(
    "name", ["../../etc/passwd", "/etc/passwd", "sub/blob-00000.bin", ".hidden", "..", "blob\0.bin", "", "x" * 200]
)
def test_manifest_with_unsafe_blob_name_is_refused(
    one: Hierarchy, tmp_path: Path, name: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    one.save(small_state(), step=7).wait()
    mpath = rank_dir(one, "ssd", 7) / "manifest"
    m = decode_manifest(mpath.read_bytes())
    bad = dataclasses.replace(m, blobs=(BlobEntry(name, m.blobs[0].size), *m.blobs[1:]))
    rewrite_manifest(mpath, encode_manifest(bad))  # correctly framed and checksummed: only the name is wrong
    no_blob_reads(monkeypatch, one)
    with pytest.raises(CorruptCheckpointError) as ei:
        one.restore()
    assert "plain file name" in str(ei.value) and ei.value.tier == "ssd"


def test_manifest_with_out_of_bounds_extent_is_refused(one: Hierarchy, monkeypatch: pytest.MonkeyPatch) -> None:
    one.save(small_state(), step=8).wait()
    mpath = rank_dir(one, "ssd", 8) / "manifest"
    m = decode_manifest(mpath.read_bytes())
    t0 = m.tensors[0]
    moved = t0._replace(offset=m.blobs[t0.blob].size - t0.length // 2 // 64 * 64)
    rewrite_manifest(mpath, encode_manifest(dataclasses.replace(m, tensors=(moved, *m.tensors[1:]))))
    no_blob_reads(monkeypatch, one)
    with pytest.raises(CorruptCheckpointError, match="exceeds blob size"):
        one.restore()


@pytest.mark.parametrize("version", [1, 2, 3, 4])
def test_older_format_checkpoint_is_still_restored(one: Hierarchy, version: int) -> None:
    """A checkpoint whose manifest is format version 1 (row-per-tensor table), 2 (ext-2 tensor
    references in the tree, ints as themselves), 3 (the payload alone checksummed) or 4 (no sharding
    fields) restores, into new tensors and in place, and verifies."""
    state = small_state(4)
    state["meta"] = {"ids": [1, -2, 1 << 70], "pair": (5, state["model"]["tiny"]), 7: OrderedDict(a=0)}
    one.save(state, step=9).wait()
    mpath = rank_dir(one, "ssd", 9) / "manifest"
    m = decode_manifest(mpath.read_bytes())
    assert m.version == 5
    old = flatten(state, version=version).tree
    assert (old != m.tree) == (version < 3)
    rewrite_manifest(mpath, encode_manifest(dataclasses.replace(m, version=version, tree=old)))
    assert one.inspect(9)[1].version == version
    assert_same(state, one.restore(step=9))
    target = {k: v for k, v in zeros_like_state(state).items() if k != "meta"}
    target["meta"] = {"ids": None, "pair": None, 7: OrderedDict()}
    assert one.restore(step=9, into=target, strict=False) is target  # meta[7]'s key is added to the empty dict
    assert_same(state, target)
    assert [err for _, _, err in one.verify(9)] == [None]


def test_bad_manifest_on_fast_tier_falls_back(two: Hierarchy, caplog: pytest.LogCaptureFixture) -> None:
    state = small_state(9)
    two.save(state, step=6).wait()
    rewrite_manifest(rank_dir(two, "ssd", 6) / "manifest", b"garbage")
    with caplog.at_level(logging.WARNING, logger="tierckpt"):
        assert_same(state, two.restore())
    assert any("ssd" in r.getMessage() for r in caplog.records if r.levelno >= logging.WARNING)


# -- refused values --------------------------------------------------------------------------------------
def _refused_states() -> dict[str, tuple[Any, str]]:
    base = small_state()

    def with_value(v: Any) -> dict[str, Any]:
        s = dict(base)
        s["optim"] = {"param_groups": [{"lr": 1e-3, "fn": v}], "state": {}}
        return s

    return {
        "lambda": (with_value(lambda x: x), "state['optim']['param_groups'][0]['fn']"),
        "set": (with_value({1, 2, 3}), "state['optim']['param_groups'][0]['fn']"),
        "tuple-keys": (with_value({(0, 1): 2.0}), "state['optim']['param_groups'][0]['fn']"),
        "top-level-set": ({"model": base["model"], "seen": {"a"}}, "state['seen']"),
        "in-tuple": ({"x": (1, 2, Fraction(1, 3))}, "state['x'][2]"),
    }


@pytest.mark.parametrize("kind", list(_refused_states()))
def test_refused_value_names_key_path_and_leaves_nothing(tmp_path: Path, two: Hierarchy, kind: str) -> None:
    two.save(small_state(), step=1).wait()
    before = {t: tier_entries(tmp_path / t) for t in ("ssd", "pfs")}
    state, path = _refused_states()[kind]
    with pytest.raises(StateError) as ei:
        two.save(state, step=2)
    assert str(ei.value).startswith(path + ":"), str(ei.value)
    assert isinstance(ei.value, TypeError) and isinstance(ei.value, TierckptError)
    for t in ("ssd", "pfs"):
        assert tier_entries(tmp_path / t) == before[t]  # no step dir, no scratch dir
        assert not (tmp_path / t / "step-000000000002").exists()
    assert [c.step for c in two.checkpoints()] == [1]


def test_unpicklable_value_with_allow_pickle_names_key_path(tmp_path: Path, two: Hierarchy) -> None:
    state = {"optim": {"param_groups": [{"fn": lambda x: x}]}}
    with pytest.raises(StateError, match=r"^state\['optim'\]\['param_groups'\]\[0\]\['fn'\]: cannot pickle"):
        two.save(state, step=1, allow_pickle=True)
    for t in ("ssd", "pfs"):
        assert tier_entries(tmp_path / t) == []


@pytest.mark.parametrize("kind", ["set", "tuple-keys", "top-level-set", "in-tuple", "function"])
def test_allow_pickle_round_trip(two: Hierarchy, kind: str) -> None:
    if kind == "function":
        state: Any = {"optim": {"param_groups": [{"lr": 0.1, "fn": math.sqrt}]}, "w": torch.ones(3)}
    else:
        state = _refused_states()[kind][0]
    two.save(state, step=5, allow_pickle=True).wait()
    for tier in ("ssd", "pfs"):
        with pytest.raises(StateError, match="allow_pickle"):
            two.restore(5, tier=tier)
    with pytest.raises(StateError):
        two.restore()
    for tier in ("ssd", "pfs"):
        assert_same(state, two.restore(5, tier=tier, allow_pickle=True))


def test_plain_values_need_no_pickle(two: Hierarchy) -> None:
    state = {
        "od": OrderedDict([("b", 1), ("a", torch.zeros(2))]),
        "t": (1, "x", None, b"\0"),
        "big": 1 << 80,
        "dtype": torch.bfloat16,
        "size": torch.Size([2, 3]),
        "ints": {1: 2, -3: [4.5, True]},
    }
    two.save(state, step=1).wait()
    assert_same(state, two.restore())


# -- a tier directory removed between saves ---------------------------------------------------------------
@pytest.mark.parametrize("gone", ["pfs", "ssd"])
def test_removed_tier_directory(tmp_path: Path, two: Hierarchy, gone: str) -> None:
    """The contract (tiers/_files.py): a vanished tier directory is *not* recreated (it may be an unmounted
    file system); that tier's save fails with TierIOError(ENOENT), the other tier commits, and everything
    the other tier holds stays restorable. Once the directory is back, saves reach both tiers again."""
    other = "ssd" if gone == "pfs" else "pfs"
    s1, s2, s3 = small_state(1), small_state(2), small_state(3)
    two.save(s1, step=1).wait()
    shutil.rmtree(tmp_path / gone)

    handle = two.save(s2, step=2)
    with pytest.raises(TierIOError) as ei:
        handle.wait()
    assert ei.value.errno == errno.ENOENT and gone in str(ei.value)
    assert handle.durable[other].result() is None
    assert set(handle.errors()) == {gone}
    assert not (tmp_path / gone).exists()  # not recreated behind the user's back
    assert [(c.step, c.tiers) for c in two.checkpoints()] == [(1, (other,)), (2, (other,))]
    assert_same(s1, two.restore(1))
    assert_same(s2, two.restore())
    assert [e for _, _, e in two.verify()] == [None, None]

    (tmp_path / gone).mkdir()
    two.save(s3, step=3).wait()
    assert two.checkpoints()[-1].tiers == ("ssd", "pfs")
    assert_same(s3, two.restore(3, tier=gone))
    assert_same(s1, two.restore(1))


def test_removed_tier_directory_unobserved_failure_surfaces_on_close(tmp_path: Path) -> None:
    h = Hierarchy.from_config(config(tmp_path))
    h.save({"w": torch.ones(4)}, step=1)
    shutil.rmtree(tmp_path / "pfs")
    h.save({"w": torch.zeros(4)}, step=2)  # handle dropped without wait()
    with pytest.raises(TierIOError):
        h.close()


def test_the_users_own_exception_is_not_replaced_by_a_failure_of_the_close(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    with pytest.raises(ValueError, match="the user's own") as e, Hierarchy.from_config(config(tmp_path)) as h:
        h.save({"w": torch.ones(4)}, step=1).wait()
        shutil.rmtree(tmp_path / "pfs")
        h.save({"w": torch.zeros(4)}, step=2)  # its pfs copy fails in the background; nobody waits
        raise ValueError("the user's own")
    assert "TierIOError" in caplog.text and "ValueError" in caplog.text  # the close's failure is logged
    if sys.version_info >= (3, 11):
        assert any("TierIOError" in note for note in e.value.__notes__)
    with pytest.raises(RuntimeError, match="closed"):  # closed all the same: tiers and engines released
        h.restore()
    with pytest.raises(TierIOError), Hierarchy.from_config(config(tmp_path)) as h:  # no exception: raised
        h.save({"w": torch.ones(4)}, step=3)
        shutil.rmtree(tmp_path / "pfs")
        h.save({"w": torch.zeros(4)}, step=4)


# -- replacing a step --------------------------------------------------------------------------------------
def test_saving_a_step_twice_replaces_it(tmp_path: Path, two: Hierarchy) -> None:
    first = {f"w{i}": torch.arange(150_000, dtype=torch.float32) + i for i in range(3)}  # 3 x 600 KiB: 3 blobs
    first["tag"] = "first"
    second = {"w": torch.full((1000,), 7.0), "v": torch.ones(3, dtype=torch.int8), "tag": "second"}
    two.save(first, step=10).wait()
    blobs_first = sorted(os.listdir(rank_dir(two, "ssd", 10)))
    two.save(second, step=10).wait()
    assert [(c.step, c.tiers) for c in two.checkpoints()] == [(10, ("ssd", "pfs"))]
    for tier in ("ssd", "pfs"):
        assert_same(second, two.restore(10, tier=tier))
        step_dir = rank_dir(two, tier, 10).parent
        assert sorted(os.listdir(step_dir)) == ["commit", "rank-00000"]  # no scratch copy of the old one left
        _, m = two.inspect(10)
        files = ["data.bin"] if tier == "pfs" else [b.name for b in m.blobs]  # pfs: one data file a copy
        assert sorted(os.listdir(rank_dir(two, tier, 10))) == sorted(["manifest", *files])
    assert len(blobs_first) > len(os.listdir(rank_dir(two, "ssd", 10)))  # the old extra blobs are gone
    assert_same(second, two.restore())
    assert [e for _, _, e in two.verify()] == [None, None]

    # and back again, through a fresh hierarchy
    two.save(first, step=10).wait()
    h = Hierarchy.from_config(config(tmp_path))
    try:
        assert_same(first, h.restore())
    finally:
        h.close()


def test_restore_of_unknown_step(two: Hierarchy) -> None:
    with pytest.raises(CheckpointNotFoundError):
        two.restore()
    two.save({"w": torch.ones(2)}, step=1).wait()
    with pytest.raises(CheckpointNotFoundError):
        two.restore(2)
