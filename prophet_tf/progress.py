"""Task progress, worker side: a small JSON status file the launcher shows.

`prophet-tf launch` gives each worker the path of its status file
in ``PROPHET_TF_STATUS_FILE``. :func:`report` merges fields (``step``,
``epoch``, ...) into this process's status and writes the file atomically
(write, then ``os.replace``) at most once per :data:`MIN_INTERVAL_S`; a
pending update is written when the interval is over and at exit. Without the
variable, :func:`report` does nothing. The engine reports the step; the epoch
comes from :func:`keras_callback`, which a training script may add to ``fit``
(Keras tells a strategy nothing about epochs).

The launcher reads the file with :func:`read_status` and shows it on its
board (prophet_tf.tools.board).

Nothing here imports TensorFlow or Keras (the callback imports Keras when it
is made).
"""
from __future__ import annotations

import atexit
import json
import logging
import os
import threading
import time
from typing import Callable

from prophet_tf import environment

__all__ = ["STATUS_FILE_ENV", "MIN_INTERVAL_S", "StatusWriter", "writer", "report",
           "read_status", "keras_callback"]

logger = logging.getLogger(__name__)

#: Environment variable naming this worker's status file.
STATUS_FILE_ENV = environment.STATUS_FILE
#: Shortest time between two writes of a status file.
MIN_INTERVAL_S = 1.0


class StatusWriter:
    """Writes one process's status as JSON, atomically and throttled.

    Args:
      path: the status file.
      min_interval_s: shortest time between two writes; a throttled update is
        written by a timer when the interval is over.
      clock: monotonic clock in seconds (tests pass their own).
    """

    def __init__(self, path: str, min_interval_s: float = MIN_INTERVAL_S,
                 clock: Callable[[], float] = time.monotonic):
        if not path:
            raise ValueError(f"a status file path is needed. Received: path={path!r}")
        self.path = path
        self.min_interval_s = float(min_interval_s)
        self._clock = clock
        self._lock = threading.Lock()
        self._fields: dict = {"pid": os.getpid()}
        self._dirty = False
        self._last_write = -float("inf")
        self._timer: threading.Timer | None = None
        self.writes = 0

    def update(self, **fields) -> None:
        """Merges `fields` into the status; writes now unless one was written recently."""
        with self._lock:
            self._fields.update(fields)
            self._dirty = True
            wait = self._last_write + self.min_interval_s - self._clock()
            if wait <= 0:
                self._write_locked()
            elif self._timer is None:
                self._timer = threading.Timer(wait, self.flush)
                self._timer.daemon = True
                self._timer.start()

    def flush(self) -> None:
        """Writes a pending update now."""
        with self._lock:
            self._timer = None
            if self._dirty:
                self._write_locked()

    def _write_locked(self) -> None:
        self._fields["time"] = time.time()
        tmp = f"{self.path}.tmp{os.getpid()}"
        try:
            with open(tmp, "w") as f:
                json.dump(self._fields, f)
            os.replace(tmp, self.path)  # Readers see the old or the new file, never half.
        except OSError as e:  # Progress is best effort: training goes on without it.
            logger.debug("cannot write the status file %s: %s", self.path, e)
        self._dirty = False
        self._last_write = self._clock()
        self.writes += 1


_writer: StatusWriter | None = None
_writer_made = False
_writer_lock = threading.Lock()


def writer() -> StatusWriter | None:
    """This process's writer for ``PROPHET_TF_STATUS_FILE``, or None when unset."""
    global _writer, _writer_made
    if _writer_made:
        return _writer
    with _writer_lock:
        if not _writer_made:
            path = os.environ.get(STATUS_FILE_ENV, "")
            if path:
                _writer = StatusWriter(path)
                atexit.register(_writer.flush)  # The last step, whatever the throttle.
            _writer_made = True
    return _writer


def report(**fields) -> None:
    """Merges `fields` (e.g. ``step=12``, ``epoch=2``) into this process's status file."""
    status = writer()
    if status is not None:
        status.update(**fields)


def read_status(path: str) -> dict | None:
    """The status a worker wrote, or None when there is none (yet) or it is unreadable."""
    try:
        with open(path) as f:
            status = json.load(f)
    except (OSError, ValueError):
        return None
    return status if isinstance(status, dict) else None


def keras_callback():
    """A Keras callback that reports the epoch (1-based, with the total) to the launcher.

    Add it to ``model.fit(..., callbacks=[progress.keras_callback()])``; it
    does nothing outside `prophet-tf launch`.
    """
    import keras

    class _ProgressCallback(keras.callbacks.Callback):
        def on_epoch_begin(self, epoch, logs=None):
            report(epoch=int(epoch) + 1, epochs=self.params.get("epochs"))

    return _ProgressCallback()
