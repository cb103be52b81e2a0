"""tierckpt as a DCP storage backend in one process: ``dcp.save`` / ``dcp.async_save`` / ``dcp.load`` through
``HierarchyWriter`` / ``HierarchyReader``, compared with DCP's own ``FileSystemWriter``; the metadata record
(no pickle) and its validation; what ``h.restore`` of a DCP checkpoint returns."""

from __future__ import annotations

import contextlib
import copy
import threading
from collections.abc import Iterator
from concurrent.futures import Future
from pathlib import Path
from typing import Any

import pytest
import torch

dcp = pytest.importorskip("torch.distributed.checkpoint")

from torch.distributed.checkpoint.api import CheckpointException  # noqa: E402
from torch.distributed.checkpoint.default_planner import DefaultSavePlanner  # noqa: E402
from torch.distributed.checkpoint.metadata import MetadataIndex  # noqa: E402

from tierckpt import Hierarchy  # noqa: E402
from tierckpt.dcp import HierarchyReader, HierarchyWriter, Location  # noqa: E402
from tierckpt.dcp._record import decode_metadata, encode_metadata  # noqa: E402
from tierckpt.errors import CorruptCheckpointError, TierckptError  # noqa: E402
from tierckpt.format.manifest import decode_head  # noqa: E402
from tierckpt.testing import FaultyTier  # noqa: E402
from tierckpt.testing.compressed import recompress  # noqa: E402
from tierckpt.tiers.base import CheckpointKey  # noqa: E402
from tierckpt.tiers.host import HostTier  # noqa: E402
from tierckpt.tiers.local import LocalTier  # noqa: E402
from tierckpt.tiers.pfs import PfsTier  # noqa: E402

pytestmark = pytest.mark.filterwarnings("ignore::UserWarning", "ignore::FutureWarning")


@pytest.fixture
def h(tmp_path: Path) -> Iterator[Hierarchy]:
    cfg = {
        "tiers": [
            {"name": "host", "kind": "host"},
            {"name": "ssd", "kind": "local", "path": str(tmp_path / "ssd")},
            {"name": "pfs", "kind": "pfs", "path": str(tmp_path / "pfs")},
        ],
        "policy": {"demote": {"pfs": {"every": 1}}},
    }
    with Hierarchy.from_config(cfg) as hier:
        yield hier


def _state(seed: int = 0) -> dict[str, Any]:
    """Model + AdamW state after one step, tensors of several dtypes, bytes and plain values, nesting."""
    torch.manual_seed(seed)
    model = torch.nn.Sequential(torch.nn.Linear(6, 4), torch.nn.ReLU(), torch.nn.Linear(4, 2))
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    model(torch.randn(3, 6)).sum().backward()
    opt.step()
    return {
        "model": model.state_dict(),
        "optim": opt.state_dict(),
        "dtypes": {
            "bf16": torch.randn(5, 3).to(torch.bfloat16),
            "f16": torch.randn(7).half(),
            "i64": torch.arange(10) * (seed + 1),
            "u8": torch.randint(0, 255, (2, 2, 2), dtype=torch.uint8),
            "bool": torch.rand(9) > 0.5,
            "c64": torch.randn(3, dtype=torch.complex64),
            "f8": torch.randn(4).to(torch.float8_e4m3fn),
            "scalar": torch.tensor(3.5 + seed),
            "view": torch.randn(4, 6)[:, ::2],  # not contiguous
        },
        "tensors": [torch.full((2,), float(seed)), torch.ones(3, dtype=torch.int32)],
        "step": 100 + seed,
        "name": f"run-{seed}",
        "raw": bytes([seed, 1, 2]),
        "pair": (seed, "b"),
        "nested": {"a": {"b": {"c": torch.eye(3) * seed, "lr": 0.5 + seed}}},
    }


def _blank(sd: dict[str, Any]) -> dict[str, Any]:
    """A state of the same structure whose tensors are zeros and plain values placeholders."""
    out = copy.deepcopy(sd)

    def zero(v: Any) -> Any:
        if isinstance(v, torch.Tensor):
            return torch.zeros_like(v)
        if isinstance(v, dict):
            return {k: zero(x) for k, x in v.items()}
        if isinstance(v, list):
            return [zero(x) for x in v]
        return "placeholder"

    return zero(out)  # type: ignore[no-any-return]


