"""Keras 3 mixed precision under prophet_tf.Strategy equals single-process Keras.

mixed_bfloat16 needs nothing of the strategy but to carry float32 gradients of
float32 variables. mixed_float16 scales the loss: a step whose global-batch
gradients overflow is skipped, which here means every PS task skips it when
any worker overflowed (one worker overflows, the other does not), and every
worker's loss scale follows what single-process Keras' would.
"""
import os
import sys

import numpy as np
import pytest

from prophet_tf.tools.launch import launch

WORKER = os.path.join(os.path.dirname(__file__), "precision_worker.py")
STEPS = 8
pytestmark = pytest.mark.timeout(300)


def _single(**options):
    """Single-process Keras in this process, not a subprocess with a TensorFlow start-up
    of its own: the worker's model, data and fit, so the same bits as running it there."""
    import keras_worker  # TensorFlow in this process: only for the references.
    import precision_worker

    keras_worker.limit_threads()  # one intra-op thread, as in the workers
    return precision_worker.single_process(STEPS, **options)


def _cluster(prefix, *options):
    assert launch([sys.executable, WORKER, prefix, str(STEPS), *options], num_workers=2,
                  num_ps=2) == 0
    return [dict(np.load(f"{prefix}.{i}.npz")) for i in range(2)]  # dicts, like _single


def _weights(run):
    return [run[f"arr_{k}"] for k in range(sum(key.startswith("arr_") for key in run))]


def test_mixed_bfloat16_trains_to_single_process_weights(tmp_path):
    single = _weights(_single(policy="mixed_bfloat16", optimizer="sgd"))
    runs = [_weights(r) for r in _cluster(str(tmp_path / "bf16"), "--policy", "mixed_bfloat16",
                                          "--optimizer", "sgd")]
    for worker in runs:
        assert [w.dtype for w in worker] == [np.float32] * len(single)  # float32 variables
        for got, want, other in zip(worker, single, runs[0]):
            np.testing.assert_array_equal(got, other)  # every worker pulls the same
            # bfloat16 has 8 significant bits: the workers' halves of the batch round
            # differently from the whole batch (measured: at most 3e-4 here).
            np.testing.assert_allclose(got, want, rtol=0, atol=1e-3)


def test_one_workers_overflow_skips_the_step_for_every_variable_and_worker(tmp_path):
    single = _single(policy="mixed_float16", overflow_step=4, growth_steps=3)
    runs = _cluster(str(tmp_path / "f16"), "--policy", "mixed_float16", "--overflow-step", "4",
                    "--growth-steps", "3")
    # Single-process Keras: 3 finite steps double the scale (2**15 -> 2**16), the
    # overflow at step 4 halves it and is not counted, 3 more double it again.
    assert int(single["iterations"]) == STEPS - 1 and float(single["scale"]) == 2.0 ** 16
    for run in runs:
        assert int(run["iterations"]) == int(single["iterations"])
        assert float(run["scale"]) == float(single["scale"])
    # Without the skip the weights would be an Adam step (lr 1e-2) away.
    unskipped = _weights(_single(policy="mixed_float16", growth_steps=3))
    for worker in runs:
        for got, want, other, moved in zip(_weights(worker), _weights(single),
                                           _weights(runs[0]), unskipped):
            np.testing.assert_array_equal(got, other)
            # float16 compute rounds the halves differently (measured: at most 4e-4).
            np.testing.assert_allclose(got, want, rtol=0, atol=2e-3)
        assert max(np.abs(m - w).max() for m, w in zip(unskipped, _weights(single))) > 5e-3


def test_a_loss_scale_optimizers_own_apply_is_refused_clearly(tmp_path, capfd):
    # Its apply updates only when this worker's gradients are finite, so one
    # worker's overflow would leave the others waiting: refused at trace time.
    assert launch([sys.executable, WORKER, str(tmp_path / "loop"), "1", "--policy",
                   "mixed_float16", "--custom-loop"], num_workers=1, num_ps=1) != 0
    out = capfd.readouterr().out
    assert "through model.fit/train_on_batch" in out
    assert "Received: LossScaleOptimizer 'loss_scale_optimizer' applied directly" in out
