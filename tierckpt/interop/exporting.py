"""Export a saved step as full tensors: safetensors files (streamed) or ``torch.save`` files, named as the
saved state's key paths joined by ``.`` (docs/integrations.md, "Export and import").

The step and the copy are chosen as a restore chooses them (:class:`~tierckpt.facade.restorejob.RestoreJob`
in a process alone): the newest step (or the one given), from the fastest tier holding it; a damaged or
unreadable copy falls back to the next tier's, and, without a step, a step unusable everywhere to the
newest older one. Each attempt writes into a scratch directory beside the output, removed if it fails;
the one that succeeds is renamed into place.
"""

from __future__ import annotations

import base64
import contextlib
import json
import logging
import os
from collections.abc import Iterator, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from tierckpt.config import HierarchyConfig
from tierckpt.configvalues import parse_size
from tierckpt.errors import ConfigError
from tierckpt.facade.restorejob import RestoreJob
from tierckpt.hierarchy import Hierarchy
from tierckpt.interop.names import KeyMapLike, Leaf, plain, select
from tierckpt.interop.output import OutputFailed, check_output, discard, output_errors, publish, scratch
from tierckpt.interop.reading import StepSource
from tierckpt.interop.writers import Item, SafetensorsWriter, TorchWriter, st_dtype, st_shape
from tierckpt.ranks.coordinator import SoloCoordinator
from tierckpt.tiers.base import Tier

__all__ = ["FORMATS", "Exported", "export"]

log = logging.getLogger(__name__)

FORMATS = ("safetensors", "torch")
DEFAULT_MAX_SHARD = "5GB"  # as Hugging Face's save_pretrained
DEFAULT_MAX_INFLIGHT = "256MiB"
VALUES_FILE = "values.json"
_NAMES = {"safetensors": ("model", ".safetensors"), "torch": ("pytorch_model", ".bin")}


@dataclass(frozen=True)
class Exported:
    """What :func:`export` wrote.

    Attributes:
        step: the step exported.
        tier: the tier its copy was read from.
        path: the output directory.
        files: the files written in it, tensor files first (then the index and ``values.json``, if any).
        tensors: the tensors written (a tied tensor once per name).
        tensor_bytes: the bytes of tensor data in the files (a tied tensor once a name in safetensors
            files, once in torch files).
        values: the plain values written (``values.json`` or the torch file).
    """

    step: int
    tier: str
    path: Path
    files: tuple[str, ...]
    tensors: int
    tensor_bytes: int
    values: int


@dataclass
class _Plan:
    """The output: its tensors (``items``, read from rows ``rows``), its plain values, and the items of
    each file."""

    items: list[Item]
    rows: list[int]
    values: dict[str, Any]
    files: list[list[int]]


