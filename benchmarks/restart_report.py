"""The tables of ``bench_restart.py``: medians per condition and operation, ratios, targets, profile."""

from __future__ import annotations

import statistics
from collections import defaultdict
from typing import Any

GB = 1e9
_ROWS = {
    "raw": "raw O_DIRECT read (fresh memory)",
    "tierckpt": "tierckpt `restore()` (fresh tensors)",
    "tierckpt-into": "tierckpt `restore(into=)` (built target)",
    "torch": "`torch.load`",
    "torch-mmap": "`torch.load(mmap=True)` + copy into new tensors",
    "dcp": "`dcp.load` (built target)",
}


def _med(xs: list[float]) -> float:
    return statistics.median(xs) if xs else float("nan")


def summarize(records: list[dict[str, Any]]) -> dict[tuple[str, str], dict[str, float]]:
    """{(condition, op): medians of secs, GB/s, op CPU-s/GB, process CPU-s/GB, faults}."""
    by: dict[tuple[str, str], list[dict[str, Any]]] = defaultdict(list)
    for r in records:
        if r["kind"] == "sample":
            by[r["cond"], r["op"]].append(r)
    out = {}
    for key, rs in by.items():
        gb = rs[0]["nbytes"] / GB
        secs = _med([r["secs"] for r in rs])
        out[key] = {
            "n": len(rs), "secs": secs, "gbps": gb / secs, "cpu_per_gb": _med([r["cpu"] / gb for r in rs]),
            "proc_cpu_per_gb": _med([r["proc_cpu"] / gb for r in rs]), "minflt": _med([r["minflt"] for r in rs]),
            "majflt": _med([r["majflt"] for r in rs]), "proc_wall": _med([r["proc_wall"] for r in rs]),
            "target_secs": _med([r["target_secs"] for r in rs if "target_secs" in r]),
        }  # fmt: skip
    return out


def _restore_table(s: dict[tuple[str, str], dict[str, float]], cond: str) -> list[str]:
    raw, tl = s.get((cond, "raw")), s.get((cond, "torch"))
    lines = [
        "| operation | n | median s | GB/s | % of raw | × torch.load | CPU-s/GB (op) | CPU-s/GB (process) | minor faults "
        "| target built in s (untimed) | process s |",
        "| --- | --- | --- | --- | --- | --- | --- | --- | --- | --- | --- |",
    ]
    for op, label in _ROWS.items():
        r = s.get((cond, op))
        if r is None:
            continue
        pct = f"{100 * raw['secs'] / r['secs']:.0f} %" if raw else "-"
        x = f"{tl['secs'] / r['secs']:.2f}" if tl else "-"
        lines.append(
            f"| {label} | {r['n']} | {r['secs']:.3f} | {r['gbps']:.2f} | {pct} | {x} | {r['cpu_per_gb']:.2f} | "
            f"{r['proc_cpu_per_gb']:.2f} | {r['minflt']:.0f} | {_opt(r['target_secs'])} | {r['proc_wall']:.2f} |"
        )
    return lines


def _opt(x: float) -> str:
    return "-" if x != x else f"{x:.2f}"  # NaN: no target


def _targets(s: dict[tuple[str, str], dict[str, float]], cond: str) -> list[str]:
    t, raw, tl = s.get((cond, "tierckpt")), s.get((cond, "raw")), s.get((cond, "torch"))
    if not (t and raw and tl):
        return []
    checks = [
        ("restore() ≥ 90 % of raw", raw["secs"] / t["secs"] >= 0.9, f"{100 * raw['secs'] / t['secs']:.0f} %"),
        ("restore() ≥ 1.3× torch.load", tl["secs"] / t["secs"] >= 1.3, f"{tl['secs'] / t['secs']:.2f}×"),
        ("CPU-s/GB ≤ torch.load's", t["cpu_per_gb"] <= tl["cpu_per_gb"],
         f"{t['cpu_per_gb']:.2f} vs {tl['cpu_per_gb']:.2f}"),
    ]  # fmt: skip
    mm = s.get((cond, "torch-mmap"))
    if mm:
        ratio = mm["secs"] / t["secs"]
        checks.append(("restore() ≥ 1.2× torch.load(mmap=True) + copy", ratio >= 1.2, f"{ratio:.2f}×"))
    return [f"* {name}: {'met' if ok else 'MISSED'} ({got})" for name, ok, got in checks]


