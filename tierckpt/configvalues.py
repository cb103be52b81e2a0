"""Checks of single configuration values shared by :mod:`tierckpt.config` and the tier kinds: sizes,
bounded reprs for error messages, and paths with ``~`` and ``$VAR`` expanded as a shell would."""

from __future__ import annotations

import logging
import os
import re
import reprlib
from collections.abc import Mapping
from collections.abc import Set as AbstractSet
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from tierckpt.errors import ConfigError

__all__ = [
    "LAUNCHERS",
    "NODE_ENV_VARS",
    "Launch",
    "check_bool",
    "check_choice",
    "check_int",
    "check_keys",
    "check_node",
    "check_timeout",
    "expand_path",
    "expand_placeholders",
    "format_size",
    "launched",
    "launched_rank",
    "no_nul",
    "node_identity",
    "parse_rate",
    "parse_size",
    "process_rank",
    "resolve_path",
    "short",
]

log = logging.getLogger("tierckpt.coordination")
_ENV_RE = re.compile(r"\$(\w+|\{[^}]*\})", re.ASCII)  # what os.path.expandvars replaces
_UNITS = {
    "": 1, "b": 1,
    "k": 1 << 10, "kib": 1 << 10, "kb": 1000,
    "m": 1 << 20, "mib": 1 << 20, "mb": 1000**2,
    "g": 1 << 30, "gib": 1 << 30, "gb": 1000**3,
    "t": 1 << 40, "tib": 1 << 40, "tb": 1000**4,
}  # fmt: skip
_MAX_SIZE = (1 << 63) - 1
# ASCII only: \d and \s would also take Unicode digits (and int() would read them)
_SIZE_RE = re.compile(r"\s*([0-9]+)(?:\.([0-9]+))?\s*([A-Za-z]*)\s*", re.ASCII)


class _Repr(reprlib.Repr):
    def repr_int(self, x: int, level: int) -> str:
        # repr() refuses an int of over 4300 digits (and 0x<5000 hex digits> is valid YAML)
        return super().repr_int(x, level) if x.bit_length() <= 128 else f"<an integer of {x.bit_length()} bits>"


_REPR = _Repr()
_REPR.maxlevel, _REPR.maxstring, _REPR.maxlong, _REPR.maxother = 3, 40, 40, 40


def short(value: Any) -> str:
    """``repr(value)`` for an error message, bounded: YAML aliases make a 200-byte file hold a list
    whose full repr is gigabytes, and a bad size may be 5000 digits long."""
    return _REPR.repr(value)


def parse_size(value: Any, key: str) -> int:
    """Parse ``64GiB``, ``100 MB``, ``4096`` or an int into bytes.

    A fraction (``1.5GiB``) must come to a whole number of bytes; the arithmetic is exact.

    Raises:
        ConfigError: naming ``key`` when the value is not a size from 0 to 2**63 - 1 bytes.
    """
    if isinstance(value, bool):
        raise ConfigError(f"{key}: expected a size like '64GiB', got {short(value)}")
    if isinstance(value, int):
        if value < 0:
            raise ConfigError(f"{key}: expected a non-negative size, got {short(value)}")
        if value > _MAX_SIZE:
            raise ConfigError(f"{key}: expected a size below 8EiB (2**63 bytes), got {short(value)}")
        return value
    m = _SIZE_RE.fullmatch(value) if isinstance(value, str) else None
    if m is None or m.group(3).lower() not in _UNITS:
        raise ConfigError(f"{key}: expected a size like '64GiB', got {short(value)}")
    whole, frac = m.group(1).lstrip("0"), (m.group(2) or "").rstrip("0")
    # Bound the digits before int() (which refuses over 4300): 20 whole digits exceed 2**63, and a
    # fraction of more than 40 digits (2**-40 has 40) never makes whole bytes with any unit.
    if len(whole) > 19:
        raise ConfigError(f"{key}: expected a size below 8EiB (2**63 bytes), got {short(value)}")
    n, rest = 0, 1
    if len(frac) <= 40:
        n, rest = divmod(int(whole + frac or "0") * _UNITS[m.group(3).lower()], 10 ** len(frac))
    if rest:
        raise ConfigError(f"{key}: expected a whole number of bytes, got {short(value)}")
    if n > _MAX_SIZE:
        raise ConfigError(f"{key}: expected a size below 8EiB (2**63 bytes), got {short(value)}")
    return n


_RATE_RE = re.compile(r"(.*?)\s*/\s*s\s*", re.ASCII | re.IGNORECASE)


