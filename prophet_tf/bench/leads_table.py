"""The docs' tables of answer leads and phase offsets (``prophet-tf report``'s
``leads`` kind) and of steps together and apart (its ``modes`` kind), from
``benchmarks/timeline_breakdown.py --json``: per run, how far the workers'
steps were apart and how long before arriving each answer had left the PS's
count of answers owed (``breakdown.answer_leads``); and how many steps the
workers ran together and apart, and how long those took (``phases.phase_modes``)."""
from __future__ import annotations

import os

__all__ = ["leads_table", "modes_table"]


def _lead(lead: dict | None) -> str:
    if not lead:
        return "–"
    return f"{lead['median_ms']:.1f} ({lead['p10_ms']:.1f}–{lead['p90_ms']:.1f})"


def _runs(result: dict, key: str, table: str) -> dict:
    """``result[key]`` (run -> its analysis), refused when missing or empty."""
    runs = result.get(key) or {}
    if not runs:
        raise ValueError(f"{table} needs the {key} of timeline_breakdown.py --json. "
                         f"Received: keys {sorted(result)}")
    return runs


def leads_table(result: dict) -> str:
    """Markdown lines: a row per run (the same worker-1 offset and lead columns).

    Raises:
      ValueError: a result without answer leads.
    """
    runs = _runs(result, "answer_leads", "a leads table")
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


def _part(part: dict) -> str:
    return f"{part['steps']} | " + (f"{part['step_ms']:.1f}" if part["steps"] else "–")


def modes_table(result: dict) -> str:
    """Markdown lines: a row per run, its steps together and apart, and (where
    the result has ``push_order``) its pushes sent behind another to one PS.

    Raises:
      ValueError: a result without phase modes.
    """
    runs = _runs(result, "phase_modes", "a modes table")
    orders = result.get("push_order") or {}
    lines = ["| run | steps together | their median, ms | steps apart | their median, ms | "
             "how far apart, ms |" + (" pushes sent behind another | ended first |"
                                      if orders else ""),
             "|---|---|---|---|---|---|" + ("---|---|" if orders else "")]
    for run, modes in runs.items():
        spread = modes["apart"]["spread_ms"]
        order = orders.get(run)
        lines.append(f"| {os.path.basename(run)} | {_part(modes['together'])} | "
                     f"{_part(modes['apart'])} | "
                     f"{'–' if spread is None else f'{spread:.0f}'} |"
                     + (f" {order['behind']} | {order['overtook']} |" if order
                        else " – | – |" if orders else ""))
    apart = {m["apart_ms"] for m in runs.values()}
    lines.append("")
    lines.append(f"Per run, the measured steps whose workers started backprop at most "
                 f"{'/'.join(f'{a:g}' for a in sorted(apart))} ms apart (together) and "
                 "further (apart), and each part's median step time (worker 0's start of "
                 "backprop to the next) and spread (the latest worker's start minus the "
                 "earliest's)"
                 + ("; and the pushes to a PS on another host sent while the one before "
                    "them to that PS had over 2 ms to go, and how many of those ended over "
                    "1 ms before it" if orders else "")
                 + f". From `{result['command']}`.")
    return "\n".join(lines) + "\n"
