"""`prophet-tf launch --hosts` over ssh, on hosts emulated by network namespaces.

The remote side (`python -m prophet_tf.tools._remote_task`) first, without ssh: the
environment from the first line of its input, the port and status markers, and the
task stopped, its process group with it, when that input closes.

Then real ssh (slow: `make test-long`, which installs openssh-server when
/usr/sbin/sshd is missing): three namespaces on a bridge (prophet_tf.bench.netns),
the launcher in host 0 (the login node), a real sshd on hosts 1 and 2, each with
its own sshd_config, host key and authorized key made here by ssh-keygen (nothing
of this machine's /root/.ssh or /etc/ssh is used). The launcher dials them with
`--ssh-port`, `--ssh-identity-file` and `--ssh-option`s that name this test's
known_hosts. After every job, `ip netns pids` must show nothing in any namespace but
the two sshd listeners: no task, wrapper, ssh session or ssh client is left.
"""
from __future__ import annotations

import contextlib
import json
import os
import pathlib
import re
import signal
import subprocess
import sys
import time

import pytest

from cluster import ROOT, launch_env, reap

from prophet_tf.tools._remote_task import MARKER

SSHD = "/usr/sbin/sshd"
# sshd listens on this port inside each host's own network namespace, where nothing
# else runs: no other process can hold it (the rule of free ports is about shared
# namespaces). Not 22, so that --ssh-port is exercised.
SSH_PORT = 2222


# -- the remote side, without ssh ---------------------------------------------------------------

def _remote_task(*args, env_line: dict, tmp_path: pathlib.Path):
    proc = subprocess.Popen([sys.executable, "-m", "prophet_tf.tools._remote_task", *args],
                            stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                            stderr=subprocess.STDOUT, cwd=ROOT, env=launch_env())
    proc.stdin.write(json.dumps(env_line).encode() + b"\n")
    proc.stdin.flush()
    return proc


def _gone(pid: int, timeout: float = 10.0) -> bool:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        try:
            state = pathlib.Path(f"/proc/{pid}/stat").read_text().rpartition(")")[2].split()[0]
        except OSError:
            return True
        if state == "Z":
            return True  # exited; its parent (gone too) will not reap it
        time.sleep(0.05)
    return False


@pytest.mark.timeout(60)
def test_remote_side_stops_the_task_and_its_group_when_its_input_closes(tmp_path):
    """The environment comes from the first input line; the port and status files are
    reported as markers; EOF on the input stops the task and its child."""
    script = tmp_path / "task.py"
    script.write_text(
        "import json, os, subprocess, sys, time\n"
        "child = subprocess.Popen(['sleep', '300'])\n"
        "open(sys.argv[-1], 'w').write('4321\\n')\n"  # what `prophet-tf ps --port-file` does
        "json.dump({'step': 7}, open(os.environ['PROPHET_TF_STATUS_FILE'], 'w'))\n"
        "print('secret', os.environ['SECRET_FOR_TEST'], 'child', child.pid, flush=True)\n"
        "time.sleep(300)\n")
    proc = _remote_task("--port-flag=--port-file", "--status", "--", sys.executable,
                        str(script), env_line={"SECRET_FOR_TEST": "s3cr3t"}, tmp_path=tmp_path)
    try:
        seen, lines = {}, []
        deadline = time.monotonic() + 30
        while not ("port" in seen and "status" in seen and lines) and \
                time.monotonic() < deadline:
            line = proc.stdout.readline()
            assert line, b"".join(lines)
            if line.startswith(MARKER):
                seen.update(json.loads(line[len(MARKER):]))
            else:
                lines.append(line)
        assert seen == {"port": 4321, "status": {"step": 7}}, (seen, lines)
        match = re.match(rb"secret s3cr3t child (\d+)\n", lines[0])
        assert match, lines
        assert b"s3cr3t" not in pathlib.Path(f"/proc/{proc.pid}/cmdline").read_bytes()
        proc.stdin.close()  # what the launcher does, and what a lost ssh session does
        assert proc.wait(15) == 128 + signal.SIGTERM
        assert _gone(int(match[1]))  # the task's own child, by its process group
    finally:
        reap(proc)


