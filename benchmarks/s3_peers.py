"""The torch side of ``bench_s3.py``, one operation per process (called by ``s3_child.py``).

The state: ``nbytes`` of the benchmark's byte pattern (the bytes the raw clients move) cut into float32
tensors of ``tensor_bytes`` each (the last one shorter), so every path moves the same bytes.

Operations (``spec["op"]``):

* ``tier-save``: a :class:`~tierckpt.Hierarchy` of a host tier over the S3 tier (each keeping one
  checkpoint) saves the state ``saves`` times (default 2: the first after the open, then one in the steady
  state, which evicts the first); each demotion host → s3 is timed from the host copy's commit to the S3
  copy's (the two ``durable`` futures), its CPU and extra RSS measured over the same interval.
* ``tier-restore``: a restart: a hierarchy of the S3 tier alone (no host copy), ``restore()`` into fresh
  tensors; opening the hierarchy is timed apart.
* ``dcp-fsspec-save`` / ``dcp-fsspec-load``: ``torch.distributed.checkpoint`` through ``FsspecWriter`` /
  ``FsspecReader`` on s3fs (``thread_count`` threads, one file each; no fsync, which s3fs files lack);
  the load into ``torch.empty`` tensors allocated beforehand (their pages first touched by the load).
* ``s3torch-save`` / ``s3torch-load``: s3torchconnector's ``S3StorageWriter`` / ``S3StorageReader``
  (its default reader), their S3 client pointed at the endpoint with path-style addressing.

A load reports whether the tensors hold the saved bytes (``intact``).
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable
from typing import Any

import torch
import xxhash
from s3_clients import pattern
from s3_marks import GAP_S, Mark, measured

REGION = "us-east-1"


def make_state(nbytes: int, seed: int, tensor_bytes: int) -> dict[str, torch.Tensor]:
    src = pattern(nbytes, seed)
    out: dict[str, torch.Tensor] = {}
    for i, off in enumerate(range(0, nbytes, tensor_bytes)):
        chunk = bytearray(src[off : off + tensor_bytes])
        out[f"t{i:04d}"] = torch.frombuffer(chunk, dtype=torch.uint8).view(torch.float32)
    return out


def empty_state(nbytes: int, tensor_bytes: int) -> dict[str, torch.Tensor]:
    """Tensors of the state's shapes, allocated and not touched."""
    return {f"t{i:04d}": torch.empty(min(tensor_bytes, nbytes - off) // 4, dtype=torch.float32)
            for i, off in enumerate(range(0, nbytes, tensor_bytes))}  # fmt: skip


def intact(state: dict[str, torch.Tensor], spec: dict[str, Any]) -> bool:
    """Whether the tensors, in name order, hold the pattern's bytes."""
    h = xxhash.xxh3_64()
    for name in sorted(state):
        h.update(state[name].contiguous().view(torch.uint8).numpy())
    return bool(h.hexdigest() == xxhash.xxh3_64_hexdigest(pattern(spec["nbytes"], spec["seed"])))


def url(spec: dict[str, Any]) -> str:
    return f"s3://{spec['bucket']}/{spec['prefix']}"


# -- tierckpt -------------------------------------------------------------------------------------------
def tier_config(spec: dict[str, Any], host: bool) -> dict[str, Any]:
    """The hierarchy: ``obj`` (the S3 tier, ``spec["tier_options"]`` added to its options), under a host
    tier with room for two copies when ``host``; each keeps one checkpoint."""
    obj = {"name": "obj", "kind": "s3", "path": url(spec),
           "options": {"endpoint_url": spec["endpoint"], **spec.get("tier_options", {})}}  # fmt: skip
    tiers = [{"name": "host", "kind": "host", "capacity": 2 * spec["nbytes"] + (256 << 20)}] if host else []
    return {"tiers": [*tiers, obj], "policy": {"keep": {t["name"]: 1 for t in [*tiers, obj]}}}


class _Marks:
    """A :class:`Mark` taken when each of some futures resolves (in the thread that resolves it, which
    runs the callbacks after waking the waiters: :meth:`get` waits for the mark)."""

    def __init__(self) -> None:
        self.marks: dict[str, Mark] = {}
        self.cond = threading.Condition()

    def on(self, fut: Any, name: str, reset: bool = False) -> None:
        def note(_: Any) -> None:
            mark = Mark(reset=reset)
            with self.cond:
                self.marks[name] = mark
                self.cond.notify_all()

        fut.add_done_callback(note)

    def get(self, name: str) -> Mark:
        with self.cond:
            if not self.cond.wait_for(lambda: name in self.marks, timeout=60):
                raise TimeoutError(f"no mark {name!r} within 60 s of its future")
            return self.marks[name]


def _one_save(h: Any, state: Any, step: int) -> dict[str, Any]:
    """Save ``step``; the demotion (the host copy's commit to the S3 copy's: time, CPU, extra RSS over
    the host copy) with the whole save (the call to the end of every copy and eviction) under ``save``."""
    time.sleep(GAP_S)
    marks = _Marks()
    start = Mark()
    handle = h.save(state, step=step)
    marks.on(handle.durable["host"], "host", reset=True)  # the demotion starts here
    marks.on(handle.durable["obj"], "obj")
    handle.wait()
    h.wait()  # and the evictions the save caused
    out = marks.get("host").until(marks.get("obj"))
    out["save"] = start.until(Mark())
    del out["save"]["extra_rss"]  # the peak mark was reset when the demotion began
    return out


def tier_save(spec: dict[str, Any]) -> dict[str, Any]:
    """``spec["saves"]`` saves of the state in one hierarchy (the first after opening it, then the steady
    state: each later one evicts its predecessor from both tiers); the last one's figures, the first's
    under ``first``."""
    from tierckpt import Hierarchy

    state = make_state(spec["nbytes"], spec["seed"], spec["tensor_bytes"])
    with Hierarchy.from_config(tier_config(spec, host=True)) as h:
        saves = [_one_save(h, state, step) for step in range(1, spec.get("saves", 2) + 1)]
    return {**saves[-1], "first": saves[0]} if len(saves) > 1 else saves[0]


def tier_restore(spec: dict[str, Any]) -> dict[str, Any]:
    from tierckpt import Hierarchy

    out: dict[str, Any] = {}
    opened = Mark(reset=True)
    h = Hierarchy.from_config(tier_config(spec, host=False))
    out["open"] = opened.until(Mark())
    time.sleep(GAP_S)
    try:
        with measured(out):
            state = h.restore()
    finally:
        h.close()
    out["intact"] = intact(state, spec)
    return out


# -- peers ----------------------------------------------------------------------------------------------
def _fsspec_options(spec: dict[str, Any]) -> dict[str, Any]:
    return {"endpoint_url": spec["endpoint"], "client_kwargs": {"region_name": REGION}}


def _s3torch_fs(spec: dict[str, Any], reader: Any = None) -> Any:
    """s3torchconnector's DCP file system on the endpoint: its writer and reader take no endpoint, so
    theirs is replaced by one whose client has it (``S3Client(endpoint=...)``, path-style addressing)."""
    from s3torchconnector import S3ClientConfig
    from s3torchconnector._s3client import S3Client
    from s3torchconnector.dcp.s3_file_system import S3FileSystem

    cfg = S3ClientConfig(force_path_style=True, part_size=spec["part"])
    client = S3Client(REGION, endpoint=spec["endpoint"], s3client_config=cfg)
    return S3FileSystem(REGION, s3_client=client, reader_constructor=reader)


def writer(spec: dict[str, Any]) -> Any:
    if spec["op"].startswith("dcp-fsspec"):
        from torch.distributed.checkpoint._fsspec_filesystem import FsspecWriter

        return FsspecWriter(url(spec), sync_files=False, thread_count=spec["conc"], **_fsspec_options(spec))
    from s3torchconnector.dcp import S3StorageWriter

    w = S3StorageWriter(REGION, url(spec), thread_count=spec["conc"])
    w.fs = _s3torch_fs(spec)
    return w


def reader(spec: dict[str, Any]) -> Any:
    if spec["op"].startswith("dcp-fsspec"):
        from torch.distributed.checkpoint._fsspec_filesystem import FsspecReader

        return FsspecReader(url(spec), **_fsspec_options(spec))
    from s3torchconnector.dcp import S3StorageReader

    r = S3StorageReader(REGION, url(spec))
    r.fs = _s3torch_fs(spec, reader=r._reader_constructor)
    return r


def peer_save(spec: dict[str, Any]) -> dict[str, Any]:
    import torch.distributed.checkpoint as dcp

    state = make_state(spec["nbytes"], spec["seed"], spec["tensor_bytes"])
    w = writer(spec)
    out: dict[str, Any] = {}
    with measured(out):
        dcp.save(state, storage_writer=w, no_dist=True)
    return out


def peer_load(spec: dict[str, Any]) -> dict[str, Any]:
    import torch.distributed.checkpoint as dcp

    state = empty_state(spec["nbytes"], spec["tensor_bytes"])
    r = reader(spec)
    out: dict[str, Any] = {}
    with measured(out):
        dcp.load(state, storage_reader=r, no_dist=True)
    out["intact"] = intact(state, spec)
    return out


OPS: dict[str, Callable[[dict[str, Any]], dict[str, Any]]] = {
    "tier-save": tier_save,
    "tier-restore": tier_restore,
    "dcp-fsspec-save": peer_save,
    "dcp-fsspec-load": peer_load,
    "s3torch-save": peer_save,
    "s3torch-load": peer_load,
}


def run(spec: dict[str, Any]) -> dict[str, Any]:
    return OPS[spec["op"]](spec)
