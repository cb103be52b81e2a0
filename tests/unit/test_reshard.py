"""datapath/reshard.py's pure helpers: finding DTensors in a target, chunk-aligned spans."""

from __future__ import annotations

import torch

from tierckpt.datapath.matching import holds_dtensor
from tierckpt.datapath.shardread import _as_box


def test_a_target_that_holds_itself_is_walked_once() -> None:
    import torch.distributed.tensor  # noqa: F401  # the walk runs only once DTensor exists

    a: dict[str, object] = {"x": [1, (2, {})]}
    a["self"] = a
    loop: list[object] = []
    loop.append(loop)
    assert not holds_dtensor(a) and not holds_dtensor(loop) and not holds_dtensor([a, a, loop])


def test_a_box_is_a_strided_view_of_the_chunks_read() -> None:
    shard = torch.arange(48, dtype=torch.float32).reshape(6, 8)  # a saved shard, row-major
    raw = shard.view(torch.uint8).flatten()
    c0 = 64  # the read started at byte 64 (element 16, row 2)
    box = _as_box(raw[c0:], torch.float32, (6, 8), c0, (3, 2), (2, 4))
    assert torch.equal(box, shard[3:5, 2:6])
