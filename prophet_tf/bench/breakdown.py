"""Where a bench run's step time goes, read from the worker and PS timelines.

    python benchmarks/timeline_breakdown.py [--json OUT] DIR [DIR ...]

DIR is a run directory under ``prophet-tf bench --timeline-dir`` (it holds
``worker-<i>.json``). For worker 0, for every measured step k (after the
bench's warm-up steps; every analysis takes ``warmup``), times are taken
from the first gradient of step k becoming ready: the end of backprop (last
gradient ready), the end of the last push of step k, the first and last
pulled partition of version k+1, and the moment the last parameter of step
k+1's forward was there; then the median over the steps. Also the time the
push link was busy while backprop ran (a scheduler that holds gradients back
leaves it idle). How far the workers drift apart, and the steps' times
together and apart: :mod:`prophet_tf.bench.phases`.

Then, per measured step, where the workers' start of the next step spreads
(with a PS on every worker's host): each worker's last parameter of version
k+1 in, their spread (last minus first), and the PS whose answers ended
last: how long after the last push into it its answers went on, and how many
bytes of step k+1 the worker on its host pushed to other PS tasks meanwhile.
A worker whose parameters are all in starts the next step and pushes; on its
host's uplink those pushes share the link with its PS's answers to the
workers still waiting, so the first worker's lead makes the others' wait
longer.

Last, where in each worker's own step (batch end to batch end, as the
bench's ``link_phases``) the step's exchange ends: when the worker's and
every worker's last push of the step before ended, when the first layer's
value arrived, when the last answer arrived, when the first and the last
gradient were ready; beside the link load in each tenth of the step, from
the interface counters the bench keeps in ``run.json`` with the timelines.
A push ends when the PS's reply arrives, which may wait behind answers in the same connection,
so the PS's own trace (``ps-<i>.json``, kept by the bench too) adds when each sum was complete
and each answer handed to gRPC (how long before its arrival: :func:`answer_leads`).
"""
from __future__ import annotations

import functools
import glob
import json
import os
import re
import statistics

from prophet_tf.bench import link_load
from prophet_tf.bench.results import WARMUP_STEPS

__all__ = ["breakdown", "worker_events", "backward_starts", "answer_tails", "answer_leads",
           "push_order",
           "uplinks", "step_events", "STEP_EVENTS"]


def _load(path: str):
    with open(path) as f:
        return json.load(f)


@functools.lru_cache(maxsize=None)  # each analysis reads the same timelines
def _events(directory: str, worker: int) -> list:
    return _load(os.path.join(directory, f"worker-{worker}.json"))["traceEvents"]


def worker_events(directory: str) -> list[list]:
    """Every worker's timeline events, in worker order."""
    n = len(glob.glob(os.path.join(directory, "worker-*.json")))
    return [_events(directory, w) for w in range(n)]


def _by_category(events: list) -> dict:
    """Category ("push", "pull", "backward", ...) -> its events."""
    by = {}
    for e in events:
        by.setdefault(e.get("cat"), []).append(e)
    return by


def _times_by(events: list, arg: str, ended: bool = True) -> dict:
    """Value of ``args[arg]`` -> when its events ended (or began), in us."""
    times = {}
    for e in events:
        times.setdefault(e["args"][arg], []).append(e["ts"] + e["dur"] if ended else e["ts"])
    return times


def backward_starts(events: list) -> dict:
    """Step -> when its first gradient became ready (us)."""
    readies = _times_by([e for e in events if e.get("cat") == "backward"], "step", ended=False)
    return {k: min(times) for k, times in readies.items()}


def breakdown(directory: str, worker: int = 0, warmup: int = WARMUP_STEPS) -> dict:
    by = _by_category(_events(directory, worker))
    readies = _times_by(by.get("backward", []), "step", ended=False)
    pulled = _times_by(by.get("pull", []), "version")
    pushes_by, reads_by = {}, {}
    for e in by.get("push", []):
        pushes_by.setdefault(e["args"]["step"], []).append((e["ts"], e["ts"] + e["dur"]))
    for e in by.get("forward", []):
        reads_by.setdefault(e["args"]["step"], []).append(e["args"]["forward_start_us"])
    rows = []
    for k in sorted(readies)[warmup:-1]:
        ready, pushes = readies[k], pushes_by.get(k)
        pulls, reads = pulled.get(k + 1), reads_by.get(k + 1)
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


