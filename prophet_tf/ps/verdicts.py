"""Step verdicts of a loss-scaled model: apply the step, or skip it everywhere.

Workers that scale their loss (a Keras ``LossScaleOptimizer``, the
``mixed_float16`` policy) push every gradient the moment it exists, overflowed
or not, so pushes still overlap backprop. Once a worker's backprop is done it
sends every PS task its verdict of the step: whether all its gradients were
finite (the ``Verdict`` RPC, a gather round per step). A PS task applies a
partition's sum for step k only once it holds every worker's verdict of k:

* all finite: the sum is applied, as without loss scaling;
* any not: the step is skipped. The partition's version k + 1 keeps its
  values and the optimizer's iteration count does not advance, which is what
  single-process Keras does when the global batch's gradients overflow.

Every PS task receives the same verdicts, so all skip the same steps, for
every variable; every worker gets all verdicts back and moves its loss scale
the same way (``prophet_tf.loss_scaling``).

The optimizer's iteration of step k is k minus the steps skipped before k
(what single-process Keras' ``iterations`` would be).
"""
from __future__ import annotations

import bisect
import collections

__all__ = ["Verdicts"]


class Verdicts:
    """The verdicts of one PS task and the sums that wait for them (under the state lock).

    Args:
        skipped_before_start: steps skipped before the job's first version
            (a restored checkpoint's count; 0 for a fresh start).
    """

    def __init__(self, skipped_before_start: int = 0):
        self.skipped_before_start = skipped_before_start
        self._known: dict[int, bool] = {}
        self._skipped: list[int] = []  # sorted
        self._waiting: dict[int, list] = collections.defaultdict(list)  # step -> [(part, total)]

    def decide_locked(self, step: int, finite: bool) -> list | None:
        """Records the verdict of ``step``; returns the ``(part, total)`` that waited
        for it, or None when it was already known (every worker's call decides)."""
        if step in self._known:
            return None
        self._known[step] = finite
        if not finite:
            bisect.insort(self._skipped, step)
        for old in [s for s in self._known if s < step - 2]:
            del self._known[old]  # a step's sums complete before the step after next starts
        return self._waiting.pop(step, [])

    def wait_locked(self, part, step: int, total) -> bool | None:
        """The verdict of ``step`` if known; else keeps ``(part, total)`` until
        :meth:`decide_locked` returns it, and returns None."""
        verdict = self._known.get(step)
        if verdict is None:
            self._waiting[step].append((part, total))
        return verdict

    def optimizer_iteration(self, step: int) -> int:
        """The optimizer's iteration count when step ``step`` is applied."""
        return step - self.skipped_before(step)

    def skipped_before(self, step: int) -> int:
        """Steps skipped before ``step`` since the job began."""
        return self.skipped_before_start + bisect.bisect_left(self._skipped, step)
