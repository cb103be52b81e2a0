"""The model of ``bench_restart.py``'s end-to-end restart: a LLaMA-style decoder with the shapes of the
``llm`` workload (tierckpt/bench/workloads.py), fp32 weights, ``torch.optim.AdamW``.

The training state (``model.state_dict()`` + ``optimizer.state_dict()``: weights, ``exp_avg``,
``exp_avg_sq``, ``step``) is 12 bytes per parameter: ~1.4 GB at the full size.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from tierckpt.bench.workloads import LLM_FULL, LLM_QUICK, LLMDims

__all__ = ["Llama", "batch", "fresh_adam_state", "llm_dims"]

_SEQ = 32


def llm_dims(size: str) -> LLMDims:
    """``full`` (vocab 32000, hidden 1024, 4 layers: 117 M parameters) or ``quick`` (~4 M)."""
    return {"full": LLM_FULL, "quick": LLM_QUICK}[size]


class _Layer(nn.Module):
    def __init__(self, d: LLMDims, heads: int) -> None:
        super().__init__()
        h, f = d.hidden, d.ffn
        self.heads = heads
        self.input_layernorm = nn.RMSNorm(h)
        self.q_proj, self.k_proj = nn.Linear(h, h, bias=False), nn.Linear(h, h, bias=False)
        self.v_proj, self.o_proj = nn.Linear(h, h, bias=False), nn.Linear(h, h, bias=False)
        self.post_attention_layernorm = nn.RMSNorm(h)
        self.gate_proj, self.up_proj = nn.Linear(h, f, bias=False), nn.Linear(h, f, bias=False)
        self.down_proj = nn.Linear(f, h, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, s, h = x.shape
        y = self.input_layernorm(x)
        q, k, v = (p(y).view(b, s, self.heads, -1).transpose(1, 2) for p in (self.q_proj, self.k_proj, self.v_proj))
        a = F.scaled_dot_product_attention(q, k, v, is_causal=True).transpose(1, 2).reshape(b, s, h)
        x = x + self.o_proj(a)
        y = self.post_attention_layernorm(x)
        return x + self.down_proj(F.silu(self.gate_proj(y)) * self.up_proj(y))


class Llama(nn.Module):
    """Embedding, ``d.layers`` decoder layers (attention + SwiGLU MLP, RMSNorm), final norm, lm_head."""

    def __init__(self, d: LLMDims) -> None:
        super().__init__()
        self.embed_tokens = nn.Embedding(d.vocab, d.hidden)
        self.layers = nn.ModuleList(_Layer(d, heads=max(1, d.hidden // 128)) for _ in range(d.layers))
        self.norm = nn.RMSNorm(d.hidden)
        self.lm_head = nn.Linear(d.hidden, d.vocab, bias=False)

    def forward(self, idx: torch.Tensor) -> torch.Tensor:
        x = self.embed_tokens(idx)
        for layer in self.layers:
            x = layer(x)
        return self.lm_head(self.norm(x))


def batch(size: str, *, shift: int = 0) -> torch.Tensor:
    """A fixed token batch (1 x 32); ``shift=1`` gives the next-token targets."""
    g = torch.Generator().manual_seed(1234)
    toks = torch.randint(0, llm_dims(size).vocab, (1, _SEQ + 1), generator=g)
    return toks[:, shift : shift + _SEQ]


def fresh_adam_state(opt: torch.optim.Optimizer) -> None:
    """Give a fresh Adam/AdamW optimizer the state tensors its first step would create (zeros), with
    plain torch APIs, so that ``restore(into=...)`` and ``dcp.load`` have tensors to fill in place."""
    for group in opt.param_groups:
        for p in group["params"]:
            opt.state[p] = {
                "step": torch.tensor(0.0),
                "exp_avg": torch.zeros_like(p, memory_format=torch.preserve_format),
                "exp_avg_sq": torch.zeros_like(p, memory_format=torch.preserve_format),
            }
