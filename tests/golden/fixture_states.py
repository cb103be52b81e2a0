"""The states stored in tests/golden: one function builds them, for the fixture writer and for the tests.

Imports torch only, never tierckpt: ``make_fixture.py`` runs it under the tierckpt of any commit (the
old fixtures were written by old commits' writers), and ``tests/integration/test_golden.py`` rebuilds
the expected values from it. Everything here is deterministic (values from ``torch.arange`` and fixed
byte patterns). Changing a state invalidates every fixture that holds it: add a new step instead.
"""

from __future__ import annotations

import fractions
from collections import OrderedDict
from typing import Any, NamedTuple

import torch

__all__ = ["CORE_DTYPES", "GOLDEN_STEPS", "RAW_DTYPES", "Golden", "golden_states"]

#: dtypes with meaningful ``arange`` values, in every torch this project supports (>= 2.3).
CORE_DTYPES = (
    "float32",
    "float64",
    "float16",
    "bfloat16",
    "int8",
    "int16",
    "int32",
    "int64",
    "uint8",
    "bool",
    "complex64",
    "complex128",
    "float8_e4m3fn",
    "float8_e5m2",
)


#: Every other dtype torch 2.13 has (the fixtures' writers accepted them all), but the quantized ones
#: (refused by design): bit patterns, not values (torch cannot compute with most of them). Fixed here,
#: not read from torch, so that the stored step does not depend on the torch that rebuilds it.
RAW_DTYPES = (
    "bits16",
    "bits1x8",
    "bits2x4",
    "bits4x2",
    "bits8",
    "complex32",
    "float4_e2m1fn_x2",
    "float8_e4m3fnuz",
    "float8_e5m2fnuz",
    "float8_e8m0fnu",
    "int1",
    "int2",
    "int3",
    "int4",
    "int5",
    "int6",
    "int7",
    "uint1",
    "uint2",
    "uint3",
    "uint4",
    "uint5",
    "uint6",
    "uint7",
    "uint16",
    "uint32",
    "uint64",
)


class Golden(NamedTuple):
    """One stored step: the state saved, and whether saving (and restoring) it needs ``allow_pickle``."""

    state: Any
    allow_pickle: bool = False


def _arange(name: str, n: int = 6) -> torch.Tensor:
    dt = getattr(torch, name)
    if dt is torch.bool:
        return torch.arange(n) % 3 == 0
    if dt.is_complex:
        real = torch.arange(n, dtype=torch.float64)
        return torch.complex(real, -real / 2).to(dt)
    return torch.arange(n, dtype=torch.float32).sub(2).to(dt) if dt.is_signed else torch.arange(n).to(dt)


def _raw(dt: torch.dtype, n: int = 6) -> torch.Tensor:
    """``n`` elements of ``dt`` from a fixed byte pattern (torch cannot compute with every dtype)."""
    data = bytearray((i * 37 + 11) % 256 for i in range(n * dt.itemsize))
    return torch.frombuffer(data, dtype=torch.uint8).view(dt).reshape(2, -1)


def _raw_dtypes() -> dict[str, torch.Tensor]:
    """One tensor of each of :data:`RAW_DTYPES` that this torch has."""
    return {n: _raw(getattr(torch, n)) for n in RAW_DTYPES if isinstance(getattr(torch, n, None), torch.dtype)}


def _core() -> dict[Any, Any]:
    w = torch.arange(12, dtype=torch.float32).reshape(3, 4)
    grid = torch.arange(20, dtype=torch.int32).reshape(4, 5)
    return {
        "model": OrderedDict([("w", w), ("b", torch.arange(4, dtype=torch.float64) / 8), ("tied", w)]),
        "row_of_w": w[1],  # shares w's storage, another extent: a row of its own
        "dtypes": {name: _arange(name) for name in CORE_DTYPES},
        "scalar": torch.tensor(3.5),
        "scalar_int": torch.tensor(-7, dtype=torch.int64),
        "empty": torch.empty(0, 3, dtype=torch.float32),
        "empty_1d": torch.zeros(0, dtype=torch.int16),
        "strided": grid.t()[1:, ::2],  # non-contiguous: stored as its contiguous bytes
        "conj": torch.complex(torch.arange(3.0), torch.ones(3)).conj(),  # a lazily conjugated view
        "optim": {
            "state": {0: {"step": torch.tensor(5.0), "exp_avg": torch.full((3, 4), 0.25)}, 1: {}},
            "param_groups": [{"lr": 1e-3, "betas": (0.9, 0.999), "params": [0, 1], "nesterov": False}],
        },
        "nested": {
            "list": [1, 2.5, [None, True, "x"], []],
            "tuple": (1, "two", (3.0, ()), torch.arange(3, dtype=torch.int8)),
            "od": OrderedDict([("b", 1), ("a", [2, {"c": 3}]), (4, "int key")]),
            "deep": {"a": {"b": {"c": {"d": [({"e": 1},)]}}}},
        },
        "plain": {
            "int": 7,
            "neg": -3,
            "zero": 0,
            "i64_min": -(1 << 63),
            "u64_max": (1 << 64) - 1,
            "big": 1 << 70,
            "big_neg": -(1 << 80) + 1,
            "float": 0.1,
            "neg_zero": -0.0,
            "inf": float("inf"),
            "nan": float("nan"),
            "str": "héllo, wörld ✓",
            "empty_str": "",
            "bytes": b"\x00\x01\xfe\xff",
            "none": None,
            "true": True,
            "false": False,
            "empty_list": [],
            "empty_dict": {},
            "empty_tuple": (),
        },
        "torch_values": {"dtype": torch.bfloat16, "device": torch.device("cpu"), "size": torch.Size([2, 3])},
        7: "an int key",
        -1: [1, 2, 3],
    }


def _zstd() -> dict[str, Any]:
    """A tree over 64 KiB that zstd shrinks: every writer stores it compressed (tree_codec "zstd"); and a
    tensor over the fixture writer's 4 KiB blob size, so the step spans two blob files."""
    return {
        "w": torch.arange(8, dtype=torch.float32),
        "big": torch.arange(1536, dtype=torch.float32).reshape(48, 32),
        "names": [f"layers.{i % 64}.attention.weight" for i in range(3000)],
        "ids": list(range(3000)),
        "refs": [torch.arange(2, dtype=torch.int64)] * 3,
    }


def _pickled() -> dict[str, Any]:
    """Values stored as pickles (allow_pickle=True), among them a dict with a tuple key: it is pickled
    whole, tensor and all, after the writer gave its tensor a row that the tree never references."""
    return {
        "frac": fractions.Fraction(1, 3),
        "set": {3, 1, 2},
        "tuple_keys": {"t": torch.arange(4, dtype=torch.int16), (1, 2): "x"},
        "w": torch.arange(5, dtype=torch.float32),
    }


#: step -> what it holds; every fixture directory holds these steps.
GOLDEN_STEPS = {1: "core", 2: "every other dtype", 3: "zstd tree, two blobs", 4: "pickled values"}


def golden_states() -> dict[int, Golden]:
    """The state of every stored step, built afresh (tensors are new objects on every call)."""
    return {1: Golden(_core()), 2: Golden(_raw_dtypes()), 3: Golden(_zstd()), 4: Golden(_pickled(), allow_pickle=True)}
