"""tf_keras optimizers described to the Keras 3 PS: same update, clear errors.

Each convertible tf_keras optimizer (and schedule) is applied for a few steps
next to the Keras 3 optimizer rebuilt from its converted config, on the same
gradients; the weights must agree. The last tests go through the real PS
servicer (no network), as a worker's Register and Push would.
"""
import json
import os

os.environ.setdefault("TF_NUM_INTRAOP_THREADS", "1")
os.environ.setdefault("TF_NUM_INTEROP_THREADS", "1")
os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")

import keras  # noqa: E402
import numpy as np  # noqa: E402
import pytest  # noqa: E402
import tensorflow as tf  # noqa: E402
import tf_keras  # noqa: E402

from prophet_tf import _keras_compat  # noqa: E402
from prophet_tf import keras_optimizer  # noqa: E402
from prophet_tf import strategy as strategy_lib  # noqa: E402
from prophet_tf import strategy_checks  # noqa: E402
from prophet_tf.optimizer_policy import NO_WEIGHT_DECAY_KEY  # noqa: E402
from prophet_tf.ps.servicer import ParameterServerServicer  # noqa: E402
from prophet_tf.ps.v1 import ps_pb2  # noqa: E402

pytestmark = pytest.mark.timeout(180)

SHAPES = [(6, 4), (4,)]
STEPS = 5
RTOL = 1e-5
T = tf_keras.optimizers
S = tf_keras.optimizers.schedules


def start_values(seed=0):
    rng = np.random.default_rng(seed)
    return [rng.standard_normal(s).astype(np.float32) for s in SHAPES]


def gradients(step):
    rng = np.random.default_rng(100 + step)
    return [rng.standard_normal(s).astype(np.float32) for s in SHAPES]


def train_tf_keras(optimizer, values):
    variables = [tf.Variable(v, name=f"v{i}") for i, v in enumerate(values)]
    for step in range(STEPS):
        optimizer.apply_gradients(zip([tf.constant(g) for g in gradients(step)], variables))
    return [v.numpy() for v in variables]


def train_keras3(config, values):
    config = json.loads(json.dumps(config))  # What crosses the wire.
    config.pop(NO_WEIGHT_DECAY_KEY, None)
    optimizer = keras.optimizers.deserialize(config)
    assert isinstance(optimizer, keras.optimizers.Optimizer), optimizer
    variables = [keras.Variable(v) for v in values]
    for step in range(STEPS):
        optimizer.apply([keras.ops.convert_to_tensor(g) for g in gradients(step)], variables)
    return [v.numpy() for v in variables]


def assert_close(actual, expected, what):
    for j, (a, e) in enumerate(zip(actual, expected)):
        scale = max(float(np.max(np.abs(e))), 1e-30)
        error = float(np.max(np.abs(a - e))) / scale
        assert error <= RTOL, f"{what}, variable {j}: max relative error {error:.3g}"


OPTIMIZERS = {
    "SGD": lambda: T.SGD(0.1),
    "SGD-momentum-nesterov": lambda: T.SGD(0.05, momentum=0.9, nesterov=True),
    "Adam": lambda: T.Adam(0.01, beta_1=0.8, epsilon=1e-6),
    "Adam-amsgrad": lambda: T.Adam(0.01, amsgrad=True),
    "AdamW": lambda: T.AdamW(0.01, weight_decay=0.05),
    "RMSprop": lambda: T.RMSprop(0.01, rho=0.8),
    "RMSprop-centered-momentum": lambda: T.RMSprop(0.01, momentum=0.5, centered=True),
    "Adagrad": lambda: T.Adagrad(0.1, initial_accumulator_value=0.2),
    "Adadelta": lambda: T.Adadelta(1.0, rho=0.9),
    "Adamax": lambda: T.Adamax(0.01),
    "Ftrl": lambda: T.Ftrl(0.1, l1_regularization_strength=0.01,
                           l2_regularization_strength=0.02, beta=0.1),
    "Lion": lambda: T.Lion(0.001, beta_1=0.8),
    "Adafactor": lambda: T.Adafactor(0.1),
    "SGD-weight-decay": lambda: T.SGD(0.1, momentum=0.5, weight_decay=0.01),
}

SCHEDULES = {
    "ExponentialDecay": lambda: S.ExponentialDecay(0.2, decay_steps=2, decay_rate=0.7),
    "ExponentialDecay-staircase": lambda: S.ExponentialDecay(0.2, 2, 0.7, staircase=True),
    "PiecewiseConstantDecay": lambda: S.PiecewiseConstantDecay([1, 3], [0.3, 0.2, 0.05]),
    "PolynomialDecay": lambda: S.PolynomialDecay(0.2, 4, end_learning_rate=0.01, power=2.0),
    "InverseTimeDecay": lambda: S.InverseTimeDecay(0.2, 1, 0.5),
    "CosineDecay": lambda: S.CosineDecay(0.2, 4, alpha=0.1),
    "CosineDecay-warmup": lambda: S.CosineDecay(0.0, 3, warmup_target=0.2, warmup_steps=2),
    "CosineDecayRestarts": lambda: S.CosineDecayRestarts(0.2, 2, t_mul=2.0, m_mul=0.5),
}