def _bits(t: torch.Tensor) -> torch.Tensor:
    """``t`` as something torch.equal compares bit for bit (it has no float8 kernel)."""
    return t.contiguous().view(torch.uint8) if t.dtype.is_floating_point and t.element_size() == 1 else t


def _assert_same(a: Any, b: Any, path: str = "sd") -> None:
    same = (isinstance(a, dict) and isinstance(b, dict)) or type(a) is type(b)  # an OrderedDict is a dict
    assert same, f"{path}: {type(a)} vs {type(b)}"
    if isinstance(a, torch.Tensor):
        assert a.dtype == b.dtype and a.shape == b.shape, path
        assert torch.equal(_bits(a), _bits(b)), path
    elif isinstance(a, dict):
        assert a.keys() == b.keys(), path
        for k in a:
            _assert_same(a[k], b[k], f"{path}[{k!r}]")
    elif isinstance(a, (list, tuple)):
        assert len(a) == len(b), path
        for i, (x, y) in enumerate(zip(a, b, strict=True)):
            _assert_same(x, y, f"{path}[{i}]")
    else:
        assert a == b, path


# -- round trips ---------------------------------------------------------------------------------------------
def test_save_then_load_round_trips_every_value(h: Hierarchy) -> None:
    sd = _state(1)
    md = dcp.save(sd, storage_writer=HierarchyWriter(h, step=5))
    assert all(isinstance(v, Location) and v.rank == 0 for v in md.storage_data.values())
    got = _blank(sd)
    dcp.load(got, storage_reader=HierarchyReader(h, step=5))
    _assert_same(got, sd)


def test_a_compressed_copy_loads(h: Hierarchy) -> None:
    """Every tier's copy of the step stored compressed (the host tier's too): the metadata and each item
    read through the decoder."""
    sd = _state(3)
    dcp.save(sd, storage_writer=HierarchyWriter(h, step=4, durable="all"))
    key = CheckpointKey(4, 0)
    assert [t.name for t in h.tiers if t.holds(key)] == ["host", "ssd", "pfs"]
    for t in h.tiers:
        recompress(t, key, plan=lambda b, k: (2, 0b11))
        assert decode_head(t.read_manifest(key)).frames is not None
    got = _blank(sd)
    dcp.load(got, storage_reader=HierarchyReader(h, step=4))
    _assert_same(got, sd)


def test_a_dcp_checkpoint_lists_verifies_demotes_and_is_one_save(h: Hierarchy, tmp_path: Path) -> None:
    dcp.save(_state(0), storage_writer=HierarchyWriter(h, step=3, durable="all"))
    [info] = h.checkpoints()
    assert info.step == 3 and info.tiers == ("host", "ssd", "pfs")  # demoted as the policy says
    assert [(s, t, e) for s, t, e in h.verify()] == [(3, t, None) for t in ("host", "ssd", "pfs")]
    # one part for the rank, a manifest and a few aggregated blobs: no file per item (there are 30)
    [part] = (tmp_path / "pfs").glob("step-*/rank-*")
    assert len(list(part.iterdir())) <= 3, sorted(p.name for p in part.iterdir())


def test_save_returns_once_durable_on_the_first_persistent_tier(h: Hierarchy) -> None:
    dcp.save({"t": torch.arange(1000)}, storage_writer=HierarchyWriter(h, step=1))
    assert h.checkpoints()[0].states["ssd"] == "committed"


@contextlib.contextmanager
def _gated_pfs(tmp_path: Path, ssd: bool) -> Iterator[tuple[Hierarchy, threading.Event, FaultyTier]]:
    """host, an ssd (when ``ssd``) and a pfs whose commits wait for the event (set at the end, or after
    20 s: a save that waits for pfs returns then)."""
    held = threading.Event()
    timer = threading.Timer(20.0, held.set)
    pfs = FaultyTier(PfsTier("pfs", tmp_path / "pfs"), gates={"commit": held})
    tiers = [HostTier("host"), *([LocalTier("ssd", tmp_path / "ssd")] if ssd else []), pfs]
    timer.start()
    try:
        with Hierarchy(tiers) as hier:
            yield hier, held, pfs
            held.set()
    finally:
        timer.cancel()
        held.set()