@pytest.mark.timeout(60)
def test_remote_side_exits_with_the_task_code_and_refuses_bad_input(tmp_path):
    proc = _remote_task("--", sys.executable, "-c", "import sys; sys.exit(7)", env_line={},
                        tmp_path=tmp_path)
    try:
        assert proc.wait(30) == 7
    finally:
        reap(proc)
    bad = subprocess.run([sys.executable, "-m", "prophet_tf.tools._remote_task", "--", "true"],
                         input=b"PROPHET_TF_TOKEN=abc\n", capture_output=True, timeout=30,
                         cwd=ROOT, env=launch_env())
    assert bad.returncode == 1
    assert b"must be a JSON object" in bad.stderr and b"abc" not in bad.stderr


# -- hosts over ssh -----------------------------------------------------------------------------

class SshCluster:
    """Host 0 runs the launcher; hosts 1 and 2 each run a real sshd."""

    def __init__(self, net, directory: pathlib.Path, daemons: list[subprocess.Popen]):
        self.net, self.directory, self.daemons = net, directory, daemons
        self.hosts = net.addresses[1:]

    def argv(self, hosts: str, *args: str) -> list[str]:
        ssh = ["--ssh-port", str(SSH_PORT),
               "--ssh-identity-file", str(self.directory / "client_key"),
               "--ssh-option", f"UserKnownHostsFile={self.directory / 'known_hosts'}",
               "--ssh-option", "GlobalKnownHostsFile=/dev/null",
               "--ssh-option", "StrictHostKeyChecking=yes"]
        # --env PYTHONPATH: the remote tasks import this checkout, as the launcher does.
        return self.net.command(0, [sys.executable, "-m", "prophet_tf", "launch", "--hosts",
                                    hosts, *ssh, "--env", "PYTHONPATH", *args])

    def leftovers(self, timeout: float = 30.0) -> list[tuple[int, int, str]]:
        """Every process in the hosts' namespaces but the sshd listeners, once there is
        none or after `timeout` s: (host, pid, command line)."""
        listeners = {d.pid for d in self.daemons}
        deadline = time.monotonic() + timeout
        while True:
            left = []
            for host, name in enumerate(self.net.hosts):
                pids = subprocess.run(["ip", "netns", "pids", name], capture_output=True,
                                      text=True, timeout=30).stdout.split()
                for pid in map(int, pids):
                    if pid in listeners:
                        continue
                    try:
                        cmdline = pathlib.Path(f"/proc/{pid}/cmdline").read_bytes()
                    except OSError:
                        continue
                    left.append((host, pid, cmdline.replace(b"\0", b" ").decode().strip()))
            if not left or time.monotonic() > deadline:
                return left
            time.sleep(0.2)


@contextlib.contextmanager
def _sshd_hosts(tmp: pathlib.Path):
    if not os.path.exists(SSHD):
        pytest.fail(f"the --hosts tests need sshd ({SSHD}, Debian's openssh-server), which is "
                    "not installed: run them with `make test-long`, which installs it as root "
                    "(apt-get install openssh-server), or install it yourself")
    from prophet_tf.bench import netns
    ok, why = netns.available()
    if not ok:
        pytest.fail(f"the --hosts tests emulate hosts with network namespaces, which are not "
                    f"available here (run them as root): {why}")
    for name in ("client_key", "host_key"):
        subprocess.run(["ssh-keygen", "-q", "-t", "ed25519", "-N", "", "-C", f"test-{name}",
                        "-f", str(tmp / name)], check=True, timeout=30)
    (tmp / "authorized_keys").write_text((tmp / "client_key.pub").read_text())
    # sshd's privilege separation directory, which its service would otherwise make.
    os.makedirs("/run/sshd", mode=0o755, exist_ok=True)
    host_key = " ".join((tmp / "host_key.pub").read_text().split()[:2])
    daemons: list[subprocess.Popen] = []
    with netns.EmulatedNetwork(3, None) as net:
        try:
            known = []
            for i in (1, 2):
                config = tmp / f"sshd-{i}.conf"
                config.write_text("\n".join([
                    f"ListenAddress {net.addresses[i]}:{SSH_PORT}",
                    f"HostKey {tmp / 'host_key'}", "PidFile none",
                    f"AuthorizedKeysFile {tmp / 'authorized_keys'}",
                    "PubkeyAuthentication yes", "PasswordAuthentication no",
                    "KbdInteractiveAuthentication no", "PermitRootLogin prohibit-password",
                    "StrictModes no", "UsePAM no", "PrintMotd no", "LogLevel ERROR", ""]))
                with open(tmp / f"sshd-{i}.log", "wb") as log:
                    daemons.append(subprocess.Popen(
                        net.command(i, [SSHD, "-D", "-e", "-f", str(config)]),
                        stdout=log, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL))
                known.append(f"[{net.addresses[i]}]:{SSH_PORT} {host_key}")
            (tmp / "known_hosts").write_text("\n".join(known) + "\n")
            cluster = SshCluster(net, tmp, daemons)
            _wait_sshd(cluster)
            yield cluster
        finally:
            for daemon in daemons:
                reap(daemon)


