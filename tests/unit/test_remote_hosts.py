"""`prophet-tf launch --hosts`: the host list, the ssh command, each task's environment,
and every bad input refused before anything starts (no ssh here; the runs over ssh are
tests/integration/test_launch_hosts.py)."""
import json
import shlex
import subprocess
import sys

import pytest

from prophet_tf.tools import launch, processes, remote_hosts
from prophet_tf.tools.remote_hosts import Host, SshOptions


@pytest.fixture
def nothing_starts(monkeypatch):
    """Fails the test if any process is started."""
    def popen(*args, **kwargs):
        pytest.fail(f"a process was started: {args[0] if args else kwargs}")
    monkeypatch.setattr(processes.subprocess, "Popen", popen)


def _main(argv, capsys):
    """launch.main's exit code and stderr, whether it returned or argparse exited."""
    try:
        code = launch.main(argv)
    except SystemExit as e:
        code = e.code
    return code, capsys.readouterr().err


@pytest.mark.parametrize("text, hosts", [
    ("a:2,b:2", [Host("a", 2), Host("b", 2)]),
    ("node-1, node-2:3", [Host("node-1", 1), Host("node-2", 3)]),
    ("10.0.0.11:1,10.0.0.12", [Host("10.0.0.11", 1), Host("10.0.0.12", 1)]),
    ("[fd00::1]:2,[fd00::2]", [Host("[fd00::1]", 2), Host("[fd00::2]", 1)]),
    ("localhost:4", [Host("localhost", 4)]),
])
def test_host_list(text, hosts):
    assert remote_hosts.parse_hosts(text) == hosts


def test_ssh_dials_an_ipv6_address_without_brackets():
    assert [h.destination for h in remote_hosts.parse_hosts("[fd00::1]:2,b")] == ["fd00::1", "b"]


def test_tasks_are_numbered_host_by_host(monkeypatch):
    monkeypatch.setattr(remote_hosts.shutil, "which", lambda name: f"/usr/bin/{name}")
    placement = remote_hosts.SshHosts(remote_hosts.parse_hosts("a:2,[fd00::2]"), 2, SshOptions(),
                                      {"PROPHET_TF_TOKEN": "t"})
    assert (placement.num_workers, placement.num_ps) == (3, 4)
    assert [placement.worker_name(i) for i in range(3)] == [
        "worker 0@a", "worker 1@a", "worker 2@[fd00::2]"]
    assert [placement.ps_name(i) for i in range(4)] == [
        "ps 0@a", "ps 1@a", "ps 2@[fd00::2]", "ps 3@[fd00::2]"]
    # Workers do not listen: their names are the host and a port per worker of that host.
    assert placement.worker_addresses() == ["a:2223", "a:2224", "[fd00::2]:2223"]


def test_ssh_command_never_prompts_and_keeps_user_options_first():
    options = SshOptions(2222, "/keys/id", ("User=ubuntu", "ServerAliveInterval=5"))
    argv = options.argv("fd00::2", "cd /w && exec python")
    assert argv[:4] == ["ssh", "-T", "-o", "BatchMode=yes"]
    assert argv[-3:] == ["--", "fd00::2", "cd /w && exec python"]
    flags = argv[4:-3]
    # For each key ssh keeps the first value: the user's interval wins over the default.
    assert flags.index("ServerAliveInterval=5") < flags.index("ServerAliveInterval=15")
    assert flags[flags.index("-p") + 1] == "2222" and flags[flags.index("-i") + 1] == "/keys/id"
    assert ["-o", "User=ubuntu"] == flags[:2]


