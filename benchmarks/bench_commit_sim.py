"""A simulated commit of N ranks in one process: is the commit protocol linear in ranks?

Every fake rank is a thread with its own :class:`~tierckpt.ranks.distributed.StoreCoordinator`
(on one in-process ``HashStore``) and its own handle on one shared ``pfs`` directory. Per step, each
rank writes its copy (a tiny state: the bytes are not what is measured), reports it
(``gather("commit/pfs/…")``, the protocol's one message a rank), rank 0 writes the step's record; then
every rank lists the tier and the ranks agree on the step to restore (``agree_step``), as a restart does.

Counted: store operations (by rank 0 and by the others) and the file system's metadata operations
(open, mkdir, rename, unlink, stat, scandir, fsync of files and directories), per phase, per rank.

    python benchmarks/bench_commit_sim.py --ranks 125 250 500 1000 --dir /var/tmp/commitsim
"""

from __future__ import annotations

import argparse
import os
import shutil
import sys
import threading
import time
from collections import Counter
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist

from tierckpt.datapath.packing import build_manifest
from tierckpt.format.layout import plan
from tierckpt.format.manifest import BlobEntry
from tierckpt.format.record import CommitRecord, encode_record, manifest_tag
from tierckpt.format.tree import flatten
from tierckpt.io import make_engine
from tierckpt.ranks.distributed import StoreCoordinator
from tierckpt.tiers.base import CheckpointKey
from tierckpt.tiers.pfs import PfsTier

_OS_CALLS = ("open", "mkdir", "rename", "unlink", "stat", "scandir", "fsync", "rmdir", "lstat")


class Counted:
    """Counts calls of ``os`` metadata functions and of a store's methods, per thread-phase."""

    def __init__(self) -> None:
        self.fs: Counter[str] = Counter()
        self.lock = threading.Lock()
        self._real: dict[str, Callable[..., Any]] = {}

    def __enter__(self) -> Counted:
        for name in _OS_CALLS:
            real = getattr(os, name)
            self._real[name] = real

            def wrapped(*a: Any, _real: Callable[..., Any] = real, _name: str = name, **k: Any) -> Any:
                with self.lock:
                    self.fs[_name] += 1
                return _real(*a, **k)

            setattr(os, name, wrapped)
        return self

    def __exit__(self, *exc: object) -> None:
        for name, real in self._real.items():
            setattr(os, name, real)


class CountingStore(dist.Store):
    """A store that counts each rank's operations (by thread)."""

    def __init__(self, inner: dist.Store) -> None:
        super().__init__()
        self.inner = inner
        self.ops: Counter[str] = Counter()
        self.lock = threading.Lock()
        self.local = threading.local()

    def _count(self, what: str) -> None:
        who = "rank 0" if getattr(self.local, "rank", 1) == 0 else "others"
        with self.lock:
            self.ops[who] += 1
            self.ops[f"{who}: {what}"] += 1

    def set(self, key: str, value: Any) -> None:
        self._count("set")
        self.inner.set(key, value)

    def get(self, key: str) -> bytes:
        self._count("get")
        got = self.inner.get(key)
        if getattr(self.local, "rank", 1) == 0:
            with self.lock:
                self.ops["rank 0 bytes"] += len(got)
        return got

    def append(self, key: str, value: Any) -> None:
        self._count("append")
        self.inner.append(key, value)

    def add(self, key: str, value: int) -> int:
        self._count("add")
        return self.inner.add(key, value)

    def check(self, keys: list[str]) -> bool:
        self._count("check")
        return self.inner.check(keys)

    def wait(self, keys: list[str], *a: Any) -> None:
        self._count("wait")
        self.inner.wait(keys, *a)

    def delete_key(self, key: str) -> bool:
        self._count("delete_key")
        return self.inner.delete_key(key)

    def compare_set(self, key: str, expected: Any, desired: Any) -> bytes:
        self._count("compare_set")
        return self.inner.compare_set(key, expected, desired)

    def num_keys(self) -> int:
        return self.inner.num_keys()

    def clone(self) -> CountingStore:
        return self


