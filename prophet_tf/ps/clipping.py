"""``global_clipnorm`` on the PS: one norm over every partition's summed gradient.

Single-process Keras (``keras/src/optimizers/base_optimizer.py``,
``clip_by_global_norm``) scales every gradient of a step by

    scale = clip * minimum(1 / norm, 1 / clip) + (norm - norm)

with ``norm`` the square root of the sum of all gradients' squared entries
(float32; the ``norm - norm`` term makes a non-finite norm give a NaN scale).
The PS's optimizer is rebuilt without the option (its ``apply`` sees one
partition, whose norm is not the step's), and :class:`GlobalNorm` holds each
complete sum of a step until every partition of the step has its sum, then
hands them all on, scaled by that step's one factor. The squared norms are
added in float64, so the result differs from Keras' float32 reduction by
rounding only.

With several PS tasks, each adds its own partitions' squared entries and the
tasks agree on the step's total through PS task 0 (``norm_sharing.py``);
the held sums are released once the total is back.
"""

from __future__ import annotations

import math
import threading

import numpy as np

__all__ = ["GlobalNorm", "check_placement", "scale"]


def check_placement(global_clipnorm: float | None, num_ps: int, ps0_address: str) -> None:
    """Refuses ``global_clipnorm`` on several PS tasks when the workers did not say
    where PS task 0 is (the tasks agree on the norm there).

    Raises:
        ValueError: names the option, the number of PS tasks and the missing address.
    """
    if global_clipnorm and num_ps > 1 and not ps0_address:
        raise ValueError(
            "global_clipnorm on several PS tasks needs PS task 0's address, where the tasks "
            "agree on each step's norm, and the workers' Register did not carry it (a "
            "client older than this PS?). Received: global_clipnorm="
            f"{global_clipnorm!r}, num_ps={num_ps}, ps0_address=''")


def scale(squared_norm: float, clip: float) -> np.float32:
    """Keras' ``clip_by_global_norm`` factor for a step, in float32."""
    c = np.float32(clip)
    norm = np.float32(math.sqrt(squared_norm)) if math.isfinite(squared_norm) \
        else np.float32(squared_norm)
    with np.errstate(divide="ignore", invalid="ignore"):
        return c * np.minimum(np.float32(1) / norm, np.float32(1) / c) + (norm - norm)


class GlobalNorm:
    """Holds a step's complete sums until all ``num_parts`` have theirs, and the
    step's norm is known.

    Args:
        clip: the ``global_clipnorm``.
        num_parts: the partitions of a step on this PS task.
        share: None when this task holds every partition; else
            ``(step, squared, then)``, which sends this task's sum of squares of
            a step to the other tasks and calls ``then(total)`` with all tasks'
            (``norm_sharing.NormSharing.share``).
        release: with ``share``: called with the ready list (see :meth:`add`)
            once the step's total is known.
    """

    def __init__(self, clip: float, num_parts: int, share=None, release=None):
        if not clip > 0:
            raise ValueError(f"global_clipnorm must be > 0. Received: {clip!r}")
        if num_parts < 1:
            raise ValueError(f"num_parts must be >= 1. Received: {num_parts!r}")
        if (share is None) != (release is None):
            raise ValueError("share and release go together. Received: "
                             f"share={share!r}, release={release!r}")
        self.clip, self.num_parts = float(clip), num_parts
        self._share, self._release = share, release
        self._lock = threading.Lock()
        self._held: dict[int, list] = {}  # step -> [(part, total, iteration)]
        self._squared: dict[int, float] = {}  # step -> sum of squared entries so far

    def add(self, part, step: int, total: np.ndarray, iteration: int) -> list:
        """Records one partition's sum of ``step``.

        Returns:
            ``[(part, step, scaled total, iteration)]`` for every partition of
            the step once this was the last and the norm is this task's alone;
            else ``[]`` (with ``share``, ``release`` gets that list later).
        """
        squared = float(np.sum(np.square(total, dtype=np.float64)))
        with self._lock:
            held = self._held.setdefault(step, [])
            held.append((part, total, iteration))
            self._squared[step] = self._squared.get(step, 0.0) + squared
            if len(held) < self.num_parts:
                return []
            del self._held[step]
            mine = self._squared.pop(step)
        if self._share is None:
            return self._scaled(step, held, mine)
        self._share(step, mine, lambda everyone: self._release(
            self._scaled(step, held, everyone)))
        return []

    def _scaled(self, step: int, held: list, squared: float) -> list:
        factor = scale(squared, self.clip)
        return [(p, step, (t * factor).astype(t.dtype, copy=False), i) for p, t, i in held]

    def pending(self) -> dict[int, int]:
        """Steps held, with how many partitions each has (for errors and tests)."""
        with self._lock:
            return {step: len(held) for step, held in self._held.items()}
