"""``python benchmarks/timeline_breakdown.py [--json OUT] DIR [DIR ...]``: the
timeline analyses of :mod:`prophet_tf.bench.breakdown` and
:mod:`prophet_tf.bench.phases` of each bench run directory, printed and kept."""
from __future__ import annotations

import glob
import json
import os

from prophet_tf.bench import breakdown, phases

__all__ = ["main"]


def main(argv):
    """Prints each run's breakdown; with ``--json OUT`` also writes it, each run's
    per-step answer tails and uplinks (``breakdown.uplinks``), answer leads,
    phase offsets and modes, push order and, where the bench kept
    ``run.json``, its step events (``breakdown.step_events``), keyed "<parent
    directory>/<run directory>", so the figures drawn from timelines too
    large to commit are kept."""
    out = None
    if argv[:1] == ["--json"]:
        out, argv = argv[1], argv[2:]
    tails, placed, shares, leads, offsets, modes, orders, steps = ({} for _ in range(8))
    for pattern in argv:
        for directory in sorted(glob.glob(pattern)):
            path = os.path.normpath(directory)
            run = os.path.join(os.path.basename(os.path.dirname(path)), os.path.basename(path))
            tails[run] = breakdown.answer_tails(directory)
            shares[run] = breakdown.uplinks(directory)
            leads[run] = breakdown.answer_leads(directory)
            offsets[run] = {w: dict(zip(("median_ms", "min_ms", "max_ms"), o))
                            for w, o in phases.phase_offsets(directory).items()}
            modes[run] = phases.phase_modes(directory)
            orders[run] = breakdown.push_order(directory)
            events = breakdown.step_events(directory)
            if events:
                placed[run] = events
            b = steps[run] = breakdown.breakdown(directory)
            if b:
                print(os.path.basename(path) + ": " + ", ".join(
                    f"{k} {v:.2f}" if k == "push_busy_in_backward" else f"{k} {v:.0f}"
                    for k, v in b.items()))
            m = modes[run]
            print(f"  steps together {m['together']['steps']}, apart {m['apart']['steps']} "
                  f"(more than {m['apart_ms']:g} ms); pushes sent behind another to the "
                  f"same PS {orders[run]['behind']}, of them ended before it "
                  f"{orders[run]['overtook']}")
            for w, o in offsets[run].items():
                print(f"  worker {w} backprop starts {o['median_ms']:+.1f} ms from worker 0's "
                      f"(median; {o['min_ms']:+.1f} to {o['max_ms']:+.1f})")
            for where, lead in leads[run].items():
                if isinstance(lead, dict):
                    print(f"  answers to the {where.replace('_', ' ')}'s worker taken by gRPC "
                          f"{lead['median_ms']:.1f} ms before they arrived (median of "
                          f"{lead['count']}; p10-p90 {lead['p10_ms']:.1f}-{lead['p90_ms']:.1f})")
            for r in tails[run]:
                print(f"  step {r['step']}: parameters in at "
                      f"{', '.join(f'{t:.0f}' for t in r['last_in_ms'])} ms (spread "
                      f"{r['spread_ms']:.0f}); PS {r['laggard_ps']} answered "
                      f"{r['tail_ms']:.0f} ms after its last push in, while worker "
                      f"{r['laggard_ps']} pushed {r['host_worker_push_mb']:.1f} MB of step "
                      f"{r['step'] + 1}")
            for r in shares[run]:
                print(f"  step {r['step']} uplinks, pushes | answers ended (s): " + "; ".join(
                    f"host {h} {x['push_end_s']:.2f} | {x['answer_end_s']:.2f}"
                    for h, x in enumerate(r["hosts"])) + f" (pushes {r['push_end_spread_s']:.2f} "
                      "s apart)")
            if events:
                print("  in worker steps (median, range): " + "; ".join(
                    f"{name} {events['events'][name]:.3f} ({low:.3f} to {high:.3f})"
                    for name, (low, high) in events["events_range"].items()))
                for side, load in events["link_load"].items():
                    print(f"  link load {side} per tenth: "
                          + " ".join("-" if x is None else f"{x:.2f}" for x in load))
    if out:
        with open(out, "w") as f:
            json.dump({"command": "python benchmarks/timeline_breakdown.py --json OUT "
                                  + " ".join(argv), "answer_tails": tails,
                       "step_events": placed, "uplinks": shares, "answer_leads": leads,
                       "phase_offsets": offsets, "phase_modes": modes,
                       "push_order": orders, "breakdown": steps}, f, indent=1)
