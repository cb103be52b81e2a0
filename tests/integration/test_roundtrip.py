"""The Hierarchy contract of issue #2, end to end on real directories."""

from __future__ import annotations

import errno
import filecmp
import logging
import threading
from collections import OrderedDict
from concurrent.futures import Future
from pathlib import Path
from typing import Any

import pytest
import torch

from tierckpt import (
    CheckpointNotFoundError,
    ConfigError,
    CorruptCheckpointError,
    Hierarchy,
    StateError,
    TierckptError,
    TierIOError,
)
from tierckpt.testing import FaultyTier
from tierckpt.tiers._lease import LEASE_DIR
from tierckpt.tiers.host import HostTier
from tierckpt.tiers.local import LocalTier

ALL_DTYPES = [
    torch.float32, torch.float64, torch.float16, torch.bfloat16, torch.complex64, torch.complex128,
    torch.int8, torch.int16, torch.int32, torch.int64, torch.uint8, torch.uint16, torch.uint32, torch.uint64,
    torch.bool, torch.float8_e4m3fn, torch.float8_e5m2, torch.float8_e4m3fnuz, torch.float8_e5m2fnuz,
]  # fmt: skip


def cfg(tmp_path: Path, *tiers: str, **extra: object) -> dict:
    kinds = {"host": {"name": "host", "kind": "host", "capacity": "512MiB"},
             "ssd": {"name": "ssd", "kind": "local", "path": str(tmp_path / "ssd")},
             "pfs": {"name": "pfs", "kind": "pfs", "path": str(tmp_path / "pfs")}}  # fmt: skip
    return {"tiers": [kinds[t] for t in tiers], **extra}


def rand(shape: tuple[int, ...], dtype: torch.dtype, seed: int = 0) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    n = 1
    for s in shape:
        n *= s
    raw = torch.randint(0, 256, (n * dtype.itemsize,), dtype=torch.uint8, generator=g)
    if dtype == torch.bool:
        return (raw % 2).to(torch.bool).view(shape)
    return raw.view(dtype).view(shape)


def bits_equal(a: torch.Tensor, b: torch.Tensor) -> bool:
    if a.dtype != b.dtype or a.shape != b.shape:
        return False
    return torch.equal(a.reshape(-1).view(torch.uint8), b.reshape(-1).view(torch.uint8)) if a.numel() else True


def full_state() -> dict:
    state: dict = {"dtypes": {}, "shapes": {}}
    for i, dt in enumerate(ALL_DTYPES):
        state["dtypes"][str(dt)] = rand((17, 5), dt, i)
    base = rand((64, 48), torch.float32, 99)
    state["shapes"] = {
        "scalar": torch.tensor(3.5), "scalar_bf16": torch.tensor(1.25, dtype=torch.bfloat16),
        "empty": torch.empty(0, 4), "empty3": torch.empty(2, 0, 3, dtype=torch.int16),
        "transposed": base.t(), "sliced": base[::3, 5:20], "view_row": base[7], "base": base,
        "expanded": torch.arange(4.0).expand(3, 4), "big": rand((1 << 20,), torch.float32, 5),
        "conj": rand((4,), torch.complex64, 7).conj(),
    }  # fmt: skip
    state["plain"] = {"step": 12, "lr": 3e-4, "name": "run", "flags": [True, None], "betas": (0.9, 0.95),
                      "blob": b"\x00\x01", "nested": {0: {"x": (1, [2, 3])}}, "od": OrderedDict(a=1)}  # fmt: skip
    return state


def assert_same(a: object, b: object, path: str = "state") -> None:
    assert type(a) is type(b), path
    if isinstance(a, torch.Tensor):
        assert bits_equal(a.resolve_conj(), b), path  # type: ignore[arg-type]
    elif isinstance(a, dict):
        assert list(a) == list(b), path  # type: ignore[arg-type]
        for k in a:
            assert_same(a[k], b[k], f"{path}[{k!r}]")  # type: ignore[index]
    elif isinstance(a, (list, tuple)):
        assert len(a) == len(b), path  # type: ignore[arg-type]
        for i, (x, y) in enumerate(zip(a, b)):  # type: ignore[call-overload]
            assert_same(x, y, f"{path}[{i}]")
    else:
        assert a == b, path


