#!/bin/bash
# Answers first on and off, alternating, in the paper suite's ResNet-50 cell
# with 4 workers at 3 Gbit/s (time scale 24: links 125 Mbit/s). Writes
# benchmarks/answers-first-resnet50-4w-{on,off}-N.json and the timelines
# under $TIMELINES (for benchmarks/timeline_breakdown.py).
#   bash benchmarks/answers_first_ab.sh 1 2 3
set -euo pipefail
TIMELINES=${TIMELINES:-/tmp/answers-first-timelines}
for n in "$@"; do
  for mode in on off; do
    if [ "$mode" = off ]; then export PROPHET_TF_ANSWERS_FIRST=0; else unset PROPHET_TF_ANSWERS_FIRST; fi
    prophet-tf bench --model resnet50 --compute emulated --compute-ms 90.0 --time-scale 24.0 \
      --workers 4 --bandwidth-mbit 3000.0 --steps 12 --reps 1 --global-batch 128 \
      --schedulers prophet,p3 --compute-reps 0 --timeline-dir "$TIMELINES/$mode-$n" \
      --json "benchmarks/answers-first-resnet50-4w-$mode-$n.json"
  done
done
