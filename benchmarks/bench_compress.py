"""Compression ratios and speeds per tensor kind (issue 30): plain zstd against byte-grouped zstd (the codec of
compressed tier copies), and DCP's ZStandard stream extension, on two training states.

Usage::

    python benchmarks/bench_compress.py --out compress.json      # ~256 MB llm state + the trained model
    python benchmarks/bench_compress.py --quick                  # ~51 MB llm state, 100 training steps

Sources:

* ``llm``: the synthetic LLaMA-style state of tierckpt/bench/workloads.py (bf16 weights, fp32 master
  weights and Adam moments drawn from normal and uniform distributions), with the int64 and bool tensors
  of its ``small`` workload (random bytes).
* ``trained``: a byte-level GPT (the model of ``train_workload.py``: 4 layers of 256, about 3.3 M
  parameters) trained here with AdamW for ``--steps`` steps (300) on the Python standard library's
  ``.py`` files (no network), on two torch threads: 0.2-1.5 s a step on this machine depending on what
  else runs, so 1-8 minutes on the first run; the state is then kept in ``--cache``, outside the
  repository. Kinds: its fp32 master weights, their bf16 copy, Adam's two moments; int64: a data
  loader's buffer of token ids (2 M tokens of the corpus); bool: GPT-2-style causal mask buffers (one
  1024 × 1024 lower triangle per layer).

Each kind's tensors are laid end to end and cut into 4 MiB frames, as a compressed tier copy cuts a
blob. Methods:

* ``zstd-L``: one zstd frame of each frame's raw bytes at level L (checksum and content size on, as the
  codec writes them).
* ``grouped-L, all planes``: :func:`tierckpt.format.codec.encode_frame` with width = the element size
  (2, 4 or 8; one stream for bool), as the compression policy picks it, every plane tried; a plane is
  kept compressed where zstd makes it < 97 % of its bytes, else stored raw. "planes" gives each plane's
  stored fraction (``raw``: left raw in most frames), lowest byte first. This is a probe frame.
* ``grouped-1, chosen planes``: trying only the planes kept compressed above (what ``auto`` and ``zstd``
  do between probes). Decode: :func:`~tierckpt.format.codec.decode_frame` of the grouped-1 frames.
* ``dcp-zstd``: ``torch.distributed.checkpoint`` saving the kind's tensors through
  ``FileSystemWriter(..., _extensions=[ZStandard()])`` (zstd's default level 3 over each file's
  stream) into /dev/shm: the ratio of its data files' bytes without and with the extension, and raw
  MiB per CPU second of the whole compressed save (the process's CPU time).

Speeds are raw MiB per second of the encoding thread's CPU time (``time.thread_time``; every method
runs on one thread), the median of ``--repeats`` runs (more for a kind under ``--sample-mib``, 64,
so that each sample covers as much): the speed of one core whatever else runs on the machine (wall time would count
the waits for a CPU; a busy VM still moves it, through steal time and shared caches). Results: a
markdown table on stdout, JSON in ``--out``.
"""

from __future__ import annotations

import argparse
import json
import shutil
import statistics
import sys
import sysconfig
import tempfile
import time
import warnings
from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np
import torch
import torch.nn.functional as F
import zstandard

from tierckpt.bench.system import machine_info
from tierckpt.bench.workloads import LLM_QUICK, llm_dims_for, make_llm_state, make_small_state
from tierckpt.format.codec import decode_frame, encode_frame
from tierckpt.format.frames import Frame

if str(Path(__file__).resolve().parent) not in sys.path:  # the sibling modules, when imported from elsewhere
    sys.path.insert(0, str(Path(__file__).resolve().parent))
from train_workload import GPT, GPTDims

FRAME = 4 << 20
MIB = 1 << 20
LEVELS = (1, 3)
GPT_DIMS = GPTDims(vocab=256, dim=256, layers=4, heads=4, batch=16, seq=128)
KINDS = ("bf16 weights", "fp32 master weights", "Adam exp_avg", "Adam exp_avg_sq", "int64", "bool")
Kinds = dict[str, list[torch.Tensor]]


# -- the trained model ----------------------------------------------------------------------------------
def corpus(limit: int) -> torch.Tensor:
    """The standard library's ``.py`` files (no site-packages), sorted, concatenated: up to ``limit`` bytes."""
    root = Path(sysconfig.get_paths()["stdlib"])
    out, n = [], 0
    for p in sorted(root.rglob("*.py")):
        if "site-packages" in p.parts or n >= limit:
            continue
        data = p.read_bytes()
        out.append(data)
        n += len(data)
    return torch.frombuffer(bytearray(b"".join(out)[:limit]), dtype=torch.uint8).long()


