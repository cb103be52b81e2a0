"""Golden fixtures: checkpoints written by the writer of every format version the reader accepts.

``tests/golden/vN`` holds a local tier written by the last commit that wrote format version N
(tests/golden/README.md); ``tests/golden/fixture_states.py`` rebuilds the states they hold. Each version's
fixture is copied to ``tmp_path`` (the repository is never written) and read with the current code:
restore, restore(into=), verify, inspect, and damage caught. The current version's fixture must also be
exactly what the current writer produces, so an encoding change cannot slip in without a version bump.
"""

from __future__ import annotations

import json
import math
import shutil
import sys
from collections import OrderedDict
from pathlib import Path
from typing import Any

import msgpack
import pytest
import torch

from tierckpt import CorruptCheckpointError, Hierarchy
from tierckpt.cli import main as cli_main
from tierckpt.format.frames import envelope_inner
from tierckpt.format.manifest import (
    ENVELOPE_VERSION,
    FORMAT_VERSION,
    HEADER,
    READ_VERSIONS,
    TRAILER_BYTES,
    decode_head,
    decode_manifest,
)

GOLDEN = Path(__file__).resolve().parents[1] / "golden"
sys.path.insert(0, str(GOLDEN))
import make_fixture  # noqa: E402  (tests/golden is not a package)
from fixture_states import GOLDEN_STEPS, RAW_DTYPES, golden_states  # noqa: E402

RAW_STEP = 2  # the step that holds RAW_DTYPES
#: the fixtures: one per manifest version, and a copy stored compressed (version 6, an envelope)
FIXTURES = (*READ_VERSIONS, ENVELOPE_VERSION)
versions = pytest.mark.parametrize("version", FIXTURES, ids=lambda v: f"v{v}")


def _tier(tmp_path: Path, version: int) -> Path:
    """A copy of the fixture of ``version`` (the tests never write into the repository)."""
    src = GOLDEN / f"v{version}"
    assert src.is_dir(), f"no golden fixture for format version {version}: {src} (tests/golden/README.md)"
    return Path(shutil.copytree(src, tmp_path / f"v{version}"))


def _open(tier: Path) -> Hierarchy:
    return Hierarchy.from_config({"tiers": [{"name": "ssd", "kind": "local", "path": str(tier)}]}, readonly=True)


def _skip_missing_dtypes(step: int) -> None:
    missing = [n for n in RAW_DTYPES if not isinstance(getattr(torch, n, None), torch.dtype)]
    if step == RAW_STEP and missing:
        pytest.skip(f"this torch lacks dtypes the fixture holds: {', '.join(missing)}")


def _bytes(t: torch.Tensor) -> bytes:
    """A tensor's elements as row-major bytes (works for dtypes torch cannot compute with)."""
    t = t.resolve_conj().resolve_neg().contiguous().reshape(-1)
    return t.view(torch.uint8).numpy().tobytes()


def assert_same(got: Any, want: Any, path: str = "state") -> None:
    """``got`` is ``want``: exact types (containers included), keys in order, tensor dtypes, shapes and
    bytes, float bits (NaN and -0.0 included)."""
    assert type(got) is type(want), f"{path}: got {type(got).__name__}, want {type(want).__name__}"
    if isinstance(want, torch.Tensor):
        assert (got.dtype, got.shape) == (want.dtype, want.shape), f"{path}: {got.dtype} {tuple(got.shape)}"
        assert _bytes(got) == _bytes(want), f"{path}: values differ: {got} != {want}"
    elif isinstance(want, dict):
        assert list(got) == list(want), f"{path}: keys {list(got)} != {list(want)}"
        for k, v in want.items():
            assert_same(got[k], v, f"{path}[{k!r}]")
    elif isinstance(want, (list, tuple)):
        assert len(got) == len(want), f"{path}: length {len(got)} != {len(want)}"
        for i, (g, w) in enumerate(zip(got, want)):
            assert_same(g, w, f"{path}[{i}]")
    elif isinstance(want, float):
        assert math.isnan(got) if math.isnan(want) else (got, math.copysign(1, got)) == (want, math.copysign(1, want))
    else:
        assert got == want, f"{path}: {got!r} != {want!r}"


def _target(want: Any) -> Any:
    """A restore(into=) target shaped like ``want``: new tensors full of 0xA5 bytes, plain values None."""
    if isinstance(want, torch.Tensor):
        raw = torch.full((want.numel() * want.dtype.itemsize,), 0xA5, dtype=torch.uint8)
        return raw.view(want.dtype).reshape(want.shape)  # (torch.empty warns for some dtypes)
    if type(want) in (dict, OrderedDict):
        return type(want)((k, _target(v)) for k, v in want.items())
    if type(want) in (list, tuple):
        return type(want)(_target(v) for v in want)
    return None  # torch.Size, torch.dtype and other plain values are assigned


def _tensors(state: Any) -> list[torch.Tensor]:
    """The tensors restore(into=) fills in place: all but those inside tuples (a tuple is assigned whole,
    docs/restore.md)."""
    if isinstance(state, torch.Tensor):
        return [state]
    items = state.values() if isinstance(state, dict) else state if type(state) is list else ()
    return [t for v in items for t in _tensors(v)]