def export(
    source: Hierarchy | HierarchyConfig | Mapping[str, Any] | str | os.PathLike[str],
    out: str | os.PathLike[str],
    *,
    step: int | None = None,
    format: str = "safetensors",
    only: Sequence[str] = (),
    key_map: KeyMapLike = None,
    max_shard_size: int | str = DEFAULT_MAX_SHARD,
    max_inflight: int | str = DEFAULT_MAX_INFLIGHT,
    force: bool = False,
) -> Exported:
    """Write step ``step`` (default: the newest that reads) of a hierarchy's checkpoints as full tensors.

    Every tensor is written under its key path in the saved state joined by ``.``
    (``{"model": {"layers.0.weight": w}}`` → ``model.layers.0.weight``); a DTensor, sharded over any
    number of saved ranks, as its full tensor, put together in this process from the ranks' copies (no
    process group needed). Plain tensors and values come from rank 0's copy.

    * ``safetensors``: ``model.safetensors``, or, over ``max_shard_size``, ``model-00001-of-0000N.safetensors``
      … with ``model.safetensors.index.json`` (Hugging Face's names and index); ``__metadata__`` is
      ``{"format": "pt", "step": "N"}``. Plain values (ints, strings, …) go to ``values.json``:
      ``{"step": N, "values": {name: value}}`` (tuples as lists, a dtype or device as its string, bytes
      as ``{"base64": …}``). A tied tensor is written once under each of its names.
    * ``torch``: ``pytorch_model.bin`` (or ``pytorch_model-0000k-of-0000N.bin`` with
      ``pytorch_model.bin.index.json``), each a flat ``{name: tensor}`` dict that
      ``torch.load(weights_only=True)`` reads; the plain values are in the first file; tied tensors stay tied.

    Memory: safetensors files are streamed, at most ``max_inflight`` bytes of tensors read ahead of the
    writes (one plain tensor larger than that is read whole; a larger DTensor in slabs), plus the read
    staging of the tier read. A torch file is written by ``torch.save`` from memory: up to one file
    (``max_shard_size``) is held.

    Args:
        source: a hierarchy (used as it is: call this from one process), or its config (a YAML path, a
            mapping, a ``HierarchyConfig``), opened read-only as a process alone (``tierckpt export``).
        out: the output directory: made; one that exists must be empty, unless ``force``.
        step: the step; None: the newest that reads (a step damaged on every tier is skipped, with a warning).
        format: ``"safetensors"`` or ``"torch"``.
        only: dotted prefixes of the names to keep (``["model"]``: ``model`` and ``model.*``); none: all.
        key_map: renames, applied after ``only``: a mapping of prefix to replacement
            (``{"model.": ""}`` drops the prefix), or a function of a name returning the new name or None
            (leave it out).
        max_shard_size: the most bytes of tensors in one file (an int or a size like ``"5GB"``); a single
            tensor larger than that gets a file alone.
        max_inflight: the most bytes of tensors read ahead of the writes.
        force: replace an existing non-empty ``out`` (whole: its other files go too).

    Returns:
        What was written (:class:`Exported`).

    Raises:
        OutputExistsError: ``out`` exists, is not empty, and not ``force`` (checked before anything is read).
        CheckpointNotFoundError: no such step, or no committed step.
        CorruptCheckpointError: every copy of the step is damaged (with ``step`` given).
        StateError: a tensor's dtype has no safetensors type (naming it), a pickled value is selected,
            ``only`` selects nothing, or two leaves get one name.
        ConfigError: a bad ``format`` or size.
        OSError: writing the output failed (nothing is left in ``out``).
    """
    if format not in FORMATS:
        raise ConfigError(f"format: expected one of {', '.join(FORMATS)}, got {format!r}")
    shard, inflight = parse_size(max_shard_size, "max_shard_size"), parse_size(max_inflight, "max_inflight")
    if shard < 1 or inflight < 1:
        raise ConfigError("max_shard_size and max_inflight must be at least 1 byte")
    target = Path(out)
    check_output(target, force=force)
    opts = _Options(format, tuple(only), key_map, shard, inflight, target)
    with _opened(source) as h:

        def read(s: int, tier: str, replicas: object) -> tuple[Path, _Plan]:
            t = h.tier(tier)
            return _attempt(t, s, [x for x in h.tiers if x is not t], opts)

        job = RestoreJob(
            read,
            lambda: [c for c in h.checkpoints() if c.tiers],
            SoloCoordinator(0, 1),
            where="rank 0 on any tier",
            may_commit=h.readonly,
        )
        try:
            (tmp, plan), got, tier = job.run(step)
        except OutputFailed as e:
            raise e.error from None
    try:
        publish(tmp, target, force=force)
    except BaseException:
        discard(tmp)
        raise
    files = _file_names(format, len(plan.files))
    extra = [_index_name(format)] if len(plan.files) > 1 else []
    if format == "safetensors" and plan.values:
        extra.append(VALUES_FILE)
    log.info("exported step %d from tier %r to %s (%d files)", got, tier, target, len(files))
    return Exported(
        got, tier, target, tuple(files + extra),
        tensors=sum(len(it.names) for it in plan.items),
        tensor_bytes=_data_bytes(format, plan.items),
        values=len(plan.values),
    )  # fmt: skip


@dataclass(frozen=True)
class _Options:
    format: str
    only: tuple[str, ...]
    key_map: KeyMapLike
    shard: int
    inflight: int
    out: Path


@contextlib.contextmanager
def _opened(source: Hierarchy | HierarchyConfig | Mapping[str, Any] | str | os.PathLike[str]) -> Iterator[Hierarchy]:
    if isinstance(source, Hierarchy):
        yield source
        return
    solo = SoloCoordinator(0, 1)  # a tool alone, whatever process group this process is in
    if isinstance(source, (str, os.PathLike)):
        h = Hierarchy.from_yaml(source, readonly=True, coordinator=solo)
    else:
        h = Hierarchy.from_config(source, readonly=True, coordinator=solo)
    with h:
        yield h


def _attempt(tier: Tier, step: int, others: Sequence[Tier], opts: _Options) -> tuple[Path, _Plan]:
    """Export ``step`` from ``tier``'s copies into a new scratch directory; returns it and the plan (the
    scratch directory is removed if anything fails)."""
    with StepSource(tier, step, others) as src:
        plan = _plan(src, select(src.leaves, opts.only, opts.key_map), opts)
        with output_errors():
            tmp = scratch(opts.out)
        try:
            _write(src, plan, tmp, opts, step)
        except BaseException:
            discard(tmp)
            raise
    return tmp, plan