def _wait_sshd(cluster: SshCluster, timeout: float = 30.0) -> None:
    """Until both sshd answer a login with this test's key."""
    for host in cluster.hosts:
        deadline = time.monotonic() + timeout
        while True:
            probe = subprocess.run(cluster.net.command(0, [
                "ssh", "-T", "-o", "BatchMode=yes", "-o", "ConnectTimeout=5", "-p", str(SSH_PORT),
                "-i", str(cluster.directory / "client_key"),
                "-o", f"UserKnownHostsFile={cluster.directory / 'known_hosts'}",
                "-o", "StrictHostKeyChecking=yes", host, "true"]),
                capture_output=True, text=True, timeout=30, stdin=subprocess.DEVNULL)
            if probe.returncode == 0:
                break
            if time.monotonic() > deadline:
                logs = "".join((cluster.directory / f"sshd-{i}.log").read_text() for i in (1, 2))
                pytest.fail(f"sshd on {host} did not accept the test's key: {probe.stderr}\n"
                            f"{logs}")
            time.sleep(0.2)


@pytest.fixture(scope="module")
def hosts(tmp_path_factory):
    with _sshd_hosts(tmp_path_factory.mktemp("ssh-hosts")) as cluster:
        yield cluster


def _run(cluster: SshCluster, hosts: str, *args: str, timeout: float):
    return subprocess.run(cluster.argv(hosts, *args), env=launch_env(), cwd=ROOT,
                          capture_output=True, text=True, timeout=timeout,
                          stdin=subprocess.DEVNULL)


@pytest.mark.slow
@pytest.mark.timeout(420)
def test_digits_trains_on_two_hosts_over_ssh(hosts):
    """examples/train_digits.py, a worker and a PS task on each of two hosts."""
    a, b = hosts.hosts
    result = _run(hosts, f"{a},{b}:1", "--", sys.executable, "examples/train_digits.py",
                  "--epochs", "2", timeout=400)
    text = result.stdout[-4000:] + result.stderr[-4000:]
    assert result.returncode == 0, text
    # Every line of a task carries its name and its host.
    for line in result.stdout.splitlines():
        assert re.match(rf"^\[(worker 0|ps 0)@{a}\] |^\[(worker 1|ps 1)@{b}\] ", line), line
    epochs = {}
    for worker, host in ((0, a), (1, b)):
        epochs[worker] = re.findall(rf"^\[worker {worker}@{host}\] worker {worker} of 2: epoch "
                                    r"(\d): loss (\d\.\d+) accuracy (\d\.\d+)$",
                                    result.stdout, re.M)
        assert [e[0] for e in epochs[worker]] == ["1", "2"], text
    # One model on the PS tasks: both workers print the same loss and accuracy.
    assert epochs[0] == epochs[1], epochs
    test = re.findall(r"^\[worker (\d)@\S+\] worker \d of 2: whole test set \(360 images\): "
                      r"accuracy (\d\.\d+)", result.stdout, re.M)
    assert len(test) == 2 and test[0][1] == test[1][1], text
    assert float(test[0][1]) > 0.5, test
    # The board followed both PS tasks to SERVING on their hosts' own addresses, and the
    # workers' steps (2 epochs of 23 steps) through their status files.
    assert re.search(rf"ps 0@{a}: healthy at {a}:\d+", result.stderr), result.stderr
    assert re.search(rf"ps 1@{b}: healthy at {b}:\d+", result.stderr), result.stderr
    assert re.search(rf"worker 1@{b}: done, step 46", result.stderr), result.stderr
    assert hosts.leftovers() == []


