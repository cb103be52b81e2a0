"""The files an export writes: safetensors, streamed (the header first, from the dtypes and shapes known up
front, then each tensor's bytes where the header puts them, in whatever order they are read), and
``torch.save`` files of a flat ``{name: tensor or value}`` dict.

The safetensors format (its README, "Format"): 8 bytes, the header's length as a little-endian u64; the
header, a JSON object naming each tensor's ``dtype``, ``shape`` and ``data_offsets`` ``[begin, end)``
in the bytes after the header, and an optional ``__metadata__`` object of strings; then the tensors'
bytes, little-endian, row-major, covering the data without holes. The header is padded with spaces to
a multiple of 8 bytes, and the tensors are placed by item size, largest first, so that each starts at
a multiple of its item size (as ``safetensors.torch.save_file`` places them).
"""

from __future__ import annotations

import ctypes
import json
import math
import os
import struct
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from tierckpt.errors import StateError

__all__ = ["ST_DTYPES", "Item", "SafetensorsWriter", "TorchWriter", "from_st_dtype", "st_dtype"]

MAX_HEADER_BYTES = 100_000_000  # what safetensors readers accept


def _dtypes() -> dict[torch.dtype, str]:
    names = {
        "bool": "BOOL", "uint8": "U8", "int8": "I8", "int16": "I16", "uint16": "U16", "int32": "I32",
        "uint32": "U32", "int64": "I64", "uint64": "U64", "float16": "F16", "bfloat16": "BF16",
        "float32": "F32", "float64": "F64", "complex64": "C64", "float8_e4m3fn": "F8_E4M3",
        "float8_e4m3fnuz": "F8_E4M3FNUZ", "float8_e5m2": "F8_E5M2", "float8_e5m2fnuz": "F8_E5M2FNUZ",
        "float8_e8m0fnu": "F8_E8M0", "float4_e2m1fn_x2": "F4",
    }  # fmt: skip
    return {getattr(torch, k): v for k, v in names.items() if isinstance(getattr(torch, k, None), torch.dtype)}


#: torch dtype -> safetensors dtype (those this torch has); ``float4_e2m1fn_x2`` holds two F4 values a byte
ST_DTYPES: dict[torch.dtype, str] = _dtypes()
_FROM_ST = {v: k for k, v in ST_DTYPES.items()}
_PACKED = {"F4": 2}  # safetensors dtypes counted in values, not bytes: values per byte of the torch dtype


def st_dtype(dtype: torch.dtype, name: str) -> str:
    """The safetensors dtype of ``dtype``.

    Raises:
        StateError: safetensors has none (naming ``name``, the tensor's, and the dtypes it has).
    """
    got = ST_DTYPES.get(dtype)
    if got is None:
        have = ", ".join(str(d).removeprefix("torch.") for d in ST_DTYPES)
        raise StateError(
            f"{name}: dtype {str(dtype).removeprefix('torch.')} has no safetensors type (safetensors holds {have}); "
            "export with format='torch' (--format torch), or leave it out"
        )
    return got


def st_shape(st: str, shape: Sequence[int], name: str) -> list[int]:
    """The shape the header names: a packed dtype's last dimension counts values, not bytes."""
    k = _PACKED.get(st)
    if k is None:
        return list(shape)
    if not shape:
        raise StateError(f"{name}: a 0-d {st} tensor has no safetensors shape (its byte holds {k} values)")
    return [*shape[:-1], shape[-1] * k]