def train_gpt(steps: int, seed: int = 0, log: Callable[[str], None] = print) -> dict[str, Any]:
    """Train the byte-level GPT with AdamW (warm-up, then cosine decay) for ``steps`` steps; return its
    state: fp32 weights, bf16 copy, Adam moments, a token buffer and causal masks."""
    torch.set_num_threads(2)
    torch.manual_seed(seed)
    data = corpus(16 * MIB)
    model = GPT(GPT_DIMS)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3, betas=(0.9, 0.95), weight_decay=0.1)
    sched = torch.optim.lr_scheduler.LambdaLR(
        opt, lambda s: min(1.0, (s + 1) / 50) * 0.5 * (1 + np.cos(np.pi * min(s, steps) / steps))
    )
    g = torch.Generator().manual_seed(seed)
    d, t0 = GPT_DIMS, time.perf_counter()
    for step in range(steps):
        starts = torch.randint(0, len(data) - d.seq - 1, (d.batch,), generator=g)
        batch = torch.stack([data[s : s + d.seq + 1] for s in starts.tolist()])
        loss = F.cross_entropy(model(batch[:, :-1]).reshape(-1, d.vocab), batch[:, 1:].reshape(-1))
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        sched.step()
        opt.zero_grad(set_to_none=True)
        if step % 100 == 0 or step == steps - 1:
            log(f"  step {step:4d}  loss {loss.item():.3f}  ({time.perf_counter() - t0:.0f} s)")
    names = [n for n, _ in model.named_parameters()]
    moments = [opt.state[p] for p in model.parameters()]
    return {
        "loss": loss.item(),
        "seconds": time.perf_counter() - t0,
        "steps": steps,
        "master": {n: p.detach().clone() for n, p in zip(names, model.parameters())},
        "exp_avg": {n: m["exp_avg"].clone() for n, m in zip(names, moments)},
        "exp_avg_sq": {n: m["exp_avg_sq"].clone() for n, m in zip(names, moments)},
        "tokens": data[: 2 * MIB].clone(),  # int64
    }


def trained_kinds(cache: Path, steps: int) -> tuple[Kinds, dict[str, Any]]:
    """The trained model's kinds, trained now or loaded from ``cache``."""
    path = cache / f"gpt-{GPT_DIMS.dim}x{GPT_DIMS.layers}-{steps}steps.pt"
    if path.exists():
        state = torch.load(path, weights_only=True)
        print(f"trained model: loaded {path}", file=sys.stderr)
    else:
        print(f"trained model: training {steps} steps (cached in {path})", file=sys.stderr)
        state = train_gpt(steps, log=lambda s: print(s, file=sys.stderr))
        cache.mkdir(parents=True, exist_ok=True)
        torch.save(state, path)
    master = list(state["master"].values())
    mask = torch.ones(1024, 1024, dtype=torch.bool).tril()
    kinds = {
        "bf16 weights": [t.to(torch.bfloat16) for t in master],
        "fp32 master weights": master,
        "Adam exp_avg": list(state["exp_avg"].values()),
        "Adam exp_avg_sq": list(state["exp_avg_sq"].values()),
        "int64": [state["tokens"]],
        "bool": [mask.clone() for _ in range(GPT_DIMS.layers)],
    }
    info = {"steps": state["steps"], "final_loss": state["loss"], "train_seconds": state["seconds"]}
    info["params"] = sum(t.numel() for t in master)
    return kinds, info


def llm_kinds(target_bytes: int) -> tuple[Kinds, dict[str, Any]]:
    """The ``llm`` workload's kinds (int64 and bool from the ``small`` workload)."""
    dims = llm_dims_for(target_bytes) if target_bytes > LLM_QUICK.state_bytes() else LLM_QUICK
    state = make_llm_state(dims)
    optim = state["optim"]["state"].values()
    small = [t for block in make_small_state(2000, seed=1).values() for t in block.values()]
    kinds = {
        "bf16 weights": list(state["model"].values()),
        "fp32 master weights": [s["master"] for s in optim],
        "Adam exp_avg": [s["exp_avg"] for s in optim],
        "Adam exp_avg_sq": [s["exp_avg_sq"] for s in optim],
        "int64": [t for t in small if t.dtype == torch.int64],
        "bool": [t for t in small if t.dtype == torch.bool],
    }
    return kinds, {"dims": vars(dims), "state_bytes": dims.state_bytes()}


# -- measuring ------------------------------------------------------------------------------------------
def laid_out(tensors: list[torch.Tensor]) -> memoryview:
    """The tensors' bytes end to end, as a blob holds them."""
    flat = torch.cat([t.contiguous().reshape(-1).view(torch.uint8) for t in tensors])
    return memoryview(flat.numpy()).cast("B")


