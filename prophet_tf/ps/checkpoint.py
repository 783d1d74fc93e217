"""Checkpoints of one PS task: parameters, optimizer state and the step.

A checkpoint of version v holds every partition this task owns at version v
(v optimizer steps applied) and the optimizer's variables (slots, iteration
counter, learning rate) at that moment. The servicer takes it on its apply
thread right after the last partition reached v, before any partition can
move on (moving on needs every worker to pull version v first), so the
snapshot is consistent without stopping the workers.

On disk, one directory per checkpoint::

    DIR/ckpt-000000120/state.npz   arrays "p<key>_<partition>", "o<index>"
    DIR/ckpt-000000120/meta.json   step, model signature, optimizer variable names

written under a temporary name, flushed to disk and renamed: a crash leaves
either the whole checkpoint or a ``.tmp-*`` directory that is ignored and
removed. The newest ``keep`` checkpoints are kept.
"""
from __future__ import annotations

import dataclasses
import json
import logging
import os
import queue
import re
import shutil
import threading
import time
from typing import Mapping, Sequence

import numpy as np

__all__ = ["CheckpointPolicy", "Checkpointer", "Snapshot", "model_signature",
           "signature_difference", "choose", "take", "signature_of", "install"]

logger = logging.getLogger(__name__)

_FORMAT = 1
_NAME = re.compile(r"^ckpt-(\d{9,})$")


@dataclasses.dataclass(frozen=True)
class CheckpointPolicy:
    """When and where a PS task saves checkpoints.

    Args:
        directory: this task's checkpoint directory (created if missing).
        every_steps: save at every version divisible by this.
        every_secs: save the first completed version this long after the last save.
        keep: how many of the newest checkpoints to keep.
    """
    directory: str
    every_steps: int | None = None
    every_secs: float | None = None
    keep: int = 3

    def __post_init__(self):
        if not self.directory:
            raise ValueError(f"checkpoint directory must be a path. Received: {self.directory!r}")
        if self.every_steps is not None and (not isinstance(self.every_steps, int)
                                             or self.every_steps < 1):
            raise ValueError(f"every_steps must be an integer >= 1. "
                             f"Received: every_steps={self.every_steps!r}")
        if self.every_secs is not None and not self.every_secs > 0:
            raise ValueError(f"every_secs must be > 0. Received: every_secs={self.every_secs!r}")
        if self.every_steps is None and self.every_secs is None:
            raise ValueError("Give every_steps or every_secs (or both). Received: neither")
        if not isinstance(self.keep, int) or self.keep < 1:
            raise ValueError(f"keep must be an integer >= 1. Received: keep={self.keep!r}")


@dataclasses.dataclass
class Snapshot:
    """One checkpoint's content."""
    step: int
    signature: dict
    params: dict[tuple[int, int], np.ndarray]
    optimizer_names: list[str]
    optimizer_values: list[np.ndarray]
    # Steps a loss-scaled model skipped before ``step`` (the optimizer's
    # iteration count is ``step`` minus these; ps/verdicts.py).
    skipped_steps: int = 0