def run_ranks(n: int, body: Callable[[int], Any]) -> list[Any]:
    out: list[Any] = [None] * n

    def one(r: int) -> None:
        try:
            out[r] = body(r)
        except BaseException as e:
            out[r] = e

    threads = [threading.Thread(target=one, args=(r,)) for r in range(n)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    bad = [o for o in out if isinstance(o, BaseException)]
    if bad:
        raise bad[0]
    return out


def one_size(n: int, root: Path) -> dict[str, Any]:
    shutil.rmtree(root, ignore_errors=True)
    inner = dist.HashStore()
    store = CountingStore(inner)
    eng = make_engine("threads", 8)
    tiers = [PfsTier("pfs", root, eng, job="sim") for _ in range(n)]
    coords: list[Any] = run_ranks(n, lambda r: _coordinator(store, r, n))
    flat = flatten({"w": torch.zeros(16)})
    layout = plan(flat.nbytes, align=4096, blob_bytes=4096)
    blobs = (BlobEntry("blob-00000.bin", layout.blob_sizes[0]),)
    rows: dict[str, Any] = {}

    def phase(name: str, body: Callable[[int], Any]) -> list[Any]:
        store.ops.clear()
        with Counted() as c:
            t0 = time.perf_counter()
            out = run_ranks(n, lambda r: (setattr(store.local, "rank", r), body(r))[1])
            rows[name] = {
                "seconds": time.perf_counter() - t0,
                "store ops rank 0": store.ops["rank 0"],
                "rank 0 bytes": store.ops["rank 0 bytes"],
                "store ops per other rank": store.ops["others"] / max(1, n - 1),
                "fs metadata ops": sum(c.fs.values()),
                "fs ops per rank": sum(c.fs.values()) / n,
            }
        return out

    def write(r: int) -> bytes:
        key = CheckpointKey(1, r)
        w = tiers[r].reserve(key, blobs)
        m = build_manifest(flat, [t.tensor for t in flat.tensors], layout, blobs, [0], step=1, rank=r,
                           world_size=n, align=4096)  # fmt: skip
        w.commit(m)
        return m

    manifests = phase("write copies", write)

    def commit(r: int) -> None:
        def record(tags: list[int]) -> bytes:
            data = encode_record(CommitRecord(1, n, tuple(tags)))
            tiers[0].write_record(1, data)
            return data

        coords[r].gather("commit/pfs/1/1", manifest_tag(manifests[r]), record)

    phase("commit (report + record)", commit)

    def agree(r: int) -> Any:
        own = [k.step for k in tiers[r].list_committed(r)]
        recorded = set(tiers[r].list_records())
        newest = max((s for s in own if s in recorded), default=None)
        return coords[r].agree_step(newest)

    agreed = phase("restart: list + agree_step", agree)
    assert agreed == [1] * n, agreed[:5]
    eng.close()
    shutil.rmtree(root, ignore_errors=True)
    return rows


def _coordinator(store: Any, r: int, n: int) -> StoreCoordinator:
    return StoreCoordinator(store, r, n, timeout=120.0)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--ranks", type=int, nargs="+", default=[125, 250, 500, 1000])
    p.add_argument("--dir", type=Path, default=Path("/var/tmp/commitsim"))
    args = p.parse_args(argv)
    print(
        "| ranks | phase | seconds | store ops, rank 0 | bytes rank 0 got | store ops, each other rank | fs metadata ops | per rank |"
    )
    print("| ---: | --- | ---: | ---: | ---: | ---: | ---: | ---: |")
    for n in args.ranks:
        for name, row in one_size(n, args.dir).items():
            print(
                f"| {n} | {name} | {row['seconds']:.3f} | {row['store ops rank 0']} | {row['rank 0 bytes']} | "
                f"{row['store ops per other rank']:.1f} | {row['fs metadata ops']} | {row['fs ops per rank']:.1f} |",
                flush=True,
            )
    return 0


if __name__ == "__main__":
    sys.exit(main())
