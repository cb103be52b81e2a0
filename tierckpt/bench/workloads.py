"""Deterministic benchmark workloads: training states built from a seed, sized by arguments.

* ``llm``: a LLaMA-style training state (embedding, transformer layers of q/k/v/o and gate/up/down,
  norms, lm_head): bf16 params and, per param, fp32 master weights, Adam ``exp_avg``/``exp_avg_sq`` and
  a 0-dim ``step``; param groups, the torch RNG state and an RNG bytes blob.
* ``small``: ``n`` tensors of 1-64 KiB, mixed dtypes, each with its own storage.
* ``mixed``: an ``llm`` state plus a few thousand small tensors and nested Python values (long
  param_groups, a training config, data loader state).
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import Any

import torch

__all__ = [
    "LLM_FULL",
    "LLM_QUICK",
    "LLMDims",
    "Workload",
    "build_workload",
    "empty_like_state",
    "iter_tensors",
    "like_state",
    "llm_dims_for",
    "make_llm_state",
    "make_mixed_state",
    "make_small_state",
    "same_state",
    "state_bytes",
    "zeros_like_state",
]

_PARAM_STATE_BYTES = 2 + 4 * 3  # bf16 param + fp32 master, exp_avg, exp_avg_sq per parameter


@dataclass(frozen=True)
class LLMDims:
    """Shape of the ``llm`` workload's model."""

    vocab: int
    hidden: int
    ffn: int
    layers: int

    def state_bytes(self) -> int:
        """Tensor bytes of the training state these dims give (params, master, Adam moments)."""
        per_layer = 4 * self.hidden * self.hidden + 3 * self.hidden * self.ffn + 2 * self.hidden
        params = 2 * self.vocab * self.hidden + self.layers * per_layer + self.hidden
        return params * _PARAM_STATE_BYTES


LLM_FULL = LLMDims(vocab=32000, hidden=1024, ffn=2816, layers=4)  # 117 M params -> ~1.64 GB state
LLM_QUICK = LLMDims(vocab=4000, hidden=256, ffn=704, layers=2)  # ~51 MB
_LLM_MID = LLMDims(vocab=8000, hidden=512, ffn=1408, layers=1)


def llm_dims_for(target_bytes: int) -> LLMDims:
    """The ``llm`` dims whose state is closest to ``target_bytes``: LLaMA-7B-like widths scaled down
    (hidden 1024, 512 or 256) and as many layers as fit (at least one)."""
    best = LLM_QUICK
    for base in (LLM_FULL, _LLM_MID, LLM_QUICK):
        zero = LLMDims(base.vocab, base.hidden, base.ffn, 0)
        per_layer = LLMDims(base.vocab, base.hidden, base.ffn, 1).state_bytes() - zero.state_bytes()
        layers = max(1, round((target_bytes - zero.state_bytes()) / per_layer))
        best = LLMDims(base.vocab, base.hidden, base.ffn, layers)
        if zero.state_bytes() + per_layer <= target_bytes * 1.25:
            return best
    return best


