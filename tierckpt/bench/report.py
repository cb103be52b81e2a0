"""Markdown for people: the comparison tables, the memory table, the issue's targets and the notes."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from tierckpt.bench.metrics import MB, Recorder
from tierckpt.bench.peers import Peer
from tierckpt.bench.workloads import Workload

__all__ = ["comparison", "machine_line", "targets"]

LIMITS = ("raw:", "fio", "memcpy")
OURS = ("tierckpt",)
# Targets of issue #4 (medians, same run).
T_SAVE_LLM, T_SAVE_SMALL, T_RESTORE, T_HOST, T_BLOCK = 0.90, 0.80, 0.90, 0.80, 0.4


def _f(x: float | None, spec: str = ".2f", scale: float = 1.0) -> str:
    return "-" if x is None else format(x * scale, spec)


def _pct(x: float | None) -> str:
    return "-" if x is None else f"{100 * x:.0f} %"


def machine_line(info: dict[str, Any]) -> str:
    """One line describing the machine and versions."""
    return (
        f"{info.get('cpu', '?')}, {info.get('cores', '?')} cores, {info.get('mem_gib', '?')} GiB, Linux "
        f"{info.get('kernel', '?')}, {info.get('fs', '?')} on {info.get('device', '?')} ({info.get('mount_opts', '?')}, "
        f"scheduler {info.get('scheduler') or '?'}); torch {info.get('torch', '?')}, Python {info.get('python', '?')}; "
        f"tierckpt from {info.get('tierckpt_src', '?')}; load average at start {info.get('loadavg_start', '?')}"
    )


def _peer_names(rec: Recorder, wl: str) -> list[str]:
    return list(dict.fromkeys(s.peer for s in rec.samples if s.workload == wl))


def _table(rec: Recorder, wl: Workload, which: str) -> list[str]:
    g = rec.summary
    if which == "median":
        lines = [
            "| peer | save GB/s | returns s | safe to mutate s | durable s | restore cold GB/s | resident | "
            "restore warm GB/s | resident | peak extra RSS MB save / restore | CPU s save / restore |",
            "|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|",
        ]
    else:
        lines = ["| peer | save GB/s | restore cold GB/s | restore warm GB/s |", "|---|---:|---:|---:|"]
    for peer in _peer_names(rec, wl.name):
        if peer.startswith("memcpy"):
            continue
        save = g(wl.name, peer, "save", None, "gbps", which)
        cold = g(wl.name, peer, "restore", "cold", "gbps", which)
        warm = g(wl.name, peer, "restore", "warm", "gbps", which)
        if which != "median":
            lines.append(f"| {peer} | {_f(save)} | {_f(cold)} | {_f(warm)} |")
            continue
        api = g(wl.name, peer, "save", None, "api_secs", which)
        blk = g(wl.name, peer, "save", None, "blocking_secs", which)
        dur = g(wl.name, peer, "save", None, "wall_secs", which)
        rc = g(wl.name, peer, "restore", "cold", "resident", which)
        rw = g(wl.name, peer, "restore", "warm", "resident", which)
        cache = "cold" if rec.select(workload=wl.name, peer=peer, op="restore", cache="cold") else "memory"
        rss_s = g(wl.name, peer, "save", None, "peak_extra_rss_bytes", which)
        rss_r = g(wl.name, peer, "restore", cache, "peak_extra_rss_bytes", which)
        cpu_s = g(wl.name, peer, "save", None, "cpu_secs", which)
        cpu_r = g(wl.name, peer, "restore", cache, "cpu_secs", which)
        lines.append(
            f"| {peer} | {_f(save)} | {_f(api, '.3f')} | {_f(blk, '.3f')} | {_f(dur, '.3f')} | {_f(cold)} | "
            f"{_pct(rc)} | {_f(warm)} | {_pct(rw)} | {_f(rss_s, '.0f', 1 / MB)} / {_f(rss_r, '.0f', 1 / MB)} | "
            f"{_f(cpu_s)} / {_f(cpu_r)} |"
        )
    return lines


def _memory_table(rec: Recorder, wl: Workload) -> list[str]:
    g = rec.summary
    ref = g(wl.name, "memcpy", "restore", "memory", "gbps", "median")
    rows = [
        ("tierckpt restore from the host tier", g(wl.name, "tierckpt-lazy", "restore", "memory", "gbps", "median")),
        ("memcpy into new memory", ref),
        (
            "memcpy into memory faulted in before",
            g(wl.name, "memcpy-prefaulted", "restore", "memory", "gbps", "median"),
        ),
    ]
    if all(v is None for _, v in rows):
        return []
    lines = ["| from memory | GB/s (median) | vs memcpy into new memory |", "|---|---:|---:|"]
    lines += [f"| {name} | {_f(v)} | {_pct(v / ref) if v is not None and ref else '-'} |" for name, v in rows]
    return lines


def _raw(rec: Recorder, wl: str, op: str, cache: str | None) -> tuple[str, float] | None:
    cands = [
        (p, v)
        for p in _peer_names(rec, wl)
        if p.startswith("raw:") and (v := rec.summary(wl, p, op, cache, "gbps", "median")) is not None
    ]
    return max(cands, key=lambda c: c[1], default=None)


def _ahead(rec: Recorder, wl: str, op: str, cache: str | None, ours: float, field_: str = "gbps") -> str:
    peers = [p for p in _peer_names(rec, wl) if not p.startswith(LIMITS + OURS)]
    got = {p: rec.summary(wl, p, op, cache, field_, "median") for p in peers}
    vals = {p: v for p, v in got.items() if v is not None}
    if not vals:
        return "no peer ran"
    better = [f"{p} {v:.2f}" for p, v in vals.items() if v >= ours]
    return "ahead of every peer" if not better else "behind " + ", ".join(better)


def targets(rec: Recorder, workloads: Sequence[Workload]) -> list[str]:
    """Issue #4's targets that this run can check, each with the numbers and PASS/MISS."""
    names = {w.name for w in workloads}
    g = rec.summary
    out: list[str] = []

    def ok(b: bool) -> str:
        return "PASS" if b else "MISS"

    for wl, goal in (("llm", T_SAVE_LLM), ("small", T_SAVE_SMALL)):
        ours = g(wl, "tierckpt", "save", None, "gbps", "median") if wl in names else None
        raw = _raw(rec, wl, "save", None)
        if ours is not None and raw is not None:
            extra = f"; {_ahead(rec, wl, 'save', None, ours)}" if wl == "llm" else ""
            out.append(f"{wl} save {ours:.2f} GB/s = {ours / raw[1]:.0%} of raw write ({raw[0]} {raw[1]:.2f}), "
                       f"target >= {goal:.0%}: {ok(ours >= goal * raw[1])}{extra}")  # fmt: skip
    raw = _raw(rec, "llm", "restore", "cold")
    for peer, what in (("tierckpt", "into new tensors"), ("tierckpt:into", "into a live state (restore(into=))")):
        ours = g("llm", peer, "restore", "cold", "gbps", "median") if "llm" in names else None
        if ours is not None and raw is not None:
            out.append(f"llm restore from local {what} (cold) {ours:.2f} GB/s = {ours / raw[1]:.0%} of raw read "
                       f"({raw[0]} {raw[1]:.2f}), target >= {T_RESTORE:.0%}: {ok(ours >= T_RESTORE * raw[1])}; "
                       f"{_ahead(rec, 'llm', 'restore', 'cold', ours)}")  # fmt: skip
    host = g("llm", "tierckpt-lazy", "restore", "memory", "gbps", "median")
    ref = g("llm", "memcpy", "restore", "memory", "gbps", "median")
    if host is not None and ref:
        out.append(f"llm restore from the host tier {host:.2f} GB/s = {host / ref:.0%} of memcpy into new memory "
                   f"({ref:.2f}), target >= {T_HOST:.0%}: {ok(host >= T_HOST * ref)}")  # fmt: skip
    lazy = g("llm", "tierckpt-lazy", "save", None, "api_secs", "median")
    lazy_safe = g("llm", "tierckpt-lazy", "save", None, "blocking_secs", "median")
    dcps = {
        p: v
        for p in _peer_names(rec, "llm")
        if p.startswith("dcp-async") and (v := g("llm", p, "save", None, "blocking_secs", "median")) is not None
    }
    if lazy is not None and dcps:
        best = min(dcps, key=lambda p: dcps[p])
        out.append(f"llm lazy save blocks the caller {lazy:.3f} s (until `save()` returns) = {lazy / dcps[best]:.2f}x "
                   f"the best DCP async_save's blocking, {best}'s {dcps[best]:.3f} s (until its state may be "
                   f"mutated), target <= {T_BLOCK}x: {ok(lazy <= T_BLOCK * dcps[best])}. The copy into the host "
                   f"tier then runs beside the caller's work (here nobody works: safe to mutate after "
                   f"{lazy_safe or 0:.3f} s, waited at once); the training-loop benchmark measures the blocking "
                   "when forward and backward overlap it")  # fmt: skip
    return out


