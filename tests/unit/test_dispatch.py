"""The dispatch: key map, partitions, the one in-flight window per link; no TF, no threads."""
import subprocess
import sys
import types

import pytest

from prophet_tf.engine import schedulers
from prophet_tf.engine.dispatch import Dispatch
from prophet_tf.ps import sharding

pytestmark = pytest.mark.timeout(60)


def specs(*shapes):
    return [types.SimpleNamespace(key=i, shape=list(s), dtype="float32", priority=i)
            for i, s in enumerate(shapes)]


def make(name="fifo", shapes=((1000,), (10, 100), ()), num_ps=2, native=(30, 10, 20),
         balance=False, **options):
    """A dispatch; unbalanced by default, so each variable is one partition."""
    return Dispatch(list(native), specs(*shapes), num_ps,
                    schedulers.make_scheduler(name, **options), balance=balance)


def test_the_engine_imports_without_tensorflow():
    # A None entry in sys.modules makes `import tensorflow` fail.
    code = ("import sys; sys.modules['tensorflow'] = None\n"
            "import prophet_tf.engine.engine, prophet_tf.engine.dispatch, "
            "prophet_tf.engine.delivery, prophet_tf.engine.schedulers, prophet_tf.bench.simulate\n"
            "from prophet_tf.engine import Engine\n"
            "assert sys.modules['tensorflow'] is None\n")
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                            timeout=60)
    assert result.returncode == 0, result.stderr


def test_partitions_are_the_ps_sides():
    d = make("p3", slice_bytes=1000)
    assert schedulers.DEFAULT_PARTITION_BYTES == sharding.DEFAULT_MAX_PARTITION_BYTES
    assert d.partitions == sharding.plan(d.specs, 2, 1000, spread=False)
    assert d.partition_bytes == 1000
    assert [len(d.partitions_of[k]) for k in range(3)] == [4, 4, 1]  # 4,000 bytes each
    second = d.partitions_of[1][1]
    assert (second.begin, second.end) == (250, 500)
    assert d.byte_offset(second) == second.begin * 4
    assert make(num_ps=1, balance=True).partition_bytes == schedulers.DEFAULT_PARTITION_BYTES


def test_several_ps_tasks_get_the_model_in_even_shares():
    # 8,004 bytes over 2 PS tasks: 8 pieces of about 1,000 bytes, in turn.
    d = make(balance=True)
    assert d.partitions == sharding.plan(d.specs, 2, d.partition_bytes, spread=True)
    loads = [sum(p.nbytes for p in d.partitions if p.ps_index == i) for i in range(2)]
    assert loads == [4000, 4004], loads
    # Optimizers that need whole variables (Lamb, Adafactor) keep them whole.
    whole = Dispatch([30, 10, 20], specs((1000,), (10, 100), ()), 2,
                     schedulers.make_scheduler("fifo"), balance=False)
    assert whole.partition_bytes == schedulers.DEFAULT_PARTITION_BYTES
    assert [len(whole.partitions_of[k]) for k in range(3)] == [1, 1, 1]


def test_pull_order_is_by_priority():
    d = Dispatch([5, 6, 7], [types.SimpleNamespace(key=i, shape=[4], dtype="float32",
                                                   priority=p) for i, p in enumerate((2, 0, 1))],
                 1, schedulers.make_scheduler("fifo"))
    assert [p.key for p in d.pull_order(0)] == [1, 2, 0]


def test_keys_are_mapped_and_bad_gradients_change_nothing():
    d = make()
    assert [d.ps_key(k) for k in (30, 10, 20)] == [0, 1, 2]
    with pytest.raises(RuntimeError, match="unregistered variable key 99"):
        d.add(99, 0, 0)
    d.add(10, 0, 0, payload="first")
    with pytest.raises(RuntimeError, match="second gradient arrived for variable key 10 at "
                                           "iteration 0"):
        d.add(10, 0, 0, payload="second")
    (block,) = d.next_blocks(0)
    assert d.payload(block[0]) == "first"
    with pytest.raises(ValueError, match="native keys must be distinct"):
        make(native=(1, 1, 2))
    with pytest.raises(ValueError, match="2 keys for 3 specs"):
        make(native=(1, 2))


