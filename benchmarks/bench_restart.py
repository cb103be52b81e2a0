"""The restart, measured as a restart: every restore runs in a NEW process, cold page cache, its memory
not faulted in yet; once on a quiet machine and once with one core kept busy by a neighbour.

Usage::

    python benchmarks/bench_restart.py [--quick] [--repeats 3] [--out DIR] [--dir SCRATCH] [--profile]

Restores of the ``llm`` state (~1.6 GB, tierckpt/bench/workloads.py), each in a fresh process
(``restart_child.py``): tierckpt ``restore()`` into fresh tensors, ``restore(into=)`` a freshly built
target, ``torch.load``, ``dcp.load``, the raw O_DIRECT read of the same bytes (tierckpt's blob files),
and fio. Then the end-to-end restart a user sees (process start → model and optimizer built and
restored → first training step done) for tierckpt, torch.save/torch.load and DCP. Operations are
interleaved per repeat, order rotated. Medians, GB/s, ratios to raw and torch.load, and CPU-seconds
per GB (the operation's own ``getrusage``, and the whole process's from ``wait4``). See docs/benchmarks.md.
"""

from __future__ import annotations

import argparse
import gc
import json
import os
import pickle
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import torch
from restart_child import digest, skeleton_of
from restart_model import Llama, batch, llm_dims
from restart_report import report

from tierckpt import Hierarchy
from tierckpt.bench.rawio import fio_available, run_fio
from tierckpt.bench.system import machine_info, make_cold, read_text
from tierckpt.bench.workloads import make_llm_state, state_bytes

HERE = Path(__file__).resolve().parent
OPS = ("raw", "tierckpt", "tierckpt-into", "torch", "torch-mmap", "dcp")
RESTARTS = ("tierckpt", "torch", "dcp")
REPORTED = Path("/sys/module/page_reporting/parameters/reported_kib")  # this VM's free page reporting counter
SPIN = "import os, sys\nos.sched_setaffinity(0, {int(sys.argv[1])})\nwhile True:\n    pass\n"


