"""A save killed with SIGKILL at any moment never leaves a checkpoint that restore() picks up half written,
and every checkpoint committed before the kill still restores.

The saving process is forked from a small "zygote" script (written to tmp_path) that has already imported
torch, so each iteration costs a fork instead of a 2-3 s interpreter start. The zygote's forked child
opens a local + pfs hierarchy with 16 MiB blobs and saves steps of a ~256 MiB state in a loop; the parent
SIGKILLs it after a seeded random delay spread over a whole save (measured once beforehand), including
its fsync/manifest/rename tail. Step content is a deterministic function of the step, so whatever step
restore() returns can be checked byte for byte. Every third child first re-saves the newest step, so
kills also land inside an atomic replace."""

from __future__ import annotations

import contextlib
import inspect
import logging
import os
import queue
import random
import signal
import subprocess
import sys
import textwrap
import threading
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import torch

from tierckpt import Hierarchy
from tierckpt.tiers.base import CheckpointKey

SCRATCH_PREFIXES = (".tmp-", ".old-", ".evict-")
TIERS = ("ssd", "pfs")
# tensor sizes in MiB (sum 200): several per 16 MiB blob, some alone, three larger than a blob
SIZES_MIB = (1, 3, 5, 7, 2, 9, 11, 4, 13, 6, 8, 10, 12, 14, 15, 16, 20, 24, 2, 5, 3, 7, 3)


# -- shared with the child (copied into its script by inspect.getsource) -------------------------------------
def crash_config(root: str) -> dict[str, Any]:
    return {
        "tiers": [
            {"name": "ssd", "kind": "local", "path": root + "/ssd"},
            {"name": "pfs", "kind": "pfs", "path": root + "/pfs"},
        ],
        "layout": {"blob_size": "16MiB"},
        "io": {"chunk": "16MiB"},
    }


def make_state(step: int) -> dict[str, Any]:
    """The content of ``step``: every byte depends on the step and the tensor's position."""
    model = {}
    for i, mib in enumerate(SIZES_MIB):
        n = (mib << 20) // 4 - 3 * i  # odd lengths: extents do not all end on a page
        model[f"layer{i:02d}.weight"] = torch.arange(n, dtype=torch.int32).add_(step * 1009 + i * 7)
    return {"step": step, "model": model, "meta": {"tag": f"step-{step}", "sizes": list(SIZES_MIB)}}


CHILD_MAIN = """
import os, sys, time
import torch
from tierckpt import Hierarchy
from tierckpt.io._liburing import liburing_runs

liburing_runs()  # run the engine's one-time probe subprocess here, before any fork


def emit(msg):
    os.write(1, (msg + "\\n").encode())  # unbuffered: nothing is duplicated by fork or lost by SIGKILL


def child(root, mode):
    h = Hierarchy.from_config(crash_config(root))
    if mode == "time":  # the known first checkpoint, timed
        t0 = time.perf_counter()
        h.save(make_state(1), step=1).wait()
        emit("TIMED %.6f" % (time.perf_counter() - t0))
        h.close()
        return
    last = max(c.step for c in h.checkpoints())
    step = last if mode == "replace" else last + 1
    state = make_state(step)
    emit("READY %d" % step)
    while True:
        h.save(state, step=step).wait()
        emit("SAVED %d" % step)
        step += 1
        state = make_state(step)


def main():
    root = sys.argv[1]
    emit("ZYGOTE")
    for line in sys.stdin:
        cmd, *args = line.split()
        if cmd == "run":
            pid = os.fork()
            if pid == 0:
                code = 0
                try:
                    child(root, args[0])
                except BaseException as e:
                    emit("ERROR %r" % (e,))
                    code = 1
                os._exit(code)
            emit("PID %d" % pid)
        elif cmd == "reap":
            pid, status = os.waitpid(int(args[0]), 0)
            emit("REAPED %d %d" % (pid, status))
        else:
            break


main()
"""


def child_script() -> str:
    parts = [
        "from __future__ import annotations",
        "from typing import Any",
        "import torch",
        f"SIZES_MIB = {SIZES_MIB!r}",
        inspect.getsource(crash_config),
        inspect.getsource(make_state),
    ]
    return "\n\n".join(parts) + textwrap.dedent(CHILD_MAIN)


