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

The partitions the norm needs must all be on this PS task: with several PS
tasks the norm would need an agreement between them (docs/design.md,
"Gradient clipping"), so Register refuses ``global_clipnorm`` there
(:func:`check_placement`).
"""

from __future__ import annotations

import math
import threading

import numpy as np

__all__ = ["GlobalNorm", "check_placement", "scale"]


def check_placement(global_clipnorm: float | None, num_ps: int) -> None:
    """Refuses ``global_clipnorm`` when the step's partitions span PS tasks.

    Raises:
        ValueError: names the option, its value and the number of PS tasks.
    """
    if global_clipnorm and num_ps > 1:
        raise ValueError(
            "global_clipnorm scales every gradient by one norm over all variables' summed "
            f"gradients, but this job's variables are on {num_ps} PS tasks, which do not "
            "agree on one norm per step. Run one PS task, or use clipnorm (per variable) or "
            f"clipvalue. Received: global_clipnorm={global_clipnorm!r}, num_ps={num_ps}")


def scale(squared_norm: float, clip: float) -> np.float32:
    """Keras' ``clip_by_global_norm`` factor for a step, in float32."""
    c = np.float32(clip)
    norm = np.float32(math.sqrt(squared_norm)) if math.isfinite(squared_norm) \
        else np.float32(squared_norm)
    with np.errstate(divide="ignore", invalid="ignore"):
        return c * np.minimum(np.float32(1) / norm, np.float32(1) / c) + (norm - norm)


class GlobalNorm:
    """Holds a step's complete sums until all ``num_parts`` have theirs.

    Args:
        clip: the ``global_clipnorm``.
        num_parts: the partitions of a step (all of this PS task's).
    """

    def __init__(self, clip: float, num_parts: int):
        if not clip > 0:
            raise ValueError(f"global_clipnorm must be > 0. Received: {clip!r}")
        if num_parts < 1:
            raise ValueError(f"num_parts must be >= 1. Received: {num_parts!r}")
        self.clip, self.num_parts = float(clip), num_parts
        self._lock = threading.Lock()
        self._held: dict[int, list] = {}  # step -> [(part, total, iteration)]
        self._squared: dict[int, float] = {}  # step -> sum of squared entries so far

    def add(self, part, step: int, total: np.ndarray, iteration: int) -> list:
        """Records one partition's sum of ``step``.

        Returns:
            ``[(part, step, scaled total, iteration)]`` for every partition of
            the step once this was the last; else ``[]``.
        """
        squared = float(np.sum(np.square(total, dtype=np.float64)))
        with self._lock:
            held = self._held.setdefault(step, [])
            held.append((part, total, iteration))
            self._squared[step] = self._squared.get(step, 0.0) + squared
            if len(held) < self.num_parts:
                return []
            del self._held[step]
            factor = scale(self._squared.pop(step), self.clip)
        return [(p, step, (t * factor).astype(t.dtype, copy=False), i) for p, t, i in held]

    def pending(self) -> dict[int, int]:
        """Steps held, with how many partitions each has (for errors and tests)."""
        with self._lock:
            return {step: len(held) for step, held in self._held.items()}
