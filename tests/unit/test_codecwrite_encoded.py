"""Frames handed to the codec writer already encoded (CodecWriter.write_encoded, what a recoding copy does):
stored byte for byte beside the frames it encodes itself, neither planned nor measured, their memory
read until their future resolves; frames that do not fit, or come twice, refused."""

from __future__ import annotations

import pytest
import torch
from test_codecwrite import ALIGN, F, Recorder, _decoded, _floats, _manifest, _noise, _writer  # tests/unit/

from tierckpt.format.codec import Encoded, encode_frame
from tierckpt.format.frames import unwrap_manifest
from tierckpt.format.manifest import encode_manifest
from tierckpt.io.buffers import ptr_mv
from tierckpt.policies.compressconfig import CompressConfig
from tierckpt.policies.compression import Adaptive


def _encoded(blob: torch.Tensor, k: int, width: int) -> Encoded:
    """Frame ``k`` of ``blob`` encoded (all planes tried), its streams copied into memory of their own."""
    raw = ptr_mv(blob.data_ptr() + k * F, F, writable=False)
    enc = encode_frame(raw, width, (1 << width) - 1, 1)
    assert enc.width, "the test's frame must compress"
    return enc


def test_frames_handed_encoded_are_stored_as_they_are_beside_frames_it_encodes() -> None:
    m = _manifest([("s['w']", "bfloat16", 6 * F), ("s['rng']", "uint8", 2 * F)])
    blobs = [_floats(m.blobs[0].size, 1), _noise(m.blobs[1].size, 2)]
    inner = Recorder([b.numel() for b in blobs])
    adaptive = Adaptive(CompressConfig("zstd"), 2)
    w = _writer(inner, m, adaptive=adaptive)
    handed = {k: _encoded(blobs[0], k, 2) for k in (0, 2, 3, 5)}
    futs = []
    for k in range(6):
        if k in handed:
            futs.append(w.write_encoded(0, k, handed[k]))
        else:
            futs.append(w.write(0, k * F, blobs[0].data_ptr() + k * F, F))
    futs.append(w.write(1, 0, blobs[1].data_ptr(), 2 * F))
    for f in futs:
        assert f.result() > 0
    wanted = {k: b"".join(bytes(s) for s in e.streams) for k, e in handed.items()}
    w.commit(encode_manifest(m))
    assert inner.manifest is not None
    _, index = unwrap_manifest(inner.manifest)
    assert index is not None
    for k, e in handed.items():
        fr = index.frame(0, k)
        assert (fr.width, fr.planes, fr.lengths) == (e.width, e.planes, e.lengths)
        assert bytes(inner.data[0][fr.stored_offset : fr.stored_offset + fr.stored_len]) == wanted[k]
    assert index.frame(0, 1).width and index.frame(0, 4).width  # encoded by the writer
    assert not index.frame(1, 0).width and not index.frame(1, 1).width  # noise stays raw
    assert _decoded(inner.manifest, inner.data) == [bytes(b.numpy()) for b in blobs]
    planned = {name: v["frames"] for name, v in adaptive.snapshot()["kinds"].items()}
    assert planned == {"bfloat16/weight": 2, "uint8": 2}  # the handed frames were neither planned nor measured


def test_a_handed_frames_memory_may_be_reused_once_its_future_resolved() -> None:
    m = _manifest([("s['w']", "bfloat16", 3 * F)])
    blob = _floats(m.blobs[0].size, 3)
    inner = Recorder([blob.numel()], delay=0.01)
    w = _writer(inner, m)
    for k in range(3):
        enc = _encoded(blob, k, 2)
        staging = bytearray(b"".join(bytes(s) for s in enc.streams))  # a staging slot, reused at once
        view, streams, at = memoryview(staging), [], 0
        for n in enc.lengths:
            streams.append(view[at : at + n])
            at += n
        w.write_encoded(0, k, Encoded(enc.width, enc.planes, streams, 0.0, (), ())).result()
        staging[:] = bytes(len(staging))
    w.commit(encode_manifest(m))
    assert inner.manifest is not None
    assert _decoded(inner.manifest, inner.data) == [bytes(blob.numpy())]


def test_frames_that_do_not_fit_or_come_twice_are_refused() -> None:
    m = _manifest([("s['w']", "bfloat16", 3 * F)])
    blob = _floats(m.blobs[0].size, 4)
    w = _writer(Recorder([blob.numel()]), m)
    enc = _encoded(blob, 0, 2)
    with pytest.raises(ValueError, match="no frame 3"):
        w.write_encoded(0, 3, enc)
    raw = ptr_mv(blob.data_ptr(), F, writable=False)
    with pytest.raises(ValueError, match="width 0"):
        w.write_encoded(0, 0, Encoded(0, 0, [raw], 0.0, (), ()))
    with pytest.raises(ValueError, match="width 1"):  # a zstd stream as long as the frame
        w.write_encoded(0, 0, Encoded(1, 1, [raw], 0.0, (), ()))
    with pytest.raises(ValueError, match="width 2"):  # a raw plane of the wrong length
        w.write_encoded(0, 0, Encoded(2, 0b10, [raw[: F // 2 - 1], raw[:10]], 0.0, (), ()))
    w.write_encoded(0, 0, enc).result()
    with pytest.raises(ValueError, match="written twice"):
        w.write_encoded(0, 0, enc)
    w.write(0, F, blob.data_ptr() + F, ALIGN).result()  # part of frame 1
    with pytest.raises(ValueError, match="written twice"):
        w.write_encoded(0, 1, _encoded(blob, 1, 2))
    w.abort()
