"""The bench's extras are optional: the runtime imports without them, and a command
that needs one says which extra brings it (prophet_tf.extras)."""
import pathlib
import subprocess
import sys

import pytest

from prophet_tf import extras

ROOT = pathlib.Path(__file__).resolve().parents[2]
# A None entry in sys.modules makes `import X` fail as if X were not installed.
WITHOUT_EXTRAS = ("import sys\n"
                  "for m in ('matplotlib', 'tf_keras', 'sklearn'): sys.modules[m] = None\n")


def _run(code: str, *args: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-c", WITHOUT_EXTRAS + code, *args], cwd=ROOT,
                          capture_output=True, text=True, timeout=240)


def test_check_and_require_name_the_command_and_the_install():
    assert extras.require("matplotlib", "x").__name__ == "matplotlib"
    extras.check("tf_keras", "x")  # installed here (make install)
    with pytest.raises(KeyError, match="not an optional dependency: 'numpyy'"):
        extras.check("numpyy", "x")


@pytest.mark.timeout(300)
def test_the_runtime_imports_without_the_bench_extras():
    """Every module outside bench/ and tools/ imports with matplotlib, tf_keras and
    scikit-learn unimportable."""
    code = ("import importlib, pkgutil, prophet_tf\n"
            "names = [m.name for m in pkgutil.walk_packages(prophet_tf.__path__, 'prophet_tf.')\n"
            "         if not m.name.startswith(('prophet_tf.bench', 'prophet_tf.tools'))\n"
            "         and m.name != 'prophet_tf.__main__'\n"
            # The package's .so files are ctypes libraries, not extension modules.
            "         and not m.module_finder.find_spec(m.name).origin.endswith('.so')]\n"
            "for n in names: importlib.import_module(n)\n"
            "print(len(names), [m for m in ('matplotlib', 'tf_keras', 'sklearn')\n"
            "                   if sys.modules.get(m) is not None])\n")
    result = _run(code)
    assert result.returncode == 0, result.stderr[-3000:]
    count, loaded = result.stdout.split(maxsplit=1)
    assert int(count) > 30 and loaded.strip() == "[]"


@pytest.mark.timeout(300)
def test_a_command_without_its_extra_says_which_to_install(tmp_path):
    """`simulate --plot` without matplotlib and `bench` of tf-mwms without tf_keras
    stop before they start work, and `report` (no extra) still runs; the CLI prints
    the install line, not a traceback."""
    code = "from prophet_tf import cli; sys.exit(cli.main(sys.argv[1:]))"
    png = tmp_path / "sweep.png"
    result = _run(code, "simulate", "--model", "cnn", "--sweep", "--plot", str(png))
    assert result.returncode == 1, result.stderr[-3000:]
    assert result.stderr.strip() == (
        "prophet-tf simulate: --plot needs matplotlib, which is not "
        'installed: pip install "prophet_tf[bench]" (or pip install matplotlib)')
    assert not png.exists() and result.stdout == ""
    result = _run(code, "bench", "--schedulers", "prophet,tf-mwms", "--reps", "1")
    assert result.returncode == 1, result.stderr[-3000:]
    assert result.stderr.strip() == (
        "prophet-tf bench: the tf-mwms baseline (--schedulers ...,tf-mwms) needs tf_keras, "
        'which is not installed: pip install --no-deps "tf_keras>=2.21,<2.22" (or, where '
        'the `tensorflow` distribution is installed, pip install "prophet_tf[tf-keras]")')
    result = _run(code, "report", "--check", "docs/benchmarks.md")
    assert result.returncode == 0, result.stderr[-3000:]
