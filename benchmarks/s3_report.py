"""The markdown report of ``bench_s3.py`` from its records (medians over repeats; rates in MB/s = 10^6 B/s)."""

from __future__ import annotations

import argparse
import statistics
from collections import Counter
from typing import Any

MB, MIB = 1e6, 1 << 20
TARGET = 0.80  # the tier's demotion and restore: at least 80 % of the raw client's limit
LOADS = ("get", "tier-restore", "dcp-fsspec-load", "s3torch-load")  # extra RSS includes the destination
PATHS = (  # (op, label) of the tier and the peers, as the report names them
    ("tier-save", "tierckpt: demotion host → s3"),
    ("tier-restore", "tierckpt: restore s3 → memory (restart)"),
    ("dcp-fsspec-save", "dcp.save via fsspec + s3fs"),
    ("dcp-fsspec-load", "dcp.load via fsspec + s3fs"),
    ("s3torch-save", "s3torchconnector S3StorageWriter"),
    ("s3torch-load", "s3torchconnector S3StorageReader"),
)


class Group:
    """The samples of one (phase, op, client, part, conc) that succeeded, and their failures."""

    def __init__(self, recs: list[dict[str, Any]]) -> None:
        self.ok = [r for r in recs if r.get("ok")]
        self.failed = [r for r in recs if not r.get("ok")]
        self.nbytes = recs[0]["nbytes"]

    def rate(self) -> float | None:
        return self.nbytes / statistics.median(r["secs"] for r in self.ok) / MB if self.ok else None

    def spread(self) -> str:
        rates = sorted(self.nbytes / r["secs"] / MB for r in self.ok)
        return f"{rates[0]:.0f}–{rates[-1]:.0f}" if len(rates) > 1 else "-"

    def per_gb(self, key: str) -> str:
        xs = [r[key] for r in self.ok if r.get(key) is not None]
        return f"{statistics.median(xs) / (self.nbytes / 1e9):.2f}" if xs else "-"

    def extra_rss_mib(self, op: str) -> float | None:
        """The largest peak extra RSS of the repeats; for a load, beyond the destination's own bytes."""
        xs = [r["extra_rss"] - (self.nbytes if op in LOADS else 0) for r in self.ok]
        return max(xs) / MIB if xs else None

    def requests(self, window: str = "") -> Counter[str]:
        """The first sample's requests by operation in ``window``: the measured one (""), or a nested one
        (``save``, ``open``, ``first.save``)."""
        rec: dict[str, Any] = self.ok[0] if self.ok else {}
        for k in filter(None, window.split(".")):
            rec = rec.get(k) or {}
        return Counter(rec.get("requests", {}))


def groups(recs: list[dict[str, Any]], phase: str) -> dict[tuple[str, str, int, int], Group]:
    by: dict[tuple[str, str, int, int], list[dict[str, Any]]] = {}
    for r in recs:
        if r["kind"] == "sample" and r["phase"] == phase:
            by.setdefault((r["op"], r.get("client", ""), r.get("part", 0), r.get("conc", 0)), []).append(r)
    return {k: Group(v) for k, v in by.items()}


def _fmt(x: float | None, spec: str = ".0f") -> str:
    return "-" if x is None else format(x, spec)


def sweep_tables(recs: list[dict[str, Any]]) -> list[str]:
    g = groups(recs, "sweep")
    if not g:
        return []
    lines = ["## Sweep: raw clients, MB/s (client CPU s/GB)", ""]
    for op, title in (("put", "Multipart uploads"), ("get", "Parallel ranged GETs")):
        concs = sorted({k[3] for k in g if k[0] == op})
        rows = sorted({(k[1], k[2]) for k in g if k[0] == op})
        best = {c: max((g[k].rate() or 0, k) for k in g if k[0] == op and k[1] == c)[1] for c, _ in rows}
        lines += [f"**{title}** (part size × requests in flight; obstore `get_ranges` runs at most 10)", "",
                  "| client | part MiB | " + " | ".join(f"× {c}" for c in concs) + " |",
                  "|---|---:|" + "---:|" * len(concs)]  # fmt: skip
        for client, part in rows:
            cells = []
            for c in concs:
                k = (op, client, part, c)
                if k not in g or g[k].rate() is None:
                    cells.append("-" if k not in g else "failed")
                    continue
                cell = f"{g[k].rate():.0f} ({g[k].per_gb('cpu')})"
                cells.append(f"**{cell}**" if best[client] == k else cell)
            lines.append(f"| {client} | {part / MIB:.0f} | " + " | ".join(cells) + " |")
        lines.append("")
    return lines


