"""``use_ema`` on the PS: the moving averages per partition, swapped in at the end of fit.

Keras (``keras/src/optimizers/base_optimizer.py``) keeps, with ``use_ema``, a
moving average of every trainable variable in the optimizer: after each
update, inside ``optimizer.apply``, ``average = m * average + (1 - m) * value``
(``m`` is ``ema_momentum``, 0 at iteration 0), and every
``ema_overwrite_frequency`` iterations it overwrites the variables with their
averages. At the end of ``fit`` ``finalize_variable_values`` overwrites them
once more.

The PS's optimizer is rebuilt with the option, so each partition has an
average of its own (an optimizer slot: saved models and checkpoints hold it).
Keras updates and overwrites *every* variable's in each ``apply``; the PS
applies one partition per ``apply``, so while a partition's update is traced
:func:`one_partition` narrows both to that partition (as accumulation's reset
is, ``accumulation.py``), with Keras' own formula.

The end of ``fit`` is the ``SwapAverages`` RPC (:class:`SwapRPCs`): every
worker, once its parameters of the last step's version v are staged, calls it
on every PS task (a round among the workers, ``gather.Gatherer``); once all
have, and every partition is at version v, the PS overwrites its partitions
with their averages and publishes them as version v again. No step is made:
single-process Keras' next step starts from the averages at the same
iteration. Each worker then pulls version v anew (``engine.py``), so its reads
(evaluate, predict, save, the next fit) see the averages.
"""
from __future__ import annotations

import contextlib

import grpc
import numpy as np

from prophet_tf.ps import gather, protocol, registration, sharding
from prophet_tf.ps.errors import RpcError, invalid, precondition
from prophet_tf.ps.v1 import ps_pb2

__all__ = ["one_partition", "deferred", "after_update", "average", "SwapRPCs"]


def _average_variable(optimizer, variable):
    return optimizer._model_variables_moving_average[optimizer._get_variable_index(variable)]


@contextlib.contextmanager
def one_partition(optimizer, variable):
    """While tracing ``optimizer.apply([gradient], [variable])``: the moving average
    update and overwrite touch ``variable``'s average only (nothing to do without
    ``use_ema``)."""
    if not getattr(optimizer, "use_ema", False):
        yield
        return
    from keras import ops

    average_variable = _average_variable(optimizer, variable)

    def update(trainable_variables):
        # Keras' _update_model_variables_moving_average, for this variable alone.
        not_first_step = ops.not_equal(optimizer.iterations, 0)
        momentum = ops.multiply(ops.cast(not_first_step, variable.dtype),
                                optimizer.ema_momentum)
        average_variable.assign(ops.add(ops.multiply(momentum, average_variable),
                                        ops.multiply(ops.subtract(1, momentum), variable)))

    def overwrite(trainable_variables):
        variable.assign(average_variable)

    with _replaced(optimizer, update, overwrite):
        yield


@contextlib.contextmanager
def deferred(optimizer):
    """While tracing ``optimizer.apply``: no moving average is updated or
    overwritten (Lamb's first phase: :func:`after_update` comes in its second)."""
    if not getattr(optimizer, "use_ema", False):
        yield
        return
    with _replaced(optimizer, lambda variables: None, lambda variables: None):
        yield


@contextlib.contextmanager
def _replaced(optimizer, update, overwrite):
    optimizer._update_model_variables_moving_average = update
    optimizer._overwrite_model_variables_with_average_value = overwrite
    try:
        yield
    finally:  # the class's again
        del optimizer._update_model_variables_moving_average
        del optimizer._overwrite_model_variables_with_average_value


def after_update(optimizer, variable) -> None:
    """While tracing, after ``variable``'s update outside ``optimizer.apply`` (Lamb's
    second phase, ``lamb.py``): Keras' moving-average block of
    ``_backend_apply_gradients``, for ``variable`` alone (the optimizer's
    ``_iterations`` set as for its apply). Nothing without ``use_ema``."""
    if not getattr(optimizer, "use_ema", False):
        return
    from keras import ops

    with one_partition(optimizer, variable):
        optimizer._update_model_variables_moving_average([variable])
        if optimizer.ema_overwrite_frequency:
            ops.cond((optimizer.iterations + 1) % optimizer.ema_overwrite_frequency == 0,
                     lambda: optimizer._overwrite_model_variables_with_average_value(
                         [variable]),
                     lambda: None)


def average(optimizer, part) -> np.ndarray:
    """A partition's moving average, in its shape (call under the apply lock)."""
    value = np.asarray(_average_variable(optimizer, registration.optimized(part)).numpy())
    if part.whole is not None:
        value = sharding.elements(value, part.plan)
    return value.reshape(part.shape)


class SwapRPCs:
    """``SwapAverages`` of the servicer (its state and locks, ``servicer.py``)."""

    def _init_swaps(self) -> None:
        self._swap_rounds = gather.Gatherer(
            self.num_workers, self._round_failure, what="swap of the moving averages",
            same_calls="every worker must end the same fit calls")
        self._swapped: set[int] = set()  # rounds done (under the apply lock)

    def SwapAverages(self, request, context):
        return self._answer(lambda r: self._swap_averages(r, context), "SwapAverages",
                            request, context)

    def _swap_averages(self, request, context):
        if getattr(request, "malformed", None):  # bytes that did not parse (protocol.py)
            raise invalid(f"The request is not a GatherRequest. Received: {request.malformed}")
        try:
            version = protocol.decode_swap_version(request.payload)
        except ValueError as e:
            raise invalid(str(e)) from None
        with self._lock:
            model = self._model
        if model is None or not getattr(model.optimizer, "use_ema", False):
            raise precondition("SwapAverages is for a model whose optimizer keeps moving "
                               "averages (use_ema=True); this PS has "
                               f"{'no model' if model is None else 'another optimizer'}. "
                               f"Received: a swap at version {version} from worker "
                               f"{request.worker_id}")
        payloads = self._swap_rounds.gather(request, context)
        if len(set(payloads)) != 1:
            versions = [protocol.decode_swap_version(p) for p in payloads]
            raise invalid("The workers ended fit at different steps: "
                          f"{versions} (by worker). Received: version={version}")
        left = list(self._parts.values())
        while left:  # every partition's version `version` applied
            got = self._next_applied(left, version, context)
            if got is None:
                raise RpcError(grpc.StatusCode.CANCELLED, "the client went away")
            if got[2] != version:
                raise precondition(f"{got[0].name} is at version {got[2]}, past the swap's: "
                                   f"a worker trained on before every worker ended fit. "
                                   f"Received: version={version}")
        with self._applier.lock:
            if request.round in self._swapped:
                return ps_pb2.GatherResponse()
            self._swapped.add(request.round)
            encoded = []
            for part in self._parts.values():
                part.variable.assign(average(model.optimizer, part))
                encoded.append((part, protocol.encode_pull_entry(
                    part.plan.key, part.plan.partition, version, part.spec.dtype,
                    registration.read(part))))
            with self._lock:
                for part, chunk in encoded:
                    part.encoded = chunk
                self._published.notify_all()
        return ps_pb2.GatherResponse()
