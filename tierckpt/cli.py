"""The ``tierckpt`` command (also ``python -m tierckpt``): ``ls``, ``inspect``, ``verify`` and ``rm`` a
hierarchy's checkpoints, ``export`` one as safetensors or torch files (:mod:`tierckpt.interop`), ``probe``
a directory's file system, and ``bench`` (the benchmark suite, :mod:`tierckpt.bench`).

Argument parsing imports nothing heavy: torch is imported by the command that needs it, so
``--help``, ``--version`` and usage errors return at once.

Exit status: 0 on success; 1 when ``verify`` finds a damaged, unusable or missing copy, or nothing to
verify, or an unknown step, and when ``rm`` finds no such step; 2 on bad usage or config.
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
    from tierckpt.config import HierarchyConfig, TierConfig
    from tierckpt.facade.verify import CopyCheck, LookBudget
    from tierckpt.hierarchy import Hierarchy
    from tierckpt.tiers.base import Tier

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
    from tierckpt.facade.describe import describe, describe_io, describe_stored, io_lines, stored_lines, text_lines
    from tierckpt.tiers.base import CheckpointKey

    with _open(args) as h:
        tier, m = h.inspect(args.step)
        info = describe(m, tier)
        info["files"] = h.tier(tier).copy_files(CheckpointKey(m.step, m.rank))  # the copy's data files
        info["stored"] = describe_stored(h.tiers, CheckpointKey(m.step, m.rank))  # each tier's bytes and ratio
        info["io"] = describe_io(h.tiers, h.geometry)  # each tier's geometry and file-system facts
    if args.json:
        print(json.dumps(info))
    else:
        print("\n".join(text_lines(info) + stored_lines(info["stored"]) + io_lines(info["io"])))
    return 0


def _cmd_verify(args: argparse.Namespace) -> int:
    try:
        checks = _verify_everywhere(args)
    except CheckpointNotFoundError as e:  # an unknown --step
        if not args.json:
            raise
        print(json.dumps({"ok": False, "error": str(e), "summary": _summary([]), "copies": []}))
        return 1
    bad = [c for _, c in checks if c.error is not None]
    if args.json:
        print(json.dumps({
            "ok": bool(checks) and not bad,
            "error": None if checks else "no checkpoint found",
            "summary": _summary(checks),
            "copies": [{"step": c.step, "tier": c.tier, "node": node, "rank": c.rank, "ok": c.error is None,
                        "status": _status(c.error), "error": None if c.error is None else str(c.error)}
                       for node, c in checks],
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


def _status(error: BaseException | None) -> str:
    """A copy's verdict: ``ok``, ``corrupt`` (damaged) or ``unusable`` (not the copy the step's record
    names, missing, or unreadable)."""
    from tierckpt.errors import CorruptCheckpointError

    if error is None:
        return "ok"
    return "corrupt" if isinstance(error, CorruptCheckpointError) else "unusable"


def _verdict(error: BaseException | None) -> str:
    return "ok" if error is None else f"{_status(error).upper()}: {error}"


def _summary(checks: Sequence[tuple[int | None, CopyCheck]]) -> dict[str, int]:
    got = [_status(c.error) for _, c in checks]
    return {"copies": len(got), **{k: got.count(k) for k in ("ok", "corrupt", "unusable")}}


def _verify_everywhere(args: argparse.Namespace) -> list[tuple[int | None, CopyCheck]]:
    """Every copy of the config's tiers (of ``--rank`` only, if given), as (node, check), in the order
    (step, tier as configured, rank, node): each tier once for each directory its path expands to (every
    node's and every rank's that exists, where it holds ``{node}`` or ``{rank}``; node None where it
    holds no ``{node}``), and each rank that a record of a tier names and none of its directories holds
    (missing, node None)."""
    from tierckpt.config import load_config
    from tierckpt.facade.verify import LookBudget

    cfg = load_config(args.config)
    rank = 0 if args.rank is None else args.rank
    budget = LookBudget()  # the wait for copies about to be committed: one for the whole command
    out: list[tuple[int | None, CopyCheck]] = []
    for i, t in enumerate(cfg.tiers):
        seen = _Seen(cfg, i)
        for r, node, where in _directories(t, rank):
            with seen.open(r, node) as h:
                seen.look(h, args, r, node, budget)
            seen.looked.append(where)
        out += seen.checks + seen.missing(args.rank)
    if args.step is not None and not out:
        raise CheckpointNotFoundError(f"step {args.step} is not committed on any tier of {args.config}")
    order = {t.name: i for i, t in enumerate(cfg.tiers)}
    return sorted(out, key=lambda nc: (nc[1].step, order[nc[1].tier], nc[1].rank, -1 if nc[0] is None else nc[0]))


class _Seen:
    """What the directories of tier ``index`` of ``cfg`` showed: their copies' checks, the ranks each
    step's records name, and where the records were."""

    def __init__(self, cfg: HierarchyConfig, index: int) -> None:
        from dataclasses import replace

        from tierckpt.config import PolicyConfig

        self.cfg = replace(cfg, tiers=(cfg.tiers[index],), policy=PolicyConfig())  # no other tier to name
        self.tier = cfg.tiers[index].name
        self.checks: list[tuple[int | None, CopyCheck]] = []
        self.named: dict[int, set[int]] = {}  # step: the ranks its records name
        self.recorded: dict[int, list[tuple[int, int | None]]] = {}  # step: the directories holding its record
        self.looked: list[str] = []  # the directories, for messages

    def open(self, rank: int, node: int | None) -> Hierarchy:
        """The tier alone, read-only, as seen by ``rank`` (a process alone) on ``node``."""
        from tierckpt.hierarchy import Hierarchy
        from tierckpt.ranks.coordinator import SoloCoordinator

        return Hierarchy.from_config(self.cfg, readonly=True, coordinator=SoloCoordinator(rank, rank + 1, node=node))

    def look(self, h: Hierarchy, args: argparse.Namespace, rank: int, node: int | None, budget: LookBudget) -> None:
        """Verify the copies in one directory (``h``: its tier alone, opened as ``rank`` on ``node``)."""
        from tierckpt.facade.verify import verify_copies

        tier = h.tiers[0]
        infos = [c for c in h.checkpoints() if c.tiers and (args.step is None or c.step == args.step)]
        ranks = None if args.rank is None else {args.rank}
        checks = verify_copies(h.tiers, infos, rank, may_commit=True, ranks=ranks, budget=budget)
        self.checks += [(node, c) for c in checks]
        for step in _records(tier, args.step):
            size = _record_size(tier, step)
            if size is not None:
                self.named.setdefault(step, set()).update(range(size))
                self.recorded.setdefault(step, []).append((rank, node))

    def missing(self, only: int | None) -> list[tuple[int | None, CopyCheck]]:
        """A check for each rank (``only``, if given) that a record names and no directory holds: not
        one whose step a directory has evicted since it was looked at (its record goes first)."""
        import errno

        from tierckpt.errors import TierIOError
        from tierckpt.facade.verify import CopyCheck

        found: dict[int, set[int]] = {}
        for _, c in self.checks:
            found.setdefault(c.step, set()).add(c.rank)
        out: list[tuple[int | None, CopyCheck]] = []
        for step, named in sorted(self.named.items()):
            lost = sorted(r for r in named - found.get(step, set()) if only is None or r == only)
            if not lost or self._evicted(step):
                continue
            dirs = ", ".join(self.looked[:4]) + (f" and {len(self.looked) - 4} more" if len(self.looked) > 4 else "")
            for r in lost:
                msg = (
                    f"step {step} on tier {self.tier!r}: rank {r}'s copy, which the step's record names, is in "
                    f"none of the tier's directories ({dirs})"
                )
                out.append((None, CopyCheck(step, self.tier, r, TierIOError(errno.ENOENT, msg))))
        return out

    def _evicted(self, step: int) -> bool:
        """Whether a directory that held ``step``'s record holds it no more (its copies go next)."""
        for rank, node in self.recorded[step]:
            with self.open(rank, node) as h:
                if _record_size(h.tiers[0], step) is None:
                    return True
        return False


