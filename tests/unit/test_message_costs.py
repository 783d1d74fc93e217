"""Message costs measured from a run's timelines: the pushes that crossed no link."""
import json

import pytest

from prophet_tf.bench import message_costs
from prophet_tf.engine import timeline


def _write(directory, worker, transfers):
    trace = timeline.build_trace(worker, [], transfers, [], {})
    path = directory / f"worker-{worker}.json"
    path.write_text(json.dumps(trace))


def _push(ps, nbytes, step, seconds, start=0):
    return timeline.Transfer("push", ps, (0,), nbytes, step, start, start + int(seconds * 1e9))


def test_a_line_through_the_local_pushes(tmp_path):
    overhead, per_byte = 0.003, 4e-9
    for worker in (0, 1):  # colocated, 2 workers, 4 PS: PS p lives on host p % 2
        transfers = []
        for step in range(14):
            for ps in range(4):
                nbytes = 10_000 * (1 + step) * (1 + ps)
                local = overhead + nbytes * per_byte
                # Neither warm-up steps (3x slower) nor remote pushes (half
                # the time: they would be taken for the ones that did not wait).
                seconds = local * (3 if step < 8 else 1) * (0.5 if ps % 2 != worker else 1)
                transfers.append(_push(ps, nbytes, step, seconds))
        _write(tmp_path, worker, transfers)
    got = message_costs.measure(str(tmp_path), workers=2, num_ps=4, layout="colocated",
                                warmup_steps=8)
    assert got["messages"] == 2 * 6 * 2  # 2 workers x 6 steps x 2 local PS
    assert got["overhead_s"] == pytest.approx(overhead, rel=1e-3)
    assert got["per_byte_s"] == pytest.approx(per_byte, rel=1e-3)
    assert message_costs.measure(str(tmp_path), 2, 4, "dedicated", 8) is None
    assert message_costs.measure(str(tmp_path), 2, 4, "colocated", 11) is None  # too few


def test_pushes_that_waited_do_not_count_as_cost(tmp_path):
    # 2 ms whatever the size, but every third push waited 10 ms behind
    # another message: the cost stays 2 ms per message, nothing per byte.
    pushes = [_push(0, 1000 * (1 + i), 9, 0.002 + (0.010 if i % 3 == 0 else 0.0))
              for i in range(60)]
    _write(tmp_path, 0, pushes)
    got = message_costs.measure(str(tmp_path), 1, 1, "colocated", 8)
    assert got["overhead_s"] == pytest.approx(0.002) and got["per_byte_s"] == 0.0


def test_costs_never_go_negative_and_combine_by_median(tmp_path):
    # Time falling with size: no per-byte cost.
    _write(tmp_path, 0, [_push(0, 1000 * 2 ** (i % 6), 9, 0.001 * (6 - i % 6))
                         for i in range(30)])
    got = message_costs.measure(str(tmp_path), 1, 1, "colocated", 8)
    assert got["per_byte_s"] == 0.0 and got["overhead_s"] > 0
    both = message_costs.combine([{"overhead_s": 1, "per_byte_s": 3, "messages": 5}, None,
                                  {"overhead_s": 2, "per_byte_s": 1, "messages": 7},
                                  {"overhead_s": 9, "per_byte_s": 2, "messages": 1}])
    assert both == {"overhead_s": 2, "per_byte_s": 2, "messages": 13}
    assert message_costs.combine([None]) is None
