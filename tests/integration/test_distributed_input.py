"""tf.distribute idioms on real clusters: distributed datasets, custom loops, any worker count.

Each cluster runs tests/integration/input_worker.py on every worker (3 workers, 2 PS
tasks: shares of 2, 3 and 3 rows of a global batch of 8, then 1, 1 and 2 of the
last batch), a model with BatchNormalization(synchronized=True) (the global batch's
moments, through PS task 0, forward and back): fit on experimental_distribute_dataset, fit on
distribute_datasets_from_function, a custom loop with strategy.run,
apply_gradients, strategy.reduce and strategy.gather, evaluate and predict on a
distributed dataset, and a tf.train.Checkpoint, which a second cluster resumes
from. The same program on the default strategy in one process is the reference.
"""
from __future__ import annotations

import json
import subprocess
import sys

import numpy as np
import pytest

from cluster import HERE, ROOT, assert_close, child_env, reap_group

INPUT_WORKER = HERE / "input_worker.py"
CLUSTER_TIMEOUT = 180.0


def _run(command: list, log_path, env) -> int | None:
    with open(log_path, "wb") as log:
        proc = subprocess.Popen(command, stdout=log, stderr=subprocess.STDOUT, env=env,
                                cwd=ROOT, start_new_session=True)
    try:
        return proc.wait(CLUSTER_TIMEOUT)
    except subprocess.TimeoutExpired:
        return None
    finally:
        reap_group(proc)


def _env():
    return child_env(drop=("TF_CONFIG", "PROPHET_TF_SCHEDULER", "TF_USE_LEGACY_KERAS"),
                     TF_NUM_INTRAOP_THREADS="1", TF_NUM_INTEROP_THREADS="2",
                     OMP_NUM_THREADS="1", PYTHONFAULTHANDLER="1")


class Result:
    def __init__(self, out_dir, names):
        self.out_dir = out_dir
        self.arrays = {n: dict(np.load(out_dir / f"{n}.npz")) for n in names}
        self.info = {n: json.loads((out_dir / f"{n}.json").read_text()) for n in names}


def launch(tmp_path, workers: int, scheduler: str = "fifo", resume_from=None,
           keras: str = "keras3") -> Result:
    out = tmp_path / f"{keras}-{scheduler}-w{workers}{'-resumed' if resume_from else ''}"
    extra = ["--resume-from", str(resume_from)] if resume_from else []
    extra += ["--keras", keras]
    code = _run([sys.executable, "-m", "prophet_tf", "launch", "--workers", str(workers),
                 "--ps", "2", "--scheduler", scheduler, "--", sys.executable,
                 str(INPUT_WORKER), "--out", str(out), *extra],
                tmp_path / f"{out.name}.log", _env())
    log = (tmp_path / f"{out.name}.log").read_text(errors="replace")
    assert code == 0, f"cluster exited with {code}:\n{log[-6000:]}"
    suffix = "-resumed" if resume_from else ""
    return Result(out, [f"worker{i}{suffix}" for i in range(workers)])


@pytest.fixture(scope="module")
def single(tmp_path_factory):
    """The same program on the default strategy, for a cluster of W workers."""
    runs = {}

    def get(workers: int, keras: str = "keras3") -> Result:
        if (workers, keras) not in runs:
            tmp = tmp_path_factory.mktemp(f"single-{keras}-w{workers}")
            code = _run([sys.executable, str(INPUT_WORKER), "--single", "--workers",
                         str(workers), "--keras", keras, "--out", str(tmp)],
                        tmp / "single.log", _env())
            assert code == 0, (tmp / "single.log").read_text(errors="replace")[-6000:]
            runs[workers, keras] = Result(tmp, ["single", "single-resumed"])
        return runs[workers, keras]

    return get


@pytest.fixture(scope="module")
def clusters(tmp_path_factory):
    tmp, runs = tmp_path_factory.mktemp("clusters"), {}

    def get(workers: int, scheduler: str = "fifo", resume_from=None,
            keras: str = "keras3") -> Result:
        key = (workers, scheduler, resume_from, keras)
        if key not in runs:
            runs[key] = launch(tmp, workers, scheduler, resume_from, keras)
        return runs[key]

    return get