def _records(tier: Tier, step: int | None) -> list[int]:
    """The steps whose record ``tier`` holds (``step`` only, if given; none where it keeps none)."""
    try:
        steps = tier.list_records()
    except (OSError, NotImplementedError):
        return []
    return [s for s in steps if step is None or s == step]


def _record_size(tier: Tier, step: int) -> int | None:
    """The number of ranks ``step``'s record on ``tier`` names (None: no record, or one that cannot be
    read: verifying the copies reports that)."""
    from tierckpt.format.record import decode_record

    try:
        data = tier.read_record(step)
        return None if data is None else decode_record(data, step).world_size
    except (OSError, TierckptError, NotImplementedError):
        return None


_PROBE_RANKS = (98765, 98764)  # rank and node indices no real job uses: where a path differs between two of
_PROBE_NODES = (97531, 97530)  # them, it holds {rank} (or {node}), and their digits show where


def _directories(t: TierConfig, rank: int) -> list[tuple[int, int | None, str]]:
    """The (rank, node) to open tier entry ``t`` as, and the directory, once for each directory of it
    that exists: each rank's and node's where its path holds ``{rank}`` or ``{node}`` (node None where it
    holds no ``{node}``); else once, as ``rank``.

    Raises:
        ConfigError: the path holds ``{rank}`` or ``{node}`` in a form that is not decimal digits (its
            directories cannot be found).
    """
    import glob
    import re
    from dataclasses import replace

    from tierckpt.configvalues import MAX_NODE
    from tierckpt.errors import ConfigError
    from tierckpt.ranks.coordinator import MAX_RANK
    from tierckpt.tiers.options import local_directory

    def at(r: int, n: int | None) -> str:
        return str(local_directory(replace(t, rank=r, node=n)))

    try:
        probe = at(_PROBE_RANKS[0], _PROBE_NODES[0])
        by_rank = probe != at(_PROBE_RANKS[1], _PROBE_NODES[0])
        by_node = probe != at(_PROBE_RANKS[0], _PROBE_NODES[1])
    except TierckptError:  # not a directory (a URL, no path): the kind's own
        return [(rank, None, t.location or t.name)]
    if not by_rank and not by_node:
        return [(rank, None, at(rank, None))]
    digits = {str(_PROBE_RANKS[0]): "rank", str(_PROBE_NODES[0]): "node"}
    parts = re.split("(" + "|".join(digits) + ")", probe)
    names = [digits[p] for p in parts[1::2]]
    if ("rank" in names) != by_rank or ("node" in names) != by_node:
        raise ConfigError(f"{t.key}.path: cannot find its directories: {{rank}} and {{node}} must be decimal")
    pattern = re.compile("".join("([0-9]+)" if i % 2 else re.escape(p) for i, p in enumerate(parts)))
    out = set()
    for path in glob.glob("".join("*" if i % 2 else glob.escape(p) for i, p in enumerate(parts))):
        m = pattern.fullmatch(path)
        if m is None:
            continue
        got = {name: {int(g) for n, g in zip(names, m.groups()) if n == name} for name in ("rank", "node")}
        if len(got["rank"]) > 1 or len(got["node"]) > 1:
            continue
        r, n = min(got["rank"], default=rank), min(got["node"], default=None)
        if r < MAX_RANK and (n is None or n < MAX_NODE) and os.path.isdir(path) and at(r, n) == path:
            out.add((r, n, path))
    return sorted(out, key=lambda rnp: (rnp[0], -1 if rnp[1] is None else rnp[1]))


