"""``restore(into=...)``: the in-place restore that streams a checkpoint through reused staging buffers
straight into the target's tensors (tierckpt.datapath.restore_into)."""

from __future__ import annotations

import dataclasses
import itertools
import logging
import threading
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import torch

from tierckpt import CheckpointKey, CorruptCheckpointError, Hierarchy, StateError
from tierckpt.config import LayoutConfig
from tierckpt.datapath.restore_into import RestoreStaging
from tierckpt.format.manifest import decode_manifest, encode_manifest
from tierckpt.format.record import CommitRecord, encode_record, manifest_tag
from tierckpt.format.tree import flatten
from tierckpt.testing.tamper import rewrite_manifest
from tierckpt.tiers.gpu import GpuTier

SLOT = 64 << 10  # small staging slots, so tensors span several reads and reads wrap the pool


def config(tmp_path: Path, *tiers: str, engine: str = "auto") -> dict[str, Any]:
    kinds = {
        "host": {"name": "host", "kind": "host", "capacity": "256MiB"},
        "ssd": {"name": "ssd", "kind": "local", "path": str(tmp_path / "ssd")},
        "pfs": {"name": "pfs", "kind": "pfs", "path": str(tmp_path / "pfs")},
    }
    return {"tiers": [kinds.get(t, t) for t in tiers], "io": {"engine": engine}, "layout": {"blob_size": "1MiB"}}


def open_h(cfg: dict[str, Any], slots: int = 3) -> Hierarchy:
    if cfg["tiers"] == ["gpu"]:  # the gpu tier's logic on host memory (the CUDA run is tests/gpu)
        h = Hierarchy([GpuTier("gpu", 256 << 20, device="cpu")], layout=LayoutConfig(blob_bytes=1 << 20))
    else:
        h = Hierarchy.from_config(cfg)
    h._in_place = RestoreStaging(dataclasses.replace(h._geometry, read_slots=slots, read_slot_bytes=SLOT))
    return h


def make_state(seed: int = 0) -> dict[str, Any]:
    g = torch.Generator().manual_seed(seed)

    def raw(n: int, dtype: torch.dtype) -> torch.Tensor:
        b = torch.randint(0, 256, (n * dtype.itemsize,), dtype=torch.uint8, generator=g)
        return (b % 2).bool() if dtype == torch.bool else b.view(dtype)

    return {
        "model": {
            "big": raw(400_000, torch.float32),  # 1.6 MB: several slots and blobs
            "bf16": raw(40_001, torch.bfloat16).view(40_001, 1),
            "mat": raw(96 * 33, torch.float64).view(96, 33),
            "f8": raw(1000, torch.float8_e4m3fn),
            "c64": raw(77, torch.complex64),
            "flags": raw(13, torch.bool),
            "u16": raw(5, torch.uint16),
        },
        "optim": {
            "state": {0: {"step": torch.tensor(7.0), "exp_avg": raw(3000, torch.float32)}},
            "param_groups": [{"lr": 1e-3, "betas": (0.9, 0.95), "params": [0]}],
        },
        "empty": torch.empty(0, 3),
        "rng": raw(5056, torch.uint8),
        "step": 10 + seed,
    }


def zeros_like(s: Any) -> Any:
    if isinstance(s, torch.Tensor):
        return torch.zeros_like(s)
    if isinstance(s, dict):
        return {k: zeros_like(v) for k, v in s.items()}
    if isinstance(s, list):
        return [zeros_like(v) for v in s]
    return s


def tensors(s: Any, path: str = "") -> Iterator[tuple[str, torch.Tensor]]:
    if isinstance(s, torch.Tensor):
        yield path, s
    elif isinstance(s, dict):
        for k, v in s.items():
            yield from tensors(v, f"{path}/{k}")
    elif isinstance(s, (list, tuple)):
        for i, v in enumerate(s):
            yield from tensors(v, f"{path}/{i}")


def assert_same(a: Any, b: Any) -> None:
    ta, tb = dict(tensors(a)), dict(tensors(b))
    assert list(ta) == list(tb)
    for k in ta:
        x, y = ta[k], tb[k]
        assert x.dtype == y.dtype and x.shape == y.shape, k
        assert torch.equal(x.reshape(-1).view(torch.uint8), y.reshape(-1).view(torch.uint8)), k


