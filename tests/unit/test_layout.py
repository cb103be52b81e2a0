from __future__ import annotations

import itertools
import random

import pytest

from tierckpt.format.layout import SMALL_ALIGN, plan, round_up


def check(lengths: list[int], align: int, blob: int) -> None:
    lay = plan(lengths, align=align, blob_bytes=blob)
    assert len(lay.extents) == len(lengths)
    spans: dict[int, list[tuple[int, int]]] = {}
    for n, e in zip(lengths, lay.extents):
        assert e.length == n
        if n == 0:
            continue
        assert e.offset % (align if n >= align else SMALL_ALIGN) == 0
        assert e.offset + n <= lay.blob_sizes[e.blob]
        spans.setdefault(e.blob, []).append((e.offset, e.offset + n))
    for s in lay.blob_sizes:
        assert s % align == 0 and s > 0
    for ranges in spans.values():
        ranges.sort()
        assert all(a[1] <= b[0] for a, b in itertools.pairwise(ranges))
    for b, size in enumerate(lay.blob_sizes):  # a blob only exceeds the target when one item does
        if size > blob:
            assert any(e.blob == b and e.length > blob - align for e in lay.extents)


def test_random_layouts_are_valid_and_deterministic() -> None:
    rng = random.Random(0)
    for _ in range(200):
        lengths = [rng.choice([0, 1, 7, 64, 4095, 4096, 5000, 70000, 1 << 20]) for _ in range(rng.randint(0, 60))]
        align = rng.choice([512, 4096, 1 << 16])
        blob = rng.choice([align, 1 << 20, 4 << 20])
        check(lengths, align, blob)
        assert plan(lengths, align=align, blob_bytes=blob) == plan(lengths, align=align, blob_bytes=blob)


def test_small_items_are_packed_tightly() -> None:
    lay = plan([100] * 30, align=4096, blob_bytes=1 << 20)
    assert lay.blob_sizes == (4096,)
    assert [e.offset for e in lay.extents[:3]] == [0, 128, 256]


def test_large_items_start_aligned_and_blobs_split() -> None:
    lay = plan([10, 3 << 20, 3 << 20], align=4096, blob_bytes=4 << 20)
    assert [e.blob for e in lay.extents] == [0, 0, 1]
    assert lay.extents[1].offset == 4096
    assert lay.blob_sizes == (4096 + (3 << 20), 3 << 20)


def test_oversized_item_gets_its_own_blob() -> None:
    lay = plan([1, 10 << 20, 1], align=4096, blob_bytes=1 << 20)
    assert [e.blob for e in lay.extents] == [0, 1, 2]


def test_no_bytes_no_blobs() -> None:
    assert plan([], align=4096, blob_bytes=1 << 20).blob_sizes == ()
    assert plan([0, 0], align=4096, blob_bytes=1 << 20).blob_sizes == ()


@pytest.mark.parametrize("kw", [{"align": 3000}, {"align": 4096, "blob_bytes": 100}, {"small_align": 8192}])
def test_bad_arguments(kw: dict[str, int]) -> None:
    args = {"align": 4096, "blob_bytes": 1 << 20} | kw
    with pytest.raises(ValueError):
        plan([1], **args)


def test_round_up() -> None:
    assert [round_up(n, 4096) for n in (0, 1, 4096, 4097)] == [0, 4096, 4096, 8192]
