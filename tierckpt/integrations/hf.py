"""Hugging Face ``transformers``: a ``Trainer`` whose checkpoints go through a :class:`~tierckpt.Hierarchy`.

The Trainer writes a checkpoint as a folder, ``checkpoint-<global step>/`` in ``output_dir`` (the weights
with ``save_pretrained``, ``optimizer.pt``, ``scheduler.pt``, ``scaler.pt``, ``rng_state.pth``,
``trainer_state.json``), finds the newest one by listing those folders (``resume_from_checkpoint=True``)
and rotates them (``save_total_limit``) by removing folders. :class:`HierarchyTrainerMixin` keeps the
folders, and puts what is in them through a hierarchy instead:

* ``_save_checkpoint`` saves the model's ``state_dict()``, the optimizer's, the scheduler's, the
  scaler's, the RNG states (``tierckpt.rng_state``: no pickle) and the trainer state as one step of the
  hierarchy, and returns once the bytes are in the top tier. The folder, holding ``trainer_state.json``
  and a pointer file (``tierckpt.json``, tierckpt/integrations/_pointers.py) naming the step, is written
  under a hidden name and renamed into place once the step is committed on the first persistent tier the
  save goes to, in the background: a job killed before then finds the previous folder, whose checkpoint
  survived. The Trainer's own rotation runs then too, and the steps of the folders it removed are
  deleted from the hierarchy (``Hierarchy.delete``) at the next save or at the end of ``train``.
* ``_load_from_checkpoint`` (the weights, in place), ``_load_optimizer_and_scheduler``, ``_load_scaler``
  and ``_load_rng_state`` read a folder's pointer and take their part of one restore of its step, from the
  fastest tier holding it; a folder without a pointer (the Trainer's own) is loaded as the Trainer would.

Why a mixin over the Trainer's private checkpoint methods rather than a ``TrainerCallback``: ``on_save``
is called after the Trainer has written the folder (the slow write is done by then), and no callback is
called when a checkpoint is loaded. These methods have had these names and arguments since
``transformers`` 4.50 (tested with 5.24). See docs/integrations.md, "Hugging Face".
"""

from __future__ import annotations

import contextlib
import dataclasses
import json
import logging
import os
import re
import secrets
import shutil
import threading
from collections.abc import Mapping
from concurrent.futures import Future
from typing import Any

import transformers
from transformers import Trainer
from transformers.trainer_callback import ExportableState
from transformers.trainer_utils import PREFIX_CHECKPOINT_DIR

from tierckpt import CheckpointNotFoundError, Hierarchy, SoloCoordinator, StateError
from tierckpt.integrations._pointers import Pointer, new_id, read_pointer, write_pointer
from tierckpt.integrations._saving import Background, delete_steps, newest_step, next_step
from tierckpt.resume import rng_state, set_rng_state

__all__ = ["POINTER_NAME", "HierarchyTrainer", "HierarchyTrainerMixin"]

log = logging.getLogger(__name__)

POINTER_NAME = "tierckpt.json"  #: the pointer file's name in a checkpoint folder
STATE_NAME = "trainer_state.json"  # the Trainer's own name, which it reads from the folder
KEY = "tierckpt"  # the save's id in the saved state
PARTS = ("model", "optimizer", "scheduler", "scaler", "rng", "trainer_state", KEY)  # the saved state's keys
_FOLDER = re.compile(rf"^{PREFIX_CHECKPOINT_DIR}-\d+$")
_SCRATCH = re.compile(rf"^\.{PREFIX_CHECKPOINT_DIR}-\d+\.tierckpt-[0-9a-f]+$")


