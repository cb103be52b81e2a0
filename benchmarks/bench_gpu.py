"""The gpu tier on a CUDA device: how long training waits, how long until durable, how fast a restore
lands back in device memory, next to torch.save / torch.load and torch.distributed.checkpoint.

Usage::

    python benchmarks/bench_gpu.py [--quick] [--repeats 3] [--dir SCRATCH] [--out results.json]

Each workload's state is built on the GPU (``llm``: bf16 params, fp32 master weights and Adam moments,
about 1.6 GB; ``small``: 20,000 tensors of 1-64 KiB). Per repeat, in the same run:

* ``gpu->host->ssd``: a hierarchy whose top tier is ``gpu``. ``stall`` is the time until ``staged``
  (the device-to-device snapshot: what training waits for); ``durable`` until the ``ssd`` tier committed.
* ``host->ssd``: the top tier is pinned host memory: ``stall`` includes the device-to-host copy.
* ``ssd``: one ``local`` tier, saved straight from device memory (``stall`` = ``durable``).
* ``torch.save``: ``torch.save`` of the device state + fsync (the whole thing is the stall).
* ``dcp.save``: ``torch.distributed.checkpoint.save`` with ``FileSystemWriter`` (one process).
* ``d2h copy``: ``tensor.cpu()`` for every tensor: the bare cost of leaving the device.

Restores go into the live device state (``restore(into=...)``, what a restart does): from the gpu tier,
from host memory, and from the ssd tier with a cold page cache; next to ``torch.load(map_location=
"cuda")`` + ``copy_`` and ``dcp.load``, both cold. Every restore is checked bit for bit.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import tempfile
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch

from tierckpt import Hierarchy
from tierckpt.bench.system import make_cold
from tierckpt.bench.workloads import LLM_FULL, LLM_QUICK, like_state, make_llm_state, make_small_state, state_bytes

GB = 1e9
GiB = 1 << 30


def _on(state: Any, device: str) -> Any:
    return like_state(state, lambda t: t.to(device))


def _same(a: Any, b: Any) -> bool:
    if isinstance(a, torch.Tensor):
        b = b.to(a.device)
        return (
            a.dtype == b.dtype
            and a.shape == b.shape
            and torch.equal(a.view(-1).view(torch.uint8), b.reshape(-1).view(torch.uint8))
        )
    if isinstance(a, dict):
        return a.keys() == b.keys() and all(_same(a[k], b[k]) for k in a)
    if isinstance(a, (list, tuple)):
        return len(a) == len(b) and all(_same(x, y) for x, y in zip(a, b))
    return bool(a == b)


def _copy_into(dst: Any, src: Any) -> None:
    if isinstance(dst, torch.Tensor):
        dst.copy_(src, non_blocking=True)
    elif isinstance(dst, dict):
        for k in dst:
            _copy_into(dst[k], src[k])


def _fsync_tree(root: Path) -> None:
    for p in root.rglob("*"):
        if p.is_file():
            fd = os.open(p, os.O_RDONLY)
            try:
                os.fsync(fd)
            finally:
                os.close(fd)


def _hierarchy(kind: str, root: Path, nbytes: int) -> Hierarchy:
    cap = f"{max(2 * nbytes, 1 << 30)}B"
    tiers: list[dict[str, Any]] = []
    if kind.startswith("gpu"):
        tiers.append({"name": "gpu", "kind": "gpu", "capacity": cap})
    if "host" in kind:
        tiers.append({"name": "host", "kind": "host", "capacity": cap})
    tiers.append({"name": "ssd", "kind": "local", "path": str(root / "ssd")})
    keep = {t["name"]: 1 for t in tiers if t["name"] != "ssd"}
    return Hierarchy.from_config({"tiers": tiers, "policy": {"keep": keep}})


class Run:
    def __init__(self, name: str, state: Any, scratch: Path) -> None:
        self.name, self.state, self.scratch = name, state, scratch
        self.nbytes, self.ntensors = state_bytes(state)
        self.times: dict[str, list[float]] = {}
        self.errors: dict[str, str] = {}

    def record(self, op: str, fn: Callable[[], float | None]) -> None:
        torch.cuda.synchronize()
        t0 = time.perf_counter()
        try:
            got = fn()
        except Exception as e:  # a benchmark reports a failing operation and goes on with the others
            self.errors[op] = f"{type(e).__name__}: {e}"
            return
        torch.cuda.synchronize()
        self.times.setdefault(op, []).append(got if got is not None else time.perf_counter() - t0)

    def fresh(self, sub: str) -> Path:
        d = self.scratch / sub
        shutil.rmtree(d, ignore_errors=True)
        d.mkdir(parents=True)
        return d

    def tierckpt(self, kind: str, step: int) -> None:
        root = self.fresh(kind.replace(">", "_").replace("-", ""))
        with _hierarchy(kind, root, self.nbytes) as h:
            t0 = time.perf_counter()
            handle = h.save(self.state, step=step)
            handle.staged.result()
            stall = time.perf_counter() - t0
            handle.wait()
            durable = time.perf_counter() - t0
            self.times.setdefault(f"save {kind} stall", []).append(stall)
            self.times.setdefault(f"save {kind} durable", []).append(durable)
            live = like_state(self.state, torch.zeros_like)
            for tier in [t.name for t in h.tiers]:
                if tier == "ssd":
                    make_cold([root / "ssd"])
                torch.cuda.synchronize()
                t0 = time.perf_counter()
                got = h.restore(step=step, tier=tier, into=live)
                torch.cuda.synchronize()
                self.times.setdefault(f"restore {kind} from {tier}", []).append(time.perf_counter() - t0)
                if not _same(self.state, got):
                    self.errors[f"restore {kind} from {tier}"] = "restored bytes differ"
                live = like_state(self.state, torch.zeros_like)

    def peers(self) -> None:
        root = self.fresh("torchsave")
        path = root / "state.pt"

        def tsave() -> None:
            with open(path, "wb") as f:
                torch.save(self.state, f)
                f.flush()
                os.fsync(f.fileno())

        self.record("save torch.save", tsave)
        self.record("d2h copy", lambda: like_state(self.state, lambda t: t.cpu()) and None)
        live = like_state(self.state, torch.zeros_like)
        make_cold([path])

        def tload() -> None:
            _copy_into(live, torch.load(path, map_location="cuda", weights_only=True))

        self.record("restore torch.load(cuda)+copy", tload)
        if not _same(self.state, live):
            self.errors["restore torch.load(cuda)+copy"] = "restored bytes differ"
        import torch.distributed.checkpoint as dcp

        droot = self.fresh("dcp")
        self.record(
            "save dcp.save",
            lambda: (
                dcp.save(self.state, storage_writer=dcp.FileSystemWriter(str(droot), thread_count=8), no_dist=True)
                and None
            ),
        )
        live = like_state(self.state, torch.zeros_like)
        make_cold([droot])
        self.record(
            "restore dcp.load", lambda: dcp.load(live, storage_reader=dcp.FileSystemReader(str(droot)), no_dist=True)
        )
        if "restore dcp.load" not in self.errors and not _same(self.state, live):
            self.errors["restore dcp.load"] = "restored bytes differ"


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--quick", action="store_true", help="small sizes (a smoke run)")
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--dir", type=Path, default=None, help="scratch directory (default: a temporary one)")
    p.add_argument("--out", type=Path, default=None, help="write the medians as JSON here")
    p.add_argument("--workloads", default="llm,small")
    a = p.parse_args(argv)
    if not torch.cuda.is_available():
        print("bench_gpu: no CUDA device; nothing to measure")
        return 0
    scratch = Path(tempfile.mkdtemp(prefix="bench-gpu-", dir=a.dir))
    results: dict[str, Any] = {"device": torch.cuda.get_device_name(), "torch": torch.__version__}
    try:
        for wl in a.workloads.split(","):
            cpu = (
                make_llm_state(LLM_QUICK if a.quick else LLM_FULL)
                if wl == "llm"
                else make_small_state(500 if a.quick else 20_000)
            )
            run = Run(wl, _on(cpu, "cuda"), scratch / wl)
            del cpu
            for r in range(a.repeats):
                for kind in ("gpu>host>ssd", "host>ssd", "ssd"):
                    run.tierckpt(kind, step=r + 1)
                run.peers()
            med = {op: statistics.median(ts) for op, ts in run.times.items()}
            results[wl] = {"bytes": run.nbytes, "tensors": run.ntensors, "median_s": med, "errors": run.errors}
            print(f"\n{wl}: {run.nbytes / GB:.2f} GB in {run.ntensors} tensors, {a.repeats} repeats (medians)")
            for op, s in med.items():
                print(f"  {op:40s} {s:8.3f} s  {run.nbytes / GB / s:7.2f} GB/s")
            for op, e in run.errors.items():
                print(f"  FAILED {op}: {e}")
    finally:
        shutil.rmtree(scratch, ignore_errors=True)
    if a.out:
        a.out.write_text(json.dumps(results, indent=1))
    return 1 if any(results[w]["errors"] for w in a.workloads.split(",")) else 0


if __name__ == "__main__":
    raise SystemExit(main())
