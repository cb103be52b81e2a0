"""Many ranks on one machine: tierckpt vs the raw O_DIRECT limit vs torch.distributed.checkpoint (DCP).

4 spawned gloo ranks (a forkserver; a TCPStore held by this process, as torchrun's agent does) hold an
FSDP2-sharded LLaMA-style state: every parameter a ``DTensor`` sharded on dim 0 over the 4 ranks
(``Shard(0)``, what ``fully_shard`` + ``get_state_dict`` give), bf16 weights in ``model`` and, per
parameter, an fp32 master copy and Adam's two fp32 moments in ``optim`` (14 bytes a parameter).
``--gib`` sets the total size of the state (the model's width is chosen to come closest).

Measured in one run, medians of ``--repeats``; every duration is wall time from the first rank's call
to the last rank's end (the ranks start together after a barrier), GB/s are state bytes (10^9 B):

* ``save``: ``h.save(state, step).wait()`` on a ``local`` tier, durable on every rank (the step's
  commit record written); next to fio writing the same bytes with O_DIRECT (``--ioengine=io_uring
  --direct=1 --iodepth=32 --bs=4M --numjobs=4``, fsync at the end; a Python O_DIRECT loop on 4
  threads when fio is not installed) and ``dcp.save`` with ``FileSystemWriter`` (``thread_count`` 1,
  2, 4; fsync'd files: its default).
* ``restore 4 -> 2``: fresh processes on 2 ranks, the page cache dropped before each job
  (``drop_caches`` as root, else ``posix_fadvise(DONTNEED)`` on every file, which the table says):
  ``Hierarchy(...)`` + ``h.restore(into=)`` of DTensors sharded over 2 ranks vs ``dcp.load`` of the
  FileSystemWriter checkpoint into the same targets. Both restores are checked value by value.
* ``lazy save``: how long the training thread is blocked per save: ``h.save`` returning, and
  ``handle.staged`` resolving (from when the caller may change its tensors), vs ``dcp.async_save``
  returning and its staging done (``AsyncSaveResponse.staging_completion``, where it gives one),
  for its default stager and for ``DefaultStager`` with asynchronous staging; each save is waited for
  (durable) before the next one.
* the same lazy save with a ``host`` tier above the ``local`` one (keeping the newest step), where
  ``staged`` is the copy into host memory and the disk write follows in the background.
* files and directories per checkpoint, for tierckpt's step directory and for DCP's.

    python benchmarks/bench_dist.py --gib 1.5 --repeats 3 --dir /var/tmp/bench-dist --out /tmp/dist.json
"""

from __future__ import annotations

import argparse
import gc
import json
import multiprocessing as mp
import os
import queue
import shutil
import statistics
import subprocess
import sys
import threading
import time
import traceback
from collections.abc import Callable
from datetime import UTC, datetime, timedelta
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist

GB = 1e9
VOCAB = 32000
LAYERS = 8
JOB = "bench-dist"
DCP_THREADS = (1, 2, 4)
ASYNC_CONFIGS = ("default", "async-staging")


