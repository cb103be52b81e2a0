"""The training workload of ``bench_train.py``: a small GPT-style model, seeded batches, and the GIL probe loops.

Everything here is deterministic: the model is initialised from a seed, batch ``i`` is drawn from a
generator seeded with ``(seed, i)``, so two runs of the same mode train the same numbers.
"""

from __future__ import annotations

import copy
import time
from collections.abc import Callable, Iterator
from dataclasses import asdict, dataclass
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

__all__ = [
    "FULL",
    "GPT",
    "QUICK",
    "GPTDims",
    "Trainer",
    "matmul_loop",
    "poisoned",
    "python_loop",
    "rate_until",
    "same_tensors",
    "sched_secs",
    "snapshot",
    "tensor_bytes",
]


@dataclass(frozen=True)
class GPTDims:
    """Model and batch sizes. ``state_bytes`` ≈ 12 × parameters (fp32 weights, AdamW exp_avg, exp_avg_sq)."""

    vocab: int
    dim: int
    layers: int
    heads: int
    batch: int
    seq: int

    def params(self) -> int:
        d = self.dim
        per_block = 4 * d + (3 * d * d + 3 * d) + (d * d + d) + (4 * d * d + 4 * d) + (4 * d * d + d)
        return 2 * self.vocab * d + self.seq * d + self.layers * per_block + 2 * d

    def as_dict(self) -> dict[str, int]:
        return asdict(self)


# ~27 M parameters -> ~330 MB of training state; ~0.5-0.8 s per step on one core of this machine.
FULL = GPTDims(vocab=8192, dim=512, layers=6, heads=8, batch=4, seq=64)
QUICK = GPTDims(vocab=512, dim=64, layers=2, heads=4, batch=2, seq=16)


