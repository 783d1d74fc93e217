"""Clipping by norms on the PS: ``global_clipnorm`` and ``clipnorm``, as Keras clips
the whole summed gradient.

Single-process Keras (``keras/src/optimizers/base_optimizer.py``) scales a step's
gradients, with ``norm`` the square root of a sum of squared entries (float32):

- ``global_clipnorm`` (``clip_by_global_norm``), one norm over all gradients:
  every gradient times ``clip * minimum(1 / norm, 1 / clip) + (norm - norm)``
  (the ``norm - norm`` term makes a non-finite norm give a NaN scale);
- ``clipnorm`` (``_clip_by_norm``), one norm per variable: its gradient times
  ``clip``, divided by ``maximum(norm, clip)`` (a norm of 0 stays 0).

The PS's optimizer is rebuilt without the option (its ``apply`` sees one
partition, whose norm is not the variable's or the step's), and
:class:`NormHold` holds each complete sum of a step until every partition of
its group (global: all of them; clipnorm: its variable's) has its sum here,
then hands them on with the group's factor; the apply scales the gradient by
it where Keras clips, inside ``optimizer.apply`` (:func:`scaled_by`). The
squared entries are added in float64, so the result differs from Keras'
float32 reduction by rounding only.

With ``gradient_accumulation_steps`` N Keras clips only at every N-th step, the
average ``(gradient + accumulator) / N``; the other steps' gradients are
accumulated as they are. So the hold lets those through at once, and at an
update step it takes the norm of that average, reading each partition's
accumulator (its previous update has been applied: this step's gradients were
computed from the version it produced).

A group with partitions on several PS tasks waits for the others' sums: once
this task has all its partitions of such groups for a step, it sends their
sums (one float64 per shared group) to the other tasks and releases them with
the totals (``norm_sharing.py``).
"""

from __future__ import annotations

import contextlib
import math
import threading
from typing import Callable

import numpy as np

__all__ = ["NormHold", "check_placement", "scale", "clip_by_norm_factor", "shared_groups",
           "scaled_by", "UNSCALED"]

#: The factor of a gradient that is not clipped: ``(multiplier, divisor)``.
UNSCALED = (np.float32(1), np.float32(1))


def shared_groups(partitions, per_variable: bool) -> tuple[tuple, list]:
    """``(groups, tasks)``: the norm groups (variable keys for ``clipnorm``, 0 for
    ``global_clipnorm``) with partitions on several PS tasks, sorted, and the PS tasks
    that own a partition of one (who share norms each step), sorted."""
    owners: dict = {}
    for p in partitions:
        owners.setdefault(p.key if per_variable else 0, set()).add(p.ps_index)
    shared = tuple(sorted(g for g, tasks in owners.items() if len(tasks) > 1))
    return shared, sorted({t for g in shared for t in owners[g]})


def check_placement(shared: bool, num_ps: int, ps0_address: str, option: str) -> None:
    """Refuses clipping whose norms span PS tasks when the workers did not say where PS
    task 0 is (the tasks agree on the norms there).

    Raises:
        ValueError: names the option, the number of PS tasks and the missing address.
    """
    if shared and not ps0_address:
        raise ValueError(
            "Norms over partitions on several PS tasks need PS task 0's address, where the "
            "tasks agree on them, and the workers' Register did not carry it (a client "
            f"older than this PS?). Received: {option}, num_ps={num_ps}, ps0_address=''")


def scale(squared_norm: float, clip: float) -> np.float32:
    """Keras' ``clip_by_global_norm`` factor for a step, in float32."""
    c = np.float32(clip)
    norm = np.float32(math.sqrt(squared_norm)) if math.isfinite(squared_norm) \
        else np.float32(squared_norm)
    with np.errstate(divide="ignore", invalid="ignore"):
        return c * np.minimum(np.float32(1) / norm, np.float32(1) / c) + (norm - norm)


def clip_by_norm_factor(squared_norm: float, clip: float):
    """``(multiplier, divisor)`` of Keras' ``_clip_by_norm`` for one variable, float32:
    its gradient times ``multiplier``, divided by ``divisor``."""
    c = np.float32(clip)
    l2sum = np.float32(squared_norm)
    norm = np.sqrt(l2sum) if l2sum > 0 else l2sum
    return c, np.maximum(norm, c)


@contextlib.contextmanager
def scaled_by(optimizer, multiplier, divisor):
    """While tracing ``optimizer.apply``: its clipping step (``_clip_gradients``, where
    Keras clips, after averaging accumulated gradients) multiplies each gradient by
    ``multiplier`` and divides it by ``divisor`` (scalar tensors: the group's factor)."""
    from keras import ops

    def clip(grads):
        return [None if g is None else (g * ops.cast(multiplier, g.dtype)) /
                ops.cast(divisor, g.dtype) for g in grads]

    optimizer._clip_gradients = clip
    try:
        yield
    finally:
        del optimizer._clip_gradients  # the class's again


