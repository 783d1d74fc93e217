"""Keeps Keras from importing the optional packages it integrates with.

When scikit-learn and matplotlib are installed, ``import keras`` (and ``import
tensorflow``, which imports Keras) imports both, for Keras' scikit-learn
wrappers and its image-plotting utilities: about 0.9 CPU-seconds and tens of
MB per process. A parameter-server task uses neither, nor do the bench's and
the tests' worker programs; Keras treats a package it cannot import as absent
(``try: import ... except ImportError``). :func:`skip_keras_integrations`
makes them unimportable to Keras' and TensorFlow's own import in this process:
the program itself may still import them (before or after).
"""
from __future__ import annotations

import importlib.abc
import sys

__all__ = ["KERAS_INTEGRATIONS", "skip_keras_integrations"]

#: The packages Keras imports when they are installed, which a process that
#: only trains or applies updates never uses.
KERAS_INTEGRATIONS = ("sklearn", "matplotlib")


def _initializing(module_name: str) -> bool:
    """Whether ``module_name`` is being imported right now (its module body runs)."""
    spec = getattr(sys.modules.get(module_name), "__spec__", None)
    return bool(getattr(spec, "_initializing", False))


class _Unimportable(importlib.abc.MetaPathFinder):
    """Fails the import of the named top-level packages and their modules while
    Keras or TensorFlow is being imported."""

    def __init__(self, packages):
        self.packages = frozenset(packages)

    def find_spec(self, name, path=None, target=None):
        if name.partition(".")[0] in self.packages and (
                _initializing("keras") or _initializing("tensorflow")):
            raise ModuleNotFoundError(
                f"{name} is not imported by Keras in this process (prophet_tf.lean_keras)",
                name=name)
        return None


def skip_keras_integrations() -> bool:
    """Makes :data:`KERAS_INTEGRATIONS` unimportable to Keras' import in this process.

    Returns False, changing nothing, once Keras or one of those packages is
    imported: then it is too late to save anything, and a package half
    imported must stay importable.
    """
    if any(name in sys.modules for name in ("keras", "tensorflow", *KERAS_INTEGRATIONS)):
        return False
    if not any(isinstance(f, _Unimportable) for f in sys.meta_path):
        sys.meta_path.insert(0, _Unimportable(KERAS_INTEGRATIONS))
    return True
