"""Where a bench run's step time goes, read from the worker timelines.

    python benchmarks/timeline_breakdown.py [--json OUT] DIR [DIR ...]

DIR is a run directory under ``prophet-tf bench --timeline-dir`` (it holds
``worker-<i>.json``). For worker 0, for every measured step k (after the
bench's 8 warm-up steps), times are taken from the first gradient of step k
becoming ready: the end of backprop (last gradient ready), the end of the
last push of step k, the first and last pulled partition of version k+1, and
the moment the last parameter of step k+1's forward was there; then the
median over the steps. Also the time the push link was busy while backprop
ran (a scheduler that holds gradients back leaves it idle), and how far the
workers drift apart: each other worker's start of backprop minus worker 0's,
per step (median and range). Synchronous workers out of phase load their
hosts' links in turns, so each link idles while the other is busy.

Then, per measured step, where the workers' start of the next step spreads
(with a PS on every worker's host): each worker's last parameter of version
k+1 in, their spread (last minus first), and the PS whose answers ended
last: how long after the last push into it its answers went on, and how many
bytes of step k+1 the worker on its host pushed to other PS tasks meanwhile.
A worker whose parameters are all in starts the next step and pushes; on its
host's uplink those pushes share the link with its PS's answers to the
workers still waiting, so the first worker's lead makes the others' wait
longer.
"""
import glob
import json
import os
import re
import statistics
import sys

WARMUP_STEPS = 8


def _events(directory: str, worker: int) -> list:
    with open(os.path.join(directory, f"worker-{worker}.json")) as f:
        return json.load(f)["traceEvents"]


def _backward_starts(events: list) -> dict:
    """Step -> when its first gradient became ready (us)."""
    starts = {}
    for e in events:
        if e.get("cat") == "backward":
            step = e["args"]["step"]
            starts[step] = min(e["ts"], starts.get(step, e["ts"]))
    return starts


def phase_offsets(directory: str) -> dict:
    """Worker w -> (median, min, max) over the measured steps of its start of
    backprop minus worker 0's, in ms."""
    paths = glob.glob(os.path.join(directory, "worker-*.json"))
    starts = [_backward_starts(_events(directory, w)) for w in range(len(paths))]
    out = {}
    for w in range(1, len(starts)):
        offsets = [(starts[w][k] - t) / 1e3 for k, t in starts[0].items()
                   if k >= WARMUP_STEPS and k in starts[w]]
        if offsets:
            out[w] = (statistics.median(offsets), min(offsets), max(offsets))
    return out


def breakdown(directory: str, worker: int = 0) -> dict:
    events = _events(directory, worker)
    by = {}
    for e in events:
        by.setdefault(e.get("cat"), []).append(e)
    steps = sorted({e["args"]["step"] for e in by.get("backward", [])})
    rows = []
    for k in steps[WARMUP_STEPS:-1]:
        ready = [e["ts"] for e in by["backward"] if e["args"]["step"] == k]
        pushes = [(e["ts"], e["ts"] + e["dur"]) for e in by.get("push", [])
                  if e["args"]["step"] == k]
        pulls = [e["ts"] + e["dur"] for e in by.get("pull", []) if e["args"]["version"] == k + 1]
        reads = [e["args"]["forward_start_us"] for e in by.get("forward", [])
                 if e["args"]["step"] == k + 1]
        if not (ready and pushes and pulls and reads):
            continue
        t0, t1 = min(ready), max(ready)
        busy, last = 0.0, t0
        for a, b in sorted(pushes):  # union of push intervals within backprop
            a, b = max(a, last), min(b, t1)
            if b > a:
                busy += b - a
                last = b
        rows.append({"backward_ms": (t1 - t0) / 1e3,
                     "last_push_end_ms": (max(b for _, b in pushes) - t0) / 1e3,
                     "first_pull_ms": (min(pulls) - t0) / 1e3,
                     "last_pull_ms": (max(pulls) - t0) / 1e3,
                     "last_param_in_ms": (max(reads) - t0) / 1e3,
                     "push_busy_in_backward": busy / max(t1 - t0, 1e-9)})
    return {k: statistics.median(r[k] for r in rows) for k in rows[0]} if rows else {}


