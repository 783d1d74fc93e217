"""Where a bench run's step time goes, read from the worker and PS timelines.

    python benchmarks/timeline_breakdown.py [--json OUT] DIR [DIR ...]

DIR is a run directory under ``prophet-tf bench --timeline-dir``; the
analyses live in ``prophet_tf/bench/breakdown.py`` (tested on the smoke
bench's timelines), which says what each one reads.
"""
import sys

from prophet_tf.bench.breakdown_cli import main

if __name__ == "__main__":
    main(sys.argv[1:])