class Checkpointer:
    """Saves snapshots in the background and finds them again.

    ``save`` copies nothing itself: the caller hands over arrays it will not
    change (the servicer reads fresh copies of its variables). Writing happens
    on a background thread so the apply thread is held only for the reads.
    """

    def __init__(self, policy: CheckpointPolicy):
        self.policy = policy
        os.makedirs(policy.directory, exist_ok=True)
        for name in os.listdir(policy.directory):  # debris of a crash mid-write
            if name.startswith(".tmp-"):
                shutil.rmtree(os.path.join(policy.directory, name), ignore_errors=True)
        self._last_save = time.monotonic()
        self._last_step: int | None = None
        self._queue: queue.Queue = queue.Queue()
        self._error: BaseException | None = None
        self._writer = threading.Thread(target=self._write_loop, daemon=True,
                                        name="prophet-tf-checkpoint")
        self._writer.start()

    # ---------------------------------------------------------------- saving

    def due(self, step: int) -> bool:
        """Whether version ``step`` (just completed) should be saved."""
        if step <= 0 or step == self._last_step:
            return False
        p = self.policy
        return bool((p.every_steps and step % p.every_steps == 0)
                    or (p.every_secs and time.monotonic() - self._last_save >= p.every_secs))

    def save(self, snapshot: Snapshot) -> None:
        """Queues ``snapshot`` for writing; raises a previous write's error."""
        if self._error is not None:
            raise RuntimeError(f"Writing a checkpoint to {self.policy.directory} failed: "
                               f"{self._error}") from self._error
        self._last_save, self._last_step = time.monotonic(), snapshot.step
        self._queue.put(snapshot)

    def flush(self) -> None:
        """Waits until every queued checkpoint is on disk."""
        self._queue.join()

    def close(self) -> None:
        self.flush()
        self._queue.put(None)
        self._writer.join()

    def _write_loop(self):
        while True:
            snapshot = self._queue.get()
            try:
                if snapshot is None:
                    return
                self._write(snapshot)
            except BaseException as e:  # reported on the next save
                logger.exception("Writing checkpoint of step %d failed", snapshot.step)
                self._error = e
            finally:
                self._queue.task_done()

    def _write(self, snapshot: Snapshot) -> None:
        directory = self.policy.directory
        final = os.path.join(directory, f"ckpt-{snapshot.step:09d}")
        tmp = os.path.join(directory, f".tmp-ckpt-{snapshot.step:09d}-{os.getpid()}")
        shutil.rmtree(tmp, ignore_errors=True)
        os.makedirs(tmp)
        arrays = {f"p{k}_{p}": a for (k, p), a in snapshot.params.items()}
        arrays.update({f"o{i}": a for i, a in enumerate(snapshot.optimizer_values)})
        with open(os.path.join(tmp, "state.npz"), "wb") as f:
            np.savez(f, **arrays)
            f.flush()
            os.fsync(f.fileno())
        meta = {"format": _FORMAT, "step": snapshot.step, "signature": snapshot.signature,
                "optimizer_variables": snapshot.optimizer_names,
                "skipped_steps": snapshot.skipped_steps, "saved_at": time.time()}
        with open(os.path.join(tmp, "meta.json"), "w") as f:
            json.dump(meta, f)
            f.flush()
            os.fsync(f.fileno())
        if os.path.exists(final):  # the same step saved again (a restarted job)
            shutil.rmtree(final)
        os.rename(tmp, final)
        _fsync_dir(directory)
        logger.info("Checkpoint of step %d written to %s", snapshot.step, final)
        for old in self.steps()[:-self.policy.keep]:
            shutil.rmtree(os.path.join(directory, f"ckpt-{old:09d}"), ignore_errors=True)

    # --------------------------------------------------------------- reading

    def steps(self) -> list[int]:
        """The steps of the complete checkpoints on disk, oldest first."""
        found = []
        for name in os.listdir(self.policy.directory):
            m = _NAME.match(name)
            if m and os.path.exists(os.path.join(self.policy.directory, name, "meta.json")):
                found.append(int(m.group(1)))
        return sorted(found)

    def load(self, step: int) -> Snapshot:
        """Reads the checkpoint of ``step``; ValueError names a damaged file."""
        path = os.path.join(self.policy.directory, f"ckpt-{step:09d}")
        try:
            with open(os.path.join(path, "meta.json")) as f:
                meta = json.load(f)
            if meta.get("format") != _FORMAT or meta.get("step") != step:
                raise ValueError(f"format {meta.get('format')}, step {meta.get('step')}")
            with np.load(os.path.join(path, "state.npz")) as data:
                params, optimizer = {}, []
                for name in data.files:
                    if name.startswith("p"):
                        key, _, part = name[1:].partition("_")
                        params[int(key), int(part)] = data[name]
                names = meta["optimizer_variables"]
                optimizer = [data[f"o{i}"] for i in range(len(names))]
            skipped = meta.get("skipped_steps", 0)
            if type(skipped) is not int or not 0 <= skipped <= step:
                raise ValueError(f"skipped_steps {skipped!r}")
        except (OSError, ValueError, KeyError, TypeError) as e:
            raise ValueError(f"The checkpoint in {path} cannot be read: {e}") from None
        return Snapshot(step, meta["signature"], params, names, optimizer, skipped)