def plain(buf: memoryview, level: int) -> dict[str, Any]:
    """One zstd frame per 4 MiB frame (the codec's settings: checksum and content size on)."""
    z = zstandard.ZstdCompressor(level=level, write_checksum=True, write_content_size=True)
    stored, secs = 0, 0.0
    for k in range(0, len(buf), FRAME):
        t = time.thread_time()
        stored += len(z.compress(buf[k : k + FRAME]))
        secs += time.thread_time() - t
    return {"ratio": len(buf) / stored, "mib_s": len(buf) / MIB / secs}


def grouped(buf: memoryview, width: int, level: int, try_planes: int, decode: bool = False) -> dict[str, Any]:
    """:func:`encode_frame` per frame, trying the planes of ``try_planes``; the planes' stored fractions
    where kept, and ``chosen``: the planes kept compressed in most of the bytes (the policy's choice)."""
    stored, secs, dsecs = 0, 0.0, 0.0
    kept_raw, kept_stored, planes_raw = np.zeros(max(1, width)), np.zeros(max(1, width)), np.zeros(max(1, width))
    out = bytearray(FRAME)
    for k in range(0, len(buf), FRAME):
        raw = buf[k : k + FRAME]
        t = time.thread_time()
        enc = encode_frame(raw, width, try_planes, level)
        secs += time.thread_time() - t
        stored += enc.stored_len
        if len(enc.plane_raw) == len(planes_raw):
            planes_raw += enc.plane_raw
            for p in range(len(planes_raw)):
                if enc.planes >> p & 1:
                    kept_raw[p] += enc.plane_raw[p]
                    kept_stored[p] += enc.lengths[p] if enc.width >= 2 else enc.stored_len
        if decode:
            frame = Frame(k, len(raw), 0, enc.width, enc.planes, enc.lengths)
            view = memoryview(out)[: len(raw)]
            blob = b"".join(enc.streams)
            t = time.thread_time()
            decode_frame(memoryview(blob), frame, view)
            dsecs += time.thread_time() - t
            if view != raw:
                raise AssertionError(f"frame at {k} did not decode to its bytes")
    # a plane counts as compressed where most of its bytes were kept compressed
    fractions = [
        round(float(s / r), 3) if r > planes_raw[p] / 2 else "raw"
        for p, (r, s) in enumerate(zip(kept_raw, kept_stored))
    ]
    chosen = sum(1 << p for p, f in enumerate(fractions) if f != "raw")
    res = {
        "ratio": len(buf) / stored,
        "mib_s": len(buf) / MIB / secs,
        "width": width,
        "planes": fractions,
        "chosen": chosen,
    }
    if decode:
        res["decode_mib_s"] = len(buf) / MIB / dsecs
    return res


def dcp_zstd(tensors: list[torch.Tensor], scratch: Path) -> dict[str, Any] | None:
    """DCP's ZStandard extension: data files' bytes without / with it, and the compressed save's rate."""
    try:
        import torch.distributed.checkpoint as dcp
        from torch.distributed.checkpoint._extension import ZStandard
    except ImportError:
        return None
    state = {f"t{i}": t for i, t in enumerate(tensors)}
    sizes, secs = {}, 0.0
    for name, ext in (("plain", None), ("zstd", [ZStandard()])):
        where = scratch / name
        shutil.rmtree(where, ignore_errors=True)
        writer = dcp.FileSystemWriter(where, thread_count=1, _extensions=ext)
        t = time.process_time()
        with warnings.catch_warnings():  # "torch.distributed is disabled ...: a single process": it is
            warnings.simplefilter("ignore", UserWarning)
            dcp.save(state, storage_writer=writer)
        secs = time.process_time() - t
        sizes[name] = sum(p.stat().st_size for p in where.glob("*.distcp"))
        shutil.rmtree(where)
    raw = sum(t.numel() * t.element_size() for t in tensors)
    return {"ratio": sizes["plain"] / sizes["zstd"], "mib_s": raw / MIB / secs, "files_bytes": sizes}


def median_of(repeats: int, run: Callable[..., dict[str, Any]], *args: Any) -> dict[str, Any]:
    """``run(*args)`` ``repeats`` times: the first result, with the median of each speed."""
    results = [run(*args) for _ in range(repeats)]
    first = results[0]
    for key in ("mib_s", "decode_mib_s"):
        if key in first:
            first[key] = statistics.median(r[key] for r in results)
    return first


