"""Resume a training job exactly: model, optimizer, scheduler, RNG and data position, saved and loaded together.

A checkpoint resumes a job only if *everything* that decides the next update comes back: the weights,
the optimizer's moments and step counts, the scheduler's position, the random number generators and
where the data stream stood. :class:`TrainState` gathers these from the objects themselves (through
their ``state_dict()``) and gives them back through their ``load_state_dict()``, so nothing is left out
and nothing is left in a dict that no object reads::

    job = TrainState(model=model, optim=opt, sched=sched, data=loader)  # + the RNGs
    done = job.restore(h)  # updates in the newest checkpoint, loaded into all of the above (0: none yet)
    for step in range(done, steps):
        ...  # forward, backward, opt.step(), sched.step()
        job.save(h, step=step + 1)  # the state after step + 1 updates

Models are restored in place (``restore(into=model.state_dict())``: no second copy of the weights);
everything else is read into fresh tensors and handed to ``load_state_dict``, which is what a fresh
optimizer (one with no state tensors yet) needs. :func:`rng_state` and :func:`set_rng_state` capture
and restore python's ``random``, numpy's global generator and torch's CPU and CUDA generators as
tensors and plain values (no pickle). See docs/resume.md.
"""

from __future__ import annotations

import logging
import random
import sys
from collections import OrderedDict
from collections.abc import Iterator
from types import ModuleType
from typing import TYPE_CHECKING, Any, cast

import torch

from tierckpt.errors import StateError

if TYPE_CHECKING:
    from tierckpt.datapath.keymap import KeyMapLike
    from tierckpt.hierarchy import Hierarchy, SaveHandle

__all__ = ["ResumableLoader", "TrainState", "rng_state", "set_rng_state"]

log = logging.getLogger(__name__)

RNG = "rng"  # the key of the RNG states in a TrainState's state


