"""The probe of a tier's file system (tierckpt.io.fsutil.probe_fs): the file it writes to learn whether
O_DIRECT works is its own, created exclusively under a name no one can guess, and never a link."""

from __future__ import annotations

import errno
import os
import secrets
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from tierckpt.io.fsutil import probe_fs


def _names(*names: str) -> Iterator[str]:
    yield from names
    while True:
        yield "fresh"


def test_a_link_planted_at_the_probes_name_is_neither_followed_nor_removed(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    victim = tmp_path / "victim"
    victim.write_bytes(b"precious")
    tier = tmp_path / "tier"
    tier.mkdir()
    # links at the name a probe once took (the pid alone) and at the first name this one draws
    planted = [tier / f".tierckpt-probe-{os.getpid()}", tier / f".tierckpt-probe-{os.getpid()}-planted"]
    for link in planted:
        link.symlink_to(victim)
    names = _names("planted")
    monkeypatch.setattr(secrets, "token_hex", lambda n: next(names))
    facts = probe_fs(tier, writable=True)
    assert victim.read_bytes() == b"precious"  # not truncated through a link
    assert all(link.is_symlink() for link in planted)  # not removed: they are not the probe's
    assert sorted(os.listdir(tier)) == sorted(p.name for p in planted)  # its own file is gone
    assert facts == probe_fs(tmp_path, writable=True)  # and it learnt the same as anywhere else


def test_a_probe_whose_every_name_is_taken_says_so_and_touches_nothing(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    victim = tmp_path / "victim"
    victim.write_bytes(b"precious")
    tier = tmp_path / "tier"
    tier.mkdir()
    (tier / f".tierckpt-probe-{os.getpid()}-planted").symlink_to(victim)
    monkeypatch.setattr(secrets, "token_hex", lambda n: "planted")
    with pytest.raises(FileExistsError, match="probe file names were taken"):
        probe_fs(tier, writable=True)
    assert victim.read_bytes() == b"precious"


def test_a_file_system_that_creates_the_probe_before_refusing_o_direct_is_left_clean(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A file system that creates the file, then fails the open with EINVAL: the probe's own file goes."""
    real_open = os.open
    direct = getattr(os, "O_DIRECT", 0)
    if not direct:
        pytest.skip("no O_DIRECT here")

    def refusing(path: Any, flags: int, mode: int = 0o777, **kw: Any) -> int:
        if flags & direct:
            os.close(real_open(path, flags & ~direct, mode, **kw))
            raise OSError(errno.EINVAL, "Invalid argument", str(path))
        return real_open(path, flags, mode, **kw)

    monkeypatch.setattr(os, "open", refusing)
    assert not probe_fs(tmp_path, writable=True).direct
    assert os.listdir(tmp_path) == []
