"""`prophet-tf launch --gpus N`: one worker per GPU, each with its own CUDA_VISIBLE_DEVICES.

Real launches (real PS tasks, a tiny worker script without TensorFlow). Each
worker reports its own CUDA_VISIBLE_DEVICES and TF_CONFIG index, and the
CUDA_VISIBLE_DEVICES every PS task was started with, read from
/proc/<pid>/environ of its siblings (the launcher's children): the
environment exec gave the PS, i.e. what the launcher handed it. No GPU is
needed: the variable is only read here.
"""
import json
import sys
import textwrap

import pytest

from cluster import LAUNCH_DROP, ONE_TF_THREAD, child_env, run_prophet

CUDA = "CUDA_VISIBLE_DEVICES"

WORKER = textwrap.dedent(r'''
    import json, os, sys

    def ps_environments():
        """{pid: CUDA_VISIBLE_DEVICES or None} of the launcher's PS children."""
        found = {}
        for entry in os.listdir("/proc"):
            if not entry.isdigit():
                continue
            try:
                stat = open(f"/proc/{entry}/stat").read()
                cmdline = open(f"/proc/{entry}/cmdline", "rb").read().split(b"\0")
                environ = open(f"/proc/{entry}/environ", "rb").read().split(b"\0")
            except OSError:
                continue
            if int(stat.rpartition(")")[2].split()[1]) != os.getppid():
                continue
            if cmdline[1:4] != [b"-m", b"prophet_tf", b"ps"]:
                continue
            env = dict(e.decode().split("=", 1) for e in environ if b"=" in e)
            found[entry] = env.get("CUDA_VISIBLE_DEVICES")
        return found

    open(sys.argv[1], "a").close()   # "a worker started"
    config = json.loads(os.environ["TF_CONFIG"])
    print("REPORT " + json.dumps({
        "index": config["task"]["index"], "workers": len(config["cluster"]["worker"]),
        "cuda": os.environ.get("CUDA_VISIBLE_DEVICES"), "ps": ps_environments()}), flush=True)
''')


@pytest.fixture
def worker_script(tmp_path):
    path = tmp_path / "worker.py"
    path.write_text(WORKER)
    return path


def _env(cuda=None):
    """The launcher's environment: the caller's CUDA_VISIBLE_DEVICES is `cuda` (None: unset)."""
    return child_env(drop=(*LAUNCH_DROP, CUDA), **ONE_TF_THREAD,
                     **({} if cuda is None else {CUDA: cuda}))


def _launch(args, cuda=None, timeout=150):
    return run_prophet("launch", *args, env=_env(cuda), timeout=timeout)


def _reports(output):
    return sorted((json.loads(line.split("REPORT ", 1)[1]) for line in output.splitlines()
                   if "REPORT " in line), key=lambda r: r["index"])


@pytest.mark.timeout(180)
def test_one_device_per_worker_and_none_for_the_ps(worker_script, tmp_path):
    result = _launch(["--gpus", "3", "--ps", "2", "--", sys.executable, str(worker_script),
                      str(tmp_path / "started")])
    assert result.returncode == 0, result.stdout + result.stderr
    reports = _reports(result.stdout)
    # --gpus alone sets the number of workers; without a caller's list, devices 0..N-1.
    assert [(r["index"], r["workers"], r["cuda"]) for r in reports] == [
        (0, 3, "0"), (1, 3, "1"), (2, 3, "2")], result.stdout
    for r in reports:  # Both PS tasks, as each worker saw them: no GPU.
        assert sorted(r["ps"].values()) == ["", ""], r
    assert ('one worker per GPU: worker 0 on CUDA_VISIBLE_DEVICES=0, worker 1 on '
            'CUDA_VISIBLE_DEVICES=1, worker 2 on CUDA_VISIBLE_DEVICES=2; PS tasks: '
            'CUDA_VISIBLE_DEVICES=""') in result.stderr


@pytest.mark.timeout(180)
def test_the_callers_devices_are_split_among_the_workers(worker_script, tmp_path):
    # Indices and a UUID, in the caller's order; with more devices than --gpus, the first N.
    result = _launch(["--workers", "3", "--gpus", "3", "--", sys.executable,
                      str(worker_script), str(tmp_path / "started")],
                     cuda="5, GPU-8932f937-d72c,3,1")
    assert result.returncode == 0, result.stdout + result.stderr
    reports = _reports(result.stdout)
    assert [r["cuda"] for r in reports] == ["5", "GPU-8932f937-d72c", "3"], result.stdout
    assert all(list(r["ps"].values()) == [""] for r in reports), reports


@pytest.mark.timeout(180)
def test_without_gpus_the_environment_is_unchanged(worker_script, tmp_path):
    result = _launch(["--workers", "2", "--", sys.executable, str(worker_script),
                      str(tmp_path / "started")], cuda="4,6")
    assert result.returncode == 0, result.stdout + result.stderr
    reports = _reports(result.stdout)
    assert [r["cuda"] for r in reports] == ["4,6", "4,6"]
    assert all(list(r["ps"].values()) == ["4,6"] for r in reports), reports
    assert "one worker per GPU" not in result.stderr


@pytest.mark.timeout(60)
@pytest.mark.parametrize("args, cuda, message", [
    (["--gpus", "0"], None, "--gpus must be an integer >= 1. Received: --gpus 0"),
    (["--gpus", "-2"], None, "Received: --gpus -2"),
    (["--workers", "4", "--gpus", "2"], None,
     "one worker per GPU: give --workers 2 or leave it out. Received: --workers 4, --gpus 2"),
    (["--workers", "1", "--gpus", "2"], None, "Received: --workers 1, --gpus 2"),
    (["--gpus", "3"], "2,5", "--gpus 3 needs 3 devices but CUDA_VISIBLE_DEVICES names 2. "
                             "Received: CUDA_VISIBLE_DEVICES='2,5', --gpus 3"),
    (["--gpus", "2"], "0,,1", "'' is neither. Received: CUDA_VISIBLE_DEVICES='0,,1'"),
    (["--gpus", "2"], "0,gpu1", "'gpu1' is neither. Received: CUDA_VISIBLE_DEVICES='0,gpu1'"),
    (["--gpus", "1"], "-1", "'-1' is neither. Received: CUDA_VISIBLE_DEVICES='-1'"),
    (["--gpus", "2"], "", "is set but empty, which hides every GPU"),
    (["--gpus", "2"], "1,1", "names a device twice (1); one worker per GPU needs distinct devices. "
     "Received: CUDA_VISIBLE_DEVICES='1,1'"),
])
def test_bad_gpus_rejected_before_anything_starts(worker_script, tmp_path, args, cuda, message):
    started = tmp_path / "started"
    result = _launch([*args, "--", sys.executable, str(worker_script), str(started)], cuda=cuda,
                     timeout=40)
    assert result.returncode == 2, result.stdout + result.stderr
    assert message in result.stderr, result.stderr
    assert "Traceback" not in result.stderr
    assert "[ps" not in result.stdout and "[worker" not in result.stdout
    assert not started.exists()


@pytest.mark.timeout(30)
def test_neither_workers_nor_gpus():
    result = _launch(["--ps", "1", "--", "true"], timeout=20)
    assert result.returncode == 2
    assert "required: --workers (or --gpus N" in result.stderr, result.stderr


@pytest.mark.timeout(30)
def test_help_names_gpus():
    result = run_prophet("launch", "--help", env=_env(), timeout=20)
    assert result.returncode == 0
    assert "(--workers N | --gpus N | --hosts H[:N],...)" in result.stdout
    assert "one per GPU" in result.stdout
