"""The examples, run as a user would: through `prophet-tf launch` (or launch_ec2.py) on
localhost, with few epochs and one TF thread per process."""
import importlib.util
import json
import os
import re
import subprocess
import sys
import time

import pytest

from cluster import LAUNCH_DROP, ONE_TF_THREAD, ROOT, child_env, run_prophet

EXAMPLES = ROOT / "examples"


def _env(**extra):
    # Besides the launcher's, the examples' own settings: none from the caller's shell.
    return child_env(drop=(*LAUNCH_DROP, "PROPHET_TF_TIMELINE", "PROPHET_TF_TOKEN",
                           "PROPHET_TF_TOKEN_FILE"), **ONE_TF_THREAD, **extra)


def _launch(args, timeout, **env):
    return run_prophet("launch", *args, env=_env(**env), timeout=timeout)


def _lines(output, pattern):
    return [m for line in output.splitlines() if (m := re.search(pattern, line))]


def _accuracies(output):
    """{worker: whole-test-set accuracy} from the examples' last lines."""
    return {int(m[1]): float(m[2]) for m in
            _lines(output, r"^\[worker (\d)\] worker \d.*: test accuracy (\d\.\d+)")}


# -- quickstart, with a timeline drawn by `prophet-tf plot` -----------------------------------


@pytest.mark.timeout(300)
@pytest.mark.parametrize("attempt", [1, 2])
def test_quickstart_prophet_timeline_and_plot(tmp_path, attempt):
    """Run twice: a worker once died with SIGSEGV after fit here (README "How it works")."""
    from prophet_tf.tools import plot
    timeline = tmp_path / "timeline"
    result = _launch(["--workers", "2", "--ps", "1", "--scheduler", "prophet", "--",
                      sys.executable, str(EXAMPLES / "quickstart.py"), "--epochs", "1"],
                     timeout=280, PROPHET_TF_TIMELINE=str(timeline))
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
    accuracy = _accuracies(result.stdout)
    assert sorted(accuracy) == [0, 1], result.stdout[-3000:]
    # The same weights on both workers (one PS), and far better than chance (0.1).
    assert accuracy[0] == accuracy[1] and accuracy[0] > 0.3, accuracy
    # The launcher followed the epochs through the example's progress callback.
    assert "worker 0: done, epoch 1/1, step 23" in result.stderr, result.stderr[-2000:]
    # 1,437 training images in global batches of 64: 23 steps; 4 trained variables.
    for worker in (0, 1):
        trace = plot.load(str(timeline / f"worker-{worker}.json"))[1]
        parsed = plot.parse_timeline(trace)
        assert parsed.scheduler == "prophet" and parsed.steps == list(range(23))
        names = parsed.names  # by priority: the first Dense layer's kernel, then its bias
        assert len(names) == 4 and names[0].endswith("/kernel:0") and \
            names[1].endswith("/bias:0") and names[0].rsplit("/", 1)[0] == \
            names[1].rsplit("/", 1)[0], names
    out = tmp_path / "schedule.png"
    draw = run_prophet("plot", str(timeline), "-o", str(out), "--steps", "15:18", env=_env(),
                       timeout=120)
    assert draw.returncode == 0, draw.stderr
    data = out.read_bytes()
    assert data[:8] == b"\x89PNG\r\n\x1a\n" and len(data) > 30_000


# -- functional model, callbacks, crash and --restart ----------------------------------------


@pytest.mark.timeout(480)
def test_functional_callbacks_crash_and_restart(tmp_path):
    out = tmp_path / "runs"
    result = _launch(["--workers", "2", "--ps", "1", "--restart", "1", "--",
                      sys.executable, str(EXAMPLES / "functional_callbacks.py"), "--out",
                      str(out), "--epochs", "3", "--crash-in-epoch", "2"], timeout=460)
    text = result.stdout[-4000:] + result.stderr[-4000:]
    assert result.returncode == 0, text
    assert "[worker 0] crashing on purpose in epoch 2" in result.stdout
    assert ("attempt 2 of 2; the previous attempt failed: worker 0 exited with code 3"
            in result.stderr), text
    # BackupAndRestore: both workers resumed after epoch 1 and trained epochs 2 and 3.
    assert len(_lines(result.stdout, r"^\[worker \d\] worker \d: trained epochs 2\.\.3;")) == 2
    accuracy = _accuracies(result.stdout)
    assert sorted(accuracy) == [0, 1] and accuracy[0] == accuracy[1] > 0.3, text
    for worker in (0, 1):
        mine = out / f"worker-{worker}"
        assert (mine / "best.keras").stat().st_size > 10_000  # ModelCheckpoint
        assert not (mine / "backup").exists()  # BackupAndRestore cleans up after success
    # TensorBoard (the `examples` extra installs it) wrote event files on each worker.
    logs = _lines(result.stdout, r"TensorBoard files (\d+)")
    assert logs and all(int(m[1]) > 0 for m in logs), text
    # The best checkpoint is a plain Keras model that scores like the trained one.
    best = _lines(result.stdout, r"best checkpoint .*best\.keras: (\d\.\d+)")
    assert len(best) == 2 and all(float(m[1]) > 0.3 for m in best)


