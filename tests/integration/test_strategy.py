"""prophet_tf.Strategy end to end: real clusters (`python -m prophet_tf launch`).

Each cluster runs tests/integration/keras_worker.py --keras keras3 on every worker; the
workers write their final weights, predictions and what they saw to files that
the tests compare with plain single-process Keras run here, in the test
process, from the same model/data/optimizer code.

A cluster is started once per configuration and shared by the tests that look
at it (clusters are the expensive part: each task imports TensorFlow):

  sgd       2 workers, 2 PS, MLP, numpy arrays, global_clipnorm (one norm agreed by both)
  momentum  2 workers, 1 PS, MLP, tf.data.Dataset, clipnorm, gradient_accumulation_steps=2,
            LearningRateScheduler over 3 epochs of 3 steps
  rounds    2 workers, 2 PS, CNN, keras.utils.PyDataset (variables on both PS tasks), Adam
            with clipnorm (each variable whole on one PS task) and use_ema (the averages
            swapped in at the end of each fit): fit, evaluate, predict, fit again (the
            first fit's weights are kept too)
  schedule  2 workers, 2 PS, MLP with LayerNormalization and GroupNormalization, numpy,
            Nadam with ExponentialDecay, clipvalue
  bn        2 workers, 1 PS, MLP with BatchNormalization, 3 epochs
  misuse    1 worker, 1 PS: model outside scope() (2 ways), jit_compile,
            run_eagerly (in this order, in one worker process)

plus a hand-made cluster (one PS from conftest, two worker subprocesses) whose
workers build different models.
"""
from __future__ import annotations

import sys

import numpy as np
import pytest

from cluster import (KERAS_WORKER, STEPS, KerasClusters, WorkerProcesses,
                     assert_batchnorm_averages_statistics, assert_close,
                     assert_reads_see_latest_parameters, misuse_case, steps_per_epoch)

CLUSTER_TIMEOUT = 150.0  # whole launch, TensorFlow imports included, on a busy 2-core box
WATCHDOG = 90.0  # a worker prints its stacks and exits after this long

CONFIGS = {
    # global_clipnorm on 2 PS tasks: they agree on each step's norm through task 0.
    "sgd": dict(workers=2, ps=2, optimizer="sgd+global_clipnorm", model="mlp", data="numpy"),
    # Clipping rides on these: the PS clips the summed gradient. A learning rate set by
    # a callback on the workers, and gradient accumulation (the PS's), ride on momentum.
    "momentum": dict(workers=2, ps=1, optimizer="momentum+clipnorm_accumulate", model="mlp",
                     data="dataset", epochs=3, steps=3, lr_callback=True),
    # Nadam: its u_product advances once per step although each PS task applies
    # every variable on its own.
    "schedule": dict(workers=2, ps=2, optimizer="nadam_schedule+clipvalue", model="norm",
                     data="numpy"),
    "bn": dict(workers=2, ps=1, optimizer="adam", model="bn", data="numpy", epochs=3, steps=4),
    # fit -> evaluate -> predict -> fit, run twice (see test_fit_evaluate_predict_fit...).
    "rounds": dict(workers=2, ps=2, optimizer="adam+clipnorm_ema", model="cnn",
                   data="pydataset", rounds=2),
    "misuse": dict(workers=1, ps=1, optimizer="sgd", model="mlp", data="numpy",
                   scenario="misuse", watchdog=40.0),
}
CLUSTERS = KerasClusters(CONFIGS, keras="keras3", timeout=CLUSTER_TIMEOUT, watchdog=WATCHDOG)
reference = CLUSTERS.reference


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    root = tmp_path_factory.mktemp("clusters")
    return lambda name: CLUSTERS.run(name, root)


# -- 1. exactness ------------------------------------------------------------------------------

@pytest.mark.timeout(CLUSTER_TIMEOUT + 60)
def first_fit(runs, name):
    """(run, npz tag, reference) of config `name`'s first fit; "adam" is the first of the
    "rounds" cluster's two fits (one cluster for both)."""
    if name == "adam":
        run = runs("rounds")
        return run, ".round1", reference(run.config, rounds=1)
    run = runs(name)
    return run, "", reference(run.config)


@pytest.mark.parametrize("name", ["sgd", "momentum", "adam", "schedule"])
def test_weights_equal_single_process_training(runs, name):
    """After 6 or 9 steps on 2 workers at batch b: plain Keras at batch 2b, on both workers."""
    run, tag, single = first_fit(runs, name)
    run.check_ok()
    expected = single["trainable"]
    for index in range(run.config["workers"]):
        actual = run.trainable(index, tag)
        assert len(actual) == len(expected)
        for j, (a, e) in enumerate(zip(actual, expected)):
            assert_close(a, e, f"{name}: worker {index}, trainable variable {j}")
    for a, b in zip(run.trainable(0, tag), run.trainable(1, tag)):
        np.testing.assert_array_equal(a, b)  # Both pulled the same bytes.
    info = run.info(0)
    assert info["steps_per_epoch"] == steps_per_epoch(run.config)
    if "+" in run.config["optimizer"]:  # The clipping changed the result: it clipped.
        unclipped = reference(run.config, optimizer=run.config["optimizer"].split("+")[0],
                              rounds=1 if tag else run.config.get("rounds", 1))
        assert any(not np.allclose(e, u, rtol=1e-4)
                   for e, u in zip(expected, unclipped["trainable"]))


