"""Fuzz the packer: tensors of every dtype torch has, of any shape (0-dim and zero-size included), as any
view of a storage (slices with steps, transposes, expands, as_strided, conj and neg views, real/imag,
diagonal, unfold, narrow, select, dtype views) either round-trip bit-exactly through save -> restore and
restore(into=) or are refused with StateError; through the C loops and the Python loops, into a memory
tier (packed in place) and a directory tier (packed through staging buffers)."""

from __future__ import annotations

import ctypes
import itertools
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

import tierckpt.datapath.packing
import tierckpt.format.native as nat
from tierckpt import Hierarchy, StateError
from tierckpt.format.memory import copies

DTYPES = sorted({v for v in vars(torch).values() if isinstance(v, torch.dtype)}, key=str)
#: refused by design (flatten: quantized tensors); every other dtype must round-trip
REFUSED = {torch.qint8, torch.qint32, torch.quint8, torch.quint4x2, torch.quint2x4}
EXAMPLES = {"host": 800, "local": 80}  # ~3,500 tensors in all, 25-40 s here (2 busy cores); -m slow runs 10x
SLOW_FACTOR = 10


def _bytes(t: torch.Tensor) -> bytes:
    same = {1: torch.uint8, 2: torch.int16, 4: torch.int32, 8: torch.int64}.get(t.element_size())
    c = t.view(same).contiguous() if same is not None and not (t.is_conj() or t.is_neg()) else t.contiguous()
    return ctypes.string_at(c.data_ptr(), c.nbytes) if c.nbytes else b""


def _try(f: Callable[..., torch.Tensor | None], *args: Any) -> torch.Tensor | None:
    try:
        return f(*args)
    except (RuntimeError, ValueError, IndexError, TypeError, NotImplementedError):
        return None  # torch itself refuses this view of this tensor: not the packer's case


