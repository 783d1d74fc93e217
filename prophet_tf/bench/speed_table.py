"""The docs' table of ``benchmarks/simulate_speed.py``: how long a simulate
command took, wall and CPU (and the instructions it ran, when counted), per
checkout (``prophet-tf report``'s ``simspeed`` kind)."""
from __future__ import annotations

import statistics

__all__ = ["speed_table"]


def _spread(values: list[float], digits: int) -> str:
    """Median (min–max)."""
    v = sorted(values)
    return f"{statistics.median(v):.{digits}f} ({v[0]:.{digits}f}–{v[-1]:.{digits}f})"


def speed_table(result: dict) -> str:
    """Markdown lines: a row per checkout (the baseline first), its wall and CPU
    seconds (median and spread over the repetitions), the instructions its
    processes ran if counted (median, in billions), and each scheduler's step
    time (median over the repetitions, in ms), then the command."""
    config, runs = result["config"], result["runs"]
    schedulers = list(next(iter(runs.values()))[0]["step_time_s"])
    counted = bool(config.get("instructions"))
    lines = ["| code | commit | wall s | CPU s | " + ("G instructions | " if counted else "")
             + " | ".join(f"{s} step" for s in schedulers) + " |",
             "|---|---|---|---|" + "---|" * (len(schedulers) + counted)]
    for name, reps in runs.items():
        steps = [f"{statistics.median(r['step_time_s'][s] for r in reps) * 1e3:.2f} ms"
                 for s in schedulers]
        count = (f"{statistics.median(r['instructions'] for r in reps) / 1e9:.3f} | "
                 if counted else "")
        lines.append(f"| {name} | {config['commits'].get(name)} | "
                     f"{_spread([r['wall_s'] for r in reps], 1)} | "
                     f"{_spread([r['cpu_s'] for r in reps], 1)} | " + count
                     + " | ".join(steps) + " |")
    turns = " in turns" if len(runs) > 1 else ""
    under = " (under callgrind, which runs the code some 60 times slower)" if counted else ""
    lines.append("")
    lines.append(f"`{config['command']}`, {config['reps']} runs per checkout{turns}; median "
                 f"(min–max); CPU: user + system of the command and its processes{under}; "
                 f"{config['cores']} cores.")
    return "\n".join(lines) + "\n"
