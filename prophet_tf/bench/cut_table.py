"""The docs' table of ``benchmarks/partition_cut.py``: partitions cut along rows or
along flattened elements, as simulated (``prophet-tf report``'s ``cuts`` kind)."""
from __future__ import annotations

__all__ = ["cuts_table"]


def cuts_table(result: dict) -> str:
    """Markdown lines: the busiest PS task's bytes over the mean per PS count and cut;
    then each scheduler's step over the ideal bound per cell and cut."""
    spread = {(s["ps"], s["cut"]): s for s in result["spread"]}
    counts = sorted({ps for ps, _ in spread})
    cuts = list(dict.fromkeys(cut for _, cut in spread))
    lines = ["| PS tasks | " + " | ".join(f"busiest / mean, {c} (partitions)" for c in cuts)
             + " |", "|---|" + "---|" * len(cuts)]
    for ps in counts:
        lines.append(f"| {ps} | " + " | ".join(
            f"{spread[ps, c]['busiest_over_mean']:.2f} ({spread[ps, c]['partitions']})"
            for c in cuts) + " |")
    lines.append("")
    schedulers = list(dict.fromkeys(r["scheduler"] for r in result["runs"]))
    lines.append("| workers / PS | Gbit/s | cut | " + " | ".join(schedulers)
                 + " | ideal s |")
    lines.append("|---|---|---|" + "---|" * (len(schedulers) + 1))
    by_cell: dict = {}
    for r in result["runs"]:
        by_cell.setdefault((r["workers"], r["ps"], r["bandwidth_mbit"], r["cut"]), {})[
            r["scheduler"]] = r
    for (workers, ps, mbit, cut), runs in by_cell.items():
        ideal = next(iter(runs.values()))["ideal_step_time_s"]
        lines.append(f"| {workers} / {ps} | {mbit / 1000:g} | {cut} | " + " | ".join(
            f"{runs[s]['step_time_s'] / ideal:.2f}" for s in schedulers)
            + f" | {ideal:.2f} |")
    lines.append("")
    lines.append(f"Step time over the ideal bound; {result['model']}, compute "
                 f"{result['compute_s']:g} s per step, {result['layout']} layout (one PS per 4 "
                 f"workers). From `{result['command']}`.")
    return "\n".join(lines) + "\n"
