"""Tables, target checks and plots of ``bench_iostudy.py``'s results (its ``iostudy.json``).

``python benchmarks/iostudy_report.py /tmp/iostudy/iostudy.json`` prints the tables again and writes the PNGs.
"""

from __future__ import annotations

import json
import statistics
import sys
from pathlib import Path
from typing import Any

GB = 1e9
OURS = "tierckpt:detected"
PEERS = ("uncoalesced", "uncoalesced:direct", "datastates", "torch.save", "dcp", "torchsnapshot")


def med(case: dict[str, Any], op: str, name: str) -> float | None:
    """The median seconds of ``name``'s ``op`` (``save``/``restore``); ``dcp`` is its best thread count."""
    if op == "save" and name == "dcp":
        ts = [statistics.median(v) for k, v in case["save"].items() if k.startswith("dcp-t")]
        return min(ts) if ts else None
    if op == "restore" and name in ("dcp", "dcp-t1"):
        name = "dcp.load"
    if op == "restore" and name == "torch.save":
        name = "torch.save"
    v = case[op].get(name)
    return statistics.median(v) if v else None


def gbps(case: dict[str, Any], op: str, name: str) -> float | None:
    s = med(case, op, name)
    return case["bytes"] / s / GB if s else None


def _cell(case: dict[str, Any], op: str, name: str) -> str:
    g, ref = gbps(case, op, name), gbps(case, op, "fio")
    if g is None:
        return "skipped" if name in case["skipped"] else "–"
    return f"{g:.2f} ({g / ref:.0%})" if ref else f"{g:.2f}"


def best_dcp_threads(case: dict[str, Any]) -> str:
    ks = [k for k in case["save"] if k.startswith("dcp-t")]
    return min(ks, key=lambda k: statistics.median(case["save"][k])) if ks else "–"


def geometry_line(m: dict[str, Any]) -> str:
    """The geometry tierckpt used on the mount, detected and default."""
    out = []
    for case in m["cases"].values():
        for name in (OURS, "tierckpt:default"):
            g = case["info"].get(name, {}).get("geometry")
            if g and name not in " ".join(out):
                out.append(
                    f"{name}: align {g['alignment_bytes'] >> 10} KiB, chunk {g['chunk_bytes'] >> 20} MiB, piece "
                    f"{g['piece_bytes'] >> 10} KiB, blob {g['blob_bytes'] >> 20} MiB, QD {g['queue_depth']}, "
                    f"direct {g['direct']}"
                )
    return "; ".join(out)


def mount_tables(m: dict[str, Any]) -> list[str]:
    """A save table and a restore table: GB/s (ratio to fio O_DIRECT on the mount) per case."""
    cases = m["cases"]
    keys = list(cases)
    head = "| variant | " + " | ".join(f"{k.split('/')[0]}, {k.split('/')[1]} rank(s)" for k in keys) + " |"
    sep = "| --- |" + " --- |" * len(keys)
    f = m["facts"]
    lines = [f"#### {m['fs_type']} ({m['family']}) at `{m['path']}`", "",
             f"Detected: block {f['block_bytes']} B, st_blksize {f['io_block_bytes']} B, O_DIRECT {f['direct']}, "
             f"stripe unit {f['stripe_unit_bytes']}, stripe count {f['stripe_count']}, object {f['object_bytes']}. "
             f"Geometry: {geometry_line(m)}.", "", "Save (durable), GB/s (× fio O_DIRECT write, same files):", "",
             head, sep]  # fmt: skip
    save_names = [n for n in next(iter(cases.values()))["save"] if not n.startswith("dcp-t")]
    first = next(iter(cases.values()))
    save_names += [k for k in first["save"] if k.startswith("dcp-t")] + list(first["skipped"])
    for n in dict.fromkeys(save_names):
        lines.append(f"| {n} | " + " | ".join(_cell(cases[k], "save", n) for k in keys) + " |")
    lines.append("| files per checkpoint | " + " | ".join(
        ", ".join(f"{n} {c}" for n, c in cases[k]["files"].items()
                  if n in (OURS, "dcp-t1", "torchsnapshot", "torch.save")) for k in keys) + " |")  # fmt: skip
    lines += ["", "Restore (cold, fresh processes, into new tensors), GB/s (× fio O_DIRECT read):", "", head, sep]
    for n in next(iter(cases.values()))["restore"]:
        lines.append(f"| {n} | " + " | ".join(_cell(cases[k], "restore", n) for k in keys) + " |")
    return lines


