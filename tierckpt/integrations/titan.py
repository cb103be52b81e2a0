"""torchtitan: a checkpoint manager that saves and loads a torchtitan job through a :class:`~tierckpt.Hierarchy`.

torchtitan builds its checkpointer from the job config's ``checkpoint`` field, whose type says which
manager class it builds (``Configurable``: ``config.checkpoint.build(...)`` constructs the class that
declares the config). :class:`HierarchyCheckpointManager` implements torchtitan's ``BaseCheckpointManager``
contract, so a job selects it by giving its config::

    from tierckpt.integrations.titan import HierarchyCheckpointManager

    config.checkpoint = HierarchyCheckpointManager.Config(enable=True, hierarchy="tiers/local.yaml", interval=500)

Every rank saves its own part of the model, optimizer, LR schedulers, data loader and trainer state
(DTensors as their shards) as one step of the hierarchy, the step being torchtitan's step; training
goes on once the bytes are in the top tier (torchtitan waits for that before the next optimizer step,
``maybe_wait_for_staging``), the lower tiers follow in the background. A load restores the newest
committed step (or ``load_step``) from the fastest tier holding it, in place, resharded for this job's
meshes. ``keep_latest_k`` deletes older steps with :meth:`Hierarchy.delete`. See docs/integrations.md,
"torchtitan".
"""

from __future__ import annotations

import contextlib
import logging
from concurrent.futures import Future
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import torch
from torchtitan.components.checkpointer.base import (
    DATALOADER,
    LR_SCHEDULER,
    MODEL,
    OPTIMIZER,
    BaseCheckpointManager,
    ModelWrapper,
)
from torchtitan.config import TORCH_DTYPE_MAP

from tierckpt import CheckpointNotFoundError, Hierarchy, SaveHandle

if TYPE_CHECKING:
    from torch import nn

__all__ = ["HierarchyCheckpointManager"]

log = logging.getLogger(__name__)


def _when_done(handle: SaveHandle) -> Future[None]:
    """A future that resolves once every tier the save goes to has committed it (or holds its first error)."""
    out: Future[None] = Future()
    futures = [handle.staged, *handle.durable.values()]

    def check(_: object) -> None:
        if all(f.done() for f in futures) and not out.done():
            err = next((f.exception() for f in futures if f.exception() is not None), None)
            with contextlib.suppress(Exception):  # another callback set it first
                out.set_exception(err) if err is not None else out.set_result(None)

    for f in futures:
        f.add_done_callback(check)
    return out