def clients_table(recs: list[dict[str, Any]]) -> list[str]:
    g = groups(recs, "clients")
    if not g:
        return []
    lines = ["## Raw clients at their best settings, same run", "",
             "| direction | client | part MiB × conc | MB/s median | min–max | % of fastest | client CPU s/GB | "
             "server CPU s/GB | extra RSS MiB | part × conc MiB |",
             "|---|---|---:|---:|---:|---:|---:|---:|---:|---:|"]  # fmt: skip
    for op, label in (("put", "upload"), ("get", "download")):
        keys = [k for k in g if k[0] == op]
        top = max((g[k].rate() or 0 for k in keys), default=0)
        for k in sorted(keys, key=lambda k: -(g[k].rate() or 0)):
            grp, part, conc = g[k], k[2], k[3]
            pct = _fmt(100 * grp.rate() / top if grp.rate() and top else None)  # type: ignore[operator]
            lines.append(f"| {label} | {k[1]} | {part / MIB:.0f} × {conc} | {_fmt(grp.rate())} | {grp.spread()} | {pct} | "
                         f"{grp.per_gb('cpu')} | {grp.per_gb('server_cpu')} | {_fmt(grp.extra_rss_mib(op))} | "
                         f"{part * conc / MIB:.0f} |")  # fmt: skip
    lines += ["", "Extra RSS: the largest over the repeats of the peak RSS during the transfer minus the RSS "
              "before it; for downloads, beyond the destination's own pages.", ""]  # fmt: skip
    return lines


def raw_rate(recs: list[dict[str, Any]], op: str, client: str) -> float | None:
    rates = [grp.rate() for k, grp in groups(recs, "clients").items() if k[0] == op and k[1] == client]
    return max((r for r in rates if r is not None), default=None)


def fastest_raw(recs: list[dict[str, Any]], op: str) -> float | None:
    rates = [grp.rate() for k, grp in groups(recs, "clients").items() if k[0] == op]
    return max((r for r in rates if r is not None), default=None)


def paths_table(recs: list[dict[str, Any]], a: argparse.Namespace) -> tuple[list[str], dict[str, Group]]:
    g = {k[0]: grp for ph in ("tier", "peer") for k, grp in groups(recs, ph).items()}
    if not g:
        return [], g
    lines = [f"## The tier and the peers (raw limit: `{a.tier_client}` at its best, same run)", "",
             "| path | MB/s median | min–max | % of raw limit | % of fastest raw | client CPU s/GB | "
             "server CPU s/GB | extra RSS MiB |",
             "|---|---:|---:|---:|---:|---:|---:|---:|"]  # fmt: skip
    for op, label in PATHS:
        if op not in g:
            continue
        grp, d = g[op], "get" if op in LOADS else "put"
        limit, fastest = raw_rate(recs, d, a.tier_client), fastest_raw(recs, d)
        r = grp.rate()
        lines.append(f"| {label} | {_fmt(r)} | {grp.spread()} | {_fmt(100 * r / limit if r and limit else None)} | "
                     f"{_fmt(100 * r / fastest if r and fastest else None)} | {grp.per_gb('cpu')} | "
                     f"{grp.per_gb('server_cpu')} | {_fmt(grp.extra_rss_mib(op))} |")  # fmt: skip
    if "tier-save" in g and g["tier-save"].ok:
        saves = [r["save"]["secs"] for r in g["tier-save"].ok]
        lines += ["", f"The whole save (host copy, then the demotion): median {statistics.median(saves):.2f} s."]
    if "tier-restore" in g and g["tier-restore"].ok:
        opens = [r["open"]["secs"] for r in g["tier-restore"].ok]
        lines += [
            f"Opening the hierarchy before the restore (not in the rate): median {statistics.median(opens):.2f} s."
        ]
    return [*lines, ""], g


