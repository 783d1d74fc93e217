"""prophet_tf.bench.breakdown on timelines written here: whether pushes to
one PS arrive in the order sent."""
import json

from prophet_tf.bench import breakdown


def write_pushes(directory, pushes_by_worker):
    """pushes_by_worker[w]: (PS index, step, start ms, end ms) of each push."""
    for w, pushes in enumerate(pushes_by_worker):
        events = [{"ph": "M", "name": "thread_name", "pid": w, "tid": 100 + ps,
                   "args": {"name": f"push to PS {ps}"}} for ps in range(2)]
        for ps, step, start, end in pushes:
            events.append({"ph": "X", "name": "push 1 key(s)", "pid": w, "tid": 100 + ps,
                           "ts": start * 1e3, "dur": (end - start) * 1e3, "cat": "push",
                           "args": {"keys": ["v"], "bytes": 1000, "step": step}})
        (directory / f"worker-{w}.json").write_text(json.dumps({"traceEvents": events}))
    breakdown._events.cache_clear()  # the readers cache by directory
    breakdown._transfers.cache_clear()


def test_pushes_sent_behind_another_to_the_same_ps_are_counted(tmp_path):
    write_pushes(tmp_path, [
        # Worker 0 to PS 1 (another host): the second is sent 10 ms into the
        # first and ends after it; the third overtakes the second; the fourth
        # starts after the third has ended. To PS 0 (its own host)
        # nothing counts, nor does step 0 (warm-up).
        [(1, 1, 0, 100), (1, 1, 10, 101), (1, 1, 20, 50), (1, 1, 99.5, 140),
         (0, 1, 0, 100), (0, 1, 5, 20), (1, 0, 0, 100), (1, 0, 5, 20)],
        # Worker 1 to PS 0: one behind another, arriving in order.
        [(0, 1, 0, 50), (0, 1, 1, 51)]])
    assert breakdown.push_order(str(tmp_path), warmup=1) == {"behind": 3, "overtook": 1}