def _plan(src: StepSource, chosen: Sequence[Leaf], opts: _Options) -> _Plan:
    names: dict[int, list[str]] = {}  # row -> its names, rows in the order first met
    values: dict[str, Any] = {}
    for x in chosen:
        if x.row is None:
            values[x.name] = plain(x.value, x.name)
        else:
            names.setdefault(x.row, []).append(x.name)
    rows = list(names)
    items = [Item(tuple(names[r]), src.dtype(r), src.shape(r)) for r in rows]
    if opts.format == "safetensors":
        for it in items:  # every dtype checked before a byte is read
            st_shape(st_dtype(it.dtype, it.names[0]), it.shape, it.names[0])
    files: list[list[int]] = []
    held = 0
    for i, it in enumerate(items):
        size = it.nbytes * (len(it.names) if opts.format == "safetensors" else 1)
        if not files or (held + size > opts.shard and files[-1]):
            files.append([])
            held = 0
        files[-1].append(i)
        held += size
    return _Plan(items, rows, values, files or [[]])


def _file_names(fmt: str, n: int) -> list[str]:
    stem, ext = _NAMES[fmt]
    return [f"{stem}{ext}"] if n == 1 else [f"{stem}-{k:05d}-of-{n:05d}{ext}" for k in range(1, n + 1)]


def _index_name(fmt: str) -> str:
    stem, ext = _NAMES[fmt]
    return f"{stem}{ext}.index.json"


def _write(src: StepSource, plan: _Plan, tmp: Path, opts: _Options, step: int) -> None:
    """Every file of ``plan`` into ``tmp``, each synced; the index and values files."""
    names = _file_names(opts.format, len(plan.files))
    for k, (name, members) in enumerate(zip(names, plan.files)):
        items = [plan.items[i] for i in members]
        with output_errors():
            writer: SafetensorsWriter | TorchWriter = (
                SafetensorsWriter(tmp / name, items, {"format": "pt", "step": str(step)})
                if opts.format == "safetensors"
                else TorchWriter(tmp / name, items, plan.values if k == 0 else {})
            )
        try:
            parts = src.parts([plan.rows[i] for i in members], opts.inflight)
            for window in src.windows(parts, opts.inflight):
                with output_errors():
                    for p, t in window:
                        writer.put(p.item, p.start, t)
                del window, t  # nothing read is held while the next window is
            with output_errors():
                writer.close()
        except BaseException:
            writer.abort()
            raise
        log.info("export: wrote %s (%d tensors)", name, len(items))
    with output_errors():
        if len(names) > 1:
            weight_map = {n: f for f, members in zip(names, plan.files) for i in members for n in plan.items[i].names}
            if opts.format == "torch":
                weight_map.update(dict.fromkeys(plan.values, names[0]))
            total = _data_bytes(opts.format, plan.items)
            index = {"metadata": {"total_size": total}, "weight_map": dict(sorted(weight_map.items()))}
            _write_json(tmp / _index_name(opts.format), index)
        if opts.format == "safetensors" and plan.values:
            values = {n: _jsonable(v) for n, v in plan.values.items()}
            _write_json(tmp / VALUES_FILE, {"step": step, "values": values})


def _data_bytes(fmt: str, items: Sequence[Item]) -> int:
    """The tensor bytes the files hold: a tied tensor once per name in safetensors, once in torch files."""
    return sum(it.nbytes * (len(it.names) if fmt == "safetensors" else 1) for it in items)


def _write_json(path: Path, obj: Any) -> None:
    with open(path, "x", encoding="utf-8") as f:
        json.dump(obj, f, indent=2, ensure_ascii=False)
        f.write("\n")
        f.flush()
        os.fsync(f.fileno())


def _jsonable(v: Any) -> Any:
    """A plain value as JSON: tuples and sizes as lists, a dtype or device as its string, bytes as
    ``{"base64": ...}``; an empty container as itself."""
    if v is None or isinstance(v, (bool, int, float, str)):
        return v
    if isinstance(v, bytes):
        return {"base64": base64.b64encode(v).decode("ascii")}
    if isinstance(v, (torch.dtype, torch.device)):
        return str(v)
    if isinstance(v, (list, tuple)):
        return [_jsonable(x) for x in v]
    if isinstance(v, Mapping):
        return {str(k): _jsonable(x) for k, x in v.items()}
    return repr(v)
