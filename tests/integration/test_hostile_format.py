"""Manifests that are checksum-valid but hostile, or damaged where a checksum once did not look: every
reader (restore, restore(into=), verify, the CLI) refuses them with CorruptCheckpointError, within a
bounded time and memory, without crashing or importing anything; and what ``save`` accepts (nesting up
to its limit) every reader reads back, in the main thread and in a thread with the default stack."""

from __future__ import annotations

import dataclasses
import json
import os
import struct
import subprocess
import sys
import textwrap
from collections import OrderedDict
from collections.abc import Callable
from pathlib import Path
from typing import Any

import msgpack
import pytest
import torch
import xxhash
import zstandard

from tierckpt import CorruptCheckpointError, Hierarchy, UnsupportedFormatError
from tierckpt.format.frames import wrap_manifest
from tierckpt.format.manifest import FORMAT_VERSION, decode_manifest, encode_manifest
from tierckpt.format.tree import MAX_NESTING
from tierckpt.io.engine import make_engine
from tierckpt.testing.compressed import Stored, encode_frames, index_of, read_plain, write_encoded
from tierckpt.testing.tamper import rewrite_manifest
from tierckpt.tiers.base import CheckpointKey
from tierckpt.tiers.host import HostTier
from tierckpt.tiers.local import LocalTier

ROOT = Path(__file__).resolve().parents[2]
MiB = 1 << 20


def local(tmp_path: Path) -> Hierarchy:
    return Hierarchy([LocalTier("ssd", tmp_path / "ssd", make_engine("threads", 2))])


def manifest_path(tmp_path: Path, step: int = 1) -> Path:
    return tmp_path / "ssd" / f"step-{step:012d}" / "rank-00000" / "manifest"


def frame(payload: bytes, version: int) -> bytes:
    """A manifest file around ``payload`` with a valid checksum under the rules of ``version``."""
    head = struct.pack("<8sHHIQ", b"TIERCKPT", version, 0, 0, len(payload)) + payload
    return head + struct.pack("<Q", xxhash.xxh3_64_intdigest(head if version >= 4 else payload))


def payload_of(data: bytes) -> dict[str, Any]:
    (n,) = struct.unpack_from("<Q", data, 16)
    return msgpack.unpackb(data[24 : 24 + n], raw=False)


def with_tree(tmp_path: Path, tree: bytes, codec: str = "none") -> None:
    """Replace step 1's tree (the saved state holds no tensor) in a checksum-valid manifest."""
    mpath = manifest_path(tmp_path)
    p = payload_of(mpath.read_bytes())
    p["tree"], p["tree_codec"] = tree, codec
    rewrite_manifest(mpath, frame(msgpack.packb(p, use_bin_type=True), FORMAT_VERSION))


def readers_refuse(tmp_path: Path, match: str) -> None:
    """restore(), restore(into=) and verify() each raise CorruptCheckpointError matching ``match``."""
    with local(tmp_path) as h:
        with pytest.raises(CorruptCheckpointError, match=match):
            h.restore()
        with pytest.raises(CorruptCheckpointError, match=match):
            h.restore(into={"a": None})
        [(_, _, err)] = h.verify(1)
        assert isinstance(err, CorruptCheckpointError) and err.tier == "ssd", err


def run_child(code: str, timeout: float = 60) -> dict[str, Any]:
    """Run ``code`` in a fresh interpreter; it sets ``out`` (a dict); returns it with the child's peak
    RSS growth over its baseline (after imports) in MiB and its wall time."""
    prog = (
        textwrap.dedent(
            """
        import json, resource, time
        import torch, tierckpt
        base = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
        t0 = time.monotonic()
        out = {}
        """
        )
        + textwrap.dedent(code)
        + textwrap.dedent(
            """
        out["secs"] = time.monotonic() - t0
        out["rss_mib"] = (resource.getrusage(resource.RUSAGE_SELF).ru_maxrss - base) / 1024
        print("RESULT" + json.dumps(out))
        """
        )
    )
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    r = subprocess.run([sys.executable, "-c", prog], capture_output=True, text=True, timeout=timeout, env=env)
    assert r.returncode == 0, f"child died with {r.returncode}: {r.stderr[-3000:]}"
    line = next(x for x in r.stdout.splitlines() if x.startswith("RESULT"))
    return json.loads(line[len("RESULT") :])


