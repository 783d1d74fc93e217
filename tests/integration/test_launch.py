"""`prophet-tf launch`: real PS tasks, tiny worker scripts (no TensorFlow).

Workers report what they see as JSON lines ("REPORT {...}"): their pid, their
TF_CONFIG, PROPHET_TF_SCHEDULER, the health status of every PS address and the
pids of their siblings (the launcher's other children, PS tasks included), so
the test can check after the launcher returned that none of them is left.
"""
import json
import os
import signal
import subprocess
import sys
import textwrap
import time

import pytest

from cluster import ROOT, launch_env, reap, run_prophet
from process_helpers import children, kill_leftovers, state, wait_gone

WORKER = textwrap.dedent(r'''
    import json, os, sys, time

    def siblings():
        out = []
        for entry in os.listdir("/proc"):
            if not entry.isdigit() or int(entry) == os.getpid():
                continue
            try:
                stat = open(f"/proc/{entry}/stat").read()
            except OSError:
                continue
            if int(stat.rpartition(")")[2].split()[1]) == os.getppid():
                out.append(int(entry))
        return out

    def health(addresses):
        import grpc
        from grpc_health.v1 import health_pb2, health_pb2_grpc
        status = {}
        for address in addresses:
            with grpc.insecure_channel(address) as channel:
                # The launcher gives every task the cluster's token.
                token = os.environ["PROPHET_TF_TOKEN"]
                reply = health_pb2_grpc.HealthStub(channel).Check(
                    health_pb2.HealthCheckRequest(), timeout=10,
                    metadata=(("authorization", "Bearer " + token),))
                status[address] = health_pb2.HealthCheckResponse.ServingStatus.Name(reply.status)
        return status

    config = json.loads(os.environ["TF_CONFIG"])
    index = config["task"]["index"]
    mode = sys.argv[1]
    report = {"pid": os.getpid(), "index": index, "tf_config": config,
              "scheduler": os.environ.get("PROPHET_TF_SCHEDULER"), "siblings": siblings()}
    if mode == "check":
        report["health"] = health(config["cluster"]["ps"])
    print("REPORT " + json.dumps(report), flush=True)
    print(f"hello from worker {index}", flush=True)
    if mode == "check":
        sys.exit(0)
    if mode == "selfkill":
        import signal
        os.kill(os.getpid(), signal.SIGKILL)
    if mode == "sleep" or (mode == "fail1" and index == 1):
        open(sys.argv[2] + f".{index}", "w").close()   # "my pid is printed"
        time.sleep(120)
        sys.exit(0)
    # fail1, worker 0: fail once worker 1 is up and has reported.
    while not os.path.exists(sys.argv[2] + ".1"):
        time.sleep(0.05)
    sys.exit(3)
''')


@pytest.fixture
def worker_script(tmp_path):
    path = tmp_path / "worker.py"
    path.write_text(WORKER)
    return path


def _launch_argv(*args):
    return [sys.executable, "-m", "prophet_tf", "launch", *args]


def _reports(output):
    return sorted((json.loads(line.split("REPORT ", 1)[1]) for line in output.splitlines()
                   if "REPORT " in line), key=lambda r: r["index"])


def _run(args, timeout=120):
    return run_prophet("launch", *args, env=launch_env(), timeout=timeout)


def _start(tmp_path, args, extra_env=None):
    """Starts the launcher, its output to tmp_path/launch.log; returns (process, log path)."""
    log = tmp_path / "launch.log"
    # The launcher's temporary directory goes under this test's tmp_path (every child's
    # TMPDIR is already off /tmp: conftest.children_tmpdir), so a test that SIGKILLs the
    # launcher can find the directory it leaves.
    env = dict(launch_env(), TMPDIR=str(tmp_path), **(extra_env or {}))
    with open(log, "wb") as f:
        proc = subprocess.Popen(_launch_argv(*args), env=env, cwd=ROOT, stdout=f,
                                stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL)
    return proc, log