@pytest.mark.parametrize("engine", ["threads", "uring"])
@pytest.mark.parametrize("tiers", [("ssd",), ("host", "ssd", "pfs")])
def test_every_dtype_and_shape_round_trips_bit_exact(
    tmp_path: Path, engine: str, tiers: tuple[str, ...], loops: str
) -> None:
    state = full_state()
    with Hierarchy.from_config(cfg(tmp_path, *tiers, io={"engine": engine, "chunk": "256KiB"},
                                   layout={"blob_size": "1MiB"})) as h:  # fmt: skip
        h.save(state, step=100).wait()
        back = h.restore()
        assert_same(state, back)
        for name in tiers:
            assert_same(state, h.restore(step=100, tier=name))
        assert back["shapes"]["base"].data_ptr() != state["shapes"]["base"].data_ptr()


def test_restore_into_copies_in_place(tmp_path: Path) -> None:
    model = torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.Linear(16, 4))
    opt = torch.optim.AdamW(model.parameters())
    model(torch.randn(2, 8)).sum().backward()
    opt.step()
    state = {"model": model.state_dict(), "optim": opt.state_dict(), "step": 1}
    with Hierarchy.from_config(cfg(tmp_path, "ssd")) as h:
        h.save(state, step=1).wait()
        model2 = torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.Linear(16, 4))
        target = {"model": model2.state_dict(), "step": 0}
        ptrs = [t.data_ptr() for t in target["model"].values()]
        out = h.restore(into=target, strict=False)  # "optim" is only in the checkpoint: added to the target
        assert out is target and target["step"] == 1
        assert [t.data_ptr() for t in target["model"].values()] == ptrs
        for k, v in model.state_dict().items():
            assert torch.equal(model2.state_dict()[k], v)
        opt2 = torch.optim.AdamW(model2.parameters())
        opt2.load_state_dict(target["optim"])  # the optimizer state (int keys, tuples) restores usable

        bad = {"model": {k: torch.zeros(1) for k in model.state_dict()}}
        before = [t.clone() for t in model2.parameters()]
        with pytest.raises(StateError, match=r"target\['model'\]\['0.weight'\]: target is torch.float32 \(1,\)"):
            h.restore(into=bad)
        with pytest.raises(StateError, match=r"target\['missing'\]: key is not in the checkpoint"):
            h.restore(into={"model": model2.state_dict(), "missing": torch.zeros(1)})
        assert all(torch.equal(a, b) for a, b in zip(before, model2.parameters()))


def test_same_state_same_bytes(tmp_path: Path) -> None:
    paths = []
    for run in ("a", "b"):
        root = tmp_path / run
        with Hierarchy.from_config(
            cfg(root, "ssd"),
        ) as h:
            h.save(full_state(), step=3).wait()
        paths.append(root / "ssd" / "step-000000000003" / "rank-00000")
    names = sorted(p.name for p in paths[0].iterdir())
    assert names == sorted(p.name for p in paths[1].iterdir())
    assert all(filecmp.cmp(paths[0] / n, paths[1] / n, shallow=False) for n in names)


