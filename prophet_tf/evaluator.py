"""The evaluator task: evaluates the chief's checkpoints without joining training.

A cluster may have an `evaluator` task (a TFJob's Evaluator replica). It is no
worker: it never connects to a PS, and no training step waits for it. It
watches the directory the chief's `keras.callbacks.ModelCheckpoint` writes
into, loads each new complete checkpoint into plain Keras and evaluates it,
until the chief marks training done:

    # chief (worker 0), after fit:
    prophet_tf.mark_training_done(checkpoint_dir)
    # evaluator:
    prophet_tf.evaluate_checkpoints(
        checkpoint_dir, lambda model, path: model.evaluate(x, y, return_dict=True))

Keras writes a `.keras` file in place (it opens the path and zips into it), and
ModelCheckpoint with a fixed name rewrites the same file every epoch, so a file
in the directory may be half-written. A file is read from a private copy, taken
when it has not changed for `settle_s` and checked after the copy: unchanged
meanwhile, and, for a `.keras` file, a zip whose directory (written last) and
every member's CRC check out.
"""
from __future__ import annotations

import dataclasses
import fnmatch
import logging
import math
import os
import pathlib
import shutil
import stat
import tempfile
import time
import zipfile
from typing import Any, Callable

logger = logging.getLogger(__name__)

__all__ = ["DONE_FILE", "Evaluation", "evaluate_checkpoints", "mark_training_done"]

#: The marker the chief writes into the checkpoint directory once training is over.
DONE_FILE = "training-done"


@dataclasses.dataclass(frozen=True)
class Evaluation:
    """One evaluated checkpoint: its path and what `evaluate_fn` returned."""
    path: str
    result: Any


def mark_training_done(directory, done_file: str = DONE_FILE) -> str:
    """Writes the marker that ends `evaluate_checkpoints` (the chief calls it after fit).

    Returns the marker's path. Written to a temporary name and renamed, so an
    evaluator never sees it before the checkpoints saved before it.
    """
    directory = _directory(directory)
    _file_name("done_file", done_file)
    os.makedirs(directory, exist_ok=True)
    path = os.path.join(directory, done_file)
    temporary = f"{path}.{os.getpid()}.tmp"
    with open(temporary, "w") as f:
        f.write("training done\n")
    os.replace(temporary, path)
    return path


def evaluate_checkpoints(directory, evaluate_fn: Callable[[Any, str], Any], *,
                         pattern: str = "*.keras", done_file: str = DONE_FILE,
                         poll_s: float = 2.0, settle_s: float = 1.0,
                         timeout_s: float | None = None,
                         load_fn: Callable[[str], Any] | None = None) -> list[Evaluation]:
    """Evaluates each new complete checkpoint in `directory`, once and in order.

    Every `poll_s` seconds it lists the files matching `pattern`, oldest first
    (by modification time, then name), and for each it has not evaluated in
    this version (name, size and modification time) and that is complete, calls
    `evaluate_fn(load_fn(copy), path)`. A file rewritten in place is a new
    version. It returns once `done_file` exists and every checkpoint written
    before it has been evaluated. The directory may not exist yet.

    Args:
      directory: where the chief's ModelCheckpoint writes (a shared volume).
      evaluate_fn: called as `evaluate_fn(model, path)`; what it returns is
        kept in the result. An exception in it ends the evaluation.
      pattern: the checkpoint files, a glob within `directory`.
      done_file: the marker `mark_training_done` writes. It may be the last
        checkpoint's own name (`"epoch-008.keras"`): then that file ends it.
      poll_s: seconds between two looks at the directory.
      settle_s: a file modified less than this long ago is left for later.
      timeout_s: raise TimeoutError when neither a new checkpoint nor the
        marker has appeared for this long; None waits as long as it takes.
      load_fn: makes a model of a file's path; None is `keras.models.load_model`.

    Returns:
      The evaluations, in the order they were made.

    Raises:
      ValueError: an argument is malformed (the message names what was
        received), or a checkpoint is not complete although training is done.
      TimeoutError: nothing new for `timeout_s` seconds.
    """
    directory = _directory(directory)
    if not callable(evaluate_fn):
        raise ValueError("evaluate_fn must be callable as evaluate_fn(model, path). "
                         f"Received: evaluate_fn={evaluate_fn!r}")
    _file_name("pattern", pattern)
    _file_name("done_file", done_file)
    _seconds("poll_s", poll_s, zero_ok=False)
    _seconds("settle_s", settle_s, zero_ok=True)
    if timeout_s is not None:
        _seconds("timeout_s", timeout_s, zero_ok=False)
    if load_fn is not None and not callable(load_fn):
        raise ValueError("load_fn must be callable as load_fn(path), or None. "
                         f"Received: load_fn={load_fn!r}")
    if load_fn is None:
        import keras  # Here: importing prophet_tf stays light.
        load_fn = keras.models.load_model

    watcher = _Watcher(directory, pattern, settle_s)
    # The marker may be the last checkpoint itself: then done once that file was evaluated.
    marker_is_checkpoint = fnmatch.fnmatch(done_file, pattern)
    evaluations: list[Evaluation] = []
    last_news, marker_seen = time.monotonic(), False
    with tempfile.TemporaryDirectory(prefix="prophet-tf-evaluator-") as private:
        while True:
            # The marker before the listing: every checkpoint saved before it is listed.
            done = (done_file in watcher.taken_names if marker_is_checkpoint
                    else os.path.exists(os.path.join(directory, done_file)))
            for path, copy in watcher.new_complete(private, training_done=done):
                logger.info("evaluating checkpoint %s", path)
                try:
                    model = load_fn(copy)
                finally:
                    os.unlink(copy)
                evaluations.append(Evaluation(path, evaluate_fn(model, path)))
                last_news = time.monotonic()
            if marker_is_checkpoint:
                done = done_file in watcher.taken_names
            if done and not watcher.pending:
                return evaluations
            if done and not marker_seen:
                marker_seen, last_news = True, time.monotonic()
            if timeout_s is not None and time.monotonic() - last_news > timeout_s:
                last = evaluations[-1].path if evaluations else "none"
                raise TimeoutError(
                    f"no new checkpoint matching {pattern!r} in {directory} and no "
                    f"{done_file!r} for {timeout_s} s ({len(evaluations)} evaluated, the "
                    f"last: {last}; incomplete: {sorted(watcher.pending) or 'none'}). "
                    f"Received: timeout_s={timeout_s!r}")
            time.sleep(poll_s)


