"""The liburing probe's answer is kept per machine, Python and binding, and a bad cache only costs a probe."""

from __future__ import annotations

import json
import subprocess
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from tierckpt.io import _liburing

pytest.importorskip("liburing", reason="the liburing binding is not installed")


@pytest.fixture
def probes(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> Iterator[list[int]]:
    """Count the child probes; the cache lives in tmp_path."""
    monkeypatch.setenv("TIERCKPT_CACHE_DIR", str(tmp_path))
    _liburing.liburing_runs.cache_clear()
    calls: list[int] = []
    real = subprocess.run

    def counted(*args: Any, **kwargs: Any) -> Any:
        calls.append(1)
        return real(*args, **kwargs)

    monkeypatch.setattr(_liburing.subprocess, "run", counted)
    yield calls
    _liburing.liburing_runs.cache_clear()


def _ask() -> str | None:
    _liburing.liburing_runs.cache_clear()  # a new process, as far as the in-memory cache goes
    return _liburing.liburing_runs()


def test_a_second_process_reads_the_kept_answer(probes: list[int], tmp_path: Path) -> None:
    first = _ask()
    assert len(probes) == 1 and (tmp_path / "liburing-probe.json").exists()
    assert _ask() == first and len(probes) == 1


def test_another_machine_or_binding_probes_again(
    probes: list[int], tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    _ask()
    monkeypatch.setattr(_liburing, "_probe_key", lambda: "another")
    _ask()
    assert len(probes) == 2
    assert set(json.loads((tmp_path / "liburing-probe.json").read_text())) >= {"another"}


@pytest.mark.parametrize("text", ["not json", "[1, 2]", '{"%s": 3}'])
def test_a_damaged_cache_costs_a_probe_and_is_replaced(probes: list[int], tmp_path: Path, text: str) -> None:
    key = _liburing._probe_key()
    assert key is not None
    (tmp_path / "liburing-probe.json").write_text(text.replace("%s", key))
    first = _ask()
    assert len(probes) == 1
    assert json.loads((tmp_path / "liburing-probe.json").read_text())[key] == (first or "")


def test_an_empty_cache_dir_keeps_nothing(probes: list[int], monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("TIERCKPT_CACHE_DIR", "")
    _ask()
    _ask()
    assert len(probes) == 2


def test_an_unwritable_cache_only_costs_a_probe(
    probes: list[int], tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    blocker = tmp_path / "file"
    blocker.write_text("")
    monkeypatch.setenv("TIERCKPT_CACHE_DIR", str(blocker / "sub"))  # a directory under a file: ENOTDIR
    assert _ask() == _ask()
    assert len(probes) == 2


def test_a_probe_that_could_not_run_is_not_kept(probes: list[int], monkeypatch: pytest.MonkeyPatch) -> None:
    def fails(*args: Any, **kwargs: Any) -> Any:
        probes.append(1)
        raise subprocess.TimeoutExpired("python", 60)

    monkeypatch.setattr(_liburing.subprocess, "run", fails)
    assert "could not run" in (_ask() or "")
    assert "could not run" in (_ask() or "")
    assert len(probes) == 2
