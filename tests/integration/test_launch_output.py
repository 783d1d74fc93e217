"""`prophet-tf launch` keeps TensorFlow's start-up chatter out of what a user reads.

TensorFlow 2.21 prints an absl banner at import, and on CPUs where it turns
oneDNN on by default (not on every x86 CPU) a oneDNN notice, before its logging
honours TF_CPP_MIN_LOG_LEVEL. The launcher gives every task
TF_CPP_MIN_LOG_LEVEL=2 unless the caller set it, and drops those lines when the
task's level hides informational messages; TF_CPP_MIN_LOG_LEVEL=0 shows all.
"""
import functools
import subprocess
import sys

import pytest

from cluster import launch_env, run_prophet

# A worker that imports TensorFlow (as every training script does) and says which level it got.
WORKER = "import os, tensorflow; print('level', os.environ.get('TF_CPP_MIN_LOG_LEVEL'))"
BANNERS = ("All log messages before absl::InitializeLog() is called",
           "oneDNN custom operations are on")


@functools.cache
def banners_tensorflow_prints() -> tuple[str, ...]:
    """The BANNERS this machine's TensorFlow prints at import, launcher or not."""
    env = launch_env()
    env["TF_CPP_MIN_LOG_LEVEL"] = "0"
    result = subprocess.run([sys.executable, "-c", "import tensorflow"], env=env,
                            capture_output=True, text=True, timeout=120)
    return tuple(b for b in BANNERS if b in result.stdout + result.stderr)


@pytest.mark.timeout(240)
@pytest.mark.parametrize("level,expected_level,shown", [(None, "2", False), ("0", "0", True)])
def test_tensorflow_startup_banners_follow_the_log_level(level, expected_level, shown):
    printed = banners_tensorflow_prints()
    # The absl banner comes on every machine: without it there is nothing to test.
    assert BANNERS[0] in printed, printed
    env = launch_env()
    env.pop("TF_CPP_MIN_LOG_LEVEL", None)  # child_env sets it; the caller's shell may not
    if level is not None:
        env["TF_CPP_MIN_LOG_LEVEL"] = level
    result = run_prophet("launch", "--workers", "1", "--ps", "1", "--", sys.executable, "-c",
                         WORKER, env=env, timeout=200)
    output = result.stdout + result.stderr
    assert result.returncode == 0, output[-4000:]
    assert f"[worker 0] level {expected_level}" in result.stdout, output[-4000:]
    # The PS task imports TensorFlow only when a worker declares a model, which this
    # one never does: it prints no banner at any level, the worker as the level says.
    for banner in printed:
        for task, expected in (("[worker 0]", shown), ("[ps 0]", False)):
            lines = [line for line in output.splitlines()
                     if line.startswith(task) and banner in line]
            assert bool(lines) == expected, f"{task} {banner!r}: {lines}\n{output[-4000:]}"
