"""``HierarchyReader.read_data`` streams an item that DCP asks for whole, into a tensor of its dtype, straight
into DCP's target tensor (tierckpt/dcp/_direct.py); everything else is copied from a fresh tensor. Each test
checks the values bit for bit and which way each item went (the copies from fresh tensors are counted)."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import torch

dcp = pytest.importorskip("torch.distributed.checkpoint")

from torch.distributed.checkpoint.api import CheckpointException  # noqa: E402

import tierckpt.dcp._reader as reader_mod  # noqa: E402
from tests.unit.test_dcp import gloo1  # noqa: E402, F401  (a fixture: a process group of this process alone)
from tierckpt import Hierarchy  # noqa: E402
from tierckpt.dcp import HierarchyReader, HierarchyWriter  # noqa: E402

pytestmark = pytest.mark.filterwarnings("ignore::UserWarning", "ignore::FutureWarning")


@pytest.fixture
def copied(monkeypatch: pytest.MonkeyPatch) -> list[tuple[int, torch.Size]]:
    """(target address, shape) of every item the reader copies from a fresh tensor (not streamed)."""
    seen: list[tuple[int, torch.Size]] = []
    real = reader_mod.copy_tensor

    def spy(dst: torch.Tensor, src: torch.Tensor) -> None:
        seen.append((dst.data_ptr(), dst.shape))
        real(dst, src)

    monkeypatch.setattr(reader_mod, "copy_tensor", spy)
    return seen


def _two_tiers(tmp_path: Path) -> dict[str, Any]:
    return {
        "tiers": [
            {"name": "ssd", "kind": "local", "path": str(tmp_path / "ssd")},
            {"name": "pfs", "kind": "pfs", "path": str(tmp_path / "pfs")},
        ],
    }


@pytest.fixture
def h(tmp_path: Path) -> Iterator[Hierarchy]:
    with Hierarchy.from_config(_two_tiers(tmp_path)) as hier:
        yield hier


def test_whole_items_stream_into_the_targets_bit_for_bit(h: Hierarchy, copied: list[Any]) -> None:
    torch.manual_seed(0)
    sd: dict[str, Any] = {
        "model": {"w": torch.randn(256, 64), "b": torch.randn(64)},
        "ids": torch.arange(1000),
        "bf": torch.randn(33).to(torch.bfloat16),
        "f8": torch.randn(17).to(torch.float8_e4m3fn),
        "n": 3,
    }
    dcp.save(sd, storage_writer=HierarchyWriter(h, step=1, durable="all"))
    got: dict[str, Any] = {
        "model": {"w": torch.full((256, 64), -1.0), "b": torch.zeros(64)},
        "ids": torch.zeros(1000, dtype=torch.int64),
        "bf": torch.zeros(33, dtype=torch.bfloat16),
        "f8": torch.zeros(17, dtype=torch.float8_e4m3fn),
        "n": 0,
    }
    before = {k: id(v) for k, v in got["model"].items()}
    dcp.load(got, storage_reader=HierarchyReader(h, step=1))
    assert copied == []  # every tensor streamed, none copied from a fresh one
    assert {k: id(v) for k, v in got["model"].items()} == before  # into DCP's targets, the user's tensors
    for a, b in [(got["model"]["w"], sd["model"]["w"]), (got["model"]["b"], sd["model"]["b"])]:
        assert torch.equal(a, b)
    assert torch.equal(got["ids"], sd["ids"]) and torch.equal(got["bf"], sd["bf"])
    assert torch.equal(got["f8"].view(torch.uint8), sd["f8"].view(torch.uint8)) and got["n"] == 3


def test_a_damaged_copy_streams_from_the_next_tier(
    h: Hierarchy, tmp_path: Path, copied: list[Any], caplog: pytest.LogCaptureFixture
) -> None:
    """The damage is deep in a long tensor: the bytes before it already went into the target from the
    first tier; the next tier's copy rewrites them all."""
    sd = {"big": torch.arange(3 << 20, dtype=torch.int32), "small": torch.arange(7.0)}
    dcp.save(sd, storage_writer=HierarchyWriter(h, step=1, durable="all"))
    [blob] = [p for p in (tmp_path / "ssd").glob("step-*/rank-*/*") if p.name.startswith("blob")]
    with blob.open("r+b") as f:  # one flipped bit, 10 MiB into the blob
        f.seek(10 << 20)
        byte = f.read(1)[0]
        f.seek(10 << 20)
        f.write(bytes([byte ^ 1]))
    got = {"big": torch.full((3 << 20,), -1, dtype=torch.int32), "small": torch.zeros(7)}
    dcp.load(got, storage_reader=HierarchyReader(h, step=1))
    assert torch.equal(got["big"], sd["big"]) and torch.equal(got["small"], sd["small"])
    assert "tier 'ssd'" in caplog.text and "checksum" in caplog.text
    assert copied == []