def measure(kinds: Kinds, scratch: Path, dcp: bool, runs: int, sample: int) -> dict[str, Any]:
    out: dict[str, Any] = {}
    for kind in KINDS:
        tensors = kinds[kind]
        buf = laid_out(tensors)
        size = tensors[0].element_size()
        width = size if size in (2, 4, 8) else 1
        row: dict[str, Any] = {"raw_mib": len(buf) / MIB, "dtype": str(tensors[0].dtype).removeprefix("torch.")}
        every = (1 << width) - 1
        repeats = max(runs, -(-runs * sample // len(buf)))  # small kinds: more runs, so a sample is long enough
        for level in LEVELS:
            row[f"zstd-{level}"] = median_of(repeats, plain, buf, level)
            row[f"grouped-{level}"] = median_of(repeats, grouped, buf, width, level, every, level == 1)
        chosen = row["grouped-1"]["chosen"]
        row["grouped-1-chosen"] = median_of(repeats, grouped, buf, width, 1, chosen) if chosen else None
        if dcp:
            row["dcp-zstd"] = dcp_zstd(tensors, scratch)
        row["runs"] = repeats
        out[kind] = row
        print(f"  {kind}: done", file=sys.stderr)
    return out


# -- report ---------------------------------------------------------------------------------------------
def _cell(m: dict[str, Any] | None) -> str:
    return "–" if m is None else f"{m['ratio']:.3f}× · {m['mib_s']:.0f}"


def report(results: dict[str, Any]) -> str:
    lines = []
    for source, res in results["sources"].items():
        lines += [
            f"\n**{source}** ({res['about']})\n",
            "| kind | raw MiB | zstd-1 | zstd-3 | grouped-1, all planes | grouped-1, chosen planes | grouped-3, all planes "
            "| planes: stored fraction | grouped-1 decode MiB/s | dcp-zstd |",
            "| --- | ---: | ---: | ---: | ---: | ---: | ---: | --- | ---: | ---: |",
        ]
        for kind, row in res["kinds"].items():
            g1 = row["grouped-1"]
            planes = ", ".join(str(f) for f in g1["planes"]) if g1["width"] >= 2 else "(one stream)"
            lines.append(
                f"| {kind} ({row['dtype']}) | {row['raw_mib']:.1f} | {_cell(row['zstd-1'])} | {_cell(row['zstd-3'])} "
                f"| {_cell(g1)} | {_cell(row['grouped-1-chosen'])} | {_cell(row['grouped-3'])} | {planes} "
                f"| {g1['decode_mib_s']:.0f} | {_cell(row.get('dcp-zstd'))} |"
            )
    lines.append(
        "\nCells: ratio (raw / stored) · raw MiB per CPU second (encoding on one thread; dcp-zstd: the whole save)."
    )
    return "\n".join(lines)


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0], formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument("--quick", action="store_true", help="the ~51 MB llm state and 100 training steps")
    p.add_argument("--llm-size", type=int, default=256, help="MB of llm state (default 256)")
    p.add_argument("--steps", type=int, default=None, help="training steps (default 300; --quick 100)")
    p.add_argument(
        "--cache", type=Path, default=Path.home() / ".cache" / "tierckpt-bench", help="where the trained state is kept"
    )
    p.add_argument("--no-dcp", action="store_true", help="skip DCP's ZStandard extension")
    p.add_argument("--repeats", type=int, default=3, help="runs of each method; speeds are their median (3)")
    p.add_argument("--sample-mib", type=int, default=64, help="a smaller kind runs more often, to cover this (64)")
    p.add_argument("--out", type=Path, default=None, help="JSON results")
    args = p.parse_args(argv)
    if args.steps is None:
        args.steps = 100 if args.quick else 300
    return args


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    torch.set_num_threads(2)
    llm, llm_info = llm_kinds(LLM_QUICK.state_bytes() if args.quick else args.llm_size * 10**6)
    trained, trained_info = trained_kinds(args.cache, args.steps)
    shm = Path("/dev/shm") if Path("/dev/shm").is_dir() else None
    with tempfile.TemporaryDirectory(prefix="bench-compress-", dir=shm) as scratch:
        results: dict[str, Any] = {"machine": machine_info(Path(scratch)), "frame_bytes": FRAME, "sources": {}}
        for name, kinds, info, about in (
            ("llm", llm, llm_info, "synthetic: normal/uniform draws; int64 and bool: random bytes"),
            (
                "trained",
                trained,
                trained_info,
                f"byte-level GPT, {trained_info['params'] / 1e6:.1f} M params, {trained_info['steps']} AdamW steps on stdlib .py, "
                f"loss {trained_info['final_loss']:.2f}",
            ),
        ):
            print(f"{name}:", file=sys.stderr)
            results["sources"][name] = {
                "about": about,
                "info": info,
                "kinds": measure(kinds, Path(scratch), not args.no_dcp, args.repeats, args.sample_mib * MIB),
            }
    print(report(results))
    if args.out:
        args.out.write_text(json.dumps(results, indent=1, default=str))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
