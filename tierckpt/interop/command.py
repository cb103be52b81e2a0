"""``tierckpt export``: its options (built without importing torch, for ``--help``) and what it runs."""

from __future__ import annotations

import argparse
import json

__all__ = ["add_arguments", "run"]


def add_arguments(p: argparse.ArgumentParser) -> None:
    """The ``export`` options."""
    p.add_argument("config", help="hierarchy YAML file")
    p.add_argument("--step", type=int, default=None, help="step (default: the newest that reads)")
    p.add_argument("--format", choices=("safetensors", "torch"), default="safetensors", help="default: %(default)s")
    p.add_argument("--out", required=True, help="output directory (made; an existing one must be empty)")
    p.add_argument(
        "--only", action="append", default=[], metavar="PREFIX",
        help="keep only names under this dotted prefix (e.g. model); repeatable",
    )  # fmt: skip
    p.add_argument(
        "--rename", action="append", default=[], metavar="OLD=NEW",
        help="replace a leading OLD of names by NEW (model.= drops 'model.'); repeatable, longest OLD first",
    )  # fmt: skip
    p.add_argument("--max-shard-size", default="5GB", help="most tensor bytes a file holds (default: %(default)s)")
    p.add_argument(
        "--max-inflight", default="256MiB", help="most tensor bytes read ahead of the writes (default: %(default)s)"
    )
    p.add_argument("--force", action="store_true", help="replace an existing non-empty output directory, whole")
    p.add_argument("--json", action="store_true", help="machine-readable output")


def run(args: argparse.Namespace) -> int:
    """Export as ``args`` say; print what was written."""
    from tierckpt.errors import ConfigError
    from tierckpt.interop.exporting import export

    renames = {}
    for r in args.rename:
        old, sep, new = r.partition("=")
        if not sep:
            raise ConfigError(f"--rename: expected OLD=NEW, got {r!r}")
        renames[old] = new
    got = export(
        args.config, args.out, step=args.step, format=args.format, only=args.only, key_map=renames or None,
        max_shard_size=args.max_shard_size, max_inflight=args.max_inflight, force=args.force,
    )  # fmt: skip
    if args.json:
        print(json.dumps({
            "step": got.step, "tier": got.tier, "path": str(got.path), "files": list(got.files),
            "tensors": got.tensors, "tensor_bytes": got.tensor_bytes, "values": got.values,
        }))  # fmt: skip
    else:
        print(
            f"exported step {got.step} from tier {got.tier!r} to {got.path}: {got.tensors} tensors "
            f"({got.tensor_bytes} bytes), {got.values} plain values, in {', '.join(got.files)}"
        )
    return 0