# -- the original example ----------------------------------------------------------------------


@pytest.mark.slow  # `make demo` in full: CI runs it (`make test-long`), `make test` does not
@pytest.mark.timeout(900)
def test_train_digits_reaches_the_readmes_accuracy():
    """The README's quickstart claim: 0.9833 on the whole test set after `make demo`'s 8 epochs."""
    result = _launch(["--workers", "2", "--ps", "1", "--", sys.executable,
                      str(EXAMPLES / "train_digits.py")], timeout=880)
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
    whole = _lines(result.stdout, r"^\[worker (\d)\] .*whole test set \(360 images\): "
                                  r"accuracy (\d\.\d+)")
    assert len(whole) == 2 and whole[0][2] == whole[1][2], result.stdout[-3000:]
    assert float(whole[0][2]) >= 0.95, result.stdout[-3000:]


# -- multi_host/tf_config.py -----------------------------------------------------------------


def _module(path, name):
    spec = importlib.util.spec_from_file_location(name, path)
    module = importlib.util.module_from_spec(spec)
    sys.modules[name] = module  # dataclasses look their module up there
    spec.loader.exec_module(module)
    return module


def test_multi_host_tf_config(capsys):
    tf_config = _module(EXAMPLES / "multi_host" / "tf_config.py", "tf_config_example")
    assert tf_config.main(["--ps", "10.0.0.10:2222", "--worker", "10.0.0.11:2222,10.0.0.12:2222",
                           "--task", "worker:1"]) == 0
    assert json.loads(capsys.readouterr().out) == {
        "cluster": {"ps": ["10.0.0.10:2222"], "worker": ["10.0.0.11:2222", "10.0.0.12:2222"]},
        "task": {"type": "worker", "index": 1}}
    # prophet_tf reads it as the task it names.
    from prophet_tf import cluster
    config = cluster.resolve(tf_config.tf_config(["a:1"], ["b:2", "c:3"], "ps", 0))
    assert config.task_type == "ps" and list(config.ps) == ["a:1"] and config.num_workers == 2
    for argv, message in ((["--ps", "a", "--worker", "b:1", "--task", "ps:0"], "HOST:PORT"),
                          (["--ps", "a:1", "--worker", "b:1", "--task", "worker:2"],
                           "Received: worker:2"),
                          (["--ps", "a:1", "--worker", "b:1", "--task", "chief"], "TYPE:INDEX")):
        assert tf_config.main(argv) == 2
        assert message in capsys.readouterr().err


# -- ec2/launch_ec2.py -----------------------------------------------------------------------

LAUNCH_EC2 = EXAMPLES / "ec2" / "launch_ec2.py"
HOSTS = """\
# ssh target               role    address
ubuntu@ec2-a.example.com   ps      10.0.0.11
ubuntu@ec2-b.example.com   worker  10.0.0.12:2230
ec2-c.example.com          WORKER          # address from the target, default port
"""


@pytest.fixture(scope="module")
def ec2():
    return _module(LAUNCH_EC2, "launch_ec2_example")


def test_ec2_hosts_and_tf_configs(ec2):
    hosts = ec2.parse_hosts(HOSTS)
    assert [(h.target, h.role, h.index, h.address) for h in hosts] == [
        ("ubuntu@ec2-a.example.com", "ps", 0, "10.0.0.11:2222"),
        ("ubuntu@ec2-b.example.com", "worker", 0, "10.0.0.12:2230"),
        ("ec2-c.example.com", "worker", 1, "ec2-c.example.com:2222")]
    configs = ec2.tf_configs(hosts)
    cluster = {"ps": ["10.0.0.11:2222"], "worker": ["10.0.0.12:2230", "ec2-c.example.com:2222"]}
    assert configs["ubuntu@ec2-a.example.com ps 0"] == {
        "cluster": cluster, "task": {"type": "ps", "index": 0}}
    assert configs["ec2-c.example.com worker 1"] == {
        "cluster": cluster, "task": {"type": "worker", "index": 1}}
    local = ec2.localize(hosts)
    assert all(h.address.startswith("127.0.0.1:") for h in local)
    assert len({h.address for h in local}) == 3 and [h.role for h in local] == [
        "ps", "worker", "worker"]


@pytest.mark.parametrize("text, message", [
    ("a ps\n", "names no worker host"),
    ("a worker\n", "names no ps host"),
    ("a ps\nb chief\n", "line 2: the role must be one of"),
    ("a ps x y\nb worker\n", "line 1: expected SSH_TARGET ROLE"),
    ("a ps 10.0.0.1:2222\nb worker 10.0.0.1:2222\n", "cannot share an address"),
    ("a ps 10.0.0.1:70000\nb worker\n", "bad port"),
])
def test_ec2_bad_hosts(ec2, text, message):
    with pytest.raises(ValueError, match=message):
        ec2.parse_hosts(text)


