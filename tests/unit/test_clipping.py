"""prophet_tf.ps.clipping: global_clipnorm's factor and hold, against Keras' own code."""
import os

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")

import numpy as np  # noqa: E402
import pytest  # noqa: E402
from keras.src.optimizers import base_optimizer  # noqa: E402

from prophet_tf.ps import clipping  # noqa: E402


@pytest.mark.parametrize("clip", [0.5, 100.0])  # clipping, and a norm under the clip
def test_held_partitions_are_scaled_as_keras_clips_the_whole_gradient(clip):
    rng = np.random.default_rng(0)
    kernel, bias = rng.standard_normal((6, 4)).astype(np.float32), rng.standard_normal(4)
    bias = bias.astype(np.float32)
    expected = [np.asarray(g) for g in base_optimizer.clip_by_global_norm([kernel, bias], clip)]
    hold = clipping.GlobalNorm(clip, num_parts=3)  # kernel rows 0:3 and 3:6, bias
    assert hold.add("k0", 7, kernel[:3], 7) == []
    assert hold.add("b", 7, bias, 7) == []
    assert hold.pending() == {7: 2}
    ready = {part: total for part, step, total, _ in hold.add("k1", 7, kernel[3:], 7)}
    assert hold.pending() == {}
    np.testing.assert_allclose(np.concatenate([ready["k0"], ready["k1"]]), expected[0],
                               rtol=1e-6)
    np.testing.assert_allclose(ready["b"], expected[1], rtol=1e-6)
    assert ready["b"].dtype == np.float32


def test_steps_are_held_apart():
    hold = clipping.GlobalNorm(1.0, num_parts=2)
    assert hold.add("a", 0, np.ones(2, np.float32), 0) == []
    assert hold.add("a", 1, np.ones(2, np.float32), 1) == []
    assert [s for _, s, _, _ in hold.add("b", 1, np.ones(2, np.float32), 1)] == [1, 1]
    assert hold.pending() == {0: 1}


def test_factor_of_a_zero_or_non_finite_norm_is_keras_s():
    assert clipping.scale(0.0, 1.0) == 1.0  # Nothing to clip.
    assert np.isnan(clipping.scale(float("inf"), 1.0))  # Keras' NaN scale.
    assert np.isnan(clipping.scale(float("nan"), 1.0))


@pytest.mark.parametrize("clip,num_parts", [(0.0, 1), (-1.0, 1), (1.0, 0)])
def test_bad_arguments_are_named(clip, num_parts):
    with pytest.raises(ValueError, match="Received"):
        clipping.GlobalNorm(clip, num_parts)


def test_several_ps_tasks_need_task_0s_address():
    clipping.check_placement(None, 3, "")
    clipping.check_placement(1.0, 1, "")
    clipping.check_placement(1.0, 2, "localhost:1234")
    with pytest.raises(ValueError, match=r"Received: global_clipnorm=1\.0, num_ps=2, "
                                         r"ps0_address=''"):
        clipping.check_placement(1.0, 2, "")
