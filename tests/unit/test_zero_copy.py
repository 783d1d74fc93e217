"""A PS task's sums go to TensorFlow and its new values come back without copies
(prophet_tf.ps.zero_copy): the buffers are shared, never written while shared, and
an array TensorFlow could not take as it is is copied instead."""
import os

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")

import keras  # noqa: E402
import ml_dtypes  # noqa: E402
import numpy as np  # noqa: E402
import pytest  # noqa: E402
import tensorflow as tf  # noqa: E402

from prophet_tf.ps import aggregation, zero_copy  # noqa: E402


@pytest.mark.parametrize("shape", [(), (1,), (3, 5), (1000, 7)])
@pytest.mark.parametrize("dtype", [np.float32, np.float64, np.int8])
def test_an_aligned_array_starts_on_the_alignment_with_the_shape_asked(shape, dtype):
    for _ in range(20):  # numpy's own buffers land 16 bytes off most of the time
        array = zero_copy.aligned_empty(shape, dtype)
        assert array.ctypes.data % zero_copy.ALIGNMENT == 0
        assert array.shape == shape and array.dtype == dtype and array.flags.c_contiguous


def test_an_aligned_sum_is_shared_with_its_tensor():
    array = zero_copy.aligned_empty((4, 256), np.float32)
    array[:] = 1.0
    tensor = zero_copy.to_tensor(array)
    array[0, 0] = 7.0  # only to see the sharing: the PS never writes a sum it handed over
    assert float(tensor[0, 0]) == 7.0
    assert float(tf.reduce_sum(tensor)) == 1023 + 7


@pytest.mark.parametrize("case", ["misaligned", "read-only", "strided"])
def test_an_array_tensorflow_cannot_take_as_it_is_is_copied(case):
    base = zero_copy.aligned_empty((2, 1025), np.float32)
    base[:] = np.arange(base.size, dtype=np.float32).reshape(base.shape)
    array = {"misaligned": base.reshape(-1)[1:1025],  # 4 bytes past the alignment
             "read-only": base[0],
             "strided": base[:, ::2]}[case]
    if case == "read-only":
        array.flags.writeable = False
    expected = array.copy()
    tensor = zero_copy.to_tensor(array)
    base[:] = -1.0
    # A misaligned buffer taken as it is would abort a kernel that relies on it.
    assert np.array_equal(tf.strided_slice(tensor, [0], [1]).numpy(), expected[:1])
    assert np.array_equal(tensor.numpy(), expected)


@pytest.mark.parametrize("dtype", [tf.float32, tf.float16, tf.bfloat16])
def test_a_value_comes_back_as_a_view_and_a_scalar_as_a_copy(dtype):
    tensor = tf.range(6, dtype=tf.float32) if dtype == tf.float32 else tf.cast(tf.range(6), dtype)
    array = zero_copy.to_array(tensor)
    assert not array.flags.owndata and array.dtype == dtype.as_numpy_dtype
    assert array.tolist() == list(range(6))
    scalar = zero_copy.to_array(tf.constant(3.0, dtype))  # np.asarray of it raises for bfloat16
    assert scalar.shape == () and float(scalar) == 3.0


@pytest.mark.parametrize("optimizer", [lambda: keras.optimizers.SGD(0.5),
                                       lambda: keras.optimizers.Adam(0.5)])
def test_a_value_held_across_the_next_update_keeps_its_bits(optimizer):
    """The applier publishes views of the updated variable; TensorFlow copies the
    variable's buffer before an update while such a view lives."""
    optimizer = optimizer()
    variable = keras.Variable(np.ones((8, 8), np.float32))
    optimizer.build([variable])

    @tf.function(autograph=False, input_signature=[tf.TensorSpec((8, 8), tf.float32)])
    def update(gradient):
        optimizer.apply([gradient], [variable])
        return variable.value.read_value()

    def step():
        total = zero_copy.aligned_empty((8, 8), np.float32)
        total[:] = 1.0
        return zero_copy.to_array(update(zero_copy.to_tensor(total)))

    first = step()
    kept = first.copy()
    second = step()
    assert np.array_equal(first, kept) and not np.array_equal(first, second)


@pytest.mark.parametrize("dtype", [np.float32, ml_dtypes.bfloat16, np.float16])
@pytest.mark.parametrize("rows", [[None, None, None], [1, 1, 2]])
def test_the_workers_sum_is_aligned_and_keeps_its_bits(dtype, rows):
    rng = np.random.default_rng(0)
    arrays = [rng.standard_normal(1001).astype(dtype) for _ in range(3)]
    total = aggregation.worker_order_sum(np.dtype(dtype).name, list(zip(arrays, rows)))
    sum_dtype = aggregation.SUM_DTYPES[np.dtype(dtype).name]
    weights = aggregation.share_weights(rows) or [1.0] * 3
    expected = arrays[0].astype(sum_dtype) * sum_dtype(weights[0])
    for array, weight in zip(arrays[1:], weights[1:]):
        expected += array.astype(sum_dtype) * sum_dtype(weight)
    assert total.ctypes.data % zero_copy.ALIGNMENT == 0 and total.dtype == sum_dtype
    assert np.array_equal(total.view(np.uint32), expected.view(np.uint32))
