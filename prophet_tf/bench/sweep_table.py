"""The docs' table of a `prophet-tf simulate --sweep` JSON (``prophet-tf report``'s
``sweep`` kind): each scheduler's step time over the ideal bound, per cell."""
from __future__ import annotations

__all__ = ["sweep_table"]


def sweep_table(result: dict) -> str:
    """Markdown lines: one row per (workers, PS, bandwidth), one column per scheduler."""
    schedulers = list(dict.fromkeys(r["scheduler"] for r in result["sweep"]))
    by_cell: dict = {}
    for r in result["sweep"]:
        by_cell.setdefault((r["workers"], r["ps"], r["bandwidth_mbit"]), {})[r["scheduler"]] = r
    lines = ["| workers / PS | Gbit/s | " + " | ".join(schedulers) + " | ideal s |",
             "|---|---|" + "---|" * (len(schedulers) + 1)]
    for (workers, ps, mbit), runs in by_cell.items():
        ideal = next(iter(runs.values()))["ideal_step_time_s"]
        lines.append(f"| {workers} / {ps} | {mbit / 1000:g} | " + " | ".join(
            f"{runs[s]['step_time_s'] / ideal:.2f}" for s in schedulers) + f" | {ideal:.3f} |")
    lines.append("")
    placement = ("a PS task on every worker host" if result["layout"] == "colocated"
                 else "one PS per 4 workers")
    lines.append(f"Step time over the ideal bound; {result['model']}, compute "
                 f"{result['compute_s']:g} s per step, {result['layout']} layout ({placement}"
                 f"). From `{result['command']}`.")
    return "\n".join(lines) + "\n"