class Bench:
    """Checkpoints written once (``setup``), then restored by child processes (``run``)."""

    def __init__(self, args: argparse.Namespace, scratch: Path, out: Path) -> None:
        self.args, self.scratch = args, scratch
        self.size = "quick" if args.quick else "full"
        stamp = time.strftime("%Y%m%d-%H%M%S")
        self.jsonl, self.md = out / f"restart-{stamp}.jsonl", out / f"restart-{stamp}.md"
        self.records: list[dict[str, Any]] = []
        self.cold_methods: set[str] = set()

    def emit(self, rec: dict[str, Any]) -> None:
        self.records.append(rec)
        with self.jsonl.open("a") as f:
            f.write(json.dumps(rec) + "\n")

    # -- setup (untimed) -----------------------------------------------------------------------------------
    def setup(self) -> None:
        s = self.scratch
        state = make_llm_state(llm_dims(self.size))
        self.nbytes, ntensors = state_bytes(state)
        self.ref = digest(state)
        h = Hierarchy.from_config({"tiers": [{"name": "local", "kind": "local", "path": str(s / "tierckpt")}]})
        h.save(state, step=1, blocking=True)
        h.close()
        self.blobs = sorted((s / "tierckpt").rglob("blob-*.bin"))
        self.raw_bytes = sum(p.stat().st_size for p in self.blobs)
        with open(s / "torch.pt", "wb") as f:
            torch.save(state, f)
            f.flush()
            os.fsync(f.fileno())
        import torch.distributed.checkpoint as dcp

        dcp.save(state, storage_writer=dcp.FileSystemWriter(str(s / "dcp")), no_dist=True)
        with open(s / "skeleton.pkl", "wb") as f:
            pickle.dump(skeleton_of(state), f)
        del state
        self.emit({"kind": "setup", "size": self.size, "state_bytes": self.nbytes, "tensors": ntensors,
                   "blob_files": len(self.blobs), "blob_bytes": self.raw_bytes})  # fmt: skip
        if self.args.restarts:
            self.setup_e2e()
        gc.collect()

    def setup_e2e(self) -> None:
        """A trained model + AdamW (one step, so the optimizer has state), saved the three ways; the loss
        the next step computes is what every restart's first step must compute."""
        s = self.scratch / "e2e"
        torch.manual_seed(0)
        torch.set_num_threads(2)
        model = Llama(llm_dims(self.size))
        opt = torch.optim.AdamW(model.parameters(), lr=1e-4)
        self._step(model, opt)
        state = {"model": model.state_dict(), "optim": opt.state_dict()}
        h = Hierarchy.from_config({"tiers": [{"name": "local", "kind": "local", "path": str(s / "tierckpt")}]})
        h.save(state, step=1, blocking=True)
        h.close()
        with open(s / "torch.pt", "wb") as f:
            torch.save(state, f)
            f.flush()
            os.fsync(f.fileno())
        import torch.distributed.checkpoint as dcp

        dcp.save(state, storage_writer=dcp.FileSystemWriter(str(s / "dcp")), no_dist=True)
        self.e2e_bytes = state_bytes(state)[0]
        self.e2e_loss = self._step(model, opt)
        self.emit({"kind": "setup_e2e", "state_bytes": self.e2e_bytes, "params": sum(p.numel() for p in model.parameters()),
                   "next_loss": self.e2e_loss})  # fmt: skip

    def _step(self, model: Llama, opt: torch.optim.Optimizer) -> float:
        loss = torch.nn.functional.cross_entropy(
            model(batch(self.size)).flatten(0, 1), batch(self.size, shift=1).flatten()
        )
        loss.backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
        return float(loss)

    # -- runs ----------------------------------------------------------------------------------------------
    def cold(self) -> None:
        self.cold_methods.add(make_cold([self.scratch], self.args.cold))

    def settle(self) -> dict[str, float]:
        """Wait (at most ``--settle`` s) until the memory freed by the last process has gone back to the host.

        On a VM with free page reporting (virtio-balloon), freed guest memory is handed back to the host
        within seconds, and the next first touch of it costs a host fault (~1 CPU-s/GB here, against
        ~0.1 for the guest's own zeroing). A process started right after another one exited gets memory
        still backed and faults it in several times faster: without this wait, whichever operation runs
        first after a big free looks cheap. Waiting gives every process never-touched memory, as a
        restarting job on this VM gets. Where the counter is absent, nothing is waited for.
        """
        if not REPORTED.exists() or self.args.settle <= 0:
            return {}
        t0, last, since = time.monotonic(), int(REPORTED.read_text()), time.monotonic()
        start = last
        while (
            time.monotonic() - t0 < self.args.settle and time.monotonic() - since < 3.0
        ):  # reporting runs 2 s after a free
            time.sleep(0.25)
            now = int(REPORTED.read_text())
            if now != last:
                last, since = now, time.monotonic()
        return {"settle_secs": time.monotonic() - t0, "reported_mib": (last - start) / 1024}

    def child(self, spec: dict[str, Any]) -> dict[str, Any]:
        """Run one restarted process; its JSON line plus ``proc_*`` (whole process, from outside)."""
        self.cold()
        settled = self.settle()
        log = self.scratch / "child.log"
        with log.open("w") as err:
            t0 = time.time()
            p = subprocess.Popen([sys.executable, str(HERE / "restart_child.py"), json.dumps(spec)],
                                 stdout=subprocess.PIPE, stderr=err, text=True)  # fmt: skip
            stdout = p.stdout.read() if p.stdout else ""
            _, status, ru = os.wait4(p.pid, 0)
            p.returncode = os.waitstatus_to_exitcode(status)
            wall = time.time() - t0
        if p.returncode != 0:
            raise RuntimeError(f"restart child {spec['op']} failed ({p.returncode}):\n{log.read_text()[-4000:]}")
        out = json.loads(stdout.strip().splitlines()[-1])
        out.update(t_spawn=t0, proc_wall=wall, proc_cpu=ru.ru_utime + ru.ru_stime, **settled)
        return out

    def restore_spec(self, op: str) -> dict[str, Any]:
        s = self.scratch
        spec: dict[str, Any] = {"op": op, "step": 1, "size": self.size, "skeleton": str(s / "skeleton.pkl")}
        spec["path"] = str({"tierckpt": s / "tierckpt", "tierckpt-into": s / "tierckpt", "torch": s / "torch.pt",
                            "torch-mmap": s / "torch.pt", "dcp": s / "dcp", "raw": s}[op])  # fmt: skip
        spec["files"] = [str(p) for p in self.blobs]
        return spec

    def run(self) -> None:
        a = self.args
        for rep in range(a.repeats):
            for cond in a.conditions:
                spinner = self.neighbour() if cond == "busy" else None
                try:
                    self.run_restores(rep, cond)
                    if a.restarts:
                        self.run_e2e(rep, cond)
                finally:
                    if spinner is not None:
                        spinner.kill()
                        spinner.wait()
            print(f"repeat {rep + 1}/{a.repeats} done", file=sys.stderr, flush=True)

    def run_restores(self, rep: int, cond: str) -> None:
        ops = self.args.ops
        k = rep % max(1, len(ops))
        for op in ops[k:] + ops[:k]:
            got = self.child(self.restore_spec(op))
            if op != "raw" and got.get("digest") != self.ref:  # the bytes, in the saved structure's order
                raise RuntimeError(f"{op} restored a state that differs from the saved one")
            self.emit({"kind": "sample", "cond": cond, "op": op, "rep": rep, "nbytes": self.nbytes, **got})
        if self.args.profile:
            got = self.child({**self.restore_spec("tierckpt"), "profile": True})
            self.emit({"kind": "profile", "cond": cond, "op": "tierckpt", "rep": rep, "nbytes": self.nbytes, **got})
        if fio_available() and not self.args.no_fio:
            self.cold()
            gbps = run_fio(self.scratch / "fio.dat", self.raw_bytes, "read")
            self.emit({"kind": "fio", "cond": cond, "rep": rep, "gbps": gbps})

    def run_e2e(self, rep: int, cond: str) -> None:
        s = self.scratch / "e2e"
        hows = self.args.restarts
        k = rep % max(1, len(hows))
        for how in hows[k:] + hows[:k]:
            path = {"tierckpt": s / "tierckpt", "torch": s / "torch.pt", "dcp": s / "dcp"}[how]
            got = self.child({"op": f"e2e-{how}", "step": 1, "size": self.size, "path": str(path)})
            got["loss_ok"] = got["loss"] == self.e2e_loss
            self.emit({"kind": "e2e", "cond": cond, "how": how, "rep": rep, "nbytes": self.e2e_bytes, **got})

    def neighbour(self) -> subprocess.Popen[bytes]:
        """A spinning python process pinned to the last core (os.sched_setaffinity)."""
        core = max(os.sched_getaffinity(0))
        return subprocess.Popen([sys.executable, "-c", SPIN, str(core)])


