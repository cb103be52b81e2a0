"""The ``tierckpt`` command (also ``python -m tierckpt``): ``ls``, ``inspect`` and ``verify`` a
hierarchy's checkpoints, and ``bench`` (the benchmark suite, :mod:`tierckpt.bench`).

Argument parsing imports nothing heavy: torch is imported by the command that needs it, so
``--help``, ``--version`` and usage errors return at once.

Exit status: 0 on success, 1 when ``verify`` finds a damaged copy, 2 on bad usage or config.
"""

from __future__ import annotations

import argparse
import json
import logging
import os
import sys
from collections.abc import Sequence
from typing import TYPE_CHECKING

from tierckpt import __version__
from tierckpt.errors import CheckpointNotFoundError, TierckptError

if TYPE_CHECKING:
    from tierckpt.hierarchy import Hierarchy

_EXIT_PIPE = 128 + 13  # as a shell reports a process that SIGPIPE ended

__all__ = ["main"]


def _open(args: argparse.Namespace) -> Hierarchy:
    from tierckpt.hierarchy import Hierarchy  # here, not above: --help and usage errors need no torch

    # these commands only look: no directory made for a mistyped path, no copy on close; as one rank
    # (--rank) of a job of any size, alone (no coordinator: a tool is not one of the job's ranks)
    from tierckpt.ranks.coordinator import SoloCoordinator

    rank = getattr(args, "rank", 0)
    return Hierarchy.from_yaml(args.config, readonly=True, coordinator=SoloCoordinator(rank, rank + 1))


def _ranks(h: Hierarchy, step: int, tiers: tuple[str, ...]) -> int | None:
    """The number of ranks that saved ``step`` (from its commit record on the first of ``tiers``), or
    None where it has none (a copy written before records)."""
    from tierckpt.format.record import decode_record

    for name in tiers:
        try:
            data = h.tier(name).read_record(step)
            if data is not None:
                return decode_record(data, step).world_size
        except (OSError, TierckptError):
            continue
    return None


def _cmd_ls(args: argparse.Namespace) -> int:
    with _open(args) as h:
        infos = h.checkpoints()
        if args.json:
            listed = [{"step": i.step, "tiers": list(i.tiers), "ranks": _ranks(h, i.step, i.tiers)} for i in infos]
            print(json.dumps({"checkpoints": listed}))
            return 0
        if not infos:
            print("no committed checkpoints")
            return 0
        names = [t.name for t in h.tiers]
        width = max(len("step"), *(len(str(i.step)) for i in infos))
        print(f"{'step':>{width}}  " + "  ".join(names) + "  ranks")
        for i in infos:
            ranks = _ranks(h, i.step, i.tiers)
            marks = "  ".join(f"{'x' if n in i.tiers else '.':^{len(n)}}" for n in names)
            print(f"{i.step:>{width}}  {marks}  {'-' if ranks is None else ranks:>5}")
    return 0


def _cmd_inspect(args: argparse.Namespace) -> int:
    from tierckpt.facade.describe import describe, text_lines

    with _open(args) as h:
        tier, m = h.inspect(args.step)
        info = describe(m, tier)
    if args.json:
        print(json.dumps(info))
    else:
        print("\n".join(text_lines(info)))
    return 0


def _cmd_verify(args: argparse.Namespace) -> int:
    with _open(args) as h:
        results = h.verify(args.step)
        bad = [r for r in results if r[2] is not None]
        if args.json:
            print(json.dumps({
                "ok": bool(results) and not bad,
                "copies": [{"step": s, "tier": t, "ok": e is None, "error": None if e is None else str(e)}
                           for s, t, e in results],
            }))  # fmt: skip
        else:
            for s, t, e in results:
                print(f"step {s} on {t}: {'ok' if e is None else f'CORRUPT: {e}'}")
            print(
                f"{len(results) - len(bad)} of {len(results)} copies verified"
                + (f", {len(bad)} damaged" if bad else "")
                + ("" if results else ": no checkpoint found (is the config's path right?)")
            )
    return 1 if bad or not results else 0  # a verify that checked nothing proves nothing


def _cmd_bench(args: argparse.Namespace) -> int:
    from tierckpt.bench.runner import run

    return run(args)


def build_parser() -> argparse.ArgumentParser:
    from tierckpt.bench.options import add_arguments

    p = argparse.ArgumentParser(prog="tierckpt", description="Inspect and verify tierckpt checkpoints; benchmark.")
    p.add_argument("-V", "--version", action="version", version=f"%(prog)s {__version__}")
    p.add_argument("-v", "--verbose", action="store_true", help="log what the library does")
    sub = p.add_subparsers(dest="command", required=True)
    for name, fn, helptext in (
        ("ls", _cmd_ls, "list committed steps and which tiers hold each"),
        ("inspect", _cmd_inspect, "show a step's tensors (dtypes, shapes, sizes), tied tensors and plain values"),
        ("verify", _cmd_verify, "re-read every copy and check every checksum (exit 1 on damage)"),
    ):
        sp = sub.add_parser(name, help=helptext, description=helptext)
        sp.add_argument("config", help="hierarchy YAML file")
        if name != "ls":
            sp.add_argument("--step", type=int, default=None, help="step (default: newest for inspect, all for verify)")
            sp.add_argument("--rank", type=int, default=0, help="the rank whose copies to look at (default: 0)")
        sp.add_argument("--json", action="store_true", help="machine-readable output")
        sp.set_defaults(func=fn)
    helptext = "benchmark tierckpt against torch.save, DCP, TorchSnapshot, safetensors and the raw disk"
    sp = sub.add_parser("bench", help=helptext, description=helptext + " (see docs/benchmarks.md)")
    add_arguments(sp)
    sp.set_defaults(func=_cmd_bench)
    return p


def main(argv: Sequence[str] | None = None) -> int:
    """Entry point of the ``tierckpt`` console script."""
    argv = list(sys.argv[1:] if argv is None else argv)
    args = build_parser().parse_args(argv)
    args.argv = argv[argv.index("bench") + 1 :] if "bench" in argv else argv
    logging.basicConfig(
        level=logging.INFO if args.verbose else logging.ERROR, format="%(levelname)s %(name)s: %(message)s"
    )
    try:
        return int(args.func(args))
    except BrokenPipeError:  # `tierckpt inspect ... | head`: the reader left; no traceback, no claim of success
        devnull = os.open(os.devnull, os.O_WRONLY)
        os.dup2(devnull, sys.stdout.fileno())  # so that the interpreter's final flush does not fail again
        return _EXIT_PIPE
    except CheckpointNotFoundError as e:
        print(f"tierckpt: {e}", file=sys.stderr)
        return 1 if args.command == "verify" else 2
    except TierckptError as e:
        print(f"tierckpt: {e}", file=sys.stderr)
        return 2


if __name__ == "__main__":  # pragma: no cover
    sys.exit(main())
