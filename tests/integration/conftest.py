"""Fixtures shared by the integration tests."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest


@pytest.fixture
def chain_config(tmp_path: Path) -> Callable[..., dict[str, Any]]:
    """A factory: ``chain_config(**policy)`` is the config of host (256 MiB) → ssd (local) → pfs under
    ``tmp_path``, 1 MiB chunks, with that policy."""

    def make(**policy: Any) -> dict[str, Any]:
        return {
            "tiers": [
                {"name": "host", "kind": "host", "capacity": "256MiB"},
                {"name": "ssd", "kind": "local", "path": str(tmp_path / "ssd")},
                {"name": "pfs", "kind": "pfs", "path": str(tmp_path / "pfs")},
            ],
            "io": {"chunk": "1MiB"},
            "policy": policy,
        }

    return make
