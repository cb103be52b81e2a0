"""Peers from other packages: torch.distributed.checkpoint (DCP), TorchSnapshot and safetensors.

Each imports its package lazily in ``check``/``open``, so a missing package only skips that peer. What
each one can and cannot do with the workloads (durability, non-tensor values, templates) is in its
``durability`` and ``note``, which the report prints.
"""

from __future__ import annotations

import contextlib
import inspect
import warnings
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import torch

from tierckpt.bench.peers import Peer, Pending, fsync_tree
from tierckpt.bench.workloads import Workload, iter_tensors, same_state, zeros_like_state

__all__ = ["DcpAsync", "DcpSave", "Safetensors", "TorchSnapshot", "flat_tensors"]


@contextlib.contextmanager
def _quiet() -> Iterator[None]:
    """Silence the peers' deprecation and experimental-feature warnings."""
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        yield


def flat_tensors(obj: Any, prefix: str = "") -> dict[str, torch.Tensor]:
    """Every tensor of a nested state under a ``/``-joined key path; other values are left out."""
    out: dict[str, torch.Tensor] = {}
    if isinstance(obj, torch.Tensor):
        out[prefix] = obj
    elif isinstance(obj, dict):
        for k, v in obj.items():
            out.update(flat_tensors(v, f"{prefix}/{k}" if prefix else str(k)))
    elif isinstance(obj, (list, tuple)):
        for i, v in enumerate(obj):
            out.update(flat_tensors(v, f"{prefix}/{i}" if prefix else str(i)))
    return out


# -- torch.distributed.checkpoint -----------------------------------------------------------------------------
class DcpSave(Peer):
    """``dcp.save`` with ``FileSystemWriter(thread_count=N)`` (``sync_files=True``: every file fsynced), no
    process group (``no_dist=True``); ``dcp.load`` with ``FileSystemReader`` into a template."""

    requires = ("torch.distributed.checkpoint",)
    durability = "FileSystemWriter sync_files=True: each data file and .metadata fsynced (directory not)"
    note = "load fills a template of torch.zeros_like tensors (a live target) built before the timer; non-tensor values pickled"

    def __init__(self, threads: int = 1) -> None:
        self.threads = threads
        self.name = f"dcp-t{threads}"
        self.how = (
            f"`dcp.save(storage_writer=FileSystemWriter(thread_count={threads}), no_dist=True)`; "
            "`dcp.load(template, storage_reader=FileSystemReader)`"
        )

    def open(self, scratch: Path, wl: Workload) -> None:
        super().open(scratch, wl)
        import torch.distributed.checkpoint as dcp

        self.dcp = dcp

    def save(self, state: Any, rep: int) -> Pending:
        with _quiet():
            writer = self.dcp.FileSystemWriter(str(self.dir / str(rep)), thread_count=self.threads)
            self.dcp.save(state, storage_writer=writer, no_dist=True)
        return Pending()

    def prepare_restore(self, rep: int, like: Any) -> Any:
        return zeros_like_state(like)  # a live target, as a built model and optimizer are

    def restore(self, rep: int, arg: Any, cache: str) -> Any:
        with _quiet():
            reader = self.dcp.FileSystemReader(str(self.dir / str(rep)))
            self.dcp.load(arg, storage_reader=reader, no_dist=True)
        return arg


class DcpAsync(DcpSave):
    """``dcp.async_save`` (thread executor, ``no_dist=True``) with a ``FileSystemWriter``.

    Args:
        stager: ``default`` (no stager given: the writer stages a fresh CPU copy inside the call),
            ``reused`` (one ``DefaultStager(StagingOptions(False, False, False, False))`` for every save
            of the workload: staging storages are cached and reused, the copy runs inside the call), or
            ``background`` (the same with ``use_async_staging=True``: the call returns at once and
            ``staging_completion`` resolves when the copy is done).
    """

    caches = ()
    note = "save only (restore as dcp-t1); API return = staging done except with background staging"

    def __init__(self, stager: str = "default") -> None:
        super().__init__(1)
        self.stager_kind = stager
        self.name = {"default": "dcp-async", "reused": "dcp-async-stager", "background": "dcp-async-stager-bg"}[stager]
        self.stager: Any = None
        self.how = (
            "`dcp.async_save(storage_writer=FileSystemWriter, no_dist=True)` "
            + {
                "default": "with DCP's default staging (the writer copies the state inside the call)",
                "reused": "with `async_stager=DefaultStager(StagingOptions(False, False, False, False))` reused "
                "across saves (one untimed warm-up save allocates its storages)",
                "background": "with a reused `DefaultStager(StagingOptions(use_async_staging=True))`: safe to mutate = "
                "`staging_completion`",
            }[stager]
        )

    def check(self) -> None:
        super().check()
        from torch.distributed.checkpoint import state_dict_saver

        if "async_stager" not in inspect.signature(state_dict_saver.async_save).parameters:
            raise ImportError("this torch's dcp.async_save takes no async_stager")
        if self.stager_kind != "default":
            from torch.distributed.checkpoint.staging import DefaultStager, StagingOptions  # noqa: F401

    def open(self, scratch: Path, wl: Workload) -> None:
        super().open(scratch, wl)
        if self.stager_kind != "default":
            from torch.distributed.checkpoint.staging import DefaultStager, StagingOptions

            with _quiet():
                self.stager = DefaultStager(StagingOptions(False, False, self.stager_kind == "background", False))

    def warmup(self, state: Any) -> None:
        if self.stager is not None:  # the first save allocates the cached staging storages
            p = self.save(state, -1)
            p.staged()
            p.durable()
            self.discard(-1)

    def save(self, state: Any, rep: int) -> Pending:
        with _quiet():
            writer = self.dcp.FileSystemWriter(str(self.dir / str(rep)))
            out = self.dcp.async_save(state, storage_writer=writer, async_stager=self.stager, no_dist=True)
        if hasattr(out, "staging_completion"):  # AsyncSaveResponse (background staging)
            return Pending(staged=out.staging_completion.result, durable=out.upload_completion.result)
        return Pending(durable=out.result)

    def close(self) -> None:
        if self.stager is not None:
            self.stager.close()
            self.stager = None