def test_remote_environment_carries_the_token_not_its_file(tmp_path, monkeypatch):
    monkeypatch.setattr(remote_hosts.shutil, "which", lambda name: f"/usr/bin/{name}")
    token_file = tmp_path / "token"
    token_file.write_text("s3cr3t-token\n")
    base = {"PROPHET_TF_TOKEN_FILE": str(token_file), "PROPHET_TF_LOG_LEVEL": "DEBUG",
            "TF_NUM_INTRAOP_THREADS": "1", "KERAS_BACKEND": "tensorflow", "TF_CONFIG": "{}",
            "TF_VAR_password": "terraform's", "HOME": "/root", "OMP_NUM_THREADS": "2",
            "PYTHONPATH": "/src"}
    placement = remote_hosts.SshHosts([Host("a", 1)], 1, SshOptions(), base,
                                      forward=["PYTHONPATH"], cwd="/work dir")
    seen = {}

    class Recorder:
        def __init__(self, name, argv, task_env, out=None):
            seen.update(name=name, argv=argv, env=task_env)

    monkeypatch.setattr(remote_hosts, "RemoteTask", Recorder)
    placement.start_worker(0, ["python", "train.py", "--x", "a b"], {"TF_CONFIG": "{mine}"},
                           None, "/tmp")
    assert seen["env"] == {"PROPHET_TF_TOKEN": "s3cr3t-token", "PROPHET_TF_LOG_LEVEL": "DEBUG",
                           "TF_NUM_INTRAOP_THREADS": "1", "KERAS_BACKEND": "tensorflow",
                           "PYTHONPATH": "/src", "TF_CONFIG": "{mine}"}
    # The token travels on the session's input only, never on the command line.
    assert not any("s3cr3t" in arg for arg in seen["argv"])
    remote = shlex.split(seen["argv"][-1])
    assert remote[:4] == ["cd", "/work dir", "&&", "exec"]
    assert remote[5:9] == ["-m", "prophet_tf.tools._remote_task", "--status", "--"]
    assert remote[9:] == ["python", "train.py", "--x", "a b"]
    seen.clear()
    placement.start_ps(0, ["--num-workers", "1"], {}, None, "/tmp")
    remote = shlex.split(seen["argv"][-1])
    # The PS binds every interface on a port it picks, and the remote side reports it.
    assert remote[6:9] == ["prophet_tf.tools._remote_task", "--port-flag=--port-file", "--"]
    assert remote[9:] == [sys.executable, "-m", "prophet_tf", "ps", "--host", "[::]", "--port",
                          "0", "--num-workers", "1"]
    assert seen["name"] == "ps 0@a" and "TF_CONFIG" not in seen["env"]


def test_remote_task_takes_markers_out_of_the_output(tmp_path):
    script = tmp_path / "remote.py"
    script.write_text(
        "import sys\n"
        "env = sys.stdin.readline()\n"
        "sys.stdout.write('hello\\n')\n"
        "sys.stdout.buffer.write(b'\\x1eprophet-tf-launch {\"port\": 4242}\\n')\n"
        "sys.stdout.buffer.write(b'\\x1eprophet-tf-launch {\"status\": {\"step\": 3}}\\n')\n"
        "sys.stdout.write(env)\n")
    out = tmp_path / "out"
    with open(out, "w") as f:
        task = remote_hosts.RemoteTask("worker 0@a", [sys.executable, str(script)],
                                       {"A": "1"}, f)
        task.stop()
        assert task.returncode == 0
    assert task.port == 4242 and task.status() == {"step": 3}
    assert out.read_text().splitlines() == ["[worker 0@a] hello",
                                            '[worker 0@a] {"A": "1"}']