def targets(m: dict[str, Any]) -> list[str]:
    """The issue's ratios on this mount, each with met / missed."""
    out = []
    ok = lambda b: "met" if b else "missed"  # noqa: E731
    for k, c in m["cases"].items():
        wl = k.split("/")[0]
        ours = med(c, "save", OURS)
        if ours is None:
            continue
        if wl == "small" and med(c, "save", "dcp"):
            r = med(c, "save", "dcp") / ours  # type: ignore[operator]
            out.append(f"* {k}: save {r:.2f}× `dcp.save` ({best_dcp_threads(c)}); ≥ 3×: {ok(r >= 3)}")
        if wl == "llm":
            r = med(c, "save", "fio") / ours  # type: ignore[operator]
            peers = {p: med(c, "save", p) for p in PEERS}
            best = min((v, p) for p, v in peers.items() if v)
            out.append(f"* {k}: save {r:.0%} of fio; ≥ 90 %: {ok(r >= 0.9)}; fastest peer ({best[1]}) "
                       f"takes {best[0] / ours:.2f}× our time: ahead {ok(ours < best[0])}")  # fmt: skip
        rs = med(c, "restore", OURS)
        for p in ("dcp", "torch.save"):
            other = med(c, "restore", p)
            if rs and other:
                label = "dcp.load" if p == "dcp" else "torch.load"
                out.append(f"* {k}: restore {other / rs:.2f}× {label}'s speed; ahead: {ok(rs < other)}")
    return out


def report(info: dict[str, Any]) -> str:
    """The markdown of a run: conditions, per-mount tables and target checks."""
    lines = [f"Run of {info['date']}, {info['cpus']} CPUs, medians of {info['repeats']} repeats; "
             f"`bench_iostudy.py {' '.join(info['argv'])}`.", ""]  # fmt: skip
    for m in info["mounts"]:
        c0 = next(iter(m["cases"].values()))
        lines += mount_tables(m)
        lines += ["", f"Cold: {', '.join(c0['cold'])}. Skipped: "
                  + ("; ".join(f"{n}: {w}" for c in m["cases"].values() for n, w in c["skipped"].items()) or "none")
                  + ".", "", "Targets:", *targets(m), ""]  # fmt: skip
    return "\n".join(lines)


def plot_mount(m: dict[str, Any], path: Path) -> Path | None:
    """Bars of save and restore GB/s per variant, one group per case; None without matplotlib."""
    from tierckpt.bench import plots

    if plots.available() is not None:
        return None
    import matplotlib.pyplot as plt

    cases = m["cases"]
    fig, axes = plt.subplots(2, 1, figsize=(10, 7), squeeze=False)
    for ax, op in zip(axes[:, 0], ("save", "restore")):
        names = list(dict.fromkeys(n for c in cases.values() for n in c[op]))
        width = 0.85 / max(1, len(names))
        for i, n in enumerate(names):
            xs = [j + (i - (len(names) - 1) / 2) * width for j in range(len(cases))]
            ax.bar(xs, [gbps(c, op, n) or 0.0 for c in cases.values()], width, label=n, color=plt.cm.tab20(i % 20))
        ax.set_xticks(range(len(cases)), [k.replace("/", ", ") + " rank(s)" for k in cases])
        ax.set_ylabel("GB/s (median)")
        ax.set_title(f"{op}{' (durable)' if op == 'save' else ' (cold, fresh processes)'}: {m['fs_type']}")
        ax.grid(axis="y", alpha=0.3)
        ax.legend(fontsize=6, loc="upper left", bbox_to_anchor=(1.01, 1.0))
    fig.tight_layout()
    fig.savefig(path, dpi=70)
    plt.close(fig)
    return path


def main(argv: list[str]) -> int:
    info = json.loads(Path(argv[0]).read_text())
    print(report(info))
    for i, m in enumerate(info["mounts"]):
        plot_mount(m, Path(argv[0]).parent / f"iostudy-{i}-{m['fs_type'].replace('.', '-')}.png")
    return 0


if __name__ == "__main__":
    sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
    sys.exit(main(sys.argv[1:]))
