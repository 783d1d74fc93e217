"""prophet_tf.ps.clipping: the clipping factors and the hold, against Keras' own code."""
import os
import types

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")

import keras  # noqa: E402
import numpy as np  # noqa: E402
import pytest  # noqa: E402
from keras.src.optimizers import base_optimizer  # noqa: E402

from prophet_tf.ps import clipping, sharding  # noqa: E402
from prophet_tf.ps.v1 import ps_pb2  # noqa: E402


def part(key: int):
    """What the hold reads of a partition: its variable's key."""
    return types.SimpleNamespace(plan=types.SimpleNamespace(key=key))


def scaled(ready):
    """part id -> the released total scaled by its factor, as the apply does (float32)."""
    return {id(p): (total * m) / d for p, _, total, _, (m, d) in ready}


def gradients():
    rng = np.random.default_rng(0)
    return [rng.standard_normal(s).astype(np.float32) for s in ((6, 4), (4,))]


@pytest.mark.parametrize("clip", [0.5, 100.0])  # clipping, and a norm under the clip
def test_held_partitions_are_scaled_as_keras_clips_the_whole_gradient(clip):
    kernel, bias = gradients()
    expected = [np.asarray(g) for g in base_optimizer.clip_by_global_norm([kernel, bias], clip)]
    hold = clipping.NormHold(clip, False, {0: 3})  # kernel rows 0:3 and 3:6, bias
    k0, k1, b = part(0), part(0), part(1)
    assert hold.add(k0, 7, kernel[:3], 7) == []
    assert hold.add(b, 7, bias, 7) == []
    assert hold.pending() == {7: 2}
    ready = scaled(hold.add(k1, 7, kernel[3:], 7))
    assert hold.pending() == {}
    np.testing.assert_allclose(np.concatenate([ready[id(k0)], ready[id(k1)]]), expected[0],
                               rtol=1e-6)
    np.testing.assert_allclose(ready[id(b)], expected[1], rtol=1e-6)
    assert ready[id(b)].dtype == np.float32


@pytest.mark.parametrize("clip", [0.5, 100.0])
def test_clipnorm_scales_each_variable_by_its_own_norm_as_keras(clip):
    kernel, bias = gradients()
    optimizer = keras.optimizers.SGD(clipnorm=clip)
    expected = [np.asarray(optimizer._clip_by_norm(g)) for g in (kernel, bias)]
    hold = clipping.NormHold(clip, True, {0: 2, 1: 1})
    b = part(1)
    ready = scaled(hold.add(b, 3, bias, 3))  # the bias is whole: released at once
    np.testing.assert_allclose(ready[id(b)], expected[1], rtol=1e-6)
    k0, k1 = part(0), part(0)
    assert hold.add(k0, 3, kernel[:3], 3) == []
    ready = scaled(hold.add(k1, 3, kernel[3:], 3))
    np.testing.assert_allclose(np.concatenate([ready[id(k0)], ready[id(k1)]]), expected[0],
                               rtol=1e-6)
    assert hold.pending() == {}


@pytest.mark.parametrize("per_variable", [False, True])
def test_with_accumulation_only_every_nth_step_is_clipped_by_the_average_s_norm(per_variable):
    """Keras accumulates steps 0 and 1 of 3 unclipped and clips (g + accumulator) / 3 at
    step 2 (the hold's iteration, the optimizer's raw step counter)."""
    kernel, bias = gradients()
    accumulators = {0: 2 * kernel, 1: -bias}
    average = [(kernel + accumulators[0]) / np.float32(3), (bias + accumulators[1]) / np.float32(3)]
    optimizer = keras.optimizers.SGD(clipnorm=0.5)
    expected = ([np.asarray(optimizer._clip_by_norm(g)) for g in average] if per_variable else
                [np.asarray(g) for g in base_optimizer.clip_by_global_norm(average, 0.5)])
    hold = clipping.NormHold(0.5, per_variable, {0: 1, 1: 1} if per_variable else {0: 2},
                             accumulation_steps=3,
                             accumulated=lambda p: accumulators[p.plan.key])
    k, b = part(0), part(1)
    for iteration in (0, 1, 3, 4):
        (released,) = hold.add(k, iteration, kernel, iteration)
        assert released[2] is kernel and released[4] == clipping.UNSCALED
    ready = hold.add(k, 2, kernel, 2) + hold.add(b, 2, bias, 2)
    assert hold.pending() == {}
    # Released as summed: Keras' own apply averages, and the factor clips the average
    # where Keras clips (clipping.scaled_by).
    assert all(r[2] is g for r, g in zip(ready, (kernel, bias)))
    for (_, _, _, _, (m, d)), avg, want in zip(ready, average, expected):
        np.testing.assert_allclose((avg * m) / d, want, rtol=1e-6)
        assert (m, d) != clipping.UNSCALED  # it clips