class Zygote:
    def __init__(self, tmp_path: Path, root: Path) -> None:
        script = tmp_path / "crash_child.py"
        script.write_text(child_script())
        self.stderr_path = tmp_path / "zygote.stderr"
        self._stderr = open(self.stderr_path, "wb")  # noqa: SIM115 - closed in close()
        self.proc = subprocess.Popen(
            [sys.executable, str(script), str(root)],
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            stderr=self._stderr,
            text=True,
            bufsize=1,
        )
        self.lines: queue.Queue[str] = queue.Queue()
        self.children: set[int] = set()  # forked savers not yet reaped
        threading.Thread(target=self._pump, daemon=True).start()
        self.expect("ZYGOTE", timeout=120)

    def _pump(self) -> None:
        assert self.proc.stdout is not None
        for line in self.proc.stdout:
            self.lines.put(line.strip())
        self.lines.put("EOF")

    def send(self, cmd: str) -> None:
        assert self.proc.stdin is not None
        self.proc.stdin.write(cmd + "\n")
        self.proc.stdin.flush()

    def expect(self, prefix: str, timeout: float = 120) -> tuple[str, list[str]]:
        """Wait for a line starting with ``prefix``; returns it and the lines seen before it."""
        seen: list[str] = []
        deadline = time.monotonic() + timeout
        while True:
            try:
                line = self.lines.get(timeout=max(0.01, deadline - time.monotonic()))
            except queue.Empty:
                raise AssertionError(
                    f"no {prefix!r} from the child within {timeout}s; saw {seen}; {self.stderr()}"
                ) from None
            if line.startswith(prefix):
                return line, seen
            if line.startswith(("ERROR", "EOF")):
                raise AssertionError(f"child failed: {line}; saw {seen}; {self.stderr()}")
            seen.append(line)

    def start(self, mode: str) -> int:
        """Fork a saver in ``mode`` (time / loop / replace); returns its pid."""
        self.send(f"run {mode}")
        pid = int(self.expect("PID")[0].split()[1])
        self.children.add(pid)
        return pid

    def reap(self, pid: int, timeout: float = 60) -> tuple[int, list[str]]:
        """Wait for the saver to end; returns its wait status and what it printed meanwhile."""
        self.send(f"reap {pid}")
        line, seen = self.expect("REAPED", timeout)
        self.children.discard(pid)
        return int(line.split()[2]), seen

    def stderr(self) -> str:
        self._stderr.flush()
        return "stderr: " + self.stderr_path.read_text(errors="replace")[-4000:]

    def drain(self) -> list[str]:
        out = []
        with contextlib.suppress(queue.Empty):
            while True:
                out.append(self.lines.get_nowait())
        return out

    def close(self) -> None:
        for pid in self.children:  # a failed test may leave a saver looping: stop it
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, signal.SIGKILL)
        with contextlib.suppress(OSError, ValueError):
            self.send("quit")
        try:
            self.proc.wait(timeout=30)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.wait()
        self._stderr.close()


@pytest.fixture
def zygote_factory(tmp_path: Path) -> Iterator[Any]:
    made: list[Zygote] = []

    def make(root: Path) -> Zygote:
        z = Zygote(tmp_path, root)
        made.append(z)
        return z

    yield make
    for z in made:
        z.close()


def scratch_dirs(root: Path) -> list[Path]:
    return [p for t in TIERS for p in (root / t).glob("step-*/*") if p.name.startswith(SCRATCH_PREFIXES)]


def check_state(got: Any, step: int, known: dict[int, Any] | None = None) -> None:
    want = known[step] if known and step in known else make_state(step)
    assert got["step"] == step and got["meta"] == want["meta"]
    assert list(got["model"]) == list(want["model"])
    for k, w in want["model"].items():
        g = got["model"][k]
        assert g.dtype == w.dtype and g.shape == w.shape, k
        assert torch.equal(g, w), f"step {step}: {k} differs"


def committed(h: Hierarchy) -> set[tuple[int, str]]:
    return {(c.step, t) for c in h.checkpoints() for t in c.tiers}