def targets(recs: list[dict[str, Any]], g: dict[str, Group], a: argparse.Namespace) -> list[str]:
    lines = ["## Targets (issue 29)", ""]
    for op, d, what in (("tier-save", "put", "demotion host → s3"), ("tier-restore", "get", "restore s3 → memory")):
        r, limit = (g[op].rate() if op in g else None), raw_rate(recs, d, a.tier_client)
        if r is None or limit is None:
            lines.append(f"* {what} ≥ {TARGET:.0%} of raw `{a.tier_client}`: not measured")
            continue
        verdict = "PASS" if r >= TARGET * limit else "MISS"
        lines.append(f"* {what} ≥ {TARGET:.0%} of raw `{a.tier_client}`: {verdict} ({r:.0f} of {limit:.0f} MB/s, "
                     f"{100 * r / limit:.0f} %)")  # fmt: skip
        for peer in ("dcp-fsspec", "s3torch"):
            pop = f"{peer}-{'save' if d == 'put' else 'load'}"
            pr = g[pop].rate() if pop in g else None
            if pr is not None:
                lines.append(f"  * ahead of {pop}: {'PASS' if r > pr else 'MISS'} ({r:.0f} vs {pr:.0f} MB/s)")
            else:
                why = short(g[pop].failed[0]["error"]) if pop in g and g[pop].failed else "did not run"
                lines.append(
                    f"  * ahead of {pop}: no comparison, it {why if why == 'did not run' else 'failed: ' + why}"
                )
    if "tier-save" in g and g["tier-save"].ok:
        lists = sum(n for k, n in g["tier-save"].requests("save").items() if k.startswith("ListObjects"))
        lines.append(f"* no LIST in a save after the first: {'PASS' if not lists else 'MISS'} ({lists} LIST requests)")
    return [*lines, ""]


REQUEST_COLUMNS = (  # (op, window, label) of the requests table
    ("tier-save", "first.save", "tierckpt: first save after opening"),
    ("tier-save", "save", "tierckpt: a later save (evicts the one before)"),
    ("tier-restore", "open", "tierckpt: opening for a restart"),
    ("tier-restore", "", "tierckpt: restore"),
    ("dcp-fsspec-save", "", "dcp.save, fsspec + s3fs"),
    ("dcp-fsspec-load", "", "dcp.load, fsspec + s3fs"),
    ("s3torch-save", "", "s3torchconnector save"),
    ("s3torch-load", "", "s3torchconnector load"),
)


def requests_table(g: dict[str, Group], a: argparse.Namespace) -> list[str]:
    cols = [(op, w, label) for op, w, label in REQUEST_COLUMNS if op in g and g[op].requests(w)]
    if not cols:
        return []
    ops = sorted({k for op, w, _ in cols for k in g[op].requests(w)})
    lines = [f"## Requests per checkpoint ({a.nbytes / MIB:.0f} MiB in one rank's copy; radosgw's log)", "",
             "| operation | " + " | ".join(label for *_, label in cols) + " |", "|---|" + "---:|" * len(cols)]  # fmt: skip
    for name in ops:
        lines.append(f"| {name} | " + " | ".join(str(g[op].requests(w).get(name, 0)) for op, w, _ in cols) + " |")
    return [*lines, ""]


def short(error: str) -> str:
    """An error on one line: a multi-line one (DCP's CheckpointException carries tracebacks) as its first
    line and its last."""
    lines = [ln.strip() for ln in error.splitlines() if ln.strip()]
    return lines[0] if len(lines) < 2 else f"{lines[0]} … {lines[-1]}"


def failures(recs: list[dict[str, Any]]) -> list[str]:
    seen: dict[str, str] = {}
    for r in recs:
        if r["kind"] == "sample" and not r.get("ok"):
            seen.setdefault(f"{r['op']} {r.get('client', '')}".strip(), short(r["error"]))
        elif r["kind"] == "skip":
            seen.setdefault(r["what"], r["why"])
    return ["## Did not run or failed", "", *[f"* {k}: {v}" for k, v in seen.items()], ""] if seen else []


def report(recs: list[dict[str, Any]], a: argparse.Namespace) -> str:
    m = recs[0]
    lines = [f"# S3: {a.nbytes / MIB:.0f} MiB per transfer, {a.repeats} round(s), "
             f"{m.get('server', m.get('endpoint'))}", "",
             f"{m.get('cpu')}, {m.get('cores')} cores (shared by the client and the server), {m.get('mem_gib')} GiB; "
             f"{m.get('ceph_version', '')}; load average at the start {m.get('loadavg_start')}; "
             f"state: {a.tensor_bytes / MIB:.0f} MiB float32 tensors.", ""]  # fmt: skip
    if (ms := m.get("small_get_ms")) is not None:
        lines += [f"A GET of 1 KiB took {ms:.0f} ms (median)" + (
            ": the server delays small responses (radosgw's beast without `tcp_nodelay=1`: Nagle's algorithm "
            "against the client's delayed ACKs, about 40 ms a request with a body), which every table below "
            "includes." if ms > 20 else "."), ""]  # fmt: skip
    lines += sweep_tables(recs) + clients_table(recs)
    paths, g = paths_table(recs, a)
    lines += paths + targets(recs, g, a) + requests_table(g, a) + failures(recs)
    return "\n".join(lines) + "\n"
