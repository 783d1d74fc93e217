"""prophet_tf.bench.phases on timelines written here: steps split by how far
apart the workers started them."""
import json

import pytest

from prophet_tf.bench import breakdown, phases


def write_timelines(directory, starts_ms):
    """starts_ms[w][k]: worker w's start of backprop of step k (two gradient
    events, the first of them the start)."""
    for w, starts in enumerate(starts_ms):
        events = [{"ph": "M", "name": "process_name", "pid": w, "args": {"name": f"worker {w}"}}]
        for k, t in enumerate(starts):
            for key, dt in ((1, 0.0), (0, 30.0)):
                events.append({"ph": "i", "s": "t", "name": f"grad {key}", "pid": w, "tid": 2,
                               "ts": (t + dt) * 1e3, "cat": "backward",
                               "args": {"key": key, "step": k}})
        (directory / f"worker-{w}.json").write_text(json.dumps({"traceEvents": events}))
    breakdown._events.cache_clear()  # the readers cache by directory


def test_steps_are_split_by_their_spread(tmp_path):
    # Timestamps written here, not measured: the medians below are of these.
    worker0 = [0, 200, 400, 610, 890, 1160, 1380]
    # Together (10 ms), apart (70, 60 ms), together again (5 ms); step 6 has no next one.
    worker1 = [0, 210, 470, 670, 895, 1165, 1385]
    write_timelines(tmp_path, [worker0, worker1])
    modes = phases.phase_modes(str(tmp_path), warmup=1)
    assert modes["apart_ms"] == phases.APART_MS
    assert modes["together"] == {"steps": 3, "step_ms": 220.0, "spread_ms": 5.0}
    assert modes["apart"] == {"steps": 2, "step_ms": 245.0, "spread_ms": 65.0}
    assert phases.phase_modes(str(tmp_path), warmup=1, apart_ms=65.0)["apart"]["steps"] == 1
    assert phases.phase_modes(str(tmp_path), warmup=1, apart_ms=75.0)["apart"]["steps"] == 0


def test_a_part_without_steps_has_no_medians(tmp_path):
    write_timelines(tmp_path, [[0, 100, 200, 300], [0, 101, 202, 303]])
    modes = phases.phase_modes(str(tmp_path), warmup=0)
    assert modes["together"]["steps"] == 3
    assert modes["apart"] == {"steps": 0, "step_ms": None, "spread_ms": None}


def test_offsets_are_each_worker_from_worker_0(tmp_path):
    write_timelines(tmp_path, [[0, 100, 200, 300], [5, 90, 230, 300]])
    assert phases.phase_offsets(str(tmp_path), warmup=1) == {1: (0.0, -10.0, 30.0)}


@pytest.mark.parametrize("apart_ms", [0, -1.0, float("nan")])
def test_a_bad_threshold_is_refused(tmp_path, apart_ms):
    write_timelines(tmp_path, [[0, 100], [0, 100]])
    with pytest.raises(ValueError, match="apart_ms must be positive"):
        phases.phase_modes(str(tmp_path), apart_ms=apart_ms)
