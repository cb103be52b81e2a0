"""The C loops of tierckpt.format._native (and the loader that checks them) against what they replace."""

from __future__ import annotations

import logging
import os
import random
from array import array

import pytest
import torch
import xxhash

from tierckpt.format import native as nat

native = nat.native
needs_native = pytest.mark.skipif(native is None, reason="tierckpt.format._native is not built here")
U64 = (1 << 64) - 1


def test_native_is_built_where_required() -> None:
    """CI sets TIERCKPT_REQUIRE_NATIVE=1: a broken build must fail there, not fall back unseen."""
    if os.environ.get("TIERCKPT_REQUIRE_NATIVE") != "1":
        pytest.skip("TIERCKPT_REQUIRE_NATIVE is not set")
    assert native is not None


@needs_native
@pytest.mark.parametrize("n", [0, 1, 3, 4, 8, 9, 16, 17, 100, 128, 129, 240, 241, 4096, 65_537, 1 << 21])
def test_digest_is_xxh3(n: int) -> None:
    data = random.Random(n).randbytes(n)
    assert native.digest(data) == xxhash.xxh3_64_intdigest(data)


class Blob:
    """A buffer laid out like a blob: tensors at aligned offsets, zero gaps, and a record table."""

    def __init__(self, lengths: list[int], align: int = 64, seed: int = 0) -> None:
        rng = random.Random(seed)
        self.offsets, pos = [], 0
        for n in lengths:
            pos = -(-pos // align) * align
            self.offsets.append(pos)
            pos += n
        self.lengths = lengths
        self.size = -(-pos // 4096) * 4096
        self.buf = torch.zeros(self.size, dtype=torch.uint8)
        for o, n in zip(self.offsets, lengths):
            self.buf[o : o + n] = torch.tensor(list(rng.randbytes(n)), dtype=torch.uint8)
        self.sums = [
            xxhash.xxh3_64_intdigest(self.buf[o : o + n].numpy().tobytes()) for o, n in zip(self.offsets, lengths)
        ]
        self.dsts = [torch.zeros(n, dtype=torch.uint8) for n in lengths]
        order = list(range(len(lengths)))
        self.recs = nat.records(order, self.offsets, self.lengths, self.sums, [d.data_ptr() for d in self.dsts])

    def scatter(
        self,
        k: int = 0,
        stop: int | None = None,
        p0: int = 0,
        n: int | None = None,
        cursor: int | None = None,
        max_len: int = U64,
        threads: int = 1,
    ) -> tuple[int, int, int, int, int]:
        n = self.size - p0 if n is None else n
        stop = len(self.lengths) if stop is None else stop
        return native.scatter(
            self.recs.table,
            k,
            stop,
            self.buf.data_ptr() + p0,
            p0,
            n,
            p0 if cursor is None else cursor,
            max_len,
            threads,
        )

    def copied(self, i: int) -> bool:
        o, n = self.offsets[i], self.lengths[i]
        return torch.equal(self.dsts[i], self.buf[o : o + n])


@needs_native
def test_scatter_verifies_and_copies_every_tensor() -> None:
    b = Blob([1, 3, 64, 1000, 4097, 65_536, 7], align=64)
    k, cursor, err, _, _ = b.scatter()
    assert (k, cursor, err) == (7, b.offsets[-1] + 7, 0)
    assert all(b.copied(i) for i in range(7))


@needs_native
def test_scatter_stops_where_a_tensor_leaves_the_piece_or_is_too_long() -> None:
    b = Blob([100, 200, 300_000, 50, 60])
    piece = b.offsets[2] + 10  # tensor 2 crosses the end of this piece
    assert b.scatter(n=piece)[:3] == (2, b.offsets[1] + 200, 0)
    assert not b.copied(2)
    assert b.scatter(max_len=1000)[:3] == (2, b.offsets[1] + 200, 0)  # too long for the loop
    after = b.scatter(k=3, p0=b.offsets[2] + 300_000 - 8, cursor=b.offsets[2] + 300_000)  # a piece after it
    assert after[:3] == (5, b.offsets[4] + 60, 0) and b.copied(3) and b.copied(4)
    assert b.scatter(k=1, stop=2, cursor=100)[:3] == (2, b.offsets[1] + 200, 0)  # never past stop


@needs_native
@pytest.mark.parametrize("victim", [0, 3, 6])
def test_scatter_reports_a_mismatch_and_copies_nothing_from_there(victim: int) -> None:
    b = Blob([10, 20, 30, 40_000, 50, 60, 70])
    b.buf[b.offsets[victim] + b.lengths[victim] // 2] ^= 0x10
    k, cursor, err, _, _ = b.scatter()
    assert (k, cursor, err) == (victim, b.offsets[victim], 1)
    assert all(b.copied(i) for i in range(victim))
    assert not any(bool(b.dsts[i].any()) for i in range(victim, 7))


@needs_native
@pytest.mark.parametrize("where", ["first-gap-byte", "last-gap-byte"])
def test_scatter_reports_non_zero_padding(where: str) -> None:
    b = Blob([10, 20, 30], align=64)
    gap = (b.offsets[1] + 20, b.offsets[2])
    b.buf[gap[0] if where == "first-gap-byte" else gap[1] - 1] = 1
    assert b.scatter() == (2, gap[0], 2, gap[0], gap[1])
    assert not b.dsts[2].any()


@needs_native
def test_scatter_leaves_bytes_already_in_place() -> None:
    b = Blob([100, 200])
    b.recs.set_dst(0, b.buf.data_ptr() + b.offsets[0])  # read straight into its destination: hash only
    assert b.scatter()[:3] == (2, b.offsets[1] + 200, 0)
    assert not b.dsts[0].any() and b.copied(1)


@needs_native
def test_scatter_refuses_bad_arguments() -> None:
    b = Blob([100, 200])
    with pytest.raises(ValueError):
        native.scatter(b.recs.table[:-1], 0, 1, b.buf.data_ptr(), 0, b.size, 0, U64)  # not whole records
    with pytest.raises(ValueError):
        b.scatter(k=2, stop=1)
    with pytest.raises(ValueError):
        b.scatter(stop=3)  # past the table
    with pytest.raises(ValueError):
        b.scatter(cursor=b.size + 1)  # cursor outside the piece


@pytest.mark.parametrize("impl", ["native", "python"])
def test_all_zero(impl: str, monkeypatch: pytest.MonkeyPatch) -> None:
    if impl == "native" and native is None:
        pytest.skip("tierckpt.format._native is not built here")
    if impl == "python":
        monkeypatch.setattr(nat, "native", None)
    t = torch.zeros(10_000, dtype=torch.uint8)
    a = t.data_ptr()
    for start in range(9):
        for n in (0, 1, 7, 8, 9, 63, 64, 65, 130, 4096, 4097, 9000):
            assert nat.all_zero(a + start, n)
            if n:
                t[start + n - 1] = 1
                assert not nat.all_zero(a + start, n)
                assert nat.all_zero(a + start, n - 1)
                t[start + n - 1] = 0


def test_records_layout() -> None:
    r = nat.records([2, 0], [10, 20, 30], [1, 2, 3], [7, 8, 9], [100, 200, 300])
    assert r.table == array("Q", [30, 3, 9, 300, 10, 1, 7, 100])
    r.set_dst(1, 5)
    assert r.table[7] == 5
    assert nat.records([0], [1], [2], [3]).table == array("Q", [1, 2, 3, 0])


def test_loader_off_by_environment(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("TIERCKPT_NATIVE", "0")
    assert nat._load() is None


@needs_native
def test_loader_refuses_a_function_that_is_not_xxh3(
    monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    """A candidate is checked against python-xxhash before it is set (strnlen has the right signature
    and the wrong results), and a rejected one never replaces the function in use."""
    monkeypatch.setattr(nat, "_candidates", lambda: [("libc.so.6", "strnlen"), ("libc.so.6", "no_such_symbol")])
    with caplog.at_level(logging.WARNING, logger="tierckpt"):
        assert nat._load() is None
    assert any("strnlen" in r.getMessage() and "disagrees" in r.getMessage() for r in caplog.records)
    data = b"still xxh3" * 100
    assert native.digest(data) == xxhash.xxh3_64_intdigest(data)


@needs_native
@pytest.mark.parametrize("threads", [1, 2, 3, 8])
@pytest.mark.parametrize("damage", [None, "early", "late", "both", "gap-at-middle"])
def test_scatter_on_threads_reports_the_first_problem(threads: int, damage: str | None) -> None:
    """A run of 2.5 MiB is split over the threads: results and errors are those of one thread (the
    first problem in blob order); only tensors after a damaged one may differ (copied, verified)."""
    n = 40
    b = Blob([64 * 1024 + 8] * n, align=64)  # 8 bytes past 64 KiB: a zero gap before every tensor
    if damage in ("early", "both"):
        b.buf[b.offsets[3] + 5] ^= 1
    if damage in ("late", "both"):
        b.buf[b.offsets[n - 4] + 5] ^= 1
    if damage == "gap-at-middle":
        b.buf[b.offsets[n // 2] - 1] = 7
    got = b.scatter(threads=threads)
    if damage is None:
        assert got == (n, b.offsets[-1] + b.lengths[-1], 0, 0, 0)
        assert all(b.copied(i) for i in range(n))
        return
    if damage == "gap-at-middle":
        gap = (b.offsets[n // 2 - 1] + b.lengths[0], b.offsets[n // 2])
        assert got == (n // 2, gap[0], 2, *gap)
        bad = n // 2
    else:
        bad = 3 if damage in ("early", "both") else n - 4
        assert got[:3] == (bad, b.offsets[bad], 1)
    assert all(b.copied(i) for i in range(bad))
    assert not b.dsts[bad].any()


@needs_native
@pytest.mark.parametrize("hashed", [True, False])
def test_gather_packs_zeroes_gaps_and_hashes(hashed: bool) -> None:
    """gather is scatter's mirror: sources into a piece full of old bytes, gaps zeroed, checksums
    stored (or left alone); it stops at a tensor without a source, too long, or leaving the piece."""
    b = Blob([10, 3000, 70_000, 20, 5000], align=64)
    srcs = [b.buf[o : o + n].clone() for o, n in zip(b.offsets, b.lengths)]
    piece = torch.full((b.size,), 0xAB, dtype=torch.uint8)  # stale bytes everywhere
    t = nat.records(range(5), b.offsets, b.lengths, [0] * 5, [s.data_ptr() for s in srcs]).table
    t[4 * 3 + 3] = 0  # tensor 3 has no source (not contiguous, or on a device): the caller packs it
    k, cursor = native.gather(t, 0, 5, piece.data_ptr(), 0, b.size, 0, U64, hashed)
    assert (k, cursor) == (3, b.offsets[2] + 70_000)
    assert torch.equal(piece[:cursor], b.buf[:cursor])  # tensors in, gaps zero
    assert bool((piece[cursor:] == 0xAB).all())  # nothing past the stop touched
    assert [t[4 * i + 2] for i in range(3)] == (b.sums[:3] if hashed else [0, 0, 0])
    assert native.gather(t, 0, 5, piece.data_ptr(), 0, b.size, 0, 4096, hashed)[0] == 2  # too long
    p1 = b.offsets[1] + 100  # a piece that ends inside tensor 1
    assert native.gather(t, 0, 5, piece.data_ptr(), 0, p1, 0, U64, hashed) == (1, b.offsets[0] + 10)
    with pytest.raises(ValueError):
        native.gather(t, 0, 6, piece.data_ptr(), 0, b.size, 0, U64, hashed)
    with pytest.raises(TypeError):
        native.gather(bytes(t), 0, 5, piece.data_ptr(), 0, b.size, 0, U64, hashed)  # read-only table