def comparison(
    rec: Recorder, workloads: Sequence[Workload], peers: Sequence[Peer], cold_methods: set[str]
) -> list[str]:
    """The comparison section: per workload the median and best tables and the memory table, then the
    targets and the notes on every peer that ran or was skipped."""
    lines: list[str] = []
    for wl in workloads:
        if not rec.select(workload=wl.name):
            continue
        lines += ["", f"### {wl.name}: {wl.ntensors} tensors, {wl.nbytes / 1e9:.3f} GB ({wl.describe})", "",
                  "Medians:", "", *_table(rec, wl, "median"), "", "Best (min time):", "", *_table(rec, wl, "min")]  # fmt: skip
        mem = _memory_table(rec, wl)
        if mem:
            lines += ["", *mem]
    t = targets(rec, workloads)
    if t:
        lines += ["", "### Targets (issue #4, medians of this run)", "", *[f"* {x}" for x in t]]
    ran = {s.peer for s in rec.samples}
    lines += ["", "### How each peer was run", ""]
    for p in peers:
        if p.name in ran:
            bits = [b for b in (p.how, p.durability and f"durability: {p.durability}", p.note) if b]
            lines.append(f"* `{p.name}`: {'; '.join(bits)}")
    if rec.skips:
        lines += ["", "Skipped:", ""]
        lines += [f"* `{k.peer}`{f' on {k.workload}' if k.workload else ''}: {k.why}" for k in rec.skips]
    cold = ", ".join(sorted(cold_methods)) or "-"
    lines += ["", f"Cold reads: page cache emptied with {cold} before each (see docs/benchmarks.md)."]
    if rec.notes:
        lines += ["", *[f"* {n}" for n in rec.notes]]
    return lines