def parse_rate(value: Any, key: str) -> int:
    """Parse a rate, ``300MB/s``, ``1.5GiB/s``, ``500 KB/s`` (a size as :func:`parse_size` reads it, then
    ``/s``) or an int of bytes per second, into bytes per second.

    Raises:
        ConfigError: naming ``key`` when the value is not a rate (a size without ``/s`` is not one).
    """
    if isinstance(value, int) and not isinstance(value, bool):
        return parse_size(value, key)
    m = _RATE_RE.fullmatch(value) if isinstance(value, str) else None
    if m is None or not m.group(1).strip():
        raise ConfigError(f"{key}: expected a rate like '300MB/s', got {short(value)}")
    try:
        return parse_size(m.group(1), key)
    except ConfigError:
        raise ConfigError(f"{key}: expected a rate like '300MB/s', got {short(value)}") from None


def format_size(n: int) -> str:
    """Format bytes the way :func:`parse_size` reads them back (``1.5GiB``)."""
    for unit, mult in (("TiB", 1 << 40), ("GiB", 1 << 30), ("MiB", 1 << 20), ("KiB", 1 << 10)):
        if n >= mult:
            return f"{n / mult:.3g}{unit}"
    return f"{n}B"


def no_nul(value: str, key: str) -> None:
    """No path of the operating system holds a NUL byte (``open`` would raise a bare ValueError).

    Raises:
        ConfigError: naming ``key`` when ``value`` holds one.
    """
    if "\0" in value:
        raise ConfigError(f"{key}: a path cannot contain a NUL byte, got {short(value)}")


def expand_path(value: str, key: str) -> Path:
    """Expand a leading ``~`` / ``~user``, then ``$VAR`` and ``${VAR}``, as a shell would.

    Raises:
        ConfigError: naming ``key`` and the variable when one is not set or is empty (``$SCRATCH/ckpt``
            would otherwise name a directory ``$SCRATCH``, or ``/ckpt``), or a NUL byte.
    """
    no_nul(value, key)
    head, sep, tail = value.partition("/") if value.startswith("~") else ("", "", value)

    def var(m: re.Match[str]) -> str:
        got = os.environ.get(m.group(1)[1:-1] if m.group(1).startswith("{") else m.group(1))
        if not got:
            raise ConfigError(f"{key}: {m.group(0)} is {'empty' if got == '' else 'not set'}")
        return got

    return Path(os.path.expanduser(head) + sep + _ENV_RE.sub(var, tail))


def resolve_path(value: str, key: str, base_dir: str | os.PathLike[str]) -> Path:
    """:func:`expand_path`, then relative to ``base_dir`` (the YAML file's folder), made absolute.

    Raises:
        ConfigError: as :func:`expand_path`.
    """
    p = expand_path(value, key)
    return p if p.is_absolute() else (Path(base_dir) / p).resolve()


def check_keys(
    d: Any, key: str, allowed: AbstractSet[str], required: AbstractSet[str] = frozenset()
) -> Mapping[str, Any]:
    """``d`` as a mapping whose keys are all in ``allowed`` and include ``required``.

    Raises:
        ConfigError: ``d`` is no mapping, or has an unknown key or lacks a required one, naming it.
    """
    if not isinstance(d, Mapping):
        raise ConfigError(f"{key}: expected a mapping, got {type(d).__name__} {short(d)}")
    for k in d:
        if k not in allowed:
            raise ConfigError(f"{key}.{k}: unknown key (allowed: {', '.join(sorted(allowed))})")
    for k in required:
        if k not in d:
            raise ConfigError(f"{key}.{k}: required key is missing")
    return d


def check_int(v: Any, key: str, lo: int, hi: int) -> int:
    """``v``, an integer (not a bool) in ``[lo, hi]``; else :class:`ConfigError` naming ``key``."""
    if isinstance(v, bool) or not isinstance(v, int) or not lo <= v <= hi:
        raise ConfigError(f"{key}: expected an integer in [{lo}, {hi}], got {short(v)}")
    return v


def check_choice(v: Any, key: str, choices: tuple[str, ...]) -> str:
    """``v``, one of ``choices``; else :class:`ConfigError` naming ``key`` and the choices."""
    if v not in choices:
        raise ConfigError(f"{key}: expected one of {', '.join(choices)}, got {short(v)}")
    choice: str = v  # one of the str choices (checked above)
    return choice


