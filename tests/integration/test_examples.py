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
@pytest.mark.parametrize("attempt", [1, pytest.param(2, marks=pytest.mark.slow)])
def test_quickstart_prophet_timeline_and_plot(tmp_path, attempt):
    """Run twice in `make test-long`: a worker once died with SIGSEGV after fit here
    (docs/design.md)."""
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
    """The README's quickstart claim, to its printed digits: after `make demo`'s 8 epochs
    every worker's whole-test-set accuracy equals single-process Keras' on the same data
    and global batch (`--single`), and both are the figure the README prints."""
    readme = (ROOT / "README.md").read_text()
    claim = re.search(r"Measured here: (\d\.\d{4}) on the whole test set on both workers, "
                      r"the\s+same as single-process Keras.*?--single`: (\d\.\d{4})\)",
                      readme, re.S)
    assert claim, "the README's quickstart no longer states the demo's accuracy"
    result = _launch(["--workers", "2", "--ps", "1", "--", sys.executable,
                      str(EXAMPLES / "train_digits.py")], timeout=600)
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
    pattern = r"whole test set \(360 images\): accuracy (\d\.\d+)"
    whole = {m[1]: m[2] for m in _lines(result.stdout, r"^\[worker (\d)\] .*" + pattern)}
    single = subprocess.run([sys.executable, str(EXAMPLES / "train_digits.py"), "--single"],
                            env=_env(), cwd=ROOT, capture_output=True, text=True, timeout=280)
    assert single.returncode == 0, single.stderr[-3000:]
    alone = _lines(single.stdout, r"^single process: " + pattern)
    assert len(alone) == 1, single.stdout[-3000:]
    assert whole == {"0": alone[0][1], "1": alone[0][1]}, (whole, alone[0][1])
    assert claim[1] == claim[2] == alone[0][1], (claim.groups(), alone[0][1])


# -- multi_host/tf_config.py -----------------------------------------------------------------


def _module(path, name):
    spec = importlib.util.spec_from_file_location(name, path)
    module = importlib.util.module_from_spec(spec)
    sys.modules[name] = module  # dataclasses look their module up there
    spec.loader.exec_module(module)
    return module


def test_multi_host_tf_config(capsys):
    tf_config = _module(EXAMPLES / "multi_host" / "tf_config.py", "tf_config_example")
    args = ["--ps", "10.0.0.10:2222", "--worker", "10.0.0.11:2222,10.0.0.12:2222"]
    expected = {
        "cluster": {"ps": ["10.0.0.10:2222"], "worker": ["10.0.0.11:2222", "10.0.0.12:2222"]},
        "task": {"type": "worker", "index": 1}}
    assert tf_config.main([*args, "--json", "--task", "worker:1"]) == 0
    assert json.loads(capsys.readouterr().out) == expected
    # The README's pattern works without --workers-per-host too: eval sets TF_CONFIG.
    shown = subprocess.run(
        ["sh", "-c", 'eval "$("$0" "$@")" && printf "%s\\n" "$TF_CONFIG"', sys.executable,
         str(EXAMPLES / "multi_host" / "tf_config.py"), *args, "--task", "worker:1"],
        capture_output=True, text=True, timeout=30)
    assert shown.returncode == 0, shown.stderr
    assert json.loads(shown.stdout) == expected
    assert tf_config.main([*args, "--task", "worker:1"]) == 0
    assert capsys.readouterr().out.startswith("export TF_CONFIG=")
    with pytest.raises(SystemExit):
        tf_config.main([*args, "--json", "--workers-per-host", "2", "--task", "ps:0"])
    assert "Received both" in capsys.readouterr().err
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


