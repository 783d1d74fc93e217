"""prophet_tf.Strategy with tf_keras (Keras 2) models: real clusters, as test_strategy.

Each cluster runs tests/integration/keras_worker.py (--keras tf.keras or tf_keras)
on every worker through `python -m prophet_tf launch`; the PS tasks stay Keras 3.
The workers write their final weights and what they saw to files that the tests
compare with plain single-process tf_keras run here, in the test process, from
the same model/data/optimizer code.

  sgd          2 workers, 1 PS, MLP, numpy arrays        tf.keras, TF_USE_LEGACY_KERAS=1
               global_clipnorm (clipped on the PS)
  momentum     2 workers, 1 PS, MLP, tf.data.Dataset     `import tf_keras`, no TF_USE_LEGACY_KERAS
               clipnorm (clipped on the PS), LearningRateScheduler over 3 epochs of 3 steps
  adam         2 workers, 2 PS, CNN, tf_keras Sequence   tf.keras, TF_USE_LEGACY_KERAS=1
  schedule     2 workers, 2 PS, MLP, SGD + ExponentialDecay + clipvalue (clipped on the PS)
  bn           2 workers, 1 PS, MLP with BatchNormalization, 3 epochs
  misuse       1 worker, 1 PS: each unsupported option in turn, then AdamW with
               weight decay (bias excluded), which must train exactly
"""
from __future__ import annotations

import numpy as np
import pytest

from cluster import (STEPS, KerasClusters, assert_batchnorm_averages_statistics,
                     assert_close, assert_reads_see_latest_parameters, misuse_case,
                     steps_per_epoch)
import keras_worker as kw  # imports TensorFlow

CLUSTER_TIMEOUT = 210.0  # whole launch, TensorFlow imports included, on a busy 2-core box
WATCHDOG = 150.0  # a worker prints its stacks and exits after this long

# keras: how the worker gets tf_keras; "tf.keras" (the default) sets TF_USE_LEGACY_KERAS=1.
CONFIGS = {
    "sgd": dict(workers=2, ps=1, optimizer="sgd+global_clipnorm", model="mlp", data="numpy"),
    "momentum": dict(workers=2, ps=1, optimizer="momentum+clipnorm", model="mlp",
                     data="dataset", keras="tf_keras", epochs=3, steps=3, lr_callback=True),
    "adam": dict(workers=2, ps=2, optimizer="adam", model="cnn", data="sequence"),
    "schedule": dict(workers=2, ps=2, optimizer="schedule+clipvalue", model="mlp",
                     data="numpy"),
    "bn": dict(workers=2, ps=1, optimizer="adam", model="bn", data="numpy", epochs=3, steps=4),
    "misuse": dict(workers=1, ps=1, optimizer="adamw", model="mlp", data="numpy",
                   scenario="misuse", watchdog=110.0),
}
CLUSTERS = KerasClusters(CONFIGS, keras="tf.keras", timeout=CLUSTER_TIMEOUT, watchdog=WATCHDOG)
reference = CLUSTERS.reference


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    root = tmp_path_factory.mktemp("tf_keras_clusters")
    return lambda name: CLUSTERS.run(name, root)


# -- 1. exactness ------------------------------------------------------------------------------

@pytest.mark.timeout(CLUSTER_TIMEOUT + 60)
@pytest.mark.parametrize("name", ["sgd", "momentum", "adam", "schedule"])
def test_weights_equal_single_process_training(runs, name):
    """After 6 or 9 steps on 2 workers at batch b: plain tf_keras at batch 2b, on both workers."""
    run = runs(name)
    run.check_ok()
    expected = reference(run.config)["trainable"]
    for index in range(run.config["workers"]):
        info = run.info(index)
        assert info["keras"].startswith("tf_keras"), info["keras"]  # Not Keras 3.
        actual = run.trainable(index)
        assert len(actual) == len(expected)
        for j, (a, e) in enumerate(zip(actual, expected)):
            assert_close(a, e, f"{name}: worker {index}, trainable variable {j}")
        assert info["steps_per_epoch"] == steps_per_epoch(run.config)
        # The worker's optimizer counted every step.
        assert info["iterations"] == sum(steps_per_epoch(run.config))
    for a, b in zip(run.trainable(0), run.trainable(1)):
        np.testing.assert_array_equal(a, b)  # Both pulled the same bytes.
    # The PS ran a Keras 3 optimizer even though the workers use tf_keras.
    assert f"optimizer {'Adam' if name == 'adam' else 'SGD'}" in run.log, run.describe()
    if "+" in run.config["optimizer"]:  # The clipping changed the result: it clipped.
        unclipped = reference({**run.config, "optimizer": run.config["optimizer"].split("+")[0]})
        assert any(not np.allclose(e, u, rtol=1e-4)
                   for e, u in zip(expected, unclipped["trainable"]))


