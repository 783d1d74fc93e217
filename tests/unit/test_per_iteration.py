"""Nadam's u_product on the PS: one advance per step over many partitions (the
servicer's exactness test), and its value from a step count alone for a PS that
resumes and a worker's saved optimizer (prophet_tf.per_iteration)."""
import os

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")

import keras  # noqa: E402
import numpy as np  # noqa: E402
import pytest  # noqa: E402

from prophet_tf import per_iteration  # noqa: E402


def _nadam_after(applies: int):
    """A single-process Keras Nadam after ``applies`` steps."""
    variable = keras.Variable(np.ones(3, np.float32))
    optimizer = keras.optimizers.Nadam(0.01, beta_1=0.85)
    optimizer.build([variable])
    for _ in range(applies):
        optimizer.apply([np.full(3, 0.5, np.float32)], [variable])
    return optimizer


@pytest.mark.parametrize("applies", [0, 1, 2, 7, 40])
def test_the_value_after_n_steps_is_keras_own(applies):
    keras_value = float(_nadam_after(applies)._u_product.numpy())
    fresh = _nadam_after(0)
    ours = float(per_iteration.value_after(fresh, applies))
    assert ours == pytest.approx(keras_value, rel=1e-6, abs=0)
    per_iteration.set_after(fresh, applies)
    assert float(fresh._u_product.numpy()) == ours


def test_the_product_reaches_a_fixed_point_and_bad_counts_are_refused():
    fresh = _nadam_after(0)
    settled = per_iteration.value_after(fresh, 2000)
    assert 0 <= settled < 1e-40
    assert per_iteration.value_after(fresh, 10**9) == settled  # no billion-step loop
    with pytest.raises(ValueError, match="Received: -1"):
        per_iteration.value_after(_nadam_after(0), -1)


def test_the_rewinder_advances_once_per_step_and_resumes_from_the_count():
    optimizer = _nadam_after(0)
    rewinder = per_iteration.Rewinder(optimizer)
    state = optimizer._u_product
    # Three partitions of step 0, each advancing the product as an apply does.
    for _ in range(3):
        rewinder.before_update(0)
        state.assign(state.numpy() * 0.5)
    assert float(state.numpy()) == 0.5
    rewinder.before_update(1)  # the next step starts where step 0 ended
    assert float(state.numpy()) == 0.5
    rewinder.before_update(9)  # a resume: from the count, not the variable
    assert float(state.numpy()) == float(per_iteration.value_after(optimizer, 9))
    # Optimizers without per-step state are left alone.
    sgd = keras.optimizers.SGD(0.1)
    assert not per_iteration.tracked(sgd)
    per_iteration.Rewinder(sgd).before_update(3)
