"""prophet_tf.progress: the worker's status file and the launcher's board."""
import io
import json
import os
import pathlib
import subprocess
import sys
import time

import pytest

from prophet_tf import progress
from prophet_tf.tools import board as board_lib

ROOT = pathlib.Path(__file__).resolve().parents[2]


class Clock:
    def __init__(self):
        self.now = 100.0

    def __call__(self):
        return self.now


# -- status file -----------------------------------------------------------------------------


def test_writer_merges_fields_and_writes_atomically(tmp_path):
    path = tmp_path / "status.json"
    clock = Clock()
    writer = progress.StatusWriter(str(path), min_interval_s=1.0, clock=clock)
    writer.update(step=1)
    status = json.loads(path.read_text())
    assert status["step"] == 1 and status["pid"] == os.getpid() and "time" in status
    clock.now += 1.5
    writer.update(epoch=2)
    assert json.loads(path.read_text())["step"] == 1  # merged, not replaced
    assert json.loads(path.read_text())["epoch"] == 2
    assert sorted(p.name for p in tmp_path.iterdir()) == ["status.json"]  # no temp file left
    assert writer.writes == 2


def test_writer_throttles_then_writes_the_latest(tmp_path):
    path = tmp_path / "status.json"
    writer = progress.StatusWriter(str(path), min_interval_s=0.3)
    writer.update(step=1)
    for step in range(2, 50):
        writer.update(step=step)
    assert json.loads(path.read_text())["step"] == 1 and writer.writes == 1
    deadline = time.monotonic() + 5
    while json.loads(path.read_text())["step"] != 49 and time.monotonic() < deadline:
        time.sleep(0.05)
    assert json.loads(path.read_text())["step"] == 49  # the timer wrote the pending update
    assert writer.writes == 2


def test_writer_flush_writes_pending_update(tmp_path):
    path = tmp_path / "status.json"
    writer = progress.StatusWriter(str(path), min_interval_s=60)
    writer.update(step=1)
    writer.update(step=2)
    writer.flush()
    assert json.loads(path.read_text())["step"] == 2
    writes = writer.writes
    writer.flush()  # nothing pending: no write
    assert writer.writes == writes


def test_writer_rejects_empty_path():
    with pytest.raises(ValueError, match="Received: path=''"):
        progress.StatusWriter("")


def test_writer_survives_unwritable_directory(tmp_path):
    writer = progress.StatusWriter(str(tmp_path / "missing" / "status.json"), min_interval_s=0)
    writer.update(step=1)  # best effort: no exception
    assert not (tmp_path / "missing").exists()


def test_read_status(tmp_path):
    assert progress.read_status(str(tmp_path / "none.json")) is None
    bad = tmp_path / "bad.json"
    bad.write_text("{half")
    assert progress.read_status(str(bad)) is None
    bad.write_text("[1]")
    assert progress.read_status(str(bad)) is None
    bad.write_text('{"step": 4}')
    assert progress.read_status(str(bad)) == {"step": 4}


def _python(code, env):
    return subprocess.run([sys.executable, "-c", code], env=env, cwd=ROOT, capture_output=True,
                          text=True, timeout=60)


@pytest.mark.timeout(60)
def test_report_from_env_flushes_last_update_at_exit(tmp_path):
    path = tmp_path / "w.json"
    env = dict(os.environ, PYTHONPATH=str(ROOT), PROPHET_TF_STATUS_FILE=str(path))
    result = _python("import sys\n"
                     "from prophet_tf import progress\n"
                     "for step in range(1, 101): progress.report(step=step)\n"
                     "progress.report(epoch=3)\n"
                     "print('tensorflow' in sys.modules)", env)
    assert result.returncode == 0, result.stderr
    assert result.stdout.strip() == "False"  # no TensorFlow import
    assert json.loads(path.read_text())["step"] == 100
    assert json.loads(path.read_text())["epoch"] == 3


@pytest.mark.timeout(60)
def test_report_without_env_does_nothing(tmp_path):
    env = dict(os.environ, PYTHONPATH=str(ROOT))
    env.pop("PROPHET_TF_STATUS_FILE", None)
    result = _python("from prophet_tf import progress\n"
                     "progress.report(step=1)\n"
                     "print(progress.writer())", env)
    assert result.returncode == 0 and result.stdout.strip() == "None", result.stderr


@pytest.mark.timeout(120)
def test_keras_callback_reports_epochs(tmp_path, monkeypatch):
    import keras
    import numpy as np
    path = tmp_path / "k.json"
    monkeypatch.setattr(progress, "_writer", progress.StatusWriter(str(path), min_interval_s=0))
    monkeypatch.setattr(progress, "_writer_made", True)
    model = keras.Sequential([keras.Input((2,)), keras.layers.Dense(1)])
    model.compile(optimizer="sgd", loss="mse")
    model.fit(np.zeros((8, 2)), np.zeros((8, 1)), epochs=3, verbose=0,
              callbacks=[progress.keras_callback()])
    status = json.loads(path.read_text())
    assert status["epoch"] == 3 and status["epochs"] == 3


