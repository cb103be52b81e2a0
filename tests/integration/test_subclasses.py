"""Tensors whose bytes are not plainly in their storage (DTensor, dispatch subclasses, wrappers, freed
storage) are refused by save() and by restore(into=) before a byte is written; plain subclasses pass."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import torch
import torch.distributed as dist
from torch.utils._pytree import tree_map

from tierckpt import Hierarchy, StateError
from tierckpt.format.tree import flatten


def cfg(tmp_path: Path) -> dict[str, Any]:
    return {
        "tiers": [
            {"name": "host", "kind": "host", "capacity": "64MiB"},
            {"name": "ssd", "kind": "local", "path": str(tmp_path / "ssd")},
        ],
        "io": {"engine": "threads"},
    }


def _nothing_saved(h: Hierarchy, tmp_path: Path) -> bool:
    return not h.checkpoints() and not any(p.name.startswith("step") for p in (tmp_path / "ssd").rglob("*"))


class Wrapper(torch.Tensor):
    """A wrapper subclass with its own ``__torch_dispatch__`` (the pattern of DTensor and friends): its
    own storage holds nothing, its value is ``inner`` times two."""

    inner: torch.Tensor

    @staticmethod
    def __new__(cls, inner: torch.Tensor) -> Wrapper:
        w = torch.Tensor._make_wrapper_subclass(cls, inner.shape, dtype=inner.dtype, device=inner.device)
        w.inner = inner
        return w

    @classmethod
    def __torch_dispatch__(cls, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
        unwrap = lambda x: x.inner * 2 if isinstance(x, Wrapper) else x  # noqa: E731
        return func(*tree_map(unwrap, args), **tree_map(unwrap, kwargs or {}))


class Logged(torch.Tensor):
    """A subclass made with ``_make_subclass`` (real storage) whose operations its dispatch redefines."""

    @classmethod
    def __torch_dispatch__(cls, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
        unwrap = lambda x: x.as_subclass(torch.Tensor) if isinstance(x, Logged) else x  # noqa: E731
        return func(*tree_map(unwrap, args), **tree_map(unwrap, kwargs or {}))


class Plain(torch.Tensor):
    """A plain Python subclass: its bytes are its storage's."""