def _manifest_bytes(tier: Path, step: int) -> bytes:
    return (tier / f"step-{step:012d}" / "rank-00000" / "manifest").read_bytes()


def test_every_readable_version_has_a_fixture_and_no_other() -> None:
    held = sorted(int(p.name[1:]) for p in GOLDEN.glob("v*") if p.is_dir())
    assert held == list(FIXTURES), (
        f"tests/golden holds fixtures of versions {held}, the reader accepts {list(FIXTURES)}: every "
        "readable version needs a fixture (tests/golden/README.md)"
    )


@versions
def test_fixture_is_what_it_claims(version: int) -> None:
    """Every step is there, written in its directory's version; one tree is zstd, one step has 3 blobs."""
    tier = GOLDEN / f"v{version}"
    steps = sorted(int(p.name[5:]) for p in tier.glob("step-*"))
    assert steps == sorted(GOLDEN_STEPS) == sorted(golden_states())
    for step in steps:
        data = _manifest_bytes(tier, step)
        assert int.from_bytes(data[8:10], "little") == version
        if version == ENVELOPE_VERSION:  # a compressed copy: every blob's frames compressed, the inner a v5 file
            frames = decode_head(data).frames
            assert frames is not None and frames.compressed_frames() == frames.total
            data = bytes(envelope_inner(data))
            assert int.from_bytes(data[8:10], "little") == FORMAT_VERSION
        payload = msgpack.unpackb(data[HEADER.size : -TRAILER_BYTES], raw=False, strict_map_key=False)
        assert (payload["tree_codec"] == "zstd") == (step == 3), f"step {step}: tree codec {payload['tree_codec']}"
        assert len(payload["blobs"]) == (3 if step == 3 else 1)
        assert payload["has_pickle"] is golden_states()[step].allow_pickle


@versions
@pytest.mark.parametrize("step", sorted(GOLDEN_STEPS), ids=lambda s: f"step{s}")
def test_restore_returns_the_saved_state(tmp_path: Path, version: int, step: int) -> None:
    _skip_missing_dtypes(step)
    golden = golden_states()[step]
    with _open(_tier(tmp_path, version)) as h:
        got = h.restore(step, allow_pickle=golden.allow_pickle)
        assert h.last_restore == (step, "ssd")
    assert_same(got, golden.state)
    if step == 1:  # one tensor saved once, referenced twice: one tensor again
        assert got["model"]["w"] is got["model"]["tied"]
        assert got["row_of_w"].data_ptr() != got["model"]["w"][1].data_ptr()  # a row of its own
    if step == 3:
        assert got["refs"][0] is got["refs"][1] is got["refs"][2]


@versions
@pytest.mark.parametrize(
    "step", sorted(s for s, g in golden_states().items() if not g.allow_pickle), ids=lambda s: f"step{s}"
)
def test_restore_into_fills_a_matching_target(tmp_path: Path, version: int, step: int) -> None:
    """(restore(into=) refuses a checkpoint with pickled values by design: step 4 is left out.)"""
    _skip_missing_dtypes(step)
    want = golden_states()[step].state
    target = _target(want)
    before = _tensors(target)
    with _open(_tier(tmp_path, version)) as h:
        got = h.restore(step, into=target)
    assert got is target
    assert all(a is b for a, b in zip(_tensors(target), before)), "tensors were replaced, not filled"
    assert_same(target, want)


@versions
def test_verify_finds_every_copy_good(tmp_path: Path, version: int) -> None:
    if any(not isinstance(getattr(torch, n, None), torch.dtype) for n in RAW_DTYPES):
        pytest.skip("this torch lacks dtypes the fixture holds")
    with _open(_tier(tmp_path, version)) as h:
        assert h.verify() == [(s, "ssd", None) for s in sorted(GOLDEN_STEPS)]


@versions
def test_inspect_reports_the_format_version(tmp_path: Path, version: int, capsys: pytest.CaptureFixture[str]) -> None:
    tier = _tier(tmp_path, version)
    saved = FORMAT_VERSION if version == ENVELOPE_VERSION else version  # a compressed copy: its manifest's
    with _open(tier) as h:
        name, m = h.inspect(1)
    assert (name, m.version, m.step) == ("ssd", saved, 1)
    assert (m.frames is not None) == (version == ENVELOPE_VERSION)
    config = tmp_path / "tiers.yaml"
    config.write_text(json.dumps({"tiers": [{"name": "ssd", "kind": "local", "path": str(tier)}]}))
    capsys.readouterr()
    assert cli_main(["inspect", str(config), "--step", "1", "--json"]) == 0
    info = json.loads(capsys.readouterr().out)
    assert (info["format_version"], info["step"]) == (saved, 1)
    if version == ENVELOPE_VERSION:
        (stored,) = info["stored"].values() if isinstance(info["stored"], dict) else info["stored"]
        assert "zstd" in json.dumps(stored)
    assert cli_main(["inspect", str(config), "--step", "1"]) == 0
    assert f"format v{saved}" in capsys.readouterr().out


