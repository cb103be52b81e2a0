"""A DCP :class:`~torch.distributed.checkpoint.staging.AsyncStager` that stages into host buffers kept
across saves (docs/integrations.md, "DCP async and staging").

``dcp.async_save`` first stages the state: a copy that later training steps cannot change. DCP's
``DefaultStager`` (what ``async_save`` uses unless told otherwise) copies every tensor into newly
allocated memory on every save, so most of the time the training thread is blocked goes to faulting in
fresh pages. :class:`HierarchyStager` copies into one arena per state (pinned where CUDA exists, as
tierckpt's host tier's buffers), allocated at the first save and reused by the next ones once nothing
holds the previous staged copy, on a background thread if asked.
"""

from __future__ import annotations

import copy
import threading
import weakref
from collections.abc import Callable
from concurrent.futures import Future, ThreadPoolExecutor
from typing import Any

import torch
from torch.distributed.checkpoint.staging import AsyncStager

from tierckpt.dcp._copy import copy_tensors

__all__ = ["HierarchyStager"]

_ALIGN = 64  # each tensor's offset in its arena: a cache line, a multiple of every dtype's size
_PLAIN = (str, bytes, int, float, bool, complex, type(None), torch.dtype, torch.device, torch.Size)


class _Arena:
    """The buffers of one staged copy: one for the plain tensors, one per DTensor shard (a DTensor over a
    view that does not start its storage does not pickle: torch 2.13 crashes sending it to another
    process); reusable once every staged tensor of its last copy is gone (weak references say)."""

    def __init__(self, *, pin: bool | None, share: bool) -> None:
        self.pin, self.share = pin, share
        self.buf: torch.Tensor | None = None
        self.own: list[torch.Tensor] = []
        self.views: list[weakref.ref[torch.Tensor]] = []
        self.allocations = 0

    def busy(self) -> bool:
        return any(r() is not None for r in self.views)

    def _alloc(self, nbytes: int) -> torch.Tensor:
        self.allocations += 1
        if self.share:
            shared: torch.Tensor = torch.empty(max(nbytes, 1), dtype=torch.uint8).share_memory_()
            return shared
        return torch.empty(max(nbytes, 1), dtype=torch.uint8, pin_memory=bool(self.pin))

    def plain(self, nbytes: int) -> torch.Tensor:
        """The plain tensors' buffer, of at least ``nbytes`` (grown where smaller)."""
        if self.buf is None or self.buf.numel() < nbytes:
            self.buf = None
            self.buf = self._alloc(nbytes)
        return self.buf

    def shard(self, i: int, nbytes: int) -> torch.Tensor:
        """The ``i``-th DTensor shard's buffer: ``nbytes`` at the start of its own storage."""
        if i == len(self.own):
            self.own.append(self._alloc(nbytes))
        elif self.own[i].numel() < nbytes:
            self.own[i] = self._alloc(nbytes)
        return self.own[i][:nbytes]