class HierarchyTrainerMixin:
    """Put a ``Trainer``'s checkpoints through a tierckpt hierarchy: mix it in before the Trainer class
    (``class MyTrainer(HierarchyTrainerMixin, SFTTrainer)``), or use :class:`HierarchyTrainer`.

    Every argument of the Trainer is taken as it is; ``save_steps``, ``save_total_limit``,
    ``resume_from_checkpoint=True`` and ``load_best_model_at_end`` work as they do with files.

    Args:
        hierarchy: the hierarchy: a YAML file's path, or a mapping with the YAML schema (relative tier
            paths relative to the current directory when the trainer is built), as for
            :meth:`Hierarchy.from_config`.
        blocking: ``_save_checkpoint`` returns only once every tier the save goes to has committed it and
            its folder is in place (as the Trainer's own saving does).
        prefetch: open the hierarchy when the trainer is built and start copying its newest step up to
            the top tier (``Hierarchy.prefetch``), so that a resume reads it from memory.
        *args, **kwargs: the Trainer's.

    Raises:
        ValueError: a setup whose checkpoints this does not cover: DeepSpeed, FSDP, several processes
            (``args.world_size > 1``), ``push_to_hub``.
        ConfigError: the hierarchy's config is invalid (with ``prefetch``: here, else at the first save or load).
    """

    #: with ``prefetch``, the future of the newest step's climb to the top tier
    prefetched: Future[str] | None

    def __init__(
        self,
        *args: Any,
        hierarchy: str | os.PathLike[str] | Mapping[str, Any],
        blocking: bool = False,
        prefetch: bool = True,
        **kwargs: Any,
    ) -> None:
        super().__init__(*args, **kwargs)
        self._check_supported()
        self.hierarchy_config = hierarchy if isinstance(hierarchy, Mapping) else os.fspath(hierarchy)
        self._base_dir = os.getcwd()
        self.blocking = blocking
        self._h: Hierarchy | None = None
        self._lock = threading.Lock()
        self._pending: dict[str, Pointer] = {}  # folder -> its newest save, until the folder is in place
        self._released: set[int] = set()  # steps whose folder went: deleted unless a folder names them again
        self._dirs: set[str] = set()  # the run directories this process saved folders in
        self._background = Background("tierckpt-hf")
        self._newest: int | None = None
        self._resumed: tuple[str, dict[str, Any]] | None = None  # (folder, what its restore read besides the model)
        self.prefetched = self.hierarchy.prefetch() if prefetch else None

    def _check_supported(self) -> None:
        t: Any = self
        unsupported = [
            what
            for what, on in (
                ("DeepSpeed", t.is_deepspeed_enabled),
                ("FSDP", t.is_fsdp_enabled),
                (f"{t.args.world_size} processes", t.args.world_size > 1),
                ("push_to_hub", t.args.push_to_hub),
            )
            if on
        ]
        if unsupported:
            raise ValueError(
                f"{type(self).__name__} saves the checkpoints of one process without DeepSpeed or FSDP, which write "
                f"folders of their own; this run has {', '.join(unsupported)} (use the Trainer's own saving there)"
            )

    @property
    def hierarchy(self) -> Hierarchy:
        """The hierarchy, opened on first use (and again after ``train`` closed it)."""
        if self._h is None:
            solo = SoloCoordinator(rank=0, world_size=1)
            if isinstance(self.hierarchy_config, Mapping):
                self._h = Hierarchy.from_config(self.hierarchy_config, self._base_dir, coordinator=solo)
            else:
                self._h = Hierarchy.from_yaml(self.hierarchy_config, coordinator=solo)
        return self._h

    # -- save ---------------------------------------------------------------------------------------------
    def _save_checkpoint(self, model: Any, trial: Any, *args: Any, **kwargs: Any) -> None:
        """Save the model, optimizer, scheduler, scaler, RNG and trainer states as a step of the hierarchy;
        ``checkpoint-<global step>/`` follows once the step is durable (see the module's docstring)."""
        t: Any = self
        self._settle_earlier()
        if t.hp_search_backend is None and trial is None:
            t.store_flos()
        run_dir = t._get_output_dir(trial=trial)
        folder = os.path.abspath(os.path.join(run_dir, f"{PREFIX_CHECKPOINT_DIR}-{t.state.global_step}"))
        self._note_best(run_dir, folder)
        self._export_callback_states()
        h = self.hierarchy
        if self._newest is None:
            self._sweep_scratch(run_dir)
            self._newest = newest_step(h)
        step = self._newest = next_step(self._newest, t.state.global_step)
        pointer = Pointer(step, new_id(), t.state.global_step)
        trainer_state = json.dumps(dataclasses.asdict(t.state), indent=2, sort_keys=True) + "\n"  # as save_to_json
        handle = h.save(self._state(trainer_state, pointer), step=step, blocking=self.blocking)
        handle.staged.result()
        with self._lock:
            self._pending[folder] = pointer
            self._dirs.add(os.path.dirname(folder))
        what = f"putting the checkpoint folder {folder} (step {step}) in place"
        self._background.publish_when_durable(h, handle, lambda: self._publish(folder, pointer, trainer_state), what)
        if self.blocking:
            handle.wait()
            self._background.drain()
            self._settle_earlier()

    def _state(self, trainer_state: str, pointer: Pointer) -> dict[str, Any]:
        """What a checkpoint holds (``save_only_model``: the model and the trainer state)."""
        t: Any = self
        only_model = t.args.save_only_model
        scaler = getattr(t.accelerator, "scaler", None)
        return {
            "model": t.accelerator.unwrap_model(t.model).state_dict(),
            "optimizer": None if only_model else t.optimizer.state_dict(),
            "scheduler": None if only_model or t.lr_scheduler is None else t.lr_scheduler.state_dict(),
            "scaler": None if only_model or scaler is None else scaler.state_dict(),
            "rng": None if only_model else rng_state(),
            "trainer_state": trainer_state,
            KEY: {"id": pointer.id, "transformers": transformers.__version__},
        }

    def _note_best(self, run_dir: str, folder: str) -> None:
        """The Trainer's ``best_model_checkpoint``, set as it sets it (a folder still to come counts, and
        so does ``folder``, the one being saved)."""
        t: Any = self
        if t.args.save_strategy in ("steps", "epoch", "best") and t.state.best_global_step:
            best = os.path.join(run_dir, f"{PREFIX_CHECKPOINT_DIR}-{t.state.best_global_step}")
            with self._lock:
                pending = os.path.abspath(best) in (*self._pending, folder)
            if pending or os.path.exists(best):
                t.state.best_model_checkpoint = best

    def _export_callback_states(self) -> None:
        """Put the stateful callbacks' states in the trainer state, as the Trainer does before it saves."""
        t: Any = self
        for cb in [*t.callback_handler.callbacks, t.control]:
            if isinstance(cb, ExportableState):
                name, state = type(cb).__name__, cb.state()
                if isinstance(t.state.stateful_callbacks[name], list):
                    t.state.stateful_callbacks[name].append(state)
                else:
                    t.state.stateful_callbacks[name] = state

    def _publish(self, folder: str, pointer: Pointer, trainer_state: str) -> None:
        """Put ``folder`` in place (its trainer state and pointer) unless a newer save of it came first; a
        folder it replaces releases its step; then the Trainer's rotation."""
        with self._lock:
            if self._pending.get(folder) is not pointer:
                return
            old = _pointer_in(folder)
            _put_folder(folder, pointer, trainer_state)
            del self._pending[folder]
            if old is not None and old.step != pointer.step:
                self._released.add(old.step)
            self._rotate(os.path.dirname(folder))

    def _rotate(self, run_dir: str) -> None:
        """The Trainer's ``save_total_limit`` rotation; the steps of the folders it removed are released."""
        t: Any = self
        before = _folders(run_dir)
        if hasattr(transformers.trainer_utils, "rotate_checkpoints"):  # transformers >= 5
            transformers.trainer_utils.rotate_checkpoints(
                output_dir=run_dir, save_total_limit=t.args.save_total_limit,
                best_model_checkpoint=t.state.best_model_checkpoint, use_mtime=True,
            )  # fmt: skip
        else:
            t._rotate_checkpoints(use_mtime=True, output_dir=run_dir)
        self._released |= {step for path, step in before.items() if not os.path.exists(path)}

    def _settle_earlier(self) -> None:
        """Raise what failed in the background since the last call; delete the released steps that no
        folder (in place or to come) names."""
        self._background.settle()
        self._delete_released()

    def _delete_released(self) -> None:
        with self._lock:
            if not self._released:
                return
            named = {step for d in self._dirs for step in _folders(d).values()}
            named |= {p.step for p in self._pending.values()}
            gone, self._released = self._released - named, set()
        delete_steps(self.hierarchy, gone)

    def _sweep_scratch(self, run_dir: str) -> None:
        """Remove the hidden folders that a process killed while it put a folder in place left behind."""
        with contextlib.suppress(FileNotFoundError):
            for e in os.scandir(run_dir):
                if _SCRATCH.match(e.name):
                    shutil.rmtree(e.path, ignore_errors=True)

    # -- load ---------------------------------------------------------------------------------------------
    def _load_from_checkpoint(self, resume_from_checkpoint: str, model: Any = None) -> None:
        """Restore the weights in place from the step the folder's pointer names (a folder without one:
        as the Trainer loads it); the rest of that restore is kept for the loads that follow."""
        if _pointer_in(resume_from_checkpoint) is None:
            super()._load_from_checkpoint(resume_from_checkpoint, model)  # type: ignore[misc]
            return
        self._restored(resume_from_checkpoint, model)

    def _load_optimizer_and_scheduler(self, checkpoint: str | None) -> None:
        if checkpoint is None or _pointer_in(checkpoint) is None:
            super()._load_optimizer_and_scheduler(checkpoint)  # type: ignore[misc]
            return
        t: Any = self
        state = self._restored(checkpoint)
        if state["optimizer"] is None:
            return  # save_only_model: the Trainer's own resume has nothing to load either
        t.optimizer.load_state_dict(state.pop("optimizer"))
        if t.lr_scheduler is not None and state["scheduler"] is not None:
            t.lr_scheduler.load_state_dict(state["scheduler"])

    def _load_scaler(self, checkpoint: str | None) -> None:
        if checkpoint is None or _pointer_in(checkpoint) is None:
            super()._load_scaler(checkpoint)  # type: ignore[misc]
            return
        scaler = getattr(getattr(self, "accelerator", None), "scaler", None)
        saved = self._restored(checkpoint)["scaler"]
        if scaler is not None and saved is not None:
            scaler.load_state_dict(saved)

    def _load_rng_state(self, checkpoint: str | None) -> None:
        if checkpoint is None or _pointer_in(checkpoint) is None:
            super()._load_rng_state(checkpoint)  # type: ignore[misc]
            return
        saved = self._restored(checkpoint)["rng"]
        if saved is not None:
            set_rng_state(saved)

    def _load_best_model(self) -> None:
        t: Any = self
        best = t.state.best_model_checkpoint
        if best is None or _pointer_in(best) is None:
            super()._load_best_model()  # type: ignore[misc]
            return
        log.info("loading the best model from %s (score: %s)", best, t.state.best_metric)
        self._resumed = None
        self._restored(best)
        self._resumed = None

    def _restored(self, folder: str, model: Any = None) -> dict[str, Any]:
        """The restore of ``folder``'s step: the model's weights read into ``model`` (default: the
        trainer's) in place the first time; what else it read, kept until the next folder's restore."""
        if self._resumed is not None and self._resumed[0] == os.path.abspath(folder):
            return self._resumed[1]
        t: Any = self
        pointer = _pointer_in(folder)
        if pointer is None:
            raise FileNotFoundError(f"{folder}: no {POINTER_NAME} (not a checkpoint of {type(self).__name__})")
        module = t.accelerator.unwrap_model(t.model if model is None else model)
        into = {k: module.state_dict() if k == "model" else None for k in PARTS}
        try:
            state: dict[str, Any] = self.hierarchy.restore(pointer.step, into=into)
        except StateError:
            self._check_id(folder, pointer)  # a checkpoint saved otherwise: say so rather than how it differs
            raise
        self._check_id(folder, pointer, state)
        del state["model"]
        self._resumed = (os.path.abspath(folder), state)
        return state

    def _check_id(self, folder: str, pointer: Pointer, state: Any = None) -> None:
        """Raise unless the step ``pointer`` names holds the save it was written for (its id)."""
        if state is None:  # read the id alone
            state = self.hierarchy.restore(pointer.step, key_map=lambda k: k if k.startswith(f"{KEY}.") else None)
        saved = state.get(KEY) if isinstance(state, dict) else None
        if not isinstance(saved, dict) or saved.get("id") != pointer.id:
            raise CheckpointNotFoundError(
                f"{folder} names step {pointer.step} of the hierarchy, which now holds another checkpoint "
                "(the step was deleted and saved again)"
            )

    # -- the end ------------------------------------------------------------------------------------------
    def train(self, *args: Any, **kwargs: Any) -> Any:
        """The Trainer's ``train``; then every copy is finished, every folder put in place, the released
        steps deleted and the hierarchy closed (it opens again when it is next used)."""
        try:
            out = super().train(*args, **kwargs)  # type: ignore[misc]
        except BaseException:
            with contextlib.suppress(Exception):
                self.finish()
            raise
        self.finish()
        return out

    def finish(self) -> None:
        """Finish every copy and folder, delete the released steps, close the hierarchy; raise a
        background failure. ``train`` calls it when it ends."""
        self._resumed = None
        self.prefetched = None
        h = self._h
        if h is None:
            self._background.raise_error()
            return
        try:
            h.flush()
            self._background.drain()
            self._delete_released()
        finally:
            self._h, self._newest = None, None
            self._background.forget()
            h.close()
        self._background.raise_error()