class HierarchyCheckpointManager(BaseCheckpointManager):
    """torchtitan's checkpointer, through a hierarchy: select it with its :class:`Config` as the job's
    ``checkpoint`` config.

    Args:
        config: the manager's settings (torchtitan's own, and ``hierarchy``, ``blocking``, ``prefetch``).
        dataloader, model_parts, optimizers, lr_schedulers, states, sd_adapter, base_folder: what
            torchtitan's trainer passes every checkpoint manager (``states``: the trainer's own state,
            ``{"train_state": trainer}``).

    Raises:
        ValueError: ``hierarchy`` is not given, or ``last_save_in_hf`` is set (write the final step out
            with ``tierckpt export``).
    """

    @dataclass(kw_only=True, slots=True)
    class Config(BaseCheckpointManager.Config):
        hierarchy: str = ""
        """The hierarchy's YAML file (docs/config.md); its relative tier paths are relative to it."""

        blocking: bool = False
        """Return from each save only once every tier has committed it."""

        prefetch: bool = True
        """When the manager is built, start copying the newest step up to the top tier (Hierarchy.prefetch)."""

        def __post_init__(self) -> None:
            BaseCheckpointManager.Config.__post_init__(self)
            if self.enable and not self.hierarchy:
                raise ValueError("checkpoint.hierarchy: the hierarchy's YAML file is required (docs/config.md)")
            if self.last_save_in_hf:
                raise ValueError(
                    "checkpoint.last_save_in_hf is not supported by HierarchyCheckpointManager: write the final "
                    "step out with `tierckpt export CONFIG --format safetensors` (docs/integrations.md)"
                )

    def __init__(
        self,
        config: Config,
        *,
        dataloader: Any,
        model_parts: list[nn.Module],
        optimizers: Any,
        lr_schedulers: Any,
        states: dict[str, Any],
        sd_adapter: Any,
        base_folder: str = "",
    ) -> None:
        self.enable = config.enable
        if not self.enable:
            return
        self.save_future: Future[None] | None = None
        self.config = config
        self.sd_adapter = sd_adapter
        self.states = states
        self.states.update(
            {
                MODEL: ModelWrapper(model_parts),
                OPTIMIZER: optimizers,
                DATALOADER: dataloader,
                LR_SCHEDULER: lr_schedulers,
            }
        )
        self.export_dtype = TORCH_DTYPE_MAP[config.export_dtype]
        self._handle: SaveHandle | None = None
        self.h: Hierarchy | None = Hierarchy.from_yaml(config.hierarchy, readonly=config.load_only)
        self._steps = sorted(c.step for c in self.h.checkpoints() if c.tiers)  # committed somewhere
        self.prefetched: Future[str] | None = None  # the prefetch of the newest step, if any
        if config.prefetch and self._steps and not config.load_only:
            self.prefetched = self.h.prefetch()
        log.info("checkpointing through the hierarchy of %s (%d steps in it)", config.hierarchy, len(self._steps))

    def __del__(self) -> None:
        with contextlib.suppress(Exception):
            self.close()

    # -- save -------------------------------------------------------------------------------------------
    def _should_save(self, step: int, last_step: bool) -> bool:
        if self.config.load_only:
            return False
        if step == 1 and self.config.enable_first_step_checkpoint:
            return True
        return last_step or step % self.config.interval == 0

    def _parts(self) -> dict[str, Any]:
        return {name: part for name, part in self.states.items() if part is not None}

    @torch.no_grad()
    def _save(self, curr_step: int, last_step: bool = False) -> bool:
        if not self._should_save(curr_step, last_step):
            return False
        h = self._open()
        if self.save_future is not None and self.save_future.done():
            self._wait_for_saving()  # raises a failure of the previous save
        if last_step and self.config.last_save_model_only:
            model = self.states[MODEL].state_dict()
            cast = {k: v.to(self.export_dtype) if v.is_floating_point() else v for k, v in model.items()}
            handle = h.save({MODEL: cast}, step=curr_step, blocking=True)
        else:
            state = {name: part.state_dict() for name, part in self._parts().items()}
            handle = h.save(state, step=curr_step, blocking=self.config.blocking or last_step)
        self._handle, self.save_future = handle, _when_done(handle)
        self._steps = sorted({*self._steps, curr_step})
        self._purge(h)
        return True

    def _purge(self, h: Hierarchy) -> None:
        """``keep_latest_k``: delete every step but the newest k (every rank deletes the same steps)."""
        k = self.config.keep_latest_k
        if k <= 0 or len(self._steps) <= k:
            return
        old, self._steps = self._steps[:-k], self._steps[-k:]
        for step in old:
            with contextlib.suppress(CheckpointNotFoundError):  # gone already
                h.delete(step)

    def _maybe_wait_for_staging(self) -> None:
        if self._handle is not None:
            self._handle.staged.result()

    def _wait_for_saving(self) -> None:
        future, self.save_future = self.save_future, None
        if future is not None:
            future.result()
        if self._handle is not None:
            self._handle.wait()

    # -- load -------------------------------------------------------------------------------------------
    @torch.no_grad()
    def _load(self, step: int = -1) -> bool:
        h = self._open()
        if step == -1:
            step = max((c.step for c in h.checkpoints() if c.tiers), default=-1)
        if step == -1:
            return self._initial_load()
        model_only = step == 0  # a seed checkpoint (create_seed_checkpoint), as torchtitan reads it
        parts = {MODEL: self.states[MODEL]} if model_only else self._parts()
        target = {n: p.state_dict() if n in (MODEL, OPTIMIZER) else None for n, p in parts.items()}  # None: whole
        log.info("loading step %d%s from the hierarchy", step, " (the model only)" if model_only else "")
        state = h.restore(step, into=target)
        for name, part in parts.items():
            if name not in self.config.exclude_from_loading:
                part.load_state_dict(state[name])
        return True

    def _initial_load(self) -> bool:
        """No step in the hierarchy: ``initial_load_path`` (a torchtitan DCP folder, or Hugging Face
        safetensors with ``initial_load_in_hf``), read with DCP as torchtitan reads it; else a fresh start."""
        path = self.config.initial_load_path
        if not path and not self.config.initial_load_in_hf:
            log.info("no checkpoint in the hierarchy: a fresh start")
            return False
        import torch.distributed.checkpoint as dcp

        model = self.states[MODEL]
        if self.config.initial_load_in_hf:
            if self.sd_adapter is None:
                raise ValueError("checkpoint.initial_load_in_hf needs the model's state dict adapter (sd_adapter)")
            hf = self.sd_adapter.to_hf(model.state_dict())
            path = path or self.sd_adapter.hf_assets_path
            reader = self.sd_adapter.get_hf_storage_reader(path, self.config.initial_load_in_hf_quantized)
            dcp.load(hf, storage_reader=reader)
            model.load_state_dict(self.sd_adapter.from_hf(hf))
            return True
        if self.config.initial_load_model_only:
            sd = model.state_dict()
        else:  # torchtitan's layout: the model's keys at the top, the other parts under their names
            sd = {n: p for n, p in self._parts().items() if n != MODEL and n not in self.config.exclude_from_loading}
            sd.update(model.state_dict())
        log.info("no checkpoint in the hierarchy: loading %s", path)
        dcp.load(sd, checkpoint_id=path)
        model.load_state_dict(sd)
        return True

    # -- the hierarchy ----------------------------------------------------------------------------------
    def _open(self) -> Hierarchy:
        if self.h is None:
            raise RuntimeError("HierarchyCheckpointManager: used after close()")
        return self.h

    def _close(self) -> None:
        """Finish every copy (raising a failure) and close the hierarchy."""
        h, self.h = getattr(self, "h", None), None
        if h is not None:
            h.close()