def _ec2(*args, timeout=60, **env):
    return subprocess.run([sys.executable, str(LAUNCH_EC2), *args], env=_env(**env), cwd=ROOT,
                          capture_output=True, text=True, timeout=timeout,
                          stdin=subprocess.DEVNULL)


@pytest.mark.timeout(60)
def test_ec2_dry_run(tmp_path):
    hosts = tmp_path / "hosts.txt"
    hosts.write_text(HOSTS)
    result = _ec2(str(hosts), "--cwd", "/home/ubuntu/prophet_tf", "--env",
                  "PROPHET_TF_SCHEDULER=prophet", "--dry-run", "--", "python3",
                  "examples/train_digits.py", "--epochs", "2", PROPHET_TF_TOKEN="s3cret-value")
    assert result.returncode == 0, result.stderr
    out = result.stdout
    assert "s3cret-value" not in out  # the token goes through stdin, never a command line
    blocks = [b for b in out.split("\n\n") if b.strip()]
    assert [b.splitlines()[0] for b in blocks] == [
        "# ubuntu@ec2-a.example.com ps 0: dials 10.0.0.11:2222",
        "# ubuntu@ec2-b.example.com worker 0: dials 10.0.0.12:2230",
        "# ec2-c.example.com worker 1: dials ec2-c.example.com:2222"]
    for block, (target, role, index) in zip(blocks, [("ubuntu@ec2-a.example.com", "ps", 0),
                                                     ("ubuntu@ec2-b.example.com", "worker", 0),
                                                     ("ec2-c.example.com", "worker", 1)]):
        config = json.loads(block.splitlines()[1].split("TF_CONFIG=", 1)[1])
        assert config["task"] == {"type": role, "index": index}
        command = block.splitlines()[3]
        assert command.startswith(f"ssh -o BatchMode=yes -o ServerAliveInterval=15 {target} ")
        assert "cd /home/ubuntu/prophet_tf" in block and "PROPHET_TF_SCHEDULER=prophet" in block
        assert ("python3 -m prophet_tf ps" if role == "ps"
                else "python3 examples/train_digits.py --epochs 2") in block
        assert "IFS= read -r PROPHET_TF_TOKEN" in block


@pytest.mark.timeout(60)
def test_ec2_bad_arguments(tmp_path):
    hosts = tmp_path / "hosts.txt"
    hosts.write_text("a ps\n")
    result = _ec2(str(hosts), "--dry-run", "--", "true")
    assert result.returncode == 2 and "names no worker host" in result.stderr
    result = _ec2(str(tmp_path / "none.txt"), "--dry-run", "--", "true")
    assert result.returncode == 2 and "none.txt" in result.stderr
    hosts.write_text(HOSTS)
    result = _ec2(str(hosts), "--dry-run")
    assert result.returncode == 2 and "no worker command" in result.stderr
    result = _ec2(str(hosts), "--env", "NOPE", "--dry-run", "--", "true")
    assert result.returncode == 2 and "Received: --env NOPE" in result.stderr
    assert "Traceback" not in result.stderr


@pytest.mark.timeout(300)
def test_ec2_local_trains_quickstart(tmp_path):
    hosts = tmp_path / "hosts.txt"
    hosts.write_text(HOSTS)
    result = _ec2(str(hosts), "--local", "--", sys.executable,
                  str(EXAMPLES / "quickstart.py"), "--epochs", "1", timeout=280)
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
    accuracy = {int(m[1]): float(m[2]) for m in _lines(
        result.stdout, r"^\[localhost worker (\d)\] worker \d of 2: test accuracy (\d\.\d+)")}
    assert sorted(accuracy) == [0, 1] and accuracy[0] == accuracy[1] > 0.3, result.stdout[-3000:]
    assert "[localhost ps 0] " in result.stdout  # the PS's lines, prefixed
    assert "every worker finished; stopping the PS tasks" in result.stderr


@pytest.mark.timeout(200)
def test_ec2_local_failure_stops_everyone(tmp_path):
    hosts = tmp_path / "hosts.txt"
    hosts.write_text("a ps\nb worker\nc worker\n")
    script = tmp_path / "w.py"
    # Worker 0 fails at once; worker 1 would sleep for minutes.
    script.write_text(
        "import json, os, sys, time\n"
        "index = json.loads(os.environ['TF_CONFIG'])['task']['index']\n"
        f"open(r'{tmp_path}/pid.%d' % index, 'w').write(str(os.getpid()))\n"
        "if index == 1:\n    time.sleep(300)\n"
        "sys.exit(5)\n")
    start = time.monotonic()
    result = _ec2(str(hosts), "--local", "--grace", "10", "--", sys.executable, str(script),
                  timeout=180)
    assert result.returncode == 5, result.stdout + result.stderr
    assert "worker 0 exited with code 5; stopping the others" in result.stderr
    assert time.monotonic() - start < 150
    sleeper = int((tmp_path / "pid.1").read_text())
    deadline = time.monotonic() + 10
    while os.path.exists(f"/proc/{sleeper}") and time.monotonic() < deadline:
        time.sleep(0.1)
    assert not os.path.exists(f"/proc/{sleeper}")  # stopped through its closed stdin
