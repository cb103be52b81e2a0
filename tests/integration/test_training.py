"""The lifecycle around a training job: a CPU training loop with lazy saves every step, a restart in a
fresh process that prefetches during its (simulated) initialization, and preemption by SIGTERM."""

from __future__ import annotations

import importlib.util
import json
import os
import shutil
import signal
import subprocess
import sys
import textwrap
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
import torch
import yaml

from tierckpt import Hierarchy

REPO = Path(__file__).resolve().parents[2]


def _example_model() -> type[torch.nn.Module]:
    """The quickstart's small GPT (tied embedding and head), so the test trains the model users see."""
    spec = importlib.util.spec_from_file_location("tierckpt_quickstart", REPO / "examples" / "quickstart.py")
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module.TinyGPT  # type: ignore[no-any-return]


TinyGPT = _example_model()


def train_state(model: torch.nn.Module, opt: torch.optim.Optimizer, step: int) -> dict[str, Any]:
    return {"model": model.state_dict(), "optim": opt.state_dict(), "step": step, "rng": torch.get_rng_state()}


def clone(obj: Any) -> Any:
    if isinstance(obj, torch.Tensor):
        return obj.clone()
    if isinstance(obj, dict):
        return {k: clone(v) for k, v in obj.items()}
    if isinstance(obj, (list, tuple)):
        return type(obj)(clone(v) for v in obj)
    return obj


def same(a: Any, b: Any) -> bool:
    if isinstance(a, torch.Tensor):
        return isinstance(b, torch.Tensor) and a.dtype == b.dtype and torch.equal(a, b)
    if isinstance(a, dict):
        return isinstance(b, dict) and a.keys() == b.keys() and all(same(a[k], b[k]) for k in a)
    if isinstance(a, (list, tuple)):
        return type(a) is type(b) and len(a) == len(b) and all(same(x, y) for x, y in zip(a, b))
    return bool(a == b) and type(a) is type(b)


def test_training_loop_with_lazy_saves_every_step(chain_config: Callable[..., dict[str, Any]], tmp_path: Path) -> None:
    """50 steps of a small GPT with AdamW, a lazy save every step (host → ssd → pfs, every 5th to the pfs,
    keep host 1, ssd 2). The snapshot is staged while forward/backward run and waited for right before
    ``optimizer.step()``. Afterwards every tier holds what its policy says and every copy verifies."""
    torch.manual_seed(0)
    model = TinyGPT()
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    expected: dict[int, Any] = {}
    with Hierarchy.from_config(chain_config(keep={"host": 1, "ssd": 2}, demote={"pfs": {"every": 5}})) as h:
        for step in range(1, 51):
            handle = h.save(train_state(model, opt, step - 1), step=step)  # the state as of the last step
            if step % 5 == 0 or step >= 49:
                expected[step] = clone(train_state(model, opt, step - 1))
            idx = torch.randint(0, 256, (4, 33))
            loss = torch.nn.functional.cross_entropy(model(idx[:, :-1]).flatten(0, 1), idx[:, 1:].flatten())
            opt.zero_grad()
            loss.backward()  # parameters and optimizer state are untouched so far: the copy overlaps this
            handle.staged.result()
            opt.step()  # now they change in place
        h.wait()
        on = {t.name: [k.step for k in t.list_committed()] for t in h.tiers}
        assert on == {"host": [50], "ssd": [49, 50], "pfs": list(range(5, 51, 5))}
        assert [c.step for c in h.checkpoints()] == [*range(5, 50, 5), 49, 50]
        assert all(set(c.states.values()) <= {"committed", "absent"} for c in h.checkpoints())
        results = h.verify()
        assert len(results) == 1 + 2 + 10 and all(err is None for _, _, err in results)
        for step, want in expected.items():
            assert same(h.restore(step=step), want), step
        restored_model, restored_opt = TinyGPT(), torch.optim.AdamW(TinyGPT().parameters(), lr=1e-3)
        got = h.restore()
        restored_model.load_state_dict(got["model"])
        restored_opt.load_state_dict(got["optim"])
        assert h.last_restore == (50, "host")