@pytest.mark.timeout(2 * CLUSTER_TIMEOUT + 60)
@pytest.mark.parametrize("attempt", [1, pytest.param(2, marks=pytest.mark.slow)])
def test_fit_evaluate_predict_fit_on_a_pydataset_ends_cleanly_and_exact(runs, tmp_path, attempt):
    """Regression: a worker died with SIGSEGV between fit and evaluate.

    The cause was TensorFlow's MultiDeviceIterator, which OneDeviceStrategy's
    distributed datasets iterate with (docs/design.md); this cluster (2 PS, Adam, CNN,
    PyDataset) met it most often. A second, fresh cluster in `make test-long`.
    """
    run = runs("rounds") if attempt == 1 else CLUSTERS.run("rounds", tmp_path, fresh=True)
    run.check_ok()
    assert "Segmentation fault" not in run.log, run.describe()
    expected = reference(run.config)["trainable"]
    for index in range(run.config["workers"]):
        for j, (a, e) in enumerate(zip(run.trainable(index), expected)):
            assert_close(a, e, f"attempt {attempt}: worker {index}, trainable variable {j}")
    assert run.info(0)["iterations"] == 2 * STEPS


@pytest.mark.timeout(CLUSTER_TIMEOUT + 60)
def test_learning_rate_callback_reaches_the_ps(runs):
    """LearningRateScheduler changes the rate on the workers; the PS must train with it."""
    run = runs("momentum")
    run.check_ok()
    expected = reference(run.config)["trainable"]
    without = reference({**run.config, "lr_callback": False})["trainable"]
    assert any(not np.allclose(e, w, rtol=1e-4) for e, w in zip(expected, without))
    for index in range(run.config["workers"]):
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


# -- 4. dataset kinds --------------------------------------------------------------------------

@pytest.mark.timeout(CLUSTER_TIMEOUT + 60)
@pytest.mark.parametrize("kind,name", [("dataset", "momentum"), ("pydataset", "adam")])
def test_dataset_kinds_split_the_global_batch(runs, kind, name):
    run, tag, single = first_fit(runs, name)
    assert run.config["data"] == kind
    run.check_ok()
    steps = [run.info(i)["steps_per_epoch"] for i in range(run.config["workers"])]
    assert steps == [steps_per_epoch(run.config)] * run.config["workers"], steps
    for j, (a, b) in enumerate(zip(run.trainable(0, tag), run.trainable(1, tag))):
        np.testing.assert_array_equal(a, b, err_msg=f"trainable variable {j}")
    # Each worker took every step on half of each batch: together, the global batch.
    for j, (a, e) in enumerate(zip(run.trainable(0, tag), single["trainable"])):
        assert_close(a, e, f"{kind}: trainable variable {j}")


# -- 5. misuse -----------------------------------------------------------------------------

@pytest.mark.timeout(CLUSTER_TIMEOUT + 60)
@pytest.mark.parametrize("case", ["outside_scope", "outside_scope_compiled_inside"])
def test_model_created_outside_scope_is_rejected(runs, case):
    result = misuse_case(runs("misuse"), case)
    assert result["raised"], result
    assert "scope" in result["message"], result["message"]


@pytest.mark.timeout(CLUSTER_TIMEOUT + 60)
def test_jit_compile_is_rejected(runs):
    result = misuse_case(runs("misuse"), "jit_compile")
    assert result["raised"], result
    assert "jit_compile" in result["message"], result["message"]


@pytest.mark.timeout(CLUSTER_TIMEOUT + 60)
def test_run_eagerly_warns_and_trains(runs):
    run = runs("misuse")
    result = misuse_case(run, "run_eagerly")
    assert not result["raised"], result.get("traceback")
    assert any("run_eagerly" in w for w in result["warnings"]), result["warnings"]
    # One worker at batch b is single-process Keras at batch b.
    expected = reference(run.config, workers=1)["trainable"]
    arrays = run.npz(0, ".run_eagerly")
    for j, e in enumerate(expected):
        assert_close(arrays[f"t{j}"], e, f"run_eagerly: trainable variable {j}")
    run.check_ok()


@pytest.mark.timeout(150)
def test_workers_with_different_models_both_fail_naming_the_variable(start_ps, tmp_path):
    """Worker i builds a hidden layer of 8 + i units: no hang, both exit non-zero."""
    rpc_timeout = 30.0  # the first Register also imports TensorFlow on the PS
    ps = start_ps("--num-workers", "2")
    config = dict(CONFIGS["sgd"], watchdog=60.0)
    argv = [sys.executable, str(KERAS_WORKER), *CLUSTERS.worker_args(config, tmp_path / "out"),
            "--hidden-by-worker", "--rpc-timeout", str(rpc_timeout)]
    with WorkerProcesses(tmp_path, [ps.address], 2, argv, CLUSTERS.env(config)) as workers:
        codes = workers.wait(110)
    texts = [workers.log(i) for i in range(2)]  # After the reaping: every line written.
    report = "\n".join(f"--- worker {i} (exit {c}):\n{t[-3000:]}"
                       for i, (c, t) in enumerate(zip(codes, texts)))
    assert all(c is not None for c in codes), "a worker hung:\n" + report
    assert all(c != 0 for c in codes), report
    # The worker whose Register was rejected, and the one the PS tells about it,
    # both name the variable that differs.
    assert all("net/hidden/kernel" in t for t in texts), report
    assert not any("Timeout (0:" in t for t in texts), \
        "the watchdog had to stop a worker:\n" + report