class HierarchyTrainer(HierarchyTrainerMixin, Trainer):
    """``transformers.Trainer`` with its checkpoints in a tierckpt hierarchy:
    ``HierarchyTrainer(model=..., args=..., train_dataset=..., hierarchy="tiers/local.yaml")``
    (see :class:`HierarchyTrainerMixin`)."""


def _pointer_in(folder: str) -> Pointer | None:
    """The pointer in a checkpoint folder, or None where it has none (a folder the Trainer wrote)."""
    try:
        return read_pointer(os.path.join(folder, POINTER_NAME))
    except (FileNotFoundError, NotADirectoryError):
        return None


def _folders(run_dir: str) -> dict[str, int]:
    """The checkpoint folders in ``run_dir`` that hold a pointer, and the steps they name."""
    out: dict[str, int] = {}
    with contextlib.suppress(FileNotFoundError):
        for e in os.scandir(run_dir):
            if _FOLDER.match(e.name):
                with contextlib.suppress(ValueError):
                    p = _pointer_in(e.path)
                    if p is not None:
                        out[e.path] = p.step
    return out


def _put_folder(folder: str, pointer: Pointer, trainer_state: str) -> None:
    """Write the folder under a hidden name beside it, then rename it into place (a folder of that name is
    renamed aside first and removed after): a reader sees the old folder or the new one, whole."""
    parent, name = os.path.split(folder)
    os.makedirs(parent, exist_ok=True)
    scratch = os.path.join(parent, f".{name}.tierckpt-{secrets.token_hex(4)}")
    os.mkdir(scratch)
    try:
        with open(os.path.join(scratch, STATE_NAME), "w", encoding="utf-8") as f:
            f.write(trainer_state)
            f.flush()
            os.fsync(f.fileno())
        write_pointer(os.path.join(scratch, POINTER_NAME), pointer)  # syncs the scratch directory too
        aside = None
        if os.path.lexists(folder):
            aside = os.path.join(parent, f".{name}.tierckpt-{secrets.token_hex(4)}")
            os.rename(folder, aside)
        os.rename(scratch, folder)
    except BaseException:
        shutil.rmtree(scratch, ignore_errors=True)
        raise
    dfd = os.open(parent, os.O_RDONLY | os.O_DIRECTORY)
    try:
        os.fsync(dfd)
    finally:
        os.close(dfd)
    if aside is not None:
        shutil.rmtree(aside, ignore_errors=True)
