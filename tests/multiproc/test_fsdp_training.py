"""End to end (issue 21 §4): a small transformer wrapped with FSDP2 ``fully_shard`` and AdamW, trained on
spawned gloo ranks on two simulated nodes, saved lazily every step through host → local (one directory per
node) → pfs with small keep windows; restored in new jobs on 4, 2 and 8 ranks and in one process into a
plain model, bit-exactly; training then goes on, and its losses are those of the run that was never
interrupted (docs/distributed.md, "Tests")."""

from __future__ import annotations

import copy
import os
import shutil
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest
import torch
import torch._dynamo  # fully_shard imports it: once in the forkserver, not in each of 8 ranks
import torch.distributed as dist
import torch.nn.functional as F
from harness import spawn  # tests/multiproc/harness.py
from torch import nn
from torch.distributed.checkpoint.state_dict import get_state_dict, set_state_dict
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.fsdp import fully_shard
from torch.distributed.tensor import DTensor

from tierckpt import Hierarchy

SAVES = 4  # the saving job saves steps 1..SAVES, one lazy save per step
MORE = 3  # then trains MORE steps unsaved: the uninterrupted run that every restored job continues
KEEP = {"host": 1, "ssd": 2, "pfs": 3}  # each tier evicts while the job trains
KEPT = list(range(SAVES - KEEP["pfs"] + 1, SAVES + 1))  # what the pfs tier holds at the end: 2, 3, 4
NEW = list(range(SAVES + 1, SAVES + MORE + 1))  # the steps a restored job saves (pfs evicts every older one)
# sizes not divisible by 2, 4 or 8 ranks (uneven shards; on 8 ranks some are empty)
BATCH, SEQ, VOCAB, DIM, HEADS, HIDDEN, LAYERS = 8, 6, 19, 12, 2, 20, 2
DATA_SEED = 1234


