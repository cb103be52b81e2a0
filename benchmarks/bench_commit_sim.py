"""A simulated commit of N ranks in one process: is the commit protocol linear in ranks?

Every fake rank is a thread with its own :class:`~tierckpt.ranks.distributed.StoreCoordinator`
(on one in-process ``HashStore``) and its own handle on one shared ``pfs`` directory. Per step, each
rank writes its copy (a tiny state: the bytes are not what is measured), reports it
(``gather("commit/pfs/…")``, the protocol's one message a rank), rank 0 writes the step's record; then
every rank lists the tier and the ranks agree on the step to restore (``agree_step``), as a restart does.

Counted: store operations (by rank 0 and by the others) and the file system's metadata operations
(open, mkdir, rename, unlink, stat, scandir, fsync of files and directories), per phase, per rank; and,
per checkpoint (the write and commit phases), the operations a metadata server feels most: file and
directory creates, opens of existing files, fsyncs of files and of directories, renames, and the entries
the step leaves (its directory and everything in it).

``--layout per_node`` runs the same with the per-node layout of docs/distributed.md ("A per-node data file: the design",
designed, not implemented in tierckpt): the write phase is the prototype in ``pernode_proto.py``, the
ranks of a node (``--ranks-per-node``, consecutive ranks) sharing one data file.

    python benchmarks/bench_commit_sim.py --ranks 125 250 500 1000 --dir /var/tmp/commitsim
    python benchmarks/bench_commit_sim.py --ranks 1000 --layout per_rank per_node --ranks-per-node 8
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

sys.path.insert(0, str(Path(__file__).resolve().parent))
from pernode_proto import save_per_node  # a sibling script's module, imported after the path is set

_OS_CALLS = ("open", "mkdir", "rename", "unlink", "stat", "scandir", "fsync", "rmdir", "lstat")
#: the kinds of operation counted per checkpoint, in table order
KINDS = ("file creates", "mkdirs", "opens of existing files", "file fsyncs", "directory fsyncs", "renames")


class Counted:
    """Counts calls of ``os`` metadata functions (``fs``) and, by kind (``kinds``: a create is an
    ``open`` with ``O_CREAT``, a directory fsync one of a descriptor opened with ``O_DIRECTORY``)."""

    def __init__(self) -> None:
        self.fs: Counter[str] = Counter()
        self.kinds: Counter[str] = Counter()
        self.lock = threading.Lock()
        self._real: dict[str, Callable[..., Any]] = {}
        self._dir_fds: set[int] = set()

    def _kind(self, name: str, a: tuple[Any, ...], k: dict[str, Any]) -> str | None:
        if name == "open":
            flags = a[1] if len(a) > 1 else k.get("flags", 0)
            if flags & os.O_DIRECTORY:
                return None
            return "file creates" if flags & os.O_CREAT else "opens of existing files"
        if name == "fsync":
            return "directory fsyncs" if a[0] in self._dir_fds else "file fsyncs"
        return {"mkdir": "mkdirs", "rename": "renames"}.get(name)

    def __enter__(self) -> Counted:
        for name in (*_OS_CALLS, "close"):
            real = getattr(os, name)
            self._real[name] = real

            def wrapped(*a: Any, _real: Callable[..., Any] = real, _name: str = name, **k: Any) -> Any:
                if _name == "close":
                    with self.lock:
                        self._dir_fds.discard(a[0])
                    return _real(*a, **k)
                with self.lock:  # counted as asked (an EEXIST mkdir counts: the server answered it)
                    self.fs[_name] += 1
                    if (kind := self._kind(_name, a, k)) is not None:
                        self.kinds[kind] += 1
                out = _real(*a, **k)
                if _name == "open" and (a[1] if len(a) > 1 else k.get("flags", 0)) & os.O_DIRECTORY:
                    with self.lock:
                        self._dir_fds.add(out)
                return out

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


def step_files(step_dir: Path) -> tuple[int, int]:
    """(entries: the step's directory and everything in it, data files: ``data.bin`` and ``node-…``)."""
    entries, data = 1, 0
    for _, dirs, files in os.walk(step_dir):
        entries += len(dirs) + len(files)
        data += sum(f == "data.bin" or f.startswith("node-") for f in files)
    return entries, data


def one_size(n: int, root: Path, layout: str = "per_rank", per_node: int = 8) -> dict[str, Any]:
    """The phases' counts for ``n`` ranks in ``layout`` (``per_node``: ``per_node`` ranks a node)."""
    shutil.rmtree(root, ignore_errors=True)
    inner = dist.HashStore()
    store = CountingStore(inner)
    eng = make_engine("threads", 8)
    tiers = [PfsTier("pfs", root, eng, job="sim") for _ in range(n)]
    coords: list[Any] = run_ranks(n, lambda r: _coordinator(store, r, n))
    flat = flatten({"w": torch.zeros(16)})
    plan_ = plan(flat.nbytes, align=4096, blob_bytes=4096)
    blobs = (BlobEntry("blob-00000.bin", plan_.blob_sizes[0]),)
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
                "kinds": Counter(c.kinds),
                "store ops": store.ops["rank 0"] + store.ops["others"],
            }
        return out

    def write(r: int) -> bytes:
        key = CheckpointKey(1, r)
        m = build_manifest(flat, [t.tensor for t in flat.tensors], plan_, blobs, [0], step=1, rank=r,
                           world_size=n, align=4096)  # fmt: skip
        if layout == "per_node":
            first = r - r % per_node
            save_per_node(store, root, 1, r, list(range(first, min(first + per_node, n))), m, bytes(blobs[0].size))
            return m
        w = tiers[r].reserve(key, blobs)
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
    rows["entries"], rows["data files"] = step_files(root / "step-000000000001")

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
    p.add_argument("--layout", nargs="+", choices=("per_rank", "per_node"), default=["per_rank"])
    p.add_argument("--ranks-per-node", type=int, default=8, help="for --layout per_node (default 8)")
    args = p.parse_args(argv)
    print(
        "| layout | ranks | phase | seconds | store ops, rank 0 | bytes rank 0 got | store ops, each other rank | fs metadata ops | per rank |"
    )
    print("| --- | ---: | --- | ---: | ---: | ---: | ---: | ---: | ---: |")
    per_checkpoint = []
    for n in args.ranks:
        for lay in args.layout:
            rows = one_size(n, args.dir, lay, args.ranks_per_node)
            what = f"per_node ({args.ranks_per_node} a node)" if lay == "per_node" else lay
            per_checkpoint.append((what, n, rows))
            for name, row in rows.items():
                if not isinstance(row, dict):
                    continue
                print(
                    f"| {what} | {n} | {name} | {row['seconds']:.3f} | {row['store ops rank 0']} | {row['rank 0 bytes']} | "
                    f"{row['store ops per other rank']:.1f} | {row['fs metadata ops']} | {row['fs ops per rank']:.1f} |",
                    flush=True,
                )
    print("\nPer checkpoint (write and commit phases):\n")
    print(f"| layout | ranks | data files | {' | '.join(KINDS)} | all of these | entries | store ops |")
    print("| --- | ---: |" + " ---: |" * (len(KINDS) + 4))
    for what, n, rows in per_checkpoint:
        kinds = rows["write copies"]["kinds"] + rows["commit (report + record)"]["kinds"]
        store_ops = rows["write copies"]["store ops"] + rows["commit (report + record)"]["store ops"]
        print(
            f"| {what} | {n} | {rows['data files']} | {' | '.join(str(kinds[k]) for k in KINDS)} | "
            f"{sum(kinds[k] for k in KINDS)} | {rows['entries']} | {store_ops} |"
        )
    return 0


if __name__ == "__main__":
    sys.exit(main())