def test_multi_host_tf_config_workers_per_host(capsys):
    tf_config = _module(EXAMPLES / "multi_host" / "tf_config.py", "tf_config_example")
    hosts = ["--ps", "10.0.0.11:2222,10.0.0.12:2222", "--worker", "10.0.0.11:2223,10.0.0.12:2223",
             "--workers-per-host", "2"]
    workers = ["10.0.0.11:2223", "10.0.0.11:2224", "10.0.0.12:2223", "10.0.0.12:2224"]
    cluster = {"ps": ["10.0.0.11:2222", "10.0.0.12:2222"], "worker": workers}
    # Worker i is the (i mod 2)-th on its host: GPU i mod 2; a PS sees no GPU.
    for task, device in (("worker:0", "0"), ("worker:1", "1"), ("worker:2", "0"),
                         ("worker:3", "1"), ("ps:1", "")):
        task_type, index = task.split(":")
        env = tf_config.task_environment(cluster["ps"], ["10.0.0.11:2223", "10.0.0.12:2223"], 2,
                                         task_type, int(index))
        assert json.loads(env["TF_CONFIG"]) == {
            "cluster": cluster, "task": {"type": task_type, "index": int(index)}}
        assert env["CUDA_VISIBLE_DEVICES"] == device, task
    # What a user runs: the printed lines, eval'd by a shell, set both variables.
    shown = subprocess.run(
        ["sh", "-c", 'eval "$("$0" "$@")" && printf "%s\\n%s|\\n" "$TF_CONFIG" '
         '"$CUDA_VISIBLE_DEVICES"', sys.executable,
         str(EXAMPLES / "multi_host" / "tf_config.py"), *hosts, "--task", "worker:3"],
        capture_output=True, text=True, timeout=30)
    assert shown.returncode == 0, shown.stderr
    config, device = shown.stdout.splitlines()
    assert json.loads(config) == {"cluster": cluster, "task": {"type": "worker", "index": 3}}
    assert device == "1|"
    assert tf_config.main([*hosts, "--task", "ps:0"]) == 0
    assert capsys.readouterr().out.splitlines()[1] == "export CUDA_VISIBLE_DEVICES=''"
    for argv, message in (
            (["--ps", "a:1", "--worker", "b:1", "--workers-per-host", "0", "--task", "worker:0"],
             "Received: 0"),
            (["--ps", "a:1", "--worker", "b:65535", "--workers-per-host", "2", "--task", "ps:0"],
             "ports 65535..65536 on b, past 65535. Received: 'b:65535'"),
            (["--ps", "b:2224", "--worker", "b:2223", "--workers-per-host", "2", "--task",
              "ps:0"], "cannot share an address (workers on host:PORT..PORT+1). Received: "
                       "['b:2224']"),
            (["--ps", "a:1", "--worker", "b:1", "--workers-per-host", "2", "--task", "worker:2"],
             "worker:0..1). Received: worker:2")):
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


def test_ec2_workers_per_host_hosts(ec2):
    hosts = ec2.parse_hosts(HOSTS, devices=ec2.worker_devices(2))
    assert [(h.target, h.role, h.index, h.address, h.device) for h in hosts] == [
        ("ubuntu@ec2-a.example.com", "ps", 0, "10.0.0.11:2222", ""),
        ("ubuntu@ec2-b.example.com", "worker", 0, "10.0.0.12:2230", "0"),
        ("ubuntu@ec2-b.example.com", "worker", 1, "10.0.0.12:2231", "1"),
        ("ec2-c.example.com", "worker", 2, "ec2-c.example.com:2222", "0"),
        ("ec2-c.example.com", "worker", 3, "ec2-c.example.com:2223", "1")]
    assert ec2.tf_configs(hosts)["ec2-c.example.com worker 3"]["cluster"]["worker"] == [
        "10.0.0.12:2230", "10.0.0.12:2231", "ec2-c.example.com:2222", "ec2-c.example.com:2223"]
    # A list given with --env is split among each host's workers, the first N entries.
    assert ec2.worker_devices(2, "5,GPU-8932f937, 3") == ["5", "GPU-8932f937"]
    local = ec2.localize(hosts)
    assert [h.device for h in local] == ["", "0", "1", "0", "1"]
    assert len({h.address for h in local}) == 5
    # Without the option nothing changes: one worker a line, the hosts' own devices.
    assert all(h.device is None for h in ec2.parse_hosts(HOSTS))
    assert ec2.task_env(ec2.parse_hosts(HOSTS)[1], {"A": "1"}) == {"A": "1"}