class Block(nn.Module):
    """Pre-norm transformer block: causal self-attention, then a GELU MLP (4× wide)."""

    def __init__(self, dim: int, heads: int) -> None:
        super().__init__()
        self.heads = heads
        self.ln1 = nn.LayerNorm(dim)
        self.qkv = nn.Linear(dim, 3 * dim)
        self.proj = nn.Linear(dim, dim)
        self.ln2 = nn.LayerNorm(dim)
        self.fc = nn.Linear(dim, 4 * dim)
        self.out = nn.Linear(4 * dim, dim)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, t, d = x.shape
        q, k, v = self.qkv(self.ln1(x)).view(b, t, 3, self.heads, d // self.heads).permute(2, 0, 3, 1, 4)
        y = F.scaled_dot_product_attention(q, k, v, is_causal=True).transpose(1, 2).reshape(b, t, d)
        x = x + self.proj(y)
        return x + self.out(F.gelu(self.fc(self.ln2(x))))


class GPT(nn.Module):
    """Token + position embedding, ``layers`` blocks, final LayerNorm, untied LM head."""

    def __init__(self, d: GPTDims) -> None:
        super().__init__()
        self.tok = nn.Embedding(d.vocab, d.dim)
        self.pos = nn.Embedding(d.seq, d.dim)
        self.blocks = nn.ModuleList(Block(d.dim, d.heads) for _ in range(d.layers))
        self.ln = nn.LayerNorm(d.dim)
        self.head = nn.Linear(d.dim, d.vocab, bias=False)

    def forward(self, idx: torch.Tensor) -> torch.Tensor:
        x = self.tok(idx) + self.pos(torch.arange(idx.shape[1]))
        for block in self.blocks:
            x = block(x)
        return self.head(self.ln(x))


class Trainer:
    """Model + AdamW, seeded; ``forward_backward(i)`` then ``update()`` is one training step.

    ``state()`` is the training state a checkpoint holds: the live tensors of ``model.state_dict()`` and
    ``optimizer.state_dict()`` (no copies), and the step counter.
    """

    def __init__(self, dims: GPTDims, seed: int = 0) -> None:
        self.dims, self.seed = dims, seed
        torch.manual_seed(seed)
        self.model = GPT(dims)
        self.opt = torch.optim.AdamW(self.model.parameters(), lr=1e-4, weight_decay=0.1)
        self.steps_done = 0

    def batch(self, i: int) -> torch.Tensor:
        g = torch.Generator().manual_seed(self.seed * 1_000_003 + i)
        return torch.randint(0, self.dims.vocab, (self.dims.batch, self.dims.seq + 1), generator=g)

    def forward_backward(self, i: int) -> float:
        tokens = self.batch(i)
        logits = self.model(tokens[:, :-1])
        loss = F.cross_entropy(logits.reshape(-1, self.dims.vocab), tokens[:, 1:].reshape(-1))
        loss.backward()
        return float(loss.detach())

    def update(self) -> None:
        self.opt.step()
        self.opt.zero_grad(set_to_none=True)
        self.steps_done += 1

    def state(self) -> dict[str, Any]:
        return {"model": self.model.state_dict(), "optim": self.opt.state_dict(), "step": self.steps_done}


# -- state helpers --------------------------------------------------------------------------------------
def _tensors(obj: Any, path: str = "") -> Iterator[tuple[str, torch.Tensor]]:
    if isinstance(obj, torch.Tensor):
        yield path, obj
    elif isinstance(obj, dict):
        for k, v in obj.items():
            yield from _tensors(v, f"{path}/{k}")
    elif isinstance(obj, (list, tuple)):
        for i, v in enumerate(obj):
            yield from _tensors(v, f"{path}/{i}")


def tensor_bytes(state: Any) -> tuple[int, int]:
    """(bytes, count) of the tensors in ``state``."""
    ts = [t for _, t in _tensors(state)]
    return sum(t.numel() * t.element_size() for t in ts), len(ts)


def snapshot(state: Any) -> Any:
    """A deep copy: what a checkpoint taken now must restore to."""
    return copy.deepcopy(state)


def poisoned(state: Any) -> Any:
    """A deep copy whose tensor bytes are all 0xA5: a state to load into that matches nothing by chance."""
    out = copy.deepcopy(state)
    for _, t in _tensors(out):
        t.reshape(-1).view(torch.uint8).fill_(0xA5)
    return out


def same_tensors(ref: Any, got: Any) -> str | None:
    """None if every tensor of ``ref`` is in ``got`` at the same path with the same dtype, shape and bytes;
    else the first difference. Only tensors are compared (plain values may come back as other types)."""
    have = dict(_tensors(got))
    want = dict(_tensors(ref))
    for path, a in want.items():
        b = have.get(path)
        if b is None:
            return f"{path}: missing"
        if a.dtype != b.dtype or a.shape != b.shape:
            return f"{path}: {a.dtype}{tuple(a.shape)} vs {b.dtype}{tuple(b.shape)}"
        if not torch.equal(a.reshape(-1).view(torch.uint8), b.reshape(-1).view(torch.uint8)):
            return f"{path}: bytes differ"
    return None


# -- GIL probe loops ------------------------------------------------------------------------------------
def python_loop(n: int = 20_000) -> Callable[[], None]:
    """A pure-Python chunk of work (~0.6 ms here): holds the GIL the whole time it runs."""

    def run() -> None:
        x = 0
        for i in range(n):
            x += i * i

    return run


def matmul_loop(size: int = 256) -> Callable[[], None]:
    """A torch chunk (~0.35 ms here): one ``size``×``size`` fp32 matmul, which runs without the GIL."""
    a = torch.randn(size, size, generator=torch.Generator().manual_seed(0))
    b = torch.randn(size, size, generator=torch.Generator().manual_seed(1))
    out = torch.empty(size, size)

    def run() -> None:
        torch.mm(a, b, out=out)

    return run


def sched_secs() -> tuple[float, float]:
    """(seconds on a CPU, seconds runnable but waiting for a CPU) of the calling thread, from
    ``/proc/thread-self/schedstat``; zeros where the kernel does not provide it."""
    try:
        with open("/proc/thread-self/schedstat") as f:
            run_ns, wait_ns = f.read().split()[:2]
        return int(run_ns) / 1e9, int(wait_ns) / 1e9
    except (OSError, ValueError):
        return 0.0, 0.0


def rate_until(chunk: Callable[[], None], done: Callable[[], bool], max_secs: float) -> dict[str, float]:
    """Run ``chunk`` until ``done()`` or ``max_secs``.

    Returns ``chunks`` run, wall ``secs``, and where the calling thread's time went: ``cpu_secs`` on a
    CPU, ``runq_secs`` runnable but waiting for a CPU (other threads and processes), the rest blocked
    (for a loop that never sleeps: waiting for the GIL); ``bg_cpu_secs``: CPU time of this process's
    other threads meanwhile.
    """
    n = 0
    cpu0, runq0 = sched_secs()
    proc0, thr0 = time.process_time(), time.thread_time()
    t0 = time.perf_counter()
    deadline = t0 + max_secs
    while True:
        chunk()
        n += 1
        now = time.perf_counter()
        if done() or now >= deadline:
            break
    cpu1, runq1 = sched_secs()
    proc1, thr1 = time.process_time(), time.thread_time()
    return {
        "chunks": n,
        "secs": now - t0,
        "cpu_secs": cpu1 - cpu0,
        "runq_secs": runq1 - runq0,
        "bg_cpu_secs": (proc1 - proc0) - (thr1 - thr0),
    }
