"""The restart processes of the prefetch benchmark (:mod:`tierckpt.bench.prefetch`).

``python -m tierckpt.bench._restart`` is a fork server: it imports tierckpt's hierarchy (and so torch)
and nothing else, starts no thread, then for each JSON line ``[config_path, mode, init_secs]`` on its
stdin forks a process that runs :func:`restart` and exits, and answers one JSON line on stdout:
``["ok", result]`` or ``["error", why]``. A forked restart has what a restarted job has when it restores
(torch imported, no tensors, no hierarchy) and faults in new memory like any new process; it costs
~0.1 s to start instead of the 3-5 s a new interpreter spends importing torch.
"""

from __future__ import annotations

import json
import os
import sys
import time
from pathlib import Path
from typing import Any

from tierckpt.hierarchy import Hierarchy

__all__ = ["restart", "serve"]


def restart(cfg_path: str, mode: str, init_secs: float) -> dict[str, Any]:
    """One restart (in a process of its own): open the hierarchy, optionally prefetch, sleep
    ``init_secs``, restore; the timings as a JSON-able dict."""
    h = Hierarchy.from_config(json.loads(Path(cfg_path).read_text()))
    done_at: list[float] = []
    t0 = time.perf_counter()
    fut = None
    if mode == "prefetch":
        fut = h.prefetch()
        fut.add_done_callback(lambda f: done_at.append(time.perf_counter()))
    time.sleep(init_secs)  # model construction, NCCL initialization, data loader workers ...
    t1 = time.perf_counter()
    in_time = fut.done() if fut is not None else None
    state = h.restore()
    t2 = time.perf_counter()
    out = {
        "mode": mode, "init_secs": init_secs, "after_init_secs": t2 - t1, "total_secs": t2 - t0,
        "prefetch_done_secs": (done_at[0] - t0) if done_at else None, "prefetch_done_at_init_end": in_time,
        "last_restore": list(h.last_restore or (None, None)),
    }  # fmt: skip
    del state
    h.close()
    return out


def _run_forked(cfg_path: str, mode: str, init_secs: float) -> list[Any]:
    """Fork; the child runs :func:`restart` and sends its result back through a pipe."""
    r, w = os.pipe()
    pid = os.fork()
    if pid == 0:  # the restart process
        os.close(r)
        try:
            answer: list[Any] = ["ok", restart(cfg_path, mode, init_secs)]
        except BaseException as e:
            answer = ["error", f"{type(e).__name__}: {e}"]
        with os.fdopen(w, "w") as f:
            f.write(json.dumps(answer))
        os._exit(0)
    os.close(w)
    with os.fdopen(r) as f:
        data = f.read()
    _, status = os.waitpid(pid, 0)
    if not data:
        return ["error", f"the restart process exited without a result (wait status {status})"]
    got: list[Any] = json.loads(data)  # the child writes one JSON list
    return got


def serve() -> int:
    """The fork server's loop (see the module docstring); returns at the end of stdin."""
    print(json.dumps(["ready"]), flush=True)
    for line in sys.stdin:
        cfg_path, mode, init_secs = json.loads(line)
        print(json.dumps(_run_forked(cfg_path, mode, float(init_secs))), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(serve())