def _start_and_wait(tmp_path, args, want_reports, timeout=120):
    """Starts the launcher (output to a file) and waits for `want_reports` REPORT lines."""
    proc, log = _start(tmp_path, args)
    deadline = time.monotonic() + timeout
    while len(_reports(log.read_text(errors="replace"))) < want_reports:
        if proc.poll() is not None or time.monotonic() > deadline:
            reap(proc)
            pytest.fail(f"launcher exited ({proc.returncode}) or timed out before the "
                        f"workers reported:\n{log.read_text(errors='replace')}")
        time.sleep(0.1)
    return proc, log


@pytest.mark.timeout(120)
def test_workers_get_own_tf_config_and_serving_ps(worker_script):
    # The README's "name:option=value" form reaches every worker as it was given.
    result = _run(["--workers", "2", "--ps", "2", "--scheduler", "prophet:blocks_in_flight=4",
                   "--", sys.executable, str(worker_script), "check"])
    assert result.returncode == 0, result.stdout + result.stderr
    reports = _reports(result.stdout)
    assert [r["index"] for r in reports] == [0, 1]
    cluster = reports[0]["tf_config"]["cluster"]
    assert len(cluster["worker"]) == 2 and len(cluster["ps"]) == 2
    assert len(set(cluster["ps"])) == 2
    for i, r in enumerate(reports):
        assert r["tf_config"] == {"cluster": cluster, "task": {"type": "worker", "index": i}}
        assert r["health"] == {address: "SERVING" for address in cluster["ps"]}
        assert r["scheduler"] == "prophet:blocks_in_flight=4"
    # Every line carries its task's name.
    lines = result.stdout.splitlines()
    for i in range(2):
        assert f"[worker {i}] hello from worker {i}" in lines
        assert any(line.startswith(f"[worker {i}] REPORT ") for line in lines)
    for line in lines:
        assert line.startswith(("[worker 0] ", "[worker 1] ", "[ps 0] ", "[ps 1] ")), line
    # PS tasks log "listening" (logging goes to their stderr, relayed too).
    output = result.stdout
    assert "[ps 0] " in output and "[ps 1] " in output
    # Siblings seen by the workers = the PS tasks and the other worker: all gone.
    pids = {r["pid"] for r in reports} | {p for r in reports for p in r["siblings"]}
    assert len(pids) >= 4
    assert wait_gone(pids, timeout=5) == []


@pytest.mark.timeout(90)
def test_failing_worker_stops_the_others(worker_script, tmp_path):
    result = _run(["--workers", "2", "--ps", "1", "--",
                   sys.executable, str(worker_script), "fail1", str(tmp_path / "up")])
    reports = _reports(result.stdout)
    pids = {r["pid"] for r in reports} | {p for r in reports for p in r["siblings"]}
    try:
        assert result.returncode == 3, result.stdout + result.stderr
        assert "worker 0 exited with code 3" in result.stderr
        assert [r["index"] for r in reports] == [0, 1]
        assert len(pids) >= 3   # two workers and the PS
        assert state(reports[1]["pid"]) is None   # the sleeper was stopped and reaped
        assert wait_gone(pids, timeout=5) == []
    finally:
        kill_leftovers(pids)


@pytest.mark.timeout(90)
def test_worker_killed_by_signal_exits_128_plus_n(worker_script):
    result = _run(["--workers", "1", "--ps", "1", "--",
                   sys.executable, str(worker_script), "selfkill"])
    assert result.returncode == 128 + signal.SIGKILL, result.stdout + result.stderr
    assert "worker 0 exited with code -9" in result.stderr
    pids = {p for r in _reports(result.stdout) for p in r["siblings"]}
    assert pids and wait_gone(pids, timeout=5) == []


@pytest.mark.timeout(90)
def test_missing_worker_executable(tmp_path):
    result = _run(["--workers", "1", "--ps", "1", "--", str(tmp_path / "no-such-program")])
    assert result.returncode == 127, result.stdout + result.stderr
    assert "no-such-program" in result.stderr and "Traceback" not in result.stderr
    assert "[ps 0] " in result.stdout   # the PS was up, then stopped