@pytest.mark.parametrize("tiers", [("ssd",), ("host",)])
def test_native_and_python_loops_write_the_same_bytes(
    tmp_path: Path, tiers: tuple[str, ...], monkeypatch: pytest.MonkeyPatch
) -> None:
    """Packing with the C loop (tierckpt.format.native) and with the Python one gives the same blobs and
    manifest, for every dtype, view, conjugate and size around the 1 MiB block (small chunks, so
    tensors cross pieces), over staging buffers that an earlier save left full of bytes."""
    import tierckpt.datapath.packing
    import tierckpt.format.native

    if tierckpt.format.native.native is None:
        pytest.skip("tierckpt.format._native is not built here")
    state = full_state()
    state["around_block"] = {f"n{n}": rand((n,), torch.uint8, n) for n in ((1 << 20) - 1, 1 << 20, (1 << 20) + 1)}
    got = {}
    for loops in ("native", "python"):
        if loops == "python":
            monkeypatch.setattr(tierckpt.datapath.packing, "native", None)
        root = tmp_path / loops
        with Hierarchy.from_config(cfg(root, *tiers, io={"chunk": "256KiB"}, layout={"blob_size": "3MiB"})) as h:
            h.save({"dirty": rand((3 << 20,), torch.uint8, 1)}, step=1).wait()  # staging bytes to overwrite
            h.save(state, step=3).wait()
            tier = h.tier(tiers[0])
            key = next(k for k in tier.list_committed() if k.step == 3)
            m = h.inspect(3)[1]
            reader = tier.reader(key, m.blobs)
            if tiers == ("ssd",):
                blobs = [(root / "ssd" / "step-000000000003" / "rank-00000" / b.name).read_bytes() for b in m.blobs]
            else:
                blobs = [bytes(reader.buffer(bi)[: b.size].numpy()) for bi, b in enumerate(m.blobs)]  # type: ignore[index]
            reader.close()
            got[loops] = (tier.read_manifest(key), blobs)
            assert_same(state, h.restore())
    assert got["native"][0] == got["python"][0]
    assert len(got["native"][1]) == len(got["python"][1]) > 1
    assert got["native"][1] == got["python"][1]


