"""Fixtures shared by the test suites."""

from __future__ import annotations

import contextlib
import os
import shutil
import subprocess
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest

from tierckpt.io.engine import IOEngine, make_engine

# the real servers (Ceph with CephFS and S3, GlusterFS) and their fixtures, one of each per session
pytest_plugins = ["tierckpt.testing.pytest_clusters"]


@pytest.fixture(scope="session", autouse=True)
def cache_dir(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Path]:
    """The session's own cache directory (``TIERCKPT_CACHE_DIR``, inherited by the processes tests start):
    nothing read from or left in the user's cache (the liburing probe's answer, kept measurements)."""
    where = tmp_path_factory.mktemp("cache")
    old = os.environ.get("TIERCKPT_CACHE_DIR")
    os.environ["TIERCKPT_CACHE_DIR"] = str(where)
    yield where
    if old is None:
        os.environ.pop("TIERCKPT_CACHE_DIR", None)
    else:
        os.environ["TIERCKPT_CACHE_DIR"] = old


@pytest.fixture(autouse=True)
def _no_kept_measurements(cache_dir: Path) -> None:
    """Each test starts with no measurements kept by an earlier one (tierckpt.datapath.measured)."""
    shutil.rmtree(cache_dir / "measured", ignore_errors=True)


@pytest.fixture(params=["threads", "uring"])
def engine(request: pytest.FixtureRequest) -> Iterator[IOEngine]:
    """Each I/O engine in turn (queue depth 4); the io_uring one skips where io_uring is unavailable."""
    try:
        e = make_engine(request.param, 4)
    except OSError as err:
        pytest.skip(f"io_uring unavailable here: {err}")
    yield e
    e.close()


@contextlib.contextmanager
def _mounted(mnt: Path, size: int) -> Iterator[Path]:
    """A tmpfs of ``size`` bytes mounted at ``mnt`` (made here), unmounted after; skips unless root and
    mount works."""
    if not hasattr(os, "geteuid") or os.geteuid() != 0:
        pytest.skip("mounting a tmpfs needs root")
    mnt.mkdir()
    try:
        r = subprocess.run(
            ["mount", "-t", "tmpfs", "-o", f"size={size}", "tmpfs", str(mnt)],
            capture_output=True,
            text=True,
            timeout=30,
        )
    except (OSError, subprocess.TimeoutExpired) as e:
        pytest.skip(f"cannot mount a tmpfs: {e}")
    if r.returncode != 0:
        pytest.skip(f"cannot mount a tmpfs: {r.stderr.strip()}")
    try:
        yield mnt
    finally:
        subprocess.run(["umount", "-l", str(mnt)], check=False, capture_output=True, timeout=30)


@pytest.fixture
def tmpfs(tmp_path: Path) -> Iterator[Path]:
    """A 64 MiB tmpfs mounted at ``tmp_path/pfs`` (for ENOSPC); skips unless root and mount works."""
    with _mounted(tmp_path / "pfs", 64 << 20) as mnt:
        yield mnt


@pytest.fixture
def mount_tmpfs() -> Callable[[Path, int], contextlib.AbstractContextManager[Path]]:
    """``mount_tmpfs(path, size)``: a tmpfs of ``size`` bytes at ``path`` for a ``with`` block (a device of
    the size a test needs); skips unless root and mount works."""
    return _mounted


@pytest.fixture(params=["native", "python"])
def loops(request: pytest.FixtureRequest, monkeypatch: pytest.MonkeyPatch) -> str:
    """Each implementation of the per-tensor loops of save and restore in turn: the C extension
    (skipped where it is not built) and the pure-Python ones it replaces (tierckpt.format.native)."""
    import tierckpt.datapath.packing
    import tierckpt.format.native

    if request.param == "native":
        if tierckpt.format.native.native is None:
            pytest.skip("tierckpt.format._native is not built here (or TIERCKPT_NATIVE=0)")
    else:
        for mod in (
            tierckpt.datapath.packing,
            tierckpt.format.native,
        ):
            monkeypatch.setattr(mod, "native", None)
    return str(request.param)