@functools.lru_cache(maxsize=None)  # answer tails, uplinks and answer leads read them
def _transfers(directory: str, worker: int) -> dict:
    """A worker's pushes and answers by step: ("push", step) or ("pull",
    version) -> [(PS index, start, end, bytes, variable names)], times in us;
    an end is the transfer's arrival. Shared: not to be changed."""
    events = _events(directory, worker)
    links = _links(events)
    out = {}
    for e in events:
        kind = links.get(e.get("tid"))
        if kind is None or e.get("cat") not in ("push", "pull"):
            continue
        k = e["args"]["step"] if kind[0] == "push" else e["args"]["version"]
        out.setdefault((kind[0], k), []).append(
            (kind[1], e["ts"], e["ts"] + e["dur"], e["args"]["bytes"], e["args"]["keys"]))
    return out


def answer_tails(directory: str, warmup: int = WARMUP_STEPS) -> list[dict]:
    """Per measured step k: each worker's last parameter of version k+1 in
    (ms from worker 0's start of backprop k), the spread, and the PS whose
    answers ended last with its tail and its host worker's step-(k+1) pushes
    in that tail (MB)."""
    events = worker_events(directory)
    n = len(events)
    transfers = [_transfers(directory, w) for w in range(n)]
    starts = backward_starts(events[0])
    rows = []
    for k in sorted(starts)[warmup:-1]:
        push_in, answered, last_in = {}, {}, []
        for w in range(n):
            for ps, _, end, _, _ in transfers[w].get(("push", k), ()):
                push_in[ps] = max(push_in.get(ps, end), end)
            answers = transfers[w].get(("pull", k + 1), ())
            for ps, _, end, _, _ in answers:
                answered[ps] = max(answered.get(ps, end), end)
            if answers:
                last_in.append(max(end for _, _, end, _, _ in answers))
        if len(last_in) < n or not answered:
            continue
        ps = max(answered, key=answered.get)
        a, b = push_in.get(ps, answered[ps]), answered[ps]
        ahead = 0.0
        if ps < n:  # the worker on the laggard PS's host (colocated layout)
            for to, s, t, nbytes, _ in transfers[ps].get(("push", k + 1), ()):
                if to != ps and t > a and s < b:  # bytes spread evenly over the push
                    ahead += nbytes * (min(t, b) - max(s, a)) / max(t - s, 1e-9)
        t0 = starts[k]
        rows.append({"step": k, "last_in_ms": [(t - t0) / 1e3 for t in last_in],
                     "spread_ms": (max(last_in) - min(last_in)) / 1e3, "laggard_ps": ps,
                     "tail_ms": (b - a) / 1e3, "host_worker_push_mb": ahead / 1e6})
    return rows


def uplinks(directory: str, warmup: int = WARMUP_STEPS) -> list[dict]:
    """Per measured step k, what each host's uplink carried (colocated
    layout: worker i and PS i share host i): its worker's pushes of step k
    to the other hosts' PS tasks and its PS's answers of version k+1 to the
    other hosts' workers, in MB, and when each ended (s from the step's
    first gradient on any worker, ``start_s``: that gradient's time on the
    monotonic clock), and how far apart the hosts' pushes ended."""
    events = worker_events(directory)
    n = len(events)
    transfers = [_transfers(directory, w) for w in range(n)]
    starts = {}
    for ev in events:
        for k, t in backward_starts(ev).items():
            starts[k] = min(t, starts.get(k, t))
    rows = []
    for k in sorted(starts)[warmup:-1]:
        hosts = []
        for h in range(n):
            pushed = [(end, nbytes) for ps, _, end, nbytes, _ in transfers[h].get(("push", k), ())
                      if ps != h]
            answered = [(end, nbytes) for w in range(n) if w != h
                        for ps, _, end, nbytes, _ in transfers[w].get(("pull", k + 1), ())
                        if ps == h]
            if not (pushed and answered):
                break
            hosts.append({"push_mb": sum(b for _, b in pushed) / 1e6,
                          "push_end_s": (max(t for t, _ in pushed) - starts[k]) / 1e6,
                          "answer_mb": sum(b for _, b in answered) / 1e6,
                          "answer_end_s": (max(t for t, _ in answered) - starts[k]) / 1e6})
        else:
            ends = [x["push_end_s"] for x in hosts]
            rows.append({"step": k, "start_s": starts[k] / 1e6, "hosts": hosts,
                         "push_end_spread_s": max(ends) - min(ends)})
    return rows


