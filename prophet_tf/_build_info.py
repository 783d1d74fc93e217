"""What the op library was built against, and whether this TensorFlow can load it.

A custom op library is compiled against one TensorFlow's headers and links its
``libtensorflow_framework.so.2``: it loads only under the same TensorFlow minor
version (2.21.x for one built against 2.21). ``setup.py`` records the version in
``_build_info.json`` next to ``_prophet_ops.so``; :func:`version_mismatch`
compares it with the installed one before the library is loaded, so a wheel
installed next to another TensorFlow fails with both versions and the way out
instead of an undefined-symbol error.

prophet_tf does not require a TensorFlow distribution (``tensorflow``,
``tensorflow-cpu`` and ``tensorflow[and-cuda]`` all provide the ``tensorflow``
module, and a hard requirement on one would be installed over the others):
:func:`require_tensorflow` is the import-time check with an install hint.

Nothing here imports TensorFlow.
"""

from __future__ import annotations

import importlib.util
import json
import os
import pathlib
import re

__all__ = ["BUILD_INFO_NAME", "INSTALL_HINT", "read", "minor_version", "version_mismatch",
           "rebuild_hint", "tensorflow_installed", "require_tensorflow"]

BUILD_INFO_NAME = "_build_info.json"
_PACKAGE_DIR = pathlib.Path(__file__).resolve().parent

INSTALL_HINT = ("Install one: `pip install \"prophet_tf[cpu]\"` (tensorflow-cpu) or "
                "`pip install \"prophet_tf[gpu]\"` (tensorflow[and-cuda], for NVIDIA GPUs), "
                "or a TensorFlow of your own, e.g. `pip install \"tensorflow>=2.21,<2.22\"`.")


def read(directory: str | os.PathLike | None = None) -> dict:
    """The recorded build facts (``tensorflow_version``, ...); {} when the
    library was not built or the file is unreadable."""
    directory = pathlib.Path(directory) if directory is not None else _PACKAGE_DIR
    try:
        info = json.loads((directory / BUILD_INFO_NAME).read_text())
    except (OSError, ValueError):
        return {}
    return info if isinstance(info, dict) else {}


def minor_version(version: str) -> tuple[int, int] | None:
    """``(major, minor)`` of a TensorFlow version string (``"2.21.0"``,
    ``"2.22.0rc1"``, ``"2.21.0-dev20260101"``); None if it has no such prefix."""
    match = re.match(r"\s*(\d+)\.(\d+)", str(version))
    return (int(match.group(1)), int(match.group(2))) if match else None


def rebuild_hint(installed: str) -> str:
    """How to get an op library for TensorFlow `installed`."""
    return (f"Rebuild prophet_tf against TensorFlow {installed}: from a checkout, "
            f"`pip install --no-build-isolation -e .`; otherwise `pip install "
            f"\"setuptools>=77\" wheel \"grpcio-tools>=1.85.1,<1.86\"` then `pip install "
            f"--force-reinstall --no-deps --no-build-isolation --no-binary prophet_tf "
            f"prophet_tf` (or the sdist's path as the last word; without "
            f"--no-build-isolation the build would use the TensorFlow pinned in "
            f"pyproject.toml). Or install the TensorFlow it was built for.")


def version_mismatch(built: str | None, installed: str) -> str | None:
    """The error message when an op library built against TensorFlow `built`
    cannot be loaded under TensorFlow `installed`, else None.

    Same major.minor loads (patch releases keep the ABI); None or an
    unparsable `built` (a library without build facts) is left to the loader.
    """
    if not built:
        return None
    want, have = minor_version(built), minor_version(installed)
    if want is not None and want == have:
        return None
    if want is None and built == installed:
        return None
    return (f"prophet_tf's op library was built against TensorFlow {built}, but TensorFlow "
            f"{installed} is installed: a TensorFlow op library loads only under the "
            f"TensorFlow minor version it was compiled for "
            f"({'.'.join(map(str, want)) + '.x' if want else built}). "
            f"{rebuild_hint(installed)}")


def tensorflow_installed() -> bool:
    """Whether a ``tensorflow`` module can be found, without importing it."""
    try:
        return importlib.util.find_spec("tensorflow") is not None
    except (ImportError, ValueError):
        return False


def require_tensorflow() -> None:
    """Raises ImportError with an install hint when no TensorFlow is importable.

    Looks for the module without importing it.
    """
    if not tensorflow_installed():
        raise ImportError("prophet_tf needs TensorFlow (2.21), and no TensorFlow is "
                          "installed in this environment. It does not install one by itself, "
                          "so that the one you have (CPU or GPU) stays. " + INSTALL_HINT)
