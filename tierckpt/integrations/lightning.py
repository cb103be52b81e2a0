"""PyTorch Lightning: a ``CheckpointIO`` plugin that saves and loads through a :class:`~tierckpt.Hierarchy`.

Lightning names a checkpoint by a path (``epoch=3-step=300.ckpt``, ``last.ckpt``) and finds checkpoints
by looking for files; a hierarchy names one by a step. :class:`HierarchyCheckpointIO` maps the one onto
the other:

* each ``save_checkpoint(checkpoint, path)`` is a save of the hierarchy as a step of its own: the
  checkpoint's ``global_step``, or the next free step where that one is taken (``save_last=True``
  saves ``last.ckpt`` at the same global step as a top-k file);
* at ``path`` it writes a small pointer file naming that step (tierckpt/integrations/_pointers.py), once
  the step is committed on the first persistent tier the save goes to: a job killed before then finds
  the previous pointer at ``last.ckpt``, whose checkpoint did survive, and ``ckpt_path="last"`` (which
  lists the directory and compares modification times) resumes from it;
* ``load_checkpoint(path)`` reads the pointer and restores its step from the fastest tier holding it
  (a file that is not a pointer, such as an earlier ``torch.save`` checkpoint, is loaded with
  ``torch.load`` as Lightning would);
* ``remove_checkpoint(path)`` (top-k retention) removes the pointer, and deletes the step from the
  hierarchy once no pointer in the directories it wrote names it (a pointer rewritten to a newer step,
  ``last.ckpt`` at each save, releases its old step the same way).

Lightning saves from global rank 0 only (single device, DDP, FSDP's full state dict); that rank's
hierarchy is opened alone (world size 1). The other ranks read the same checkpoint through a read-only
hierarchy when they load. See docs/integrations.md.
"""

from __future__ import annotations

import logging
import os
import threading
from collections.abc import Mapping
from concurrent.futures import Future
from typing import Any

import torch
from lightning.fabric.plugins.io.checkpoint_io import CheckpointIO
from lightning.fabric.plugins.io.torch_io import TorchCheckpointIO
from lightning.pytorch.callbacks import Callback
from lightning_utilities.core.apply_func import apply_to_collection

from tierckpt import CheckpointNotFoundError, Hierarchy, SaveHandle, SoloCoordinator, TierckptError
from tierckpt.integrations._pointers import Pointer, new_id, read_pointer, referenced_steps, write_pointer
from tierckpt.integrations._saving import Background, delete_steps, newest_step, next_step

__all__ = ["AsyncHierarchyCheckpointIO", "HierarchyCheckpointIO"]

log = logging.getLogger(__name__)

KEY = "tierckpt"  #: the key of the save's id in the saved state (taken out again when it is loaded)
_RANK_VARS = ("RANK", "LOCAL_RANK", "NODE_RANK", "SLURM_PROCID")


def _is_global_zero() -> bool:
    """Whether this process is the job's global rank 0: torch.distributed's rank where a process group is
    up, else the launchers' variables (Lightning's own launcher and torchrun set them in every process
    but the first one it starts)."""
    if torch.distributed.is_available() and torch.distributed.is_initialized():
        return torch.distributed.get_rank() == 0
    return all(os.environ.get(v, "0").strip() in ("", "0") for v in _RANK_VARS)