class TrainState:
    """The parts of a training job that a checkpoint must hold, saved and restored together.

    Args:
        rng: also save and restore the random number generators (:func:`rng_state`) under ``"rng"``.
        **parts: the job's stateful objects by name: anything with ``state_dict()`` and
            ``load_state_dict()`` (``nn.Module``, optimizers, LR schedulers, ``GradScaler``, a stateful
            data loader such as torchdata's ``StatefulDataLoader``, your own object holding the data
            position), or a ``torch.Generator``. The names are the top-level keys of the saved state.

    Raises:
        StateError: no part, a part with neither interface, or ``rng`` not a bool (no part can be
            named ``"rng"``).
    """

    def __init__(self, *, rng: bool = True, **parts: Any) -> None:
        if not parts:
            raise StateError("TrainState needs at least one part, e.g. TrainState(model=model, optim=opt)")
        if type(rng) is not bool:
            raise StateError(f"rng= takes True or False (got {_what(rng)}): the name 'rng' is the RNG states' own")
        for name, part in parts.items():
            if not isinstance(part, torch.Generator) and not (
                callable(getattr(part, "state_dict", None)) and callable(getattr(part, "load_state_dict", None))
            ):
                raise StateError(
                    f"part {name!r}: a {type(part).__module__}.{type(part).__qualname__} has no state_dict() and "
                    "load_state_dict(); wrap what it holds in an object that has both (docs/resume.md)"
                )
        self.parts = parts
        self.rng = rng

    def state_dict(self) -> dict[str, Any]:
        """The state to save: each part's ``state_dict()`` (numpy scalars in them turned into Python
        scalars), and the RNG states under ``"rng"``.

        The tensors are the parts' own (no copy): with a lazy :meth:`Hierarchy.save`, wait for
        ``handle.staged`` before changing them in place (``opt.step()``).
        """
        out: dict[str, Any] = {}
        for name, part in self.parts.items():
            if isinstance(part, torch.Generator):
                out[name] = part.get_state()
            elif isinstance(part, torch.nn.Module):
                out[name] = part.state_dict()
            else:
                out[name] = _plain(part.state_dict())
        if self.rng:
            out[RNG] = rng_state()
        return out

    def load_state_dict(self, state: Any) -> None:
        """Load a saved :meth:`state_dict` (e.g. one from ``h.restore()``) into every part.

        Raises:
            StateError: ``state`` does not have exactly this TrainState's parts (all differences named),
                or the RNG states are malformed. Each part's ``load_state_dict`` raises its own errors
                (a model's keys and shapes, an optimizer's parameter groups).
        """
        if not isinstance(state, dict):
            raise StateError(f"expected the dict a TrainState saved, got a {type(state).__name__}")
        want = [*self.parts, *([RNG] if self.rng else [])]
        missing, extra = [k for k in want if k not in state], [k for k in state if k not in want]
        if missing or extra:
            raise StateError(
                f"the checkpoint does not hold this TrainState's parts: missing {missing}, not a part here {extra} "
                "(the names given to TrainState(...) must be those the job saved with)"
            )
        for name, part in self.parts.items():
            if isinstance(part, torch.Generator):
                part.set_state(state[name])
            else:
                part.load_state_dict(state[name])
        if self.rng:
            set_rng_state(state[RNG])

    def save(self, h: Hierarchy, *, step: int, allow_pickle: bool = False, blocking: bool = False) -> SaveHandle:
        """``h.save(self.state_dict(), step=step, ...)``.

        Label the save with the number of optimizer updates its state holds (save after
        ``opt.step()`` of update ``step``, as ``step + 1`` with a 0-based loop counter): :meth:`restore`
        returns that label, and the loop goes on from it.
        """
        return h.save(self.state_dict(), step=step, allow_pickle=allow_pickle, blocking=blocking)

    def restore(
        self,
        h: Hierarchy,
        step: int | None = None,
        *,
        tier: str | None = None,
        allow_pickle: bool = False,
        key_map: KeyMapLike = None,
    ) -> int:
        """Load the newest (or the given) checkpoint of ``h`` into every part; returns its step.

        Modules are restored in place, strictly (every key, shape and dtype must match) and then passed
        to their ``load_state_dict`` (a copy onto itself, which torch skips, plus whatever the module
        keeps outside its tensors). Every other part is read into fresh tensors and passed to its
        ``load_state_dict``: a fresh optimizer gets its state tensors this way. ``key_map``: as for
        :meth:`Hierarchy.restore` (e.g. ``KeyMap.torch_compile()`` for a model compiled on one side only).

        Returns:
            The restored step, or 0 when ``step`` is None and ``h`` holds no committed checkpoint
            (a fresh start: nothing is changed).

        Raises:
            CheckpointNotFoundError: ``step`` was given and no tier holds it.
            CorruptCheckpointError: every copy of the step is damaged (nothing is loaded into a part
                that is not a module; a module may hold part of the checkpoint's bytes, see docs/restore.md).
            StateError: the checkpoint does not match the parts (every difference named).
        """
        if step is None and tier is None and not any(c.tiers for c in h.checkpoints()):
            log.info("no checkpoint to resume from: starting from scratch")
            return 0
        target: dict[str, Any] = {
            name: part.state_dict() if isinstance(part, torch.nn.Module) else None for name, part in self.parts.items()
        }  # None: taken whole from the checkpoint
        if self.rng:
            target[RNG] = None
        self.load_state_dict(
            h.restore(step, into=target, tier=tier, allow_pickle=allow_pickle, strict=True, key_map=key_map)
        )
        return cast("tuple[int, str]", h.last_restore)[0]  # set by the restore that just returned