def _flip(path: Path, offset: int) -> None:
    data = bytearray(path.read_bytes())
    data[offset] ^= 0x10
    path.write_bytes(bytes(data))


@versions
@pytest.mark.parametrize("where", ["tensor byte", "padding byte", "manifest payload"])
def test_a_flipped_byte_is_caught(tmp_path: Path, version: int, where: str) -> None:
    tier = _tier(tmp_path, version)
    rank = tier / "step-000000000001" / "rank-00000"
    m = decode_manifest((rank / "manifest").read_bytes())
    if version == ENVELOPE_VERSION and where != "manifest payload":  # raw offsets do not apply: stored bytes
        assert m.frames is not None
        held = m.frames.held[0]
        _flip(rank / "blob-00000.bin", held // 2 if where == "tensor byte" else held - 1)
    elif where == "tensor byte":
        w = next(t for t in m.tensors if t.path == "state['model']['w']")
        _flip(rank / "blob-00000.bin", w.offset + w.length // 2)
    elif where == "padding byte":
        assert max(t.offset + t.length for t in m.tensors if t.blob == 0) < m.blobs[0].size
        _flip(rank / "blob-00000.bin", m.blobs[0].size - 1)
    else:
        _flip(rank / "manifest", HEADER.size + (len(_manifest_bytes(tier, 1)) - HEADER.size - TRAILER_BYTES) // 2)
    with _open(tier) as h:
        with pytest.raises(CorruptCheckpointError):
            h.restore(1)
        with pytest.raises(CorruptCheckpointError):
            h.restore(1, into=_target(golden_states()[1].state))
        (result,) = h.verify(1)
        assert isinstance(result[2], CorruptCheckpointError), result
        assert h.restore(3)["w"].shape == (8,)  # the other steps are untouched


def test_the_current_writer_writes_the_current_fixture_byte_for_byte(tmp_path: Path) -> None:
    """The writer is deterministic (no time, host or random bytes in a manifest or blob); the same states
    must still give the same bytes. Left out: the manifest of a step with pickled values, which holds a
    pickled tensor, and pickle names a tensor's storage by its memory address."""
    fixture = GOLDEN / f"v{FORMAT_VERSION}"
    assert fixture.is_dir(), (
        f"no golden fixture for the current format version {FORMAT_VERSION} (tests/golden/README.md)"
    )
    assert make_fixture.save_states(tmp_path / "tier") == FORMAT_VERSION
    written = make_fixture.copy_committed(tmp_path / "tier", tmp_path / "now")
    names = sorted(str(p.relative_to(tmp_path / "now")) for p in written)
    assert names == sorted(str(p.relative_to(fixture)) for p in fixture.rglob("*") if p.is_file())
    pickled = {
        f"step-{s:012d}/{name}"
        for s, g in golden_states().items()
        if g.allow_pickle
        for name in ("rank-00000/manifest", "commit")  # the record names the manifest by its checksum
    }
    changed = [
        n for n in names if n not in pickled and (tmp_path / "now" / n).read_bytes() != (fixture / n).read_bytes()
    ]
    assert not changed, (
        f"the v{FORMAT_VERSION} encoding changed ({', '.join(changed)} differ from tests/golden/v{FORMAT_VERSION}): "
        f"bump FORMAT_VERSION, keep reading v{FORMAT_VERSION}, and add a golden fixture for the new version "
        "(tests/golden/README.md)"
    )


def test_fixture_states_are_deterministic() -> None:
    """The expected values are rebuilt on every run: two builds must agree (and hold what they say)."""
    a, b = golden_states(), golden_states()
    for step in a:
        assert_same(a[step].state, b[step].state)
    assert isinstance(a[1].state["model"], OrderedDict)
    assert not a[1].state["strided"].is_contiguous() and a[1].state["conj"].is_conj()


def test_a_compressed_copy_holds_the_plain_manifest_and_commit_record(tmp_path: Path) -> None:
    """Written again with ``compress: zstd``, every copy's inner manifest and every commit record are the
    plain (version-5) fixture's bytes, and the frames decode to its blobs. (The compressed streams
    themselves are not compared byte for byte: they are the zstd library's, which may change.)"""
    assert make_fixture.save_states(tmp_path / "tier", "zstd") == ENVELOPE_VERSION
    now = tmp_path / "tier"
    plain = GOLDEN / f"v{FORMAT_VERSION}"
    for step, g in golden_states().items():
        if g.allow_pickle:
            continue  # a pickled tensor's bytes name a memory address (above)
        d = f"step-{step:012d}"
        data = (now / d / "rank-00000" / "manifest").read_bytes()
        assert decode_head(data).frames is not None
        assert bytes(envelope_inner(data)) == (plain / d / "rank-00000" / "manifest").read_bytes()
        assert (now / d / "commit").read_bytes() == (plain / d / "commit").read_bytes()
    with _open(now) as h:
        for step, g in golden_states().items():
            if step != RAW_STEP:
                assert_same(h.restore(step, allow_pickle=g.allow_pickle), g.state)