RESTART = """
import json, sys, time
from tierckpt import Hierarchy

h = Hierarchy.from_yaml(sys.argv[1])
pfs = h.tier("pfs")
reads = []
real_open = pfs.open_copy
def counting_open(key):
    reads.append(key.step)
    return real_open(key)
pfs.open_copy = counting_open

t0 = time.perf_counter()
fut = h.prefetch()
time.sleep(2.0)  # model construction, NCCL init, data loader workers ...
promoted_in_time = fut.done()
t1 = time.perf_counter()
state = h.restore()
t2 = time.perf_counter()
print(json.dumps({
    "last_restore": h.last_restore, "pfs_reads": reads, "promoted_in_time": promoted_in_time,
    "prefetch_result": fut.result(), "restore_secs": t2 - t1, "step": state["step"],
    "w0": state["w"][0].item(), "tiers": {c.step: list(c.tiers) for c in h.checkpoints()},
}))
h.close()
"""


def run_py(code: str, *args: str, **kw: Any) -> subprocess.CompletedProcess[str]:
    env = {**os.environ, "PYTHONPATH": str(REPO)}
    return subprocess.run([sys.executable, "-c", textwrap.dedent(code), *args], text=True, env=env, **kw)


def test_restart_prefetches_during_init_and_restores_from_memory(
    chain_config: Callable[..., dict[str, Any]], tmp_path: Path
) -> None:
    """A job saved to host → ssd → pfs and died; it restarts on a node with an empty local SSD. The new
    process calls ``prefetch()`` first, initializes for 2 s, then ``restore()``: the bytes come from host
    memory, and the pfs was read exactly once (by the promotion)."""
    cfg_path = tmp_path / "tiers.yaml"
    cfg_path.write_text(yaml.safe_dump(chain_config(keep={"ssd": 1}, demote={"pfs": {"every": 2}})))
    with Hierarchy.from_yaml(cfg_path) as h:
        for step in range(1, 5):
            h.save({"w": torch.full((4 << 20,), float(step)), "step": step}, step=step)  # 16 MiB each
    for p in (tmp_path / "ssd").iterdir():  # the new node's SSD is empty
        shutil.rmtree(p)
    r = run_py(RESTART, str(cfg_path), capture_output=True, timeout=120)
    assert r.returncode == 0, r.stderr
    out = json.loads(r.stdout.strip().splitlines()[-1])
    assert out["last_restore"] == [4, "host"]
    assert out["pfs_reads"] == [4]
    assert out["prefetch_result"] == "host"
    assert out["step"] == 4 and out["w0"] == 4.0
    assert out["promoted_in_time"]  # 16 MiB climbs two tiers well within the 2 s of init
    assert out["tiers"]["4"] == ["host", "ssd", "pfs"]


PREEMPTED = """
import sys, time, torch
from tierckpt import Hierarchy

h = Hierarchy.from_yaml(sys.argv[1])
h.install_sigterm_handler(deadline=60)
for step in range(1, 4):
    h.save({"w": torch.full((1 << 20,), float(step)), "step": step}, step=step).wait()
print("ready", flush=True)
time.sleep(120)
print("not preempted", flush=True)
"""


@pytest.mark.skipif(not hasattr(signal, "SIGTERM"), reason="needs POSIX signals")
def test_sigterm_flushes_the_newest_checkpoint_then_terminates(
    chain_config: Callable[..., dict[str, Any]], tmp_path: Path
) -> None:
    """pfs is ``on_close`` only. On SIGTERM the handler sends the newest step there within its deadline,
    then the process dies of the signal as it would have without the handler."""
    cfg_path = tmp_path / "tiers.yaml"
    cfg_path.write_text(yaml.safe_dump(chain_config(demote={"pfs": {"on_close": True}})))
    env = {**os.environ, "PYTHONPATH": str(REPO)}
    proc = subprocess.Popen(
        [sys.executable, "-c", textwrap.dedent(PREEMPTED), str(cfg_path)],
        stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=env,
    )  # fmt: skip
    try:
        assert proc.stdout is not None
        line = proc.stdout.readline()
        assert line.strip() == "ready", proc.stderr.read() if proc.stderr else ""
        assert not list((tmp_path / "pfs").glob("step-*"))  # nothing went to the pfs before the signal
        proc.send_signal(signal.SIGTERM)
        out, err = proc.communicate(timeout=60)
    finally:
        proc.kill()
    assert proc.returncode == -signal.SIGTERM, err
    assert "not preempted" not in out
    assert "flushing checkpoints" in err
    with Hierarchy.from_yaml(cfg_path) as h:
        assert [k.step for k in h.tier("pfs").list_committed()] == [3]
        assert h.restore(tier="pfs")["step"] == 3
        assert all(e is None for _, _, e in h.verify())