def from_st_dtype(st: str, shape: Sequence[int], name: str) -> tuple[torch.dtype, tuple[int, ...]]:
    """A safetensors dtype and header shape as the torch dtype and shape (for reading).

    Raises:
        StateError: this torch has no such dtype.
    """
    dt = _FROM_ST.get(st)
    if dt is None:
        raise StateError(f"{name}: safetensors dtype {st} has no torch dtype here")
    k = _PACKED.get(st, 1)
    return dt, (*shape[:-1], shape[-1] // k) if k > 1 else tuple(shape)


@dataclass(frozen=True)
class Item:
    """A tensor of an output file: the names it is written under (tied tensors: several, each with its
    own bytes in a safetensors file, one tensor in a torch file), its dtype and its shape."""

    names: tuple[str, ...]
    dtype: torch.dtype
    shape: tuple[int, ...]

    @property
    def nbytes(self) -> int:
        return math.prod(self.shape) * self.dtype.itemsize


def _raw(t: torch.Tensor) -> memoryview:
    """The bytes of a contiguous CPU tensor, without a copy (the tensor must outlive the view)."""
    n = t.numel() * t.element_size()
    if not n:
        return memoryview(b"")
    assert t.is_contiguous() and t.device.type == "cpu"
    return memoryview((ctypes.c_ubyte * n).from_address(t.data_ptr())).cast("B")


def _pwrite(fd: int, data: memoryview, pos: int) -> None:
    while data:
        n = os.pwrite(fd, data, pos)
        data, pos = data[n:], pos + n


class SafetensorsWriter:
    """One safetensors file written as its tensors arrive: the header at once, each piece of a tensor's
    bytes at its place (:meth:`put`), the file checked whole and synced at :meth:`close`.

    Args:
        path: the file (created; it must not exist).
        items: its tensors, in the order they will be read.
        metadata: the header's ``__metadata__`` (str to str).

    Raises:
        StateError: a dtype safetensors lacks, or a header over safetensors' 100 MB limit.
    """

    def __init__(self, path: Path, items: Sequence[Item], metadata: Mapping[str, str]) -> None:
        header: dict[str, Any] = {"__metadata__": dict(metadata)}
        self.starts: list[list[int]] = [[] for _ in items]  # per item, each name's start in the data
        pos = 0
        for i in sorted(range(len(items)), key=lambda i: -items[i].dtype.itemsize):  # stable: aligned starts
            it = items[i]
            st = st_dtype(it.dtype, it.names[0])
            shape = st_shape(st, it.shape, it.names[0])
            for name in it.names:
                header[name] = {"dtype": st, "shape": shape, "data_offsets": [pos, pos + it.nbytes]}
                self.starts[i].append(pos)
                pos += it.nbytes
        text = json.dumps(header, separators=(",", ":"), ensure_ascii=False).encode()
        text += b" " * (-len(text) % 8)
        if len(text) > MAX_HEADER_BYTES:
            raise StateError(
                f"{path.name}: a header of {len(text)} bytes (safetensors reads at most {MAX_HEADER_BYTES}): "
                "give a smaller max shard size"
            )
        self.items, self.path, self.data = items, path, 8 + len(text)
        self.written = [0] * len(items)
        self.fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL | getattr(os, "O_CLOEXEC", 0), 0o644)
        try:
            _pwrite(self.fd, memoryview(struct.pack("<Q", len(text)) + text), 0)
            os.ftruncate(self.fd, self.data + pos)
        except BaseException:
            os.close(self.fd)
            raise

    def put(self, i: int, offset: int, piece: torch.Tensor) -> None:
        """Bytes ``offset`` on of item ``i`` (each of its names): ``piece``, a contiguous CPU tensor."""
        raw = _raw(piece)
        for start in self.starts[i]:
            _pwrite(self.fd, raw, self.data + start + offset)
        self.written[i] += len(raw)

    def close(self) -> None:
        """Check that every tensor was written whole, sync and close the file."""
        try:
            short = [it.names[0] for it, n in zip(self.items, self.written) if n != it.nbytes]
            if short:
                raise AssertionError(f"{self.path.name}: tensors not written whole: {short[:5]}")
            os.fsync(self.fd)
        finally:
            os.close(self.fd)

    def abort(self) -> None:
        os.close(self.fd)


class TorchWriter:
    """One ``torch.save`` file of ``{name: tensor or value}``: its tensors are held until :meth:`close`
    (``torch.save`` writes a whole object), so it holds at most one output file's bytes; tied names share
    one tensor, as they did when saved.

    Args:
        path: the file (it must not exist).
        items: its tensors.
        values: plain values to add under their names.
    """

    def __init__(self, path: Path, items: Sequence[Item], values: Mapping[str, Any]) -> None:
        self.path, self.items, self.values = path, items, dict(values)
        self.tensors: list[torch.Tensor | None] = [None] * len(items)
        self.written = [0] * len(items)

    def put(self, i: int, offset: int, piece: torch.Tensor) -> None:
        """Bytes ``offset`` on of item ``i``: ``piece``, a contiguous CPU tensor."""
        it = self.items[i]
        if offset == 0 and piece.nbytes == it.nbytes:
            self.tensors[i] = piece.reshape(it.shape)
        else:
            whole = self.tensors[i]
            if whole is None:
                whole = self.tensors[i] = torch.empty(it.shape, dtype=it.dtype)
            flat = whole.reshape(-1).view(torch.uint8)
            flat[offset : offset + piece.nbytes].copy_(piece.reshape(-1).view(torch.uint8))
        self.written[i] += piece.nbytes

    def close(self) -> None:
        """Write the file (exclusive create), sync and close it."""
        out: dict[str, Any] = {}
        for it, t, n in zip(self.items, self.tensors, self.written):
            if n != it.nbytes:
                raise AssertionError(f"{self.path.name}: {it.names[0]} not read whole")
            for name in it.names:
                out[name] = t if t is not None else torch.empty(it.shape, dtype=it.dtype)
        out.update(self.values)
        with open(self.path, "xb") as f:
            torch.save(out, f)
            f.flush()
            os.fsync(f.fileno())
        self.tensors = [None] * len(self.items)

    def abort(self) -> None:
        self.tensors = [None] * len(self.items)
