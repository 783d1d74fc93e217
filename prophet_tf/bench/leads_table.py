"""The docs' table of answer leads and phase offsets (``prophet-tf report``'s
``leads`` kind), from ``benchmarks/timeline_breakdown.py --json``: per run, how
far the workers' steps were apart and how long before arriving each answer
had left the PS's count of answers owed (``breakdown.answer_leads``)."""
from __future__ import annotations

import os

__all__ = ["leads_table"]


def _lead(lead: dict | None) -> str:
    if not lead:
        return "–"
    return f"{lead['median_ms']:.1f} ({lead['p10_ms']:.1f}–{lead['p90_ms']:.1f})"


def leads_table(result: dict) -> str:
    """Markdown lines: a row per run (the same worker-1 offset and lead columns).

    Raises:
      ValueError: a result without answer leads.
    """
    runs = result.get("answer_leads") or {}
    if not runs:
        raise ValueError("a leads table needs the answer_leads of timeline_breakdown.py "
                         f"--json. Received: keys {sorted(result)}")
    lines = ["| run | worker 1's backprop after worker 0's, ms | answers to the same host's "
             "worker, ms early | to the other host's worker, ms early |",
             "|---|---|---|---|"]
    for run, lead in runs.items():
        offset = (result.get("phase_offsets") or {}).get(run, {}).get("1")
        apart = (f"{offset['median_ms']:+.1f} ({offset['min_ms']:+.1f} to "
                 f"{offset['max_ms']:+.1f})" if offset else "–")
        lines.append(f"| {os.path.basename(run)} | {apart} | {_lead(lead['same_host'])} | "
                     f"{_lead(lead['other_host'])} |")
    lines.append("")
    lines.append("Per run, the median over the measured steps (range) of worker 1's start of "
                 "backprop minus worker 0's; and how long before it arrived gRPC had taken "
                 "each answer from the PS, median over the answers (10th–90th percentile). "
                 f"From `{result['command']}`.")
    return "\n".join(lines) + "\n"