def test_a_gradient_is_released_once_all_its_partitions_are_serialized():
    d = make("p3", slice_bytes=1000)  # variable 30 in 4 slices, all on one PS task
    d.add(30, 0, 0, payload="g")
    first = d.next_blocks(0)
    assert [len(b) for b in first] == [1, 1]  # the link's window: two blocks
    assert [d.release(b) for b in first] == [[], []]
    for block in first:
        d.on_sent(block, 0, 1)
    rest = d.next_blocks(1)
    assert [d.release(b) for b in rest] == [[], ["g"]]  # with its last slice
    assert not d.idle  # still in flight
    for block in rest:
        d.on_sent(block, 1, 2)
    assert d.idle


def test_iterations_and_the_flush_after_the_last_gradient(monkeypatch):
    d = make()
    flushed = []
    monkeypatch.setattr(d.scheduler, "flush", lambda: flushed.append(True))
    assert d.starts_iteration(0)
    d.add(30, 0, 0)
    assert not d.starts_iteration(0) and d.last_iteration == 0
    d.add(10, 0, 0)
    assert not flushed
    d.add(20, 0, 0)  # every trained variable's gradient is in: backprop is over
    assert flushed == [True]


@pytest.mark.parametrize("name, blocks, nbytes", [
    ("fifo", 2, None), ("p3", 2, None), ("bytescheduler", 2, 4 * 4_096_000),
    ("prophet", 2, 2 * schedulers.ProphetScheduler.BLOCK_BYTES)])
def test_each_scheduler_sizes_the_one_window(name, blocks, nbytes):
    d = make(name)
    assert (d.windows.max_blocks, d.windows.max_bytes) == (blocks, nbytes)
    assert d.scheduler.windows is d.windows  # the scheduler fills the dispatch's window


@pytest.mark.parametrize("name", list(schedulers.SCHEDULERS))
def test_no_link_ever_has_more_in_flight_than_its_window(name):
    # Prophet would cut this 96 MB model into 1.2 MB partitions, one to a window
    # of two 512 KiB blocks; with P3's 200 KB slices two blocks fill it.
    options = {"partition_bytes": 200_000} if name == "prophet" else {}
    d = make(name, shapes=[(4096, 1024)] * 6, native=range(6), **options)
    peak = 0
    for iteration in range(3):
        for key in reversed(range(6)):
            d.add(key, iteration, iteration * 10**9)
        sent = 0
        while blocks := d.next_blocks(sent):
            for window in d.windows.values():
                assert window.blocks <= 2
                if window.max_bytes is not None and window.blocks > 1:
                    assert window.nbytes <= window.max_bytes
                peak = max(peak, window.blocks)
            for block in blocks:
                d.release(block)
                d.on_sent(block, sent, sent + 1)
                sent += 1
        assert d.idle and d.scheduler.pending == 0
    assert peak == 2  # the window is used, not just respected


def test_a_block_outside_the_window_is_refused_with_the_numbers():
    windows = schedulers.Windows(1, 100)
    item = schedulers.ReadyItem(0, 0, 3, 0, 0, 60, 0)
    windows.book([item])
    with pytest.raises(RuntimeError, match=r"link 3's window \(1 blocks, 60 bytes in flight; "
                                           r"limits 1 blocks, 100 bytes\). Received: 1 items, "
                                           r"60 bytes"):
        windows.book([item])
    scheduler = schedulers.make_scheduler("fifo")
    scheduler.add(item)
    scheduler.next_block(0)
    with pytest.raises(RuntimeError, match="already has blocks in flight"):
        scheduler.bind_windows(windows)