class ResumableLoader:
    """A plain ``torch.utils.data.DataLoader`` that resumes mid-epoch with the batches an uninterrupted run
    would have produced: a :class:`TrainState` part (``TrainState(..., data=ResumableLoader(loader))``).

    Iterate it as the loader itself: each ``iter()`` is the next epoch (after a restore: the rest of the
    saved epoch). It saves the epoch, how many of its batches were handed out, and the random state
    the epoch began with: torch's global generator, ``loader.generator`` and the sampler's ``generator``
    as they were before the epoch's first batch (the shuffle and the workers' seeds are drawn from
    them). A restored epoch starts again from that state and loads and drops the batches already
    handed out, so every
    later batch is the same: the order, and whatever the dataset draws from the workers' generators
    (random crops), which the skipped batches advance as they did the first time. The global
    generators are not changed by this (the replay runs under ``torch.random.fork_rng``). A sampler or
    batch sampler with ``set_epoch`` (``DistributedSampler``) gets the epoch number before each epoch.

    The skipped batches are loaded again (in the workers, with their usual parallelism); torchdata's
    ``StatefulDataLoader`` skips without loading, but does not restore what the workers draw from their
    generators (docs/resume.md, "Data position").

    Args:
        loader: the data loader, with ``persistent_workers=False`` (persistent workers keep their
            generators' state from one epoch to the next, which no restart can bring back).

    Raises:
        StateError: ``loader`` is not a ``torch.utils.data.DataLoader``, or has persistent workers.
    """

    def __init__(self, loader: torch.utils.data.DataLoader[Any]) -> None:
        if not isinstance(loader, torch.utils.data.DataLoader):
            raise StateError(f"ResumableLoader takes a torch.utils.data.DataLoader, got {_what(loader)}")
        if loader.persistent_workers and loader.num_workers > 0:
            raise StateError(
                "ResumableLoader: persistent_workers=True keeps the workers' random state across epochs, which "
                "a restarted job cannot bring back; build the DataLoader with persistent_workers=False"
            )
        self.loader = loader
        self.epoch = 0  # the epoch being handed out, or the next one to start (batches == 0)
        self.batches = 0  # batches of it handed out
        self._start: dict[str, Any] = {}  # the random state before its first batch
        self._resume = False  # the next iter() takes up the saved epoch

    def __len__(self) -> int:
        return len(self.loader)

    def __iter__(self) -> Iterator[Any]:
        if not self._resume and (self.batches or self._start):  # a new epoch (the previous one left unfinished)
            self.epoch, self.batches, self._start = self.epoch + 1, 0, {}
        resume, self._resume = self._resume and self.batches > 0, False
        return self._epoch(resume)

    def _epoch(self, resume: bool) -> Iterator[Any]:
        for s in (getattr(self.loader, "sampler", None), getattr(self.loader, "batch_sampler", None)):
            set_epoch = getattr(s, "set_epoch", None)
            if callable(set_epoch):
                set_epoch(self.epoch)
        gens = self._generators()
        if resume:
            with torch.random.fork_rng(devices=[]):
                torch.set_rng_state(cast("torch.Tensor", self._start["torch"]))
                for g, state in zip(gens, cast("list[torch.Tensor]", self._start["generators"])):
                    g.set_state(state)
                it = iter(self.loader)
                for _ in range(self.batches):
                    next(it)
        else:
            self._start = {"torch": torch.get_rng_state(), "generators": [g.get_state() for g in gens]}
            it = iter(self.loader)
        for batch in it:
            self.batches += 1
            yield batch
        self.epoch, self.batches, self._start = self.epoch + 1, 0, {}

    def _generators(self) -> list[torch.Generator]:
        """The generators the loader's shuffling may draw from, each once: ``loader.generator``, its
        sampler's and its batch sampler's (and the batch sampler's sampler's) ``generator``."""
        bs = getattr(self.loader, "batch_sampler", None)
        found = [
            self.loader.generator,
            *(getattr(o, "generator", None) for o in (self.loader.sampler, bs, getattr(bs, "sampler", None))),
        ]
        out: list[torch.Generator] = []
        for g in found:
            if isinstance(g, torch.Generator) and all(g is not h for h in out):
                out.append(g)
        return out

    def state_dict(self) -> dict[str, Any]:
        """The epoch, the batches of it handed out, and the random state it began with."""
        return {"epoch": self.epoch, "batches": self.batches, **({"start": dict(self._start)} if self.batches else {})}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Take up a saved position: the next ``iter()`` hands out the rest of its epoch.

        Raises:
            StateError: ``state`` is not what :meth:`state_dict` returns.
        """
        start = state.get("start") if isinstance(state, dict) else None
        ok = isinstance(state, dict) and type(state.get("epoch")) is int and type(state.get("batches")) is int
        if ok and state["batches"] > 0:
            ok = (
                isinstance(start, dict)
                and isinstance(start.get("torch"), torch.Tensor)
                and isinstance(start.get("generators"), list)
                and len(start["generators"]) == len(self._generators())
            )
        if not ok:
            raise StateError(
                f"ResumableLoader state: expected {{'epoch', 'batches', 'start'}} with one state for each of this "
                f"loader's {len(self._generators())} generator(s), got {_what(state)}"
            )
        self.epoch, self.batches = state["epoch"], state["batches"]
        self._start = dict(start) if isinstance(start, dict) else {}
        self._resume = True


def rng_state() -> dict[str, Any]:
    """The state of the global random number generators, as tensors and plain values (no pickle).

    Holds python's ``random``; numpy's global generator (``np.random.seed`` / ``np.random.rand``) if
    numpy has been imported; torch's CPU generator; and the current CUDA device's generator if CUDA
    has been initialized (others are not touched: asking for them would create a CUDA context on
    every device). Generators you create yourself (``torch.Generator``, ``np.random.default_rng``)
    are yours to save: make them :class:`TrainState` parts or save their state.
    """
    version, internal, gauss = random.getstate()
    out: dict[str, Any] = {
        "python": {"version": version, "state": torch.tensor(internal, dtype=torch.int64), "gauss_next": gauss},
        "torch": torch.get_rng_state(),
    }
    np = sys.modules.get("numpy")
    if np is not None:
        name, keys, pos, has_gauss, cached = np.random.get_state(legacy=True)
        out["numpy"] = {
            "bit_generator": str(name), "keys": torch.from_numpy(keys.astype(np.int64)), "pos": int(pos),
            "has_gauss": int(has_gauss), "cached_gaussian": float(cached),
        }  # fmt: skip
    if torch.cuda.is_available() and torch.cuda.is_initialized():
        dev = torch.cuda.current_device()
        out["cuda"] = {dev: torch.cuda.get_rng_state(dev)}
    return out


def set_rng_state(state: Any) -> None:
    """Restore what :func:`rng_state` captured.

    A numpy state is skipped (with a log line) where numpy is not installed, and a CUDA state where
    that device does not exist: such a process cannot draw from those generators.

    Raises:
        StateError: ``state`` is not what :func:`rng_state` returns (names the part); nothing is changed.
    """
    py, cpu, npy, cuda = _check_rng(state)
    np: ModuleType | None = None
    if npy is not None:
        try:
            import numpy as np
        except ImportError:
            log.info("the checkpoint holds numpy's RNG state, but numpy is not installed: skipped")
    random.setstate((py["version"], tuple(py["state"].tolist()), py["gauss_next"]))
    torch.set_rng_state(cpu)
    if np is not None and npy is not None:  # np is only imported for a numpy state
        keys = npy["keys"].numpy().astype(np.uint32)
        np.random.set_state((npy["bit_generator"], keys, npy["pos"], npy["has_gauss"], npy["cached_gaussian"]))
    for dev, s in cuda.items():
        if torch.cuda.is_available() and 0 <= dev < torch.cuda.device_count():
            torch.cuda.set_rng_state(s, dev)
        else:
            log.warning("the checkpoint holds the RNG state of CUDA device %d, which this process lacks: skipped", dev)


def _check_rng(state: Any) -> tuple[dict[str, Any], torch.Tensor, dict[str, Any] | None, dict[int, torch.Tensor]]:
    """Validate a saved RNG state before any generator is changed."""

    def bad(where: str, what: str) -> StateError:
        return StateError(f"rng state{where}: {what} (expected what tierckpt.rng_state() returns)")

    if not isinstance(state, dict) or "python" not in state or "torch" not in state:
        raise bad("", f"expected a dict with 'python' and 'torch', got {_what(state)}")
    py, cpu = state["python"], state["torch"]
    if not (isinstance(py, dict) and isinstance(py.get("state"), torch.Tensor) and py["state"].shape == (625,)):
        raise bad("['python']", f"expected {{'version', 'state' (625 ints), 'gauss_next'}}, got {_what(py)}")
    if not (isinstance(cpu, torch.Tensor) and cpu.dtype == torch.uint8):
        raise bad("['torch']", f"expected a uint8 tensor, got {_what(cpu)}")
    npy = state.get("numpy")
    if npy is not None and not (
        isinstance(npy, dict) and isinstance(npy.get("keys"), torch.Tensor) and npy["keys"].shape == (624,)
    ):
        raise bad("['numpy']", f"expected a dict with 'keys' (624 ints), got {_what(npy)}")
    cuda = state.get("cuda", {})
    if not isinstance(cuda, dict) or not all(
        type(d) is int and isinstance(s, torch.Tensor) and s.dtype == torch.uint8 for d, s in cuda.items()
    ):
        raise bad("['cuda']", "expected {device index: uint8 tensor}")
    return py, cpu, npy, cuda


def _what(v: Any) -> str:
    return f"a {type(v).__name__}" if not isinstance(v, dict) else f"a dict with keys {sorted(map(str, v))}"


def _plain(v: Any) -> Any:
    """``v`` with numpy scalars (anywhere in its dicts, lists and tuples, keys included) turned into the
    Python scalars they equal; ``v`` itself where there is none (numpy arrays are left for ``save`` to
    refuse: store them with ``torch.from_numpy``)."""
    np = sys.modules.get("numpy")
    return v if np is None else _convert(v, np.generic)


def _convert(v: Any, generic: type[Any]) -> Any:
    tv = type(v)
    if tv is torch.Tensor or tv is int or tv is float or tv is str or v is None:
        return v
    if isinstance(v, generic):
        return v.item()
    if tv is dict or tv is OrderedDict:
        items = [(_convert(k, generic), _convert(x, generic)) for k, x in v.items()]
        changed = any(k2 is not k or x2 is not x for (k2, x2), (k, x) in zip(items, v.items()))
        return tv(items) if changed else v
    if tv is list or tv is tuple:
        xs = [_convert(x, generic) for x in v]
        return tv(xs) if any(a is not b for a, b in zip(xs, v)) else v
    return v