def check_bool(v: Any, key: str) -> bool:
    """``v``, a bool; else :class:`ConfigError` naming ``key``."""
    if not isinstance(v, bool):
        raise ConfigError(f"{key}: expected true or false, got {short(v)}")
    return v


def check_timeout(value: Any, key: str) -> float:
    """A timeout: a positive number of seconds, at most a day.

    Raises:
        ConfigError: naming ``key``.
    """
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not 0 < value <= 86400:
        raise ConfigError(f"{key}: expected a number of seconds in (0, 86400], got {short(value)}")
    return float(value)


# -- a rank's node, and the {rank} / {node} placeholders of tier paths ----------------------------------------
#: where a rank's node index comes from, in this order (docs/config.md, "distributed")
NODE_ENV_VARS = ("TIERCKPT_NODE", "GROUP_RANK", "SLURM_NODEID")
MAX_NODE = 10**5
_PLACEHOLDERS = ("rank", "node")
_FIELD_RE = re.compile(r"\{\{|\}\}|\$\{[^}]*\}|\{([^{}]*)\}|[{}]")


def _env_int(var: str, lo: int) -> int | None:
    raw = os.environ.get(var)
    if raw is None or raw == "":
        return None
    if not re.fullmatch(r"\s*[0-9]{1,9}\s*", raw, re.ASCII) or int(raw) < lo:
        raise ConfigError(f"${var}: expected an integer of at least {lo}, got {short(raw)}")
    return int(raw)


def check_node(node: Any, key: str) -> int:
    """A node index: an int in ``[0, MAX_NODE)``.

    Raises:
        ConfigError: naming ``key``.
    """
    if isinstance(node, bool) or not isinstance(node, int) or not 0 <= node < MAX_NODE:
        raise ConfigError(f"{key}: expected a node index, an integer in [0, {MAX_NODE - 1}], got {short(node)}")
    return node


def node_identity(rank: int, node: int | None = None) -> tuple[int, int]:
    """This rank's ``(node, local_rank)``.

    The node is ``node`` when given, else the first of :data:`NODE_ENV_VARS` that is set (``$TIERCKPT_NODE``
    to override; torchrun's ``$GROUP_RANK``; SLURM's ``$SLURM_NODEID``), else ``rank // $LOCAL_WORLD_SIZE``,
    else 0. The local rank is ``$LOCAL_RANK`` (or ``$SLURM_LOCALID``), else ``rank % $LOCAL_WORLD_SIZE``,
    else ``rank`` (every rank on one node).

    Raises:
        ConfigError: naming the variable (or ``node``) whose value is not a non-negative integer.
    """
    lws = _env_int("LOCAL_WORLD_SIZE", 1)
    if node is None:
        for var in NODE_ENV_VARS:
            node = _env_int(var, 0)
            if node is not None:
                check_node(node, f"${var}")
                break
    if node is None:
        node = rank // lws if lws else 0
    node = check_node(node, "node")
    local = _env_int("LOCAL_RANK", 0)
    local = _env_int("SLURM_LOCALID", 0) if local is None else local
    return node, (rank % lws if lws else rank) if local is None else local


#: the variables in which a launcher says how many processes it started for the job, and which one this
#: process is: torchrun's (and torch.distributed's env:// convention), Open MPI's mpirun, MPICH's and
#: Intel MPI's hydra (PMI), MVAPICH's mpirun_rsh, LSF's jsrun, SLURM's srun. An inner launcher comes
#: first: torchrun started by srun says the job's size and rank, srun only its agents'. Not
#: ``$SLURM_NTASKS``: a batch script of a job that asked for several tasks has it too, and is one process.
LAUNCHERS = (
    ("WORLD_SIZE", "RANK"),
    ("OMPI_COMM_WORLD_SIZE", "OMPI_COMM_WORLD_RANK"),
    ("PMI_SIZE", "PMI_RANK"),
    ("MV2_COMM_WORLD_SIZE", "MV2_COMM_WORLD_RANK"),
    ("JSM_NAMESPACE_SIZE", "JSM_NAMESPACE_RANK"),
    ("SLURM_STEP_NUM_TASKS", "SLURM_PROCID"),
)


@dataclass(frozen=True)
class Launch:
    """What a launcher says of this process (:func:`launched`).

    Attributes:
        size_var: the variable that says how many processes the launcher started (``WORLD_SIZE``).
        size: its value.
        rank_var: the same launcher's variable for this process's rank (``RANK``).
        rank: its value; None where it is not set or not an integer.
    """

    size_var: str
    size: int
    rank_var: str
    rank: int | None