@pytest.mark.timeout(CLUSTER_TIMEOUT + 60)
def test_learning_rate_callback_reaches_the_ps(runs):
    """tf_keras's LearningRateScheduler changes the rate on the workers; the PS trains with it."""
    run = runs("momentum")
    run.check_ok()
    expected = reference(run.config)["trainable"]
    without = reference(run.config, lr_callback=False)["trainable"]
    assert any(not np.allclose(e, w, rtol=1e-4) for e, w in zip(expected, without))
    for index in range(run.config["workers"]):
        assert run.info(index)["history"]["lr"] == pytest.approx([0.1, 0.05, 0.025])
        for j, (a, e) in enumerate(zip(run.trainable(index), expected)):
            assert_close(a, e, f"momentum: worker {index}, trainable variable {j}")


# -- 2. BatchNorm --------------------------------------------------------------------------

@pytest.mark.timeout(CLUSTER_TIMEOUT + 60)
def test_batchnorm_trains_and_averages_its_statistics_over_workers(runs):
    run = runs("bn")
    run.check_ok()
    assert_batchnorm_averages_statistics(run)


# -- 3. reads after fit ----------------------------------------------------------------------

@pytest.mark.timeout(CLUSTER_TIMEOUT + 60)
def test_evaluate_predict_get_weights_see_latest_parameters(runs):
    run = runs("sgd")
    run.check_ok()
    # get_weights after fit: the last step's parameters (= single-process step 6).
    assert_reads_see_latest_parameters(run, reference(run.config)["trainable"],
                                      whole_data=True)


# -- 4. misuse -----------------------------------------------------------------------------

@pytest.mark.timeout(CLUSTER_TIMEOUT + 60)
@pytest.mark.parametrize("case,fragments", [
    ("outside_scope", ["scope"]),
    ("use_ema", ["use_ema", "Received: use_ema=True"]),
    ("legacy_optimizer", ["legacy", "use tf_keras.optimizers.SGD"]),
    ("adaptive_epsilon", ["adaptive_epsilon", "Received: adaptive_epsilon=True"]),
    ("custom_schedule", ["schedule", "Received: learning_rate=", "Halving"]),
    ("jit_compile", ["jit_compile", "XLA"]),
    ("mixed_precision", ["mixed precision", "Received: variable", "AutoCastVariable"]),
])
def test_unsupported_use_is_rejected_with_a_clear_error(runs, case, fragments):
    assert case in kw.MISUSE_CASES["tf_keras"]
    result = misuse_case(runs("misuse"), case)
    assert result["raised"], result
    assert result["type"] == "ValueError", result
    for fragment in fragments:
        assert fragment in result["message"], result["message"]


@pytest.mark.timeout(CLUSTER_TIMEOUT + 60)
def test_after_rejections_a_valid_model_trains_exactly(runs):
    """The rejected cases changed nothing: AdamW (bias excluded from decay) trains as tf_keras."""
    run = runs("misuse")
    result = misuse_case(run, "valid")
    assert not result["raised"], result.get("traceback")
    assert result["value"]["steps_per_epoch"] == [STEPS]
    # One worker at batch b is single-process tf_keras at batch b.
    expected = reference(run.config, workers=1)["trainable"]
    actual = run.trainable(0, ".valid")
    assert len(actual) == len(expected)
    for j, (a, e) in enumerate(zip(actual, expected)):
        assert_close(a, e, f"misuse/valid: trainable variable {j}")
    assert "optimizer AdamW" in run.log, run.describe()
    run.check_ok()