def _view(flat: torch.Tensor, reshape: int, ops: list[tuple[str, int, int, int, int]], strided: Any) -> torch.Tensor:
    """A view of ``flat`` (1-D, the whole storage): reshaped to ``(reshape, -1)`` where that divides,
    then each op applied where torch allows it (else skipped)."""
    t, n = flat, flat.numel()
    if n and reshape and n % reshape == 0:
        t = flat.view(reshape, n // reshape)
    for op, d, i, j, k in ops:
        nd = t.dim()
        if op == "as_strided":
            size, stride, off = strided
            reach = 1 + sum((s - 1) * r for s, r in zip(size, stride)) if all(size) else 0
            t2 = _try(flat.as_strided, size, stride, min(off, n - reach)) if reach <= n else None
        else:
            t2 = _try(_apply, op, t, nd, d % max(1, nd), i, j, k)
        t = t if t2 is None else t2
    return t


OPS = [
    "slice", "transpose", "expand", "as_strided", "conj", "neg", "real", "imag", "diagonal", "unfold",
    "narrow", "select", "view_dtype", "unsqueeze", "permute", "flatten",
]  # fmt: skip


def _apply(op: str, t: torch.Tensor, nd: int, d: int, i: int, j: int, k: int) -> torch.Tensor | None:
    if op == "slice" and nd:
        idx = [slice(None)] * nd
        idx[d] = slice(i % (t.shape[d] + 1), None, 1 + k % 3)
        return t[tuple(idx)]
    if op == "transpose" and nd >= 2:
        return t.transpose(d, (d + 1 + i) % nd)
    if op == "expand":
        u = t.unsqueeze(d % (nd + 1))
        shape = list(u.shape)
        shape[d % (nd + 1)] = k % 3
        return u.expand(shape)
    if op == "conj":
        return t.conj()
    if op == "neg":
        return torch._neg_view(t)
    if op == "real":
        return t.real
    if op == "imag":
        return t.imag
    if op == "diagonal" and nd >= 2:
        return t.diagonal(i % 3 - 1, d, (d + 1) % nd)
    if op == "unfold" and nd:
        return t.unfold(d, 1 + i % 3, 1 + k % 3)
    if op == "narrow" and nd:
        start = i % (t.shape[d] + 1)
        return t.narrow(d, start, min(k, t.shape[d] - start))
    if op == "select" and nd and t.shape[d]:
        return t.select(d, i % t.shape[d])
    if op == "view_dtype":
        # not as bool: a byte other than 0 and 1 is no bool value (torch may normalize it in any copy)
        same = [x for x in DTYPES if x.itemsize == t.dtype.itemsize and x not in REFUSED and x is not torch.bool]
        return t.view(same[i % len(same)]) if same else None
    if op == "unsqueeze":
        return t.unsqueeze(d % (nd + 1))
    if op == "permute" and nd >= 2:
        return t.permute(*reversed(range(nd)))
    if op == "flatten":
        return t.flatten()
    return None


_OP = st.tuples(st.sampled_from(OPS), *(st.integers(0, 5) for _ in range(4)))
_STRIDED = st.lists(st.tuples(st.integers(0, 4), st.integers(0, 5)), max_size=3).map(
    lambda dims: (tuple(d for d, _ in dims), tuple(r for _, r in dims))
)


@st.composite
def recipes(draw: st.DrawFn) -> dict[str, Any]:
    """A state's recipe (plain values, so that hypothesis can print it): a storage of ``n`` random
    elements of a dtype, up to three views of it (each up to four view operations), maybe the storage."""
    dtype = draw(st.sampled_from(DTYPES))
    n = draw(st.integers(0, 48))
    size = n * dtype.itemsize
    views = [
        (draw(st.integers(0, 6)), draw(st.lists(_OP, max_size=4)), (*draw(_STRIDED), draw(st.integers(0, 48))))
        for _ in range(draw(st.integers(1, 3)))
    ]
    return {"dtype": str(dtype), "raw": draw(st.binary(min_size=size, max_size=size)), "views": views,
            "base": draw(st.booleans())}  # fmt: skip


def build(recipe: dict[str, Any]) -> dict[str, Any] | None:
    """The state a recipe describes (None where torch cannot make a tensor of that dtype)."""
    dtype = getattr(torch, recipe["dtype"].removeprefix("torch."))
    raw = bytearray(recipe["raw"])
    if dtype in REFUSED:
        flat = _try(lambda: torch.quantize_per_tensor(torch.randn(len(raw)), 0.1, 0, dtype))
    elif not raw:
        flat = torch.empty(0, dtype=dtype)
    else:
        if dtype is torch.bool:
            raw = bytearray(b & 1 for b in raw)
        flat = torch.frombuffer(raw, dtype=torch.uint8).view(dtype)  # holds raw (torch cannot copy every dtype)
    if flat is None:
        return None
    if flat.is_quantized:  # torch itself segfaults making some views of quantized tensors: save them whole
        return {"q": flat, "r": flat}
    state: dict[str, Any] = {
        f"v{i}": _view(flat, r, ops, strided) for i, (r, ops, strided) in enumerate(recipe["views"])
    }
    if recipe["base"]:
        state["base"] = flat
    return state


def _target(t: torch.Tensor, strided: bool) -> torch.Tensor:
    """A fresh tensor of ``t``'s shape and dtype, full of 0xA5 bytes; non-contiguous if ``strided``."""
    shape = tuple(t.shape)
    if strided and len(shape) >= 2:
        u = torch.empty(shape[::-1], dtype=t.dtype).permute(*reversed(range(len(shape))))
    else:
        u = torch.empty(shape, dtype=t.dtype)
    ctypes.memset(u.data_ptr(), 0xA5, u.untyped_storage().nbytes())
    return u


def _check(h: Hierarchy, step: int, state: dict[str, Any], strided: bool) -> None:
    # what the save must restore: each tensor's value (conj and neg bits resolved), if torch can compute it
    # (not asked of quantized tensors: resolve_neg() of a negative view of a quint4x2 one segfaults torch)
    if any(v.is_quantized for v in state.values()):  # a view of one as another dtype stays quantized
        with pytest.raises(StateError, match="cannot save a quantized tensor"):
            h.save(state, step=step)
        return
    expect = {k: _try(lambda v: v.resolve_conj().resolve_neg(), v) for k, v in state.items()}
    refused = any(v is None for v in expect.values())
    try:
        h.save(state, step=step).wait()
    except StateError:
        assert refused, "StateError for a state that is not refused by design"
        return
    assert not refused, "a view whose value torch cannot compute was saved"
    back = h.restore(step=step)
    for k, v in expect.items():
        got = back[k]
        assert got.dtype == v.dtype and got.shape == v.shape, k
        assert _bytes(got) == _bytes(v), k
    target = {k: _target(v, strided) for k, v in expect.items()}
    try:
        h.restore(step=step, into=target)
    except StateError:  # a target that only a copy can fill, of a dtype torch cannot copy
        assert any(not copies(v.dtype) and v.numel() for v in expect.values())
        assert all(set(_bytes(t)) <= {0xA5} for t in target.values()), "a refused restore changed the target"
        return
    for k, v in expect.items():
        assert _bytes(target[k]) == _bytes(v), k


def _fuzz(tmp_path: Path, monkeypatch: pytest.MonkeyPatch, impl: str, tier: str, examples: int) -> None:
    if impl == "native" and nat.native is None:
        pytest.skip("tierckpt.format._native is not built here")
    if impl == "python":
        for mod in (
            nat,
            tierckpt.datapath.packing,
        ):
            monkeypatch.setattr(mod, "native", None)
    spec = {"host": {"kind": "host", "capacity": "64MiB"}, "local": {"kind": "local", "path": str(tmp_path / "t")}}
    config = {"tiers": [{"name": "t", **spec[tier]}], "io": {"engine": "threads"}, "policy": {"keep": {"t": 1}}}
    steps = itertools.count()
    with Hierarchy.from_config(config) as h:

        @settings(
            max_examples=examples,
            derandomize=True,
            deadline=None,
            database=None,
            suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large, HealthCheck.filter_too_much],
        )
        @given(recipes(), st.booleans())
        def run(recipe: dict[str, Any], strided: bool) -> None:
            state = build(recipe)
            if state is not None:
                _check(h, next(steps), state, strided)

        run()


@pytest.mark.parametrize("tier", ["host", "local"])
@pytest.mark.parametrize("impl", ["native", "python"])
def test_every_view_of_every_dtype_round_trips_or_is_refused(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, impl: str, tier: str
) -> None:
    _fuzz(tmp_path, monkeypatch, impl, tier, EXAMPLES[tier])


@pytest.mark.slow
@pytest.mark.parametrize("tier", ["host", "local"])
@pytest.mark.parametrize("impl", ["native", "python"])
def test_every_view_of_every_dtype_round_trips_or_is_refused_long(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, impl: str, tier: str
) -> None:
    _fuzz(tmp_path, monkeypatch, impl, tier, EXAMPLES[tier] * SLOW_FACTOR)