# -- the version field and the framing -------------------------------------------------------------------
def test_a_flipped_version_bit_of_a_version_3_file_is_refused(tmp_path: Path) -> None:
    """Version 3 checksummed the payload only: 3 -> 2 made every tensor a small int, verified as good.
    A version-2 tree must reference every row of the table, so the flip is found."""
    with local(tmp_path) as h:
        h.save({"w": torch.arange(6.0), "n": 3}, step=1).wait()
    mpath = manifest_path(tmp_path)
    v3 = encode_manifest(dataclasses.replace(decode_manifest(mpath.read_bytes()), version=3))
    for bit in range(16):
        flipped = bytearray(v3)
        flipped[8 + bit // 8] ^= 1 << bit % 8
        rewrite_manifest(mpath, flipped)
        readers_refuse(tmp_path, "manifest|tree")
    rewrite_manifest(mpath, v3)
    with local(tmp_path) as h:
        assert torch.equal(h.restore()["w"], torch.arange(6.0)) and h.verify(1) == [(1, "ssd", None)]


def test_a_newer_intact_version_is_named_not_called_corrupt(tmp_path: Path) -> None:
    tiers = [LocalTier("ssd", tmp_path / "ssd", make_engine("threads", 2)), HostTier("host", 64 * MiB)]
    with Hierarchy(tiers) as h:
        h.save({"w": torch.arange(6.0)}, step=1).wait()
        mpath = manifest_path(tmp_path)
        rewrite_manifest(mpath, frame(mpath.read_bytes()[24:-8], 7))  # intact, as a newer writer would frame it
        with pytest.raises(UnsupportedFormatError, match=r"format version 7 by a newer tierckpt.*1, 2, 3, 4, 5, 6"):
            h.restore(tier="ssd")
        assert torch.equal(h.restore()["w"], torch.arange(6.0)) and h.last_restore == (1, "host")
        errs = {tier: err for _, tier, err in h.verify(1)}
        assert isinstance(errs["ssd"], UnsupportedFormatError) and not isinstance(errs["ssd"], CorruptCheckpointError)
        assert errs["host"] is None
        damaged = bytearray(mpath.read_bytes())
        damaged[40] ^= 4  # the same newer file with one payload bit flipped: damage, not a newer format
        rewrite_manifest(mpath, damaged)
        with pytest.raises(CorruptCheckpointError, match="version 7 is unknown .* checksum does not match"):
            h.restore(tier="ssd")


# -- the tree --------------------------------------------------------------------------------------------
@pytest.fixture
def plain(tmp_path: Path) -> Path:
    """A saved step 1 with no tensor (so any tree goes with its empty table)."""
    with local(tmp_path) as h:
        h.save({"a": 1}, step=1).wait()
    return tmp_path


def test_a_msgpack_timestamp_is_refused(plain: Path) -> None:
    for tree in ({"a": msgpack.Timestamp(1, 0)}, msgpack.Timestamp(5, 7)):
        with_tree(plain, msgpack.packb(tree))
        readers_refuse(plain, "timestamp")
    inner = msgpack.ExtType(1, msgpack.packb([msgpack.Timestamp(1, 0)]))  # inside a tuple
    with_tree(plain, msgpack.packb({"a": inner}))
    readers_refuse(plain, "timestamp")


def test_a_tree_nested_500_deep_names_the_limit(plain: Path) -> None:
    with_tree(plain, b"\x81\xa1a" + b"\x91" * 499 + b"\x90")  # {"a": [[[...]]]}
    readers_refuse(plain, f"nested deeper than {MAX_NESTING} containers")
    tuples = msgpack.packb(msgpack.ExtType(1, b"\x90"))
    for _ in range(MAX_NESTING):  # each a tuple holding the next
        tuples = msgpack.packb(msgpack.ExtType(1, b"\x91" + tuples))
    with_tree(plain, b"\x81\xa1a" + tuples)
    readers_refuse(plain, f"nested deeper than {MAX_NESTING} containers")


@pytest.mark.parametrize("name", [b"_inductor", b"float32 ", b"Tensor", b"qint8x", b""])
def test_a_dtype_name_is_looked_up_in_a_fixed_table(plain: Path, name: bytes) -> None:
    with_tree(plain, msgpack.packb({"a": msgpack.ExtType(6, name)}))
    readers_refuse(plain, "unknown dtype")


def test_a_dtype_name_imports_nothing(plain: Path) -> None:
    with_tree(plain, msgpack.packb({"a": msgpack.ExtType(6, b"_inductor")}))
    out = run_child(
        f"""
        import sys
        from tierckpt import Hierarchy, CorruptCheckpointError
        from tierckpt.tiers.local import LocalTier
        from tierckpt.io.engine import make_engine
        h = Hierarchy([LocalTier("ssd", {str(plain / "ssd")!r}, make_engine("threads", 2))])
        try:
            h.restore()
        except CorruptCheckpointError as e:
            out["error"] = str(e)
        out["inductor"] = "torch._inductor" in sys.modules
        """
    )
    assert "unknown dtype" in out["error"] and out["inductor"] is False


def _bomb(n_nones: int, declare: int | None = None) -> bytes:
    """A zstd frame of a msgpack array of ``n_nones`` Nones (built in chunks, never whole), its declared
    content size patched to ``declare`` where given."""
    size = 5 + n_nones
    c = zstandard.ZstdCompressor(level=3, write_content_size=True, write_checksum=False).compressobj(size=size)
    parts = [c.compress(b"\xdd" + struct.pack(">I", n_nones))]
    chunk = b"\xc0" * (16 * MiB)
    left = n_nones
    while left:
        parts.append(c.compress(chunk[: min(left, len(chunk))]))
        left -= min(left, len(chunk))
    parts.append(c.flush())
    frame_ = b"".join(parts)
    if declare is not None:  # the frame header: magic, descriptor, window byte, then a 4-byte content size
        assert frame_[4] >> 6 == 2 and not frame_[4] & 0x20
        frame_ = frame_[:6] + struct.pack("<I", declare) + frame_[10:]
    return frame_


@pytest.mark.parametrize(("nones", "declare"), [(1 << 28, None), (1 << 24, (1 << 32) - 1)])
def test_a_zstd_bomb_is_refused_before_it_expands(plain: Path, nones: int, declare: int | None) -> None:
    """An 8 KiB frame of 2**28 Nones (it took 45 s and 4.3 GiB, then verified as good), and a small frame
    declaring 4 GiB (the reader allocated it): refused from the declared size, in bounded time and memory."""
    bomb = _bomb(nones, declare)
    assert len(bomb) < 64 << 10
    with_tree(plain, bomb, "zstd")
    out = run_child(
        f"""
        from tierckpt import Hierarchy, CorruptCheckpointError
        from tierckpt.tiers.local import LocalTier
        from tierckpt.io.engine import make_engine
        h = Hierarchy([LocalTier("ssd", {str(plain / "ssd")!r}, make_engine("threads", 2))], readonly=True)
        out["errors"] = []
        for into in (None, {{"a": None}}):
            try:
                h.restore(into=into)
            except CorruptCheckpointError as e:
                out["errors"].append(str(e))
        out["errors"] += [str(err) for _, _, err in h.verify(1)]
        """
    )
    assert len(out["errors"]) == 3 and all("declares" in e and "most a reader accepts" in e for e in out["errors"])
    assert out["secs"] < 10 and out["rss_mib"] < 64, out


# -- nesting up to the save limit ------------------------------------------------------------------------
def deep_state(kind: str, depth: int) -> dict[str, Any]:
    v: Any = torch.arange(3.0)
    for _ in range(depth - 1):
        v = (v, 1) if kind == "tuple" else OrderedDict(a=v) if kind == "odict" else [v]
    return {"x": v}


@pytest.mark.parametrize("kind", ["tuple", "odict", "list"])
def test_what_save_accepts_every_reader_reads_at_the_nesting_limit(tmp_path: Path, kind: str) -> None:
    """A state nested as deep as save allows (MAX_NESTING containers, the root dict included) restores,
    restores in place and verifies, in the main thread and in a thread with the default stack size, and
    ``tierckpt verify`` passes (each in a child process: a C stack overflow would kill it)."""
    (tmp_path / "c.yml").write_text(f"tiers:\n  - {{name: ssd, kind: local, path: {tmp_path / 'ssd'}}}\n")
    out = run_child(
        f"""
        import threading
        from tierckpt import Hierarchy, load_config
        from tierckpt.cli import main
        import sys
        sys.path.insert(0, {str(Path(__file__).parent)!r})
        from test_hostile_format import deep_state
        from tierckpt.format.tree import MAX_NESTING

        state = deep_state({kind!r}, MAX_NESTING)
        h = Hierarchy.from_config(load_config({str(tmp_path / "c.yml")!r}))
        h.save(state, step=1).wait()

        def readers(where):
            got = h.restore()
            v, w = got["x"], state["x"]
            for _ in range(MAX_NESTING - 1):
                assert type(v) is type(w)
                v, w = (v[0], w[0]) if {kind!r} != "odict" else (v["a"], w["a"])
            assert torch.equal(v, w)
            assert h.restore(into={{"x": None}})["x"] is not None
            assert h.verify(1) == [(1, "ssd", None)]
            out[where] = True

        readers("main")
        t = threading.Thread(target=readers, args=("thread",))
        t.start()
        t.join()
        out["cli"] = main(["verify", {str(tmp_path / "c.yml")!r}])
        h.close()
        """,
        timeout=120,
    )
    assert out["main"] and out["thread"] and out["cli"] == 0


def test_deeper_than_save_allows_is_refused_by_save(tmp_path: Path) -> None:
    from tierckpt import StateError

    with local(tmp_path) as h, pytest.raises(StateError, match="nested too deep"):
        h.save(deep_state("tuple", MAX_NESTING + 1), step=1)


# -- compressed copies: what their frame index says, and their stored streams -------------------------------------
FRAME = 64 << 10


def hostile_copy(tmp_path: Path, edit: Callable[[list[list[Stored]]], None] | None) -> None:
    """Step 1 of :func:`frames_state` saved on the local tier, then stored again compressed (one zstd frame a
    frame, the second in two byte planes), as a writer would (``edit`` None), or ``edit``-ed and its frame
    index made by hand to say what the edited streams are (no rule of the format checked)."""
    with local(tmp_path) as h:
        h.save(frames_state(), step=1).wait()
        tier = h.tier("ssd")
        manifest, blobs = read_plain(tier, CheckpointKey(1))
        frames = encode_frames(blobs, FRAME, lambda b, k: (2, 0b11) if k == 1 else (1, 1))
        if edit is None:
            index, streams = index_of(frames, [b.numel() for b in blobs], FRAME)
            write_encoded(tier, CheckpointKey(1), manifest, streams, wrap_manifest(manifest, index))
            return
        edit(frames)
        streams = [b"".join(x for f in blob for x in f.streams) for blob in frames]
        write_encoded(tier, CheckpointKey(1), manifest, streams, envelope(manifest, frames))


def envelope(manifest: bytes, frames: list[list[Stored]]) -> bytes:
    """The version-6 file a writer would make of ``frames``, by hand: whatever they say, no rule checked."""
    every = [f for blob in frames for f in blob]
    codec = {
        "name": "zstd",
        "frame_bytes": FRAME,
        "held": b"".join(struct.pack("<Q", sum(len(x) for f in blob for x in f.streams)) for blob in frames),
        "width": bytes(f.width for f in every),
        "planes": bytes(f.planes for f in every),
        "lengths": b"".join(struct.pack("<I", len(x)) for f in every if f.width for x in f.streams),
    }
    return frame(msgpack.packb({"manifest": manifest, "codec": codec}, use_bin_type=True), 6)


def frames_state() -> dict[str, Any]:
    return {"w": torch.arange(60_000, dtype=torch.float32), "b": torch.ones(3000, dtype=torch.bfloat16)}


def compressed_readers_refuse(tmp_path: Path, match: str) -> list[str]:
    """restore(), restore(into=) and verify() of the compressed copy each raise CorruptCheckpointError
    matching ``match``; their messages."""
    errors = []
    with local(tmp_path) as h:
        for into in (None, {k: torch.zeros_like(v) for k, v in frames_state().items()}):
            with pytest.raises(CorruptCheckpointError, match=match) as e:
                h.restore(into=into)
            errors.append(str(e.value))
        [(_, _, err)] = h.verify(1)
        assert isinstance(err, CorruptCheckpointError) and err.tier == "ssd", err
        errors.append(str(err))
    return errors


def test_a_sound_compressed_copy_reads(tmp_path: Path) -> None:
    hostile_copy(tmp_path, None)
    with local(tmp_path) as h:
        got = h.restore()
        assert all(torch.equal(got[k], v) for k, v in frames_state().items()) and h.verify(1) == [(1, "ssd", None)]


def _rle_bomb(declared: int, blocks: int = 1) -> bytes:
    """A zstd frame declaring ``declared`` bytes: ``blocks`` RLE blocks of 128 KiB each (4 bytes a block)."""
    block = ((128 << 10) << 3) | (1 << 1)  # RLE, 128 KiB
    body = b"".join(((block | (i == blocks - 1)).to_bytes(3, "little") + b"\x07") for i in range(blocks))
    return b"\x28\xb5\x2f\xfd" + bytes([0b1110_0000]) + struct.pack("<Q", declared) + body


@pytest.mark.parametrize(("declared", "blocks"), [(1 << 40, 1), (4000 << 17, 4000)], ids=["1TiB", "500MiB-real"])
def test_a_bomb_in_a_stored_stream_is_refused_before_it_expands(tmp_path: Path, declared: int, blocks: int) -> None:
    """A frame's zstd stream declaring 1 TiB, and one of 16 KB that really expands to 500 MiB: the index is
    sound (the stream is shorter than its frame); the readers refuse it from its declared size, in bounded
    time and memory."""

    def bomb(frames: list[list[Stored]]) -> None:
        frames[0][0] = Stored(1, 1, [_rle_bomb(declared, blocks)])

    hostile_copy(tmp_path, bomb)
    out = run_child(
        f"""
        import torch
        from tierckpt import Hierarchy, CorruptCheckpointError
        from tierckpt.tiers.local import LocalTier
        from tierckpt.io.engine import make_engine
        h = Hierarchy([LocalTier("ssd", {str(tmp_path / "ssd")!r}, make_engine("threads", 2))], readonly=True)
        out["errors"] = []
        for into in (None, {{"w": torch.zeros(60_000), "b": torch.zeros(3000, dtype=torch.bfloat16)}}):
            try:
                h.restore(into=into)
            except CorruptCheckpointError as e:
                out["errors"].append(str(e))
        out["errors"] += [str(err) for _, _, err in h.verify(1)]
        """
    )
    assert len(out["errors"]) == 3, out
    assert all(f"declares {declared} bytes" in e and "frame 0 of" in e and "blob=" in e for e in out["errors"]), out
    assert out["secs"] < 10 and out["rss_mib"] < 64, out


def test_a_stream_with_bytes_after_its_frame_is_refused(tmp_path: Path) -> None:
    def tail(frames: list[list[Stored]]) -> None:
        f = frames[0][0]
        f.streams = [f.streams[0] + b"\0" * 8]

    hostile_copy(tmp_path, tail)
    for e in compressed_readers_refuse(tmp_path, "frame 0 of"):
        assert "tier=ssd" in e and "blob=" in e


def test_two_planes_swapped_are_a_checksum_mismatch(tmp_path: Path) -> None:
    """Every stream sound and of the size its index says, in the wrong order: the bytes decode, wrong; the
    checksums over the raw bytes find them."""

    def swap(frames: list[list[Stored]]) -> None:
        f = frames[0][1]
        assert f.width == 2 and f.planes == 0b11, f.width
        f.streams.reverse()

    hostile_copy(tmp_path, swap)
    compressed_readers_refuse(tmp_path, "checksum mismatch")


@pytest.mark.parametrize("lie", ["zstd-too-long", "zstd-as-raw", "lengths", "held"])
def test_an_index_that_breaks_the_rules_is_refused_before_a_blob_is_read(tmp_path: Path, lie: str) -> None:
    def edit(frames: list[list[Stored]]) -> None:
        f = frames[0][1]
        assert f.width == 2 and f.planes == 0b11
        if lie == "zstd-too-long":  # a zstd stream as long as the plane it stands for
            f.streams[1] = bytes(FRAME // 2)
        elif lie == "zstd-as-raw":  # plane 1, a zstd stream, said to be raw: not the plane's length
            f.planes = 0b01
        elif lie == "lengths":  # a width that calls for more lengths than there are
            f.width, f.planes = 4, 0b1111
        else:  # a frame stored raw (width 0) whose stored bytes are a zstd stream: held is not its sum
            f.width, f.planes = 0, 0

    hostile_copy(tmp_path, edit)
    for e in compressed_readers_refuse(tmp_path, "codec"):
        assert "tier=ssd" in e
