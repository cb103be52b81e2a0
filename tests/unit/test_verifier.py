"""The one verifier of a reader's bytes (tierckpt.datapath.verifier), as each of its callers uses it:
restore() and verify() (pieces checked where they are), restore(into=) (checked and copied, long tensors
block by block) and the range reads of a resharding restore (whole checksum chunks); with the C loop and
with the Python one. A flipped byte in a tensor, a non-zero padding byte and a short read are each
found, with an error naming tier, step, blob and key."""

from __future__ import annotations

import random

import pytest
import torch
import xxhash

from tierckpt.datapath.verifier import BlobVerifier, Where, verify_range
from tierckpt.errors import CorruptCheckpointError
from tierckpt.format import native as nat
from tierckpt.format.manifest import BlobEntry
from tierckpt.format.table import TensorTable

WHERE = Where("ssd", 7)
KiB = 1 << 10


@pytest.fixture(params=["native", "python"])
def impl(request: pytest.FixtureRequest, monkeypatch: pytest.MonkeyPatch) -> str:
    if request.param == "native" and nat.native is None:
        pytest.skip("tierckpt.format._native is not built here")
    if request.param == "python":
        monkeypatch.setattr(nat, "native", None)
    return str(request.param)


class Copy:
    """Two blobs laid out as a save lays them out: tensors at 64-byte offsets, zero gaps and padding."""

    def __init__(self, lengths: tuple[list[int], ...] = ([100, 3 * KiB, 5, 40 * KiB], [70 * KiB, 9])) -> None:
        rng = random.Random(1)
        paths, blobs, offsets, sums, all_lengths = [], [], [], [], []
        self.bufs: list[torch.Tensor] = []
        for bi, lens in enumerate(lengths):
            pos = 0
            spans = []
            for n in lens:
                pos = -(-pos // 64) * 64
                spans.append((pos, n))
                pos += n
            buf = torch.zeros(-(-pos // 4096) * 4096, dtype=torch.uint8)
            for o, n in spans:
                buf[o : o + n] = torch.tensor(list(rng.randbytes(n)), dtype=torch.uint8)
                paths.append(f"state['t{len(paths)}']")
                blobs.append(bi)
                offsets.append(o)
                all_lengths.append(n)
                sums.append(xxhash.xxh3_64_intdigest(buf[o : o + n].numpy().tobytes()))
            self.bufs.append(buf)
        n = len(paths)
        self.table = TensorTable(paths, ["uint8"] * n, [(x,) for x in all_lengths], blobs, offsets, all_lengths, sums)
        self.blobs = [BlobEntry(f"blob-{i:05d}.bin", b.numel()) for i, b in enumerate(self.bufs)]

    def feed(self, v: BlobVerifier, piece: int) -> list[int]:
        """Feed every blob to ``v`` in pieces of ``piece`` bytes; the tensors completed, in order."""
        done: list[int] = []
        for bi, buf in enumerate(self.bufs):
            for off in range(0, buf.numel(), piece):
                n = min(piece, buf.numel() - off)
                k0, k = v.feed(bi, off, n, buf.data_ptr() + off)
                done += v.order[k0:k]
        v.finish()
        return done

    def flip(self, bi: int, pos: int) -> None:
        self.bufs[bi][pos] ^= 0x10


PIECES = [64 * KiB, 4 * KiB, 1000]  # whole blobs, and pieces that tensors cross


@pytest.mark.parametrize("piece", PIECES)
def test_a_good_copy_passes_and_every_tensor_completes_in_order(impl: str, piece: int) -> None:
    c = Copy()
    v = BlobVerifier(WHERE, c.table, c.blobs)
    assert c.feed(v, piece) == c.table.order()


@pytest.mark.parametrize("piece", PIECES)
def test_restore_into_copies_each_tensor_to_its_destination(impl: str, piece: int) -> None:
    c = Copy()
    v = BlobVerifier(WHERE, c.table, c.blobs, max_len=1 * KiB)  # longer tensors: block by block
    dsts = [torch.zeros(n, dtype=torch.uint8) for n in c.table.lengths]
    v.set_destinations([d.data_ptr() for d in dsts])
    c.feed(v, piece)
    for i, d in enumerate(dsts):
        o, n, bi = c.table.offsets[i], c.table.lengths[i], c.table.blobs[i]
        assert torch.equal(d, c.bufs[bi][o : o + n]), i


def caller(c: Copy, name: str, keep: list[torch.Tensor]) -> BlobVerifier:
    """restore()/verify(): checked in place; restore(into=): checked and copied (long ones by blocks)
    into destinations that ``keep`` holds."""
    if name == "restore":
        return BlobVerifier(WHERE, c.table, c.blobs)
    v = BlobVerifier(WHERE, c.table, c.blobs, max_len=1 * KiB)
    keep += [torch.zeros(n, dtype=torch.uint8) for n in c.table.lengths]
    v.set_destinations([d.data_ptr() for d in keep])
    return v


@pytest.mark.parametrize("name", ["restore", "into"])
@pytest.mark.parametrize("piece", PIECES)
@pytest.mark.parametrize(("bi", "tensor", "at"), [(0, 0, 0), (0, 1, 2000), (0, 3, 40 * KiB - 1), (1, 4, 35 * KiB)])
def test_a_flipped_byte_in_a_tensor_is_a_mismatch_naming_it(
    impl: str, name: str, piece: int, bi: int, tensor: int, at: int
) -> None:
    c = Copy()
    c.flip(bi, c.table.offsets[tensor] + at)
    keep: list[torch.Tensor] = []
    v = caller(c, name, keep)
    with pytest.raises(CorruptCheckpointError, match="checksum mismatch") as e:
        c.feed(v, piece)
    assert (e.value.tier, e.value.step, e.value.blob, e.value.key) == (
        "ssd",
        7,
        c.blobs[bi].name,
        f"state['t{tensor}']",
    )


@pytest.mark.parametrize("name", ["restore", "into"])
@pytest.mark.parametrize("piece", PIECES)
@pytest.mark.parametrize(("bi", "pos"), [(0, 101), (0, 127), (0, 3210), (0, 4095 + 40 * KiB), (1, 70 * KiB + 200)])
def test_a_non_zero_padding_byte_is_found(impl: str, name: str, piece: int, bi: int, pos: int) -> None:
    c = Copy()
    assert not any(c.table.offsets[i] <= pos < c.table.offsets[i] + c.table.lengths[i]
                   for i in range(len(c.table)) if c.table.blobs[i] == bi)  # fmt: skip
    c.flip(bi, pos)
    keep: list[torch.Tensor] = []
    v = caller(c, name, keep)
    with pytest.raises(CorruptCheckpointError, match=r"padding bytes \[\d+, \d+\) are not zero") as e:
        c.feed(v, piece)
    a, b = map(int, str(e.value).split("[")[1].split(")")[0].split(", "))
    assert a <= pos < b and e.value.blob == c.blobs[bi].name and e.value.key is None


def test_a_short_read_is_a_truncated_blob() -> None:
    WHERE.check_read("blob-00000.bin", 4096, 4096, 4096)
    with pytest.raises(CorruptCheckpointError, match=r"blob is truncated: read 100 of 4096 bytes at offset 8192") as e:
        WHERE.check_read("blob-00000.bin", 8192, 4096, 100)
    assert (e.value.tier, e.value.step, e.value.blob, e.value.rank) == ("ssd", 7, "blob-00000.bin", None)
    with pytest.raises(CorruptCheckpointError, match=r"\(rank 3's copy\) \[tier=pfs, step=7, blob=blob-00001.bin\]"):
        Where("pfs", 7, rank=3).check_read("blob-00001.bin", 0, 10, 0)


def test_blobs_that_end_before_the_tensors_do() -> None:
    c = Copy()
    v = BlobVerifier(WHERE, c.table, c.blobs)
    v.feed(0, 0, c.bufs[0].numel(), c.bufs[0].data_ptr())  # blob 1 never comes
    with pytest.raises(CorruptCheckpointError, match="blobs end before the tensors do"):
        v.finish()


# -- shard reads: whole checksum chunks of one row ---------------------------------------------------------
CHUNK = 4096


def row(n: int = 5 * CHUNK + 100) -> tuple[torch.Tensor, int, list[int]]:
    data = torch.tensor(list(random.Random(2).randbytes(n)), dtype=torch.uint8)
    raw = data.numpy().tobytes()
    chunks = [xxhash.xxh3_64_intdigest(raw[o : o + CHUNK]) for o in range(0, n, CHUNK)]
    return data, xxhash.xxh3_64_intdigest(raw), chunks


def check_range(data: torch.Tensor, whole: int, chunks: list[int], c0: int, c1: int, rank: int | None = 2) -> None:
    verify_range(
        Where("pfs", 9, rank), data[c0:].data_ptr(), c0, c1, length=data.numel(), checksum=whole,
        chunk_bytes=CHUNK, chunks=chunks, blob="blob-00003.bin", key="state['w']",
    )  # fmt: skip


@pytest.mark.parametrize(("c0", "c1"), [(0, 5 * CHUNK + 100), (CHUNK, 3 * CHUNK), (4 * CHUNK, 5 * CHUNK + 100)])
def test_chunks_of_a_row_pass_and_a_flipped_byte_in_them_is_found(impl: str, c0: int, c1: int) -> None:
    data, whole, chunks = row()
    check_range(data, whole, chunks, c0, c1)
    for pos in (c0, (c0 + c1) // 2, c1 - 1):
        data[pos] ^= 1
        with pytest.raises(CorruptCheckpointError, match=rf"checksum mismatch in bytes \[{c0}, {c1}\)") as e:
            check_range(data, whole, chunks, c0, c1)
        data[pos] ^= 1
        assert (e.value.tier, e.value.step, e.value.rank) == ("pfs", 9, 2)
        assert (e.value.blob, e.value.key) == ("blob-00003.bin", "state['w']")
    for pos in (c0 - 1, c1):  # bytes outside the chunks read are not looked at
        if 0 <= pos < data.numel():
            data[pos] ^= 1
            check_range(data, whole, chunks, c0, c1)
            data[pos] ^= 1