# -- TorchSnapshot -------------------------------------------------------------------------------------------
class TorchSnapshot(Peer):
    """``torchsnapshot.Snapshot.take`` (or ``async_take``) of ``{"s": StateDict(state)}``; restore into a
    template. TorchSnapshot does not fsync: the harness fsyncs every file and folder it wrote, inside the
    timed durable phase."""

    requires = ("torchsnapshot",)
    durability = "no fsync of its own: the harness fsyncs every file and directory after it (timed)"
    note = "restore fills a template of torch.zeros_like tensors (a live target) built before the timer"

    def __init__(self, asynchronous: bool = False) -> None:
        self.asynchronous = asynchronous
        self.name = "torchsnapshot-async" if asynchronous else "torchsnapshot"
        self.how = (
            "`Snapshot.async_take(app_state={'s': StateDict(state)})`: safe to mutate when it returns; durable = `wait()` + fsync"
            if asynchronous
            else "`Snapshot.take(app_state={'s': StateDict(state)})` + fsync; `Snapshot(path).restore` into a template"
        )
        if asynchronous:
            self.caches = ()
            self.note = "save only (restore as torchsnapshot); async_take returns once the state is staged"

    def open(self, scratch: Path, wl: Workload) -> None:
        super().open(scratch, wl)
        with _quiet():
            import torchsnapshot

        self.ts = torchsnapshot
        # torchsnapshot 0.1.0 (its latest release) gets the byte size of a bfloat16 tensor with an odd
        # number of elements wrong by one with this torch: saving raises AssertionError ("The size of the
        # buffer generated by the buffer stager does not match ...") and, with batching off, restoring
        # raises RuntimeError ("shape '[1111]' is invalid for input of size 1110").
        odd = sum(1 for t in iter_tensors(wl.state) if t.dtype == torch.bfloat16 and t.numel() % 2)
        if odd:
            raise RuntimeError(
                f"torchsnapshot 0.1.0 cannot save bfloat16 tensors with an odd number of elements ({odd} in this "
                "state): its buffer sizes are off by one byte (AssertionError on save, RuntimeError on restore)"
            )

    def save(self, state: Any, rep: int) -> Pending:
        path = self.dir / str(rep)
        app = {"s": self.ts.StateDict(state)}
        with _quiet():
            if not self.asynchronous:
                self.ts.Snapshot.take(path=str(path), app_state=app)
                fsync_tree(path)
                return Pending()
            pending = self.ts.Snapshot.async_take(path=str(path), app_state=app)

        def durable() -> None:
            with _quiet():
                pending.wait()
            fsync_tree(path)

        return Pending(durable=durable)

    def prepare_restore(self, rep: int, like: Any) -> Any:
        return self.ts.StateDict(zeros_like_state(like))

    def restore(self, rep: int, arg: Any, cache: str) -> Any:
        with _quiet():
            self.ts.Snapshot(path=str(self.dir / str(rep))).restore({"s": arg})
        return dict(arg)


# -- safetensors ---------------------------------------------------------------------------------------------
class Safetensors(Peer):
    """``safetensors.torch.save_file`` of the state's tensors under flat ``/``-joined keys, then fsync;
    ``load_file(backend="pread")``.

    safetensors holds only tensors: the state's other values (step counters, param_groups, RNG bytes,
    config) are left out, and the restore returns the flat dict, not the nested state. It refuses tensors
    that share memory and needs contiguous ones: the workloads have neither, and ``.contiguous()`` (a
    copy, inside the timing) is applied where needed. The default ``mmap`` backend of ``load_file``
    returns tensors whose bytes are read on first touch, so it is not used.
    """

    name = "safetensors"
    how = "`save_file(flat tensors)` + fsync; `load_file(backend='pread')`"
    requires = ("safetensors.torch",)
    durability = "file fsynced by the harness after save_file (timed)"
    note = "tensors only (non-tensor values left out), flat keys, not the nested state"

    def open(self, scratch: Path, wl: Workload) -> None:
        super().open(scratch, wl)
        import safetensors.torch as st

        self.st = st
        self.load_kw: dict[str, Any] = {}
        if "backend" in inspect.signature(st.load_file).parameters:
            self.load_kw["backend"] = "pread"

    def files(self, rep: int) -> list[Path]:
        return [self.dir / f"{rep}.safetensors"]

    def save(self, state: Any, rep: int) -> Pending:
        flat = {k: v.contiguous() for k, v in flat_tensors(state).items()}
        path = self.files(rep)[0]
        self.st.save_file(flat, str(path))
        fsync_tree(path)
        return Pending()

    def restore(self, rep: int, arg: Any, cache: str) -> Any:
        return self.st.load_file(str(self.files(rep)[0]), **self.load_kw)

    def same(self, state: Any, restored: Any) -> bool:
        return same_state(flat_tensors(state), restored)
