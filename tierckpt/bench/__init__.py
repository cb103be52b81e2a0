"""Benchmark suite: tierckpt against its peers on deterministic workloads (``tierckpt bench``).

Modules: ``workloads`` (the states), ``peers``/``peers_ext`` (the implementations compared), ``system``
(cold page cache, residency, RSS/CPU, machine description), ``rawio`` (raw O_DIRECT and fio limits),
``metrics`` (samples, JSON lines), ``compare`` (the side-by-side harness), ``prefetch`` (restart with
prefetch), ``sweep`` (``io:`` tuning), ``report`` (markdown), ``plots`` (PNGs), ``runner`` (options).
Nothing here is imported by ``import tierckpt``; optional peers import their packages lazily.
"""

__all__ = ["main"]


def main(argv: list[str] | None = None) -> int:
    """Run ``tierckpt bench`` with ``argv`` (default: the command line)."""
    from tierckpt.bench.runner import main as _main

    return _main(argv)
