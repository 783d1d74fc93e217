"""The docs' tables of ``benchmarks/profile_bench.py``: where a bench run's CPU goes
per step (``prophet-tf report``'s ``profile`` kind)."""
from __future__ import annotations

__all__ = ["profile_table"]

_KINDS = ("python", "grpc", "tensorflow", "other")
_TOP = 6  # functions listed per process


def profile_table(result: dict) -> str:
    """Markdown lines: per scheduler and process, CPU ms per step by kind of thread and
    the GIL's holders by package; then the functions that held the GIL most in the
    first run's first PS task and first worker."""
    packages = ["prophet_tf", "grpc"]
    lines = ["| scheduler | process | CPU ms/step | Python threads | gRPC threads | "
             "TensorFlow threads | other threads | GIL held | prophet_tf | grpc | rest |",
             "|---|---|---|---|---|---|---|---|---|---|---|"]
    for run in result["runs"]:
        for label, p in run["processes"].items():
            cpu = p["cpu_ms_per_step"]
            held = p["gil_ms_per_step_by_package"]
            rest = sum(v for k, v in held.items() if k not in packages)
            lines.append(f"| {run['scheduler']} | {label} | {sum(cpu.values()):.1f} | "
                         + " | ".join(f"{cpu.get(k, 0.0):.1f}" for k in _KINDS)
                         + f" | {p['gil_ms_per_step_total']:.1f} | "
                         + " | ".join(f"{held.get(k, 0.0):.1f}" for k in packages)
                         + f" | {rest:.1f} |")
    lines.append("")
    run = result["runs"][0]
    for label in (next((k for k in run["processes"] if k.startswith(r)), None)
                  for r in ("ps", "worker")):
        if label is None:
            continue
        top = list(run["processes"][label]["gil_ms_per_step"].items())[:_TOP]
        lines.append(f"{run['scheduler']} {label}, GIL held (ms/step): "
                     + "; ".join(f"{name.partition(': ')[2]} {ms:.1f}" for name, ms in top)
                     + ".")
        lines.append("")
    steps = ", ".join(f"{r['scheduler']} {r['step_time_s'] * 1e3:.1f} ms over "
                      f"{r['steps_in_window']:.0f} steps" for r in result["runs"])
    config = result["config"]
    lines.append(f"Step times: {steps}; a window of {config['window']} s, py-spy at "
                 f"{config['rate']} samples/s.")
    return "\n".join(lines) + "\n"