def test_the_first_write_does_not_wait_for_every_source_address(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The C packing loop's source addresses are looked up piece by piece, just ahead of it: the first
    write goes out after the first piece's tensors, and each tensor is looked up once."""
    import tierckpt.datapath.packing
    import tierckpt.format.native
    import tierckpt.tiers._files

    if tierckpt.format.native.native is None:
        pytest.skip("tierckpt.format._native is not built here")
    state = {f"t{i}": rand((1024 + i % 7,), torch.float32, i) for i in range(2000)}  # ~8 MB
    looked, at_first_write = [0], []
    source, write = tierckpt.datapath.packing._source, tierckpt.tiers._filewrite.FileWriter.write

    def counted(t: torch.Tensor) -> int:
        looked[0] += 1
        return source(t)

    def first(self: Any, *a: Any) -> Any:
        if not at_first_write:
            at_first_write.append(looked[0])
        return write(self, *a)

    monkeypatch.setattr(tierckpt.datapath.packing, "_source", counted)
    monkeypatch.setattr(tierckpt.tiers._filewrite.FileWriter, "write", first)
    with Hierarchy.from_config(cfg(tmp_path, "ssd", io={"chunk": "1MiB"})) as h:
        h.save(state, step=1).wait()
        assert looked[0] == len(state)
        assert 0 < at_first_write[0] < len(state) // 10, at_first_write
        assert_same(state, h.restore())


def test_the_manifest_is_encoded_while_the_last_writes_are_in_flight(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Once every chunk is packed, the save encodes the manifest before it waits for the writes still in
    flight. Here no write completes until the manifest is built: a save that encoded it only after the
    writes would wait out the 10 s below and fail."""
    import tierckpt.background.savejob
    import tierckpt.tiers._files

    state = {f"t{i}": rand((1024 + i % 7,), torch.float32, i) for i in range(2000)}  # ~8 MB: 2 chunks, 6 slots
    built, held = threading.Event(), []
    build, write = tierckpt.background.savejob.build_manifest, tierckpt.tiers._filewrite.FileWriter.write

    def building(*a: Any, **k: Any) -> bytes:
        out = build(*a, **k)
        built.set()
        return out

    def held_write(self: Any, *a: Any) -> Future[int]:
        outer: Future[int] = Future()
        held.append((write(self, *a), outer))
        return outer

    def release() -> None:
        ok = built.wait(10)
        for inner, outer in list(held):
            if ok:
                outer.set_result(inner.result())
            else:
                outer.set_exception(TimeoutError("the manifest was not built while the writes were in flight"))

    monkeypatch.setattr(tierckpt.background.savejob, "build_manifest", building)
    monkeypatch.setattr(tierckpt.tiers._filewrite.FileWriter, "write", held_write)
    releaser = threading.Thread(target=release)
    releaser.start()
    try:
        with Hierarchy.from_config(cfg(tmp_path, "ssd", io={"chunk": "4MiB"})) as h:
            h.save(state, step=1).wait()
            releaser.join()
            assert built.is_set() and len(held) > 2
            monkeypatch.undo()
            assert_same(state, h.restore())
            assert h.verify() == [(1, "ssd", None)]
    finally:
        built.set()
        releaser.join()


def test_a_manifest_that_cannot_be_built_fails_the_save(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """An error while the manifest is encoded (with writes in flight) fails the save and leaves nothing
    behind; the previous checkpoint still restores."""
    import tierckpt.background.savejob

    state = {f"t{i}": rand((4096,), torch.float32, i) for i in range(600)}
    with Hierarchy.from_config(cfg(tmp_path, "ssd", io={"chunk": "1MiB"})) as h:
        h.save(state, step=1).wait()

        def broken(*a: Any, **k: Any) -> bytes:
            raise RuntimeError("cannot encode")

        monkeypatch.setattr(tierckpt.background.savejob, "build_manifest", broken)
        with pytest.raises(RuntimeError, match="cannot encode"):
            h.save(state, step=2).wait()
        monkeypatch.undo()
        assert [c.step for c in h.checkpoints() if c.tiers] == [1]
        assert sorted(p.name for p in (tmp_path / "ssd").iterdir() if p.name != LEASE_DIR) == ["step-000000000001"]
        assert_same(state, h.restore())


@pytest.mark.parametrize("how", ["smaller", "larger"])
def test_a_tensor_resized_before_the_save_copies_it_fails_that_save_cleanly(
    tmp_path: Path, loops: str, how: str
) -> None:
    """A tensor replaced (``t.data = ...``) after save() returned and before the save packed it: its bytes
    would be read past their end. The save fails naming the key, leaves nothing on disk, and the
    previous checkpoint still restores."""
    from tierckpt.io import make_engine

    gate, eng = threading.Event(), make_engine("threads", 2)
    ssd = FaultyTier(LocalTier("ssd", tmp_path / "ssd", eng), gates={"reserve": gate})
    state = {
        "a": rand((1000,), torch.float32, 1),
        "b": {"w": rand((64, 64), torch.float32, 2)},
        "c": rand((8,), torch.int64, 3),
    }
    before = {"a": state["a"].clone(), "b": {"w": state["b"]["w"].clone()}, "c": state["c"].clone()}
    try:
        with Hierarchy([ssd]) as h:
            gate.set()
            h.save(state, step=1).wait()
            gate.clear()
            handle = h.save(state, step=2)  # held before the copy
            state["b"]["w"].data = torch.zeros(2) if how == "smaller" else torch.zeros(64, 65)
            gate.set()
            with pytest.raises(StateError, match=r"state\['b'\]\['w'\] holds \d+ bytes now but 16384"):
                handle.wait()
            h.wait()  # raised once, to the handle that waited for it
            assert [c.step for c in h.checkpoints() if c.tiers] == [1]
            assert sorted(p.name for p in (tmp_path / "ssd").iterdir() if p.name != LEASE_DIR) == ["step-000000000001"]
            assert_same(before, h.restore())
    finally:
        eng.close()


def test_a_file_tier_stages_through_buffers_of_its_own_io_chunk(tmp_path: Path) -> None:
    config = cfg(tmp_path, "ssd", "pfs", io={"chunk": "16MiB"})
    config["tiers"][0]["io"] = {"chunk": "8MiB"}
    with Hierarchy.from_config(config) as h:
        assert h._mover.workers["ssd"].pool().slot_bytes == 8 << 20  # the top tier too
        assert h._mover.workers["pfs"].pool().slot_bytes == 16 << 20
    with Hierarchy.from_config(cfg(tmp_path, "host", "ssd", io={"chunk": "4MiB"})) as h:
        assert h._mover.workers["host"].pool().slot_bytes == 4 << 20


def test_retention_and_records(tmp_path: Path) -> None:
    with Hierarchy.from_config(cfg(tmp_path, "host", "ssd", "pfs", policy={"keep": {"host": 1, "ssd": 2}})) as h:
        for step in range(1, 6):
            h.save({"w": torch.full((10,), float(step))}, step=step).wait()
        assert [(c.step, c.tiers) for c in h.checkpoints()] == [
            (1, ("pfs",)), (2, ("pfs",)), (3, ("pfs",)), (4, ("ssd", "pfs")), (5, ("host", "ssd", "pfs"))]  # fmt: skip
        assert h.restore(step=2)["w"][0] == 2.0
        with pytest.raises(CheckpointNotFoundError, match="step 42 is not committed"):
            h.restore(step=42)
    with Hierarchy.from_config(cfg(tmp_path, "ssd", "pfs")) as h2:  # a new process sees the file tiers
        assert h2.restore()["w"][0] == 5.0


def test_blocking_save_does_not_wait_for_evicted_files_to_be_deleted(tmp_path: Path) -> None:
    from tierckpt.io import make_engine

    gate = threading.Event()
    eng = make_engine("threads", 2)
    ssd = FaultyTier(LocalTier("ssd", tmp_path / "ssd", eng), gates={"reclaim": gate})
    with Hierarchy([ssd], policy={"keep": {"ssd": 1}}) as h:
        h.save({"w": torch.ones(4096)}, step=1, blocking=True)
        h.save({"w": torch.zeros(4096)}, step=2, blocking=True)  # returns while step 1's files wait in reclaim
        assert [c.step for c in h.checkpoints()] == [2]  # step 1 is unlisted before the save returns
        assert (tmp_path / "ssd" / "step-000000000001").exists()  # ... and its files are not deleted yet
        assert torch.equal(h.restore()["w"], torch.zeros(4096))
        gate.set()
        h.wait()
    eng.close()
    assert not (tmp_path / "ssd" / "step-000000000001").exists()
    assert ssd.calls["reclaim"] >= 1


def test_restore_prefers_fastest_and_falls_back_on_corruption(tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    with Hierarchy.from_config(cfg(tmp_path, "ssd", "pfs")) as h:
        h.save({"w": torch.arange(1000.0)}, step=1).wait()
        blob = tmp_path / "ssd" / "step-000000000001" / "rank-00000" / "blob-00000.bin"
        data = bytearray(blob.read_bytes())
        data[100] ^= 0xFF
        blob.write_bytes(bytes(data))
        with caplog.at_level(logging.WARNING):
            assert torch.equal(h.restore()["w"], torch.arange(1000.0))
        assert any("tier 'ssd'" in r.message and "checksum mismatch" in r.message for r in caplog.records)
        # the fall from one tier to the next: a warning naming the tier, why, and the tier tried next
        fell = [r for r in caplog.records if "the copy on tier 'ssd'" in r.getMessage()]
        assert len(fell) == 1 and fell[0].levelno == logging.WARNING, [r.getMessage() for r in caplog.records]
        msg = fell[0].getMessage()
        assert msg.startswith("restore: step 1: the copy on tier 'ssd' is corrupt (CorruptCheckpointError: "), msg
        assert "checksum mismatch" in msg and msg.endswith("); trying tier 'pfs' next"), msg
        with pytest.raises(CorruptCheckpointError, match=r"tier=ssd, step=1, blob=blob-00000.bin, key=state\['w'\]"):
            h.restore(tier="ssd")


def test_refused_values_leave_nothing_on_disk(tmp_path: Path) -> None:
    with Hierarchy.from_config(cfg(tmp_path, "host", "ssd")) as h:
        with pytest.raises(StateError, match=r"state\['optim'\]\['param_groups'\]\[0\]\['fn'\]"):
            h.save({"w": torch.ones(3), "optim": {"param_groups": [{"fn": print}]}}, step=1)
        assert h.checkpoints() == []
        assert [p for p in (tmp_path / "ssd").iterdir() if p.name != LEASE_DIR] == []
        with pytest.raises(ValueError, match="step must be"):
            h.save({}, step=-1)


def test_failure_on_one_tier_does_not_stop_the_others(tmp_path: Path) -> None:
    from tierckpt.io import make_engine

    eng = make_engine("threads", 2)
    good = LocalTier("ssd", tmp_path / "ssd", eng)
    bad = FaultyTier(LocalTier("pfs", tmp_path / "pfs", eng), {"write": OSError(errno.EIO, "injected EIO")})
    h = Hierarchy([HostTier("host", 64 << 20), good, bad])
    handle = h.save({"w": torch.ones(100)}, step=1)
    handle.wait(tier="ssd")
    handle.wait(tier="host")
    with pytest.raises(OSError, match="injected EIO"):
        handle.wait()
    assert set(handle.errors()) == {"pfs"}
    assert [(c.step, c.tiers) for c in h.checkpoints()] == [(1, ("host", "ssd"))]
    assert not list((tmp_path / "pfs").glob("step-*/.tmp-*"))
    h.save({"w": torch.ones(100)}, step=2)  # not waited on: close() raises it
    with pytest.raises(OSError, match="injected EIO"):
        h.close()
    eng.close()


def test_commit_failure_is_isolated(tmp_path: Path) -> None:
    from tierckpt.io import make_engine

    eng = make_engine("threads", 2)
    bad = FaultyTier(LocalTier("pfs", tmp_path / "pfs", eng), {"commit": TierIOError(errno.ENOSPC, "full")})
    with Hierarchy([LocalTier("ssd", tmp_path / "ssd", eng), bad]) as h:
        handle = h.save({"w": torch.ones(10)}, step=1)
        with pytest.raises(TierIOError):
            handle.wait()
        assert isinstance(handle.errors()["pfs"], TierckptError)
        assert [c.tiers for c in h.checkpoints()] == [("ssd",)]
    eng.close()


def test_host_capacity_evicts_copies_held_elsewhere(tmp_path: Path) -> None:
    state = {"w": torch.zeros(3 << 20, dtype=torch.uint8)}
    conf = cfg(tmp_path, "host", "ssd")
    conf["tiers"][0]["capacity"] = "7MiB"
    with Hierarchy.from_config(conf) as h:
        h.save(state, step=1).wait()
        h.save(state, step=2).wait()
        h.save(state, step=3).wait()  # needs room: step 1 is on ssd too, so it leaves host memory
        assert [c.tiers for c in h.checkpoints()] == [("ssd",), ("host", "ssd"), ("host", "ssd")]
    with Hierarchy.from_config({"tiers": [{"name": "host", "kind": "host", "capacity": "1MiB"}]}) as h:
        handle = h.save(state, step=1)
        with pytest.raises(OSError) as ei:
            handle.wait()
        assert ei.value.errno == errno.ENOSPC and "capacity" in str(ei.value)


def test_pickle_opt_in(tmp_path: Path) -> None:
    with Hierarchy.from_config(cfg(tmp_path, "ssd")) as h:
        h.save({"keys": {(1, 2): "x"}}, step=1, allow_pickle=True).wait()
        with pytest.raises(StateError, match="pickled"):
            h.restore()
        assert h.restore(allow_pickle=True) == {"keys": {(1, 2): "x"}}


def test_empty_and_tensorless_states(tmp_path: Path) -> None:
    with Hierarchy.from_config(cfg(tmp_path, "host", "ssd")) as h:
        h.save({}, step=1).wait()
        h.save({"only": [1, "two"], "e": torch.empty(0)}, step=2).wait()
        assert h.restore(step=1) == {}
        back = h.restore()
        assert back["only"] == [1, "two"] and back["e"].shape == (0,)


def test_constructor_validation(tmp_path: Path) -> None:
    with pytest.raises(ConfigError, match="at least one tier"):
        Hierarchy([])
    with pytest.raises(ConfigError, match="policy.keep.nvme"):
        Hierarchy([HostTier("host")], policy={"keep": {"nvme": 1}})
    h = Hierarchy([HostTier("host")])
    h.close()
    with pytest.raises(RuntimeError, match="closed"):
        h.save({}, step=1)


def test_restored_tensors_own_their_storage(tmp_path: Path) -> None:
    """Zero-copy restore must still look like fresh tensors to torch (set_rng_state once segfaulted on views)."""
    state = {"rng": torch.get_rng_state(), "w": torch.randn(100, 7), "small": torch.arange(3, dtype=torch.int16)}
    with Hierarchy.from_config(cfg(tmp_path, "ssd")) as h:
        h.save(state, step=1).wait()
        back = h.restore()
    for t in back.values():
        assert t.storage_offset() == 0
        assert t.untyped_storage().nbytes() == t.numel() * t.element_size()
    torch.set_rng_state(back["rng"])
    assert torch.equal(torch.get_rng_state(), state["rng"])
    back["w"].add_(1)  # writable