def make_llm_state(d: LLMDims, seed: int = 0) -> dict[str, Any]:
    """A LLaMA-style training state: bf16 params, fp32 master weights and Adam moments, counters, RNG."""
    g = torch.Generator().manual_seed(seed)
    shapes: dict[str, tuple[int, ...]] = {"model.embed_tokens.weight": (d.vocab, d.hidden)}
    for i in range(d.layers):
        p = f"model.layers.{i}."
        shapes.update(
            {
                p + "self_attn.q_proj.weight": (d.hidden, d.hidden),
                p + "self_attn.k_proj.weight": (d.hidden, d.hidden),
                p + "self_attn.v_proj.weight": (d.hidden, d.hidden),
                p + "self_attn.o_proj.weight": (d.hidden, d.hidden),
                p + "mlp.gate_proj.weight": (d.ffn, d.hidden),
                p + "mlp.up_proj.weight": (d.ffn, d.hidden),
                p + "mlp.down_proj.weight": (d.hidden, d.ffn),
                p + "input_layernorm.weight": (d.hidden,),
                p + "post_attention_layernorm.weight": (d.hidden,),
            }
        )
    shapes["model.norm.weight"] = (d.hidden,)
    shapes["lm_head.weight"] = (d.vocab, d.hidden)
    model: dict[str, torch.Tensor] = {}
    optim_state: dict[int, dict[str, torch.Tensor]] = {}
    for i, (name, shape) in enumerate(shapes.items()):
        if name.endswith("norm.weight"):
            master = 1.0 + 0.01 * torch.randn(shape, generator=g)
        else:
            master = torch.randn(shape, generator=g) * 0.02
        model[name] = master.to(torch.bfloat16)
        optim_state[i] = {
            "step": torch.tensor(1000.0),
            "master": master,
            "exp_avg": torch.randn(shape, generator=g) * 1e-3,
            "exp_avg_sq": torch.rand(shape, generator=g) * 1e-6,
        }
    rng_blob = torch.randint(0, 256, (5056,), dtype=torch.uint8, generator=g).numpy().tobytes()
    return {
        "model": model,
        "optim": {
            "state": optim_state,
            "param_groups": [
                {"lr": 3e-4, "betas": (0.9, 0.95), "eps": 1e-8, "weight_decay": 0.1, "params": list(optim_state)}
            ],
        },
        "rng": {"torch_cpu": torch.get_rng_state(), "python": rng_blob},
        "step": 1000,
    }


_SMALL_DTYPES = (torch.float32, torch.bfloat16, torch.float16, torch.int64, torch.int32, torch.uint8, torch.bool)


