"""The `prophet-tf` entry point (`python -m prophet_tf`): usage, dispatch, exit codes."""
import json
import os
import pathlib
import signal
import subprocess
import sys
import time

import pytest

from prophet_tf import cli

ROOT = pathlib.Path(__file__).resolve().parents[2]


def _env():
    env = dict(os.environ, PYTHONPATH=str(ROOT), TF_CPP_MIN_LOG_LEVEL="2")
    env.pop("TF_CONFIG", None)
    return env


def _run(*args, timeout=60):
    return subprocess.run([sys.executable, "-m", "prophet_tf", *args], env=_env(), cwd=ROOT,
                          capture_output=True, text=True, timeout=timeout,
                          stdin=subprocess.DEVNULL)


@pytest.mark.timeout(30)
def test_no_args_prints_usage_exit_2():
    result = _run()
    assert result.returncode == 2
    out = result.stdout + result.stderr
    assert "usage: prophet-tf COMMAND" in out
    assert "ps" in out and "launch" in out


@pytest.mark.timeout(30)
@pytest.mark.parametrize("flag", ["--help", "-h"])
def test_help_exit_0(flag, capsys):
    assert cli.main([flag]) == 0
    out = capsys.readouterr().out
    assert "usage: prophet-tf COMMAND" in out
    assert "  ps " in out and "  launch " in out


@pytest.mark.timeout(30)
def test_unknown_command_exit_2_lists_commands():
    result = _run("frobnicate")
    assert result.returncode == 2
    assert "unknown command 'frobnicate'" in result.stderr
    assert "valid commands: ps, launch, doctor" in result.stderr
    assert "Traceback" not in result.stderr


@pytest.mark.timeout(30)
def test_unknown_command_in_process(capsys):
    assert cli.main(["train"]) == 2
    assert "valid commands: ps, launch, doctor" in capsys.readouterr().err


@pytest.mark.timeout(60)
@pytest.mark.parametrize("command, option", [("ps", "--num-workers"), ("launch", "--workers")])
def test_subcommand_help(command, option):
    result = _run(command, "--help")
    assert result.returncode == 0, result.stderr
    assert f"usage: prophet-tf {command}" in result.stdout
    assert option in result.stdout


@pytest.mark.timeout(90)
def test_ps_starts_and_exits_0_on_sigterm(tmp_path):
    from grpc_health.v1 import health_pb2

    port_file = tmp_path / "port"
    log = tmp_path / "ps.log"
    with open(log, "wb") as f:
        proc = subprocess.Popen(
            [sys.executable, "-m", "prophet_tf", "ps", "--port", "0", "--num-workers", "1",
             "--port-file", str(port_file), "--timeline", str(tmp_path / "ps.json")],
            env=dict(_env(), TF_NUM_INTRAOP_THREADS="1", TF_NUM_INTEROP_THREADS="1"),
            cwd=ROOT, stdout=f, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL)
    try:
        deadline = time.monotonic() + 60
        while not port_file.exists():
            assert proc.poll() is None, log.read_text()
            assert time.monotonic() < deadline, log.read_text()
            time.sleep(0.05)
        port = int(port_file.read_text())
        assert 0 < port < 65536
        import grpc
        from grpc_health.v1 import health_pb2_grpc
        with grpc.insecure_channel(f"127.0.0.1:{port}") as channel:
            reply = health_pb2_grpc.HealthStub(channel).Check(
                health_pb2.HealthCheckRequest(), timeout=10)
        assert reply.status == health_pb2.HealthCheckResponse.SERVING
        proc.send_signal(signal.SIGTERM)
        assert proc.wait(30) == 0, log.read_text()
        assert "listening on 127.0.0.1:" in log.read_text()
        # Its trace is written on the way out: no model, so no partition events.
        trace = json.loads((tmp_path / "ps.json").read_text())
        assert [e["args"]["name"] for e in trace["traceEvents"]] == [
            "ps 0", "complete", "applied", "answered"]
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait(10)


@pytest.mark.timeout(30)
def test_ps_bad_flags_exit_2():
    result = _run("ps", "--num-workers", "0", "--port", "0")
    assert result.returncode == 2
    assert "num_workers >= 1" in result.stderr
    result = _run("ps", "--num-workers", "1", "--port", "0", "--timeline", "/no/such/ps.json")
    assert result.returncode == 2
    assert "--timeline must be in an existing directory" in result.stderr
    assert "/no/such/ps.json" in result.stderr


@pytest.mark.timeout(30)
@pytest.mark.parametrize("flag", ["--version", "-V"])
def test_version(flag, capsys):
    import prophet_tf
    from prophet_tf import _build_info
    assert cli.main([flag]) == 0
    out = capsys.readouterr().out.strip()
    assert out.startswith(f"prophet_tf {prophet_tf.__version__} ")
    built = _build_info.read().get("tensorflow_version")
    assert f"TensorFlow {built}" in out if built else "not built" in out


@pytest.mark.timeout(30)
def test_version_does_not_import_tensorflow():
    code = "import sys; from prophet_tf import cli; cli.main(['--version']); " \
           "print('tensorflow' in sys.modules)"
    result = subprocess.run([sys.executable, "-c", code], env=_env(), cwd=ROOT,
                            capture_output=True, text=True, timeout=30)
    assert result.returncode == 0, result.stderr
    assert result.stdout.splitlines()[-1] == "False"


@pytest.mark.timeout(30)
def test_reader_that_stops_early_ends_quietly():
    # `prophet-tf -h | head -1` when head has already gone: a pipe whose read end
    # is closed before anything is written, so the write fails every time.
    read_end, write_end = os.pipe()
    os.close(read_end)
    try:
        result = subprocess.run([sys.executable, "-m", "prophet_tf", "--help"], env=_env(),
                                cwd=ROOT, stdout=write_end, stderr=subprocess.PIPE, text=True,
                                timeout=30)
    finally:
        os.close(write_end)
    assert result.stderr == ""   # no BrokenPipeError traceback
    assert result.returncode == 141


@pytest.mark.timeout(60)
def test_bench_and_simulate_default_to_the_same_layout():
    from prophet_tf.bench import bench_cli, simulate_cli
    bench, simulate = bench_cli._parse([]), simulate_cli._parse([])
    assert bench.layout == simulate.layout == "colocated"
    # The same rule for the PS tasks: one per worker host when colocated, else 1.
    assert (bench.ps, simulate.ps) == (bench.workers, simulate.workers)
    assert simulate_cli._parse(["--layout", "dedicated"]).ps == 1
    assert simulate_cli._parse(["--ps", "3", "--layout", "dedicated"]).ps == 3


@pytest.mark.timeout(60)
@pytest.mark.parametrize("command, options", [
    ("bench", ["--workers", "--global-batch", "--layout"]),
    ("simulate", ["--layout", "--ps"])])
def test_bench_and_simulate_options_have_help(command, options, capsys):
    from prophet_tf.bench import bench_cli, simulate_cli
    parse = {"bench": bench_cli._parse, "simulate": simulate_cli._parse}[command]
    with pytest.raises(SystemExit):
        parse(["--help"])
    text = " ".join(capsys.readouterr().out.split()).split(" options: ", 1)[1]
    words = text.split()
    for option in options:
        # argparse prints an option without help as its name and metavar alone,
        # the next option right after them.
        at = words.index(option)
        assert not words[at + 2].startswith("-"), (option, words[at:at + 4])
    assert "default colocated, as in" in text
