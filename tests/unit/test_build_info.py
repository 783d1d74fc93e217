"""prophet_tf._build_info: the TensorFlow version check before the op library
loads, and the install hint when no TensorFlow is present."""
import json
import re
import pathlib
import subprocess
import sys

import pytest

from prophet_tf import _build_info

ROOT = pathlib.Path(__file__).resolve().parents[2]

pytestmark = pytest.mark.timeout(60)


@pytest.mark.parametrize("version, expected", [
    ("2.21.0", (2, 21)), ("2.22.0rc1", (2, 22)), ("2.21.0-dev20260101", (2, 21)),
    ("3.0", (3, 0)), ("nightly", None), ("", None)])
def test_minor_version(version, expected):
    assert _build_info.minor_version(version) == expected


@pytest.mark.parametrize("built, installed", [
    ("2.21.0", "2.21.0"), ("2.21.0", "2.21.3"), ("2.21.1", "2.21.0rc2"),
    (None, "2.22.0"), ("", "2.22.0"), ("weird", "weird")])
def test_same_minor_version_loads(built, installed):
    assert _build_info.version_mismatch(built, installed) is None


@pytest.mark.parametrize("built, installed", [
    ("2.21.0", "2.22.0"), ("2.21.0", "2.20.1"), ("2.21.0", "3.21.0"), ("weird", "2.21.0")])
def test_other_minor_version_is_refused_naming_both_and_the_rebuild(built, installed):
    message = _build_info.version_mismatch(built, installed)
    assert message is not None
    assert f"built against TensorFlow {built}" in message
    assert f"TensorFlow {installed} is installed" in message
    assert f"Rebuild prophet_tf against TensorFlow {installed}" in message
    assert "pip install --no-build-isolation -e ." in message
    assert "--no-binary prophet_tf" in message


def test_read_build_info(tmp_path):
    assert _build_info.read(tmp_path) == {}
    (tmp_path / "_build_info.json").write_text("not json")
    assert _build_info.read(tmp_path) == {}
    (tmp_path / "_build_info.json").write_text(json.dumps({"tensorflow_version": "2.21.0"}))
    assert _build_info.read(tmp_path) == {"tensorflow_version": "2.21.0"}


def test_built_library_records_the_installed_tensorflow():
    import tensorflow as tf
    info = _build_info.read()
    assert info["tensorflow_version"] == tf.__version__
    assert info["cxx11_abi"] in (0, 1)


def test_no_tensorflow_gives_an_install_hint(monkeypatch):
    # find_spec reports a module mapped to None in sys.modules as absent.
    monkeypatch.setitem(sys.modules, "tensorflow", None)
    with pytest.raises(ImportError) as info:
        _build_info.require_tensorflow()
    message = str(info.value)
    assert "no TensorFlow is installed" in message
    assert 'pip install "prophet_tf[cpu]"' in message
    assert 'pip install "prophet_tf[gpu]"' in message


def test_import_without_tensorflow_fails_with_the_hint():
    # A fresh interpreter where `tensorflow` cannot be imported: the package and
    # its TensorFlow-free parts import, the Strategy says how to install TensorFlow.
    code = ("import sys; sys.modules['tensorflow'] = None\n"
            "import prophet_tf, prophet_tf.engine\n"
            "try:\n    prophet_tf.Strategy\nexcept ImportError as e:\n    print(e)\n"
            "else:\n    print('imported')")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                         cwd=ROOT, timeout=60, check=True).stdout
    assert "prophet_tf needs TensorFlow" in out and "prophet_tf[cpu]" in out


def test_cli_without_tensorflow_prints_the_hint():
    code = ("import sys; sys.modules['tensorflow'] = None\n"
            "from prophet_tf import cli; sys.exit(cli.main(['ps', '--port', '0']))")
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                            cwd=ROOT, timeout=60)
    assert result.returncode == 1
    assert "Traceback" not in result.stderr
    assert "prophet-tf ps: needs TensorFlow" in result.stderr
    assert "prophet_tf[gpu]" in result.stderr


def test_no_tensorflow_distribution_is_required():
    """pyproject.toml requires no TensorFlow distribution (pip would install it over
    another one: tensorflow-cpu over tensorflow[and-cuda]); the extras name one each,
    the build requires one for its headers, and all agree on the minor version."""
    import tomllib
    project = tomllib.loads((ROOT / "pyproject.toml").read_text())
    names = [re.match(r"[\w.-]+", r)[0].lower() for r in project["project"]["dependencies"]]
    assert not [n for n in names if n.startswith(("tensorflow", "tf-", "tf_"))], names
    extras = project["project"]["optional-dependencies"]
    assert extras["cpu"] == ["tensorflow-cpu>=2.21,<2.22"]
    assert extras["gpu"] == ["tensorflow[and-cuda]>=2.21,<2.22"]
    assert "tensorflow-cpu>=2.21,<2.22" in project["build-system"]["requires"]
    assert "tensorflow-cpu>=2.21,<2.22" in (ROOT / "Makefile").read_text()
    # The hint names the extras that exist.
    for extra in ("cpu", "gpu"):
        assert f'prophet_tf[{extra}]' in _build_info.INSTALL_HINT