@pytest.mark.parametrize("name", sorted(OPTIMIZERS))
def test_converted_optimizer_applies_the_same_update(name):
    values = start_values()
    optimizer = OPTIMIZERS[name]()
    config = _keras_compat.keras3_optimizer_config(optimizer)
    assert config["class_name"] == type(optimizer).__name__
    assert "jit_compile" not in config["config"]
    assert "is_legacy_optimizer" not in config["config"]
    expected = train_tf_keras(optimizer, values)
    assert any(not np.allclose(e, v) for e, v in zip(expected, values))  # It trained.
    assert_close(train_keras3(config, values), expected, name)


@pytest.mark.parametrize("name", sorted(SCHEDULES))
def test_converted_schedule_gives_the_same_rates_and_update(name):
    schedule = SCHEDULES[name]()
    config = _keras_compat.keras3_optimizer_config(T.SGD(schedule))
    rebuilt = keras.optimizers.schedules.deserialize(config["config"]["learning_rate"])
    assert type(rebuilt).__name__ == type(schedule).__name__
    for step in range(12):
        np.testing.assert_allclose(float(rebuilt(step)), float(schedule(step)), rtol=1e-6,
                                   err_msg=f"{name} at step {step}")
    values = start_values()
    expected = train_tf_keras(T.SGD(SCHEDULES[name](), momentum=0.5), values)
    momentum_config = _keras_compat.keras3_optimizer_config(T.SGD(SCHEDULES[name](),
                                                                  momentum=0.5))
    assert_close(train_keras3(momentum_config, values), expected, name)


def test_learning_rate_set_by_a_callback_is_in_the_config_and_read_live():
    optimizer = T.SGD(0.1)
    tf_keras.backend.set_value(optimizer.lr, 0.025)  # What LearningRateScheduler does.
    config = _keras_compat.keras3_optimizer_config(optimizer)
    assert config["config"]["learning_rate"] == pytest.approx(0.025)
    read = _keras_compat.learning_rate_reader(optimizer)
    assert read() == pytest.approx(0.025)
    tf_keras.backend.set_value(optimizer.lr, 0.5)
    assert read() == pytest.approx(0.5)
    assert _keras_compat.learning_rate_reader(T.SGD(S.ExponentialDecay(0.1, 1, 0.9))) is None


def test_keras3_optimizers_are_untouched():
    optimizer = keras.optimizers.Adam(0.003)
    assert _keras_compat.is_optimizer(optimizer)
    assert not _keras_compat.is_tf_keras_optimizer(optimizer)
    expected = json.loads(json.dumps(keras.optimizers.serialize(optimizer)))
    # The worker unscales the gradient it pushes: the PS must not again.
    del expected["config"]["loss_scale_factor"]
    assert json.loads(keras_optimizer.config_json(optimizer)) == expected
    read = _keras_compat.learning_rate_reader(optimizer)
    assert read() == pytest.approx(0.003)
    assert not _keras_compat.is_optimizer(object())


def test_optimizer_is_found_in_the_update_closure():
    optimizer = T.Adam(0.01)

    def outer():
        def apply_grad_to_update_var(var, grad):  # Like tf_keras's update function.
            return optimizer, var, grad
        return apply_grad_to_update_var

    assert strategy_checks.optimizer_of(outer()) is optimizer
    with pytest.raises(ValueError, match="Keras optimizer"):
        strategy_checks.optimizer_of(lambda var, grad: None)


class MySGD(T.SGD):
    pass


class Halving(S.LearningRateSchedule):
    def __call__(self, step):
        return 0.1 * tf.pow(0.5, tf.cast(step, tf.float32))


@pytest.mark.parametrize("make,fragments", [
    (lambda: T.legacy.SGD(0.1), ["legacy", "tf_keras.optimizers.SGD", "Received: optimizer="]),
    (lambda: T.legacy.Adam(0.1), ["legacy", "tf_keras.optimizers.Adam"]),
    (lambda: MySGD(0.1), ["built-in", "Received: optimizer=", "MySGD"]),
    (lambda: tf_keras.mixed_precision.LossScaleOptimizer(T.SGD(0.1)),
     ["LossScaleOptimizer", "Received: optimizer="]),
    (lambda: T.Nadam(0.01), ["Nadam", "u_product", "once per variable",
                             "keras.optimizers.Nadam", "Received: optimizer=tf_keras"]),
    (lambda: T.Adam(0.01, adaptive_epsilon=True), ["adaptive_epsilon",
                                                   "Received: adaptive_epsilon=True"]),
    (lambda: T.SGD(Halving()), ["schedule", "Received: learning_rate=", "Halving"]),
])
def test_unconvertible_optimizers_are_named(make, fragments):
    optimizer = make()
    assert _keras_compat.is_tf_keras_optimizer(optimizer)
    with pytest.raises(ValueError) as raised:
        keras_optimizer.config_json(optimizer)
    for fragment in fragments:
        assert fragment in str(raised.value), str(raised.value)