def test_the_default_waits_for_the_fastest_directory_every_rank_reads(tmp_path: Path) -> None:
    """One rank (one node): its ssd directory holds every rank's part, so dcp.save returns before the
    shared tier commits, also where DCP's plan caching sends the plans once; durable="shared" waits for
    the shared tier, and so does the default where the only other tier is process memory."""
    key = DefaultSavePlanner.__name__
    try:
        with _gated_pfs(tmp_path / "a", ssd=True) as (h, held, pfs):
            for step in (1, 2):
                planner = DefaultSavePlanner(enable_plan_caching=True)
                dcp.save({"t": torch.arange(4)}, storage_writer=HierarchyWriter(h, step=step), planner=planner)
                assert h.checkpoints()[-1].states["ssd"] == "committed" and not pfs.list_committed(), step
            threading.Timer(1.0, held.set).start()
            dcp.save({"t": torch.arange(4)}, storage_writer=HierarchyWriter(h, step=3, durable="shared"))
            assert 3 in [k.step for k in pfs.list_committed()]
    finally:  # DCP keeps cached plans in class attributes, by the planner's class name
        for cache in ("_cached_save_plan", "_cached_final_save_plan", "_cached_all_plans", "_cached_global_plan"):
            getattr(DefaultSavePlanner, cache).pop(key, None)
        DefaultSavePlanner._cached_metadata.pop(key, None)
    with _gated_pfs(tmp_path / "b", ssd=False) as (h, held, pfs):
        threading.Timer(1.0, held.set).start()
        dcp.save({"t": torch.arange(4)}, storage_writer=HierarchyWriter(h, step=1))
        assert [k.step for k in pfs.list_committed()] == [1]


