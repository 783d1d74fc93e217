"""`prophet-tf launch --restart K` and the PS checkpoint flags: real PS tasks, tiny workers.

Workers (no TensorFlow) append a JSON line per run to a log file: their
attempt's PS addresses and the command lines of their siblings (the
launcher's other children, i.e. the PS tasks), then fail or succeed as told.
"""
import json
import sys
import textwrap

import pytest

from cluster import launch_env, run_prophet

WORKER = textwrap.dedent(r'''
    import json, os, sys

    def siblings():
        out = {}
        for entry in os.listdir("/proc"):
            if not entry.isdigit() or int(entry) == os.getpid():
                continue
            try:
                stat = open(f"/proc/{entry}/stat").read()
                cmdline = open(f"/proc/{entry}/cmdline", "rb").read().split(b"\0")
            except OSError:
                continue
            if int(stat.rpartition(")")[2].split()[1]) == os.getppid():
                out[entry] = [part.decode() for part in cmdline if part]
        return out

    mode, log, marker = sys.argv[1], sys.argv[2], sys.argv[3]
    config = json.loads(os.environ["TF_CONFIG"])
    index = config["task"]["index"]
    with open(log, "a") as f:
        f.write(json.dumps({"index": index, "ps": config["cluster"]["ps"],
                            "ps_argv": [a for a in siblings().values() if "ps" in a]}) + "\n")
    if mode == "fail-once":
        if index == 0 and not os.path.exists(marker):
            open(marker, "w").close()
            sys.exit(4)
        sys.exit(0)
    if mode == "always-fail":
        sys.exit(4 if index == 0 else 0)
    sys.exit(0)
''')


@pytest.fixture
def worker(tmp_path):
    path = tmp_path / "worker.py"
    path.write_text(WORKER)
    return path


def _run(args, timeout=240):
    return run_prophet("launch", *args, env=launch_env(), timeout=timeout)


def _runs(log):
    return [json.loads(line) for line in log.read_text().splitlines()]


@pytest.mark.timeout(240)
def test_restart_after_a_failure_then_success(worker, tmp_path):
    log, marker = tmp_path / "runs.log", tmp_path / "failed-once"
    result = _run(["--workers", "2", "--ps", "1", "--restart", "2", "--", sys.executable,
                   str(worker), "fail-once", str(log), str(marker)])
    assert result.returncode == 0, result.stdout + result.stderr
    err = result.stderr
    assert "prophet-tf launch: attempt 1 of 3\n" in err
    assert ("prophet-tf launch: attempt 2 of 3; the previous attempt failed: worker 0 exited "
            "with code 4") in err
    assert "attempt 3 of 3" not in err
    assert "summary of attempt 1" in err and "summary of attempt 2" in err
    assert marker.exists()
    runs = _runs(log)
    # Attempt 1: worker 0 ran (and failed); worker 1 may or may not have got
    # to write before being stopped. Attempt 2: both ran, on a new PS.
    first_ps = runs[0]["ps"]
    second = [r for r in runs if r["ps"] != first_ps]
    assert sorted(r["index"] for r in second) == [0, 1], runs
    assert len({tuple(r["ps"]) for r in runs}) == 2  # the PS was restarted (new port)


@pytest.mark.timeout(300)
def test_restart_gives_up_after_k_plus_one_attempts(worker, tmp_path):
    log = tmp_path / "runs.log"
    result = _run(["--workers", "1", "--ps", "1", "--restart", "2", "--", sys.executable,
                   str(worker), "always-fail", str(log), str(tmp_path / "unused")])
    assert result.returncode == 4, result.stdout + result.stderr
    err = result.stderr
    for attempt in (1, 2, 3):
        assert f"attempt {attempt} of 3" in err
        assert f"summary of attempt {attempt}" in err
    assert "attempt 4" not in err
    assert err.count("the previous attempt failed: worker 0 exited with code 4") == 2, err
    runs = _runs(log)
    assert len(runs) == 3 and len({tuple(r["ps"]) for r in runs}) == 3


@pytest.mark.timeout(120)
def test_no_restart_by_default(worker, tmp_path):
    log = tmp_path / "runs.log"
    result = _run(["--workers", "1", "--ps", "1", "--", sys.executable, str(worker),
                   "always-fail", str(log), str(tmp_path / "unused")])
    assert result.returncode == 4
    assert "attempt" not in result.stderr and len(_runs(log)) == 1
    assert "prophet-tf launch: summary\n" in result.stderr


@pytest.mark.timeout(120)
def test_checkpoint_flags_reach_every_ps(worker, tmp_path):
    log, directory = tmp_path / "runs.log", tmp_path / "ckpt"
    result = _run(["--workers", "1", "--ps", "2", "--checkpoint-dir", str(directory),
                   "--checkpoint-steps", "5", "--checkpoint-secs", "2.5", "--", sys.executable,
                   str(worker), "ok", str(log), str(tmp_path / "unused")])
    assert result.returncode == 0, result.stdout + result.stderr
    (run,) = _runs(log)
    ps_argv = sorted(run["ps_argv"], key=lambda a: a[a.index("--ps-index") + 1])
    assert len(ps_argv) == 2
    for i, argv in enumerate(ps_argv):
        assert argv[argv.index("--ps-index") + 1] == str(i)
        assert argv[argv.index("--checkpoint-dir") + 1] == str(directory / f"ps-{i}")
        assert argv[argv.index("--checkpoint-steps") + 1] == "5"
        assert float(argv[argv.index("--checkpoint-secs") + 1]) == 2.5


@pytest.mark.timeout(60)
@pytest.mark.parametrize("args, message", [
    (["--restart", "-1"], "--restart must be >= 0. Received: --restart=-1"),
    (["--checkpoint-steps", "5"], "need --checkpoint-dir. Received: checkpoint_steps=5"),
    (["--checkpoint-dir", "d", "--checkpoint-steps", "0"],
     "checkpoint_steps must be an integer >= 1. Received: 0"),
    (["--checkpoint-dir", "d", "--checkpoint-secs", "0"], "checkpoint_secs must be > 0"),
])
def test_bad_restart_and_checkpoint_flags(args, message, tmp_path):
    result = _run(["--workers", "1", "--ps", "1", *args, "--", "true"], timeout=30)
    assert result.returncode == 2, result.stderr
    assert message in result.stderr and "Traceback" not in result.stderr
    assert "[ps" not in result.stdout and "starting" not in result.stderr