def assert_matches_single_process(run: Result, single: Result, tag="single") -> None:
    expected, expected_info = single.arrays[tag], single.info[tag]
    for name, arrays in run.arrays.items():
        # The synchronized BatchNormalization's moving statistics too: the global batch's.
        variables = sorted(k for k in expected if k[0] in "tn" and k[1:].isdigit())
        assert len(variables) == 7, variables
        for key in variables:
            assert_close(arrays[key], expected[key], f"{name}: variable {key}")
        # Every worker reports every step's loss over the whole global batch.
        assert_close(arrays["losses"], expected["losses"], f"{name}: reduced losses")
        # A metric updated inside strategy.run reads the cluster's rows, as under MWMS.
        assert_close(arrays["loop_accuracy"], expected["loop_accuracy"], f"{name}: metric")
        for key in ("gathered_first", "gathered_last"):
            np.testing.assert_array_equal(arrays[key], expected[key], err_msg=f"{name} {key}")
        # The step's own all_reduce and all_gather (not the optimizer's): the cluster's.
        for key in ("all_reduce_sum", "all_reduce_mean"):
            assert_close(arrays[key], expected["losses"], f"{name}: {key} of the loss")
        for key in ("first", "last"):
            np.testing.assert_array_equal(arrays[f"all_gather_{key}"],
                                          expected[f"gathered_{key}"],
                                          err_msg=f"{name} all_gather, {key} step")
        assert run.info[name]["iterations"] == expected_info["iterations"]
        if tag != "single":
            continue  # A resumed run is one loop epoch.
        # predict over a distributed dataset: the whole data, in order, on every worker.
        assert_close(arrays["predict"], expected["predict"], f"{name}: predict")
        for fit, ref in zip(run.info[name]["history"], expected_info["history"]):
            for metric in ref:
                assert_close(fit[metric], ref[metric], f"{name}: fit {metric}")
        for metric, value in expected_info["evaluate"].items():
            assert_close(run.info[name]["evaluate"][metric], value, f"{name}: evaluate {metric}")


@pytest.mark.timeout(2 * CLUSTER_TIMEOUT)
def test_three_uneven_workers_train_every_idiom_as_single_process(clusters, single):
    """Shares of 2, 3, 3 rows (and 1, 1, 2 of the last batch): no row is split twice or
    dropped, each worker's gradient weighs its rows, every reduced loss is the cluster's."""
    assert_matches_single_process(clusters(3), single(3))


@pytest.mark.timeout(2 * CLUSTER_TIMEOUT)
def test_tf_keras_trains_every_idiom_as_single_process(clusters, single):
    """The same program with tf_keras (Keras 2): fit over distributed datasets (with
    steps_per_epoch, as tf_keras asks), the custom loop, evaluate and predict."""
    run = clusters(3, keras="tf_keras")
    assert_matches_single_process(run, single(3, keras="tf_keras"))
    for name, info in run.info.items():
        # Its optimizer's state is the PS's, which only Keras 3 saves hold: refused.
        assert "tf_keras optimizer's state" in (info["checkpoint_error"] or ""), name
        assert "Received: a tf.train.Checkpoint of tf_keras" in info["checkpoint_error"]


def test_a_checkpoint_of_a_custom_loop_holds_the_ps_optimizer_state(clusters, single):
    """tf.train.Checkpoint(model=, optimizer=) saves what the PS trained (Adam's moments,
    not the worker's untrained copy): every saved value as single-process saves it."""
    import tensorflow as tf

    expected = tf.train.load_checkpoint(str(single(3).out_dir / "single-checkpoint"))
    saved = tf.train.load_checkpoint(str(clusters(3).out_dir / "worker0-checkpoint"))
    names = sorted(expected.get_variable_to_shape_map())
    assert sorted(saved.get_variable_to_shape_map()) == names
    slots = [n for n in names if n.startswith("optimizer/_variables/")]
    assert len(slots) >= 8, names  # Adam: two moments per variable
    for name in names:
        if not name.startswith("_CHECKPOINTABLE_OBJECT_GRAPH"):
            assert_close(saved.get_tensor(name), expected.get_tensor(name), name)


@pytest.mark.timeout(2 * CLUSTER_TIMEOUT)
def test_a_custom_loop_resumes_from_its_checkpoint_on_a_new_cluster(clusters, single):
    """The checkpoint restored into a new job's model and optimizer: the next epoch
    trains as single-process training resumed from its own checkpoint."""
    first = clusters(3)
    resumed = clusters(3, resume_from=first.out_dir / "worker0-checkpoint")
    assert_matches_single_process(resumed, single(3), tag="single-resumed")


@pytest.mark.slow
@pytest.mark.timeout(3 * CLUSTER_TIMEOUT)
@pytest.mark.parametrize("scheduler", ["prophet", "p3", "bytescheduler", "fifo-again"])
def test_sums_do_not_depend_on_the_scheduler(clusters, tmp_path, scheduler):
    """The PS adds the workers in worker order: every scheduler's weights, and a second
    FIFO run's, are FIFO's, bit for bit, with every input idiom. (test_scheduling.py
    checks each scheduler's bits on one model and one PS task: Prophet's in make test.)"""
    fifo = clusters(3, "fifo")
    other = launch(tmp_path, 3, "fifo") if scheduler == "fifo-again" else clusters(3, scheduler)
    for name in fifo.arrays:
        for key, value in fifo.arrays[name].items():
            np.testing.assert_array_equal(other.arrays[name][key], value, err_msg=key)


@pytest.mark.slow
@pytest.mark.timeout(2 * CLUSTER_TIMEOUT)
@pytest.mark.parametrize("keras", ["keras3", "tf_keras"])
def test_five_workers_with_a_last_partial_batch_train_as_single_process(clusters, single,
                                                                        keras):
    """5 workers: shares of 1 or 2 rows of 8, and of 0 or 1 of the last batch of 4."""
    assert_matches_single_process(clusters(5, keras=keras), single(5, keras=keras))
