"""The ``gpu`` tier: device-copy snapshots, demotion to host, promotion back, the same bytes as any tier.

Tests marked ``cuda`` need a CUDA device and skip without one; the others run the tier's logic on
``device="cpu"`` so that every machine covers the packing, checksum and copy paths."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import torch

from tierckpt import ConfigError, Hierarchy
from tierckpt.io.engine import make_engine
from tierckpt.tiers.gpu import GpuTier
from tierckpt.tiers.host import HostTier
from tierckpt.tiers.local import LocalTier

CUDA = torch.cuda.is_available()
cuda = pytest.mark.skipif(not CUDA, reason="needs a CUDA device")
MiB = 1 << 20


def mixed_state(device: str = "cpu") -> dict[str, Any]:
    g = torch.Generator().manual_seed(0)
    big = torch.randn(512, 1024, generator=g)
    state: dict[str, Any] = {
        "w": big.to(torch.bfloat16),
        "t": big.t(),  # not contiguous
        "s": big[::3, 5:9],
        "i8": torch.arange(-100, 100, dtype=torch.int8),
        "b": torch.rand(77, generator=g) > 0.5,
        "c": torch.randn(33, dtype=torch.complex64, generator=g),
        "zero": torch.empty(0, 4),
        "scalar": torch.tensor(7, dtype=torch.int64),
        "meta": {"lr": 1e-3, "betas": (0.9, 0.95)},
    }
    if hasattr(torch, "float8_e4m3fn"):
        state["f8"] = torch.randn(100, generator=g).to(torch.float8_e4m3fn)
    return {k: v.to(device) if isinstance(v, torch.Tensor) else v for k, v in state.items()}


def same(a: Any, b: Any) -> bool:
    """Bit-exact equality (dtype, shape and every byte; NaN-safe)."""
    if isinstance(a, torch.Tensor):
        a, b = a.cpu().contiguous(), b.cpu().contiguous()
        if a.dtype != b.dtype or a.shape != b.shape:
            return False
        return a.numel() == 0 or torch.equal(a.reshape(-1).view(torch.uint8), b.reshape(-1).view(torch.uint8))
    if isinstance(a, dict):
        return a.keys() == b.keys() and all(same(a[k], b[k]) for k in a)
    return bool(a == b) and type(a) is type(b)


def blob_bytes(h: Hierarchy, tier: str, step: int) -> list[bytes]:
    from tierckpt.datapath.manifests import load_manifest
    from tierckpt.tiers.base import CheckpointKey

    t = h.tier(tier)
    key = CheckpointKey(step, 0)
    m = load_manifest(t, key)
    out = []
    reader = t.reader(key, m.blobs)
    for i, b in enumerate(m.blobs):
        buf = torch.empty(b.size, dtype=torch.uint8)
        assert reader.read(i, 0, buf.data_ptr(), b.size).result() == b.size
        out.append(buf.numpy().tobytes())
    reader.close()
    return out


def chain(tmp_path: Path, device: str, **policy: Any) -> Hierarchy:
    gpu = GpuTier("gpu", capacity_bytes=256 * MiB, device=device)
    return Hierarchy(
        [
            gpu,
            HostTier("host", capacity_bytes=256 * MiB),
            LocalTier("ssd", tmp_path / "ssd", make_engine("threads", 4)),
        ],
        policy=policy,
    )


def devices() -> list[str]:
    return ["cpu", "cuda"] if CUDA else ["cpu"]


@pytest.mark.parametrize("device", devices())
def test_snapshot_demote_and_restore(tmp_path: Path, device: str) -> None:
    state = mixed_state(device)
    with chain(tmp_path, device, keep={"gpu": 1}) as h:
        for step in (1, 2):
            h.save(state, step=step).wait()
        assert [(c.step, c.tiers) for c in h.checkpoints()] == [(1, ("host", "ssd")), (2, ("gpu", "host", "ssd"))]
        assert all(err is None for _, _, err in h.verify())
        for tier in ("gpu", "host", "ssd"):
            got = h.restore(step=2, tier=tier)
            assert same(state, got), tier
            assert all(t.device.type == "cpu" for t in got.values() if isinstance(t, torch.Tensor))
        assert h.prefetch(step=1).result() == "gpu"
        assert same(state, h.restore(step=1)) and h.last_restore == (1, "gpu")


@pytest.mark.parametrize("device", devices())
def test_same_bytes_as_a_host_save(tmp_path: Path, device: str) -> None:
    """Same state in, same bytes out: packing with device copies gives the blobs the CPU path gives."""
    state = mixed_state(device)
    with chain(tmp_path / "a", device) as h:
        h.save(state, step=1).wait()
        via_gpu = blob_bytes(h, "gpu", 1)
    with Hierarchy([HostTier("host", capacity_bytes=256 * MiB)]) as h:
        h.save(mixed_state("cpu"), step=1).wait()
        via_host = blob_bytes(h, "host", 1)
    assert via_gpu == via_host


@pytest.mark.parametrize("device", devices())
def test_staged_snapshot_is_taken_before_mutation(tmp_path: Path, device: str) -> None:
    w = torch.randn(1 << 20, device=device)
    before = w.clone()
    with chain(tmp_path, device) as h:
        handle = h.save({"w": w}, step=1)
        handle.staged.result()
        w.add_(1.0)
        handle.wait()
        for tier in ("gpu", "host", "ssd"):
            assert torch.equal(h.restore(step=1, tier=tier)["w"], before.cpu()), tier


def test_gpu_kind_without_cuda_is_a_config_error() -> None:
    if CUDA:
        pytest.skip("this machine has CUDA")
    with pytest.raises(ConfigError, match=r"tiers\[0\]\.kind: gpu needs a CUDA device"):
        Hierarchy.from_config({"tiers": [{"name": "gpu", "kind": "gpu"}, {"name": "host", "kind": "host"}]})
    with pytest.raises(ConfigError, match="needs a CUDA device"):
        GpuTier("gpu")


@cuda
def test_gpu_from_yaml_with_a_training_state(tmp_path: Path) -> None:
    model = torch.nn.Sequential(*[torch.nn.Linear(256, 256) for _ in range(4)]).cuda()
    opt = torch.optim.AdamW(model.parameters())
    model(torch.randn(8, 256, device="cuda")).sum().backward()
    opt.step()
    cfg = {
        "tiers": [
            {"name": "gpu", "kind": "gpu", "capacity": "1GiB"},
            {"name": "host", "kind": "host", "capacity": "1GiB"},
            {"name": "ssd", "kind": "local", "path": str(tmp_path / "ssd")},
        ],
        "policy": {"keep": {"gpu": 1, "host": 1}},
    }
    with Hierarchy.from_config(cfg) as h:
        state = {"model": model.state_dict(), "optim": opt.state_dict()}
        h.save(state, step=1).wait()
        got = h.restore(into={"model": model.state_dict(), "optim": None})  # None: the optimizer's state is read whole
        assert h.last_restore == (1, "gpu")
        assert all(torch.equal(v, model.state_dict()[k]) for k, v in got["model"].items())


@pytest.mark.parametrize("device", devices())
def test_demotion_straight_to_a_file_tier(tmp_path: Path, device: str) -> None:
    """A gpu tier demotes straight to an O_DIRECT file tier: memory the device buffers do not align for
    O_DIRECT (a CPU-device tier's plain allocations) goes through aligned staging, never EINVAL."""
    state = mixed_state(device)
    tiers = [GpuTier("gpu", capacity_bytes=256 * MiB, device=device), LocalTier("ssd", tmp_path / "ssd")]
    with Hierarchy(tiers, policy={"keep": {"gpu": 1}}) as h:
        for step in (1, 2):
            h.save(state, step=step).wait()
        assert [(c.step, c.tiers) for c in h.checkpoints()] == [(1, ("ssd",)), (2, ("gpu", "ssd"))]
        assert same(state, h.restore(step=1)) and h.last_restore == (1, "ssd")
        assert h.prefetch(step=1).result() == "gpu"  # file -> device memory: the other direction
        assert same(state, h.restore(step=1)) and h.last_restore == (1, "gpu")


def target_on(state: dict[str, Any], device: str) -> dict[str, Any]:
    return {k: torch.zeros_like(v, device=device) if isinstance(v, torch.Tensor) else v for k, v in state.items()}


@pytest.mark.parametrize("device", devices())
@pytest.mark.parametrize("tier", ["gpu", "host", "ssd"])
def test_restore_into_device_tensors_from_every_tier(tmp_path: Path, tier: str, device: str) -> None:
    """``restore(into=)`` a state on the GPU: filled piece by piece from verified bytes, whatever tier
    holds the copy (device memory, pinned host memory, a file); the objects stay the caller's."""
    state = mixed_state("cpu")
    state["big"] = torch.randn(3 << 20)  # longer than a verification block and a staging slot
    with chain(tmp_path, device) as h:
        h.save(state, step=1).wait()
        target = target_on(state, device)
        target["t"] = torch.zeros(512, 1024, device=device).t()  # not contiguous: through a fresh tensor
        ids = {k: id(v) for k, v in target.items()}
        got = h.restore(step=1, tier=tier, into=target)
        assert got is target and {k: id(v) for k, v in got.items()} == ids
        assert all(v.device.type == device for v in got.values() if isinstance(v, torch.Tensor))
        assert same(state, got)


@pytest.mark.parametrize("device", devices())
def test_restore_into_device_tied_weights(tmp_path: Path, device: str) -> None:
    w = torch.randn(256, 64)
    with chain(tmp_path, device) as h:
        h.save({"a": w, "b": w}, step=1).wait()  # one tensor, two references
        target = {"a": torch.zeros(256, 64, device=device), "b": torch.zeros(256, 64, device=device)}
        h.restore(step=1, tier="ssd", into=target)
        assert torch.equal(target["a"].cpu(), w) and torch.equal(target["b"].cpu(), w)


@pytest.mark.parametrize("device", devices())
def test_restore_into_device_refuses_a_damaged_copy(tmp_path: Path, device: str) -> None:
    from tierckpt.datapath.manifests import load_manifest
    from tierckpt.errors import CorruptCheckpointError
    from tierckpt.testing.tamper import blob_file
    from tierckpt.tiers.base import CheckpointKey

    state = {f"p{i}": torch.full((4096,), float(i + 1)) for i in range(8)}
    with Hierarchy([LocalTier("ssd", tmp_path / "ssd")]) as h:
        h.save(state, step=1).wait()
        t = load_manifest(h.tier("ssd"), CheckpointKey(1, 0)).tensors
    last = max(range(len(t)), key=lambda i: (t.blobs[i], t.offsets[i]))
    path, at = blob_file(next((tmp_path / "ssd").glob("step-*/rank-*")), t.blobs[last])
    with open(path, "r+b") as f:  # flip one bit of the last tensor's bytes
        f.seek(at + t.offsets[last] + 100)
        b = f.read(1)
        f.seek(at + t.offsets[last] + 100)
        f.write(bytes([b[0] ^ 0x10]))
    with Hierarchy([LocalTier("ssd", tmp_path / "ssd")]) as h:
        target = {k: torch.zeros(4096, device=device) for k in state}
        with pytest.raises(CorruptCheckpointError):
            h.restore(step=1, into=target)
    untouched = [k for k, v in target.items() if torch.count_nonzero(v).item() == 0]
    assert len(untouched) >= 1  # the damaged tensor's bytes never reached the device
    assert all(k in untouched or torch.equal(target[k].cpu(), state[k]) for k in state)
