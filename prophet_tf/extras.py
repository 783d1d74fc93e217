"""The optional parts of prophet_tf and what installs each.

Training needs none of them: the runtime imports and runs without matplotlib
(plots: the `bench` or `plot` extra) and without tf_keras (Keras 2 models and
the bench's tf-mwms baseline). A command that needs one checks for it before it
starts work and says how to install it; the `prophet-tf` command line prints
that message instead of a traceback.
"""
from __future__ import annotations

import importlib
import importlib.util

__all__ = ["MissingExtra", "check", "require"]

# tf_keras asks for the `tensorflow` distribution: installed with its
# dependencies it would go over tensorflow-cpu or tensorflow[and-cuda].
_INSTALL = {
    "matplotlib": 'pip install "prophet_tf[{extra}]" (or pip install matplotlib)',
    "tf_keras": 'pip install --no-deps "tf_keras>=2.21,<2.22" (or, where the `tensorflow` '
                'distribution is installed, pip install "prophet_tf[tf-keras]")',
}


class MissingExtra(RuntimeError):
    """An optional dependency a command needs is not installed."""


def _error(module: str, needed_by: str, extra: str) -> MissingExtra:
    return MissingExtra(f"{needed_by} needs {module}, which is not installed: "
                        + _INSTALL[module].format(extra=extra))


def check(module: str, needed_by: str, extra: str = "bench") -> None:
    """Raises MissingExtra unless ``module`` can be imported (without importing it).

    Raises:
      MissingExtra: names ``needed_by`` and how to install ``module``.
      KeyError: ``module`` is not one of the optional dependencies.
    """
    if module not in _INSTALL:
        raise KeyError(f"not an optional dependency: {module!r}; known: {sorted(_INSTALL)}")
    if importlib.util.find_spec(module) is None:
        raise _error(module, needed_by, extra)


def require(module: str, needed_by: str, extra: str = "bench"):
    """``module``, imported; MissingExtra (as :func:`check`) when it is not installed."""
    check(module, needed_by, extra)
    try:
        return importlib.import_module(module)
    except ImportError:
        raise _error(module, needed_by, extra) from None
