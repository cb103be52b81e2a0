"""Audit finding 7: ``tierckpt verify`` and ``Hierarchy.verify`` check every rank's copy that a step's
commit record names, on every node's and every rank's directory a ``{node}`` or ``{rank}`` path expands
to, and fail on any damage, naming the rank and the tier (on 8c32cc0 they checked rank 0's copies in node
0's directory only, and reported success for the job; on 987543a ``{rank}`` paths were still opened for
rank 0 only, and a node-local copy that the records name and no directory holds was taken for another
node's and left out).

A job of 4 ranks (threads of this process agreeing through a StoreCoordinator), ranks 0-1 on node 0 and
2-3 on node 1, each node with its own ssd directory (or each rank, with ``{rank}``), and one shared pfs
directory.
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path
from typing import Any

import pytest
import torch
import torch.distributed as dist

from tierckpt import CorruptCheckpointError, Hierarchy, SoloCoordinator, StoreCoordinator, TierIOError
from tierckpt.cli import main
from tierckpt.io import make_engine
from tierckpt.policies.compressconfig import CompressConfig
from tierckpt.testing.tamper import blob_file
from tierckpt.tiers.local import LocalTier
from tierckpt.tiers.pfs import PfsTier

N = 4


@pytest.fixture
def job(tmp_path: Path, run_ranks: Any) -> Path:
    """Steps 1 and 2 of the 4-rank job, on every node's ssd and on pfs; the YAML a tool reads them with."""
    store = dist.HashStore()
    cs = run_ranks(N, lambda r: StoreCoordinator(store, r, N, timeout=20.0, node=r // 2))
    engine = make_engine("threads", 4)

    def save(r: int) -> None:
        c = cs[r]
        tiers = [
            LocalTier("ssd", tmp_path / f"node{c.node}" / "ssd", engine, job="j"),
            PfsTier("pfs", tmp_path / "pfs", engine, job="j"),
        ]
        tiers[1].compress = CompressConfig("none")  # plain copies: a flipped byte is a checksum mismatch
        with Hierarchy(tiers, coordinator=c, job="j") as h:
            for step in (1, 2):
                h.save({"w": torch.full((1000,), float(100 * step + r)), "step": step}, step=step).wait()

    try:
        assert run_ranks(N, save) == [None] * N
    finally:
        engine.close()
    yml = tmp_path / "h.yaml"
    yml.write_text(
        "tiers:\n  - {name: ssd, kind: local, path: 'node{node}/ssd'}\n  - {name: pfs, kind: pfs, path: pfs}\n"
        "io: {engine: threads}\n"
    )
    return yml


def flip(rank_dir: Path) -> None:
    blob, base = blob_file(rank_dir)
    data = bytearray(blob.read_bytes())
    data[base + 5] ^= 0x40
    blob.write_bytes(bytes(data))


def verify(capsys: pytest.CaptureFixture[str], *argv: str) -> tuple[int, list[dict[str, Any]]]:
    rc = main(["verify", *argv, "--json"])
    return rc, json.loads(capsys.readouterr().out)["copies"]


def test_every_ranks_copy_on_every_node_is_verified(job: Path, capsys: pytest.CaptureFixture[str]) -> None:
    rc, copies = verify(capsys, str(job))
    assert rc == 0 and all(c["ok"] for c in copies)
    got = sorted((c["step"], c["tier"], c["node"], c["rank"]) for c in copies)
    want = [(s, "pfs", None, r) for s in (1, 2) for r in range(N)]
    want += [(s, "ssd", r // 2, r) for s in (1, 2) for r in range(N)]
    assert got == sorted(want)


def test_a_flipped_byte_in_rank_1s_shared_copy_fails_the_job(job: Path, capsys: pytest.CaptureFixture[str]) -> None:
    flip(job.parent / "pfs" / "step-000000000002" / "rank-00001")
    rc, copies = verify(capsys, str(job))
    bad = [(c["step"], c["tier"], c["rank"]) for c in copies if not c["ok"]]
    assert rc == 1 and bad == [(2, "pfs", 1)]
    assert main(["verify", str(job)]) == 1
    out = capsys.readouterr().out
    assert "step 2 on pfs, rank 1: CORRUPT: checksum mismatch (rank 1's copy)" in out
    with Hierarchy.from_yaml(job, readonly=True) as h:  # rank 0's hierarchy checks rank 1's copies too
        errors = [(s, t, e) for s, t, e in h.verify() if e is not None]
    assert [(s, t) for s, t, _ in errors] == [(2, "pfs")] and isinstance(errors[0][2], CorruptCheckpointError)
    assert errors[0][2].rank == 1
    rc, copies = verify(capsys, str(job), "--rank", "0")  # one rank's copies: rank 0's are whole
    assert rc == 0 and {c["rank"] for c in copies} == {0}


def test_a_flipped_byte_on_another_nodes_directory_fails_the_job(job: Path, capsys: pytest.CaptureFixture[str]) -> None:
    flip(job.parent / "node1" / "ssd" / "step-000000000001" / "rank-00003")
    rc, copies = verify(capsys, str(job))
    bad = [(c["step"], c["tier"], c["node"], c["rank"]) for c in copies if not c["ok"]]
    assert rc == 1 and bad == [(1, "ssd", 1, 3)]
    assert main(["verify", str(job), "--step", "1"]) == 1
    assert "step 1 on ssd of node 1, rank 3: CORRUPT" in capsys.readouterr().out


def test_a_copy_the_record_names_missing_from_the_shared_tier_is_reported(
    job: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    shutil.rmtree(job.parent / "pfs" / "step-000000000002" / "rank-00002")
    rc, copies = verify(capsys, str(job))
    bad = [(c["step"], c["tier"], c["rank"], c["error"]) for c in copies if not c["ok"]]
    assert rc == 1 and [b[:3] for b in bad] == [(2, "pfs", 2)]
    assert "rank 2's copy, which the step's record names, is missing" in bad[0][3]
    shutil.rmtree(job.parent / "node1")  # a node that lost its ssd: its copies are not missing from pfs,
    rc, copies = verify(capsys, str(job), "--step", "1")  # but the ssd tier lacks them (node 0's record names them)
    assert all(c["ok"] for c in copies if c["tier"] == "pfs") and {c["rank"] for c in copies if c["tier"] == "pfs"} == {
        0,
        1,
        2,
        3,
    }
    bad = [(c["tier"], c["node"], c["rank"], c["status"]) for c in copies if not c["ok"]]
    assert rc == 1 and bad == [("ssd", None, 2, "unusable"), ("ssd", None, 3, "unusable")]


def test_a_node_local_copy_the_records_name_that_no_node_holds_is_reported(
    job: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """On 987543a a missing node-local copy was taken for another node's: "8 of 8 verified", exit 0."""
    shutil.rmtree(job.parent / "node1" / "ssd" / "step-000000000001" / "rank-00003")
    rc, copies = verify(capsys, str(job))
    bad = [(c["step"], c["tier"], c["node"], c["rank"], c["status"]) for c in copies if not c["ok"]]
    assert rc == 1 and bad == [(1, "ssd", None, 3, "unusable")]
    assert "rank 3's copy, which the step's record names, is in none of the tier's directories" in str(copies)
    assert len(copies) == 16  # every other copy is still verified
    rc, copies = verify(capsys, str(job), "--rank", "2")  # another rank's copy is not this one's business
    assert rc == 0 and {c["rank"] for c in copies} == {2}
    assert main(["verify", str(job), "--rank", "3", "--step", "1"]) == 1
    assert "step 1 on ssd, rank 3: UNUSABLE" in capsys.readouterr().out


class _Vanishing(LocalTier):
    """A node-local tier whose copy of ``gone`` disappears after the listing, before it is verified."""

    gone: Path | None = None

    def open_copy(self, key: Any) -> Any:
        if self.gone is not None and self.gone.exists():
            shutil.rmtree(self.gone)
        return super().open_copy(key)


def test_hierarchy_verify_reports_its_own_missing_node_local_copy(job: Path) -> None:
    """Rank 3 (of 4, on node 1) lists step 2 on its ssd; its copy goes (not evicted: the record stays)
    before it is verified: on 987543a it was taken for another node's copy and left out."""
    root = job.parent
    engine = make_engine("threads", 2)
    try:
        ssd = _Vanishing("ssd", root / "node1" / "ssd", engine, readonly=True)
        ssd.gone = root / "node1" / "ssd" / "step-000000000002" / "rank-00003"
        pfs = PfsTier("pfs", root / "pfs", engine, readonly=True)
        with Hierarchy([ssd, pfs], coordinator=SoloCoordinator(3, N, node=1), readonly=True) as h:
            got = [(s, t, e) for s, t, e in h.verify(2) if e is not None]
    finally:
        engine.close()
    assert [(s, t) for s, t, _ in got] == [(2, "ssd")]
    assert isinstance(got[0][2], TierIOError) and "rank 3's copy, which the step's record names" in str(got[0][2])


def test_hierarchy_verify_reports_a_node_local_record_without_copies(job: Path) -> None:
    """A process alone on node 1 lists step 1 on ssd (a step of 4 ranks, read by resharding) while the
    node's directory has lost both its ranks' copies: verify reports it instead of leaving it out."""
    node1 = job.parent / "node1" / "ssd" / "step-000000000001"
    for r in (2, 3):
        shutil.rmtree(node1 / f"rank-{r:05d}")
    with Hierarchy.from_yaml(job, readonly=True, coordinator=SoloCoordinator(0, 1, node=1)) as h:
        assert [c.tiers for c in h.checkpoints() if c.step == 1] == [("ssd", "pfs")]
        got = [(s, t, str(e)) for s, t, e in h.verify(1) if t == "ssd"]
    assert len(got) == 1 and "holds the step's commit record and no copy of any of the 4 ranks" in got[0][2]


@pytest.fixture(params=["r{rank}/ssd", "node{node}/r{rank:03d}"])
def ranked(request: pytest.FixtureRequest, saved_by_ranks: Any) -> Path:
    """Step 1 of a 4-rank job (2 nodes) whose ssd path holds ``{rank}`` (and ``{node}``): one directory
    per rank."""
    return saved_by_ranks(str(request.param))  # type: ignore[no-any-return]


def test_rank_paths_every_ranks_directory_is_verified(ranked: Path, capsys: pytest.CaptureFixture[str]) -> None:
    """On 987543a ``{rank}`` paths were opened for rank 0 only: a flipped byte in rank 1's ssd copy passed."""
    rc, copies = verify(capsys, str(ranked))
    assert rc == 0 and [(c["tier"], c["rank"]) for c in copies] == [("ssd", r) for r in range(N)] + [
        ("pfs", r) for r in range(N)
    ]
    path = next(p for p in ranked.parent.glob("**/step-000000000001/rank-00001") if "pfs" not in p.parts)
    flip(path)
    rc, copies = verify(capsys, str(ranked))
    assert rc == 1 and [(c["tier"], c["rank"], c["status"]) for c in copies if not c["ok"]] == [("ssd", 1, "corrupt")]
    flip(path)  # undone
    shutil.rmtree(path)
    rc, copies = verify(capsys, str(ranked))
    assert rc == 1 and [(c["tier"], c["rank"], c["status"]) for c in copies if not c["ok"]] == [("ssd", 1, "unusable")]