class HierarchyCheckpointIO(CheckpointIO):
    """Lightning's checkpoints through a tierckpt hierarchy: ``Trainer(plugins=[HierarchyCheckpointIO(cfg)])``.

    ``save_checkpoint`` returns once the checkpoint's bytes are in the top tier (training may change its
    tensors from then on); the copies to the lower tiers, the pointer file at the path and the deletion
    of released steps follow in the background. This is what Lightning's ``AsyncCheckpointIO`` offers,
    without its copy of every tensor on the training thread. A failure of a background copy is raised
    by the next ``save_checkpoint`` or by ``teardown``.

    Args:
        config: the hierarchy: a YAML file's path, or a mapping with the YAML schema (relative tier
            paths relative to the current directory when this is built), as for
            :meth:`Hierarchy.from_config`.
        allow_pickle: pickle the values of the checkpoint that are neither tensors nor plain values
            (objects among the hyperparameters, say) when saving, and accept them when loading. Without
            it such a value fails the save with a ``StateError`` naming its key, and nothing is unpickled.
        prefetch: on global rank 0, open the hierarchy at once and start copying its newest step up to
            the top tier (``Hierarchy.prefetch``), so that a resume reads it from memory once the model
            is built. Ignored with ``readonly``.
        readonly: only load (evaluation next to a running job): the hierarchy is opened read-only and
            ``save_checkpoint`` raises.
        blocking: ``save_checkpoint`` returns only once every tier the save goes to has committed it
            (as ``torch.save`` does) and its pointer is written.

    Raises:
        ConfigError: the config is invalid (with ``prefetch`` on rank 0: here, else at the first save or load).
    """

    #: with ``prefetch``, the future of the newest step's climb to the top tier (``Hierarchy.prefetch``)
    prefetched: Future[str] | None

    def __init__(
        self,
        config: str | os.PathLike[str] | Mapping[str, Any],
        *,
        allow_pickle: bool = False,
        prefetch: bool = True,
        readonly: bool = False,
        blocking: bool = False,
    ) -> None:
        self.config = config if isinstance(config, Mapping) else os.fspath(config)
        self.base_dir = os.getcwd()
        self.allow_pickle = allow_pickle
        self.readonly = readonly
        self.blocking = blocking
        self._init_runtime()
        if prefetch and not readonly and _is_global_zero():
            self.prefetched = self.hierarchy.prefetch()

    def _init_runtime(self) -> None:
        self._h: Hierarchy | None = None
        self._lock = threading.Lock()
        self._pending: dict[str, Pointer] = {}  # path -> its newest save, until its pointer is written
        self._dirs: set[str] = set()  # the directories this process wrote pointers in
        self._released: set[int] = set()  # steps a pointer stopped naming: deleted once none names them
        self._background = Background("tierckpt-lightning")
        self._newest: int | None = None  # the newest step saved or listed
        self.prefetched = None

    def __getstate__(self) -> dict[str, Any]:
        """Settings only (``ddp_spawn`` pickles the trainer's plugins): the hierarchy is opened again where
        it is used."""
        return {k: getattr(self, k) for k in ("config", "base_dir", "allow_pickle", "readonly", "blocking")}

    def __setstate__(self, state: dict[str, Any]) -> None:
        self.__dict__.update(state)
        self._init_runtime()

    # -- the hierarchy ------------------------------------------------------------------------------------
    @property
    def hierarchy(self) -> Hierarchy:
        """The hierarchy, opened on first use: writable on global rank 0 (unless ``readonly``), read-only
        on the other ranks (Lightning saves from rank 0 only)."""
        if self._h is None:
            ro = self.readonly or not _is_global_zero()
            coordinator = SoloCoordinator(rank=0, world_size=1)  # rank 0's checkpoint, whoever reads it
            if isinstance(self.config, Mapping):
                self._h = Hierarchy.from_config(self.config, self.base_dir, readonly=ro, coordinator=coordinator)
            else:
                self._h = Hierarchy.from_yaml(self.config, readonly=ro, coordinator=coordinator)
        return self._h

    # -- save ---------------------------------------------------------------------------------------------
    def save_checkpoint(self, checkpoint: dict[str, Any], path: Any, storage_options: Any | None = None) -> None:
        """Save ``checkpoint`` as a step of the hierarchy, and ``path`` as the name that finds it.

        Raises:
            TypeError: ``storage_options`` given (there are none).
            TierckptError: called on a rank other than global rank 0, or with ``readonly``.
            StateError: a value of ``checkpoint`` is neither a tensor nor a plain value (see ``allow_pickle``).
            Exception: a background copy of an earlier save failed (its error).
        """
        if storage_options is not None:
            raise TypeError(f"{type(self).__name__}.save_checkpoint takes no storage_options (got {storage_options!r})")
        if self.readonly:
            raise TierckptError(f"{type(self).__name__} was built with readonly=True: it cannot save {path}")
        if not _is_global_zero():
            raise TierckptError(
                f"{type(self).__name__} saves global rank 0's checkpoint, but save_checkpoint({os.fspath(path)!r}) "
                "was called on another rank (a strategy that saves on every rank is not supported)"
            )
        self._settle_earlier()
        h = self.hierarchy
        key = os.path.abspath(os.fspath(path))
        os.makedirs(os.path.dirname(key), exist_ok=True)  # as Lightning's own plugin does: a link may go there now
        step = self._next_step(h, checkpoint.get("global_step"))
        pointer = Pointer(step, new_id(), checkpoint.get("global_step"))
        state = {**self._snapshot(checkpoint), KEY: {"id": pointer.id}}
        handle = h.save(state, step=step, allow_pickle=self.allow_pickle, blocking=self.blocking)
        self._await_staged(handle)
        with self._lock:
            self._pending[key] = pointer
            self._dirs.add(os.path.dirname(key))
        what = f"writing the pointer file {key} (step {step})"
        self._background.publish_when_durable(h, handle, lambda: self._publish(key, pointer), what)
        if self.blocking:
            handle.wait()
            self._background.drain()
            self._background.raise_error()

    def _snapshot(self, checkpoint: dict[str, Any]) -> dict[str, Any]:
        """The checkpoint as it is handed to ``Hierarchy.save`` (the async form copies what may change
        before it waits for the staging)."""
        return checkpoint

    def _await_staged(self, handle: SaveHandle) -> None:
        """Block until the save's bytes are out of the training state (the async form defers this)."""
        handle.staged.result()

    def _next_step(self, h: Hierarchy, global_step: object) -> int:
        if self._newest is None:
            self._newest = newest_step(h)
        self._newest = next_step(self._newest, global_step)
        return self._newest

    def _publish(self, key: str, pointer: Pointer) -> None:
        """Write ``pointer`` at ``key`` unless a newer save or a removal of the path came first; the step
        the file named before is released."""
        with self._lock:
            if self._pending.get(key) is not pointer:
                return
            try:
                old = read_pointer(key)
            except (FileNotFoundError, ValueError):
                old = None
            write_pointer(key, pointer)
            del self._pending[key]
            if old is not None and old.step != pointer.step:
                self._released.add(old.step)

    def _settle_earlier(self) -> None:
        """Raise what failed in the background since the last call; delete the steps no pointer names."""
        self._background.settle()
        self._delete_released(self.hierarchy)

    # -- remove -------------------------------------------------------------------------------------------
    def remove_checkpoint(self, path: Any) -> None:
        """Remove the file at ``path`` (a pointer, a link to one, or a ``torch.save`` file); the step a
        pointer named is deleted from the hierarchy once no pointer names it."""
        key = os.path.abspath(os.fspath(path))
        with self._lock:
            pending = self._pending.pop(key, None)
            if pending is not None:
                self._released.add(pending.step)
            try:
                old = read_pointer(key)
            except (FileNotFoundError, ValueError, IsADirectoryError):
                old = None
            if old is not None:
                self._released.add(old.step)
            if os.path.lexists(key) and (old is not None or os.path.islink(key)):
                os.remove(key)
        if os.path.lexists(key):  # not a pointer: what Lightning's own plugin would remove
            TorchCheckpointIO().remove_checkpoint(key)
        if not self.readonly and _is_global_zero():
            self._delete_released(self.hierarchy)

    def _delete_released(self, h: Hierarchy) -> None:
        """Delete from ``h`` each released step that no pointer (written or pending) names (a step still
        named is released again when that pointer goes)."""
        with self._lock:
            if not self._released:
                return
            named = referenced_steps(self._dirs) | {p.step for p in self._pending.values()}
            gone, self._released = self._released - named, set()
        delete_steps(h, gone)

    # -- load ---------------------------------------------------------------------------------------------
    def load_checkpoint(
        self, path: Any, map_location: Any | None = None, weights_only: bool | None = None
    ) -> dict[str, Any]:
        """Restore the checkpoint ``path`` names, from the fastest tier holding its step.

        Args:
            path: a pointer file (or a ``torch.save`` checkpoint, loaded with ``torch.load``).
            map_location: a device (``"cuda:0"``, ``torch.device``) to move the tensors to; anything else
                leaves them on the CPU, where they are read (Lightning moves them where they belong).
            weights_only: True: accept no pickled value even with ``allow_pickle``.

        Raises:
            FileNotFoundError: nothing at ``path`` (and no save of it pending in this process).
            CheckpointNotFoundError: the step the pointer names is gone from the hierarchy, or holds
                another checkpoint now.
        """
        key = os.path.abspath(os.fspath(path))
        with self._lock:
            pointer = self._pending.get(key)
        if pointer is None:
            try:
                pointer = read_pointer(key)
            except FileNotFoundError:
                raise FileNotFoundError(f"Checkpoint file not found: {os.fspath(path)}") from None
            if pointer is None:
                return TorchCheckpointIO().load_checkpoint(key, **_torch_load_args(map_location, weights_only))
        state: dict[str, Any] = self.hierarchy.restore(
            pointer.step, allow_pickle=self.allow_pickle and weights_only is not True
        )
        meta = state.pop(KEY, None) if isinstance(state, dict) else None
        if not isinstance(meta, dict) or meta.get("id") != pointer.id:
            raise CheckpointNotFoundError(
                f"{os.fspath(path)} names step {pointer.step} of the hierarchy, which now holds another "
                "checkpoint (the step was deleted and saved again)"
            )
        if isinstance(map_location, (str, torch.device)):
            device = torch.device(map_location)
            state = apply_to_collection(state, torch.Tensor, lambda t: t.to(device))
        return state

    # -- the end ------------------------------------------------------------------------------------------
    def teardown(self) -> None:
        """Finish every copy and pointer, delete released steps, close the hierarchy (it opens again on
        the next save or load); raise a background failure."""
        h, self._h = self._h, None
        if h is None:
            self._background.raise_error()
            return
        try:
            h.flush()
            self._background.drain()
            if not h.readonly:
                self._delete_released(h)
        finally:
            self._newest = None
            self._background.forget()
            h.close()
        self._background.raise_error()