# -- the state ----------------------------------------------------------------------------------------------
def llama_shapes(gib: float) -> list[tuple[str, tuple[int, ...]]]:
    """The parameters of a LLaMA-style model (``LAYERS`` blocks, vocabulary ``VOCAB``) whose state (14 bytes
    a parameter) comes closest to ``gib`` GiB; every first dimension divisible by 4 (and 2)."""

    def shapes(d: int) -> list[tuple[str, tuple[int, ...]]]:
        hidden = (8 * d // 3 + 63) // 64 * 64
        out: list[tuple[str, tuple[int, ...]]] = [("tok_embeddings.weight", (VOCAB, d))]
        for i in range(LAYERS):
            p = f"layers.{i}."
            out += [(p + f"attention.w{x}.weight", (d, d)) for x in "qkvo"]
            out += [(p + "feed_forward.w1.weight", (hidden, d)), (p + "feed_forward.w2.weight", (d, hidden))]
            out += [(p + "feed_forward.w3.weight", (hidden, d))]
            out += [(p + "attention_norm.weight", (d,)), (p + "ffn_norm.weight", (d,))]
        return [*out, ("norm.weight", (d,)), ("output.weight", (VOCAB, d))]

    def nbytes(d: int) -> int:
        return 14 * sum(int(torch.Size(s).numel()) for _, s in shapes(d))

    target = gib * (1 << 30)
    best = min(range(64, 8193, 64), key=lambda d: abs(nbytes(d) - target))
    return shapes(best)


def state_bytes(shapes: list[tuple[str, tuple[int, ...]]]) -> int:
    return 14 * sum(int(torch.Size(s).numel()) for _, s in shapes)


def _fill(local: torch.Tensor, row0: int, salt: int) -> torch.Tensor:
    """Values that depend on the global row and the tensor, so that a restore is checked exactly."""
    rows = (torch.arange(row0, row0 + local.shape[0], dtype=torch.float32) * 7 + salt) % 1009 - 504
    return local.copy_(rows.reshape((-1,) + (1,) * (local.dim() - 1)).expand_as(local))


def build_state(world: int, shapes: list[tuple[str, tuple[int, ...]]], fill: bool) -> dict[str, Any]:
    """This rank's part of the FSDP2 state (``get_state_dict``'s layout): each parameter a DTensor, dim 0
    sharded over ``world`` ranks; zeros when not ``fill`` (a restore's target)."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import DTensor, Shard

    mesh = init_device_mesh("cpu", (world,))
    rank = dist.get_rank()

    def dt(shape: tuple[int, ...], dtype: torch.dtype, salt: int) -> DTensor:
        rows = shape[0] // world
        local = torch.zeros((rows, *shape[1:]), dtype=dtype)
        if fill:
            _fill(local, rank * rows, salt)
        stride = torch.empty(shape, device="meta").stride()
        return DTensor.from_local(local, mesh, [Shard(0)], run_check=False, shape=torch.Size(shape), stride=stride)

    model = {n: dt(s, torch.bfloat16, i) for i, (n, s) in enumerate(shapes)}
    optim: dict[str, Any] = {}
    for i, (n, s) in enumerate(shapes):
        moments = {k: dt(s, torch.float32, 3 * i + j + 1) for j, k in enumerate(("master", "exp_avg", "exp_avg_sq"))}
        optim[n] = {"step": torch.tensor(100.0)} | moments
    groups = [{"lr": 3e-4, "betas": [0.9, 0.95], "eps": 1e-8, "weight_decay": 0.1, "params": [n for n, _ in shapes]}]
    return {"model": model, "optim": {"state": optim, "param_groups": groups}, "step": 100}


def check_state(state: dict[str, Any], shapes: list[tuple[str, tuple[int, ...]]], world: int) -> None:
    """Raise if a restored rank's part is not the saved values."""
    rank = dist.get_rank()
    for i, (n, s) in enumerate(shapes):
        rows = s[0] // world
        parts = [(state["model"][n], i)] + [
            (state["optim"]["state"][n][k], 3 * i + j + 1) for j, k in enumerate(("master", "exp_avg", "exp_avg_sq"))
        ]
        for t, salt in parts:
            local = t.to_local()
            if not torch.equal(local, _fill(torch.empty_like(local), rank * rows, salt)):
                raise AssertionError(f"rank {rank}: {n} (salt {salt}) differs after restore")
    if state["step"] != 100 or float(state["optim"]["state"][shapes[0][0]]["step"]) != 100.0:
        raise AssertionError(f"rank {rank}: plain values differ after restore")


# -- the ranks' bodies ------------------------------------------------------------------------------------------
def _hierarchy(d: Path, host: bool = False) -> Any:
    """One ``local`` tier at ``d``; with ``host``, a ``host`` tier above it (keeping the newest step)."""
    from tierckpt import Hierarchy
    from tierckpt.policies.retention import KeepLatest
    from tierckpt.tiers.host import HostTier
    from tierckpt.tiers.local import LocalTier

    if host:
        tiers = [HostTier("host"), LocalTier("ssd", d, job=JOB)]
        return Hierarchy(tiers, job=JOB, retention={"host": KeepLatest(1)})
    return Hierarchy([LocalTier("local", d, job=JOB)], job=JOB)  # the coordinator: torch.distributed's store


def _lazy(h: Any, state: dict[str, Any], step: int) -> tuple[float, ...]:
    """A lazy save: (called, returned, staged, durable on every tier and rank)."""
    dist.barrier()
    t0 = time.time()
    hd = h.save(state, step=step)
    t1 = time.time()
    hd.staged.result()
    t2 = time.time()
    hd.wait()
    return t0, t1, t2, time.time()


def _timed(fn: Callable[[], Any]) -> tuple[float, float]:
    dist.barrier()
    t0 = time.time()
    fn()
    return t0, time.time()


def _settle() -> None:
    gc.collect()
    dist.barrier()
    if dist.get_rank() == 0:
        os.sync()
    dist.barrier()


def _count(d: Path) -> tuple[int, int, int]:
    """Files, directories (``d`` itself not counted) and data files (tierckpt's blobs, DCP's ``.distcp``)
    under ``d``."""
    files = dirs = data = 0
    for _, ds, fs in os.walk(d):
        files, dirs = files + len(fs), dirs + len(ds)
        data += sum(f.startswith("blob") or f.endswith(".distcp") for f in fs)
    return files, dirs, data


def _dcp_async(state: dict[str, Any], path: Path, threads: int, config: str) -> tuple[float, float, Any]:
    """``dcp.async_save``; (returned, staged) times and what to wait on for durability."""
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.staging import DefaultStager, StagingOptions
    from torch.distributed.checkpoint.state_dict_saver import AsyncSaveResponse

    stager = None
    if config == "async-staging":  # no CUDA: no pinned or shared memory
        stager = DefaultStager(StagingOptions(False, False, True, False))
    r = dcp.async_save(state, storage_writer=dcp.FileSystemWriter(path, thread_count=threads), async_stager=stager)
    returned = time.time()
    if isinstance(r, AsyncSaveResponse):
        r.staging_completion.result()
        return returned, time.time(), r.upload_completion
    return returned, returned, r


def save_job(rank: int, world: int, scratch: str, gib: float, repeats: int) -> dict[str, Any]:
    """Every save measurement on ``world`` ranks; each timing is (start, end) on this rank."""
    import torch.distributed.checkpoint as dcp

    shapes = llama_shapes(gib)
    root = Path(scratch)
    state = build_state(world, shapes, fill=True)
    out: dict[str, Any] = {"rank": rank, "t": {}, "files": {}}

    def log(key: str, value: Any) -> None:
        out["t"].setdefault(key, []).append(value)

    def dcp_dir(name: str) -> Path:
        return root / "dcp" / name

    def drop(p: Path) -> None:
        dist.barrier()
        if rank == 0:
            shutil.rmtree(p, ignore_errors=True)

    with _hierarchy(root / "tier") as h:
        h.save(state, step=1).wait()  # warm-up: staging buffers, the engine, the job's lease
        _settle()
        dcp.save(state, storage_writer=dcp.FileSystemWriter(dcp_dir("warm")))
        drop(dcp_dir("warm"))
        for rep in range(repeats):
            _settle()
            step = 2 + 2 * rep  # the lazy save takes step + 1
            log("save/tierckpt", _timed(lambda s=step: h.save(state, step=s).wait()))
            if rank == 0 and rep == 0:
                out["files"]["tierckpt"] = _count(root / "tier" / f"step-{step:012d}")
            for n in DCP_THREADS:
                _settle()
                p = dcp_dir(f"t{n}-{rep}")
                log(
                    f"save/dcp-t{n}",
                    _timed(lambda p=p, n=n: dcp.save(state, storage_writer=dcp.FileSystemWriter(p, thread_count=n))),
                )
                if rank == 0 and rep == 0 and n == 1:
                    out["files"]["dcp"] = _count(p)
                if rep == repeats - 1 and n == 1:
                    dist.barrier()
                    if rank == 0:
                        os.replace(p, root / "dcp-ckpt")  # the one restored
                else:
                    drop(p)
            _settle()
            log("lazy/tierckpt", _lazy(h, state, step + 1))
            for cfg in ASYNC_CONFIGS:
                _settle()
                p = dcp_dir(f"async-{cfg}-{rep}")
                dist.barrier()
                t0 = time.time()
                t1, t2, fut = _dcp_async(state, p, 1, cfg)
                fut.result()
                log(f"lazy/dcp-{cfg}", (t0, t1, t2, time.time()))
                drop(p)
    with _hierarchy(root / "tier-host", host=True) as h:  # lazy saves staged in host memory
        h.save(state, step=1).wait()
        for rep in range(repeats):
            _settle()
            log("lazy/tierckpt-host", _lazy(h, state, 2 + rep))
    out["saved_step"] = 2 + 2 * (repeats - 1)
    return out


def restore_job(rank: int, world: int, scratch: str, gib: float, how: str, step: int) -> dict[str, Any]:
    """One cold restore on ``world`` ranks into DTensors sharded over them, checked value by value."""
    import torch.distributed.checkpoint as dcp

    shapes = llama_shapes(gib)
    target = build_state(world, shapes, fill=False)
    target["step"] = -1
    root = Path(scratch)

    def tierckpt() -> None:
        with _hierarchy(root / "tier") as h:  # opening the tier (listing, the job's lease) is timed too
            h.restore(step, into=target)

    def dcp_load() -> None:
        dcp.load(target, checkpoint_id=root / "dcp-ckpt")

    t = _timed(tierckpt if how == "tierckpt" else dcp_load)
    check_state(target, shapes, world)
    return {"rank": rank, "t": t}


# -- spawning ------------------------------------------------------------------------------------------------
def _entry(fn: Callable[..., Any], rank: int, world: int, port: int, args: tuple[Any, ...], q: Any) -> None:
    try:
        store = dist.TCPStore("127.0.0.1", port, is_master=False, timeout=timedelta(seconds=120))
        dist.init_process_group("gloo", store=store, rank=rank, world_size=world, timeout=timedelta(seconds=600))
        try:
            q.put((rank, fn(rank, world, *args), None))
        finally:
            dist.destroy_process_group()
    except BaseException:
        q.put((rank, None, traceback.format_exc()))


def spawn(world: int, fn: Callable[..., Any], *args: Any, limit: float = 1800) -> list[Any]:
    """``fn(rank, world, *args)`` on ``world`` fresh processes (forks of a forkserver that has imported
    torch); a new TCPStore per job, held here."""
    store = dist.TCPStore("127.0.0.1", 0, is_master=True, wait_for_workers=False, timeout=timedelta(seconds=120))
    ctx = mp.get_context("forkserver")
    ctx.set_forkserver_preload(
        ["torch", "torch.distributed.tensor", "torch.distributed.checkpoint", "tierckpt", __name__]
    )
    q = ctx.Queue()
    procs = [ctx.Process(target=_entry, args=(fn, r, world, store.port, args, q), daemon=True) for r in range(world)]
    for p in procs:
        p.start()
    got: dict[int, Any] = {}
    try:
        deadline = time.monotonic() + limit
        while len(got) < world:
            rank, res, err = q.get(timeout=max(1.0, deadline - time.monotonic()))
            if err is not None:
                raise RuntimeError(f"rank {rank} of {fn.__name__} failed:\n{err}")
            got[rank] = res
    except queue.Empty:
        raise RuntimeError(f"ranks {sorted(set(range(world)) - set(got))} did not answer in {limit} s") from None
    finally:
        for p in procs:
            p.join(30)
            if p.is_alive():
                p.kill()
    return [got[r] for r in range(world)]


# -- the raw limit -----------------------------------------------------------------------------------------------
def raw_write(d: Path, nbytes: int) -> tuple[float, str]:
    """Seconds to write ``nbytes`` with O_DIRECT, 4 writers, fsync'd; and what wrote them."""
    d.mkdir(parents=True, exist_ok=True)
    per = (nbytes // 4 + (4 << 20) - 1) // (4 << 20) * (4 << 20)
    try:
        if shutil.which("fio"):
            cmd = ["fio", "--name=raw", f"--directory={d}", "--rw=write", "--ioengine=io_uring", "--direct=1",
                   "--iodepth=32", "--bs=4M", "--numjobs=4", f"--size={per}", "--end_fsync=1", "--group_reporting",
                   "--output-format=json"]  # fmt: skip
            p = subprocess.run(cmd, capture_output=True, text=True, timeout=600, check=True)
            job = json.loads(p.stdout[p.stdout.index("{") :])["jobs"][0]
            return 4 * per / float(job["write"]["bw_bytes"]), "fio"
        return _python_direct(d, per), "python O_DIRECT"
    finally:
        shutil.rmtree(d, ignore_errors=True)


def _python_direct(d: Path, per: int) -> float:
    from tierckpt.bench.rawio import raw_write_pwrite
    from tierckpt.io.buffers import aligned_empty

    buf = aligned_empty(per)
    buf.fill_(7)
    threads = [threading.Thread(target=raw_write_pwrite, args=(d / f"raw-{i}", buf, per)) for i in range(4)]
    t0 = time.perf_counter()
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    return time.perf_counter() - t0


# -- the report --------------------------------------------------------------------------------------------------
def span(per_rank: list[tuple[float, ...]], end: int = -1) -> float:
    """First rank's start to the last rank's ``end``-th time."""
    return max(t[end] for t in per_rank) - min(t[0] for t in per_rank)


def blocked(per_rank: list[tuple[float, ...]], end: int) -> float:
    """The longest any rank waited from its call to its ``end``-th time."""
    return max(t[end] - t[0] for t in per_rank)


def summarize(saves: list[dict[str, Any]], restores: dict[str, list[float]], raw: list[float]) -> dict[str, Any]:
    keys = saves[0]["t"].keys()
    reps = len(saves[0]["t"]["save/tierckpt"])
    med: dict[str, Any] = {"raw": statistics.median(raw)}
    for k in keys:
        runs = [[r["t"][k][i] for r in saves] for i in range(reps)]
        if k.startswith("save/"):
            med[k] = statistics.median(span(x) for x in runs)
        else:
            med[k] = {
                "returned": statistics.median(blocked(x, 1) for x in runs),
                "staged": statistics.median(blocked(x, 2) for x in runs),
                "durable": statistics.median(span(x) for x in runs),
            }
    for k, v in restores.items():
        med[f"restore/{k}"] = statistics.median(v)
    return med


def table(med: dict[str, Any], nbytes: int, files: dict[str, Any], raw_how: str, cold: str) -> str:
    gbps = lambda s: nbytes / s / GB  # noqa: E731
    best_t = min(DCP_THREADS, key=lambda n: med[f"save/dcp-t{n}"])
    dcp_save = med[f"save/dcp-t{best_t}"]
    tc = med["save/tierckpt"]
    best_a = min(ASYNC_CONFIGS, key=lambda c: med[f"lazy/dcp-{c}"]["staged"])
    la, lh, da = med["lazy/tierckpt"], med["lazy/tierckpt-host"], med[f"lazy/dcp-{best_a}"]
    rt, rd = med["restore/tierckpt"], med["restore/dcp"]
    ok = lambda b: "met" if b else "missed"  # noqa: E731
    raw_name = "fio, 4 jobs, QD32, 4 MiB" if raw_how == "fio" else raw_how
    rows = [
        "| measure | tierckpt | reference | ratio | target |",
        "| --- | --- | --- | --- | --- |",
        f"| save, durable on `local`, 4 ranks | {tc:.2f} s, {gbps(tc):.2f} GB/s | raw O_DIRECT write ({raw_name}): "
        f"{med['raw']:.2f} s, {gbps(med['raw']):.2f} GB/s | {med['raw'] / tc:.0%} of raw | ≥ 90 %: {ok(med['raw'] / tc >= 0.9)} |",
        f"| save vs `dcp.save` (FileSystemWriter, best `thread_count={best_t}`) | {gbps(tc):.2f} GB/s | "
        f"{dcp_save:.2f} s, {gbps(dcp_save):.2f} GB/s | {dcp_save / tc:.2f}× | ≥ 2×: {ok(dcp_save / tc >= 2)} |",
        f"| restore 4 → 2 ranks, cold ({cold}), fresh processes | {rt:.2f} s, {gbps(rt):.2f} GB/s | `dcp.load`: "
        f"{rd:.2f} s, {gbps(rd):.2f} GB/s | {rd / rt:.2f}× | ≥ 2×: {ok(rd / rt >= 2)} |",
        f"| lazy save: training thread blocked (call returns / staged) | {la['returned'] * 1e3:.0f} ms / "
        f"{la['staged'] * 1e3:.0f} ms | `dcp.async_save` ({best_a} stager): {da['returned'] * 1e3:.0f} ms / "
        f"{da['staged'] * 1e3:.0f} ms | {la['staged'] / da['staged']:.2f}× (staged) | ≤ 0.2×: "
        f"{ok(la['staged'] <= 0.2 * da['staged'])} |",
        f"| lazy save, `host` tier above `local`: blocked (returns / staged) | {lh['returned'] * 1e3:.0f} ms / "
        f"{lh['staged'] * 1e3:.0f} ms | as above | {lh['staged'] / da['staged']:.2f}× (staged) | ≤ 0.2×: "
        f"{ok(lh['staged'] <= 0.2 * da['staged'])} |",
        f"| lazy save: until durable (`local`; `host` + `local`) | {la['durable']:.2f} s; {lh['durable']:.2f} s | "
        f"{da['durable']:.2f} s | | |",
        f"| files (data files) / directories per checkpoint, 4 ranks | {files['tierckpt'][0]} "
        f"({files['tierckpt'][2]}) / {files['tierckpt'][1]} | DCP: {files['dcp'][0]} ({files['dcp'][2]}) / "
        f"{files['dcp'][1]} | | ≤ 1 data file a rank on a shared tier |",
    ]
    detail = ", ".join(f"t={n}: {nbytes / med[f'save/dcp-t{n}'] / GB:.2f} GB/s" for n in DCP_THREADS)
    lazy = "; ".join(
        f"{c}: {med[f'lazy/dcp-{c}']['returned'] * 1e3:.0f} / {med[f'lazy/dcp-{c}']['staged'] * 1e3:.0f} ms"
        for c in ASYNC_CONFIGS
    )
    return "\n".join(
        [*rows, "", f"`dcp.save` by thread count: {detail}.", f"`dcp.async_save` returned / staged: {lazy}."]
    )


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--gib", type=float, default=1.5, help="the state's total size, all ranks (GiB)")
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--dir", type=Path, default=Path("/var/tmp/bench-dist"), help="scratch (removed first)")
    ap.add_argument("--out", type=Path, help="write the medians and every sample here (JSON)")
    return ap.parse_args(argv)


def main(argv: list[str] | None = None) -> int:
    from tierckpt.bench.system import make_cold

    args = parse_args(argv)
    shutil.rmtree(args.dir, ignore_errors=True)
    args.dir.mkdir(parents=True)
    shapes = llama_shapes(args.gib)
    nbytes = state_bytes(shapes)
    print(f"state: {len(shapes)} parameters, {nbytes / GB:.3f} GB in all, 4 ranks", flush=True)
    raw, raw_how = [], ""
    for _ in range(args.repeats):
        secs, raw_how = raw_write(args.dir / "raw", nbytes)
        raw.append(secs)
        print(f"raw write ({raw_how}): {secs:.2f} s", flush=True)
    saves = spawn(4, save_job, str(args.dir), args.gib, args.repeats)
    print("saves:", json.dumps({k: [round(span([r["t"][k][i] for r in saves]), 3) for i in range(args.repeats)]
                                for k in saves[0]["t"]}), flush=True)  # fmt: skip
    restores: dict[str, list[float]] = {"tierckpt": [], "dcp": []}
    colds = set()
    for rep in range(args.repeats):
        for how in ("tierckpt", "dcp") if rep % 2 == 0 else ("dcp", "tierckpt"):
            colds.add(make_cold([args.dir]))
            got = spawn(2, restore_job, str(args.dir), args.gib, how, saves[0]["saved_step"])
            restores[how].append(span([r["t"] for r in got]))
            print(f"restore 4 -> 2 {how}: {restores[how][-1]:.2f} s", flush=True)
    cold = "drop_caches" if colds == {"drop_caches"} else "posix_fadvise(DONTNEED); drop_caches not writable"
    med = summarize(saves, restores, raw)
    print()
    print(table(med, nbytes, saves[0]["files"], raw_how, cold))
    if args.out:
        info = {"date": datetime.now(UTC).isoformat(timespec="seconds"), "bytes": nbytes, "gib": args.gib,
                "repeats": args.repeats, "raw_how": raw_how, "cold": cold, "medians": med, "raw": raw,
                "restores": restores, "saves": saves, "files": saves[0]["files"]}  # fmt: skip
        args.out.write_text(json.dumps(info, indent=1))
    shutil.rmtree(args.dir, ignore_errors=True)
    return 0


if __name__ == "__main__":
    sys.path.insert(0, str(Path(__file__).resolve().parent))  # the ranks import this module as bench_dist
    import bench_dist

    sys.exit(bench_dist.main())