# -- the model, its data, its training step ----------------------------------------------------------------------
class Block(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.ln1, self.ln2 = nn.LayerNorm(DIM), nn.LayerNorm(DIM)
        self.qkv, self.proj = nn.Linear(DIM, 3 * DIM), nn.Linear(DIM, DIM)
        self.fc1, self.fc2 = nn.Linear(DIM, HIDDEN), nn.Linear(HIDDEN, DIM)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, t, _ = x.shape
        q, k, v = self.qkv(self.ln1(x)).view(b, t, 3, HEADS, DIM // HEADS).permute(2, 0, 3, 1, 4).unbind(0)
        att = F.scaled_dot_product_attention(q, k, v, is_causal=True).transpose(1, 2).reshape(b, t, DIM)
        x = x + self.proj(att)
        return x + self.fc2(F.gelu(self.fc1(self.ln2(x))))


class TinyLM(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.emb = nn.Embedding(VOCAB, DIM)
        self.pos = nn.Parameter(torch.randn(SEQ, DIM) * 0.1)
        self.blocks = nn.ModuleList(Block() for _ in range(LAYERS))
        self.ln = nn.LayerNorm(DIM)
        self.head = nn.Linear(DIM, VOCAB, bias=False)

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        x = self.emb(tokens) + self.pos
        for block in self.blocks:
            x = block(x)
        return self.head(self.ln(x))


def build(world: int, seed: int) -> tuple[nn.Module, torch.optim.Optimizer]:
    """The model (FSDP2 over ``world`` ranks; ``world=0``: plain) and its AdamW."""
    torch.manual_seed(seed)
    model = TinyLM()
    if world:
        mesh = init_device_mesh("cpu", (world,))
        for block in model.blocks:
            fully_shard(block, mesh=mesh)
        fully_shard(model, mesh=mesh)
    return model, torch.optim.AdamW(model.parameters(), lr=1e-2, weight_decay=0.1)


def train_step(
    model: nn.Module, opt: torch.optim.Optimizer, g: torch.Generator, rank: int, world: int, pending: Any = None
) -> float:
    """One step on this rank's slice of the next global batch (drawn from ``g``, the same on every rank);
    the global mean loss. ``pending``: the previous lazy save, whose tensors must be staged before the
    optimizer changes them in place."""
    tokens = torch.randint(VOCAB, (BATCH, SEQ + 1), generator=g)
    part = tokens[rank * BATCH // max(world, 1) : (rank + 1) * BATCH // max(world, 1)]
    loss = F.cross_entropy(model(part[:, :-1]).flatten(0, 1), part[:, 1:].flatten())
    loss.backward()
    if pending is not None:
        pending.staged.result()
    opt.step()
    opt.zero_grad()
    total = loss.detach().clone()
    if world:
        dist.all_reduce(total)
    return total.item() / max(world, 1)


def full_state(msd: dict[str, Any], osd: dict[str, Any], g: torch.Generator, step: int) -> dict[str, Any]:
    """Every value of the training state, whole (DTensors gathered), as one flat dict."""

    def whole(v: Any) -> Any:
        return v.full_tensor() if isinstance(v, DTensor) else v.clone() if isinstance(v, torch.Tensor) else v

    out: dict[str, Any] = {f"model/{k}": whole(v) for k, v in msd.items()}
    out |= {f"optim/{p}/{k}": whole(v) for p, st in osd["state"].items() for k, v in st.items()}
    return out | {"param_groups": copy.deepcopy(osd["param_groups"]), "rng": g.get_state(), "step": step}


def differing(got: dict[str, Any], ref: dict[str, Any]) -> list[str]:
    """The keys whose values (dtype and bits for tensors) differ, or that only one side has."""

    def same(a: Any, b: Any) -> bool:
        if isinstance(a, torch.Tensor) and isinstance(b, torch.Tensor):
            return a.dtype == b.dtype and torch.equal(a, b)
        return type(a) is type(b) and a == b

    return sorted(set(got) ^ set(ref)) + [k for k in sorted(set(got) & set(ref)) if not same(got[k], ref[k])]


def train_state(msd: dict[str, Any], osd: dict[str, Any], g: torch.Generator, step: int) -> dict[str, Any]:
    """What a step saves: model and optimizer (``get_state_dict``), the step, the data order's RNG."""
    return {"model": msd, "optim": osd, "step": step, "data": {"rng": g.get_state(), "seen": step * BATCH}}


# -- the jobs ----------------------------------------------------------------------------------------------------
def config(root: str, nodes: str, node: int | None = None) -> dict[str, Any]:
    return {
        "tiers": [
            {"name": "host", "kind": "host"},
            {"name": "ssd", "kind": "local", "path": nodes + "/node{node}/ssd"},
            {"name": "pfs", "kind": "pfs", "path": root + "/pfs"},
        ],
        "io": {"chunk": "1MiB"},  # small staging buffers: up to 8 ranks on this machine
        "policy": {"keep": KEEP},
        "distributed": {"timeout": 60} | ({} if node is None else {"node": node}),
    }


def node_of(rank: int, world: int) -> int:
    return rank * 2 // world  # two simulated nodes: the first half of the ranks, the second half


def job(rank: int, world: int, spec: dict[str, Any]) -> dict[str, Any]:
    """A training job: restore (``spec["restore"]``) or start fresh, train ``spec["steps"]`` steps, saving
    lazily each step up to ``spec["save_until"]``; at step ``spec.get("reference")`` rank 0 writes the
    whole state with ``torch.save``. Returns what it restored, its losses and its listings."""
    torch.set_num_threads(1)  # 8 ranks on 2 cores; and one thread's reductions in one order
    os.environ["TIERCKPT_NODE"] = str(node_of(rank, world))
    os.environ["TIERCKPT_JOB"] = spec["job"]
    model, opt = build(world, spec["seed"])
    g = torch.Generator().manual_seed(DATA_SEED)
    out: dict[str, Any] = {}
    with Hierarchy.from_config(config(spec["root"], spec["nodes"])) as h:
        start = 0
        if spec["restore"]:
            out["listed_before"] = [c.step for c in h.checkpoints()]
            msd, osd = get_state_dict(model, opt)  # sharded for this job; AdamW's state initialized
            target = train_state(msd, osd, torch.Generator(), -1)
            h.restore(into=target)  # no step: the ranks agree on the newest
            set_state_dict(model, opt, model_state_dict=msd, optim_state_dict=osd)
            g.set_state(target["data"]["rng"])
            start = target["step"]
            ref = torch.load(Path(spec["root"], f"reference-{start}.pt"), weights_only=False)
            got = full_state(*get_state_dict(model, opt), g, start)  # what the model and optimizer now hold
            out |= {"restored": start, "tier": h.last_restore[1], "differs": differing(got, ref)}
            out["seen"] = target["data"]["seen"]
        losses, pending = [], None
        for step in range(start + 1, start + spec["steps"] + 1):
            losses.append(train_step(model, opt, g, rank, world, pending))
            if step <= spec["save_until"]:
                msd, osd = get_state_dict(model, opt)
                pending = h.save(train_state(msd, osd, g, step), step=step)  # lazy: not waited for
            if step == spec.get("reference"):
                whole = full_state(msd, osd, g, step)  # a collective: every rank
                if rank == 0:
                    torch.save(whole, Path(spec["root"], f"reference-{step}.pt"))
        assert h.flush(timeout=60)
        out["tiers"] = {str(c.step): list(c.tiers) for c in h.checkpoints()}
    return out | {"losses": losses}


def run_job(world: int, tmp: Path, **spec: Any) -> list[dict[str, Any]]:
    got = spawn(job, world, tmp, spec, limit=120)
    for r, res in enumerate(got):
        assert res is not None and "ok" in res, f"rank {r}: {res}"
    return [res["ok"] for res in got]  # type: ignore[index]  # checked above


@dataclass
class Saved:
    world: int
    root: Path  # pfs/, nodes/node0/ssd, nodes/node1/ssd, reference-4.pt
    ranks: list[dict[str, Any]]

    @property
    def losses(self) -> list[float]:
        return self.ranks[0]["losses"]

    def copy(self, to: Path) -> Path:
        """A copy of its directories for one restoring job (which saves into them)."""
        shutil.copytree(self.root, to)
        return to


@pytest.fixture(scope="module", params=[4, pytest.param(2, marks=pytest.mark.slow)], ids=lambda w: f"saved-on-{w}")
def saved(request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory) -> Saved:
    world: int = request.param
    root = tmp_path_factory.mktemp(f"fsdp{world}")
    spec = {"root": str(root), "nodes": str(root / "nodes"), "job": f"fsdp-save-{world}", "seed": 0}
    ranks = run_job(world, root, **spec, restore=False, steps=SAVES + MORE, save_until=SAVES, reference=SAVES)
    return Saved(world, root, ranks)


def steps_on_disk(d: Path) -> list[int]:
    return sorted(int(p.name.split("-")[1]) for p in d.glob("step-*"))


def ranks_on_disk(d: Path, step: int) -> list[int]:
    return sorted(int(p.name.split("-")[1]) for p in (d / f"step-{step:012d}").glob("rank-*"))


def listed_by_reader(root: Path, nodes: Path, node: int) -> list[int]:
    """The steps a read-only hierarchy in this process (no process group) lists, as node ``node`` sees."""
    with Hierarchy.from_config(config(str(root), str(nodes), node), readonly=True) as h:
        return [c.step for c in h.checkpoints()]


def check_listed(ranks: list[dict[str, Any]], root: Path, nodes: Path, steps: list[int]) -> None:
    """Every rank lists ``steps``; so does a reader on either node; pfs holds them and nothing else."""
    assert [sorted(map(int, r["tiers"])) for r in ranks] == [steps] * len(ranks)
    assert listed_by_reader(root, nodes, 0) == listed_by_reader(root, nodes, 1) == steps
    assert steps_on_disk(root / "pfs") == steps


# -- tests -------------------------------------------------------------------------------------------------------
def test_the_saving_job_evicts_as_it_trains_and_every_rank_lists_the_same_steps(saved: Saved) -> None:
    world, root = saved.world, saved.root
    check_listed(saved.ranks, root, root / "nodes", KEPT)
    # steps 1.. were evicted from each tier as later ones came; host keeps the newest, ssd the 2 newest
    newest = {"4": ["host", "ssd", "pfs"], "3": ["ssd", "pfs"], "2": ["pfs"]}
    assert all(r["tiers"] == newest for r in saved.ranks)
    for node in (0, 1):  # each node's ssd holds its own ranks' copies of its 2 newest steps
        ssd = root / "nodes" / f"node{node}" / "ssd"
        assert steps_on_disk(ssd) == KEPT[-KEEP["ssd"] :]
        assert ranks_on_disk(ssd, SAVES) == [r for r in range(world) if node_of(r, world) == node]
    assert ranks_on_disk(root / "pfs", SAVES) == list(range(world))
    assert all(r["losses"] == saved.losses for r in saved.ranks)  # the global loss, the same on every rank


def restore_job(world: int, tmp: Path, root: Path, nodes: Path, name: str) -> list[dict[str, Any]]:
    """A new job of ``world`` ranks (its model initialized otherwise: a value the restore misses shows)
    that restores the newest step and trains MORE steps, saving each; each rank's outcome, checked."""
    spec = {"root": str(root), "nodes": str(nodes), "job": name, "seed": 1}
    ranks = run_job(world, tmp, **spec, restore=True, steps=MORE, save_until=SAVES + MORE)
    for r in ranks:
        assert r["listed_before"] == KEPT and r["restored"] == SAVES, r
        assert r["differs"] == [] and r["seen"] == SAVES * BATCH, r  # bit-exact, every value
    return ranks


def test_restore_on_the_same_world_size_with_one_node_lost_continues_exactly(saved: Saved, tmp_path: Path) -> None:
    """Node 1 lost its SSD: its ranks read pfs, node 0's read their SSD; training then goes on exactly as
    the uninterrupted run did (same world size, same reductions in the same order)."""
    world, root = saved.world, saved.copy(tmp_path / "job")
    shutil.rmtree(root / "nodes" / "node1")
    ranks = restore_job(world, tmp_path, root, root / "nodes", "fsdp-same")
    assert [r["tier"] for r in ranks] == ["ssd" if node_of(r, world) == 0 else "pfs" for r in range(world)]
    assert all(r["losses"] == saved.losses[SAVES:] for r in ranks)  # exact
    check_listed(ranks, root, root / "nodes", NEW)
    for node in (0, 1):
        assert steps_on_disk(root / "nodes" / f"node{node}" / "ssd") == NEW[-KEEP["ssd"] :]


# Another world size splits each global batch into other slices and sums the gradients in another order
# (FSDP's reduce-scatter over other ranks, or none in one process): the same sums, which may round
# differently, so the continued losses need only agree with the uninterrupted run's to float32 rounding
# (seen here: 2 and 8 ranks bit for bit, one process a last bit off). The restored state is still
# compared bit for bit.
ROUNDING = 1e-5


def test_restore_on_another_world_size_from_pfs(saved: Saved, tmp_path: Path) -> None:
    """4 ranks saved → 2 restore (2 → 4): new node-local directories, empty, so every rank reads pfs; the
    job then saves its own steps, and pfs evicts the steps of the other world size, every rank's copy."""
    world = 2 if saved.world == 4 else 4
    root = saved.copy(tmp_path / "job")
    ranks = restore_job(world, tmp_path, root, tmp_path / "new-nodes", "fsdp-other")
    assert [r["tier"] for r in ranks] == ["pfs"] * world
    assert all(r["losses"] == pytest.approx(saved.losses[SAVES:], rel=ROUNDING) for r in ranks)
    check_listed(ranks, root, tmp_path / "new-nodes", NEW)
    assert ranks_on_disk(root / "pfs", SAVES + MORE) == list(range(world))


def test_restore_on_eight_ranks_reusing_the_node_directories(saved: Saved, tmp_path: Path) -> None:
    """8 ranks on the saving job's two nodes (their SSDs kept): each rank reads its node's SSD where that
    holds the copy its restore starts from, else pfs."""
    root = saved.copy(tmp_path / "job")
    ranks = restore_job(8, tmp_path, root, root / "nodes", "fsdp-eight")
    first = [r if r < saved.world else 0 for r in range(8)]  # the copy each rank's restore opens first
    here = ["ssd" if node_of(f, saved.world) == node_of(r, 8) else "pfs" for r, f in enumerate(first)]
    assert [r["tier"] for r in ranks] == here  # saved on 4: ssd for ranks 0-1 (node 0 holds 0-1's copies)
    assert all(r["losses"] == pytest.approx(saved.losses[SAVES:], rel=ROUNDING) for r in ranks)
    check_listed(ranks, root, root / "nodes", NEW)
    assert ranks_on_disk(root / "pfs", SAVES + MORE) == list(range(8))
    for node in (0, 1):  # the saving job's copies are gone from its SSDs too, those of ranks now elsewhere too
        assert steps_on_disk(root / "nodes" / f"node{node}" / "ssd") == NEW[-KEEP["ssd"] :]


def test_restore_in_one_process_into_a_plain_model(saved: Saved) -> None:
    """No process group, an unsharded model and optimizer: a read-only hierarchy restores whole tensors
    (rank 0's copy from node 0's SSD, the other ranks' shards from pfs)."""
    root = saved.root
    model, opt = build(0, seed=1)
    msd, osd = get_state_dict(model, opt)  # plain tensors; the optimizer state keyed by parameter name
    target = train_state(msd, osd, torch.Generator(), -1)
    with Hierarchy.from_config(config(str(root), str(root / "nodes"), 0), readonly=True) as h:
        h.restore(into=target)
        assert h.last_restore == (SAVES, "ssd")
    set_state_dict(model, opt, model_state_dict=msd, optim_state_dict=osd)
    g = torch.Generator()
    g.set_state(target["data"]["rng"])
    ref = torch.load(root / f"reference-{SAVES}.pt", weights_only=False)
    assert differing(full_state(*get_state_dict(model, opt), g, target["step"]), ref) == []
    losses = [train_step(model, opt, g, 0, 0) for _ in range(MORE)]
    assert losses == pytest.approx(saved.losses[SAVES:], rel=ROUNDING)