def _torch_load_args(map_location: Any, weights_only: bool | None) -> dict[str, Any]:
    out: dict[str, Any] = {"weights_only": weights_only}
    if map_location is not None:
        out["map_location"] = map_location
    return out


class AsyncHierarchyCheckpointIO(HierarchyCheckpointIO):
    """:class:`HierarchyCheckpointIO` whose ``save_checkpoint`` does not wait for the staging either: the
    copy into the top tier overlaps the next step's forward and backward, and is waited for right before
    the next optimizer step (the only place Lightning changes the weights and the optimizer's state).
    The module's buffers (batch norm statistics, which a forward pass changes) are copied first.

    Add its :attr:`callback` to the trainer's callbacks too, which is what waits:
    ``Trainer(plugins=[io], callbacks=[io.callback, ...])``. Without it, saves wait for the staging as
    :class:`HierarchyCheckpointIO`'s do (a warning says so). Tensors your own code changes in place
    outside the optimizer step (an EMA of the weights in a hook, say) are not covered.

    Args: as for :class:`HierarchyCheckpointIO`.
    """

    def __init__(self, config: str | os.PathLike[str] | Mapping[str, Any], **kwargs: Any) -> None:
        super().__init__(config, **kwargs)
        self.callback = _WaitForStaging()

    def __setstate__(self, state: dict[str, Any]) -> None:
        super().__setstate__(state)
        self.callback = _WaitForStaging()

    def _snapshot(self, checkpoint: dict[str, Any]) -> dict[str, Any]:
        module = self.callback.module
        sd = checkpoint.get("state_dict")
        if module is None or not isinstance(sd, dict):
            return checkpoint
        params = {p.data_ptr() for p in module.parameters()}
        copied = {
            k: v.clone() if isinstance(v, torch.Tensor) and v.data_ptr() not in params else v for k, v in sd.items()
        }
        return {**checkpoint, "state_dict": type(sd)(copied)}

    def _await_staged(self, handle: SaveHandle) -> None:
        if self.callback.module is None:
            if not self.callback.warned:
                log.warning("AsyncHierarchyCheckpointIO: its callback is not in the trainer's callbacks: saves wait")
                self.callback.warned = True
            handle.staged.result()
        else:
            self.callback.add(handle)

    def teardown(self) -> None:
        self.callback.wait()
        super().teardown()


class _WaitForStaging(Callback):
    """Waits for the staging of the async saves before the optimizer changes what they read."""

    def __init__(self) -> None:
        self.module: torch.nn.Module | None = None
        self.warned = False
        self._unstaged: list[SaveHandle] = []

    def add(self, handle: SaveHandle) -> None:
        self._unstaged.append(handle)

    def wait(self) -> None:
        """Block until every save handed over so far is staged; raise a staging failure."""
        unstaged, self._unstaged = self._unstaged, []
        for hd in unstaged:
            hd.staged.result()

    def setup(self, trainer: Any, pl_module: Any, stage: str) -> None:
        self.module = pl_module

    def on_before_optimizer_step(self, trainer: Any, pl_module: Any, optimizer: Any) -> None:
        self.wait()

    def on_train_end(self, trainer: Any, pl_module: Any) -> None:
        self.wait()

    def teardown(self, trainer: Any, pl_module: Any, stage: str) -> None:
        self.wait()
        self.module = None