def _links(events: list) -> dict:
    """tid -> (direction, PS index) from the trace's thread names."""
    out = {}
    for e in events:
        if e.get("name") == "thread_name":
            m = re.match(r"(push|pull) (?:to|from) PS (\d+)$", e["args"]["name"])
            if m:
                out[e["tid"]] = (m.group(1), int(m.group(2)))
    return out


def answer_tails(directory: str) -> list[dict]:
    """Per measured step k: each worker's last parameter of version k+1 in
    (ms from worker 0's start of backprop k), the spread, and the PS whose
    answers ended last with its tail and its host worker's step-(k+1) pushes
    in that tail (MB)."""
    n = len(glob.glob(os.path.join(directory, "worker-*.json")))
    events = [_events(directory, w) for w in range(n)]
    links = [_links(ev) for ev in events]
    starts = _backward_starts(events[0])
    rows = []
    for k in sorted(starts)[WARMUP_STEPS:-1]:
        push_in, answered, last_in = {}, {}, []
        for w in range(n):
            ends = []
            for e in events[w]:
                kind = links[w].get(e.get("tid"))
                if kind is None or e.get("cat") not in ("push", "pull"):
                    continue
                end = e["ts"] + e["dur"]
                ps = kind[1]
                if kind[0] == "push" and e["args"]["step"] == k:
                    push_in[ps] = max(push_in.get(ps, end), end)
                elif kind[0] == "pull" and e["args"]["version"] == k + 1:
                    answered[ps] = max(answered.get(ps, end), end)
                    ends.append(end)
            if ends:
                last_in.append(max(ends))
        if len(last_in) < n or not answered:
            continue
        ps = max(answered, key=answered.get)
        a, b = push_in.get(ps, answered[ps]), answered[ps]
        ahead = 0.0
        if ps < n:  # the worker on the laggard PS's host (colocated layout)
            for e in events[ps]:
                kind = links[ps].get(e.get("tid"))
                if (kind and e.get("cat") == "push" and kind[1] != ps
                        and e["args"]["step"] == k + 1):
                    s, t = e["ts"], e["ts"] + e["dur"]
                    if t > a and s < b:  # bytes spread evenly over the push
                        ahead += e["args"]["bytes"] * (min(t, b) - max(s, a)) / max(t - s, 1e-9)
        t0 = starts[k]
        rows.append({"step": k, "last_in_ms": [(t - t0) / 1e3 for t in last_in],
                     "spread_ms": (max(last_in) - min(last_in)) / 1e3, "laggard_ps": ps,
                     "tail_ms": (b - a) / 1e3, "host_worker_push_mb": ahead / 1e6})
    return rows


def main(argv):
    """Prints each run's breakdown; with ``--json OUT`` also writes each run's
    per-step answer tails (keyed "<cell directory>/<run directory>"), so the
    figures drawn from timelines too large to commit are kept."""
    out = None
    if argv[:1] == ["--json"]:
        out, argv = argv[1], argv[2:]
    tails = {}
    for pattern in argv:
        for directory in sorted(glob.glob(pattern)):
            path = os.path.normpath(directory)
            tails[os.path.join(os.path.basename(os.path.dirname(path)),
                               os.path.basename(path))] = answer_tails(directory)
            b = breakdown(directory)
            if b:
                print(os.path.basename(directory.rstrip("/")) + ": " + ", ".join(
                    f"{k} {v:.2f}" if k == "push_busy_in_backward" else f"{k} {v:.0f}"
                    for k, v in b.items()))
            for w, (median, low, high) in phase_offsets(directory).items():
                print(f"  worker {w} backprop starts {median:+.1f} ms from worker 0's "
                      f"(median; {low:+.1f} to {high:+.1f})")
            for r in tails[next(reversed(tails))]:
                print(f"  step {r['step']}: parameters in at "
                      f"{', '.join(f'{t:.0f}' for t in r['last_in_ms'])} ms (spread "
                      f"{r['spread_ms']:.0f}); PS {r['laggard_ps']} answered "
                      f"{r['tail_ms']:.0f} ms after its last push in, while worker "
                      f"{r['laggard_ps']} pushed {r['host_worker_push_mb']:.1f} MB of step "
                      f"{r['step'] + 1}")
    if out:
        with open(out, "w") as f:
            json.dump({"command": "python benchmarks/timeline_breakdown.py --json OUT "
                                  + " ".join(argv), "answer_tails": tails}, f, indent=1)


if __name__ == "__main__":
    main(sys.argv[1:])