def flip(h: Hierarchy, tier: str, step: int, blob: str, pos: int) -> None:
    p = Path(h.tier(tier).path) / f"step-{step:012d}" / "rank-00000" / blob  # type: ignore[attr-defined]
    with open(p, "r+b") as f:
        f.seek(pos)
        b = f.read(1)
        f.seek(pos)
        f.write(bytes([b[0] ^ 0x5A]))


@pytest.mark.parametrize("engine", ["threads", "uring"])
@pytest.mark.parametrize("tier", ["host", "gpu", "ssd", "pfs"])
def test_in_place_restore_is_bit_exact_and_keeps_the_target_memory(
    tmp_path: Path, engine: str, tier: str, loops: str
) -> None:
    state = make_state()
    with open_h(config(tmp_path, tier, engine=engine)) as h:
        h.save(state, step=1).wait()
        for rep in range(2):  # the second restore reuses the staging buffers
            target = zeros_like(state)
            target["step"] = 0
            ptrs = {k: t.data_ptr() for k, t in tensors(target)}
            assert h.restore(into=target) is target
            assert_same(state, target)
            assert target["step"] == 10 and target["optim"]["param_groups"][0]["betas"] == (0.9, 0.95)
            assert {k: t.data_ptr() for k, t in tensors(target)} == ptrs, rep
        if tier in ("ssd", "pfs"):
            assert h._in_place._pool is not None
            assert h._in_place._pool.allocated_bytes == 3 * SLOT  # bounded, and reused from restore to restore
    assert h._in_place._pool is None  # released on close