class NormHold:
    """Holds a step's complete sums until their group's norm is known; releases them
    with the group's clipping factor.

    Args:
        clip: the ``global_clipnorm`` or ``clipnorm``.
        per_variable: True for ``clipnorm`` (a group is a variable's key), False
            for ``global_clipnorm`` (one group, 0).
        local_counts: group -> this task's partitions of it.
        shared: the groups with partitions on other PS tasks too, in the order
            every task uses.
        share: with ``shared``: ``(step, squared, then)`` sends this task's sums of
            squares of a step (a float64 per shared group) and calls
            ``then(totals)`` with every task's added (``NormSharing.share``).
        release: with ``shared``: called with the ready list (see :meth:`add`)
            of the shared groups once their totals are known.
        accumulation_steps: ``gradient_accumulation_steps`` (0: none).
        accumulated: with it: a partition's accumulator, as an array.
    """

    def __init__(self, clip: float, per_variable: bool, local_counts: dict, shared=(),
                 share=None, release=None, accumulation_steps: int = 0,
                 accumulated: Callable | None = None):
        option = "clipnorm" if per_variable else "global_clipnorm"
        if not clip > 0:
            raise ValueError(f"{option} must be > 0. Received: {clip!r}")
        if not local_counts or min(local_counts.values()) < 1:
            raise ValueError(f"Every group holds >= 1 partition. Received: {local_counts!r}")
        if bool(shared) != (share is not None) or (share is None) != (release is None):
            raise ValueError("shared groups, share and release go together. Received: "
                             f"shared={list(shared)!r}, share={share!r}, release={release!r}")
        if bool(accumulation_steps) != (accumulated is not None):
            raise ValueError("accumulation_steps and accumulated go together. Received: "
                             f"accumulation_steps={accumulation_steps!r}, "
                             f"accumulated={accumulated!r}")
        self.clip, self.per_variable = float(clip), per_variable
        self._steps, self._accumulated = accumulation_steps, accumulated
        self._counts, self._shared = dict(local_counts), tuple(shared)
        self._shared_parts = sum(local_counts.get(g, 0) for g in self._shared)
        self._share, self._release = share, release
        self._lock = threading.Lock()
        self._held: dict[int, dict] = {}  # step -> group -> [(part, total, iteration)]
        self._squared: dict[int, dict] = {}  # step -> group -> sum of squared entries
        self._shared_in: dict[int, int] = {}  # step -> this task's shared partitions in

    def group_of(self, part) -> int:
        return part.plan.key if self.per_variable else 0

    def add(self, part, step: int, total: np.ndarray, iteration: int) -> list:
        """Records one partition's sum of ``step``.

        Returns:
            ``[(part, step, total, iteration, (multiplier, divisor))]`` for every
            partition of the group once this was its last here and the group is this
            task's alone, or at once for a step Keras only accumulates (factor
            :data:`UNSCALED`); else ``[]`` (a shared group's go to ``release`` later).
        """
        if self._steps and (iteration + 1) % self._steps:
            return [(part, step, total, iteration, UNSCALED)]
        clipped = total
        if self._steps:  # Keras clips the average of the accumulated steps
            steps = total.dtype.type(self._steps)
            accumulated = self._accumulated(part).astype(total.dtype).reshape(total.shape)
            clipped = (total + accumulated) / steps
        group = self.group_of(part)
        squared = float(np.sum(np.square(clipped, dtype=np.float64)))
        with self._lock:
            held = self._held.setdefault(step, {}).setdefault(group, [])
            held.append((part, total, iteration))
            sums = self._squared.setdefault(step, {})
            sums[group] = sums.get(group, 0.0) + squared
            if group not in self._shared:
                if len(held) < self._counts[group]:
                    return []
                ready = [(self._take_locked(step, group), sums.pop(group))]
            else:
                self._shared_in[step] = self._shared_in.get(step, 0) + 1
                if self._shared_in[step] < self._shared_parts:
                    return []
                del self._shared_in[step]
                mine = [sums.pop(g, 0.0) for g in self._shared]
                parts = [self._take_locked(step, g) for g in self._shared]
                ready = None
        if ready is not None:
            return [r for held, squared in ready for r in self._with_factor(step, held, squared)]
        self._share(step, mine, lambda totals: self._release(
            [r for held, total in zip(parts, totals) for r in self._with_factor(step, held, total)]))
        return []

    def _take_locked(self, step: int, group) -> list:
        """A group's held sums of ``step``, no longer held (the step's entry goes with
        its last group)."""
        groups = self._held.get(step, {})
        held = groups.pop(group, [])
        if step in self._held and not groups:
            del self._held[step], self._squared[step]
        return held

    def _with_factor(self, step: int, held: list, squared: float) -> list:
        factor = (clip_by_norm_factor(squared, self.clip) if self.per_variable
                  else (scale(squared, self.clip), np.float32(1)))
        return [(p, step, t, i, factor) for p, t, i in held]

    def pending(self) -> dict[int, int]:
        """Steps held, with how many partitions each has (for errors and tests)."""
        with self._lock:
            return {step: sum(len(h) for h in groups.values())
                    for step, groups in self._held.items()}
