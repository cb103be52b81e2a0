"""Fixtures shared by the test suites."""

from __future__ import annotations

from collections.abc import Iterator

import pytest

from tierckpt.io.engine import IOEngine, make_engine


@pytest.fixture(params=["threads", "uring"])
def engine(request: pytest.FixtureRequest) -> Iterator[IOEngine]:
    """Each I/O engine in turn (queue depth 4); the io_uring one skips where io_uring is unavailable."""
    try:
        e = make_engine(request.param, 4)
    except OSError as err:
        pytest.skip(f"io_uring unavailable here: {err}")
    yield e
    e.close()