@pytest.mark.parametrize("argv, message", [
    (["--hosts", "a:x,b"], "Received: 'a:x' in --hosts 'a:x,b'"),
    (["--hosts", "a:"], "integer >= 1 (a bare HOST runs 1). Received: 'a:' in --hosts 'a:'"),
    (["--hosts", "a:0,b:2"], "integer >= 1 (a bare HOST runs 1). Received: 'a:0' in --hosts"),
    (["--hosts", "a,,b"], "--hosts entry 2 is empty (HOST[:WORKERS],...). Received: --hosts "
                          "'a,,b'"),
    (["--hosts", ""], "at least one host, HOST[:WORKERS],... Received: --hosts ''"),
    (["--hosts", "a,b,a:2"], "names a host twice (a); give each host once with its number of "
                             "workers, HOST:WORKERS. Received: --hosts 'a,b,a:2'"),
    (["--hosts", "A,a"], "names a host twice (A, a)"),
    (["--hosts", "ubuntu@a"], "--ssh-option User=NAME. Received: 'ubuntu@a'"),
    (["--hosts", "fd00::1:2"], "IPv6 address in brackets, [ADDRESS]:WORKERS. Received: "
                               "'fd00::1:2'"),
    (["--hosts", "a b"], "'a b' is not a host name or address. Received: --hosts 'a b'"),
    (["--hosts=-oProxyCommand=x"], "is not a host name or address"),
    (["--hosts", "localhost,b"], "mixes a loopback name (localhost) with other hosts"),
    (["--hosts", "a", "--workers", "2"], "leave out --workers 2. Received: --hosts a with "
                                         "--workers 2"),
    (["--hosts", "a", "--gpus", "2"], "leave out --gpus 2. Received: --hosts a with --gpus 2"),
    (["--hosts", "a", "--host", "0.0.0.0"], "leave out --host 0.0.0.0"),
    (["--hosts", "a:2", "--ps", "0"], "need at least one worker and one ps. Received: "
                                      "workers=2, ps=0"),
    (["--hosts", "a", "--ssh-port", "0"], "--ssh-port must be in [1, 65535]. Received: "
                                          "--ssh-port 0"),
    (["--hosts", "a", "--ssh-option", "BatchMode"], "--ssh-option takes KEY=VALUE (ssh's -o, "
                                                    "e.g. User=ubuntu). Received: --ssh-option "
                                                    "'BatchMode'"),
    (["--hosts", "a", "--ssh-identity-file", "/no/such/key"],
     "--ssh-identity-file must be an existing file (a private key). Received: "
     "--ssh-identity-file '/no/such/key'"),
    (["--hosts", "a", "--env", "1X=2"], "--env takes NAME=VALUE or NAME. Received: --env '1X=2'"),
    (["--hosts", "a", "--env", "PROPHET_TF_TEST_UNSET_NAME"],
     "not set here; give --env PROPHET_TF_TEST_UNSET_NAME=VALUE"),
    (["--workers", "1", "--ssh-port", "22"], "--ssh-port go with --hosts. Received: --ssh-port "
                                             "without --hosts"),
    (["--hosts", "a"], "no worker command given"),
])
def test_bad_input_is_refused_before_anything_starts(argv, message, capsys, nothing_starts,
                                                      monkeypatch):
    monkeypatch.delenv("PROPHET_TF_TEST_UNSET_NAME", raising=False)
    command = [] if argv == ["--hosts", "a"] else ["--", "python", "train.py"]
    code, err = _main([*argv, *command], capsys)
    assert code == 2, err
    assert message in err, err
    assert "Traceback" not in err


def test_no_ssh_client_is_refused(capsys, nothing_starts, monkeypatch):
    monkeypatch.setattr(remote_hosts.shutil, "which", lambda name: None)
    code, err = _main(["--hosts", "a,b", "--", "python", "train.py"], capsys)
    assert code == 2 and "ssh client, which is not on PATH" in err, err


def test_remote_side_is_light():
    """The remote side starts with the standard library and prophet_tf's light modules:
    no grpc, TensorFlow or numpy before the task runs."""
    probe = ("import sys, prophet_tf.tools._remote_task; "
             "print(json.dumps(sorted(m for m in ('grpc', 'tensorflow', 'numpy') "
             "if m in sys.modules)))")
    result = subprocess.run([sys.executable, "-c", "import json; " + probe],
                            capture_output=True, text=True, timeout=60)
    assert result.returncode == 0, result.stderr
    assert json.loads(result.stdout) == []
