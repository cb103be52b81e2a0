"""The restarted process of ``bench_restart.py``: one restore (or one whole restart) in a fresh process.

Run as ``python restart_child.py '<json spec>'``; prints one JSON line (the last line of stdout) with the
wall time of the operation, the CPU time this process spent in it (``getrusage(RUSAGE_SELF)``: user +
sys of every thread), its minor/major page faults, and a digest of what was restored so the parent can
check it. The parent measures the whole process from outside (``os.wait4``).

Operations (``spec["op"]``):

* ``tierckpt``: ``Hierarchy.restore(step)`` into fresh tensors;
* ``tierckpt-into``: ``restore(step, into=target)``, the target built (untimed) by ``torch.zeros`` of the
  saved shapes, as a freshly constructed model and optimizer are (their memory already written);
* ``torch``: ``torch.load(path, weights_only=True)``;
* ``dcp``: ``dcp.load(target, FileSystemReader, no_dist=True)`` into the same kind of target;
* ``raw``: the tierckpt blob files read with O_DIRECT (64 MiB reads, all queued on tierckpt's I/O engine)
  into one fresh buffer (transparent huge pages, pages not faulted in beforehand);
* ``e2e-*``: the whole restart: build the model and optimizer, restore them, run one training step.
"""

from __future__ import annotations

import json
import os
import pickle
import resource
import sys
import time
from pathlib import Path
from typing import Any

T_START = time.time()  # before torch is imported: the restart's clock starts here (and at the parent's spawn)

import torch  # noqa: E402
import xxhash  # noqa: E402
from restart_model import Llama, batch, fresh_adam_state, llm_dims  # noqa: E402

from tierckpt.bench.workloads import iter_tensors, like_state  # noqa: E402

GB = 1e9


def _faults() -> tuple[int, int]:
    """(minor, major) page faults of this process so far, from /proc/self/stat."""
    with open("/proc/self/stat") as f:
        fields = f.read().rsplit(")", 1)[1].split()
    return int(fields[7]), int(fields[9])  # minflt, majflt (fields 10 and 12 of stat(5))


def _peak_rss_kib() -> int:
    """VmHWM of this process (``ru_maxrss`` would include the memory of the parent it was forked from)."""
    with open("/proc/self/status") as f:
        return next(int(ln.split()[1]) for ln in f if ln.startswith("VmHWM:"))


def _cpu() -> float:
    ru = resource.getrusage(resource.RUSAGE_SELF)
    return ru.ru_utime + ru.ru_stime


def digest(state: Any) -> str:
    """xxh3 over the bytes of every tensor, in structure order (dict insertion order)."""
    h = xxhash.xxh3_64()
    for t in iter_tensors(state):
        if t.numel():
            h.update(t.detach().contiguous().reshape(-1).view(torch.uint8).numpy())
    return h.hexdigest()


def zeros_from(skeleton: Any) -> Any:
    """The skeleton (tensors replaced by ``(shape, dtype name)``) with ``torch.zeros`` tensors."""

    def make(obj: Any) -> Any:
        if isinstance(obj, dict):
            if obj.keys() == {"__tensor__"}:
                shape, dtype = obj["__tensor__"]
                return torch.zeros(shape, dtype=getattr(torch, dtype))
            return {k: make(v) for k, v in obj.items()}
        if isinstance(obj, list):
            return [make(v) for v in obj]
        if isinstance(obj, tuple):
            return tuple(make(v) for v in obj)
        return obj

    return make(skeleton)


def skeleton_of(state: Any) -> Any:
    """``state`` with every tensor replaced by a picklable ``{"__tensor__": (shape, dtype name)}``."""
    return like_state(state, lambda t: {"__tensor__": (tuple(t.shape), str(t.dtype).removeprefix("torch."))})


def _hierarchy(path: str) -> Any:
    from tierckpt import Hierarchy

    return Hierarchy.from_config({"tiers": [{"name": "local", "kind": "local", "path": path}]}, readonly=True)


def _copied(state: Any) -> Any:
    """``state`` with every tensor copied into a freshly allocated one (``torch.empty_like`` + ``copy_``)."""
    return like_state(state, lambda t: torch.empty_like(t).copy_(t))


