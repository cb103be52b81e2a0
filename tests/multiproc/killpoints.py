"""Where a rank of a spawned job is SIGKILLed (or hung) in the middle of a save: each point is a
monkeypatch armed inside that rank's process only (no hook in the library), firing at one step.

Points, in the order a save reaches them (``ssd``: the node-local top tier; ``pfs``: the shared one
the save is demoted to):

* ``write_top``: mid-write of the rank's blobs on ``ssd`` (one piece written and complete, no manifest);
* ``before_gather``: its ``ssd`` copy is durable (renamed into place), before it reports it;
* ``in_gather``: it has reported its ``ssd`` copy (its value is in the store), before it reads the outcome;
* ``before_record`` / ``mid_record`` / ``after_record``: rank 0, in the ``pfs`` commit's decision once
  every rank's copy is in: before it writes the step's record, with the record written to its scratch
  name (fsynced, not renamed), or with the record in place but no outcome published;
* ``write_demotion``: mid-write of the rank's blobs on ``pfs`` (the background demotion);
* ``after_commit``: the rank's ``pfs`` commit returned (the record is written and every rank knows).

``hang``: the rank's ``ssd`` commit sleeps ``secs`` before it reports its copy, then goes on.
"""

from __future__ import annotations

import os
import signal
import time
from concurrent.futures import Future
from pathlib import Path
from typing import Any

POINTS = (
    "write_top", "before_gather", "in_gather", "before_record", "mid_record", "after_record",
    "write_demotion", "after_commit",
)  # fmt: skip


def die() -> None:
    os.kill(os.getpid(), signal.SIGKILL)
    time.sleep(60)  # never reached: the signal is delivered before kill() returns


def arm(point: str, step: int) -> None:
    """Make this process die at ``point`` of its save of ``step``."""
    import tierckpt.tiers._files as files
    import tierckpt.tiers._filewrite as filewrite
    from tierckpt.background.executor import RankExecutor
    from tierckpt.ranks.distributed import StoreCoordinator

    if point in ("write_top", "write_demotion"):
        tier = "ssd" if point == "write_top" else "pfs"
        write = filewrite.FileWriter.write

        def write_then_die(self: Any, blob: int, offset: int, addr: int, nbytes: int) -> Future[int]:
            done = write(self, blob, offset, addr, nbytes)
            if self.tier.name == tier and self.key.step == step:
                done.result()  # this piece is on disk, the rest of the copy is not
                die()
            return done

        filewrite.FileWriter.write = write_then_die  # type: ignore[method-assign]
    elif point in ("before_gather", "after_commit"):
        tier = "ssd" if point == "before_gather" else "pfs"
        publish = RankExecutor.publish

        def publish_around(self: Any, t: Any, key: Any, manifest: bytes, then: Any) -> Any:
            hit = t.name == tier and key.step == step
            if hit and point == "before_gather":
                die()
            out = publish(self, t, key, manifest, then)
            if hit:
                die()
            return out

        RankExecutor.publish = publish_around  # type: ignore[method-assign]
    elif point == "in_gather":
        wait = StoreCoordinator._wait

        def wait_or_die(self: Any, st: Any, key: str, secs: float, what: str) -> bool:
            if what.startswith(f"commit/ssd/{step}/"):
                die()  # its value is appended and counted: rank 0 has every copy
            return wait(self, st, key, secs, what)

        StoreCoordinator._wait = wait_or_die  # type: ignore[method-assign]
    elif point in ("before_record", "after_record"):
        write_record = files.FileTier.write_record

        def record_around(self: Any, s: int, data: bytes) -> None:
            hit = self.name == "pfs" and s == step
            if hit and point == "before_record":
                die()
            write_record(self, s, data)
            if hit:
                die()

        files.FileTier.write_record = record_around  # type: ignore[method-assign]
    elif point == "mid_record":
        write_file = files.write_file

        def write_file_then_die(path: Path, data: bytes) -> None:
            write_file(path, data)
            if path.name.startswith(".tmp-commit-") and path.parent.name == f"step-{step:012d}" and "pfs" in path.parts:
                die()

        files.write_file = write_file_then_die
    else:
        raise ValueError(f"no kill point {point!r} (points: {', '.join(POINTS)})")


def hang(step: int, secs: float) -> None:
    """Make this process's ``ssd`` commit of ``step`` sleep ``secs`` before it reports its copy."""
    from tierckpt.ranks.distributed import StoreCoordinator

    gather = StoreCoordinator.gather

    def late(self: Any, key: str, value: Any, fn: Any, timeout: float | None = None) -> Any:
        if key.startswith(f"commit/ssd/{step}/"):
            time.sleep(secs)
        return gather(self, key, value, fn, timeout)

    StoreCoordinator.gather = late  # type: ignore[method-assign]