def memory_info() -> dict[str, Any]:
    """THP settings and whether freed memory is reported to a VM host (what fresh memory costs depends on)."""
    thp = Path("/sys/kernel/mm/transparent_hugepage")
    info: dict[str, Any] = {f"thp_{n}": read_text(str(thp / n)).strip() for n in ("enabled", "defrag")}
    info["free_page_reporting"] = REPORTED.exists()
    return info


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--quick", action="store_true", help="a ~51 MB state and a ~4 M-parameter model (smoke test)")
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--out", type=Path, default=Path("bench-results"))
    p.add_argument("--dir", type=Path, default=None, help="scratch parent (default: a temp dir under /tmp)")
    p.add_argument("--conditions", default="quiet,busy", help="quiet, busy (one core kept busy), or both")
    p.add_argument("--ops", default=",".join(OPS), help="restores to measure (default: all)")
    p.add_argument("--restarts", default=",".join(RESTARTS), help="end-to-end restarts to measure (default: all)")
    p.add_argument(
        "--cold",
        choices=("auto", "drop_caches", "fadvise"),
        default="fadvise",
        help="fadvise (default): DONTNEED on the checkpoint files only; drop_caches would also evict "
        "python's and torch's libraries, so every process start would read them from disk",
    )
    p.add_argument(
        "--settle",
        type=float,
        default=15.0,
        help="at most this many seconds before each process for freed memory to go back to the VM's "
        "host (free page reporting; 0: do not wait)",
    )
    p.add_argument("--profile", action="store_true", help="also one profiled tierckpt restore per repeat")
    p.add_argument("--no-e2e", action="store_true", help="skip the end-to-end restarts")
    p.add_argument("--no-fio", action="store_true")
    a = p.parse_args(argv)
    a.conditions = [c for c in a.conditions.split(",") if c]
    a.ops = tuple(o for o in a.ops.split(",") if o)
    a.restarts = () if a.no_e2e else tuple(o for o in a.restarts.split(",") if o)
    if not a.conditions or set(a.conditions) - {"quiet", "busy"} or a.repeats < 1:
        p.error("--conditions takes quiet and/or busy; --repeats at least 1")
    if set(a.ops) - set(OPS) or set(a.restarts) - set(RESTARTS):
        p.error(f"--ops takes some of {','.join(OPS)}; --restarts some of {','.join(RESTARTS)}")
    return a


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    args.out.mkdir(parents=True, exist_ok=True)
    scratch = Path(tempfile.mkdtemp(prefix="bench-restart-", dir=args.dir))
    try:
        b = Bench(args, scratch, args.out)
        b.emit({"kind": "machine", **machine_info(scratch), **memory_info(), "argv": sys.argv[1:]})
        b.setup()
        b.run()
        text = report(b.records, b.cold_methods)
        b.md.write_text(text)
        print(text)
        b.emit({"kind": "end", "md": str(b.md)})
    finally:
        shutil.rmtree(scratch, ignore_errors=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