def make_small_state(n: int, seed: int = 0, lo: int = 1 << 10, hi: int = 64 << 10) -> dict[str, Any]:
    """``n`` tensors of ``lo``-``hi`` bytes (uniform), mixed dtypes, each with its own storage."""
    g = torch.Generator().manual_seed(seed)
    sizes = torch.randint(lo, hi + 1, (n,), generator=g).tolist()
    kinds = torch.randint(0, len(_SMALL_DTYPES), (n,), generator=g).tolist()
    pool = torch.randint(0, 256, (hi * 64,), dtype=torch.uint8, generator=g)
    starts = (torch.randint(0, hi * 63 // 8, (n,), generator=g) * 8).tolist()
    state: dict[str, dict[str, torch.Tensor]] = {}
    for i, (nb, k, s) in enumerate(zip(sizes, kinds, starts)):
        dt = _SMALL_DTYPES[k]
        item = torch.empty((), dtype=dt).element_size()
        numel = max(1, nb // item)
        raw = pool[s : s + numel * item]
        t = (raw & 1).view(torch.bool).clone() if dt is torch.bool else raw.view(dt).clone()
        state.setdefault(f"block{i // 100:04d}", {})[f"t{i % 100:02d}"] = t
    return state


def make_mixed_state(d: LLMDims, n_small: int, seed: int = 0) -> dict[str, Any]:
    """An ``llm`` state plus ``n_small`` small tensors (1-64 KiB) and nested Python values: one param
    group per layer with long ``params`` lists, a training config, and data loader state."""
    state = make_llm_state(d, seed)
    params = state["optim"]["param_groups"][0]["params"]
    state["optim"]["param_groups"] = [
        {"lr": 3e-4 * (0.9**k), "betas": (0.9, 0.95), "eps": 1e-8, "weight_decay": 0.0 if k % 2 else 0.1,
         "params": params[k::4], "name": f"group{k}", "fused": None, "amsgrad": False}
        for k in range(4)
    ]  # fmt: skip
    state["buffers"] = make_small_state(n_small, seed=seed + 1)
    state["config"] = {
        "model": {"vocab": d.vocab, "hidden": d.hidden, "ffn": d.ffn, "layers": d.layers, "rope_theta": 10000.0},
        "schedule": {"warmup": 2000, "decay": "cosine", "milestones": list(range(0, 100_000, 5000))},
        "tags": ["bench", "mixed", None, True, 3.5],
        "mesh": (1, 1, 1),
    }
    state["dataloader"] = {
        "epoch": 3,
        "offsets": [i * 4096 for i in range(1000)],
        "shards": {f"shard-{i:04d}": {"pos": i * 17, "done": i % 3 == 0} for i in range(200)},
        "sampler_seed": b"\x00\x01" * 64,
    }
    return state


def iter_tensors(obj: Any) -> Iterator[torch.Tensor]:
    """Every tensor in a nested dict/list/tuple, in order."""
    if isinstance(obj, torch.Tensor):
        yield obj
    elif isinstance(obj, dict):
        for v in obj.values():
            yield from iter_tensors(v)
    elif isinstance(obj, (list, tuple)):
        for v in obj:
            yield from iter_tensors(v)


def like_state(obj: Any, make: Callable[[torch.Tensor], torch.Tensor]) -> Any:
    """The same nested structure with every tensor replaced by ``make(tensor)``."""
    if isinstance(obj, torch.Tensor):
        return make(obj)
    if isinstance(obj, dict):
        return {k: like_state(v, make) for k, v in obj.items()}
    if isinstance(obj, list):
        return [like_state(v, make) for v in obj]
    if isinstance(obj, tuple):
        return tuple(like_state(v, make) for v in obj)
    return obj


def empty_like_state(obj: Any) -> Any:
    """``torch.empty_like`` for every tensor: untouched memory, so the page faults are paid by the
    restore that fills it, as by a restore into new tensors."""
    return like_state(obj, torch.empty_like)


def zeros_like_state(obj: Any) -> Any:
    """``torch.zeros_like`` for every tensor: memory already written, like a live model's and
    optimizer's (what a training restart restores into)."""
    return like_state(obj, torch.zeros_like)


def state_bytes(state: Any) -> tuple[int, int]:
    """(tensor bytes, tensor count) of a nested state."""
    ts = list(iter_tensors(state))
    return sum(t.numel() * t.element_size() for t in ts), len(ts)


def same_state(a: Any, b: Any) -> bool:
    """Bitwise equality of every tensor (NaN-safe) and equality of every other value."""
    if isinstance(a, torch.Tensor):
        return (
            isinstance(b, torch.Tensor)
            and a.dtype == b.dtype
            and a.shape == b.shape
            and torch.equal(a.reshape(-1).view(torch.uint8), b.reshape(-1).view(torch.uint8))
        )
    if isinstance(a, dict):
        return isinstance(b, dict) and a.keys() == b.keys() and all(same_state(a[k], b[k]) for k in a)
    if isinstance(a, (list, tuple)):
        return type(a) is type(b) and len(a) == len(b) and all(same_state(x, y) for x, y in zip(a, b))
    return bool(a == b)


@dataclass
class Workload:
    """A built workload: its name, the state, and what it holds."""

    name: str
    state: Any
    nbytes: int
    ntensors: int
    describe: str


def build_workload(name: str, *, llm_bytes: int, small_count: int, mixed_bytes: int, mixed_small: int) -> Workload:
    """Build the named workload (``llm``, ``small`` or ``mixed``) at the given sizes.

    Args:
        name: workload name.
        llm_bytes: target state size of ``llm`` (the nearest whole number of layers is used).
        small_count: number of tensors of ``small``.
        mixed_bytes: target size of the ``llm`` part of ``mixed``.
        mixed_small: number of small tensors in ``mixed``.

    Raises:
        ValueError: unknown name.
    """
    if name == "llm":
        d = llm_dims_for(llm_bytes)
        state: Any = make_llm_state(d)
        what = f"LLaMA-style, vocab {d.vocab}, hidden {d.hidden}, ffn {d.ffn}, {d.layers} layers"
    elif name == "small":
        state = make_small_state(small_count)
        what = f"{small_count} tensors of 1-64 KiB, mixed dtypes"
    elif name == "mixed":
        d = llm_dims_for(mixed_bytes)
        state = make_mixed_state(d, mixed_small)
        what = f"llm ({d.layers} layers, hidden {d.hidden}) + {mixed_small} small tensors + nested Python values"
    else:
        raise ValueError(f"unknown workload {name!r} (llm, small, mixed)")
    nbytes, ntensors = state_bytes(state)
    return Workload(name, state, nbytes, ntensors, what)