@pytest.mark.parametrize("option,value", [("use_ema", True)])
def test_unsupported_tf_keras_options_are_named(option, value):
    optimizer = T.SGD(0.1, **{option: value})
    with pytest.raises(ValueError) as raised:
        strategy_lib.optimizer_config(optimizer, [])
    message = str(raised.value)
    assert option in message and f"Received: {option}={value!r}" in message, message


# -- through the PS servicer ---------------------------------------------------------------

class Context:
    """Records ``abort`` like grpc.ServicerContext (which raises too)."""

    def __init__(self):
        self.code = self.details = None

    def abort(self, code, details):
        self.code, self.details = code, details
        raise RuntimeError(f"{code}: {details}")

    def time_remaining(self):
        return 10.0

    def is_active(self):
        return True


def ps_train(config_json, values):
    """One worker registers `values` with a fresh PS, pushes STEPS steps, pulls each."""
    servicer = ParameterServerServicer(1)
    try:
        specs = [ps_pb2.VariableSpec(key=i, name=f"net/v{i}", shape=v.shape, dtype="float32",
                                     priority=i) for i, v in enumerate(values)]
        servicer.Register(ps_pb2.RegisterRequest(
            worker_id=0, num_workers=1, variables=specs, optimizer_config=config_json,
            initial_values=[ps_pb2.ParameterChunk(key=i, partition=0, dtype="float32",
                                                  data=v.tobytes())
                            for i, v in enumerate(values)]), Context())
        current = values
        for step in range(STEPS):
            servicer.Push(ps_pb2.PushRequest(worker_id=0, chunks=[
                ps_pb2.GradientChunk(key=i, partition=0, step=step, dtype="float32",
                                     data=g.tobytes())
                for i, g in enumerate(gradients(step))]), Context())
            request = ps_pb2.PullRequest(worker_id=0, min_version=step + 1, items=[
                ps_pb2.KeyPartition(key=i, partition=0) for i in range(len(values))])
            chunks = [c for b in servicer.Pull(request, Context())
                      for c in ps_pb2.ParameterChunks.FromString(b).chunks]
            assert [c.version for c in chunks] == [step + 1] * len(values)
            current = [np.frombuffer(c.data, np.float32).reshape(v.shape)
                       for c, v in zip(chunks, values)]
        return current
    finally:
        servicer.close()


def test_ps_applies_tf_keras_adamw_with_exclusions_and_a_schedule():
    """The worker's Register config, rebuilt by the PS: the same weights as tf_keras."""
    values = start_values(3)

    def make():
        optimizer = T.AdamW(S.ExponentialDecay(0.05, decay_steps=1, decay_rate=0.8),
                            weight_decay=0.2)
        optimizer.exclude_from_weight_decay(var_names=["bias"])
        return optimizer

    optimizer = make()
    variables = [tf.Variable(v, name=n) for v, n in zip(values, ["kernel", "bias"])]
    config_json = keras_optimizer.config_json(optimizer, variables)
    assert json.loads(config_json)[NO_WEIGHT_DECAY_KEY] == [1]  # The bias, by key.
    for step in range(STEPS):
        optimizer.apply_gradients(zip([tf.constant(g) for g in gradients(step)], variables))
    expected = [v.numpy() for v in variables]
    assert_close(ps_train(config_json, values), expected, "PS AdamW")
    # Without the exclusion the bias would differ: the exclusion reached the PS.
    plain = keras_optimizer.config_json(
        T.AdamW(S.ExponentialDecay(0.05, decay_steps=1, decay_rate=0.8), weight_decay=0.2))
    assert not np.allclose(ps_train(plain, values)[1], expected[1], rtol=1e-6, atol=0)


def test_mixed_precision_variables_are_recognised():
    tf_keras.mixed_precision.set_global_policy("mixed_float16")
    try:
        layer = tf_keras.layers.Dense(2)
        layer.build((None, 3))
    finally:
        tf_keras.mixed_precision.set_global_policy("float32")
    assert _keras_compat.is_autocast_variable(layer.kernel)
    assert not _keras_compat.is_autocast_variable(tf.Variable(1.0))
    assert not _keras_compat.is_autocast_variable(keras.Variable(1.0))


@pytest.mark.parametrize("option,value", [("clipnorm", 1.0), ("clipvalue", 0.5),
                                          ("global_clipnorm", 1.0)])
def test_tf_keras_clipping_reaches_the_ps_as_the_keras_3_option(option, value):
    """The PS clips the summed gradient with the Keras 3 optimizer's own option."""
    config = json.loads(keras_optimizer.config_json(T.SGD(0.1, **{option: value})))
    assert config["config"][option] == value