class HierarchyStager(AsyncStager):
    """Stages ``dcp.async_save``'s state into host buffers reused across saves.

    Pass it as ``dcp.async_save(sd, storage_writer=..., async_stager=stager)`` with any storage writer
    (a :class:`~tierckpt.dcp.HierarchyWriter` or DCP's own), keep it for the whole run (its buffers are
    what makes the later saves fast) and ``close()`` it at the end.

    Tensors (a DTensor's local shard, its placement kept) are copied into an arena of the state's size;
    an arena is reused by a later save once nothing holds the staged copy it last held (DCP drops it when
    that save's upload is done), else a new one is made (at most ``arenas`` are kept). Other values are
    deep-copied. Tensors that are one object in the state are one in the staged copy.

    Args:
        background: copy on the stager's thread: ``stage`` returns a future at once and
            ``dcp.async_save`` returns DCP's ``AsyncSaveResponse`` (``staging_completion``: when the
            state may change again; ``upload_completion``: the save). Default: copy on the caller's
            thread, and ``dcp.async_save`` returns the save's future as with DCP's default stager.
        share_memory: make the arenas shared memory, for DCP's process executor (the staged copy then
            reaches the checkpoint process without another copy).
        pin_memory: page-lock the arenas (default: where CUDA is available; not with ``share_memory``).
        arenas: how many arenas to keep for reuse (2: one being saved while the next save stages).
    """

    def __init__(
        self,
        *,
        background: bool = False,
        share_memory: bool = False,
        pin_memory: bool | None = None,
        arenas: int = 2,
    ) -> None:
        if arenas < 1:
            raise ValueError(f"arenas: expected at least 1, got {arenas}")
        self._synchronize_after_execute = False  # staging is done when stage() returns (or its future)
        self._pin = False if share_memory else (torch.cuda.is_available() if pin_memory is None else pin_memory)
        self._share, self._keep = share_memory, arenas
        self._arenas: list[_Arena] = []
        self._lock = threading.Lock()
        self._pool = ThreadPoolExecutor(max_workers=1, thread_name_prefix="tierckpt-stage") if background else None
        self._last: Future[Any] | None = None
        self._closed = False
        #: buffers allocated so far (a save that reuses an arena of its size allocates none)
        self.allocations = 0

    def stage(self, state_dict: dict[str, Any]) -> Future[dict[str, Any]] | dict[str, Any]:
        """A copy of ``state_dict`` that later changes to it do not reach (a future of it in the background).

        Raises:
            RuntimeError: the stager is closed.
        """
        if self._closed:
            raise RuntimeError("HierarchyStager.stage() after close()")
        if self._pool is None:
            return self._stage(state_dict)
        self._last = self._pool.submit(self._stage, state_dict)
        return self._last

    def synchronize_staging(self) -> None:
        """Wait for the last background staging (no-op when staging on the caller's thread)."""
        if self._last is not None:
            self._last.result()

    def close(self) -> None:
        """Wait for a staging in flight, stop the thread and drop the arenas."""
        self._closed = True
        if self._pool is not None:
            self._pool.shutdown(wait=True)
        with self._lock:
            self._arenas.clear()

    # -- staging -------------------------------------------------------------------------------------------
    def _stage(self, state_dict: dict[str, Any]) -> dict[str, Any]:
        tensors: dict[int, tuple[torch.Tensor, bool]] = {}  # id -> (tensor, a DTensor's shard)
        _walk(state_dict, lambda t, shard: tensors.setdefault(id(t), (t, shard)))
        offsets, total = [], 0
        for t, shard in tensors.values():
            offsets.append(total)
            total += 0 if shard else -(-_nbytes(t) // _ALIGN) * _ALIGN
        arena = self._arena()
        before = arena.allocations
        buf, shards = arena.plain(total), 0
        staged: dict[int, torch.Tensor] = {}
        pairs: list[tuple[torch.Tensor, torch.Tensor]] = []
        cuda = False
        for (key, (t, shard)), off in zip(tensors.items(), offsets, strict=True):
            n = _nbytes(t)
            raw = arena.shard(shards, n) if shard else buf[off : off + n]
            shards += shard
            view = raw.view(t.dtype).view(t.shape)
            cuda |= t.device.type == "cuda"
            pairs.append((view, t))
            staged[key] = view
        copy_tensors(pairs)
        if cuda:
            torch.cuda.synchronize()
        arena.views = [weakref.ref(v) for v in staged.values()]
        self.allocations += arena.allocations - before
        return _rebuild(state_dict, staged, {})  # type: ignore[no-any-return]

    def _arena(self) -> _Arena:
        """The newest free arena (grown by the caller as needed), else a new one (the oldest dropped)."""
        with self._lock:
            free = [a for a in self._arenas if not a.busy()]
            if free:
                self._arenas.remove(free[-1])
                self._arenas.append(free[-1])  # newest last: the first dropped are the least used
                return free[-1]
            arena = _Arena(pin=self._pin, share=self._share)
            self._arenas.append(arena)
            del self._arenas[: -self._keep]
            return arena


def _local(t: torch.Tensor) -> torch.Tensor | None:
    """A DTensor's local shard (None for any other tensor)."""
    local = getattr(t, "_local_tensor", None)
    return local if isinstance(local, torch.Tensor) and hasattr(t, "_spec") else None


def _copied(t: torch.Tensor) -> bool:
    """Whether ``t`` goes into the arena: a plain tensor (or Parameter) of strided memory; another kind
    (a ShardedTensor, a sparse or meta tensor) is deep-copied."""
    return type(t) in (torch.Tensor, torch.nn.Parameter) and t.layout == torch.strided and t.device.type != "meta"


def _nbytes(t: torch.Tensor) -> int:
    return t.numel() * t.element_size()


def _walk(obj: Any, see: Callable[[torch.Tensor, bool], Any]) -> None:
    """Call ``see(tensor, is a DTensor's shard)`` on each tensor to copy in ``obj``, in order."""
    if isinstance(obj, torch.Tensor):
        local = _local(obj)
        t = obj if local is None else local
        if _copied(t):
            see(t, local is not None)
    elif isinstance(obj, dict):
        for v in obj.values():
            _walk(v, see)
    elif isinstance(obj, (list, tuple)):
        for v in obj:
            _walk(v, see)


def _staged_tensor(t: torch.Tensor, staged: dict[int, torch.Tensor]) -> Any:
    """The staged copy of ``t``: its arena view; a DTensor over its shard's (the same placement and global
    shape: DTensor's own constructor); a deep copy of a tensor the arena does not hold."""
    local = _local(t)
    if id(t if local is None else local) not in staged:
        return copy.deepcopy(t)
    if local is None:
        return staged[id(t)]
    make: Any = type(t)
    return make(staged[id(local)], t._spec, requires_grad=False)  # type: ignore[attr-defined]


def _rebuild(obj: Any, staged: dict[int, torch.Tensor], memo: dict[int, Any]) -> Any:
    """``obj`` with each tensor replaced by its staged copy; other values deep-copied."""
    if isinstance(obj, _PLAIN):
        return obj
    if id(obj) in memo:
        return memo[id(obj)]
    out: Any
    if isinstance(obj, torch.Tensor):
        out = _staged_tensor(obj, staged)
    elif isinstance(obj, dict):
        out = copy.copy(obj)  # its own type (OrderedDict ...), then its values replaced
        for k, v in obj.items():
            out[k] = _rebuild(v, staged, memo)
    elif isinstance(obj, list):
        out = [_rebuild(v, staged, memo) for v in obj]
    elif isinstance(obj, tuple):
        items = [_rebuild(v, staged, memo) for v in obj]
        out = type(obj)(*items) if hasattr(obj, "_fields") else type(obj)(items)
    else:
        out = copy.deepcopy(obj)
    memo[id(obj)] = out
    return out
