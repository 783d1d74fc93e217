"""Real PS tasks in subprocesses on free ports, always reaped."""

import contextlib
import dataclasses
import os
import pathlib
import subprocess
import sys
import time

import pytest

ROOT = pathlib.Path(__file__).resolve().parents[2]
START_TIMEOUT = 120.0  # importing TensorFlow on a busy 2-core machine


@dataclasses.dataclass
class PSProcess:
    proc: subprocess.Popen
    port: int
    log_path: pathlib.Path

    @property
    def address(self) -> str:
        return f"127.0.0.1:{self.port}"

    def log(self) -> str:
        return self.log_path.read_text(errors="replace")


def _reap(proc: subprocess.Popen) -> None:
    if proc.poll() is None:
        proc.terminate()
        try:
            proc.wait(10)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait(10)


@contextlib.contextmanager
def run_ps(tmp_dir: pathlib.Path, *args: str, tf_config: str | None = None):
    """Starts ``python -m prophet_tf.ps.server --port 0 --port-file F ARGS``.

    With ``tf_config``, TF_CONFIG is set to it and ``--port 0`` left out (the
    port comes from the cluster spec); otherwise TF_CONFIG is unset.
    Yields a PSProcess once the port file exists; terminates (then kills) the
    process on exit, whatever happened.
    """
    port_file = tmp_dir / "port"
    log_path = tmp_dir / "ps.log"
    env = dict(os.environ, PYTHONPATH=str(ROOT), TF_CPP_MIN_LOG_LEVEL="2",
               TF_NUM_INTRAOP_THREADS="1", TF_NUM_INTEROP_THREADS="1",
               PROPHET_TF_LOG_LEVEL="INFO")
    env.pop("TF_CONFIG", None)
    if tf_config is not None:
        env["TF_CONFIG"] = tf_config
    port_args = [] if tf_config is not None else ["--port", "0"]
    with open(log_path, "wb") as log:
        proc = subprocess.Popen(
            [sys.executable, "-m", "prophet_tf.ps.server", *port_args,
             "--port-file", str(port_file), *args],
            stdout=log, stderr=subprocess.STDOUT, env=env, cwd=ROOT)
    try:
        deadline = time.monotonic() + START_TIMEOUT
        while not port_file.exists():
            if proc.poll() is not None:
                raise RuntimeError(f"PS exited with {proc.returncode}:\n{log_path.read_text()}")
            if time.monotonic() > deadline:
                raise RuntimeError(f"PS did not start in {START_TIMEOUT} s:\n"
                                   f"{log_path.read_text()}")
            time.sleep(0.05)
        yield PSProcess(proc, int(port_file.read_text()), log_path)
    finally:
        _reap(proc)


@pytest.fixture(scope="module")
def ps2(tmp_path_factory):
    """One PS task for W=2 with 32-byte partitions, shared by a module."""
    with run_ps(tmp_path_factory.mktemp("ps2"), "--num-workers", "2",
                "--max-partition-bytes", "32") as ps:
        yield ps


@pytest.fixture
def start_ps(tmp_path):
    """Factory for PS tasks owned by one test."""
    stack = contextlib.ExitStack()
    count = 0

    def start(*args, tf_config=None):
        nonlocal count
        count += 1
        directory = tmp_path / f"ps{count}"
        directory.mkdir()
        return stack.enter_context(run_ps(directory, *args, tf_config=tf_config))

    with stack:
        yield start
