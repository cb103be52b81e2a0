"""The steps the tests of tests/pfs save (small, so that the cluster's 1 GiB of memstore is never the
limit) and the hierarchy they save them with: host on top of a ``pfs`` tier on the mount."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import torch

MiB = 1 << 20
STEP_MIB = 8  # a step's tensors: small, so that the cluster's 1 GiB of memstore is never the limit


def state(step: int) -> dict[str, Any]:
    """Step ``step``'s state: every byte depends on the step and the tensor (odd lengths: not page ends)."""
    model = {f"w{i}": torch.arange(MiB // 2 - 3 * i, dtype=torch.int32).add_(step * 1009 + i) for i in range(4)}
    return {"step": step, "model": model, "meta": {"tag": f"step-{step}"}}


def same(a: dict[str, Any], b: dict[str, Any]) -> bool:
    return (
        a["step"] == b["step"]
        and a["meta"] == b["meta"]
        and all(torch.equal(a["model"][k], v) for k, v in b["model"].items())
    )


def config(pfs: Path, host: bool = True, compress: str | None = "none") -> dict[str, Any]:
    """The hierarchy; the pfs tier stores its copies raw unless ``compress`` says otherwise (the tests of
    full devices and quotas count raw bytes; None: the kind's default, ``auto``)."""
    tiers: list[dict[str, Any]] = (
        [{"name": "host", "kind": "host", "capacity": f"{2 * STEP_MIB + 4}MiB"}] if host else []
    )
    tiers.append({"name": "pfs", "kind": "pfs", "path": str(pfs)})
    if compress is not None:
        tiers[-1]["compress"] = compress
    return {"tiers": tiers, "io": {"chunk": "1MiB"}, "layout": {"blob_size": "4MiB"}}