def _launch_int(var: str, lo: int) -> int | None:
    """``$var`` as an int of at least ``lo``; None where it is not set, or (with a warning) malformed."""
    raw = os.environ.get(var)
    if raw is None or raw == "":
        return None
    if not re.fullmatch(r"\s*[0-9]{1,9}\s*", raw, re.ASCII) or int(raw) < lo:
        log.warning("$%s is %s, not an integer of at least %d: ignored", var, short(raw), lo)
        return None
    return int(raw)


def launched() -> Launch | None:
    """What the launchers of :data:`LAUNCHERS` say of this process: the first that says it started several
    processes, else the first that says one, else None (no launcher says).

    Any launcher saying several means several: a ``$WORLD_SIZE=1`` left in the environment of an
    ``srun`` step of 2 tasks is not a job of one process, and taking it for one would make both
    processes save as rank 0 of 1 (one's checkpoints lost), while a process that saves alone and is
    refused says so with ``world_size=1`` (docs/distributed.md, "Coordination"). A malformed variable
    is logged and ignored: it does not stop a process that is alone.
    """
    one = None
    for size_var, rank_var in LAUNCHERS:
        size = _launch_int(size_var, 1)
        if size is None:
            continue
        got = Launch(size_var, size, rank_var, _launch_int(rank_var, 0) if size > 1 else 0)
        if size > 1:
            return got
        one = one or got
    return one


def launched_rank(launch: Launch) -> int:
    """This process's rank among the ranks of ``launch`` (a read-only hierarchy's, with no process group).

    Raises:
        ConfigError: the launcher does not say it, or says one outside its ranks.
    """
    var, n, rank = launch.size_var, launch.size, launch.rank
    if rank is None or rank >= n:
        said = "is not set or not an integer" if rank is None else f"is {rank}, not in [0, {n})"
        raise ConfigError(
            f"${var} is {n}: this process is one of the {n} ranks of a job, but ${launch.rank_var} {said}, so a "
            "read-only hierarchy cannot tell which rank's part to read (torch.distributed is not initialized); "
            f"set ${launch.rank_var}, pass rank= and world_size=, or coordinator=SoloCoordinator(rank, world_size)"
        )
    return rank


def process_rank() -> int:
    """This process's rank where no coordinator says: torch.distributed's when a process group is
    initialized, else ``$RANK``, else 0.

    Raises:
        ConfigError: ``$RANK`` is not a non-negative integer.
    """
    try:
        import torch.distributed as dist

        if dist.is_available() and dist.is_initialized():
            return int(dist.get_rank())
    except Exception:  # pragma: no cover - a broken torch.distributed is not a process group
        pass
    return _env_int("RANK", 0) or 0


def expand_placeholders(value: str, key: str, rank: int | None = None, node: int | None = None) -> str:
    """Replace ``{rank}`` and ``{node}`` in a tier's location (``{{`` and ``}}`` are literal braces;
    ``${VAR}`` is left for :func:`expand_path`). Format specs work as in Python: ``{rank:05d}``.

    Args:
        value: the location as written.
        key: where it came from, for errors (``tiers[1].path``).
        rank: the rank (None: :func:`process_rank`, asked only when ``{rank}`` is used).
        node: the node (None: :func:`node_identity`'s, asked only when ``{node}`` is used).

    Raises:
        ConfigError: naming ``key``: an unknown ``{name}``, a stray brace, or a bad format spec.
    """

    def field(m: re.Match[str]) -> str:
        tok, inner = m.group(0), m.group(1)
        if tok in ("{{", "}}"):
            return tok[0]
        if tok.startswith("$"):
            return tok
        if inner is None:
            raise ConfigError(f"{key}: a lone {tok!r} in {short(value)} (write {tok * 2} for a literal brace)")
        name, _, spec = inner.partition(":")
        if name not in _PLACEHOLDERS:
            raise ConfigError(
                f"{key}: unknown placeholder {{{name}}} in {short(value)} (known: {{rank}}, {{node}}; "
                "write {{ and }} for literal braces)"
            )
        got = values.get(name)
        if got is None:
            r = values["rank"] if values["rank"] is not None else process_rank()
            got = values[name] = r if name == "rank" else node_identity(r)[0]
        try:
            return format(got, spec)
        except ValueError as e:
            raise ConfigError(f"{key}: bad format {{{inner}}} in {short(value)}: {e}") from None

    values: dict[str, int | None] = {"rank": rank, "node": node}
    return _FIELD_RE.sub(field, value)
