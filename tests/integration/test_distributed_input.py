"""tf.distribute idioms on real clusters: distributed datasets, custom loops, any worker count.

Each cluster runs tests/integration/input_worker.py on every worker (3 workers, 2 PS
tasks: shares of 2, 3 and 3 rows of a global batch of 8, then 1, 1 and 2 of the
last batch): fit on experimental_distribute_dataset, fit on
distribute_datasets_from_function, then a custom loop with strategy.run,
apply_gradients, strategy.reduce and strategy.gather. The same program on the
default strategy in one process is the reference.
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
        self.arrays = {n: dict(np.load(out_dir / f"{n}.npz")) for n in names}
        self.info = {n: json.loads((out_dir / f"{n}.json").read_text()) for n in names}


def launch(tmp_path, workers: int, scheduler: str = "fifo") -> Result:
    out = tmp_path / f"{scheduler}-w{workers}"
    code = _run([sys.executable, "-m", "prophet_tf", "launch", "--workers", str(workers),
                 "--ps", "2", "--scheduler", scheduler, "--", sys.executable,
                 str(INPUT_WORKER), "--out", str(out)], tmp_path / f"{out.name}.log", _env())
    log = (tmp_path / f"{out.name}.log").read_text(errors="replace")
    assert code == 0, f"cluster exited with {code}:\n{log[-6000:]}"
    return Result(out, [f"worker{i}" for i in range(workers)])


@pytest.fixture(scope="module")
def single(tmp_path_factory):
    """The same program on the default strategy, for a cluster of W workers."""
    runs = {}

    def get(workers: int) -> Result:
        if workers not in runs:
            tmp = tmp_path_factory.mktemp(f"single-w{workers}")
            code = _run([sys.executable, str(INPUT_WORKER), "--single", "--workers",
                         str(workers), "--out", str(tmp)], tmp / "single.log", _env())
            assert code == 0, (tmp / "single.log").read_text(errors="replace")[-6000:]
            runs[workers] = Result(tmp, ["single"])
        return runs[workers]

    return get


@pytest.fixture(scope="module")
def clusters(tmp_path_factory):
    tmp, runs = tmp_path_factory.mktemp("clusters"), {}

    def get(workers: int, scheduler: str = "fifo") -> Result:
        if (workers, scheduler) not in runs:
            runs[workers, scheduler] = launch(tmp, workers, scheduler)
        return runs[workers, scheduler]

    return get


def assert_matches_single_process(run: Result, single: Result) -> None:
    expected = single.arrays["single"]
    for name, arrays in run.arrays.items():
        for key in sorted(k for k in expected if k.startswith("t")):
            assert_close(arrays[key], expected[key], f"{name}: trainable variable {key}")
        # Every worker reports every step's loss over the whole global batch.
        assert_close(arrays["losses"], expected["losses"], f"{name}: reduced losses")
        for key in ("gathered_first", "gathered_last"):
            np.testing.assert_array_equal(arrays[key], expected[key], err_msg=f"{name} {key}")
        fits, reference = run.info[name]["history"], single.info["single"]["history"]
        for fit, ref in zip(fits, reference):
            for metric in ref:
                assert_close(fit[metric], ref[metric], f"{name}: fit {metric}")
        assert run.info[name]["iterations"] == single.info["single"]["iterations"]


@pytest.mark.timeout(2 * CLUSTER_TIMEOUT)
def test_three_uneven_workers_train_every_idiom_as_single_process(clusters, single):
    """Shares of 2, 3, 3 rows (and 1, 1, 2 of the last batch): no row is split twice or
    dropped, each worker's gradient weighs its rows, every reduced loss is the cluster's."""
    assert_matches_single_process(clusters(3), single(3))


@pytest.mark.timeout(2 * CLUSTER_TIMEOUT)
def test_sums_do_not_depend_on_the_scheduler(clusters):
    """The PS adds the workers in worker order: Prophet's weights are FIFO's, bit for bit."""
    fifo, prophet = clusters(3, "fifo"), clusters(3, "prophet")
    for name in fifo.arrays:
        for key, value in fifo.arrays[name].items():
            np.testing.assert_array_equal(prophet.arrays[name][key], value, err_msg=key)


@pytest.mark.slow
@pytest.mark.timeout(3 * CLUSTER_TIMEOUT)
@pytest.mark.parametrize("scheduler", ["p3", "bytescheduler"])
def test_sums_do_not_depend_on_the_scheduler_long(clusters, scheduler):
    fifo, other = clusters(3, "fifo"), clusters(3, scheduler)
    for name in fifo.arrays:
        for key, value in fifo.arrays[name].items():
            np.testing.assert_array_equal(other.arrays[name][key], value, err_msg=key)


@pytest.mark.slow
@pytest.mark.timeout(2 * CLUSTER_TIMEOUT)
def test_five_workers_with_a_last_partial_batch_train_as_single_process(clusters, single):
    """5 workers: shares of 1 or 2 rows of 8, and of 0 or 1 of the last batch of 4."""
    assert_matches_single_process(clusters(5), single(5))
