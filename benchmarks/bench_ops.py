"""Cost of ReadyStamp per call (goal: <= 5 us).

Two measurements:

1. Graph: a tf.function applying N independent ReadyStamps (distinct keys, so
   nothing is merged) to N small tensors, against the same function with
   tf.identity in their place. Per-call cost = (t_stamp - t_identity) / N.
   Grappler removes the identities, so the difference is the whole marginal
   cost of adding a stamp op to a step: executor scheduling + kernel + record.
   The variants alternate within each repetition to share machine noise.
2. Raw: the C stamp (clock read + ring-buffer append under a mutex) in a tight
   C loop (prophet_stamp_benchmark), without TensorFlow or Python.

Run: python benchmarks/bench_ops.py [--n 1000] [--reps 7] [--calls 30]
"""

import argparse
import pathlib
import statistics
import sys
import time

import tensorflow as tf

try:
    from prophet_tf import _native
except ImportError:  # run from a checkout that is not pip-installed
    sys.path.insert(0, str(pathlib.Path(__file__).resolve().parents[1]))
    from prophet_tf import _native


def _build(n: int, use_stamp: bool):
    @tf.function
    def fn(x, step):
        parts = tf.unstack(x)
        if use_stamp:
            parts = [_native.ready_stamp(p, key=i, step=step) for i, p in enumerate(parts)]
        else:
            parts = [tf.identity(p) for p in parts]
        return tf.stack(parts)
    return fn


def _time_calls(fn, x, step, calls: int) -> float:
    start = time.perf_counter_ns()
    for _ in range(calls):
        fn(x, step)
    return (time.perf_counter_ns() - start) / calls


def bench_graph(n: int, reps: int, calls: int):
    x = tf.random.uniform([n, 4])
    step = tf.constant(1, tf.int64)
    stamp_fn, ident_fn = _build(n, True), _build(n, False)
    for fn in (stamp_fn, ident_fn):  # trace + warm up
        for _ in range(3):
            fn(x, step)
    _native.drain_stamps()
    per_op_us, stamp_ms, ident_ms = [], [], []
    for _ in range(reps):
        t_ident = _time_calls(ident_fn, x, step, calls)
        t_stamp = _time_calls(stamp_fn, x, step, calls)
        stamped = len(_native.drain_stamps())
        if stamped != n * calls:
            sys.exit(f"expected {n * calls} stamps, got {stamped}: ops were pruned or folded")
        stamp_ms.append(t_stamp / 1e6)
        ident_ms.append(t_ident / 1e6)
        per_op_us.append((t_stamp - t_ident) / n / 1e3)
    return per_op_us, stamp_ms, ident_ms


def bench_raw(reps: int, count: int = 200_000):
    lib = _native.load().lib
    per_stamp_ns = []
    for _ in range(reps):
        elapsed = lib.prophet_stamp_benchmark(count, 16)
        _native.drain_stamps()
        per_stamp_ns.append(elapsed / count)
    return per_stamp_ns


def _row(name, values, unit):
    med = statistics.median(values)
    spread = f"{min(values):.3f} .. {max(values):.3f}"
    return f"  {name:<38} {med:>10.3f} {unit:<3} [{spread}]"


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--n", type=int, default=1000, help="stamps per tf.function call")
    parser.add_argument("--reps", type=int, default=7, help="repetitions (for the spread)")
    parser.add_argument("--calls", type=int, default=30, help="calls per repetition")
    args = parser.parse_args()
    if not _native.ops_available():
        _native.load()  # raises the ImportError with the rebuild hint
    _native.reset()

    per_op_us, stamp_ms, ident_ms = bench_graph(args.n, args.reps, args.calls)
    raw_ns = bench_raw(args.reps)
    _native.reset()

    print(f"ReadyStamp cost (TF {tf.__version__}, N={args.n} ops/call, {args.calls} calls x "
          f"{args.reps} reps; median [min .. max] over reps)")
    print(_row("tf.function, N x ReadyStamp, per call", stamp_ms, "ms"))
    print(_row("tf.function, N x tf.identity, per call", ident_ms, "ms"))
    print(_row("ReadyStamp marginal cost per op", per_op_us, "us"))
    print(_row("raw C stamp (tight loop)", raw_ns, "ns"))
    verdict = "meets" if statistics.median(per_op_us) <= 5.0 else "MISSES"
    print(f"  -> {verdict} the 5 us per-op goal")


if __name__ == "__main__":
    main()