FAILING_WORKER = """\
import json, os, subprocess, sys, time
index = json.loads(os.environ["TF_CONFIG"])["task"]["index"]
up = sys.argv[1]
if index == 1:
    while not os.path.exists(up + ".0"):
        time.sleep(0.05)
    print("worker 1 fails", flush=True)
    sys.exit(3)
sleeper = subprocess.Popen(["sleep", "600"])  # a child of the task: it must go too
print("worker 0 up, child", sleeper.pid, flush=True)
open(up + ".0", "w").close()
time.sleep(600)
"""


@pytest.mark.slow
@pytest.mark.timeout(180)
def test_failing_worker_stops_every_task_on_every_host(hosts, tmp_path):
    script = tmp_path / "worker.py"
    script.write_text(FAILING_WORKER)
    a, b = hosts.hosts
    result = _run(hosts, f"{a},{b}", "--", sys.executable, str(script), str(tmp_path / "up"),
                  timeout=150)
    text = result.stdout + result.stderr
    assert result.returncode == 3, text
    assert f"worker 1@{b} exited with code 3; stopping the other tasks" in result.stderr, text
    assert f"[worker 0@{a}] worker 0 up, child" in result.stdout, text
    assert f"[worker 1@{b}] worker 1 fails" in result.stdout, text
    assert hosts.leftovers() == []


SLEEPING_WORKER = """\
import json, os, sys, time
index = json.loads(os.environ["TF_CONFIG"])["task"]["index"]
print("worker", index, "up", flush=True)
open(f"{sys.argv[1]}.{index}", "w").close()
time.sleep(600)
"""


@pytest.mark.slow
@pytest.mark.timeout(180)
@pytest.mark.parametrize("signum", [signal.SIGTERM, signal.SIGKILL])
def test_launcher_signalled_or_killed_leaves_nothing_on_any_host(hosts, tmp_path, signum):
    """SIGTERM (Ctrl-C alike): the launcher stops every task. SIGKILL: the launcher cannot
    do anything; its ssh clients die with it (PR_SET_PDEATHSIG), and each host stops its
    tasks when their ssh sessions end."""
    script = tmp_path / "worker.py"
    script.write_text(SLEEPING_WORKER)
    up = tmp_path / "up"
    a, b = hosts.hosts
    log = tmp_path / "launch.log"
    with open(log, "wb") as out:
        proc = subprocess.Popen(hosts.argv(f"{a}:2,{b}", "--", sys.executable, str(script),
                                           str(up)), env=launch_env(), cwd=ROOT, stdout=out,
                                stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL)
    try:
        deadline = time.monotonic() + 120
        while not all(os.path.exists(f"{up}.{i}") for i in range(3)):
            assert proc.poll() is None, log.read_text()  # the launcher gave up
            if time.monotonic() > deadline:  # a guard against a hang, not a measurement
                pytest.fail("the 3 workers did not start within 120 s:\n" + log.read_text())
            time.sleep(0.1)
        # The workers run on their hosts: two on a (host 1), one on b (host 2).
        running = hosts.leftovers(timeout=0)
        workers = sorted(host for host, _, cmdline in running
                         if cmdline == f"{sys.executable} {script} {up}")
        assert workers == [1, 1, 2], running
        proc.send_signal(signum)
        code = proc.wait(60)
    finally:
        reap(proc)
    text = log.read_text()
    if signum == signal.SIGTERM:
        assert code == 130, text
        assert "interrupted; stopping all tasks" in text, text
        assert f"[worker 2@{b}] worker 2 up" in text, text
    else:
        assert code == -signal.SIGKILL, text
    assert hosts.leftovers() == []
