"""Quickstart: train a small GPT-style model a few steps with a lazy checkpoint every step through the
default hierarchy (tiers/local.yaml: host memory → ./.tierckpt/ssd → ./.tierckpt/pfs), then "restart":
prefetch the newest checkpoint while a fresh model is built, restore into it, and check that training
resumes exactly where it stopped.

    python examples/quickstart.py
"""

from __future__ import annotations

import argparse
import time
from pathlib import Path

import torch
from torch import nn

from tierckpt import Hierarchy

ROOT = Path(__file__).resolve().parent.parent


class Block(nn.Module):
    def __init__(self, d: int, heads: int) -> None:
        super().__init__()
        self.ln1, self.ln2 = nn.LayerNorm(d), nn.LayerNorm(d)
        self.attn = nn.MultiheadAttention(d, heads, batch_first=True)
        self.mlp = nn.Sequential(nn.Linear(d, 4 * d), nn.GELU(), nn.Linear(4 * d, d))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        n = x.shape[1]
        mask = torch.triu(torch.ones(n, n, dtype=torch.bool), 1)
        h = self.ln1(x)
        x = x + self.attn(h, h, h, attn_mask=mask, need_weights=False)[0]
        return x + self.mlp(self.ln2(x))


class TinyGPT(nn.Module):
    def __init__(self, vocab: int = 512, d: int = 128, layers: int = 4, heads: int = 4, ctx: int = 64) -> None:
        super().__init__()
        self.tok, self.pos = nn.Embedding(vocab, d), nn.Embedding(ctx, d)
        self.blocks = nn.ModuleList(Block(d, heads) for _ in range(layers))
        self.ln = nn.LayerNorm(d)
        self.head = nn.Linear(d, vocab, bias=False)
        self.head.weight = self.tok.weight  # tied weights stay tied through a checkpoint

    def forward(self, idx: torch.Tensor) -> torch.Tensor:
        x = self.tok(idx) + self.pos(torch.arange(idx.shape[1]))
        for b in self.blocks:
            x = b(x)
        return self.head(self.ln(x))


def batch(step: int) -> torch.Tensor:
    return torch.randint(0, 512, (8, 65), generator=torch.Generator().manual_seed(step))


def forward_backward(model: nn.Module, opt: torch.optim.Optimizer, step: int) -> float:
    idx = batch(step)
    logits = model(idx[:, :-1])
    loss = nn.functional.cross_entropy(logits.reshape(-1, logits.shape[-1]), idx[:, 1:].reshape(-1))
    opt.zero_grad()
    loss.backward()
    return float(loss.detach())


def train_step(model: nn.Module, opt: torch.optim.Optimizer, step: int) -> float:
    loss = forward_backward(model, opt, step)
    opt.step()
    return loss


def checkpoint(model: nn.Module, opt: torch.optim.Optimizer, step: int) -> dict[str, object]:
    return {"model": model.state_dict(), "optim": opt.state_dict(), "step": step, "rng": torch.get_rng_state()}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--config", default=str(ROOT / "tiers" / "local.yaml"), help="hierarchy YAML")
    ap.add_argument("--steps", type=int, default=5)
    args = ap.parse_args()

    torch.manual_seed(0)
    model = TinyGPT()
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    train_step(model, opt, 0)  # the optimizer state exists from here on
    with Hierarchy.from_yaml(args.config) as h:
        blocked = []
        for step in range(1, args.steps + 1):
            t0 = time.perf_counter()
            handle = h.save(checkpoint(model, opt, step - 1), step=step - 1)  # returns at once
            blocked.append(time.perf_counter() - t0)
            loss = forward_backward(model, opt, step)  # the snapshot is copied meanwhile
            t0 = time.perf_counter()
            handle.staged.result()  # the bytes are in host memory: the tensors may change now
            blocked[-1] += time.perf_counter() - t0
            opt.step()
        h.save(checkpoint(model, opt, args.steps), step=args.steps).wait()
        nbytes = sum(t.numel() * t.element_size() for t in model.state_dict().values())
        print(f"trained {args.steps} steps (loss {loss:.4f}) with a lazy save of "
              f"{nbytes / 2**20:.1f} MiB of weights + optimizer state every step; "
              f"training was blocked {1e3 * max(blocked):.1f} ms per save at most")  # fmt: skip
        for t in h.tiers:
            print(f"  {t.name:5s} {t.describe()}")
        h.wait()
        print("checkpoints:", ", ".join(f"step {c.step} on {'+'.join(c.tiers)}" for c in h.checkpoints()))

    # A "restart": a fresh process would do exactly this (its host tier starts empty).
    with Hierarchy.from_yaml(args.config) as h:
        climbing = h.prefetch()  # the newest checkpoint climbs to host memory while we build the model
        model2 = TinyGPT()
        opt2 = torch.optim.AdamW(model2.parameters(), lr=1e-3)
        climbing.result()
        t0 = time.perf_counter()
        restored = h.restore(into={"model": model2.state_dict()})
        opt2.load_state_dict(restored["optim"])
        torch.set_rng_state(restored["rng"])
        step, tier = h.last_restore  # type: ignore[misc]
        print(f"restored step {step} in {(time.perf_counter() - t0) * 1e3:.0f} ms from tier {tier!r}")

    same = all(torch.equal(a, b) for a, b in zip(model.state_dict().values(), model2.state_dict().values()))
    tied = model2.head.weight is model2.tok.weight
    next_a = train_step(model, opt, args.steps + 1)
    next_b = train_step(model2, opt2, args.steps + 1)
    print(
        f"weights identical: {same}; tied weights still tied: {tied}; "
        f"next-step loss {next_a:.6f} vs {next_b:.6f} -> {'resumed exactly' if next_a == next_b else 'MISMATCH'}"
    )
    if not (same and next_a == next_b):
        raise SystemExit(1)


if __name__ == "__main__":
    main()
