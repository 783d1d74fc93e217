"""The optimizer apply thread: one Keras optimizer, one partition at a time.

When all W workers have pushed iteration k of a partition, the sum is queued
here; one background thread applies the optimizer (most urgent first: lowest
iteration, then lowest priority value) and hands back version k + 1.

Before a partition's update for iteration k the optimizer's iteration counter
is set to k and ``optimizer.apply`` runs for that partition alone (both in one
``tf.function`` traced per partition), so learning rate schedules, Adam's bias
correction and weight decay see exactly what single-process Keras sees at
iteration k (which optimizers allow that: :mod:`prophet_tf.optimizer_policy`).
An optimizer variable shared by all variables that advances at every ``apply``
(Nadam's ``u_product``) is rewound to its value at the start of iteration k
before each partition's update, so it advances once per iteration, as in
single-process Keras (:mod:`prophet_tf.per_iteration`).
With ``clipnorm`` or ``global_clipnorm`` every update comes with its norm
group's factor (:mod:`prophet_tf.ps.clipping`), which the traced update applies
where Keras clips, inside ``optimizer.apply``. Lamb's partitions of a variable
cut into several are applied in two phases, the second once the variable's
trust ratio is known (:mod:`prophet_tf.ps.lamb`); Adafactor's, whole, once the
variable's last partition's sum is in (:mod:`prophet_tf.ps.whole_apply`).
A learning rate changed on the workers (callbacks) arrives with each
iteration's pushes; schedules run here. A step of a loss-scaled model that
overflowed is skipped (:mod:`prophet_tf.ps.verdicts`): the partition's next
version keeps its values, in the same queue so versions stay in order, and
the optimizer iteration of each later step is given by the servicer.
"""

from __future__ import annotations

import contextlib
import itertools
import logging
import math
import queue
import threading
from typing import Callable

import numpy as np

from prophet_tf import per_iteration
from prophet_tf.ps import (accumulation, aggregation, clipping, ema, lamb, protocol,
                           whole_apply, zero_copy)
from prophet_tf.ps.registration import read  # the partition's value (under Applier.lock)

__all__ = ["Applier", "read"]

logger = logging.getLogger("prophet_tf.ps.servicer")  # the PS task's one logger




