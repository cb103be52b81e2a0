from __future__ import annotations

import errno
import logging
import os
from pathlib import Path

import pytest
import torch

import tierckpt.io.engine as engine_mod
from tierckpt.io import aligned_empty, make_engine
from tierckpt.io.buffers import StagingPool
from tierckpt.io.engine import IOEngine
from tierckpt.io.threadpool import ThreadEngine


@pytest.mark.parametrize("direct", [False, True])
def test_round_trip_many_ops(engine: IOEngine, tmp_path: Path, direct: bool) -> None:
    n, chunk = 8 << 20, 1 << 20
    src = aligned_empty(n)
    src.copy_(torch.randint(0, 256, (n,), dtype=torch.uint8))
    p = tmp_path / "f.bin"
    fd = os.open(p, os.O_RDWR | os.O_CREAT | (os.O_DIRECT if direct else 0), 0o644)
    try:
        futs = [engine.pwrite(fd, src.data_ptr() + o, chunk, o, path=str(p)) for o in range(0, n, chunk)]
        assert sum(f.result() for f in futs) == n
        assert engine.fsync(fd).result() == 0
        dst = aligned_empty(n)
        futs = [engine.pread(fd, dst.data_ptr() + o, chunk, o) for o in range(0, n, chunk)]
        assert sum(f.result() for f in futs) == n
        assert torch.equal(src, dst)
        assert engine.pread(fd, dst.data_ptr(), 8192, n - 4096).result() == 4096  # short only at EOF
        assert engine.pread(fd, dst.data_ptr(), 4096, n).result() == 0
        assert engine.pwrite(fd, src.data_ptr(), 0, 0).result() == 0
    finally:
        os.close(fd)


def test_errors_carry_errno_path_and_operation(engine: IOEngine, tmp_path: Path) -> None:
    buf = aligned_empty(4096)
    with pytest.raises(OSError) as ei:
        engine.pread(987654, buf.data_ptr(), 4096, 0, path="/some/blob").result()
    assert ei.value.errno == errno.EBADF and ei.value.filename == "/some/blob" and "read" in str(ei.value)
    fd = os.open(tmp_path, os.O_RDONLY | os.O_DIRECTORY)
    try:
        with pytest.raises(IsADirectoryError):
            engine.pread(fd, buf.data_ptr(), 4096, 0).result()
    finally:
        os.close(fd)


def test_closed_engine_refuses_work(tmp_path: Path) -> None:
    e = make_engine("threads", 2)
    e.close()
    with pytest.raises(RuntimeError):
        e.fsync(0)


def test_auto_falls_back_with_one_log_line(monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture) -> None:
    import tierckpt.io.uring as uring

    def broken(*a: object, **k: object) -> None:
        raise PermissionError(errno.EPERM, "io_uring disabled by sysctl")

    monkeypatch.setattr(uring, "UringEngine", broken)
    monkeypatch.setattr(engine_mod, "_fallback_logged", False)
    with caplog.at_level(logging.WARNING, logger="tierckpt.io.engine"):
        engines = [make_engine("auto", 2) for _ in range(3)]
    assert all(isinstance(e, ThreadEngine) for e in engines)
    assert sum("io_uring is unavailable" in r.message for r in caplog.records) == 1
    for e in engines:
        e.close()
    with pytest.raises(PermissionError):
        make_engine("uring", 2)


def test_uring_backend_knob(monkeypatch: pytest.MonkeyPatch) -> None:
    from tierckpt.io._liburing import liburing_runs
    from tierckpt.io.uring import ring_backend

    monkeypatch.setenv("TIERCKPT_URING_BACKEND", "syscall")
    assert ring_backend() == "syscall"
    monkeypatch.setenv("TIERCKPT_URING_BACKEND", "auto")
    assert ring_backend() == ("liburing" if liburing_runs() is None else "syscall")
    monkeypatch.setenv("TIERCKPT_URING_BACKEND", "liburing")
    if liburing_runs() is None:
        assert ring_backend() == "liburing"
    else:  # e.g. the wheel needs AVX-512: a clear error instead of SIGILL
        with pytest.raises(OSError, match="liburing backend unavailable"):
            ring_backend()
    monkeypatch.setenv("TIERCKPT_URING_BACKEND", "bogus")
    with pytest.raises(ValueError, match="TIERCKPT_URING_BACKEND"):
        ring_backend()


def test_staging_pool_reuses_aligned_buffers() -> None:
    pool = StagingPool(2, 8192)
    a, b = pool.acquire(), pool.acquire()
    assert a.data_ptr() % 4096 == 0 and b.data_ptr() % 4096 == 0 and a.numel() == 8192
    pool.release(a)
    assert pool.acquire().data_ptr() == a.data_ptr()
    assert pool.allocated_bytes == 2 * 8192