@pytest.mark.parametrize("workers_per_host, visible, message", [
    (0, None, "--workers-per-host must be an integer >= 1. Received: --workers-per-host 0"),
    (3, "1,2", "3 workers per host need 3 devices but CUDA_VISIBLE_DEVICES names 2. Received: "
               "--env CUDA_VISIBLE_DEVICES=1,2, --workers-per-host 3"),
    (2, "1,,2", "'' is neither"),
    (2, "-1", "'-1' is neither"),
    (2, "1,1", "names a device twice"),
    (1, "", "an empty CUDA_VISIBLE_DEVICES hides every GPU"),
])
def test_ec2_bad_devices(ec2, workers_per_host, visible, message):
    with pytest.raises(ValueError, match=re.escape(message)):
        ec2.worker_devices(workers_per_host, visible)


def test_ec2_workers_per_host_address_clashes(ec2):
    with pytest.raises(ValueError, match=re.escape("line 2: 2 workers per host need ports "
                                                   "65535..65536, past 65535")):
        ec2.parse_hosts("a ps\nb worker b:65535\n", devices=["0", "1"])
    with pytest.raises(ValueError, match=re.escape("cannot share an address. Received: "
                                                   "['a:2224']")):
        ec2.parse_hosts("a ps a:2224\na worker a:2223\n", devices=["0", "1"])