#: The events located in each measured step by :func:`step_events`; the
#: ones marked (PS) come from the PS tasks' traces (``ps-<i>.json``).
STEP_EVENTS = ("own last push of the step before", "every worker's last push",
               "last sum complete (PS)", "first layer's pushes all in",
               "first layer's sum complete (PS)", "first layer's parameter in",
               "last answer handed to gRPC (PS)", "last answer in",
               "first gradient ready", "last gradient ready")


@functools.lru_cache(maxsize=None)
def _ps_traces(directory: str) -> tuple:
    """Each PS task's trace: (its index, its events)."""
    traces = map(_load, glob.glob(os.path.join(directory, "ps-*.json")))
    return tuple((trace["metadata"]["ps"], trace["traceEvents"]) for trace in traces)


def _ps_events(directory: str) -> dict:
    """From the PS traces: ("complete", step) -> [(key, t)]; ("answered",
    worker, version) -> latest t (us)."""
    out = {}
    for _, events in _ps_traces(directory):
        for e in events:
            args = e.get("args", {})
            if e.get("cat") == "complete":
                out.setdefault(("complete", args["step"]), []).append((args["key"], e["ts"]))
            elif e.get("cat") == "answered":
                at = ("answered", args["worker"], args["version"])
                out[at] = max(out.get(at, e["ts"]), e["ts"])
    return out