@pytest.mark.timeout(60)
@pytest.mark.parametrize("spec, named", [("nope", "fifo"),
                                         ("prophet:blocks=4", "blocks_in_flight"),
                                         ("prophet:blocks_in_flight=four", "option=int")])
def test_unknown_scheduler_rejected_before_start(worker_script, tmp_path, spec, named):
    result = _run(["--workers", "1", "--ps", "1", "--scheduler", spec, "--",
                   sys.executable, str(worker_script), "sleep", str(tmp_path / "up")])
    assert result.returncode != 0
    assert "Traceback" not in result.stderr, result.stderr
    assert named in result.stderr and spec.split(":")[-1] in result.stderr
    assert "[ps" not in result.stdout and "[worker" not in result.stdout
    assert not (tmp_path / "up.0").exists()


@pytest.mark.timeout(30)
@pytest.mark.parametrize("args, message", [
    (["--workers", "2", "--ps", "1", "--"], "no worker command"),
    (["--workers", "2", "--ps", "1"], "no worker command"),
    (["--workers", "0", "--ps", "1", "--", "true"], "at least one worker"),
    (["--workers", "1", "--ps", "0", "--", "true"], "at least one worker and one ps"),
])
def test_bad_arguments(args, message):
    result = _run(args, timeout=20)
    assert result.returncode == 2
    assert message in result.stderr
    assert "Traceback" not in result.stderr
    assert "[ps" not in result.stdout


@pytest.mark.timeout(60)
def test_missing_workers_flag():
    result = _run(["--ps", "1", "--", "true"], timeout=20)
    assert result.returncode == 2
    assert "--workers" in result.stderr


def _sleeping_cluster(worker_script, tmp_path, workers):
    """A launcher with 1 PS and `workers` sleeping workers, once all have reported; returns
    (process, log path, pids of every task it started: workers and PS)."""
    proc, log = _start_and_wait(tmp_path, ["--workers", str(workers), "--ps", "1", "--",
                                           sys.executable, str(worker_script), "sleep",
                                           str(tmp_path / "up")], workers)
    reports = _reports(log.read_text())
    return proc, log, {r["pid"] for r in reports} | {p for r in reports for p in r["siblings"]}


@pytest.mark.timeout(90)
def test_sigterm_stops_everything(worker_script, tmp_path):
    proc, log, pids = _sleeping_cluster(worker_script, tmp_path, 2)
    try:
        assert len(pids) >= 3
        proc.send_signal(signal.SIGTERM)
        code = proc.wait(30)
        assert code != 0 and code in (130, 143), code
        assert wait_gone(pids, timeout=5) == [], log.read_text()
    finally:
        reap(proc)
        kill_leftovers(pids)


# Put first on a PS task's PYTHONPATH, this holds the task before it imports anything
# (Python runs sitecustomize at start-up): the test decides when start-up is "still
# going", not the machine's speed. Only the PS task is held (its argv has --port-file).
HOLD_PS = textwrap.dedent(r'''
    import os, time
    if b"--port-file" in open("/proc/self/cmdline", "rb").read().split(b"\0"):
        open(os.environ["HOLD_PS_MARK"], "w").close()
        time.sleep(60)   # until the launcher stops it (no handler yet: SIGTERM ends it)
        raise SystemExit(1)
''')


