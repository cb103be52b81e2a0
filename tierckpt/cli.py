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
    from tierckpt.config import TierConfig
    from tierckpt.facade.verify import CopyCheck
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
    checks = _verify_every_node(args)
    bad = [c for _, c in checks if c.error is not None]
    if args.json:
        print(json.dumps({
            "ok": bool(checks) and not bad,
            "copies": [{"step": c.step, "tier": c.tier, "rank": c.rank, "node": node, "ok": c.error is None,
                        "error": None if c.error is None else str(c.error)} for node, c in checks],
        }))  # fmt: skip
    else:
        for node, c in checks:
            where = f"step {c.step} on {c.tier}" + ("" if node is None else f" of node {node}") + f", rank {c.rank}"
            print(f"{where}: {_verdict(c.error)}")
        print(
            f"{len(checks) - len(bad)} of {len(checks)} copies verified"
            + (f", {len(bad)} damaged or unusable" if bad else "")
            + ("" if checks else ": no checkpoint found (is the config's path right?)")
        )
    return 1 if bad or not checks else 0  # a verify that checked nothing proves nothing


def _verdict(error: BaseException | None) -> str:
    from tierckpt.errors import CorruptCheckpointError

    if error is None:
        return "ok"
    return f"{'CORRUPT' if isinstance(error, CorruptCheckpointError) else 'UNUSABLE'}: {error}"


def _verify_every_node(args: argparse.Namespace) -> list[tuple[int | None, CopyCheck]]:
    """Every copy of the config's tiers (of ``--rank`` only, if given), as (node, check): once per node
    whose directory exists for the tiers whose path holds ``{node}`` (the shared tiers once)."""
    from tierckpt.config import load_config
    from tierckpt.facade.verify import verify_copies
    from tierckpt.hierarchy import Hierarchy
    from tierckpt.ranks.coordinator import SoloCoordinator

    cfg = load_config(args.config)
    rank = 0 if args.rank is None else args.rank
    per_node = {t.name: bool(_nodes_of(t, rank, probe=True)) for t in cfg.tiers}
    found = sorted(set().union(*(_nodes_of(t, rank) for t in cfg.tiers)))
    nodes: list[int | None] = [*found] if found else [None]
    out: list[tuple[int | None, CopyCheck]] = []
    listed = False
    for i, node in enumerate(nodes):
        coordinator = SoloCoordinator(rank, rank + 1, node=node)
        with Hierarchy.from_config(cfg, readonly=True, coordinator=coordinator) as h:
            infos = [c for c in h.checkpoints() if c.tiers and (args.step is None or c.step == args.step)]
            listed = listed or bool(infos)
            only = [n for n in per_node if per_node[n] or i == 0]  # a shared tier: once
            ranks = None if args.rank is None else {args.rank}
            checks = verify_copies(h.tiers, infos, rank, may_commit=True, ranks=ranks, only=only)
            out += [(node if per_node[c.tier] else None, c) for c in checks]
    if args.step is not None and not listed:
        raise CheckpointNotFoundError(f"step {args.step} is not committed on any tier of {args.config}")
    return sorted(out, key=lambda nc: (nc[1].step, nc[1].tier, -1 if nc[0] is None else nc[0], nc[1].rank))


_PROBE_NODES = (98765, 98764)  # node indices no real job uses: where a path differs between them, it holds {node}


def _nodes_of(t: TierConfig, rank: int, *, probe: bool = False) -> set[int]:
    """The nodes whose directory of tier entry ``t`` exists, where its path holds ``{node}`` (else none);
    with ``probe``, whether it holds ``{node}`` (a set of one probe node, or none)."""
    import glob
    import re
    from dataclasses import replace

    from tierckpt.configvalues import MAX_NODE
    from tierckpt.tiers.options import local_directory

    try:
        a, b = (str(local_directory(replace(t, rank=rank, node=n))) for n in _PROBE_NODES)
    except TierckptError:  # not a directory (a URL, no path): the kind's own
        return set()
    if a == b or probe:
        return set() if a == b else {_PROBE_NODES[0]}
    digits = str(_PROBE_NODES[0])
    pattern = re.compile(re.escape(a).replace(digits, "([0-9]+)"))
    out = set()
    for path in glob.glob(glob.escape(a).replace(digits, "*")):
        m = pattern.fullmatch(path)
        if m is None or len(set(m.groups())) != 1 or int(m.group(1)) >= MAX_NODE:
            continue
        node = int(m.group(1))
        if os.path.isdir(path) and str(local_directory(replace(t, rank=rank, node=node))) == path:
            out.add(node)
    return out


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
        (
            "verify",
            _cmd_verify,
            "re-read every rank's copies on every node and check every checksum (exit 1 on damage)",
        ),
    ):
        sp = sub.add_parser(name, help=helptext, description=helptext)
        sp.add_argument("config", help="hierarchy YAML file")
        if name != "ls":
            sp.add_argument("--step", type=int, default=None, help="step (default: newest for inspect, all for verify)")
            sp.add_argument(
                "--rank", type=int, default=0 if name == "inspect" else None,
                help="the rank whose copies to look at (default: 0 for inspect, every rank for verify)",
            )  # fmt: skip
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