def answer_leads(directory: str, warmup: int = WARMUP_STEPS) -> dict:
    """How long before an answer (a pulled partition) of a version after
    ``warmup`` arrived gRPC had taken it from the PS (``answered``: no longer
    owed), in ms: ``{"same_host", "other_host"}`` -> ``{"count", "median_ms",
    "p10_ms", "p90_ms"}`` or None (PS i is on worker i % W's host, colocated),
    and ``unmatched``: answers whose pull names another variable (the i-th
    answer of a version to a worker is its i-th pull of it: one stream)."""
    n = len(worker_events(directory))
    transfers = [_transfers(directory, w) for w in range(n)]
    answered = {}
    for ps, trace in _ps_traces(directory):
        for e in trace:
            args = e.get("args", {})
            if e.get("cat") == "answered" and args["version"] > warmup:
                answered.setdefault((ps, args["worker"], args["version"]), []).append(
                    (e["ts"], e["name"].split(" ", 1)[1]))
    leads = {"same_host": [], "other_host": []}
    unmatched = 0
    for (ps, w, version), answers in answered.items():
        received = sorted((start, end, names) for p, start, end, _, names
                          in transfers[w].get(("pull", version), ()) if p == ps)
        for (t, name), (_, end, names) in zip(sorted(answers), received):
            if names != [name]:
                unmatched += 1
                continue
            leads["same_host" if ps % n == w else "other_host"].append((end - t) / 1e3)
    out = {"unmatched": unmatched}
    for where, values in leads.items():
        values.sort()
        out[where] = {"count": len(values), "median_ms": statistics.median(values),
                      "p10_ms": values[len(values) // 10],
                      "p90_ms": values[(len(values) * 9) // 10]} if values else None
    return out


def push_order(directory: str, warmup: int = WARMUP_STEPS) -> dict:
    """Whether a worker's pushes to a PS on another host arrive in the order
    sent (one connection carries them; PS i on worker i % W's host): of the
    pushes of the measured steps sent while the one before them to the same
    PS had over 2 ms to go (``behind``), how many ended over 1 ms before it
    (``overtook``)."""
    n = len(worker_events(directory))
    behind = overtook = 0
    for w in range(n):
        by_ps: dict[int, list] = {}
        for (kind, step), rows in _transfers(directory, w).items():
            if kind == "push" and step >= warmup:
                for ps, start, end, _, _ in rows:
                    if ps % n != w:
                        by_ps.setdefault(ps, []).append((start, end))
        for pushes in by_ps.values():
            pushes.sort()
            for (_, end), (next_start, next_end) in zip(pushes, pushes[1:]):
                if next_start < end - 2000:
                    behind += 1
                    overtook += next_end < end - 1000
    return {"behind": behind, "overtook": overtook}


def _first_layer_reads(events: list) -> dict:
    """Step -> (key, name, when its value was in) of the first layer's
    variable in the worker's forward: the lowest key (keys follow the model's
    variables; the forward requests many at once, so not the earliest read)."""
    reads = {}
    for e in events:
        if e.get("cat") == "forward":
            k, key = e["args"]["step"], e["args"]["key"]
            if k not in reads or key < reads[k][0]:
                reads[k] = (key, e["name"][len("read "):], e["args"]["forward_start_us"])
    return reads


def _pushes_ended(events: list[list], first_key: dict) -> tuple[dict, dict]:
    """Step -> when the last worker's last push ended, and step -> when the
    last worker's push carrying the first layer (of the next forward) ended."""
    all_pushed, first_layer_pushed = {}, {}
    for timeline in events:
        for e in timeline:
            if e.get("cat") == "push":
                k, end = e["args"]["step"], e["ts"] + e["dur"]
                all_pushed[k] = max(all_pushed.get(k, end), end)
                if first_key.get(k + 1, (None, None))[1] in e["args"]["keys"]:
                    first_layer_pushed[k] = max(first_layer_pushed.get(k, end), end)
    return all_pushed, first_layer_pushed


def step_events(directory: str, bins: int = 10, warmup: int = WARMUP_STEPS) -> dict | None:
    """Where in each worker's own step its events fall, beside its host's
    link load through the step: needs the ``run.json`` the bench keeps with
    the timelines. A step is the span between two batch ends of the worker
    (the bench's ``link_phases`` use the same steps). Per measured step k
    of worker w, as fractions of that span (the order of ``STEP_EVENTS``):
    w's last push of step k-1 ended; every worker's had; the PS tasks had
    the last partition's sum of step k-1 complete; every worker's push
    carrying the first layer had ended, and its PS had its sum complete; w
    had the first layer's value for the forward of step k; the PS tasks had
    handed gRPC their last answer of version k to w, and w had it; the
    first and the last gradient of step k were ready. Events (PS) only
    where the PS traces were kept. Returns the medians (and ranges) over
    workers and steps, and each direction's link load per tenth of the step
    (bytes over what the link's payload rate carries), averaged over hosts
    and steps. None without run.json or a shaped link."""
    path = os.path.join(directory, "run.json")
    if not os.path.exists(path):
        return None
    run = _load(path)
    rate = run["payload_bytes_per_s"]
    if not rate:
        return None
    events = [_events(directory, w) for w in range(len(run["workers"]))]
    ps = _ps_events(directory)
    first_reads = [_first_layer_reads(e) for e in events]
    first_key = {k: (key, name) for k, (key, name, _) in first_reads[0].items()}
    all_pushed, first_layer_pushed = _pushes_ended(events, first_key)
    fractions = {name: [] for name in STEP_EVENTS}
    for w in run["host_worker"].values():
        ends = link_load.step_ends(run["workers"][w])
        by = _by_category(events[w])
        readies = _times_by(by["backward"], "step", ended=False)
        pushed, answered = _times_by(by["push"], "step"), _times_by(by["pull"], "version")
        for k in range(warmup, len(ends) - 1):
            begin, end = ends[k] * 1e6, ends[k + 1] * 1e6  # us, as the timelines
            ready, pushes, answers = readies.get(k), pushed.get(k - 1), answered.get(k)
            if not (ready and pushes and answers and k - 1 in first_layer_pushed
                    and k in first_reads[w] and k in first_key):
                continue
            sums = ps.get(("complete", k - 1), [])
            first_sums = [t for key, t in sums if key == first_key[k][0]]
            handed = ps.get(("answered", w, k))
            at = [max(pushes), all_pushed[k - 1], max((t for _, t in sums), default=None),
                  first_layer_pushed[k - 1], max(first_sums, default=None),
                  first_reads[w][k][2], handed, max(answers), min(ready), max(ready)]
            for name, t in zip(STEP_EVENTS, at):
                if t is not None:
                    fractions[name].append((t - begin) / (end - begin))
    found = {name: v for name, v in fractions.items() if v}
    if not found:
        return None
    # The bench's own link_phases over the same steps, averaged over the hosts.
    phases = link_load.link_phases(run["link_bytes"], run["workers"], run["host_worker"],
                                   warmup, rate, bins)
    return {"events": {name: statistics.median(v) for name, v in found.items()},
            "events_range": {name: (min(v), max(v)) for name, v in found.items()},
            "link_load": {side: [statistics.fmean(part) for part in zip(*filter(None, hosts))]
                          for side, hosts in phases.items()}}