class Liar(torch.Tensor):
    """A subclass whose ``__torch_function__`` refuses every call: the packer must not need it."""

    @classmethod
    def __torch_function__(cls, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
        raise AssertionError(f"__torch_function__ called for {func}")


def freed() -> torch.Tensor:
    t = torch.ones(1000)
    t.untyped_storage().resize_(0)  # what FSDP does to a parameter it has resharded
    return t


def shrunk() -> torch.Tensor:
    t = torch.ones(1000)
    t.untyped_storage().resize_(16)  # 4 elements of 1000 left
    return t


@pytest.fixture(scope="module")
def dtensor(tmp_path_factory: pytest.TempPathFactory) -> Iterator[torch.Tensor]:
    """A DTensor sharded ``Shard(0)`` over a 1-rank gloo group (the FSDP2 / tensor-parallel case)."""
    if not dist.is_available() or dist.is_initialized():
        pytest.skip("torch.distributed is not available, or a process group is already set up")
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import Shard, distribute_tensor

    store = dist.FileStore(str(tmp_path_factory.mktemp("gloo") / "store"), 1)
    dist.init_process_group("gloo", store=store, rank=0, world_size=1)
    try:
        mesh = init_device_mesh("cpu", (1,))
        yield distribute_tensor(torch.arange(16.0).reshape(4, 4), mesh, [Shard(0)])
    finally:
        dist.destroy_process_group()


def test_a_dtensor_is_saved_as_its_shard_and_restored_as_the_saved_box(tmp_path: Path, dtensor: torch.Tensor) -> None:
    """Sharded states are supported (docs/distributed.md): without ``into=`` a DTensor comes back as the
    plain tensor of the box this rank saved."""
    with Hierarchy.from_config(cfg(tmp_path)) as h:
        h.save({"model": {"b": torch.ones(3), "w": dtensor}}, step=1, blocking=True)
        _, m = h.inspect(1)
        assert m.version == 5 and list(m.sharding) == [1] and m.sharding[1].global_shape == (4, 4)
        got = h.restore()
        assert type(got["model"]["w"]) is torch.Tensor and torch.equal(
            got["model"]["w"], torch.arange(16.0).reshape(4, 4)
        )


def test_a_partial_dtensor_is_refused_naming_the_key(tmp_path: Path, dtensor: torch.Tensor) -> None:
    from torch.distributed.tensor import DTensor, Partial

    partial = DTensor.from_local(torch.ones(4, 4), dtensor.device_mesh, [Partial()])
    with Hierarchy.from_config(cfg(tmp_path)) as h:
        with pytest.raises(StateError, match=r"^state\['model'\]\['w'\]: cannot save a DTensor with placement P"):
            h.save({"model": {"b": torch.ones(3), "w": partial}}, step=1)
        assert _nothing_saved(h, tmp_path)


def test_a_plain_checkpoint_restores_into_a_dtensor(tmp_path: Path, dtensor: torch.Tensor) -> None:
    with Hierarchy.from_config(cfg(tmp_path)) as h:
        h.save({"a": torch.full((3,), 5.0), "w": torch.full((4, 4), 2.0)}, step=1, blocking=True)
        a = torch.ones(3)
        with pytest.raises(StateError, match=r"^target\['x'\]: key is not in the checkpoint"):
            h.restore(into={"a": a, "w": dtensor, "x": torch.zeros(1)})
        assert torch.equal(a, torch.ones(3)) and torch.equal(dtensor.full_tensor(), torch.arange(16.0).reshape(4, 4))
        h.restore(into={"a": a, "w": dtensor})
        assert torch.equal(dtensor.full_tensor(), torch.full((4, 4), 2.0)) and torch.equal(a, torch.full((3,), 5.0))


REFUSED = [
    (lambda: Wrapper(torch.ones(3)), r"a tensor subclass .*Wrapper with its own __torch_dispatch__"),
    (lambda: torch.Tensor._make_subclass(Logged, torch.ones(3)), r"a tensor subclass .*Logged with its own __torch"),
    (freed, r"a tensor whose storage holds no memory"),
    (shrunk, r"a tensor .* not all within the 16 bytes its storage holds"),
    (lambda: torch._to_functional_tensor(torch.ones(3)), r"a functionalized tensor"),
]


@pytest.mark.parametrize(("make", "what"), REFUSED)
def test_tensors_the_packer_cannot_read_are_refused_on_save_and_as_targets(
    tmp_path: Path, make: Any, what: str
) -> None:
    with Hierarchy.from_config(cfg(tmp_path)) as h:
        with pytest.raises(StateError, match=rf"^state\['x'\]\[1\]: cannot save {what}"):
            h.save({"x": [torch.ones(2), make()]}, step=1, allow_pickle=True)
        assert _nothing_saved(h, tmp_path)
        t = make()
        h.save({"x": [torch.ones(2), torch.zeros(tuple(t.shape))]}, step=2, blocking=True)
        first = torch.zeros(2)
        with pytest.raises(StateError, match=rf"^target\['x'\]\[1\]: cannot restore into {what}"):
            h.restore(into={"x": [first, t]})
        assert not first.any()


def test_wrappers_of_torch_func_and_fake_tensors_are_refused() -> None:
    from torch._subclasses.fake_tensor import FakeTensorMode
    from torch._subclasses.functional_tensor import FunctionalTensor, FunctionalTensorMode

    with FakeTensorMode():
        fake = torch.ones(3)
    with pytest.raises(StateError, match=r"^state\['f'\]: cannot save a FakeTensor"):
        flatten({"f": fake})
    with FunctionalTensorMode():
        functional = FunctionalTensor.to_functional(torch.ones(3))
    with pytest.raises(StateError, match=r"^state\['f'\]: cannot save a tensor subclass .*FunctionalTensor"):
        flatten({"f": functional})
    errors: list[str] = []

    def loss(x: torch.Tensor) -> torch.Tensor:
        for t in (x, torch.vmap(lambda r: r)(x)):
            with pytest.raises(StateError, match=r"cannot save a tensor wrapped by a torch.func transform") as e:
                flatten({"x": t})
            errors.append(str(e.value))
        return x.sum()

    torch.func.grad(loss)(torch.ones(2, 3))
    assert len(errors) == 2


def test_plain_subclasses_and_parameters_round_trip_without_their_torch_function(tmp_path: Path) -> None:
    liar = torch.arange(6.0).reshape(2, 3).as_subclass(Liar)
    with torch._C.DisableTorchFunctionSubclass():
        liar_view = liar.t()  # non-contiguous, still a Liar
    state = {
        "p": torch.nn.Parameter(torch.arange(4.0)),
        "s": torch.arange(5).as_subclass(Plain)[1::2],
        "liar": liar,
        "liar_t": liar_view,
        "empty": torch.empty(0).as_subclass(Plain),
    }
    with Hierarchy.from_config(cfg(tmp_path)) as h:
        h.save(state, step=1, blocking=True)
        back = h.restore()
        assert type(back["s"]) is torch.Tensor and torch.equal(back["s"], torch.tensor([1, 3]))
        assert torch.equal(back["p"], torch.arange(4.0))
        with torch._C.DisableTorchFunctionSubclass():
            assert torch.equal(back["liar"], torch.arange(6.0).reshape(2, 3))
            assert torch.equal(back["liar_t"], torch.arange(6.0).reshape(2, 3).t())
        target = {"p": torch.nn.Parameter(torch.zeros(4)), "s": torch.zeros(2, dtype=torch.long).as_subclass(Plain)}
        h.save({"p": state["p"], "s": state["s"]}, step=2, blocking=True)
        h.restore(into=target)
        assert torch.equal(target["p"].detach(), torch.arange(4.0)) and torch.equal(target["s"], torch.tensor([1, 3]))


def test_a_subclass_seen_twice_is_stored_once(tmp_path: Path) -> None:
    s = torch.arange(4.0).as_subclass(Plain)
    e = torch.empty(0).as_subclass(Plain)
    flat = flatten({"a": s, "b": s, "e": e, "e2": e, "e3": torch.empty(0).as_subclass(Plain)})
    assert [r.path for r in flat.tensors] == ["state['a']", "state['e']", "state['e3']"]
    assert type(flat.tensors[0].tensor) is torch.Tensor  # read without the subclass