def test_a_damaged_copy_is_read_from_the_next_tier(tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    cfg = {
        "tiers": [
            {"name": "ssd", "kind": "local", "path": str(tmp_path / "ssd")},
            {"name": "pfs", "kind": "pfs", "path": str(tmp_path / "pfs")},
        ],
    }
    sd: dict[str, Any] = {"t": torch.arange(4096, dtype=torch.int64), "n": 3}
    with Hierarchy.from_config(cfg) as h:
        dcp.save(sd, storage_writer=HierarchyWriter(h, step=1, durable="all"))
        [blob] = [p for p in (tmp_path / "ssd").glob("step-*/rank-*/*") if p.name.startswith("blob")]
        with blob.open("r+b") as f:  # one flipped bit in the tensor's bytes on the fastest tier
            f.seek(100)
            byte = f.read(1)[0]
            f.seek(100)
            f.write(bytes([byte ^ 1]))
        got: dict[str, Any] = {"t": torch.zeros(4096, dtype=torch.int64), "n": 0}
        dcp.load(got, storage_reader=HierarchyReader(h, step=1))
    assert torch.equal(got["t"], sd["t"]) and got["n"] == 3
    assert "tier 'ssd'" in caplog.text and "checksum" in caplog.text


def test_h_restore_returns_the_nested_state_and_the_dcp_entry(h: Hierarchy) -> None:
    sd = _state(2)
    dcp.save(sd, storage_writer=HierarchyWriter(h, step=1))
    got = h.restore(1)
    entry = got.pop("__dcp__")
    assert entry["rank"] == 0 and entry["world_size"] == 1 and entry["metadata"]["format"] == 2
    # DCP's flattening names dict keys as strings (the optimizer's parameter ids); plain values stay plain
    want = {**sd, "optim": {**sd["optim"], "state": {str(k): v for k, v in sd["optim"]["state"].items()}}}
    want["dtypes"] = {**sd["dtypes"], "view": sd["dtypes"]["view"].contiguous()}
    _assert_same(got, want)
    assert got["raw"] == bytes([2, 1, 2]) and entry["payloads"] == []  # nothing needed DCP's pickled bytes


def test_async_save_stages_then_completes_in_the_background(h: Hierarchy) -> None:
    sd = _state(3)
    fut = dcp.async_save(sd, storage_writer=HierarchyWriter(h, step=7))
    assert isinstance(fut, Future)  # DCP's own staging: the save goes on in its thread
    fut.result(timeout=60)
    assert [c.step for c in h.checkpoints()] == [7]
    got = _blank(sd)
    dcp.load(got, storage_reader=HierarchyReader(h))  # step=None: the newest
    _assert_same(got, sd)


def test_same_values_and_metadata_as_dcps_file_system_writer(h: Hierarchy, tmp_path: Path) -> None:
    sd = _state(4)
    dcp.save(sd, storage_writer=HierarchyWriter(h, step=2))
    dcp.save(sd, storage_writer=dcp.FileSystemWriter(str(tmp_path / "fs")))
    ours, stock = _blank(sd), _blank(sd)
    dcp.load(ours, storage_reader=HierarchyReader(h, step=2))
    dcp.load(stock, storage_reader=dcp.FileSystemReader(str(tmp_path / "fs")))
    _assert_same(ours, stock)
    a, b = HierarchyReader(h, step=2).read_metadata(), dcp.FileSystemReader(str(tmp_path / "fs")).read_metadata()
    assert a.state_dict_metadata == b.state_dict_metadata and a.planner_data == b.planner_data


class _OwnGlobalPlan(DefaultSavePlanner):
    """A planner whose global plan DCP's writer cannot see early: rank 0's part waits for finish()."""

    def create_global_plan(self, all_plans):  # type: ignore[no-untyped-def]
        return super().create_global_plan(all_plans)


class _OwnBytes(DefaultSavePlanner):
    """A planner that serializes objects its own way: they are stored as its bytes."""

    def transform_object(self, write_item, object):  # type: ignore[no-untyped-def]
        return super().transform_object(write_item, object)


@pytest.mark.parametrize("planner", [_OwnGlobalPlan, _OwnBytes])
def test_other_planners(h: Hierarchy, planner: type[DefaultSavePlanner]) -> None:
    sd = _state(5)
    dcp.save(sd, storage_writer=HierarchyWriter(h, step=4), planner=planner())
    got = _blank(sd)
    dcp.load(got, storage_reader=HierarchyReader(h, step=4))
    _assert_same(got, sd)
    payloads = h.restore(4)["__dcp__"]["payloads"]
    assert (["step"] in payloads) == (planner is _OwnBytes)


def test_checkpoint_id_names_the_step(h: Hierarchy) -> None:
    assert HierarchyWriter.validate_checkpoint_id("12") and HierarchyReader.validate_checkpoint_id("0")
    assert not HierarchyWriter.validate_checkpoint_id("s3://b/12") and not HierarchyReader.validate_checkpoint_id("-1")
    sd = {"t": torch.arange(4)}
    dcp.save(sd, checkpoint_id="12", storage_writer=HierarchyWriter(h, step=1))
    assert [c.step for c in h.checkpoints()] == [12]
    got = {"t": torch.zeros(4, dtype=torch.int64)}
    dcp.load(got, checkpoint_id="12", storage_reader=HierarchyReader(h))
    assert torch.equal(got["t"], sd["t"])


# -- refusals and damage ----------------------------------------------------------------------------------------
def test_bad_writer_arguments_are_refused(tmp_path: Path) -> None:
    tier = {"name": "pfs", "kind": "pfs", "path": str(tmp_path / "pfs")}
    with Hierarchy.from_config({"tiers": [tier]}) as h0, pytest.raises(ValueError, match="durable"):
        HierarchyWriter(h0, step=1, durable="soon")
    with Hierarchy.from_config({"tiers": [tier]}, readonly=True) as ro, pytest.raises(TierckptError, match="read-only"):
        HierarchyWriter(ro, step=1)


def test_a_checkpoint_not_written_through_dcp_is_named(h: Hierarchy) -> None:
    h.save({"t": torch.ones(2)}, step=1).wait()
    with pytest.raises(TierckptError, match="not written through DCP"):
        HierarchyReader(h, step=1).read_metadata()


def _saved_record(h: Hierarchy, sd: dict[str, Any]) -> dict[str, Any]:
    dcp.save(sd, storage_writer=HierarchyWriter(h, step=1))
    return h.restore(1)  # type: ignore[no-any-return]


@pytest.mark.parametrize(
    ("damage", "field"),
    [
        (lambda r: r.pop("state_dict"), "state_dict: missing"),
        (lambda r: r["state_dict"]["w"].update(dtype="float99"), "state_dict['w'].dtype"),
        (lambda r: r["state_dict"]["w"]["chunks"][0].__setitem__(1, [9, 9]), "state_dict['w'].chunks[0]"),
        (lambda r: r["state_dict"]["w"].update(size="big"), "state_dict['w'].size"),
        (lambda r: r["storage_data"][0].__setitem__(2, 3), "storage_data[0].rank"),
        (lambda r: r["storage_data"].pop(), "storage_data: does not match state_dict"),
        (lambda r: r["planner_data"]["mappings"].update(w=[]), "planner_data.mappings['w']"),
        (lambda r: r.update(format=0), "format: expected one of 1, 2"),
    ],
)
def test_a_damaged_metadata_record_names_the_field(h: Hierarchy, damage: Any, field: str) -> None:
    state = _saved_record(h, {"w": torch.ones(2, 3), "n": 1})
    damage(state["__dcp__"]["metadata"])
    h.save(state, step=2).wait()  # the same part, with the damaged record
    with pytest.raises(CorruptCheckpointError, match=f"DCP metadata: {field}".replace("[", r"\[").replace("(", r"\(")):
        HierarchyReader(h, step=2).read_metadata()
    with pytest.raises(CheckpointException, match="DCP metadata"):  # dcp.load passes the error on
        dcp.load({"w": torch.zeros(2, 3), "n": 0}, storage_reader=HierarchyReader(h, step=2))


def test_a_missing_item_is_named_not_returned(h: Hierarchy) -> None:
    state = _saved_record(h, {"w": torch.ones(2, 3), "n": 1})
    del state["w"]
    h.save(state, step=2).wait()
    with pytest.raises(CheckpointException, match=r"rank 0's part has nothing at \['w'\]"):
        dcp.load({"w": torch.zeros(2, 3), "n": 0}, storage_reader=HierarchyReader(h, step=2))


def test_the_record_round_trips_without_pickle(h: Hierarchy) -> None:
    sd = {"a": {"w": torch.ones(2, 3, dtype=torch.bfloat16)}, "n": 1}
    md = dcp.save(sd, storage_writer=HierarchyWriter(h, step=1))
    rec = encode_metadata(md, md.storage_data)
    assert "pickle" not in repr(rec) and rec["state_dict"]["a.w"]["dtype"] == "bfloat16"
    back = decode_metadata(rec, 1)
    assert back.state_dict_metadata == md.state_dict_metadata and back.planner_data == md.planner_data
    assert back.storage_data == {
        MetadataIndex("a.w", (0, 0)): Location(0, ("a", "w")),
        MetadataIndex("n"): Location(0, ("n",)),
    }
    assert back.storage_meta == md.storage_meta


def test_a_newer_record_format_is_unsupported_not_damage(h: Hierarchy) -> None:
    """A record or entry of a later format is an intact copy this reader cannot read (upgrade), never damage;
    format 1 (the entries of before coordinator_rank and per-rank records) is still read."""
    from tierckpt.dcp._record import READ_FORMATS, RECORD_FORMAT, check_format
    from tierckpt.errors import UnsupportedFormatError

    md = dcp.save({"n": 1}, storage_writer=HierarchyWriter(h, step=1))
    rec = encode_metadata(md, md.storage_data)
    assert rec["format"] == RECORD_FORMAT and 1 in READ_FORMATS
    assert decode_metadata({**rec, "format": 1}, 1).storage_data == decode_metadata(rec, 1).storage_data
    with pytest.raises(UnsupportedFormatError, match=f"format {RECORD_FORMAT + 1} is newer"):
        decode_metadata({**rec, "format": RECORD_FORMAT + 1}, 1)
    for bad in (0, "2", True, None):
        with pytest.raises(CorruptCheckpointError, match="format: expected one of"):
            check_format(bad, "DCP entry", "pfs", 1)


# -- items with no key path of their own ---------------------------------------------------------------------
@pytest.fixture
def gloo1() -> Iterator[None]:
    """A process group of this process alone (a ShardedTensor needs one)."""
    import torch.distributed as dist

    dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    try:
        yield
    finally:
        dist.destroy_process_group()


def test_two_shards_of_one_sharded_tensor_on_one_rank_round_trip(h: Hierarchy, gloo1: None, tmp_path: Path) -> None:
    """The second shard has no key path of its own: it is kept in rank 0's ``__dcp__`` entry beside the
    metadata record, which must still read (it was refused as "holds tensor 1": no tier could load it)."""
    from torch.distributed._shard.sharded_tensor import empty
    from torch.distributed._shard.sharding_spec import ChunkShardingSpec

    spec = ChunkShardingSpec(dim=0, placements=["rank:0/cpu", "rank:0/cpu"])
    st = empty(spec, 4, 3)
    for i, shard in enumerate(st.local_shards()):
        shard.tensor.copy_(torch.arange(6.0).reshape(2, 3) + 10 * i)
    dcp.save({"st": st, "x": torch.ones(2)}, storage_writer=HierarchyWriter(h, step=1))
    entry = h.restore(1)["__dcp__"]
    assert len(entry["chunks"]) == 1 and "metadata" in entry  # the format is as it was
    h.wait()
    for tier in ("host", "ssd", "pfs"):  # every tier's copy reads
        alone = {"tiers": [{"name": tier, "kind": "local" if tier == "ssd" else tier, "path": str(tmp_path / tier)}]}
        with contextlib.nullcontext(h) if tier == "host" else Hierarchy.from_config(alone, readonly=True) as r:
            got = {"st": empty(spec, 4, 3), "x": torch.zeros(2)}
            dcp.load(got, storage_reader=HierarchyReader(r, step=1))
        assert [s.tensor.tolist() for s in got["st"].local_shards()] == [s.tensor.tolist() for s in st.local_shards()]
        assert torch.equal(got["x"], torch.ones(2))


def test_a_tensor_in_the_record_itself_is_still_refused(h: Hierarchy) -> None:
    state = _saved_record(h, {"w": torch.ones(2, 3), "n": 1})
    state["__dcp__"]["metadata"]["version"] = torch.ones(1)  # damage: a tensor where plain data belongs
    h.save(state, step=2).wait()
    with pytest.raises(CorruptCheckpointError, match="DCP record: holds tensor"):
        HierarchyReader(h, step=2).read_metadata()


def test_a_tierckpt_error_reaches_the_other_ranks_whole() -> None:
    """DCP hands each rank's exception to the others pickled: each error comes back with its message,
    type and fields (CorruptCheckpointError did not unpickle: the ranks got a TypeError instead)."""
    import pickle

    from tierckpt.errors import CoordinationError, TierBusyError, TierFullError, UnsupportedFormatError

    for err in (
        CorruptCheckpointError("DCP metadata: format: expected 1, got 2", tier="pfs", step=3, blob="b0", key="w"),
        TierFullError("tier 'ssd' is full"),
        UnsupportedFormatError("manifest version 9"),
        TierBusyError("leased by job 'A'", tier="ssd", job="A", pid=5),
        CoordinationError("rank(s) 2 did not arrive", (2,), undecided=True),
    ):
        back = pickle.loads(pickle.dumps(err))
        assert (type(back), str(back), back.__dict__) == (type(err), str(err), err.__dict__)
        assert getattr(back, "errno", None) == getattr(err, "errno", None)


def test_loadable_trusts_a_node_local_directory_only_where_every_rank_names_one_node_and_one_host() -> None:
    """A node number may be every rank's default (0, where no launcher names the node): two hosts whose
    ranks all say node 0 and one path for the ssd have two directories, so the ssd does not count."""
    from tierckpt.dcp._writer import _READABLE, _note_readable, _Where

    dirs = (("host", None), ("ssd", "/local/ssd"))
    with Hierarchy([HostTier("host")]) as h:
        _note_readable(h, [_Where(0, "a", dirs), _Where(0, "a", dirs)])
        assert _READABLE[h] == {"ssd"}  # process memory never counts
        for other in (_Where(0, "b", dirs), _Where(1, "a", dirs), _Where(0, "a", (("ssd", "/local/ssd-1"),))):
            _note_readable(h, [_Where(0, "a", dirs), other])
            assert _READABLE[h] == frozenset(), other