class Applier:
    """Applies summed gradients on its own thread, one partition at a time.

    Args:
        state_lock: the servicer's state lock; the learning rates are kept
            under it (pushes record them).
        name: the thread's name.
        on_applied: ``(part, version, encoded)`` after an update, on the
            apply thread (outside :attr:`lock`).
        on_failed: ``(part, iteration, message)`` when an update raised; the
            thread goes on with other partitions.
    """

    def __init__(self, state_lock: threading.Lock, name: str,
                 on_applied: Callable, on_failed: Callable):
        self.lock = threading.Lock()  # the optimizer and the variables
        self._optimizer = None  # set when the model is installed
        self._clips = False  # and whether its updates take clipping factors
        self._rewinder = per_iteration.Rewinder(None)  # and its own with it
        # The rate this thread last gave the optimizer: setting it costs an
        # eager assign (about 0.3 ms), as much as a small partition's update.
        self._current_learning_rate: float | None = None
        self._state_lock = state_lock
        self._on_applied, self._on_failed = on_applied, on_failed
        # iteration -> the learning rate the workers trained it with (set by
        # callbacks on the workers; absent: the optimizer's own).
        self._learning_rates: dict[int, float] = {}
        self._ratios = lamb.Ratios()  # Lamb's cut variables (apply thread only)
        self._held = whole_apply.Held()  # cut variables applied whole (apply thread only)
        self._queue: queue.PriorityQueue = queue.PriorityQueue()
        self._seq = itertools.count()
        self._thread = threading.Thread(target=self._loop, daemon=True, name=name)
        self._thread.start()

    @property
    def optimizer(self):
        """The Keras optimizer that applies every partition's updates."""
        return self._optimizer

    def install(self, optimizer, clips: bool) -> None:
        """Sets the optimizer (built on the partitions' variables), and whether every
        update comes with a clipping factor (``submit``'s ``factor``).

        Called once, when the model is installed, before any update is queued
        (the servicer's state lock is held: taking self.lock here would invert
        the apply thread's lock order)."""
        self._optimizer, self._clips, self._current_learning_rate = optimizer, clips, None
        self._rewinder = per_iteration.Rewinder(optimizer)

    def set_learning_rate_locked(self, iteration: int, learning_rate: float) -> None:
        """Records an iteration's learning rate; under the state lock."""
        self._learning_rates[iteration] = learning_rate

    def submit(self, part, iteration: int, total: np.ndarray,
               optimizer_iteration: int | None = None, factor: tuple | None = None) -> None:
        """Queues the sum of all workers' gradients of ``part`` at ``iteration``
        (the step), applied with the optimizer's iteration count at
        ``optimizer_iteration`` (default: the step); with clipping, scaled where
        Keras clips by ``factor``, ``(multiplier, divisor)`` (``clipping.NormHold``)."""
        if self._clips != (factor is not None):
            raise ValueError(f"An update of {part.name} at step {iteration} comes "
                             f"{'without' if self._clips else 'with'} a clipping factor, "
                             f"and this model {'clips' if self._clips else 'does not clip'}"
                             f". Received: factor={factor!r}")
        self._put(part, iteration, total,
                  iteration if optimizer_iteration is None else optimizer_iteration, factor)

    def skip(self, part, iteration: int) -> None:
        """Queues a skipped step: ``part``'s version ``iteration + 1`` keeps its values."""
        self._put(part, iteration, None, None, None)

    def _put(self, part, iteration, total, optimizer_iteration, factor) -> None:
        self._queue.put((iteration, part.spec.priority, part.plan.key, part.plan.partition,
                         next(self._seq), part, total, optimizer_iteration, factor))

    def close(self) -> None:
        """Stops the thread after the queued updates."""
        self._queue.put((math.inf, 0, 0, 0, next(self._seq), None, None, None, None))
        self._thread.join()

    def _loop(self):
        while True:
            iteration, *_, part, total, optimizer_iteration, factor = self._queue.get()
            if part is None:
                return
            try:
                with self.lock:
                    if total is None:
                        applied = [(part, read(part))]
                    elif part.whole is not None:
                        applied = self._apply_whole(part, iteration, total,
                                                    optimizer_iteration, factor)
                    elif part.lamb_partitions > 1:
                        applied = self._apply_lamb(part, iteration, total, optimizer_iteration,
                                                   factor)
                    else:
                        applied = [(part, self._apply(part, iteration, total,
                                                      optimizer_iteration, factor))]
                    encoded = [(p, protocol.encode_pull_entry(
                        p.plan.key, p.plan.partition, iteration + 1, p.spec.dtype, value))
                        for p, value in applied]
                    # A value may view its variable's buffer: kept past the next
                    # update, it would make TensorFlow copy the variable first.
                    del applied
            except Exception as e:  # keep serving other partitions; report on this one
                logger.exception("Optimizer update of %s at step %d failed", part.name,
                                 iteration)
                self._on_failed(part, iteration,
                                f"The optimizer update of {part.name} at step {iteration} "
                                f"failed on the PS: {type(e).__name__}: {e}")
                continue
            for p, chunk in encoded:
                self._on_applied(p, iteration + 1, chunk)

    def _set_learning_rate(self, iteration: int) -> None:
        with self._state_lock:
            learning_rate = self._learning_rates.get(iteration)
            for old in [i for i in self._learning_rates if i < iteration - 2]:
                del self._learning_rates[old]
        if learning_rate is not None and learning_rate != self._current_learning_rate:
            self._optimizer.learning_rate = learning_rate  # Read inside the traced update.
            self._current_learning_rate = learning_rate

    def _apply(self, part, iteration, total, optimizer_iteration, factor):
        self._set_learning_rate(iteration)
        if part.apply_fn is None:
            part.apply_fn = self._trace(part)
        self._rewinder.before_update(optimizer_iteration)
        return part.apply_fn(total.reshape(part.shape), optimizer_iteration, factor)

    def _apply_lamb(self, part, iteration, total, optimizer_iteration, factor) -> list:
        """A partition of a variable Lamb updates over several partitions
        (:mod:`prophet_tf.ps.lamb`): its first phase; after the variable's last
        partition of the step, every partition's second: ``[(part, value)]`` to
        publish, or ``[]`` until then."""
        self._set_learning_rate(iteration)
        if part.lamb is None:
            import tensorflow as tf  # loaded by the first Register

            part.lamb = lamb.LambPartition(
                self._optimizer, part.variable,
                tf.TensorSpec(part.shape, aggregation.SUM_DTYPES[part.spec.dtype]),
                self._clips, self._patches(part.variable, averages=False))
        ready = self._ratios.add(part, iteration,
                                 *part.lamb.moments(total.reshape(part.shape),
                                                    optimizer_iteration, factor))
        if ready is None:
            return []
        averages = getattr(self._optimizer, "use_ema", False)  # updated in the second phase
        return [(p, read(p) if r is None and not averages else
                 p.lamb.finish(r, optimizer_iteration)) for p, r in ready]

    def _apply_whole(self, part, iteration, total, optimizer_iteration, factor) -> list:
        """A partition of a variable applied whole (:mod:`prophet_tf.ps.whole_apply`):
        held until the variable's last partition of the step, then all applied at
        once: ``[(part, value)]`` to publish, or ``[]`` until then."""
        ready = self._held.add(part, iteration, total, optimizer_iteration, factor)
        if ready is None:
            return []
        parts, totals, optimizer_iteration, factor = ready
        self._set_learning_rate(iteration)
        self._rewinder.before_update(optimizer_iteration)
        values = part.whole.apply(self._optimizer, parts, totals, optimizer_iteration, factor,
                                  self._patches, self._clips)
        return list(zip(parts, values))

    def _patches(self, variable, averages: bool = True):
        """``(*factor) -> ExitStack`` of what a partition's traced update runs under:
        accumulation's reset and use_ema's averages narrowed to it, and with a
        clipping factor, the factor where Keras clips."""
        optimizer = self._optimizer

        def enter(*factor):
            stack = contextlib.ExitStack()
            stack.enter_context(accumulation.one_partition(optimizer, variable))
            stack.enter_context(ema.one_partition(optimizer, variable) if averages
                                else ema.deferred(optimizer))
            if factor:
                stack.enter_context(clipping.scaled_by(optimizer, *factor))
            return stack
        return enter

    def _trace(self, part) -> Callable[[np.ndarray, int, tuple | None], np.ndarray]:
        """The optimizer update of one partition as a tf.function: (sum,
        optimizer iteration, clipping factor or None) -> the partition's new value.

        Traced once per partition (tens of ms), it then costs a fraction of
        eager Keras' Python overhead per call (about 4x less for Adam) and
        holds the GIL that much less, which the gRPC threads need. The
        concrete function is called, not the ``tf.function``: that skips the
        dispatch on the arguments, about 0.4 ms of 0.9 per small partition.
        """
        import tensorflow as tf  # loaded by the first Register (registration.load_keras)

        optimizer, variable = self._optimizer, part.variable

        patches = self._patches(variable)

        def apply(gradient, iteration, *factor):
            # The raw step counter: with gradient_accumulation_steps Keras'
            # `iterations` is it divided by the steps (accumulation.py).
            optimizer._iterations.assign(iteration)
            with patches(*factor):
                optimizer.apply([gradient], [variable])
            return variable.value.read_value()

        sum_dtype = tf.as_dtype(aggregation.SUM_DTYPES[part.spec.dtype])
        signature = [tf.TensorSpec(part.shape, sum_dtype), tf.TensorSpec((), tf.int64)]
        if self._clips:
            signature += [tf.TensorSpec((), tf.float32)] * 2
        fn = tf.function(apply, autograph=False, input_signature=signature)
        # One trace per partition is by design; TF would warn about "retracing".
        fn._omit_frequent_tracing_warning = True
        concrete = fn.get_concrete_function()
        # The sum goes in and the new value comes out without copies (zero_copy.py).
        return lambda total, iteration, factor: zero_copy.to_array(concrete(
            zero_copy.to_tensor(total), tf.constant(iteration, tf.int64),
            *(tf.constant(f, tf.float32) for f in factor or ())))
