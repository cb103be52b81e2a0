"""Write a golden fixture: the states of ``states.py`` saved by the tierckpt that ``import tierckpt`` finds.

Usage, from the repository root (tests/golden/README.md says when)::

    PYTHONPATH=$PWD python tests/golden/make_fixture.py tests/golden/v5

writes the steps of :func:`states.golden_states` into a fresh local tier and copies the committed files
(``step-*/rank-*/manifest`` and ``blob-*.bin`` or ``data.bin``; no lease, no scratch directory) into the given
directory, which must not exist yet: a fixture is never rewritten. It runs under the tierckpt of every
commit since the first one (the fixtures of older versions were written by it, with ``PYTHONPATH``
pointing at a worktree of the commit named in the README), so it uses only the API they all have.
"""

from __future__ import annotations

import argparse
import inspect
import shutil
import sys
import tempfile
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from fixture_states import golden_states  # a sibling module: tests/golden is not a package

from tierckpt import Hierarchy
from tierckpt.config import LayoutConfig
from tierckpt.format.manifest import FORMAT_VERSION
from tierckpt.tiers.local import LocalTier

__all__ = ["ALIGN", "BLOB_BYTES", "copy_committed", "save_states"]

#: Small blobs, so that a step with a tensor over 4 KiB spans several blob files.
ALIGN = BLOB_BYTES = 4096


def _local_tier(path: Path) -> LocalTier:
    if inspect.signature(LocalTier).parameters["engine"].default is inspect.Parameter.empty:
        from tierckpt.io.engine import make_engine  # format versions 1-2: a tier took its engine

        return LocalTier("ssd", path, make_engine("threads", 4))  # type: ignore[call-arg]  (old signature)
    return LocalTier("ssd", path)


def save_states(tier_dir: Path, compress: str | None = None) -> int:
    """Save every golden step into a local tier at ``tier_dir`` (its ``compress:`` setting ``compress``
    where given: format version 6 on); the format version written."""
    torch.manual_seed(0)  # nothing here is random; in case a writer ever consults the generator
    tier = _local_tier(tier_dir)
    if compress is not None:
        from tierckpt.policies.compressconfig import parse_compress

        tier.compress = parse_compress(compress, "--compress")
    with Hierarchy([tier], layout=LayoutConfig(align_bytes=ALIGN, blob_bytes=BLOB_BYTES)) as h:
        for step, golden in golden_states().items():
            h.save(golden.state, step=step, allow_pickle=golden.allow_pickle, blocking=True)
    return FORMAT_VERSION if compress is None else 6


def copy_committed(tier_dir: Path, dest: Path) -> list[Path]:
    """Copy the committed copies' manifests and blobs, and the steps' commit records, from ``tier_dir``
    to ``dest``; the files copied."""
    copied = []
    for rank_dir in sorted(tier_dir.glob("step-" + "[0-9]" * 12 + "/rank-" + "[0-9]" * 5)):
        out = dest / rank_dir.relative_to(tier_dir)
        out.mkdir(parents=True)
        data = sorted(rank_dir.glob("blob-*.bin")) + sorted(rank_dir.glob("data.bin"))  # data.bin: one_file tiers
        for f in [rank_dir / "manifest", *data]:
            shutil.copyfile(f, out / f.name)
            copied.append(out / f.name)
    for node_file in sorted(tier_dir.glob("step-" + "[0-9]" * 12 + "/node-*.data")):  # files: per_node
        out = dest / node_file.relative_to(tier_dir)
        out.parent.mkdir(parents=True, exist_ok=True)
        shutil.copyfile(node_file, out)
        copied.append(out)
    for record in sorted(tier_dir.glob("step-" + "[0-9]" * 12 + "/commit")):  # format version 5 on
        out = dest / record.relative_to(tier_dir)
        out.parent.mkdir(parents=True, exist_ok=True)
        shutil.copyfile(record, out)
        copied.append(out)
    return copied


def main() -> int:
    """Write the fixture into the directory given on the command line."""
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("dest", type=Path, help="fixture directory to create, e.g. tests/golden/v5")
    p.add_argument("--compress", default=None, help="the tier's compress: setting (zstd: a version-6 fixture)")
    args = p.parse_args()
    if args.dest.exists():
        p.error(f"{args.dest} exists: a fixture is never rewritten (tests/golden/README.md)")
    with tempfile.TemporaryDirectory() as tmp:
        version = save_states(Path(tmp) / "tier", args.compress)
        files = copy_committed(Path(tmp) / "tier", args.dest)
    total = sum(f.stat().st_size for f in files)
    print(f"format version {version}: {len(files)} files, {total} bytes in {args.dest}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
