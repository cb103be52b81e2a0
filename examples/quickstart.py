"""Quickstart: train a small GPT-style model a few steps with a lazy checkpoint every step through the
default hierarchy (tiers/local.yaml: host memory → ./.tierckpt/ssd → ./.tierckpt/pfs), then "restart":
prefetch the newest checkpoint while a fresh model, optimizer and scheduler are built, restore all of
them (and the RNG) with the documented resume pattern (tierckpt.TrainState, docs/resume.md), and check
that training resumes exactly where it stopped.

    python examples/quickstart.py
"""

from __future__ import annotations

import argparse
import time
from pathlib import Path

import torch
from torch import nn
from torch.optim.lr_scheduler import LRScheduler

from tierckpt import Hierarchy, TrainState

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
        for emb in (self.tok, self.pos):  # GPT-2's init: small embeddings, so the first logits are near 0
            nn.init.normal_(emb.weight, std=0.02)  # (N(0, 1) ones as the tied head give a first loss of ~37)

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


def train_step(model: nn.Module, opt: torch.optim.Optimizer, sched: LRScheduler, step: int) -> float:
    loss = forward_backward(model, opt, step)
    opt.step()
    sched.step()
    return loss


def build(steps: int) -> tuple[TinyGPT, torch.optim.Optimizer, LRScheduler]:
    """A fresh model, optimizer (no state tensors yet) and scheduler, as a (re)starting job builds them."""
    model = TinyGPT()
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    return model, opt, torch.optim.lr_scheduler.CosineAnnealingLR(opt, T_max=2 * steps)


def mib(tensors: list[torch.Tensor]) -> float:
    """Size of ``tensors`` in MiB, each storage once (tied weights, views)."""
    seen = {t.untyped_storage().data_ptr(): t.untyped_storage().nbytes() for t in tensors}
    return sum(seen.values()) / 2**20


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--config", default=str(ROOT / "tiers" / "local.yaml"), help="hierarchy YAML")
    ap.add_argument("--steps", type=int, default=5)
    args = ap.parse_args()

    torch.manual_seed(0)
    model, opt, sched = build(args.steps)
    # the batches are a function of the step (batch(step)), so the step is the data position
    job = TrainState(model=model, optim=opt, sched=sched)  # + the RNG states
    with Hierarchy.from_yaml(args.config) as h:
        blocked, handle, losses = [], None, []
        for step in range(args.steps):
            losses.append(forward_backward(model, opt, step))  # the previous snapshot is copied meanwhile
            t0 = time.perf_counter()
            if handle is not None:
                handle.staged.result()  # the bytes are in host memory: the tensors may change now
            blocked.append(time.perf_counter() - t0)
            opt.step()
            sched.step()
            t0 = time.perf_counter()
            handle = job.save(h, step=step + 1)  # returns at once; labelled with the updates it holds
            blocked[-1] += time.perf_counter() - t0
        h.wait()
        weights = mib(list(model.state_dict().values()))
        moments = mib([t for s in opt.state.values() for t in s.values() if isinstance(t, torch.Tensor)])
        print(f"trained {args.steps} steps (loss {losses[0]:.4f} -> {losses[-1]:.4f}) with a lazy save every step of "
              f"{weights:.1f} MiB of weights + {moments:.1f} MiB of optimizer state (+ scheduler and RNG); "
              f"training was blocked {1e3 * max(blocked):.1f} ms per save at most")  # fmt: skip
        for t in h.tiers:
            print(f"  {t.name:5s} {t.describe()}")
        print("checkpoints:", ", ".join(f"step {c.step} on {'+'.join(c.tiers)}" for c in h.checkpoints()))

    # A "restart": a fresh process would do exactly this (its host tier starts empty).
    with Hierarchy.from_yaml(args.config) as h:
        climbing = h.prefetch()  # the newest checkpoint climbs to host memory while we build the job
        torch.manual_seed(1)  # a different init: everything must come from the checkpoint
        model2, opt2, sched2 = build(args.steps)
        climbing.result()
        t0 = time.perf_counter()
        done = TrainState(model=model2, optim=opt2, sched=sched2).restore(h)
        _, tier = h.last_restore  # type: ignore[misc]
        print(f"restored step {done} (model, optimizer, scheduler, RNG) in {(time.perf_counter() - t0) * 1e3:.0f} ms "
              f"from tier {tier!r}")  # fmt: skip

    same = all(torch.equal(a, b) for a, b in zip(model.state_dict().values(), model2.state_dict().values()))
    tied = model2.head.weight is model2.tok.weight
    next_a = train_step(model, opt, sched, done)
    next_b = train_step(model2, opt2, sched2, done)
    after = all(torch.equal(a, b) for a, b in zip(model.parameters(), model2.parameters()))
    print(
        f"weights identical: {same}; tied weights still tied: {tied}; next-step loss {next_a:.6f} vs {next_b:.6f}, "
        f"weights after it identical: {after} -> {'resumed exactly' if same and after and next_a == next_b else 'MISMATCH'}"
    )
    if not (same and tied and after and next_a == next_b and done == args.steps):
        raise SystemExit(1)


if __name__ == "__main__":
    main()