def _shown(name: str, value: object) -> str:
    from tierckpt.configvalues import format_size

    if value is None or value == "":
        return "-"
    if isinstance(value, bool):
        return "yes" if value else "no"
    if isinstance(value, int) and name.endswith("_bytes") and value >= 1024:
        return f"{value} ({format_size(value)})"
    return str(value)


def _cmd_probe(args: argparse.Namespace) -> int:
    from tierckpt.tiers.probe import probe_report

    if not os.path.isdir(args.path):
        print(f"tierckpt: {args.path}: no such directory", file=sys.stderr)
        return 2
    report = probe_report(args.path, kind=args.kind, write=not args.no_write)
    if args.json:
        print(json.dumps(report))
        return 0
    facts, sources, details, geometry = (report[k] for k in ("facts", "sources", "details", "geometry"))
    assert isinstance(facts, dict) and isinstance(sources, dict) and isinstance(details, dict)
    assert isinstance(geometry, dict)
    print(
        f"{report['path']}: {facts['family']} ({facts['fs_type'] or 'type unknown'}) at {facts['mount_point'] or '?'}"
    )
    print("facts, and where each came from:")
    for name, value in facts.items():
        source = sources.get("dio_align" if name.startswith("dio_") else name, "")
        print(f"  {name:<24} {_shown(name, value):<22} {source}")
    for name, value in details.items():
        print(f"  {name:<24} {value}")
    print(f"geometry of a {report['kind']} tier here (kind from {report['kind_from']}; default io settings):")
    for name, value in geometry.items():
        print(f"  {name:<24} {_shown(name, value)}")
    return 0