def test_accumulation_needs_the_accumulators():
    with pytest.raises(ValueError, match="Received: accumulation_steps=2, accumulated=None"):
        clipping.NormHold(1.0, False, {0: 1}, accumulation_steps=2)


def test_scaled_by_clips_inside_keras_apply_where_keras_clips():
    """The factor replaces Keras' own clipping step: after the accumulated average."""
    import tensorflow as tf
    kernel, bias = gradients()
    variable = keras.Variable(np.zeros_like(kernel))
    reference = keras.Variable(np.zeros_like(kernel))
    ours = keras.optimizers.SGD(1.0, gradient_accumulation_steps=2)
    keras_own = keras.optimizers.SGD(1.0, gradient_accumulation_steps=2, clipnorm=0.5)
    ours.build([variable])
    keras_own.build([reference])
    average = (kernel + 2 * kernel) / np.float32(2)
    m, d = clipping.clip_by_norm_factor(float(np.sum(np.square(average, dtype=np.float64))),
                                        0.5)
    for g in (kernel, 2 * kernel):
        with clipping.scaled_by(ours, tf.constant(m), tf.constant(d)):
            ours.apply([tf.constant(g)], [variable])
        keras_own.apply([tf.constant(g)], [reference])
    assert "_clip_gradients" not in vars(ours)  # the class's again
    np.testing.assert_allclose(variable.numpy(), reference.numpy(), rtol=1e-6)
    assert np.abs(variable.numpy()).max() > 0


def test_a_zero_gradient_stays_zero_under_clipnorm():
    k = part(0)
    ready = scaled(clipping.NormHold(1.0, True, {0: 1}).add(k, 0, np.zeros(3, np.float32), 0))
    np.testing.assert_array_equal(ready[id(k)], np.zeros(3, np.float32))


def test_steps_are_held_apart():
    hold = clipping.NormHold(1.0, False, {0: 2})
    assert hold.add(part(0), 0, np.ones(2, np.float32), 0) == []
    assert hold.add(part(0), 1, np.ones(2, np.float32), 1) == []
    assert [r[1] for r in hold.add(part(1), 1, np.ones(2, np.float32), 1)] == [1, 1]
    assert hold.pending() == {0: 1}


def test_factor_of_a_zero_or_non_finite_norm_is_keras_s():
    assert clipping.scale(0.0, 1.0) == 1.0  # Nothing to clip.
    assert np.isnan(clipping.scale(float("inf"), 1.0))  # Keras' NaN scale.
    assert np.isnan(clipping.scale(float("nan"), 1.0))


@pytest.mark.parametrize("clip,counts", [(0.0, {0: 1}), (-1.0, {0: 1}), (1.0, {}),
                                         (1.0, {0: 0})])
def test_bad_arguments_are_named(clip, counts):
    with pytest.raises(ValueError, match="Received"):
        clipping.NormHold(clip, False, counts)


def test_shared_groups_are_the_variables_on_several_tasks():
    specs = [ps_pb2.VariableSpec(key=0, name="k", shape=[64, 4], dtype="float32"),
             ps_pb2.VariableSpec(key=1, name="b", shape=[4], dtype="float32")]
    plan = sharding.plan(specs, 2, 64, spread=True)
    shared, tasks = clipping.shared_groups(plan, per_variable=True)
    assert 0 in shared and tasks == [0, 1]
    assert clipping.shared_groups(plan, per_variable=False) == ((0,), [0, 1])
    one = sharding.plan(specs, 1, 64, spread=True)
    assert clipping.shared_groups(one, per_variable=True) == ((), [])


def test_norms_over_several_tasks_need_task_0s_address():
    clipping.check_placement(False, 3, "", "clipnorm=1.0")
    clipping.check_placement(True, 2, "localhost:1234", "clipnorm=1.0")
    with pytest.raises(ValueError, match=r"Received: global_clipnorm=1\.0, num_ps=2, "
                                         r"ps0_address=''"):
        clipping.check_placement(True, 2, "", "global_clipnorm=1.0")
