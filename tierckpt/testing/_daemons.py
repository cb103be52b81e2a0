"""What the loopback clusters of :mod:`tierckpt.testing.clusters` share: foreground daemons with their
logs, bounded waits, commands that fail with the logs' tails, and stopping (unmount first, then the daemons
in reverse order, SIGTERM then SIGKILL)."""

from __future__ import annotations

import contextlib
import http.client
import os
import re
import shutil
import signal
import socket
import subprocess
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from types import TracebackType
from typing import NoReturn, TypeVar

#: seconds a single step of a start (a command, a daemon becoming ready) may take
STEP_TIMEOUT_S = 90.0
_STOP_WAIT_S = 15.0
_LOG_TAIL_LINES = 25


class ClusterError(RuntimeError):
    """A cluster could not be started (the message has the failing step and the daemons' log tails)."""


def free_port() -> int:
    """A TCP port on 127.0.0.1 that nothing listens on now (the kernel's pick)."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def why_not(binaries: tuple[str, ...]) -> str | None:
    if not hasattr(os, "geteuid") or os.geteuid() != 0:
        return "needs root (to mount a FUSE file system)"
    if not os.path.exists("/dev/fuse"):
        return "no /dev/fuse on this machine"
    missing = [b for b in binaries if shutil.which(b) is None]
    if missing:
        return f"{', '.join(missing)} not installed (see docs/testing.md for the Debian packages)"
    return None


def _tail(path: Path, lines: int = _LOG_TAIL_LINES) -> str:
    try:
        text = path.read_text(errors="replace").splitlines()
    except OSError:
        return ""
    return "\n".join(text[-lines:])


def _wait_for(what: str, ready: Callable[[], bool], timeout_s: float, fail: Callable[[str], None]) -> None:
    """Poll ``ready`` until it is true; after ``timeout_s`` call ``fail`` (which raises) with the reason."""
    deadline = time.monotonic() + timeout_s
    delay = 0.05
    while not ready():
        if time.monotonic() > deadline:
            fail(f"{what}: not ready after {timeout_s:.0f} s")
        time.sleep(delay)
        delay = min(delay * 2, 0.5)


def port_open(host: str, port: int) -> bool:
    try:
        with socket.create_connection((host, port), timeout=1.0):
            return True
    except OSError:
        return False


def http_answers(host: str, port: int) -> bool:
    """Whether an HTTP server answers ``GET /`` at ``host:port`` (with any status) within 2 s."""
    conn = http.client.HTTPConnection(host, port, timeout=2.0)
    try:
        conn.request("GET", "/")
        conn.getresponse().read()
        return True
    except (OSError, http.client.HTTPException):
        return False
    finally:
        conn.close()


def is_mounted(path: Path) -> bool:
    """Whether a file system is mounted at ``path``, from ``/proc/self/mountinfo``: never touching the
    mount point, whose every access hangs when a FUSE client has lost its servers."""
    path = Path(os.path.abspath(path))
    target = os.path.join(os.path.realpath(path.parent), path.name) if path.name else str(path)
    try:
        lines = Path("/proc/self/mountinfo").read_text().splitlines()
    except OSError:
        return os.path.ismount(path)
    for line in lines:
        fields = line.split(" ")
        # the mount point is field 5, with space, tab, newline and backslash escaped in octal
        if len(fields) > 4 and re.sub(r"\\([0-7]{3})", lambda m: chr(int(m.group(1), 8)), fields[4]) == target:
            return True
    return False


def _unmount(mnt: Path) -> None:
    """Unmount a FUSE mount: ``fusermount3 -u``, else ``umount``, else a lazy ``umount -l``."""
    for cmd in (["fusermount3", "-u"], ["umount"], ["umount", "-l"]):
        if not is_mounted(mnt):
            return
        if shutil.which(cmd[0]) is None:
            continue
        try:
            subprocess.run([*cmd, str(mnt)], capture_output=True, timeout=30, check=False)
        except subprocess.TimeoutExpired:
            continue


class Daemons:
    """Foreground daemons started as children, with their logs; stopped last-started first."""

    def __init__(self, base: Path) -> None:
        self.base = base
        self.procs: list[tuple[str, subprocess.Popen[bytes]]] = []
        self.extra_pids: list[int] = []  # processes started by a daemon (Gluster's bricks): killed after it

    def log_path(self, name: str) -> Path:
        return self.base / "log" / f"{name}.out"

    def spawn(self, name: str, argv: list[str]) -> subprocess.Popen[bytes]:
        with open(self.log_path(name), "ab") as log:
            # a session of its own: a ^C in the test run reaches pytest, which stops the cluster in order
            p = subprocess.Popen(argv, stdin=subprocess.DEVNULL, stdout=log, stderr=log, start_new_session=True)
        self.procs.append((name, p))
        return p

    def kill(self, name: str) -> None:
        """SIGKILL the daemon ``name`` (as a crash would), wait until it is gone, and forget it."""
        for entry in [e for e in self.procs if e[0] == name]:
            p = entry[1]
            if p.poll() is None:  # once reaped, its pid may be another process's
                with contextlib.suppress(ProcessLookupError):
                    os.kill(p.pid, signal.SIGKILL)
            try:
                p.wait(timeout=_STOP_WAIT_S)
            except subprocess.TimeoutExpired:
                raise ClusterError(f"{name} (pid {p.pid}) survived SIGKILL for {_STOP_WAIT_S:.0f} s") from None
            self.procs.remove(entry)

    def running(self, name: str) -> bool:
        """Whether the daemon ``name`` was started and has not exited."""
        return any(n == name and p.poll() is None for n, p in self.procs)

    def check_alive(self, fail: Callable[[str], None]) -> None:
        for name, p in self.procs:
            if p.poll() is not None:
                fail(f"{name} exited with status {p.returncode}")

    def stop(self) -> None:
        for name, p in reversed(self.procs):
            _terminate(p.pid, lambda p=p: p.poll() is not None)  # type: ignore[misc]
            if p.poll() is None:
                raise ClusterError(f"{name} (pid {p.pid}) survived SIGKILL")
        self.procs.clear()
        for pid in self.extra_pids:
            _terminate(pid, lambda pid=pid: not _pid_alive(pid))  # type: ignore[misc]
        self.extra_pids.clear()

    def logs(self) -> str:
        parts = []
        for f in sorted((self.base / "log").glob("*")) if (self.base / "log").is_dir() else []:
            tail = _tail(f)
            if tail:
                parts.append(f"--- {f.name} (last lines) ---\n{tail}")
        return "\n".join(parts)


def _pid_alive(pid: int) -> bool:
    """Whether ``pid`` runs (a zombie, dead but not yet reaped by its parent, does not)."""
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return False
    return stat.rsplit(")", 1)[-1].split()[0] != "Z"


def _terminate(pid: int, gone: Callable[[], bool]) -> None:
    """SIGTERM, wait up to a bound for ``gone()``, then SIGKILL and wait again."""
    for sig in (signal.SIGTERM, signal.SIGKILL):
        if gone():
            return
        try:
            os.kill(pid, sig)
        except ProcessLookupError:
            return
        deadline = time.monotonic() + _STOP_WAIT_S
        while not gone() and time.monotonic() < deadline:
            time.sleep(0.05)


_C = TypeVar("_C", bound="Cluster")


class Cluster:
    """What both clusters share: the base directory, the daemons, running commands, stopping."""

    kind = "cluster"

    def __init__(self, base_dir: str | os.PathLike[str], timeout_s: float = STEP_TIMEOUT_S) -> None:
        self.base = Path(base_dir).absolute()
        self.timeout_s = timeout_s
        self.mount: Path | None = None
        self._daemons = Daemons(self.base)
        self._started = False

    def __enter__(self: _C) -> _C:
        return self

    def __exit__(
        self, exc_type: type[BaseException] | None, exc: BaseException | None, tb: TracebackType | None
    ) -> None:
        self.stop()

    def _fail(self, why: str) -> NoReturn:
        """Raise :class:`ClusterError` with ``why`` and the tails of the daemons' logs."""
        raise ClusterError(f"{self.kind} in {self.base}: {why}\n{self._daemons.logs()}")

    @contextlib.contextmanager
    def _all_or_nothing(self) -> Iterator[None]:
        """Around a whole start: when a step fails, stop what had started, then raise the step's error."""
        try:
            yield
        except ClusterError as e:
            try:
                self.stop()
            except ClusterError as stop_error:
                raise ClusterError(f"{e} (and stopping what had started failed: {stop_error})") from e
            raise

    def _run(self, argv: list[str], what: str | None = None, timeout_s: float | None = None) -> str:
        """Run a command to completion; a failure or a timeout fails the start with its output."""
        try:
            r = subprocess.run(argv, capture_output=True, text=True, timeout=timeout_s or self.timeout_s, check=False)
        except subprocess.TimeoutExpired:
            self._fail(f"{what or argv[0]}: `{' '.join(argv)}` did not finish in {timeout_s or self.timeout_s:.0f} s")
            raise AssertionError("unreachable") from None
        if r.returncode != 0:
            self._fail(f"{what or argv[0]}: `{' '.join(argv)}` exited {r.returncode}: {r.stderr or r.stdout}")
        return r.stdout

    def _wait(self, what: str, ready: Callable[[], bool]) -> None:
        def ready_or_dead() -> bool:
            self._daemons.check_alive(self._fail)
            return ready()

        _wait_for(what, ready_or_dead, self.timeout_s, self._fail)

    def _prepare(self, dirs: list[str]) -> None:
        if self._started:
            raise ClusterError(f"{self.kind} in {self.base} is already started")
        if self.base.exists():
            shutil.rmtree(self.base)
        for d in ["log", *dirs]:
            (self.base / d).mkdir(parents=True)
        self._started = True

    def _unmount(self) -> None:
        if self.mount is not None:
            _unmount(self.mount)
            if is_mounted(self.mount):
                raise ClusterError(f"cannot unmount {self.mount}")

    def _stop_servers(self) -> None:
        self._daemons.stop()

    def stop(self) -> None:
        """Unmount, stop the daemons (SIGTERM, then SIGKILL after a bounded wait), remove the base directory.

        Safe to call twice and after a failed :meth:`start`.
        """
        self._unmount()
        self._stop_servers()
        shutil.rmtree(self.base, ignore_errors=True)
        self._started = False