# -- board -----------------------------------------------------------------------------------


def _board(**kwargs):
    out, clock = io.StringIO(), Clock()
    return board_lib.Board(out=out, clock=clock, **kwargs), out, clock


def _lines(out):
    return out.getvalue().splitlines()


def test_board_state_lines():
    board, out, clock = _board(interval_s=10)
    board.add("ps 0", "ps")
    board.healthy("ps 0", "127.0.0.1:5000")
    board.add("worker 0", "worker")
    board.progress("worker 0", None)  # nothing written yet: still starting
    board.progress("worker 0", {"step": 1})
    board.progress("worker 0", {"step": 2})  # same epoch, within the interval: silent
    clock.now += 11
    board.progress("worker 0", {"step": 30, "epoch": 1, "epochs": 4})  # epoch appears: shown
    board.progress("worker 0", {"step": 31, "epoch": 1})  # silent
    clock.now += 11
    board.progress("worker 0", {"step": 60, "epoch": 1})  # interval over: shown
    board.progress("worker 0", {"step": 61, "epoch": 2})  # new epoch: shown at once
    clock.now += 5
    board.exited("worker 0", 0)
    board.exited("ps 0", 0, stopped_by_launcher=True)
    assert _lines(out) == [
        "prophet-tf launch: ps 0: starting",
        "prophet-tf launch: ps 0: healthy at 127.0.0.1:5000",
        "prophet-tf launch: worker 0: starting",
        "prophet-tf launch: worker 0: training, step 1",
        "prophet-tf launch: worker 0: training, epoch 1/4, step 30",
        "prophet-tf launch: worker 0: training, epoch 1/4, step 60",
        "prophet-tf launch: worker 0: training, epoch 2/4, step 61",
        "prophet-tf launch: worker 0: done, epoch 2/4, step 61, after 27.0 s",
        "prophet-tf launch: ps 0: stopped, after 27.0 s",
    ]
    assert board.state("worker 0") == "done" and board.state("ps 0") == "stopped"


def test_board_interval_zero_prints_state_and_epoch_changes_only():
    board, out, clock = _board(interval_s=0)
    board.add("worker 0", "worker")
    board.progress("worker 0", {"step": 1})
    for step in range(2, 100):
        clock.now += 100
        board.progress("worker 0", {"step": step})
    board.progress("worker 0", {"step": 100, "epoch": 2})
    assert len(_lines(out)) == 3, _lines(out)


def test_board_failure_and_summary():
    board, out, clock = _board()
    board.add("ps 0", "ps")
    board.add("worker 0", "worker")
    board.add("worker 1", "worker")
    board.progress("worker 0", {"step": 7, "epoch": 1})
    clock.now += 2.5
    board.exited("worker 0", 3)
    board.exited("worker 1", -15, stopped_by_launcher=True)
    board.exited("ps 0", 0, stopped_by_launcher=True)
    assert "prophet-tf launch: worker 0: failed (exit code 3), epoch 1, step 7, after 2.5 s" \
        in _lines(out)
    table = board.summary("summary of attempt 1").splitlines()
    assert table[0] == "prophet-tf launch: summary of attempt 1"
    assert table[1].split() == ["task", "state", "exit", "code", "wall", "time", "last", "step"]
    assert table[2].split() == ["ps", "0", "stopped", "0", "2.5", "s", "-"]
    assert table[3].split() == ["worker", "0", "failed", "3", "2.5", "s", "7", "(epoch", "1)"]
    assert table[4].split() == ["worker", "1", "stopped", "-15", "(SIGTERM)", "2.5", "s", "-"]
    # Columns line up.
    assert len({line.index("state") if "state" in line else None for line in table[1:2]}) == 1
    assert table[2].index("stopped") == table[1].index("state")


def test_board_quiet_prints_failures_only():
    board, out, _ = _board(verbose=False)
    board.add("ps 0", "ps")
    board.healthy("ps 0", "x:1")
    board.add("worker 0", "worker")
    board.progress("worker 0", {"step": 3})
    board.exited("worker 0", 1)
    assert _lines(out) == ["prophet-tf launch: worker 0: failed (exit code 1), step 3, "
                           "after 0.0 s"]


def test_board_rejects_negative_interval():
    with pytest.raises(ValueError, match="Received: -1"):
        board_lib.Board(interval_s=-1)


def test_describe_exit():
    assert board_lib.describe_exit(0) == "0"
    assert board_lib.describe_exit(3) == "3"
    assert board_lib.describe_exit(-9) == "-9 (SIGKILL)"
    assert board_lib.describe_exit(-99) == "-99"