@pytest.mark.timeout(90)
def test_sigterm_during_startup(worker_script, tmp_path):
    """SIGTERM while the PS is still starting: no worker is started, exit 130."""
    hold = tmp_path / "hold"
    hold.mkdir()
    (hold / "sitecustomize.py").write_text(HOLD_PS)
    held = tmp_path / "ps-held"
    env = {"PYTHONPATH": os.pathsep.join([str(hold), str(ROOT)]), "HOLD_PS_MARK": str(held)}
    proc, log = _start(tmp_path, ["--workers", "1", "--ps", "1", "--", sys.executable,
                                  str(worker_script), "sleep", str(tmp_path / "up")], env)
    pids = []
    try:
        deadline = time.monotonic() + 30
        while not held.exists() and time.monotonic() < deadline and proc.poll() is None:
            time.sleep(0.02)
        assert held.exists(), log.read_text()
        # The PS is a child, so the launcher's handlers are set (before any task starts).
        pids = children(proc.pid)
        assert pids, log.read_text()
        proc.send_signal(signal.SIGTERM)
        assert proc.wait(30) == 130, log.read_text()
        assert "interrupted while the PS tasks were starting" in log.read_text()
        assert "[worker" not in log.read_text()
        assert not (tmp_path / "up.0").exists()
        assert wait_gone(pids, timeout=5) == []
    finally:
        reap(proc)
        kill_leftovers(pids)


@pytest.mark.timeout(90)
def test_sigkilled_launcher_leaves_no_orphans(worker_script, tmp_path):
    proc, log, pids = _sleeping_cluster(worker_script, tmp_path, 1)
    try:
        assert len(pids) >= 2   # the worker and the PS
        proc.kill()
        proc.wait(10)
        # The PS shuts down gracefully on SIGTERM (no RPC in flight: quickly).
        assert wait_gone(pids, timeout=15) == []
        # A SIGKILLed launcher cannot remove its temporary directory; it is under tmp_path.
        assert [p.name for p in tmp_path.glob("prophet-tf-launch-*")], list(tmp_path.iterdir())
    finally:
        reap(proc)
        kill_leftovers(pids)


class _DeadTask:
    name = "ps 0"

    @staticmethod
    def poll():
        return 1


@pytest.mark.timeout(10)
def test_wait_healthy_gives_up_when_ps_died():
    import threading

    from prophet_tf.tools import launch
    with pytest.raises(RuntimeError, match="ps 0 exited with code 1 before it was SERVING"):
        launch._wait_healthy(_DeadTask(), "127.0.0.1:1", 60.0, threading.Event())


# -- progress lines, summary, --log-level ----------------------------------------------------

PROGRESS_WORKER = textwrap.dedent(r'''
    import json, os, sys, time
    from prophet_tf import progress   # no TensorFlow

    mode = sys.argv[1]
    index = json.loads(os.environ["TF_CONFIG"])["task"]["index"]
    print("ENV " + json.dumps({"index": index, "pid": os.getpid(), "ppid": os.getppid(),
                               "log_level": os.environ.get("PROPHET_TF_LOG_LEVEL"),
                               "status_file": os.environ.get("PROPHET_TF_STATUS_FILE")}),
          flush=True)
    for epoch in (1, 2):
        progress.report(epoch=epoch, epochs=2)
        for step in range(5):
            progress.report(step=(epoch - 1) * 5 + step + 1)
            time.sleep(0.4)
        if mode == "fail" and index == 0:
            sys.exit(3)
    if mode == "fail":
        time.sleep(60)   # worker 1 trains on until the launcher stops it
''')


@pytest.fixture
def progress_worker(tmp_path):
    path = tmp_path / "progress_worker.py"
    path.write_text(PROGRESS_WORKER)
    return path


def _envs(output):
    return sorted((json.loads(line.split("ENV ", 1)[1]) for line in output.splitlines()
                   if "ENV " in line), key=lambda r: r["index"])


def _summary(stderr):
    """Rows of the last summary table: {task: [state, exit code, wall, last step]}."""
    lines = stderr.splitlines()
    start = max(i for i, line in enumerate(lines) if line.startswith("prophet-tf launch: summary"))
    rows = {}
    for line in lines[start + 2:]:
        if not line.startswith("  "):
            break
        cells = [c for c in line.strip().split("  ") if c.strip()]
        rows[cells[0].strip()] = [c.strip() for c in cells[1:]]
    return rows