def test_a_small_checkpoint_takes_only_the_slots_it_reads_into(tmp_path: Path) -> None:
    """The pool is sized for large checkpoints (16 x 16 MiB by default) but allocates a slot only when a
    read needs one: a checkpoint of two pieces takes two slots, however many the pool may hold."""
    state = {"a": torch.arange(SLOT // 8 + 100, dtype=torch.float64)}  # one blob, just over one slot
    with open_h(config(tmp_path, "ssd"), slots=8) as h:
        h.save(state, step=1).wait()
        target = zeros_like(state)
        h.restore(into=target)
        assert torch.equal(target["a"], state["a"])
        assert h._in_place._pool.allocated_bytes == 2 * SLOT


def test_targets_that_cannot_be_streamed_into(tmp_path: Path, loops: str) -> None:
    """Non-contiguous targets, keys only the checkpoint has, a tensor saved under two keys, and one
    target tensor under two keys all end up holding the checkpoint's bytes."""
    shared = torch.arange(600, dtype=torch.float32)
    state = {"t": torch.randn(40, 70), "a": shared, "b": shared, "extra": {"x": torch.ones(3)}, "n": 1}
    with open_h(config(tmp_path, "ssd")) as h:
        h.save(state, step=2).wait()
        same = torch.zeros(600)
        target: dict[str, Any] = {"t": torch.zeros(70, 40).t(), "a": same, "b": same, "n": 0}
        assert not target["t"].is_contiguous()
        h.restore(into=target, strict=False)  # "extra" is only in the checkpoint: added to the target
        assert torch.equal(target["t"], state["t"]) and torch.equal(same, shared)
        assert torch.equal(target["extra"]["x"], torch.ones(3)) and target["n"] == 1
        a, b = torch.zeros(600), torch.zeros(600)  # two separate targets of one saved tensor
        h.restore(into={"t": torch.zeros(40, 70), "a": a, "b": b, "n": 0}, strict=False)
        assert torch.equal(a, shared) and torch.equal(b, shared)
        strided, b = torch.zeros(1200)[::2], torch.zeros(600)  # the first cannot be streamed into, the second can
        h.restore(into={"t": torch.zeros(40, 70), "a": strided, "b": b, "n": 0}, strict=False)
        assert torch.equal(strided, shared) and torch.equal(b, shared)


def test_mismatched_target_is_refused_before_anything_changes(tmp_path: Path) -> None:
    state = make_state()
    with open_h(config(tmp_path, "ssd")) as h:
        h.save(state, step=1).wait()
        target = zeros_like(state)
        target["model"]["mat"] = torch.zeros(33, 96, dtype=torch.float64)
        with pytest.raises(StateError, match=r"target\['model'\]\['mat'\]: target is torch.float64 \(33, 96\)"):
            h.restore(into=target)
        assert all(not t.any() for _, t in tensors(target) if t.numel())


@pytest.mark.parametrize(
    ("change", "message"),
    [
        (lambda t: t.__setitem__("step", torch.zeros(1)), r"target\['step'\]: target is a tensor, checkpoint has int"),
        (lambda t: t["model"].__setitem__("mat", {}), r"target\['model'\]\['mat'\]: target is a dict, checkpoint has"),
        (lambda t: t.__setitem__("model", [1]), r"target\['model'\]: target is a list of 1, checkpoint has dict"),
        (lambda t: t["model"].__setitem__("extra", torch.zeros(1)), r"target\['model'\]\['extra'\]: key is not"),
    ],
)
def test_target_structure_errors_name_the_key(tmp_path: Path, change: Any, message: str) -> None:
    state = make_state()
    with open_h(config(tmp_path, "ssd")) as h:
        h.save(state, step=1).wait()
        target = zeros_like(state)
        change(target)
        with pytest.raises(StateError, match=message):
            h.restore(into=target)
        assert all(not t.any() for _, t in tensors(target) if t.numel())


@pytest.mark.parametrize("tier", ["ssd", "host"])
def test_tensor_the_tree_does_not_reference_is_verified_and_dropped(tmp_path: Path, tier: str) -> None:
    """A hand-made manifest whose tree leaves a tensor out: no write through an unset destination."""
    with open_h(config(tmp_path, tier)) as h:
        h.save({"a": torch.arange(1000.0), "b": torch.ones(50_000)}, step=1).wait()
        t = h.tier(tier)
        m = decode_manifest(t.read_manifest(CheckpointKey(1)))
        forged = encode_manifest(dataclasses.replace(m, tree=flatten({"a": torch.zeros(1)}).tree))
        if tier == "ssd":
            rewrite_manifest(Path(t.path) / "step-000000000001" / "rank-00000" / "manifest", forged)  # type: ignore[attr-defined]
        else:
            t._held[CheckpointKey(1)].manifest = forged  # type: ignore[attr-defined]
            t.write_record(1, encode_record(CommitRecord(1, 1, (manifest_tag(forged),))))  # names the forged one
        target = {"a": torch.zeros(1000)}
        assert h.restore(into=target) is target
        assert torch.equal(target["a"], torch.arange(1000.0)) and list(target) == ["a"]


def positions(h: Hierarchy, step: int) -> dict[str, tuple[str, int, str]]:
    """Where to flip a byte: (blob name, offset, key path of the tensor there)."""
    _, m = h.inspect(step)
    t = m.tensors
    order = t.order()
    big = max(order, key=lambda i: t.lengths[i])
    first, last = order[0], order[-1]
    return {
        "first": (m.blobs[t.blobs[first]].name, t.offsets[first], t.paths[first]),
        "middle-of-a-long-tensor": (m.blobs[t.blobs[big]].name, t.offsets[big] + t.lengths[big] - 5, t.paths[big]),
        "last": (m.blobs[t.blobs[last]].name, t.offsets[last] + t.lengths[last] - 1, t.paths[last]),
    }


@pytest.mark.parametrize("where", ["first", "middle-of-a-long-tensor", "last"])
def test_flipped_byte_is_named_and_the_other_copy_is_used(
    tmp_path: Path, where: str, caplog: pytest.LogCaptureFixture, loops: str
) -> None:
    state = make_state(1)
    with open_h(config(tmp_path, "ssd", "pfs")) as h:
        h.save(state, step=3).wait()
        blob, pos, key = positions(h, 3)[where]
        flip(h, "ssd", 3, blob, pos)
        with pytest.raises(CorruptCheckpointError) as ei:
            h.restore(into=zeros_like(state), tier="ssd")
        assert (ei.value.tier, ei.value.blob, ei.value.key) == ("ssd", blob, key)
        target = zeros_like(state)
        with caplog.at_level(logging.WARNING, logger="tierckpt"):
            h.restore(into=target)
        assert_same(state, target)
        assert any("ssd" in r.getMessage() and key in r.getMessage() for r in caplog.records)
        assert h.last_restore == (3, "pfs")


def test_damaged_padding_and_truncated_blob_are_found(tmp_path: Path, loops: str) -> None:
    state = make_state(2)
    with open_h(config(tmp_path, "ssd")) as h:
        h.save(state, step=4).wait()
        _, m = h.inspect(4)
        t = m.tensors
        order = t.order()
        gaps = [
            (t.blobs[i], t.offsets[i] + t.lengths[i])
            for i, j in itertools.pairwise(order)
            if t.blobs[i] == t.blobs[j] and t.offsets[j] > t.offsets[i] + t.lengths[i]
        ]
        assert gaps
        for blob, pos in gaps[0], gaps[-1]:  # a gap between two tensors: first and last such gap
            flip(h, "ssd", 4, m.blobs[blob].name, pos)
            with pytest.raises(CorruptCheckpointError, match="padding") as ei:
                h.restore(into=zeros_like(state))
            assert ei.value.blob == m.blobs[blob].name
            flip(h, "ssd", 4, m.blobs[blob].name, pos)
        last_blob = m.blobs[-1]
        flip(h, "ssd", 4, last_blob.name, last_blob.size - 1)  # the tail padding of the last blob
        with pytest.raises(CorruptCheckpointError, match="padding") as ei:
            h.restore(into=zeros_like(state))
        assert ei.value.blob == last_blob.name
        flip(h, "ssd", 4, last_blob.name, last_blob.size - 1)  # repaired
        h.restore(into=zeros_like(state))
        p = Path(h.tier("ssd").path) / "step-000000000004" / "rank-00000" / m.blobs[0].name  # type: ignore[attr-defined]
        p.write_bytes(p.read_bytes()[: m.blobs[0].size // 2])
        with pytest.raises(CorruptCheckpointError, match="truncated") as ei:
            h.restore(into=zeros_like(state))
        assert ei.value.blob == m.blobs[0].name


def test_concurrent_in_place_restores_take_turns(tmp_path: Path) -> None:
    states = [make_state(i) for i in range(2)]
    with open_h(config(tmp_path, "ssd"), slots=2) as h:
        for i, s in enumerate(states):
            h.save(s, step=i).wait()
        targets = [zeros_like(s) for s in states]
        errors: list[BaseException] = []

        def run(i: int) -> None:
            try:
                for _ in range(3):
                    h.restore(i, into=targets[i])
            except BaseException as e:  # pragma: no cover - reported below
                errors.append(e)

        threads = [threading.Thread(target=run, args=(i,)) for i in range(2)]
        for t in threads:
            t.start()
        for t in threads:
            t.join(60)
        assert not errors
        for s, t in zip(states, targets):
            assert_same(s, t)


def spy_reads(
    h: Hierarchy, tier: str, monkeypatch: pytest.MonkeyPatch, fail_at: int | str | None = None
) -> dict[str, Any]:
    """Count the blob reads of ``tier``'s readers and how many run at once. Read number ``fail_at``
    (or with ``"engine"``, the first one submitted outside the main thread) raises OSError instead."""
    seen: dict[str, Any] = {"reads": 0, "running": 0, "most": 0, "most_after_match": 0, "matched": False}
    seen["fail_at"] = fail_at
    lock = threading.Lock()
    t = h.tier(tier)
    open_copy = t.open_copy

    def opened(key: Any) -> Any:
        c = open_copy(key)
        c.reader = lambda blobs, _r=c.reader: reader(_r(blobs))
        return c

    def reader(r: Any) -> Any:
        read = r.read

        def counted(*a: Any) -> Any:
            with lock:
                seen["reads"] += 1
                off_main = threading.current_thread() is not threading.main_thread()
                if seen["reads"] == seen["fail_at"] or (seen["fail_at"] == "engine" and off_main):
                    raise OSError(5, "injected submission failure")
                seen["running"] += 1
                seen["most"] = max(seen["most"], seen["running"])
                if seen["matched"]:
                    seen["most_after_match"] = max(seen["most_after_match"], seen["running"])
            fut = read(*a)

            def landed(_: Any) -> None:
                with lock:
                    seen["running"] -= 1

            fut.add_done_callback(landed)
            return fut

        r.read = counted
        return r

    monkeypatch.setattr(t, "open_copy", opened)
    import tierckpt.datapath.restore_into as ri

    match_target = ri.match_target

    def matched(*a: Any, **k: Any) -> Any:
        out = match_target(*a, **k)
        seen["matched"] = True
        return out

    monkeypatch.setattr(ri, "match_target", matched)
    return seen


def test_reads_start_before_the_table_is_validated_and_a_bad_table_changes_nothing(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Blob reads go into the staging slots once the manifest's head (blob names, sizes) is valid; a
    tensor table that then fails validation raises, leaves the target untouched and the slots free."""
    state = make_state(3)
    with open_h(config(tmp_path, "ssd"), slots=4) as h:
        h.save(state, step=1).wait()
        mpath = Path(h.tier("ssd").path) / "step-000000000001" / "rank-00000" / "manifest"  # type: ignore[attr-defined]
        good = mpath.read_bytes()
        m = decode_manifest(good)
        t0 = m.tensors[0]
        moved = t0._replace(offset=m.blobs[t0.blob].size)  # past the end of its blob
        rewrite_manifest(mpath, encode_manifest(dataclasses.replace(m, tensors=(moved, *m.tensors[1:]))))
        seen = spy_reads(h, "ssd", monkeypatch)
        target = zeros_like(state)
        with pytest.raises(CorruptCheckpointError, match="exceeds blob size"):
            h.restore(into=target)
        assert seen["reads"] > 0 and seen["running"] == 0  # reads had started, and all have landed
        assert all(not x.any() for _, x in tensors(target) if x.numel())
        pool = h._in_place.pool(4096)
        assert len(pool._free) == pool._allocated  # every slot given back
        rewrite_manifest(mpath, good)
        assert_same(state, h.restore(into=target))


def test_after_the_match_few_reads_run_at_once(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """Every slot is filled while the target is matched; then at most two reads run at once on a
    node-local tier (so they land in order), however many slots are free."""
    state = make_state(4)
    with open_h(config(tmp_path, "ssd"), slots=8) as h:
        h.save(state, step=1).wait()
        seen = spy_reads(h, "ssd", monkeypatch)
        assert_same(state, h.restore(into=zeros_like(state)))
        assert seen["reads"] > 8 and seen["running"] == 0
        assert 1 <= seen["most_after_match"] <= h.tier("ssd").geometry.steady_reads < seen["most"] <= 8


@pytest.mark.parametrize("engine", ["threads", "uring"])
@pytest.mark.parametrize("fail_at", [1, 2, 6, "engine"])
def test_a_read_that_cannot_be_submitted_is_raised(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, fail_at: int | str, engine: str
) -> None:
    """A failure to submit a read (in the restoring thread, or in the engine's thread as an earlier
    read lands) is raised by restore(into=), after every read in flight has landed."""
    state = make_state(5)
    with open_h(config(tmp_path, "ssd", engine=engine), slots=2 if fail_at != "engine" else 8) as h:
        h.save(state, step=1).wait()
        seen = spy_reads(h, "ssd", monkeypatch, fail_at=fail_at)
        for _ in range(20):  # "engine": until a read is submitted from the engine's thread
            try:
                h.restore(into=zeros_like(state))
            except OSError as e:
                assert "injected submission failure" in str(e)
                break
            assert fail_at == "engine"
        else:
            pytest.fail("no read was submitted from the engine's thread")
        assert seen["running"] == 0
        seen["reads"], seen["fail_at"] = 0, None
        assert_same(state, h.restore(into=zeros_like(state)))


def test_ordered_dicts_tuples_and_a_tensor_in_both_restore_in_place(tmp_path: Path, loops: str) -> None:
    """A module's state_dict (an OrderedDict) is matched key by key and streamed into; a tensor also
    referenced from an assigned tuple gets the verified bytes in both places."""
    from collections import OrderedDict

    w, b = torch.randn(8, 4), torch.randn(4)
    state = {"model": OrderedDict(w=w, b=b), "pair": (b, 3), "big": 1 << 70, "nested": [OrderedDict(x=w)]}
    with open_h(config(tmp_path, "ssd")) as h:
        h.save(state, step=1).wait()
        tw = torch.zeros(8, 4)
        target: dict[str, Any] = {"model": OrderedDict(w=tw, b=torch.zeros(4)), "pair": None, "big": 0}
        target["nested"] = [OrderedDict(x=torch.zeros(8, 4))]
        assert h.restore(into=target) is target
        assert target["model"]["w"] is tw and torch.equal(tw, w) and torch.equal(target["model"]["b"], b)
        assert torch.equal(target["nested"][0]["x"], w)
        pair = target["pair"]
        assert type(pair) is tuple and torch.equal(pair[0], b) and pair[1] == 3 and target["big"] == 1 << 70
        with pytest.raises(StateError, match=r"target\['model'\]\['w'\]: target is torch.float32 \(4, 8\)"):
            h.restore(into={**target, "model": OrderedDict(w=torch.zeros(4, 8), b=torch.zeros(4))})


def test_a_bad_tensor_reference_in_the_tree_is_named(tmp_path: Path) -> None:
    """A tree that references a tensor the table does not have is a corrupt checkpoint (naming the
    tier), found before any byte of the target changes: plain-int references of format 3 (out of
    range, negative, inside a value that is assigned) and ext-2 ones of format 2."""
    import struct

    import msgpack

    state = {"a": torch.ones(5), "b": torch.ones(3)}
    ok = msgpack.ExtType(2, struct.pack(">I", 1))
    trees = [
        (3, {"a": 7, "b": 1}),
        (3, {"a": -1, "b": 1}),
        (3, {"a": 0, "b": 1, "extra": msgpack.ExtType(1, msgpack.packb([9]))}),
        (3, {"a": msgpack.ExtType(2, struct.pack(">I", 0)), "b": 1}),
        (2, {"a": msgpack.ExtType(2, struct.pack(">I", 7)), "b": ok}),
        (2, {"a": msgpack.ExtType(2, b"\x00\x01"), "b": ok}),
    ]
    with open_h(config(tmp_path, "ssd")) as h:
        h.save(state, step=1).wait()
        mpath = Path(h.tier("ssd").path) / "step-000000000001" / "rank-00000" / "manifest"  # type: ignore[attr-defined]
        m = decode_manifest(mpath.read_bytes())
        for version, tree in trees:
            rewrite_manifest(mpath, encode_manifest(dataclasses.replace(m, version=version, tree=msgpack.packb(tree))))
            target = {"a": torch.zeros(5), "b": torch.zeros(3)}
            with pytest.raises(CorruptCheckpointError, match="tensor reference") as ei:
                h.restore(into=target)
            assert ei.value.tier == "ssd", tree
            assert not target["a"].any() and not target["b"].any()
            with pytest.raises(CorruptCheckpointError, match="tensor reference"):
                h.restore()
            [(step, tier, err)] = h.verify()  # verify checks what restore() checks
            assert (step, tier) == (1, "ssd") and isinstance(err, CorruptCheckpointError), tree
            assert "tensor reference" in str(err) and err.tier == "ssd"


class _Boom:
    """Unpickling it would run code: it leaves a mark."""

    def __reduce__(self) -> tuple[Any, ...]:
        return (_mark, (1,))


_BOOMED: list[int] = []


def _mark(x: int) -> None:
    _BOOMED.append(x)


def test_verify_checks_a_pickled_value_without_loading_it(tmp_path: Path) -> None:
    with open_h(config(tmp_path, "ssd")) as h:
        h.save({"w": torch.ones(3), "odd": _Boom()}, step=1, allow_pickle=True).wait()
        assert h.verify() == [(1, "ssd", None)]
        assert _BOOMED == []  # nothing was unpickled
        h.restore(allow_pickle=True)
        assert _BOOMED == [1]


def test_a_pickled_value_is_assigned_whole(tmp_path: Path) -> None:
    """A dict that had to be pickled (a tuple key) is one opaque value: assigned over the target's
    dict, its ints never taken for tensor references."""
    state = {"w": torch.arange(4.0), "odd": {(1, 2): 0, "n": [1, 0]}}
    with open_h(config(tmp_path, "ssd")) as h:
        h.save(state, step=1, allow_pickle=True).wait()
        target = {"w": torch.zeros(4), "odd": {"n": None}}
        assert h.restore(into=target, allow_pickle=True) is target
        assert target["odd"] == {(1, 2): 0, "n": [1, 0]} and torch.equal(target["w"], state["w"])
        h.save({"w": {(1,): 2}}, step=2, allow_pickle=True).wait()
        with pytest.raises(StateError, match=r"target\['w'\]: target is a tensor, checkpoint has a pickled value"):
            h.restore(step=2, into={"w": torch.zeros(4)}, allow_pickle=True)