def test_targets_of_another_dtype_or_stride_get_the_values(h: Hierarchy, copied: list[Any]) -> None:
    """A target of another dtype is cast from a fresh tensor; a non-contiguous one of the stored dtype is
    filled once every byte is verified (the in-place restore's own copy)."""
    torch.manual_seed(1)
    sd = {"a": torch.randn(6, 8), "b": torch.randn(5, 7), "c": torch.randn(4)}
    dcp.save(sd, storage_writer=HierarchyWriter(h, step=1))
    got = {"a": torch.zeros(6, 8, dtype=torch.bfloat16), "b": torch.zeros(7, 5).t(), "c": torch.zeros(4)}
    a_ptr = got["a"].data_ptr()
    dcp.load(got, storage_reader=HierarchyReader(h, step=1))
    assert torch.equal(got["a"], sd["a"].to(torch.bfloat16))
    assert torch.equal(got["b"], sd["b"]) and not got["b"].is_contiguous()
    assert torch.equal(got["c"], sd["c"])
    assert [p for p, _ in copied] == [a_ptr]  # only the cast went through a fresh tensor


@pytest.mark.usefixtures("gloo1")
def test_a_resharded_load_streams_whole_chunks_and_copies_boxes(h: Hierarchy, copied: list[Any]) -> None:
    """Saved as two shards of 4 rows: a plain target takes each stored chunk whole (streamed into its rows);
    a target of four shards of 2 rows asks for boxes of the stored chunks (copied from fresh tensors)."""
    from torch.distributed._shard.sharded_tensor import empty
    from torch.distributed._shard.sharding_spec import ChunkShardingSpec

    def spec(n: int) -> ChunkShardingSpec:
        return ChunkShardingSpec(dim=0, placements=["rank:0/cpu"] * n)

    full = torch.arange(24.0).reshape(8, 3)
    st = empty(spec(2), 8, 3)
    for i, shard in enumerate(st.local_shards()):
        shard.tensor.copy_(full[4 * i : 4 * i + 4])
    dcp.save({"st": st}, storage_writer=HierarchyWriter(h, step=1))

    plain = {"st": torch.zeros(8, 3)}
    dcp.load(plain, storage_reader=HierarchyReader(h, step=1))
    assert torch.equal(plain["st"], full) and copied == []

    four = {"st": empty(spec(4), 8, 3)}
    dcp.load(four, storage_reader=HierarchyReader(h, step=1))
    assert [s.tensor.tolist() for s in four["st"].local_shards()] == [
        full[2 * i : 2 * i + 2].tolist() for i in range(4)
    ]
    assert len(copied) == 4  # each a box of a stored chunk


def test_the_garbage_collector_is_as_it_was_after_a_load(h: Hierarchy, monkeypatch: pytest.MonkeyPatch) -> None:
    """read_data pauses the cyclic collector and leaves it as it found it, after a failed read too."""
    import gc

    dcp.save({"t": torch.arange(5)}, storage_writer=HierarchyWriter(h, step=1))
    seen: list[bool] = []
    real = reader_mod.read_part

    def spy(*a: Any, **k: Any) -> Any:
        seen.append(gc.isenabled())
        return real(*a, **k)

    monkeypatch.setattr(reader_mod, "read_part", spy)
    assert gc.isenabled()
    got = {"t": torch.zeros(5, dtype=torch.int64)}
    dcp.load(got, storage_reader=HierarchyReader(h, step=1))
    assert gc.isenabled() and seen == [False] and torch.equal(got["t"], torch.arange(5))
    gc.disable()
    try:
        dcp.load(got, storage_reader=HierarchyReader(h, step=1))
        assert not gc.isenabled()
    finally:
        gc.enable()

    def broken(*a: Any, **k: Any) -> Any:
        raise OSError(5, "the disk")

    monkeypatch.setattr(reader_mod, "read_part", broken)
    with pytest.raises(CheckpointException):  # DCP's, around the reader's error
        dcp.load(got, storage_reader=HierarchyReader(h, step=1))
    assert gc.isenabled()