def _ec2(*args, timeout=60, python_flags=(), **env):
    return subprocess.run([sys.executable, *python_flags, str(LAUNCH_EC2), *args],
                          env=_env(**env), cwd=ROOT,
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
def test_ec2_launcher_needs_only_the_standard_library(tmp_path):
    hosts = tmp_path / "hosts.txt"
    hosts.write_text(HOSTS)
    args = [str(hosts), "--workers-per-host", "2", "--dry-run", "--", "true"]
    # -I -S: no site-packages on the path, so no TensorFlow, numpy or prophet_tf.
    bare = _ec2(*args, python_flags=("-I", "-S"))
    assert bare.returncode == 0, bare.stderr
    assert bare.stdout == _ec2(*args).stdout and "CUDA_VISIBLE_DEVICES=1" in bare.stdout


@pytest.mark.timeout(60)
def test_ec2_dry_run_workers_per_host(tmp_path):
    hosts = tmp_path / "hosts.txt"
    hosts.write_text(HOSTS)
    result = _ec2(str(hosts), "--workers-per-host", "2", "--env", "CUDA_VISIBLE_DEVICES=4,6",
                  "--dry-run", "--", "python3", "train.py")
    assert result.returncode == 0, result.stderr
    blocks = [b for b in result.stdout.split("\n\n") if b.strip()]
    assert [b.splitlines()[0] for b in blocks] == [
        "# ubuntu@ec2-a.example.com ps 0: dials 10.0.0.11:2222; CUDA_VISIBLE_DEVICES=''",
        "# ubuntu@ec2-b.example.com worker 0: dials 10.0.0.12:2230; CUDA_VISIBLE_DEVICES=4",
        "# ubuntu@ec2-b.example.com worker 1: dials 10.0.0.12:2231; CUDA_VISIBLE_DEVICES=6",
        "# ec2-c.example.com worker 2: dials ec2-c.example.com:2222; CUDA_VISIBLE_DEVICES=4",
        "# ec2-c.example.com worker 3: dials ec2-c.example.com:2223; CUDA_VISIBLE_DEVICES=6"]
    # The task's own value is in its command; the whole list is in none.
    for block, device in zip(blocks, ["", "4", "6", "4", "6"]):
        assert f" CUDA_VISIBLE_DEVICES={device} " in block
        assert "4,6" not in block


@pytest.mark.timeout(60)
def test_ec2_bad_workers_per_host(tmp_path):
    hosts = tmp_path / "hosts.txt"
    hosts.write_text(HOSTS)
    result = _ec2(str(hosts), "--workers-per-host", "0", "--dry-run", "--", "true")
    assert result.returncode == 2
    assert "Received: --workers-per-host 0" in result.stderr
    result = _ec2(str(hosts), "--workers-per-host", "2", "--env", "CUDA_VISIBLE_DEVICES=7",
                  "--dry-run", "--", "true")
    assert result.returncode == 2
    assert "Received: --env CUDA_VISIBLE_DEVICES=7, --workers-per-host 2" in result.stderr
    assert "Traceback" not in result.stderr and result.stdout == ""


# Reports its CUDA_VISIBLE_DEVICES and those of its cluster's PS tasks, found by TF_CONFIG.
DEVICE_WORKER = """\
import json, os, time
config = json.loads(os.environ["TF_CONFIG"])
ps = {}
deadline = time.monotonic() + 60
while len(ps) < len(config["cluster"]["ps"]) and time.monotonic() < deadline:
    for pid in filter(str.isdigit, os.listdir("/proc")):
        try:
            environ = open(f"/proc/{pid}/environ", "rb").read().split(b"\\0")
        except OSError:
            continue
        env = dict(e.decode(errors="replace").split("=", 1) for e in environ if b"=" in e)
        try:
            theirs = json.loads(env.get("TF_CONFIG", "null"))
        except ValueError:
            continue
        if theirs and theirs["cluster"] == config["cluster"] and theirs["task"]["type"] == "ps":
            ps[theirs["task"]["index"]] = env.get("CUDA_VISIBLE_DEVICES")
    time.sleep(0.1)
print("REPORT " + json.dumps({"index": config["task"]["index"],
                              "cuda": os.environ.get("CUDA_VISIBLE_DEVICES"), "ps": ps}),
      flush=True)
"""


@pytest.mark.timeout(200)
def test_ec2_local_workers_per_host_get_their_devices(tmp_path):
    hosts = tmp_path / "hosts.txt"
    hosts.write_text("a ps\na worker a:2223\nb ps\nb worker b:2223\n")
    script = tmp_path / "w.py"
    script.write_text(DEVICE_WORKER)
    result = _ec2(str(hosts), "--local", "--workers-per-host", "2", "--grace", "10", "--",
                  sys.executable, str(script), timeout=180, CUDA_VISIBLE_DEVICES="9")
    assert result.returncode == 0, result.stdout + result.stderr
    reports = {int(m[1]): json.loads(m[2]) for m in _lines(
        result.stdout, r"^\[localhost worker (\d)\] REPORT (.*)$")}
    assert sorted(reports) == [0, 1, 2, 3], result.stdout
    # Two hosts' workers 0 and 1 each; the caller's CUDA_VISIBLE_DEVICES reaches no task.
    assert [reports[i]["cuda"] for i in range(4)] == ["0", "1", "0", "1"]
    for report in reports.values():
        assert report["ps"] == {"0": "", "1": ""}, report


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
    # Waiting for worker 1 would outlast the 180 s the launcher is given.
    result = _ec2(str(hosts), "--local", "--grace", "10", "--", sys.executable, str(script),
                  timeout=180)
    assert result.returncode == 5, result.stdout + result.stderr
    assert "worker 0 exited with code 5; stopping the others" in result.stderr
    sleeper = int((tmp_path / "pid.1").read_text())
    deadline = time.monotonic() + 10
    while os.path.exists(f"/proc/{sleeper}") and time.monotonic() < deadline:
        time.sleep(0.1)
    assert not os.path.exists(f"/proc/{sleeper}")  # stopped through its closed stdin


# -- kubernetes/: the TFJob manifest -----------------------------------------------------------

KUBERNETES = EXAMPLES / "kubernetes"


def _yaml(text: str):
    """The block YAML the manifests are written in (PyYAML is no dependency): mappings,
    sequences, `- key: value` items, JSON-style flow lists and quoted strings, comments."""
    lines = []
    for raw in text.splitlines():
        stripped = raw.strip()
        if not stripped or stripped.startswith("#") or stripped == "---":
            continue
        assert " #" not in stripped, f"trailing comments are not read here: {raw!r}"
        lines.append([len(raw) - len(raw.lstrip(" ")), stripped])

    def scalar(text):
        if text[0] in '["{':
            return json.loads(text)
        if text.isdigit():
            return int(text)
        return {"true": True, "false": False}.get(text, text)

    def block(i, indent):
        if lines[i][1].startswith("- "):
            items = []
            while i < len(lines) and lines[i][0] == indent and lines[i][1].startswith("- "):
                rest = lines[i][1][2:].strip()
                if re.match(r"^[\w./-]+:( |$)", rest):  # a mapping whose first key is here
                    lines[i] = [indent + 2, rest]
                    value, i = block(i, indent + 2)
                else:
                    value, i = scalar(rest), i + 1
                items.append(value)
            return items, i
        mapping = {}
        while i < len(lines) and lines[i][0] == indent:
            key, _, rest = lines[i][1].partition(":")
            assert re.match(r"^[\w./-]+$", key), f"not a key: {lines[i][1]!r}"
            i += 1
            if rest.strip():
                mapping[key] = scalar(rest.strip())
            elif i < len(lines) and (lines[i][0] > indent or lines[i][1].startswith("- ")):
                mapping[key], i = block(i, lines[i][0])
            else:
                mapping[key] = None
        assert i == len(lines) or lines[i][0] < indent, f"bad indentation: {lines[i]}"
        return mapping, i

    value, end = block(0, lines[0][0])
    assert end == len(lines)
    return value


def _operator_tf_config(job: dict, kind: str, index: int, namespace: str = "ml") -> str:
    """TF_CONFIG as the training operator builds it from the TFJob: every replica type, lower
    case, "<job>-<type>-<i>.<namespace>.svc:<tfjob-port>" (tests/unit/test_cluster.py)."""
    cluster = {}
    for replica, spec in job["spec"]["tfReplicaSpecs"].items():
        container = next(c for c in spec["template"]["spec"]["containers"]
                         if c["name"] == "tensorflow")
        port = next((p["containerPort"] for p in container.get("ports", [])
                     if p["name"] == "tfjob-port"), 2222)
        cluster[replica.lower()] = [f"{job['metadata']['name']}-{replica.lower()}-{i}."
                                    f"{namespace}.svc:{port}" for i in range(spec["replicas"])]
    return json.dumps({"cluster": dict(sorted(cluster.items())),
                       "task": {"type": kind, "index": index}, "environment": "cloud"})


def test_yaml_reader():
    assert _yaml("a:\n  b: 1\n  c: [\"x\", \"y\"]\nd:\n  - e: f\n    g: \"h: i\"\n  - j\n"
                 "k:\n- 2\nnvidia.com/gpu: 1\nv: \"\"\n") == {
                     "a": {"b": 1, "c": ["x", "y"]}, "d": [{"e": "f", "g": "h: i"}, "j"],
                     "k": [2], "nvidia.com/gpu": 1, "v": ""}


def test_kubernetes_tfjob_agrees_with_its_readme(monkeypatch):
    from prophet_tf import cluster
    from prophet_tf.ps import server

    job = _yaml((KUBERNETES / "tfjob.yaml").read_text())
    claim = _yaml((KUBERNETES / "checkpoints.yaml").read_text())
    readme = (KUBERNETES / "README.md").read_text()
    dockerfile = (KUBERNETES / "Dockerfile").read_text()
    assert (job["apiVersion"], job["kind"]) == ("kubeflow.org/v1", "TFJob")
    name, specs = job["metadata"]["name"], job["spec"]["tfReplicaSpecs"]
    assert job["spec"]["runPolicy"]["cleanPodPolicy"] == "Running"  # stops the PS pods
    assert sorted(specs) == ["Chief", "Evaluator", "PS", "Worker"]
    replicas = {kind: spec["replicas"] for kind, spec in specs.items()}
    # One PS task per worker pod, as the README's tables say.
    assert replicas["PS"] == replicas["Chief"] + replicas["Worker"]
    assert "| `Chief` | 1 |" in readme and "| `Worker` | 1 |" in readme
    assert f"| `PS` | {replicas['PS']} |" in readme and "| `Evaluator` | 1 |" in readme
    containers = {kind: spec["template"]["spec"]["containers"][0] for kind, spec in specs.items()}
    assert all(c["name"] == "tensorflow" for c in containers.values())  # the operator's name
    # The commands: train.py from the image's checkout, `prophet-tf ps` on the PS.
    workdir = re.search(r"^WORKDIR (\S+)$", dockerfile, re.M)[1]
    script = f"{workdir}/examples/kubernetes/train.py"
    assert (ROOT / script[len(workdir) + 1:]).is_file()  # the checkout is copied there
    directories = set()
    for kind in ("Chief", "Worker", "Evaluator"):
        command = containers[kind]["command"]
        assert command[:2] == ["python", script], (kind, command)
        directories.add(command[command.index("--checkpoint-dir") + 1])
    assert len(directories) == 1
    ps_command = containers["PS"]["command"]
    assert ps_command[:2] == ["prophet-tf", "ps"]
    # The token: the secret the README makes, mounted where the PS and the trainers read it.
    secret = re.search(r"kubectl create secret generic (\S+)", readme)[1]
    for kind in ("Chief", "Worker", "PS"):
        pod = specs[kind]["template"]["spec"]
        mount = next(m for m in containers[kind]["volumeMounts"] if m["name"] == "token")
        assert {"name": "token", "secret": {"secretName": secret}} in pod["volumes"]
        token = (ps_command[ps_command.index("--token-file") + 1] if kind == "PS" else
                 next(e["value"] for e in containers[kind]["env"]
                      if e["name"] == "PROPHET_TF_TOKEN_FILE"))
        assert token == f"{mount['mountPath']}/token", kind
    assert "volumeMounts" not in containers["Evaluator"] or all(
        m["name"] != "token" for m in containers["Evaluator"]["volumeMounts"])
    # The checkpoint volume: the chief writes and the evaluator reads the same claim.
    assert claim["kind"] == "PersistentVolumeClaim"
    assert claim["spec"]["accessModes"] == ["ReadWriteMany"]
    for kind in ("Chief", "Evaluator"):
        pod = specs[kind]["template"]["spec"]
        volume = next(v for v in pod["volumes"] if v["name"] == "checkpoints")
        assert volume["persistentVolumeClaim"]["claimName"] == claim["metadata"]["name"]
        mount = next(m for m in containers[kind]["volumeMounts"] if m["name"] == "checkpoints")
        assert next(iter(directories)).startswith(mount["mountPath"] + "/")

    # Placement: trainers one per node; each PS beside a trainer, never two PS on a node.
    def selects(term):
        expressions = {e["key"]: e["values"] for e in term["labelSelector"]["matchExpressions"]
                       if e["operator"] == "In"}
        assert term["topologyKey"] == "kubernetes.io/hostname"
        assert expressions["training.kubeflow.org/job-name"] == [name]
        return sorted(expressions["training.kubeflow.org/replica-type"])

    rule = "requiredDuringSchedulingIgnoredDuringExecution"
    for kind in ("Chief", "Worker"):
        affinity = specs[kind]["template"]["spec"]["affinity"]
        assert [selects(t) for t in affinity["podAntiAffinity"][rule]] == [["chief", "worker"]]
    affinity = specs["PS"]["template"]["spec"]["affinity"]
    assert [selects(t) for t in affinity["podAffinity"][rule]] == [["chief", "worker"]]
    assert [selects(t) for t in affinity["podAntiAffinity"][rule]] == [["ps"]]

    # Every task's TF_CONFIG, as the operator writes it from this manifest, resolves.
    workers = replicas["Chief"] + replicas["Worker"]
    for kind, count in (("chief", 1), ("worker", replicas["Worker"]), ("ps", replicas["PS"]),
                        ("evaluator", replicas["Evaluator"])):
        for index in range(count):
            config = cluster.resolve(_operator_tf_config(job, kind, index))
            assert (config.num_workers, config.num_ps) == (workers, replicas["PS"])
            assert config.is_evaluator == (kind == "evaluator")
            if kind == "ps":  # the PS pod's own command line, with that TF_CONFIG
                monkeypatch.setenv("TF_CONFIG", _operator_tf_config(job, kind, index))
                assert server._task_from_args(server._parse_args(ps_command[2:])) == (
                    workers, index, replicas["PS"], "[::]", 2222)


def test_kubernetes_gpu_variant_is_the_same_job_with_gpus():
    """tfjob-gpu.yaml is tfjob.yaml on the GPU image, a GPU for each training pod, none for
    the PS and evaluator pods; Dockerfile.gpu builds on TensorFlow's GPU image of the
    TensorFlow prophet_tf is built for, and keeps it."""
    cpu = _yaml((KUBERNETES / "tfjob.yaml").read_text())
    gpu = _yaml((KUBERNETES / "tfjob-gpu.yaml").read_text())
    dockerfile = (KUBERNETES / "Dockerfile.gpu").read_text()
    base = re.search(r"^FROM (\S+)$", dockerfile, re.M)[1]
    image, _, tag = base.partition(":")
    assert image == "tensorflow/tensorflow" and tag.endswith("-gpu")
    pinned = re.search(r'"tensorflow-cpu>=(\d+\.\d+),<', (ROOT / "pyproject.toml").read_text())[1]
    assert tag.startswith(pinned + "."), (tag, pinned)
    # The op library is compiled against the image's TensorFlow, none other is installed.
    commands = "\n".join(line for line in dockerfile.splitlines() if not line.startswith("#"))
    assert "--no-build-isolation" in commands and "tensorflow-cpu" not in commands
    assert "ops_available()" in dockerfile
    for line in re.findall(r"^COPY (.+) \S+$", dockerfile, re.M):
        for source in line.split():
            assert (ROOT / source).exists(), source
    built = "prophet-tf:0.1.0-gpu"
    assert f"-t {built} ." in dockerfile

    specs = gpu["spec"]["tfReplicaSpecs"]
    for kind, spec in specs.items():
        container = spec["template"]["spec"]["containers"][0]
        assert container.pop("image") == built, kind
        limits = container.pop("resources", {}).get("limits", {})
        env = {e["name"]: e["value"] for e in container.get("env", [])}
        if kind in ("Chief", "Worker"):
            assert limits == {"nvidia.com/gpu": 1}, kind
            assert "CUDA_VISIBLE_DEVICES" not in env
        else:  # requests no GPU, and sees none even where the node's runtime shows all
            assert limits == {}, kind
            assert env.get("CUDA_VISIBLE_DEVICES") == "", kind
            container["env"] = [e for e in container["env"]
                                if e["name"] != "CUDA_VISIBLE_DEVICES"]
            if not container["env"]:
                del container["env"]
    for spec in cpu["spec"]["tfReplicaSpecs"].values():
        spec["template"]["spec"]["containers"][0].pop("image")
    assert gpu == cpu  # everything else: the same job