def _e2e_table(records: list[dict[str, Any]], cond: str) -> list[str]:
    by: dict[str, list[dict[str, Any]]] = defaultdict(list)
    for r in records:
        if r["kind"] == "e2e" and r["cond"] == cond:
            by[r["how"]].append(r)
    if not by:
        return []
    lines = [
        "| restart | n | total s | start → imports s | build model+optim s | restore s | first step s | restore CPU-s | loss as uninterrupted |",
        "| --- | --- | --- | --- | --- | --- | --- | --- | --- |",
    ]
    for how, rs in by.items():

        def ph(a: str, b: str, rs: list[dict[str, Any]] = rs) -> float:
            return _med(
                [
                    (r["marks"][b] if b != "spawn" else r["t_spawn"])
                    - (r["marks"][a] if a != "spawn" else r["t_spawn"])
                    for r in rs
                ]
            )

        total = _med([r["marks"]["stepped"] - r["t_spawn"] for r in rs])
        ok = "yes" if all(r["loss_ok"] for r in rs) else "NO"
        lines.append(
            f"| {how} | {len(rs)} | {total:.2f} | {_med([r['marks']['imported'] - r['t_spawn'] for r in rs]):.2f} | "
            f"{ph('imported', 'built'):.2f} | {ph('built', 'restored'):.2f} | {ph('restored', 'stepped'):.2f} | "
            f"{_med([r['restore_cpu'] for r in rs]):.2f} | {ok} |"
        )
    return lines


def _profile(records: list[dict[str, Any]], cond: str) -> list[str]:
    rs = [r for r in records if r["kind"] == "profile" and r["cond"] == cond]
    if not rs:
        return []
    phases = sorted({p for r in rs for p in r["profile"]})
    lines = ["| phase | wall s | thread CPU s |", "| --- | --- | --- |"]
    for p in phases:
        w = _med([r["profile"].get(p, {}).get("wall", 0.0) for r in rs])
        c = _med([r["profile"].get(p, {}).get("cpu", 0.0) for r in rs])
        lines.append(f"| {p} | {w:.3f} | {c:.3f} |")
    tot = _med([r["secs"] for r in rs]), _med([r["cpu"] for r in rs]), _med([r["minflt"] for r in rs])
    lines.append(f"| (whole restore, all threads) | {tot[0]:.3f} | {tot[1]:.3f} (minor faults {tot[2]:.0f}) |")
    return lines


def report(records: list[dict[str, Any]], cold_methods: set[str]) -> str:
    """The markdown summary of a run."""
    s = summarize(records)
    setup = next(r for r in records if r["kind"] == "setup")
    lines = [
        f"# Restart benchmark ({setup['size']}: {setup['state_bytes'] / GB:.3f} GB in {setup['tensors']} tensors, "
        f"{setup['blob_files']} blob files of {setup['blob_bytes'] / GB:.3f} GB)",
        "",
        f"Cold page cache before every process via {', '.join(sorted(cold_methods))}; every restore in a new process.",
    ]
    e2e = next((r for r in records if r["kind"] == "setup_e2e"), None)
    for cond in ("quiet", "busy"):
        if not any(k[0] == cond for k in s):
            continue
        what = "quiet machine" if cond == "quiet" else "one core kept busy by a pinned spinning neighbour"
        lines += ["", f"## {cond}: {what}", "", *_restore_table(s, cond), "", *_targets(s, cond)]
        fio = [r["gbps"] for r in records if r["kind"] == "fio" and r["cond"] == cond and r["gbps"]]
        if fio:
            lines += [f"* fio (16 MiB O_DIRECT reads, QD 16, io_uring): median {_med(fio):.2f} GB/s"]
        prof = _profile(records, cond)
        if prof:
            lines += ["", "Profile of tierckpt `restore()` (medians of the profiled runs):", "", *prof]
        e = _e2e_table(records, cond)
        if e and e2e:
            lines += ["", f"End-to-end restart ({e2e['params'] / 1e6:.0f} M parameters, AdamW, "
                      f"{e2e['state_bytes'] / GB:.2f} GB of state):", "", *e]  # fmt: skip
    return "\n".join(lines) + "\n"
