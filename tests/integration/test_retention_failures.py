"""A failed lower copy never costs a step (docs/policies.md, "What eviction never does").

Retention holds a step's slowest copy beyond its tier's ``keep`` window until every lower tier the policy
sent the step to has committed it or a newer step; one warning per held copy names the failing tier and
its error; once the tier works again, the next copy that reaches it releases the backlog down to ``keep``.
Checked with an EIO-raising pfs, a real ENOSPC (the shared ``tmpfs`` fixture filled by a ballast file),
a host and an ssd with a capacity, and across a restart.
"""

from __future__ import annotations

import errno
import logging
import os
from pathlib import Path
from typing import Any

import pytest
import torch

from tierckpt import Hierarchy, TierFullError
from tierckpt.background.catalog import Catalog
from tierckpt.background.held import HeldCopies
from tierckpt.io.engine import make_engine
from tierckpt.policies import Held
from tierckpt.testing import FaultyTier
from tierckpt.tiers.base import Tier
from tierckpt.tiers.host import HostTier
from tierckpt.tiers.local import LocalTier
from tierckpt.tiers.pfs import PfsTier

KiB, MiB = 1 << 10, 1 << 20
EIO = OSError(errno.EIO, "injected EIO")


def state(step: int, nbytes: int = 64 * KiB) -> dict[str, Any]:
    return {"w": torch.full((nbytes // 4,), float(step)), "step": step}


def restorable(h: Hierarchy, step: int, nbytes: int = 64 * KiB) -> bool:
    got = h.restore(step=step)
    return got["step"] == step and torch.equal(got["w"], state(step, nbytes)["w"])


def where(h: Hierarchy) -> dict[str, list[int]]:
    """Per tier, the steps committed there."""
    out: dict[str, list[int]] = {}
    for c in h.checkpoints():
        for t in c.tiers:
            out.setdefault(t, []).append(c.step)
    return out


def held_warnings(caplog: pytest.LogCaptureFixture) -> list[str]:
    return [r.getMessage() for r in caplog.records if r.levelno == logging.WARNING and "is held on" in r.getMessage()]


def held_steps(warnings: list[str]) -> list[int]:
    """The steps the warnings say are held, in order (a step warned about twice appears twice)."""
    return [int(w.split("step ", 1)[1].split()[0]) for w in warnings]


def three_tiers(tmp_path: Path, pfs: Tier | None = None) -> tuple[Hierarchy, FaultyTier]:
    """host (keep 1) → ssd (keep 2) → pfs, the pfs wrapped in a FaultyTier."""
    engine = make_engine("threads", 4)
    lower = FaultyTier(pfs or PfsTier("pfs", tmp_path / "pfs", engine))
    tiers = [HostTier("host", capacity_bytes=64 * MiB), LocalTier("ssd", tmp_path / "ssd", engine), lower]
    return Hierarchy(tiers, policy={"keep": {"host": 1, "ssd": 2}}), lower


def save_while_pfs_fails(h: Hierarchy, steps: range, errno_: int, nbytes: int = 64 * KiB) -> None:
    """Save ``steps``; each pfs copy fails with ``errno_``; after each save every step so far restores."""
    for s in steps:
        handle = h.save(state(s, nbytes), step=s)
        with pytest.raises(OSError) as ei:
            handle.wait()
        assert ei.value.errno == errno_, ei.value
        handle.wait(tier="ssd")
        assert set(handle.errors()) == {"pfs"}
        for old in range(1, s + 1):
            assert restorable(h, old, nbytes), f"step {old} lost after saving step {s}"


def test_eio_pfs_holds_every_step_until_it_recovers(tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    """The issue's case: keep {host: 1, ssd: 2}, every pfs copy fails with EIO for 10 saves. Every step
    stays restorable (held on the ssd, one warning each naming the pfs and its error); the pfs recovers and
    the next save releases the backlog down to the windows."""
    caplog.set_level(logging.INFO, logger="tierckpt")
    h, pfs = three_tiers(tmp_path)
    pfs.fail = {"write": EIO}
    with h:
        save_while_pfs_fails(h, range(1, 11), errno.EIO)
        assert where(h) == {"host": [10], "ssd": list(range(1, 11))}
        infos = {c.step: c for c in h.checkpoints()}
        assert all(infos[s].states["pfs"] == "failed" for s in range(1, 11))
        warned = held_warnings(caplog)
        assert held_steps(warned) == list(range(1, 9))  # beyond the window of 2; each warned about once
        assert all("tier 'ssd'" in w and "tier 'pfs'" in w and "injected EIO" in w for w in warned)

        pfs.fail = {}
        h.save(state(11), step=11).wait()
        assert where(h) == {"host": [11], "ssd": [10, 11], "pfs": [11]}
        assert restorable(h, 10) and restorable(h, 11)
    # step 9 left the window when step 11 reached the ssd, before it reached the pfs: held for a moment
    assert held_steps(held_warnings(caplog)) == list(range(1, 10))


def test_a_newer_step_on_the_pfs_releases_only_older_steps(tmp_path: Path) -> None:
    """pfs every 3rd save: step 3's copy fails, so step 3 is held on the ssd past its window; step 6's copy
    succeeds and releases it. Steps never sent to the pfs follow the ssd window as before."""
    engine = make_engine("threads", 4)
    pfs = FaultyTier(PfsTier("pfs", tmp_path / "pfs", engine))
    tiers = [HostTier("host", capacity_bytes=64 * MiB), LocalTier("ssd", tmp_path / "ssd", engine), pfs]
    with Hierarchy(tiers, policy={"keep": {"host": 1, "ssd": 1}, "demote": {"pfs": {"every": 3}}}) as h:
        for s in range(1, 6):
            pfs.fail = {"write": EIO} if s == 3 else {}
            handle = h.save(state(s), step=s)
            if s == 3:
                with pytest.raises(OSError):
                    handle.wait()
            handle.wait(tier="ssd")
        assert where(h) == {"host": [5], "ssd": [3, 5]}
        assert restorable(h, 3)
        h.save(state(6), step=6).wait()
        assert where(h) == {"host": [6], "ssd": [6], "pfs": [6]}


def test_enospc_pfs_holds_every_step_until_it_has_room(tmp_path: Path, tmpfs: Path) -> None:
    """The same with a real ENOSPC: the pfs is a 64 MiB tmpfs filled up to 1 MiB by a ballast file, each
    checkpoint 2 MiB. Every step stays restorable; the ballast is then removed and the next save releases
    the backlog."""
    nbytes = 2 * MiB
    ballast = tmpfs / "ballast"
    with ballast.open("wb") as f:
        os.posix_fallocate(f.fileno(), 0, 63 * MiB)
    h, _ = three_tiers(tmp_path, pfs=PfsTier("pfs", tmpfs, make_engine("threads", 4)))
    with h:
        save_while_pfs_fails(h, range(1, 11), errno.ENOSPC, nbytes)
        assert where(h) == {"host": [10], "ssd": list(range(1, 11))}
        written = [p for p in tmpfs.rglob("*") if p.is_file() and ".tierckpt-lease" not in p.parts]
        assert written == [ballast]  # nothing half-written stays
        ballast.unlink()
        h.save(state(11, nbytes), step=11).wait()
        assert where(h) == {"host": [11], "ssd": [10, 11], "pfs": [11]}
        assert restorable(h, 11, nbytes)


@pytest.mark.parametrize("on_full", ["wait", "fail"])
def test_held_copies_fill_a_host_tier(tmp_path: Path, on_full: str) -> None:
    """host (room for 3 checkpoints, keep 1) → pfs failing: steps 1..3 are held in memory; step 4 does not
    fit and fails with TierFullError naming the held steps and the pfs error (its fallback to the pfs
    fails too); nothing held is dropped. The pfs recovers: step 5 is packed straight into the pfs, which
    releases the held copies 1 and 2, and step 6 fits in memory again."""
    host = HostTier("host", capacity_bytes=3 * (64 * KiB + 4 * KiB) + 8 * KiB)
    pfs = FaultyTier(PfsTier("pfs", tmp_path / "pfs", make_engine("threads", 4)), fail={"write": EIO})
    with Hierarchy([host, pfs], policy={"keep": {"host": 1}, "on_full": {"host": on_full}}) as h:
        for s in (1, 2, 3):
            with pytest.raises(OSError):
                h.save(state(s), step=s).wait()
        assert where(h) == {"host": [1, 2, 3]}
        handle = h.save(state(4), step=4)
        with pytest.raises(TierFullError) as ei:
            handle.wait(tier="host")
        msg = str(ei.value)
        assert "steps [1, 2]" in msg and "tier 'pfs'" in msg and "injected EIO" in msg, msg
        with pytest.raises(OSError):
            handle.wait(tier="pfs")
        assert where(h) == {"host": [1, 2, 3]}
        assert all(restorable(h, s) for s in (1, 2, 3))

        pfs.fail = {}
        handle = h.save(state(5), step=5)
        with pytest.raises(TierFullError):
            handle.wait(tier="host")
        handle.wait(tier="pfs")
        assert where(h) == {"host": [3], "pfs": [5]}  # step 3 is the host's newest: inside its window
        h.save(state(6), step=6).wait()
        assert where(h) == {"host": [6], "pfs": [5, 6]}
        assert restorable(h, 5) and restorable(h, 6)


def test_a_restarted_job_holds_what_an_earlier_process_left(tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    """A new process does not know where an earlier one sent its steps: a step whose slowest copy is
    above a tier holding neither it nor a newer step is held (steps 1..4 left by the first hierarchy on
    the ssd while the pfs failed), until a newer step reaches the pfs."""
    h, pfs = three_tiers(tmp_path)
    pfs.fail = {"write": EIO}
    with h:
        save_while_pfs_fails(h, range(1, 5), errno.EIO)
    h, pfs = three_tiers(tmp_path)
    pfs.fail = {"write": EIO}
    caplog.clear()
    with h:
        save_while_pfs_fails(h, range(5, 7), errno.EIO)
        assert where(h) == {"host": [6], "ssd": list(range(1, 7))}
        warned = held_warnings(caplog)
        assert held_steps(warned) == [1, 2, 3, 4]
        assert all("saved before this process started" in w for w in warned), warned
        pfs.fail = {}
        h.save(state(7), step=7).wait()
        assert where(h) == {"host": [7], "ssd": [6, 7], "pfs": [7]}


def test_a_full_tier_never_gives_up_a_held_copy(tmp_path: Path) -> None:
    """ssd (room for 3 checkpoints, keep 1) between a host that keeps 4 and a failing pfs: steps 1 and 2 are
    held on the ssd (the host holds them too, but a host copy dies with the process). Step 4 does not fit
    on the ssd: the ssd gives up step 3 (inside its window, the host holds it), never a held copy."""
    engine = make_engine("threads", 4)
    ssd = LocalTier("ssd", tmp_path / "ssd", engine, capacity_bytes=3 * 64 * KiB + 32 * KiB)
    pfs = FaultyTier(PfsTier("pfs", tmp_path / "pfs", engine), fail={"write": EIO})
    tiers = [HostTier("host", capacity_bytes=64 * MiB), ssd, pfs]
    with Hierarchy(tiers, policy={"keep": {"host": 4, "ssd": 1}}) as h:
        save_while_pfs_fails(h, range(1, 4), errno.EIO)
        assert where(h) == {"host": [1, 2, 3], "ssd": [1, 2, 3]}
        save_while_pfs_fails(h, range(4, 5), errno.EIO)
        assert where(h) == {"host": [1, 2, 3, 4], "ssd": [1, 2, 4]}


def test_each_held_copy_is_logged_once_and_a_late_failure_escalates(caplog: pytest.LogCaptureFixture) -> None:
    """Held while its pfs copy is on the way: INFO, once. That copy fails: one warning. Released: INFO."""
    caplog.set_level(logging.INFO, logger="tierckpt")
    catalog = Catalog([], rank=0)
    catalog.saved(1, ["ssd", "pfs"])
    held = HeldCopies(catalog)
    copy = Held(1, "ssd", ("pfs",))

    def logged() -> list[tuple[int, str]]:
        out = [(r.levelno, r.getMessage()) for r in caplog.records]
        caplog.clear()
        return out

    held.update([copy])
    held.update([copy])
    assert logged() == [(logging.INFO, "retention: step 1 is held on tier 'ssd' beyond its keep window: tier 'pfs' "
                         "has no copy of step 1 or newer (its copy has not arrived yet)")]  # fmt: skip
    catalog.set(1, "pfs", "failed", EIO)
    held.update([copy])
    held.update([copy])
    assert [(lv, "injected EIO" in m) for lv, m in logged()] == [(logging.WARNING, True)]
    full = held.explain_full("ssd", TierFullError("tier 'ssd' is full"))
    assert "steps [1]" in str(full) and "injected EIO" in str(full)
    assert held.explain_full("host", e := TierFullError("tier 'host' is full")) is e
    held.update([])
    assert logged() == [(logging.INFO, "retention: step 1 is no longer held on tier 'ssd'")]