def _restore_op(spec: dict[str, Any]) -> tuple[Any, dict[str, Any]]:
    """Set up (untimed), run the timed restore; (restored state, measurements)."""
    op, extra = spec["op"], {}
    target = None
    if op in ("tierckpt-into", "dcp"):
        t0 = time.perf_counter()
        with open(spec["skeleton"], "rb") as f:
            target = zeros_from(pickle.load(f))
        extra["target_secs"] = time.perf_counter() - t0
    if op in ("tierckpt", "tierckpt-into"):
        h = _hierarchy(spec["path"])
    if op == "dcp":
        import torch.distributed.checkpoint as dcp
    if op == "raw":
        from tierckpt.bench.rawio import RAW_CHUNK
        from tierckpt.io.buffers import aligned_empty
        from tierckpt.io.engine import make_engine

        engine = make_engine("auto", queue_depth=16)
        files = [Path(p) for p in spec["files"]]
        sizes = [os.path.getsize(p) for p in files]
    if spec.get("profile") and op == "tierckpt":
        import restart_profile

        restart_profile.install()
    f0, c0, t0 = _faults(), _cpu(), time.perf_counter()
    if op == "tierckpt":
        got = h.restore(step=spec["step"], tier="local")
    elif op == "tierckpt-into":
        got = h.restore(step=spec["step"], tier="local", into=target)
    elif op == "torch":
        got = torch.load(spec["path"], weights_only=True)
    elif op == "torch-mmap":  # what load_state_dict into a new model does: map the file, copy into new tensors
        got = _copied(torch.load(spec["path"], weights_only=True, mmap=True))
    elif op == "dcp":
        dcp.load(target, storage_reader=dcp.FileSystemReader(spec["path"]), no_dist=True)
        got = target
    elif op == "raw":
        buf = aligned_empty(sum(sizes), pin=False)
        futs, base = [], 0
        for p, n in zip(files, sizes):
            fd = os.open(p, os.O_RDONLY | os.O_DIRECT | os.O_CLOEXEC)
            futs += [
                (fd, engine.pread(fd, buf.data_ptr() + base + o, min(RAW_CHUNK, n - o), o))
                for o in range(0, n, RAW_CHUNK)
            ]
            base += n
        for _fd, fut in futs:
            fut.result()
        for fd in {fd for fd, _ in futs}:
            os.close(fd)
        got = None
    else:
        raise ValueError(f"unknown op {op!r}")
    secs, cpu, f1 = time.perf_counter() - t0, _cpu() - c0, _faults()
    if spec.get("profile") and op == "tierckpt":
        extra["profile"] = restart_profile.report()
    return got, {"secs": secs, "cpu": cpu, "minflt": f1[0] - f0[0], "majflt": f1[1] - f0[1], **extra}


def _e2e(spec: dict[str, Any]) -> dict[str, Any]:
    """Process start → model and optimizer built → restored → first training step done."""
    how = spec["op"].removeprefix("e2e-")
    marks = {"imported": time.time()}
    torch.manual_seed(1)  # a different init than the saved run: the restore must overwrite it
    model = Llama(llm_dims(spec["size"]))
    opt = torch.optim.AdamW(model.parameters(), lr=1e-4)
    marks["built"] = time.time()
    c0, f0 = _cpu(), _faults()
    if how == "tierckpt":  # the documented pattern: restore(into=) the live model and optimizer state
        fresh_adam_state(opt)
        target = {"model": model.state_dict(), "optim": opt.state_dict()}
        got = _hierarchy(spec["path"]).restore(step=spec["step"], into=target)
        opt.load_state_dict(got["optim"])
    elif how == "torch":
        sd = torch.load(spec["path"], weights_only=True)
        model.load_state_dict(sd["model"])
        opt.load_state_dict(sd["optim"])
        del sd
    elif how == "dcp":
        import torch.distributed.checkpoint as dcp

        fresh_adam_state(opt)
        target = {"model": model.state_dict(), "optim": opt.state_dict()}
        dcp.load(target, storage_reader=dcp.FileSystemReader(spec["path"]), no_dist=True)
        opt.load_state_dict(target["optim"])
    else:
        raise ValueError(f"unknown restart {how!r}")
    marks["restored"] = time.time()
    restore_cpu, f1 = _cpu() - c0, _faults()
    loss = torch.nn.functional.cross_entropy(
        model(batch(spec["size"])).flatten(0, 1), batch(spec["size"], shift=1).flatten()
    )
    loss.backward()
    opt.step()
    opt.zero_grad(set_to_none=True)
    marks["stepped"] = time.time()
    return {"marks": marks, "loss": float(loss), "restore_cpu": restore_cpu, "restore_minflt": f1[0] - f0[0]}


def main(spec: dict[str, Any]) -> dict[str, Any]:
    torch.set_num_threads(spec.get("threads", 2))
    if spec["op"].startswith("e2e-"):
        out = _e2e(spec)
    else:
        got, out = _restore_op(spec)
        if got is not None:
            out["digest"] = digest(got)
    out["t_start"], out["peak_rss_kib"] = T_START, _peak_rss_kib()
    return out


if __name__ == "__main__":
    print(json.dumps(main(json.loads(sys.argv[1]))), flush=True)