class _Watcher:
    """The directory's checkpoint files: the versions taken, the files not yet complete."""

    def __init__(self, directory: str, pattern: str, settle_s: float):
        self.directory, self.pattern, self.settle_s = directory, pattern, settle_s
        self.taken: set[tuple[str, int, int]] = set()  # (name, size, mtime_ns)
        self.pending: set[str] = set()

    @property
    def taken_names(self) -> set[str]:
        return {name for name, _, _ in self.taken}

    def new_complete(self, private: str, *, training_done: bool):
        """Yields (path, private copy) of each complete file version not taken yet, oldest
        first; those not complete yet are left in `pending`."""
        self.pending = set()
        for path, version in self._listing():
            if version in self.taken:
                continue
            copy = os.path.join(private, os.path.basename(path))
            problem = self._copy(path, version, copy)
            if problem == "gone":
                continue
            if problem is not None:
                self.pending.add(path)
                # The writer has finished: a file still broken now will never be whole.
                if training_done and problem != "recent":
                    raise ValueError(f"checkpoint {path} is not a complete file although "
                                     f"training is done: {problem}. Received: {path}")
                continue
            self.taken.add(version)
            yield path, copy

    def _listing(self) -> list[tuple[str, tuple[str, int, int]]]:
        try:
            names = os.listdir(self.directory)
        except FileNotFoundError:
            return []  # Not created yet: the chief's first save makes it.
        found = []
        for name in fnmatch.filter(names, self.pattern):
            path = os.path.join(self.directory, name)
            try:
                st = os.stat(path)
            except FileNotFoundError:
                continue
            if stat.S_ISREG(st.st_mode):
                found.append((st.st_mtime_ns, name, path, (name, st.st_size, st.st_mtime_ns)))
        return [(path, version) for _, _, path, version in sorted(found)]

    def _copy(self, path: str, version, copy: str) -> str | None:
        """Copies `path` to `copy`: None when the copy is a complete file, else why not
        ("recent": being written; "gone": deleted; or what is wrong with it)."""
        _, size, mtime_ns = version
        if time.time() - mtime_ns / 1e9 < self.settle_s:
            return "recent"
        try:
            shutil.copyfile(path, copy)
            st = os.stat(path)
        except FileNotFoundError:
            return "gone"
        problem = None
        if (st.st_size, st.st_mtime_ns) != (size, mtime_ns):
            problem = "recent"  # Written to while being copied.
        elif path.endswith(".keras"):
            problem = _zip_problem(copy)
        if problem is not None:
            os.unlink(copy)
        return problem


def _zip_problem(path: str) -> str | None:
    """None when `path` is a whole zip archive (what a `.keras` file is), else what is wrong."""
    try:
        with zipfile.ZipFile(path) as archive:
            bad = archive.testzip()
    except (zipfile.BadZipFile, OSError, EOFError) as e:
        return f"not a whole zip archive: {e}"
    return None if bad is None else f"member {bad!r} fails its CRC check"


def _directory(directory) -> str:
    if isinstance(directory, pathlib.PurePath) or (isinstance(directory, str) and directory):
        return os.fspath(directory)
    raise ValueError("directory must be a non-empty path (str or pathlib.Path). "
                     f"Received: directory={directory!r}")


def _file_name(name: str, value) -> None:
    if not isinstance(value, str) or not value or "/" in value or value in (".", ".."):
        raise ValueError(f"{name} must be a file name (or glob) inside the directory, without "
                         f"'/'. Received: {name}={value!r}")


def _seconds(name: str, value, *, zero_ok: bool) -> None:
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(
            value) or value < 0 or (value == 0 and not zero_ok):
        bound = ">= 0" if zero_ok else "> 0"
        raise ValueError(f"{name} must be a finite number of seconds {bound}. "
                         f"Received: {name}={value!r}")
