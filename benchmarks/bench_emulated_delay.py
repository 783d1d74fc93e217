"""How closely EmulatedDelay keeps its seconds (reports; never fails).

    python benchmarks/bench_emulated_delay.py [--reps 7]

The unit tests (tests/unit/test_emulated_delay.py) check that a delay never
ends early and what orders delays; how late they end depends on the
machine's load, so it is measured here. Wall clock around a warm
tf.function (or eager call) that does nothing but the delays; per case the
median and the range over ``--reps`` calls, and the median's overshoot over
what the delays ask for:

- one delay of 0.2 s in a tf.function, and of 0.1 s eagerly;
- a delay of 0 s (completes at once: no timer);
- 50 independent delays of 0.05 to 0.3 s (they overlap: the longest, not
  the 8.75 s sum, and hold no inter-op thread while they wait);
- two independent delays of 0.1 s (overlap: 0.1 s), and two ordered by
  ``after`` (0.2 s);
- a chain of 100 dependent delays of 2 ms, plain and hiding their launch
  gaps (``hide_launch_gap``: the chain keeps its 0.2 s);
- the CPU time the process spends while a 0.5 s delay waits, per wall second;
- with ``--models cnn,resnet50``: each model's emulated model (the bench's
  ``--compute emulated``, scaled to ``--compute-s``), profiled as the bench
  profiles a model: its measured forward and backward against the emulated
  layers' times, and the largest gap between a variable's measured gradient
  readiness and its emulated one (tests/integration/test_emulated_compute.py
  checks that none comes sooner).
"""
import argparse
import pathlib
import statistics
import sys
import time

import numpy as np
import tensorflow as tf

try:
    from prophet_tf.bench import emulation
except ImportError:  # run from a checkout that is not pip-installed
    sys.path.insert(0, str(pathlib.Path(__file__).resolve().parents[1]))
    from prophet_tf.bench import emulation


def _wall(fn, *args, reps):
    fn(*args)  # warm-up: tracing, the timer thread's start
    times = []
    for _ in range(reps):
        start = time.monotonic()
        fn(*args)
        times.append(time.monotonic() - start)
    return times


def _chain(seconds, n, hide):
    @tf.function
    def step(x):
        for i in range(n):
            x = emulation.delay(x + 1.0, seconds, hide_launch_gap=hide and i > 0)
        return x
    return step


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--reps", type=int, default=7)
    parser.add_argument("--models", default="", help="comma-separated profiled models")
    parser.add_argument("--compute-s", type=float, default=0.3,
                        help="the emulated models' compute per step (s)")
    args = parser.parse_args(argv)
    x = tf.constant(1.0)
    seconds = np.linspace(0.05, 0.3, 50)

    @tf.function
    def one(x):
        return emulation.delay(x, 0.2)

    @tf.function
    def zero(x):
        return emulation.delay(x, 0.0)

    @tf.function
    def concurrent(x):
        return tf.stack([emulation.delay(x + i, float(s)) for i, s in enumerate(seconds)])

    @tf.function
    def independent(x):
        return emulation.delay(x, 0.1) + emulation.delay(x + 1.0, 0.1)

    @tf.function
    def chained(x):
        a = emulation.delay(x, 0.1)
        return a + emulation.delay(x + 1.0, 0.1, after=[a])

    cases = [("one delay, tf.function", 0.2, one, (x,)),
             ("one delay, eager", 0.1, lambda x: emulation.delay(x, 0.1), (x,)),
             ("zero seconds", 0.0, zero, (x,)),
             ("50 independent delays", 0.3, concurrent, (x,)),
             ("2 independent delays", 0.1, independent, (x,)),
             ("2 delays ordered by after", 0.2, chained, (x,)),
             ("chain of 100 x 2 ms, plain", 0.2, _chain(0.002, 100, False), (x,)),
             ("chain of 100 x 2 ms, hidden gaps", 0.2, _chain(0.002, 100, True), (x,))]
    print(f"{'case':>34} {'asks (s)':>9} {'median (s)':>11} {'range (s)':>17} {'over':>8}")
    for name, asked, fn, fn_args in cases:
        times = _wall(fn, *fn_args, reps=args.reps)
        median = statistics.median(times)
        over = f"{(median - asked) * 1e3:+.1f} ms"
        print(f"{name:>34} {asked:9.3f} {median:11.4f} {min(times):8.4f}-{max(times):.4f} "
              f"{over:>8}")

    @tf.function
    def waits(x):
        return emulation.delay(x, 0.5)

    waits(x)
    fractions = []
    for _ in range(3):
        wall0, cpu0 = time.monotonic(), time.process_time()
        waits(x)
        fractions.append((time.process_time() - cpu0) / (time.monotonic() - wall0))
    print(f"CPU seconds per wall second while a 0.5 s delay waits: "
          f"{statistics.median(fractions):.3f} (median of 3)")
    for name in filter(None, args.models.split(",")):
        _emulated_model(name, args.compute_s, args.reps)


def _emulated_model(name, compute_s, reps):
    import keras

    from prophet_tf.bench import emulated, models, saved_profiles

    profile = saved_profiles.load_profile(name)
    scale = compute_s / profile["compute_s"]
    layers = emulated.emulated_layers(profile, scale)
    model = emulated.build_emulated_model(profile, keras, scale)
    got = models.profile_model(name, 8, iterations=reps, warmup=1, model=model,
                               data=emulated.emulated_data(8),
                               loss_fn=keras.losses.MeanSquaredError())
    expected, ready = [], 0.0
    for layer in reversed(layers):
        ready += layer["backward_s"]
        expected = [ready] * len(layer["variables"]) + expected
    forward = sum(layer["forward_s"] for layer in layers)
    gaps = [v["backward_ready_s"] - e for v, e in zip(got["variables"], expected)]
    print(f"emulated {name} at {compute_s:g} s: forward {got['forward_s']:.4f} s "
          f"(emulated {forward:.4f}), backward {got['backward_s']:.4f} s (emulated "
          f"{expected[0]:.4f}); gradient readiness minus emulated: "
          f"{min(gaps) * 1e3:+.2f} to {max(gaps) * 1e3:+.2f} ms (medians of {reps})")


if __name__ == "__main__":
    main()
