"""What a new user meets first, outside the command line: tiers built from Python as the docs show
them, and I/O errors that keep the OSError behind them."""

from __future__ import annotations

import errno
import re
import shutil
from pathlib import Path

import pytest
import torch

from tierckpt import Hierarchy, IOConfig, TierIOError
from tierckpt.tiers.local import LocalTier

ROOT = Path(__file__).resolve().parents[2]


def _snippet(doc: str, after: str) -> str:
    """The first ```python block of ``docs/<doc>`` after the text ``after``."""
    text = (ROOT / "docs" / doc).read_text()
    m = re.search(r"```python\n(.*?)```", text[text.index(after) :], re.S)
    assert m is not None
    return m.group(1)


def test_policies_md_builds_tiers_from_python(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """The snippet of docs/policies.md, run as written: tier objects with no engine take the
    hierarchy's io settings and its shared engine; the demotion rule it sets is the one used."""
    monkeypatch.chdir(tmp_path)
    ns: dict = {}
    exec(_snippet("policies.md", "From Python, rules compose with"), ns)
    h: Hierarchy = ns["h"]
    with h:
        ssd, pfs = h.tier("ssd"), h.tier("pfs")
        assert ssd.engine is pfs.engine and ssd.chunk_bytes == pfs.chunk_bytes == IOConfig().chunk_bytes
        for step in range(1, 7):
            h.save({"w": torch.full((4,), float(step))}, step=step, blocking=True).wait()
        assert [c.step for c in h.checkpoints() if "pfs" in c.tiers] == [5]
        assert (tmp_path / "ckpt" / "ssd" / "step-000000000006").is_dir()
    with Hierarchy([LocalTier("pfs", "ckpt/pfs")]) as again:  # on_close sent the newest there
        assert [c.step for c in again.checkpoints()] == [5, 6]
        assert torch.equal(again.restore()["w"], torch.full((4,), 6.0))


def test_config_md_python_example_and_explicit_settings(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.chdir(tmp_path)
    ns: dict = {}
    exec(_snippet("config.md", "## From Python"), ns)
    with ns["h"] as h:
        assert h.tier("ssd").engine.name == "threads" and h.tier("ssd").capacity_bytes == 100 << 30
        h.save({"w": torch.ones(3)}, step=1, blocking=True).wait()
        assert torch.equal(h.restore()["w"], torch.ones(3))
    own = LocalTier("own", tmp_path / "own", chunk_bytes=1 << 20, direct=False)  # given: kept
    with Hierarchy([own], io=IOConfig(engine="threads", chunk_bytes=8 << 20)):
        assert own.chunk_bytes == 1 << 20 and not own.direct and own.engine.name == "threads"


def test_a_tier_on_its_own_makes_and_closes_its_engine(tmp_path: Path) -> None:
    tier = LocalTier("solo", tmp_path / "solo")
    engine = tier.engine
    assert tier.engine is engine
    tier.close()
    assert tier._engine is None  # a later use makes a new one
    tier.close()
    tier.engine  # noqa: B018 - made again, then replaced by the hierarchy's (and closed)
    for _ in range(2):  # a tier object can join one hierarchy after another has closed
        with Hierarchy([tier]) as h:
            assert not tier._own_engine and tier.engine is h._engines.get(h.io.engine, h.io.queue_depth)
            h.save({"w": torch.ones(2)}, step=len(h.checkpoints()) + 1, blocking=True).wait()
    with Hierarchy([LocalTier("again", tmp_path / "solo")]) as h:
        assert [c.step for c in h.checkpoints()] == [1, 2]


def test_tier_io_errors_keep_the_oserror_as_their_cause(tmp_path: Path) -> None:
    """``raise ... from None`` dropped the cause the docs promise (docs/policies.md, "Failures")."""
    (tmp_path / "file").write_text("not a directory")
    with pytest.raises(TierIOError) as e:
        LocalTier("bad", tmp_path / "file" / "sub")
    assert isinstance(e.value.__cause__, OSError) and not isinstance(e.value.__cause__, TierIOError)
    assert e.value.errno == e.value.__cause__.errno == errno.ENOTDIR
    with Hierarchy([LocalTier("ssd", tmp_path / "ssd")]) as h:
        shutil.rmtree(tmp_path / "ssd")
        (tmp_path / "ssd").write_text("the directory went away; a file took its name")
        with pytest.raises(TierIOError, match="cannot start step 1") as e:
            h.save({"w": torch.ones(2)}, step=1).wait()
        assert isinstance(e.value.__cause__, OSError) and e.value.__cause__.errno == e.value.errno
        (tmp_path / "ssd").unlink()  # close() raises nothing more: the failure was seen through the handle
