"""Loading prophet_tf's native library: ``_prophet_ops.so``, once, two ways.

``_prophet_ops.so`` holds the TensorFlow ops (``ReadyStamp``, ``PushGrad``,
``AwaitParam``; the bench's ``EmulatedDelay``) and a small C API the engine drives through ctypes: the stamp
buffer, the gradient queue and the parameter staging area. The library is
loaded twice, by ``tf.load_op_library`` and by ``ctypes.CDLL`` on the same
path; the second load uses ``RTLD_NOLOAD`` so it can only attach to the image
TensorFlow already loaded, which is what makes the kernels and the engine share
one set of queues.

Nothing is loaded at import time. :func:`load` loads on first use and raises
``ImportError`` with a rebuild hint when the library is missing or was built
against another TensorFlow minor version (checked before loading, from
``_build_info.json``: see prophet_tf._build_info); :func:`ops_available` never raises. The ops and
the C API's wrappers are prophet_tf._native.
"""

from __future__ import annotations

import ctypes
import logging
import os
import pathlib
import threading
from typing import Any, NamedTuple

# No TensorFlow distribution is required by the package (CPU and GPU users each keep
# their own): without one, this import says how to install it.
from prophet_tf._build_info import require_tensorflow

require_tensorflow()

import tensorflow as tf  # noqa: E402

from prophet_tf import _build_info as build_info

__all__ = ["LIBRARY_NAME", "BUILD_INFO_NAME", "REBUILD_HINT", "Native", "load_library", "load",
           "ops_available"]

logger = logging.getLogger(__name__)

LIBRARY_NAME = "_prophet_ops.so"
BUILD_INFO_NAME = build_info.BUILD_INFO_NAME
_PACKAGE_DIR = pathlib.Path(__file__).resolve().parent
REBUILD_HINT = ("Rebuild it from the prophet_tf checkout with `pip install -e .` or "
                "`python setup.py build_ext --inplace`.")


class _GradInfo(ctypes.Structure):
    _fields_ = [("key", ctypes.c_int64), ("step", ctypes.c_int64), ("data", ctypes.c_void_p),
                ("nbytes", ctypes.c_int64), ("handle", ctypes.c_int64), ("dtype", ctypes.c_int32),
                ("reserved", ctypes.c_int32), ("ready_ns", ctypes.c_int64)]


class Native(NamedTuple):
    """The loaded library: ``ops`` is the op module, ``lib`` the ctypes C API."""

    ops: Any
    lib: ctypes.CDLL
    path: pathlib.Path


def _declare_c_api(lib: ctypes.CDLL) -> None:
    i64, i32, vp = ctypes.c_int64, ctypes.c_int32, ctypes.c_void_p
    signatures = {
        "prophet_now_ns": (i64, []),
        "prophet_stamp": (None, [i64, i64, i32]),
        "prophet_drain_stamps": (i64, [vp, i64]),
        "prophet_stamps_dropped": (i64, []),
        "prophet_stamp_capacity": (i64, []),
        "prophet_stamp_kind_name": (ctypes.c_char_p, [i32]),
        "prophet_stamp_benchmark": (i64, [i64, i32]),
        "prophet_next_grad": (ctypes.c_int, [i64, ctypes.POINTER(_GradInfo)]),
        "prophet_release_grad": (None, [i64]),
        "prophet_outstanding_grads": (i64, []),
        "prophet_queued_grads": (i64, []),
        "prophet_declare_param": (ctypes.c_int, [i64, i32, i32, ctypes.POINTER(i64)]),
        "prophet_freeze_param": (ctypes.c_int, [i64]),
        "prophet_deliver_begin": (ctypes.c_int, [i64, i64]),
        "prophet_deliver_write": (ctypes.c_int, [i64, i64, i64, vp, i64]),
        "prophet_deliver_commit": (ctypes.c_int, [i64, i64]),
        "prophet_deliver_cancel": (ctypes.c_int, [i64, i64]),
        "prophet_param_nbytes": (i64, [i64]),
        "prophet_param_version": (i64, [i64]),
        "prophet_param_dtype": (i32, [i64]),
        "prophet_pending_awaits": (i64, []),
        "prophet_abort": (None, [ctypes.c_char_p]),
        "prophet_reset": (None, []),
        "prophet_last_error": (ctypes.c_char_p, []),
        "prophet_last_error_code": (ctypes.c_int, []),
    }
    for name, (restype, argtypes) in signatures.items():
        fn = getattr(lib, name)
        fn.restype = restype
        fn.argtypes = argtypes


def load_library(directory: str | os.PathLike | None = None) -> Native:
    """Loads ``_prophet_ops.so`` from `directory` (default: this package). Uncached.

    Args:
        directory: folder holding ``_prophet_ops.so`` and ``_build_info.json``.

    Returns:
        The loaded `Native` library.

    Raises:
        ImportError: the library is missing, was built against another
            TensorFlow version, or fails to load; the message says how to rebuild.
    """
    directory = pathlib.Path(directory) if directory is not None else _PACKAGE_DIR
    path = directory / LIBRARY_NAME
    if not path.is_file():
        raise ImportError(f"prophet_tf's native op library was not built: {path} does not "
                          f"exist. {REBUILD_HINT}")
    built = build_info.read(directory).get("tensorflow_version")
    mismatch = build_info.version_mismatch(built, tf.__version__)
    if mismatch:
        # Refused before dlopen: under another minor version it would fail with an
        # undefined symbol, or load and misbehave.
        raise ImportError(f"{mismatch} (library: {path})")
    try:
        ops = tf.load_op_library(str(path))
    except Exception as e:  # tf.errors.NotFoundError for dlopen failures; be broad.
        raise ImportError(f"prophet_tf's op library {path} failed to load: {e}. "
                          f"{REBUILD_HINT}") from e
    try:
        # RTLD_NOLOAD: attach to the image TensorFlow just loaded, never a second copy,
        # so the kernels and this C API share one runtime.
        lib = ctypes.CDLL(str(path), mode=os.RTLD_NOW | os.RTLD_NOLOAD)
        _declare_c_api(lib)
    except (OSError, AttributeError) as e:
        raise ImportError(f"prophet_tf could not bind the C API of {path}: {e}. "
                          f"{REBUILD_HINT}") from e
    if built and built != tf.__version__:
        logger.info("prophet_tf's op library was built against TensorFlow %s and TensorFlow %s "
                    "is installed: same minor version, loaded", built, tf.__version__)
    return Native(ops=ops, lib=lib, path=path)


_lock = threading.Lock()
_native: Native | None = None


def load() -> Native:
    """Loads the package's native library once and returns it.

    Raises:
        ImportError: as `load_library`.
    """
    global _native
    if _native is None:
        with _lock:
            if _native is None:
                _native = load_library()
    return _native


def ops_available() -> bool:
    """Returns whether the native library loads. Never raises."""
    try:
        load()
        return True
    except Exception:  # pylint: disable=broad-except
        return False
