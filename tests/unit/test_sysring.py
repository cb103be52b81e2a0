"""Tests for the raw-syscall io_uring ring (:mod:`tierckpt.io._sysring`)."""

from __future__ import annotations

import ctypes
import errno
import mmap
import os
import select
import threading
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

from tierckpt.io._sysring import SysRing

try:
    SysRing(8).close()
except OSError as _e:  # io_uring disabled, seccomp, old kernel, unsupported arch
    pytest.skip(f"io_uring unavailable: {_e}", allow_module_level=True)


@pytest.fixture
def ring() -> Iterator[SysRing]:
    r = SysRing(8)
    yield r
    r.close()


def _run(ring: SysRing, n: int = 1) -> list[tuple[int, int]]:
    """Submit what is prepared and wait for ``n`` completions."""
    ring.submit()
    out: list[tuple[int, int]] = []
    while len(out) < n:
        ring.wait(1)
        out += ring.reap()
    return out


def _buf(data: bytes | int) -> tuple[ctypes.Array[ctypes.c_char], int]:
    """A ctypes buffer (keep it alive while the kernel uses it) and its address."""
    b = ctypes.create_string_buffer(data, len(data)) if isinstance(data, bytes) else ctypes.create_string_buffer(data)
    return b, ctypes.addressof(b)


def test_nop_round_trip(ring: SysRing) -> None:
    assert ring.sq_space_left() == 8
    ring.prep_nop(0xDEADBEEFCAFEF00D)
    assert ring.sq_space_left() == 7
    assert _run(ring) == [(0xDEADBEEFCAFEF00D, 0)]
    assert ring.cq_ready() == 0
    assert ring.sq_space_left() == 8


def test_write_read_buffered(ring: SysRing, tmp_path: Path) -> None:
    data = os.urandom((1 << 20) + 4097)
    fd = os.open(tmp_path / "f", os.O_RDWR | os.O_CREAT, 0o644)
    try:
        _src, src_addr = _buf(data)
        ring.prep_rw(True, fd, src_addr, len(data), 0, 1)
        assert _run(ring) == [(1, len(data))]
        assert os.pread(fd, len(data), 0) == data
        dst, dst_addr = _buf(len(data))
        ring.prep_rw(False, fd, dst_addr, len(data), 0, 2)
        assert _run(ring) == [(2, len(data))]
        assert dst.raw == data
        # read past EOF at an offset: short read of the tail
        ring.prep_rw(False, fd, dst_addr, len(data), 1 << 20, 3)
        assert _run(ring) == [(3, 4097)]
    finally:
        os.close(fd)


def test_write_read_direct(ring: SysRing, tmp_path: Path) -> None:
    n = 1 << 20
    try:
        fd = os.open(tmp_path / "d", os.O_RDWR | os.O_CREAT | os.O_DIRECT, 0o644)
    except OSError as e:
        pytest.skip(f"O_DIRECT unsupported here: {e}")
    src, dst = mmap.mmap(-1, n), mmap.mmap(-1, n)
    try:
        data = os.urandom(n)
        src[:] = data
        src_c, dst_c = ctypes.c_char.from_buffer(src), ctypes.c_char.from_buffer(dst)
        ring.prep_rw(True, fd, ctypes.addressof(src_c), n, 0, 10)
        assert _run(ring) == [(10, n)]
        ring.prep_rw(False, fd, ctypes.addressof(dst_c), n, 0, 11)
        assert _run(ring) == [(11, n)]
        assert dst[:] == data
        del src_c, dst_c
    finally:
        os.close(fd)
        src.close()
        dst.close()


def test_fsync(ring: SysRing, tmp_path: Path) -> None:
    fd = os.open(tmp_path / "s", os.O_RDWR | os.O_CREAT, 0o644)
    try:
        os.write(fd, b"x" * 100)
        ring.prep_fsync(fd, 5)
        assert _run(ring) == [(5, 0)]
    finally:
        os.close(fd)


def test_errors_are_negative_errno(ring: SysRing, tmp_path: Path) -> None:
    _b, addr = _buf(4096)
    ring.prep_rw(False, 99999, addr, 4096, 0, 1)
    dfd = os.open(tmp_path, os.O_RDONLY | os.O_DIRECTORY)
    try:
        ring.prep_rw(False, dfd, addr, 4096, 0, 2)
        assert sorted(_run(ring, 2)) == [(1, -errno.EBADF), (2, -errno.EISDIR)]
    finally:
        os.close(dfd)