def crash_loop(
    tmp_path: Path, zygote_factory: Any, caplog: pytest.LogCaptureFixture, iterations: int, seed: int
) -> dict[str, int]:
    root = tmp_path / "ckpt"
    rng = random.Random(seed)
    z = zygote_factory(root)

    # step 1, the known checkpoint, saved undisturbed; its duration sets the spread of kill delays
    pid = z.start("time")
    save_s = float(z.expect("TIMED")[0].split()[1])
    assert z.reap(pid)[0] == 0
    spread = max(save_s, 0.05)

    known = {1: make_state(1)}
    stats = {
        "kills": 0,
        "mid_first_save": 0,
        "saves_completed": 0,
        "scratch_swept": 0,
        "replace_runs": 0,
        "copies_checked": 0,
    }
    before: set[tuple[int, str]] = {(1, t) for t in TIERS}
    for it in range(iterations):
        mode = "replace" if it % 3 == 2 else "loop"
        stats["replace_runs"] += mode == "replace"
        pid = z.start(mode)
        z.expect("READY")
        # half the delays anywhere in a save (and a bit beyond), half in its fsync/manifest/rename tail
        frac = rng.uniform(0.0, 1.3) if rng.random() < 0.5 else rng.uniform(0.6, 1.1)
        time.sleep(frac * spread)
        os.kill(pid, signal.SIGKILL)
        status, seen = z.reap(pid)
        assert os.WIFSIGNALED(status) and os.WTERMSIG(status) == signal.SIGKILL, (status, seen)
        saved = [s for s in seen if s.startswith("SAVED")]
        stats["kills"] += 1
        stats["saves_completed"] += len(saved)
        stats["mid_first_save"] += not saved

        # a fresh hierarchy (what a restarted job does) sweeps the dead process's scratch directories
        leftover = scratch_dirs(root)
        stats["scratch_swept"] += bool(leftover)
        h = Hierarchy.from_config(crash_config(str(root)))
        try:
            assert scratch_dirs(root) == [], f"iteration {it}: scratch of a dead save survived the sweep"
            now = committed(h)
            assert before <= now, f"iteration {it}: committed copies vanished: {sorted(before - now)}"
            infos = h.checkpoints()
            latest = infos[-1]

            caplog.clear()
            with caplog.at_level(logging.WARNING, logger="tierckpt"):
                state = h.restore()
            check_state(state, latest.step)
            del state
            bad = [r.getMessage() for r in caplog.records if r.levelno >= logging.WARNING]
            assert bad == [], f"iteration {it}: restore() met a damaged copy: {bad}"
            # every copy the killed process may have touched is whole too: the ones committed since the
            # last check and, after a replace run, every copy of the replaced step
            touched = now - before
            if mode == "replace":
                replaced = max(s for s, _ in before)
                touched |= {(s, t) for s, t in now if s == replaced}
            for s, t in sorted(touched - {(latest.step, latest.tiers[0])}):
                check_state(h.restore(s, tier=t), s)
            stats["copies_checked"] += len(touched - {(latest.step, latest.tiers[0])}) + 1
            step1 = next(i for i in infos if i.step == 1)
            check_state(h.restore(1, tier=step1.tiers[it % len(step1.tiers)]), 1, known)

            # keep the disk small: drop everything but step 1 and the newest step
            for c in infos:
                if c.step not in (1, latest.step):
                    for t in c.tiers:
                        h.tier(t).evict(CheckpointKey(c.step))
            before = committed(h)
        finally:
            h.close()
    return stats


def test_sigkill_during_save_never_leaves_a_half_written_checkpoint(
    tmp_path: Path, zygote_factory: Any, caplog: pytest.LogCaptureFixture
) -> None:
    stats = crash_loop(tmp_path, zygote_factory, caplog, iterations=15, seed=20240607)
    print(stats)
    assert stats["kills"] == 15


@pytest.mark.slow
@pytest.mark.parametrize("seed", [1, 2])
def test_sigkill_during_save_long(
    tmp_path: Path, zygote_factory: Any, caplog: pytest.LogCaptureFixture, seed: int
) -> None:
    stats = crash_loop(tmp_path, zygote_factory, caplog, iterations=60, seed=seed)
    assert stats["kills"] == 60


def test_sweep_removes_scratch_of_dead_processes_only(tmp_path: Path) -> None:
    """Scratch directories are named ``.<kind>-rank-NNNNN-<host>-<pid>-<hex>``; a new hierarchy removes
    those of dead pids on this host and leaves live writers (and committed copies) alone."""
    from tierckpt.tiers import _filescratch

    root = tmp_path / "ckpt"
    h = Hierarchy.from_config(crash_config(str(root)))
    h.save({"w": torch.ones(10)}, step=1).wait()
    h.close()

    dead = subprocess.Popen([sys.executable, "-c", "pass"])
    dead.wait()  # reaped: its pid is free
    host = _filescratch.HOST
    planted: dict[str, bool] = {}  # path -> should survive
    for t in TIERS:
        step = root / t / "step-000000000001"
        other = root / t / "step-000000000002"
        other.mkdir()
        for kind in ("tmp", "evict"):
            planted[str(step / f".{kind}-rank-00000-{host}-{dead.pid}-0badc0de")] = False
            planted[str(other / f".{kind}-rank-00000-{host}-{dead.pid}-00c0ffee")] = False
        planted[str(step / f".tmp-rank-00000-{host}-{os.getpid()}-12345678")] = True  # a live writer (us)
        planted[str(step / f".tmp-rank-00000-otherhost-{dead.pid}-12345678")] = True  # another node's
        # an interrupted non-atomic replace whose rank dir is gone: the only copy, kept for inspection
        planted[str(other / f".old-rank-00000-{host}-{dead.pid}-abcdef01")] = True
    for p in planted:
        Path(p).mkdir()
        (Path(p) / "blob-00000.bin").write_bytes(b"x" * 100)

    h = Hierarchy.from_config(crash_config(str(root)))
    try:
        for p, survives in planted.items():
            assert Path(p).exists() == survives, p
        assert [(c.step, c.tiers) for c in h.checkpoints()] == [(1, TIERS)]
        assert torch.equal(h.restore()["w"], torch.ones(10))
    finally:
        h.close()