def _cmd_rm(args: argparse.Namespace) -> int:
    """Delete ``--step`` from every directory of every tier of the config that holds it committed (each
    opened alone, with a job identity of its own: a job holding a tier's lease refuses it)."""
    import secrets
    from dataclasses import replace

    from tierckpt.config import PolicyConfig, load_config
    from tierckpt.hierarchy import Hierarchy
    from tierckpt.ranks.coordinator import SoloCoordinator

    cfg = load_config(args.config)
    job = f"tierckpt-rm-{os.getpid()}-{secrets.token_hex(4)}"
    done: list[dict[str, str]] = []
    seen: set[int] = set()
    for t in cfg.tiers:
        for _, _, where in _directories(t, 0) if t.location is not None else ():  # memory tiers: nothing here
            one = replace(cfg, tiers=(replace(t, location=where),), policy=PolicyConfig())
            with Hierarchy.from_config(one, readonly=True, coordinator=SoloCoordinator(0, 1)) as h:  # only look
                steps = {i.step for i in h.checkpoints() if i.tiers}
            seen |= steps
            if args.step in steps:
                with Hierarchy.from_config(one, job=job, coordinator=SoloCoordinator(0, 1)) as h:
                    h.delete(args.step)
                done.append({"tier": t.name, "location": where})
    if not done:
        missing = f"step {args.step} is not committed on any tier (committed steps: {sorted(seen)})"
        if not args.json:
            raise CheckpointNotFoundError(missing)
        print(json.dumps({"step": args.step, "deleted": [], "error": missing}))
        return 1
    if args.json:
        print(json.dumps({"step": args.step, "deleted": done, "error": None}))
    else:
        print(f"step {args.step} deleted from " + ", ".join(f"{d['tier']} ({d['location']})" for d in done))
    return 0


def _cmd_bench(args: argparse.Namespace) -> int:
    from tierckpt.bench.runner import run

    return run(args)


def _add_export(sub: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    from tierckpt.interop.command import add_arguments, run

    helptext = "write a step as full tensors: safetensors or torch.save files (see docs/integrations.md)"
    sp = sub.add_parser("export", help=helptext, description=helptext)
    add_arguments(sp)
    sp.set_defaults(func=run)


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
    helptext = "delete a step from every tier (refused while a job holds the tiers' leases)"
    sp = sub.add_parser("rm", help=helptext, description=helptext + " (see docs/policies.md, 'Deleting a step')")
    sp.add_argument("config", help="hierarchy YAML file")
    sp.add_argument("--step", type=int, required=True, help="the step to delete")
    sp.add_argument("--json", action="store_true", help="machine-readable output")
    sp.set_defaults(func=_cmd_rm)
    helptext = "show what tierckpt detects of a directory's file system and the I/O sizes a tier there would use"
    sp = sub.add_parser("probe", help=helptext, description=helptext + " (see docs/tiers.md)")
    sp.add_argument("path", help="a directory")
    sp.add_argument(
        "--kind", choices=("pfs", "local"), default=None, help="the tier kind (default: pfs on a shared file system)"
    )
    sp.add_argument(
        "--no-write", action="store_true",
        help="write nothing (by default a probe file is created and removed, to learn whether O_DIRECT works)",
    )  # fmt: skip
    sp.add_argument("--json", action="store_true", help="machine-readable output")
    sp.set_defaults(func=_cmd_probe)
    _add_export(sub)
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
        return 1 if args.command in ("verify", "rm") else 2
    except TierckptError as e:
        print(f"tierckpt: {e}", file=sys.stderr)
        return 2


if __name__ == "__main__":  # pragma: no cover
    sys.exit(main())