def test_full_queue_raises(ring: SysRing) -> None:
    for i in range(8):
        ring.prep_nop(i)
    assert ring.sq_space_left() == 0
    with pytest.raises(RuntimeError):
        ring.prep_nop(99)
    assert sorted(u for u, _ in _run(ring, 8)) == list(range(8))


def test_many_ops_in_batches(ring: SysRing, tmp_path: Path) -> None:
    count, size = 200, 4096 + 3
    data = os.urandom(count * size)
    fd = os.open(tmp_path / "m", os.O_RDWR | os.O_CREAT, 0o644)
    try:
        _src, src_addr = _buf(data)
        for write in (True, False):
            dst, dst_addr = _buf(len(data))
            addr = src_addr if write else dst_addr
            done: dict[int, int] = {}
            nxt = 0
            while len(done) < count:
                while nxt < count and ring.sq_space_left():
                    ring.prep_rw(write, fd, addr + nxt * size, size, nxt * size, 1000 + nxt)
                    nxt += 1
                ring.submit()
                ring.wait(1)
                for ud, res in ring.reap():
                    assert ud not in done
                    done[ud] = res
            assert done == {1000 + i: size for i in range(count)}
        assert dst.raw == data
    finally:
        os.close(fd)


def test_wait_blocks_until_completion(ring: SysRing) -> None:
    r, w = os.pipe()
    try:
        b, addr = _buf(16)
        ring.prep_rw(False, r, addr, 16, -1, 7)
        assert ring.submit() == 1
        assert ring.cq_ready() == 0
        timer = threading.Timer(0.2, os.write, (w, b"hello"))
        t0 = time.monotonic()
        timer.start()
        ring.wait(1)
        assert time.monotonic() - t0 >= 0.15
        assert ring.reap() == [(7, 5)]
        assert b.raw[:5] == b"hello"
        timer.join()
    finally:
        os.close(r)
        os.close(w)


def test_poll_wait_releases_gil(ring: SysRing) -> None:
    r, w = os.pipe()
    counter = [0]
    stop = threading.Event()

    def spin() -> None:
        while not stop.is_set():
            counter[0] += 1

    spinner = threading.Thread(target=spin)
    timer = threading.Timer(0.3, os.write, (w, b"x" * 8))
    try:
        _b, addr = _buf(8)
        ring.prep_rw(False, r, addr, 8, -1, 42)
        assert ring.submit() == 1
        poller = select.poll()
        poller.register(ring.ring_fd, select.POLLIN)
        spinner.start()
        time.sleep(0.05)
        before = counter[0]
        timer.start()
        events = poller.poll(5000)
        after = counter[0]
        assert events and events[0][1] & select.POLLIN
        assert after - before > 1000, "spinner thread made no progress during the ring wait"
        assert ring.reap() == [(42, 8)]
    finally:
        stop.set()
        timer.cancel()
        if spinner.is_alive():
            spinner.join()
        os.close(r)
        os.close(w)


def test_close_twice() -> None:
    r = SysRing(4)
    fd = r.ring_fd
    assert fd >= 0
    r.close()
    r.close()
    assert r.ring_fd == -1
    with pytest.raises(OSError):
        os.fstat(fd)


def test_entries_rounded_and_reused_slots(tmp_path: Path) -> None:
    r = SysRing(3)  # rounded up to 4 by the kernel
    try:
        assert r.sq_space_left() == 4
        fd = os.open(tmp_path / "z", os.O_RDWR | os.O_CREAT, 0o644)
        try:
            _b, addr = _buf(b"abc")
            for i in range(20):  # slots reused many times; stale fields must not leak into NOPs
                r.prep_rw(True, fd, addr, 3, i * 3, i) if i % 2 else r.prep_nop(i)
                assert _run(r) == [(i, 3 if i % 2 else 0)]
        finally:
            os.close(fd)
    finally:
        r.close()


def test_cq_overflow_loses_nothing() -> None:
    r = SysRing(4)  # CQ has 8 entries
    try:
        for batch in range(5):  # 20 completions without reaping: 12 go to the kernel's overflow list
            for i in range(4):
                r.prep_nop(batch * 4 + i)
            assert r.submit() == 4
        assert sorted(u for u, _ in r.reap()) == list(range(20))
        assert r.cq_ready() == 0
    finally:
        r.close()
