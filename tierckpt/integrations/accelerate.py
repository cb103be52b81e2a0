"""Hugging Face Accelerate: ``Accelerator.save_state`` / ``load_state`` through a :class:`~tierckpt.Hierarchy`.

:func:`save_state` and :func:`load_state` take what ``accelerator.save_state(dir)`` and
``accelerator.load_state(dir)`` take from the accelerator (the prepared models, optimizers, schedulers,
the gradient scaler, the stateful data loaders, the objects given to ``register_for_checkpointing``, the
RNG states and ``accelerator.step``) and save them as one step of a hierarchy, or load the newest (or a
given) step back into them, from the fastest tier holding it. They are built on :class:`tierckpt.TrainState`:
models are restored in place, the rest through their ``load_state_dict``, the RNG states as tensors
(no pickle).

Why functions and not ``register_save_state_pre_hook``: those hooks see the models' weights before
``save_state`` writes them, but ``save_state`` still writes the optimizer, scheduler and RNG files
itself; there is nothing to hook where a checkpoint's bytes could take another path. See
docs/integrations.md, "Hugging Face".
"""

from __future__ import annotations

from typing import Any

from accelerate import Accelerator

from tierckpt import Hierarchy, SaveHandle, TrainState

__all__ = ["load_state", "save_state"]


class _Counter:
    """``accelerator.step`` (the gradient accumulation counter) as a part with a state dict."""

    def __init__(self, accelerator: Accelerator) -> None:
        self.accelerator = accelerator

    def state_dict(self) -> dict[str, int]:
        return {"step": int(self.accelerator.step)}

    def load_state_dict(self, state: dict[str, int]) -> None:
        self.accelerator.step = int(state["step"])


def _numbered(name: str, objects: list[Any]) -> dict[str, Any]:
    """``model``, ``model_1``, ``model_2``, … as Accelerate numbers its files."""
    return {name if i == 0 else f"{name}_{i}": obj for i, obj in enumerate(objects)}


def train_state(accelerator: Accelerator) -> TrainState:
    """The accelerator's objects as the parts of a :class:`TrainState` (with the RNG states): ``model``,
    ``optimizer``, ``scheduler`` (``model_1`` … for a second one), ``scaler``, ``dataloader`` (stateful
    data loaders only), ``custom_0`` … (``register_for_checkpointing``) and ``accelerator``."""
    loaders = [dl for dl in accelerator._dataloaders if getattr(dl, "use_stateful_dataloader", False)]
    parts: dict[str, Any] = {
        **_numbered("model", accelerator._models),
        **_numbered("optimizer", accelerator._optimizers),
        **_numbered("scheduler", accelerator._schedulers),
        **_numbered("dataloader", loaders),
        **{f"custom_{i}": obj for i, obj in enumerate(accelerator._custom_objects)},
        "accelerator": _Counter(accelerator),
    }
    if accelerator.scaler is not None:
        parts["scaler"] = accelerator.scaler
    return TrainState(**parts)


def save_state(
    accelerator: Accelerator, h: Hierarchy, step: int, *, allow_pickle: bool = False, blocking: bool = False
) -> SaveHandle:
    """Save the accelerator's state as ``step`` of ``h``; returns once its bytes are in the top tier
    (training may change the weights from then on), the copies to the lower tiers following in the
    background (``handle.wait()`` waits for them).

    Args:
        accelerator: the ``Accelerator`` whose prepared objects are saved (in a job of several processes,
            each process saves its own, into a hierarchy of that job).
        h: the hierarchy.
        step: the step to save as (your loop's update count).
        allow_pickle: pickle values that are neither tensors nor plain values (in a custom object's state).
        blocking: return only once every tier the save goes to has committed it.

    Raises:
        StateError: a value is neither a tensor nor a plain value (without ``allow_pickle``), or an object
            has no ``state_dict()``.
    """
    handle = train_state(accelerator).save(h, step=step, allow_pickle=allow_pickle, blocking=blocking)
    handle.staged.result()
    return handle


def load_state(accelerator: Accelerator, h: Hierarchy, step: int | None = None, *, allow_pickle: bool = False) -> int:
    """Load the newest (or the given) step of ``h`` into the accelerator's objects; returns its step (0
    where ``h`` holds none and no ``step`` is given: nothing is changed).

    Call it after ``accelerator.prepare(...)`` and ``register_for_checkpointing(...)``, with the same
    objects the save had (the same number of each): every difference is named in one ``StateError``.

    Raises:
        CheckpointNotFoundError: ``step`` was given and no tier holds it.
        StateError: the checkpoint does not hold these objects.
    """
    return train_state(accelerator).restore(h, step, allow_pickle=allow_pickle)