@pytest.mark.timeout(120)
def test_progress_lines_and_summary(progress_worker):
    result = _run(["--workers", "2", "--ps", "1", "--progress-interval", "0", "--",
                   sys.executable, str(progress_worker), "ok"])
    assert result.returncode == 0, result.stdout + result.stderr
    err = result.stderr.splitlines()
    assert "prophet-tf launch: ps 0: starting" in err
    assert any(line.startswith("prophet-tf launch: ps 0: healthy at 127.0.0.1:") for line in err)
    for i in range(2):
        mine = [line for line in err if line.startswith(f"prophet-tf launch: worker {i}: ")]
        states = [line.split(": ", 2)[2].split(",")[0] for line in mine]
        assert states[0] == "starting" and states[-1] == "done", mine
        assert "training" in states, mine
        assert mine[-1].startswith(f"prophet-tf launch: worker {i}: done, epoch 2/2, step 10, "
                                   "after "), mine
    assert "prophet-tf launch: ps 0: stopped" in "\n".join(err)
    rows = _summary(result.stderr)
    assert rows["ps 0"][:2] == ["stopped", "0"] and rows["ps 0"][3] == "-"
    for i in range(2):
        state, code, wall, step = rows[f"worker {i}"]
        assert (state, code, step) == ("done", "0", "10 (epoch 2)")
        assert wall.endswith(" s") and float(wall[:-2]) >= 4.0   # two epochs of 5 x 0.4 s
    # Each worker had its own status file, under the launcher's temporary directory.
    envs = _envs(result.stdout)
    files = [e["status_file"] for e in envs]
    assert len(set(files)) == 2 and all(f.endswith(f"worker-{i}.status.json")
                                        for i, f in enumerate(files))
    assert not any(os.path.exists(f) for f in files)   # cleaned up with the cluster


@pytest.mark.timeout(120)
def test_failed_worker_in_progress_and_summary(progress_worker):
    result = _run(["--workers", "2", "--ps", "1", "--", sys.executable, str(progress_worker),
                   "fail"])
    assert result.returncode == 3, result.stdout + result.stderr
    assert any(line.startswith("prophet-tf launch: worker 0: failed (exit code 3), epoch 1/2, "
                               "step 5, after ") for line in result.stderr.splitlines())
    rows = _summary(result.stderr)
    assert rows["worker 0"][0:2] == ["failed", "3"] and rows["worker 0"][3] == "5 (epoch 1)"
    assert rows["worker 1"][0:2] == ["stopped", "-15 (SIGTERM)"]
    assert rows["ps 0"][0] == "stopped"


@pytest.mark.timeout(120)
def test_log_level_debug_is_exported(progress_worker):
    result = _run(["--workers", "1", "--ps", "1", "--log-level", "DEBUG", "--", sys.executable,
                   str(progress_worker), "ok"])
    assert result.returncode == 0, result.stdout + result.stderr
    (env,) = _envs(result.stdout)
    assert env["log_level"] == "DEBUG"
    assert "DEBUG prophet_tf.tools.launch: starting worker 0: " in result.stderr
    assert "DEBUG prophet_tf.tools.launch: starting ps 0: " in result.stderr


@pytest.mark.timeout(120)
def test_log_level_warning_quiets_launcher_and_ps(progress_worker):
    result = _run(["--workers", "1", "--ps", "1", "--log-level", "warning", "--",
                   sys.executable, str(progress_worker), "ok"])
    assert result.returncode == 0, result.stdout + result.stderr
    (env,) = _envs(result.stdout)
    assert env["log_level"] == "WARNING"
    assert "starting" not in result.stderr and "healthy" not in result.stderr
    assert "INFO prophet_tf" not in result.stderr
    # The PS reads PROPHET_TF_LOG_LEVEL: its INFO line "listening on" is gone.
    assert "listening on" not in result.stdout
    assert _summary(result.stderr)["worker 0"][:2] == ["done", "0"]   # the summary stays


@pytest.mark.timeout(30)
def test_bad_log_level():
    result = _run(["--workers", "1", "--ps", "1", "--log-level", "LOUD", "--", "true"],
                  timeout=20)
    assert result.returncode == 2
    assert "--log-level" in result.stderr and "LOUD" in result.stderr
    assert "DEBUG" in result.stderr and "[ps" not in result.stdout
