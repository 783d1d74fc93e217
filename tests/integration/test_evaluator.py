"""The evaluator task: `prophet_tf.evaluate_checkpoints` on its own, then in a real TFJob-shaped
cluster (chief, worker, PS and evaluator processes, each with the TF_CONFIG the Kubeflow
operator would give it) running examples/kubernetes/train.py.

The first tests need no TensorFlow: the checkpoints are zip files written here the way Keras
writes a `.keras` file (opened in place, zipped into), and `load_fn` reads them back.
"""
from __future__ import annotations

import contextlib
import importlib.util
import io
import json
import os
import subprocess
import sys
import threading
import time
import zipfile

import pytest

import prophet_tf
from cluster import ONE_TF_THREAD, ROOT, child_env, free_port, reap, run_ps

KUBERNETES = ROOT / "examples" / "kubernetes"


def keras_like(label: str) -> bytes:
    """A zip archive shaped like a .keras file, its config naming `label`."""
    buffer = io.BytesIO()
    with zipfile.ZipFile(buffer, "w") as archive:
        archive.writestr("config.json", json.dumps({"label": label}))
        archive.writestr("model.weights.h5", os.urandom(64 << 10))
    return buffer.getvalue()


def write_slowly(path, data: bytes, pause_s: float) -> None:
    """As Keras does: open the path itself, write part, wait (a save that reads the PS), finish."""
    with open(path, "wb") as f:
        f.write(data[:len(data) // 2])
        f.flush()
        time.sleep(pause_s)
        f.write(data[len(data) // 2:])


def read_label(path) -> str:
    """load_fn of these tests: fails on anything but a whole archive."""
    with zipfile.ZipFile(path) as archive:
        return json.loads(archive.read("config.json"))["label"]


def evaluate_labels(directory, **options) -> list[tuple[str, str]]:
    options = {"poll_s": 0.05, "settle_s": 0.0, "timeout_s": 20.0, **options}
    results = prophet_tf.evaluate_checkpoints(
        directory, lambda label, path: label, load_fn=read_label, **options)
    return [(os.path.basename(e.path), e.result) for e in results]


@pytest.mark.timeout(60)
def test_each_complete_version_once_in_order_never_half_written(tmp_path):
    directory = tmp_path / "ckpt"  # created by the first save, after the evaluator starts

    def chief():
        time.sleep(0.2)
        directory.mkdir()
        write_slowly(directory / "epoch-001.keras", keras_like("1"), 0.3)
        write_slowly(directory / "epoch-002.keras", keras_like("2"), 0.3)
        (directory / "notes.txt").write_text("not a checkpoint")
        write_slowly(directory / "epoch-001.keras", keras_like("1 again"), 0.3)  # rewritten
        prophet_tf.mark_training_done(directory)

    writer = threading.Thread(target=chief)
    writer.start()
    try:
        evaluated = evaluate_labels(directory)
    finally:
        writer.join()
    assert evaluated == [("epoch-001.keras", "1"), ("epoch-002.keras", "2"),
                         ("epoch-001.keras", "1 again")]


@pytest.mark.timeout(60)
def test_the_last_checkpoint_may_be_the_marker(tmp_path):
    (tmp_path / "epoch-001.keras").write_bytes(keras_like("1"))
    writer = threading.Thread(target=write_slowly, args=(
        tmp_path / "epoch-002.keras", keras_like("2"), 0.5))
    writer.start()
    try:
        evaluated = evaluate_labels(tmp_path, done_file="epoch-002.keras")
    finally:
        writer.join()
    assert evaluated == [("epoch-001.keras", "1"), ("epoch-002.keras", "2")]


@pytest.mark.timeout(60)
def test_settle_time_holds_back_a_file_that_is_not_a_zip(tmp_path):
    """Files that are not .keras have no directory to check: only their quiet time says."""
    seen = []

    def chief():
        with open(tmp_path / "w.h5", "wb") as f:
            f.write(b"first half ")
            f.flush()
            time.sleep(0.2)  # less than settle_s: a pause longer would pass for the end
            f.write(b"second half")
        prophet_tf.mark_training_done(tmp_path)

    writer = threading.Thread(target=chief)
    writer.start()
    try:
        prophet_tf.evaluate_checkpoints(
            tmp_path, lambda data, path: seen.append(data), pattern="*.h5", poll_s=0.05,
            settle_s=2.0, timeout_s=20, load_fn=lambda p: open(p, "rb").read())
    finally:
        writer.join()
    assert seen == [b"first half second half"]


@pytest.mark.timeout(30)
def test_nothing_new_times_out_naming_the_directory(tmp_path):
    (tmp_path / "epoch-001.keras").write_bytes(keras_like("1"))
    with pytest.raises(TimeoutError, match="Received: timeout_s=0.5") as info:
        evaluate_labels(tmp_path, timeout_s=0.5)
    message = str(info.value)
    assert str(tmp_path) in message and "'training-done'" in message and "1 evaluated" in message


@pytest.mark.timeout(30)
def test_a_broken_checkpoint_once_training_is_done_is_an_error(tmp_path):
    (tmp_path / "epoch-001.keras").write_bytes(keras_like("1")[:5000])
    prophet_tf.mark_training_done(tmp_path)
    with pytest.raises(ValueError, match="not a complete file although training is done") as e:
        evaluate_labels(tmp_path)
    assert "epoch-001.keras" in str(e.value)


@pytest.mark.parametrize("kwargs, fragment", [
    ({"directory": ""}, "directory=''"),
    ({"directory": 7}, "directory=7"),
    ({"evaluate_fn": "model.evaluate"}, "evaluate_fn='model.evaluate'"),
    ({"pattern": "ckpt/*.keras"}, "pattern='ckpt/*.keras'"),
    ({"pattern": ""}, "pattern=''"),
    ({"done_file": None}, "done_file=None"),
    ({"poll_s": 0}, "poll_s=0"),
    ({"poll_s": float("inf")}, "poll_s=inf"),
    ({"settle_s": -1}, "settle_s=-1"),
    ({"timeout_s": "60"}, "timeout_s='60'"),
    ({"load_fn": "keras"}, "load_fn='keras'"),
])
def test_bad_arguments_name_what_was_received(tmp_path, kwargs, fragment):
    arguments = {"directory": tmp_path, "evaluate_fn": lambda model, path: None, **kwargs}
    with pytest.raises(ValueError, match="Received") as info:
        prophet_tf.evaluate_checkpoints(arguments.pop("directory"),
                                        arguments.pop("evaluate_fn"), **arguments)
    assert fragment in str(info.value)
    with pytest.raises(ValueError, match="done_file='a/b'"):
        prophet_tf.mark_training_done(tmp_path, "a/b")


# -- a TFJob on localhost: chief, worker, PS and evaluator ------------------------------------

# The evaluator through a wrapper that reports, once it is done, whether gRPC (which every
# connection to a PS goes through) was ever imported into its process.
EVALUATOR_WRAPPER = (
    "import runpy, sys\n"
    "sys.argv = sys.argv[1:]  # python -c CODE SCRIPT ARGS: SCRIPT becomes argv[0]\n"
    "try:\n"
    "    runpy.run_path(sys.argv[0], run_name='__main__')\n"
    "finally:\n"
    "    print('grpc imported:', 'grpc' in sys.modules, flush=True)\n")


def _module(path, name):
    spec = importlib.util.spec_from_file_location(name, path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


@pytest.mark.timeout(240)
def test_tfjob_evaluator_evaluates_the_chiefs_checkpoints(tmp_path):
    checkpoints = tmp_path / "checkpoints"
    address = lambda: f"127.0.0.1:{free_port()}"  # noqa: E731
    spec = {"chief": [address()], "evaluator": [address()], "ps": [address()],
            "worker": [address()]}

    def tf_config(kind: str) -> str:  # as the operator writes it (tests/unit/test_cluster.py)
        return json.dumps({"cluster": spec, "task": {"type": kind, "index": 0},
                           "environment": "cloud"}, separators=(",", ":"))

    script = [str(KUBERNETES / "train.py"), "--checkpoint-dir", str(checkpoints)]
    env = child_env(**ONE_TF_THREAD, PYTHONFAULTHANDLER="1")
    logs = {kind: tmp_path / f"{kind}.log" for kind in ("evaluator", "chief", "worker")}
    commands = {
        "evaluator": [sys.executable, "-c", EVALUATOR_WRAPPER, *script, "--poll-s", "0.5",
                      "--timeout-s", "150"],
        "chief": [sys.executable, *script, "--epochs", "2"],
        "worker": [sys.executable, *script, "--epochs", "2"],
    }
    started = time.monotonic()
    with run_ps(tmp_path, "--host", "127.0.0.1", tf_config=tf_config("ps")) as ps, \
            contextlib.ExitStack() as stack:
        procs = {}
        for kind, command in commands.items():  # the evaluator first: it waits for files
            with open(logs[kind], "wb") as out:
                procs[kind] = subprocess.Popen(
                    command, stdout=out, stderr=subprocess.STDOUT, cwd=ROOT,
                    env=dict(env, TF_CONFIG=tf_config(kind)), stdin=subprocess.DEVNULL)
            stack.callback(reap, procs[kind])
        deadline = time.monotonic() + 200
        codes = {}
        for kind, proc in procs.items():
            try:
                codes[kind] = proc.wait(max(deadline - time.monotonic(), 1))
            except subprocess.TimeoutExpired:
                codes[kind] = None
        text = {kind: path.read_text(errors="replace") for kind, path in logs.items()}
        assert codes == {"evaluator": 0, "chief": 0, "worker": 0}, \
            "\n".join(f"--- {k}:\n{v[-3000:]}" for k, v in text.items()) + ps.log()[-2000:]
        # The evaluator counts as no worker: the PS waited for 2, the workers are 2.
        assert "(ps 0 of 1, 2 workers;" in ps.log(), ps.log()
    print(f"TFJob on localhost: {time.monotonic() - started:.1f} s")
    assert "worker 0 of 2: training 2 epochs" in text["chief"], text["chief"]
    assert "worker 1 of 2: training 2 epochs" in text["worker"], text["worker"]
    assert "training: 2 workers, 1 PS tasks" in text["evaluator"], text["evaluator"]
    assert "grpc imported: False" in text["evaluator"], text["evaluator"]  # never dialled a PS
    assert "2 checkpoints evaluated" in text["evaluator"], text["evaluator"]
    evaluated = [json.loads(line.split("evaluator: ", 1)[1]) for line in
                 text["evaluator"].splitlines() if line.startswith("evaluator: {")]
    assert [e["checkpoint"] for e in evaluated] == ["epoch-001.keras", "epoch-002.keras"]
    # Kept on the volume; the chief waited for the last one (the TFJob ends with the chief).
    for entry in evaluated:
        stem = entry["checkpoint"].removesuffix(".keras")
        assert json.loads((checkpoints / "evaluations" / f"{stem}.json").read_text()) == entry
    assert ("worker 0 of 2: the evaluator's metrics of epoch-002.keras: "
            + json.dumps(evaluated[1])) in text["chief"], text["chief"]

    # What the evaluator printed is what loading that file here and evaluating it gives.
    import keras
    digits = _module(ROOT / "examples" / "train_digits.py", "train_digits_for_evaluator")
    _, (x_test, y_test) = digits.load_data()
    for entry in evaluated:
        model = keras.models.load_model(checkpoints / entry["checkpoint"])
        here = model.evaluate(x_test, y_test, batch_size=digits.GLOBAL_BATCH, verbose=0,
                              return_dict=True)
        assert set(here) == set(entry) - {"checkpoint"}
        for name, value in here.items():
            assert entry[name] == pytest.approx(float(value), rel=1e-6, abs=1e-7), \
                (entry["checkpoint"], name)
    # Training improved between the two checkpoints.
    assert evaluated[1]["loss"] < evaluated[0]["loss"]