def _fsync_dir(path: str) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def model_signature(specs: Sequence, partitions: Sequence, optimizer_class: str,
                    ps_index: int, num_ps: int) -> dict:
    """What must match between a checkpoint and the model that restores it."""
    return {
        "variables": [[s.key, s.name, list(s.shape), s.dtype] for s in specs],
        "partitions": sorted([p.key, p.partition, p.begin, p.end]
                             for p in partitions if p.ps_index == ps_index),
        "optimizer": optimizer_class,
        "ps_index": ps_index,
        "num_ps": num_ps,
    }


def signature_difference(saved: Mapping, current: Mapping) -> str | None:
    """A readable first difference between two signatures, or None."""
    for field in ("num_ps", "ps_index", "optimizer", "variables", "partitions"):
        a, b = saved.get(field), current.get(field)
        if a != b:
            if isinstance(a, list) and isinstance(b, list):
                if len(a) != len(b):
                    return f"{field}: {len(a)} in the checkpoint, {len(b)} now"
                i = next(i for i, (x, y) in enumerate(zip(a, b)) if x != y)
                return f"{field}[{i}]: {a[i]} in the checkpoint, {b[i]} now"
            return f"{field}: {a!r} in the checkpoint, {b!r} now"
    return None


# --- the servicer's glue --------------------------------------------------------


def choose(checkpointer: Checkpointer | None, signature: dict, optimizer_variables: Sequence,
           num_parts: int, resume_step: int) -> Snapshot | None:
    """The checkpoint to restore at the first Register, or None.

    Workers that resume from their own backup (``resume_step`` > 0) get the
    checkpoint of that very iteration, so both sides continue from the same
    point; workers starting afresh get the newest one.

    Args:
        signature: :func:`model_signature` of the declared model.
        optimizer_variables: the rebuilt optimizer's variables.
        num_parts: the partitions this PS owns.

    Raises:
        ValueError: the checkpoint is unreadable, of another model or cluster,
            or does not fit the optimizer.
    """
    if checkpointer is None:
        return None
    steps = checkpointer.steps()
    if not steps:
        return None
    if resume_step:
        if resume_step not in steps:
            logger.warning("No checkpoint of step %d (the workers' resume step) in %s; "
                           "have %s", resume_step, checkpointer.policy.directory, steps)
            return None
        step = resume_step
    else:
        step = steps[-1]
    snapshot = checkpointer.load(step)
    difference = signature_difference(snapshot.signature, signature)
    if difference:
        raise ValueError(f"The checkpoint of step {step} in {checkpointer.policy.directory} "
                         f"is of another model or cluster ({difference}; partitions "
                         "differ with the PS count, the partition size, the optimizer's "
                         "needs and the prophet_tf version that cut them). Use another "
                         "--checkpoint-dir or remove it; a saved Keras model carries the "
                         "weights and optimizer state over. Received: the model of worker 0")
    shapes = [tuple(v.shape) for v in optimizer_variables]
    if ([tuple(a.shape) for a in snapshot.optimizer_values] != shapes
            or len(snapshot.params) != num_parts):
        raise ValueError(f"The checkpoint of step {step} does not fit the optimizer "
                         f"{signature['optimizer']}'s variables")
    return snapshot


def take(step: int, signature: dict, params: dict, optimizer_variables: Sequence,
         skipped_steps: int = 0) -> Snapshot:
    """A snapshot of ``params`` (copies, by (key, partition)) and the optimizer's state."""
    names = [v.path for v in optimizer_variables]
    values = [np.array(v.numpy(), copy=True) for v in optimizer_variables]
    return Snapshot(step, signature, params, names, values, skipped_steps)


def signature_of(model, ps_index: int, num_ps: int) -> dict:
    """:func:`model_signature` of a registered model (``registration.Model``)."""
    return model_signature(model.specs, model.partitions, type(model.optimizer).__name__,
                           ps_index, num_ps)


def install(snapshot, parts: Mapping, optimizer) -> None:
    """Writes ``snapshot``'s parameters into ``parts`` (``(key, partition) -> Part``) and
    its optimizer state into ``optimizer``'s variables."""
    for (key, partition), part in parts.items():
        part.variable.assign(snapshot.params[key, partition].reshape(part.shape))
    for variable, value in zip(optimizer.variables, snapshot.optimizer_values):
        variable.assign(value)
