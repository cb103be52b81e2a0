from __future__ import annotations

import itertools
import random

import pytest

from tierckpt.format.layout import PAD_RATIO, SMALL_ALIGN, extent_align, plan, round_up


def check(lengths: list[int], align: int, blob: int) -> None:
    lay = plan(lengths, align=align, blob_bytes=blob)
    assert len(lay.extents) == len(lengths)
    spans: dict[int, list[tuple[int, int]]] = {}
    for n, e in zip(lengths, lay.extents):
        assert e.length == n
        if n == 0:
            continue
        a = extent_align(n, align)
        assert e.offset % a == 0 and SMALL_ALIGN <= a <= align
        assert a == align or a <= max(SMALL_ALIGN, n // PAD_RATIO)  # padding is at most 1/64 of the bytes
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


def test_alignment_grows_with_the_extent_up_to_align() -> None:
    assert [extent_align(n, 4096) for n in (1, 4096, 8192, 65536, 262143, 262144, 1 << 30)] == [
        64, 64, 128, 1024, 2048, 4096, 4096,
    ]  # fmt: skip
    assert extent_align(1 << 30, 1 << 20) == 1 << 20
    # a page-sized tensor after a small one is not pushed to the next page
    assert [e.offset for e in plan([100, 4096, 300 << 10], align=4096, blob_bytes=1 << 20).extents] == [0, 128, 8192]


def test_padding_stays_small_for_many_small_tensors() -> None:
    rng = random.Random(1)
    lengths = [rng.randint(1 << 10, 64 << 10) for _ in range(5000)]
    lay = plan(lengths, align=4096, blob_bytes=256 << 20)
    assert lay.total_bytes <= sum(lengths) * (1 + 2 / PAD_RATIO) + 4096
    # a 1 MiB stripe alignment (Lustre) does not pad a 1.1 MiB tensor to 2 MiB
    big = plan([1 << 20, 1200 << 10, 1200 << 10], align=1 << 20, blob_bytes=1 << 30)
    assert big.offsets == [0, 1 << 20, (1 << 20) + (1200 << 10)] and big.blob_sizes == (4 << 20,)


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
