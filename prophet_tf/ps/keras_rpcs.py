"""The RPCs behind Keras' own answers, a mixin of the servicer.

- ``Gather``: rounds of an all-gather among the workers (``gather.py``), for
  whole-data metrics and predictions;
- ``ReadOptimizerState``/``WriteOptimizerState``: the optimizer's slots of
  this task's partitions (``optimizer_state.py``), which saved models hold and
  resume from.

They use the servicer's state and locks (see ``servicer.py``).
"""
from __future__ import annotations

from prophet_tf.ps import optimizer_state
from prophet_tf.ps.errors import RpcError, precondition
from prophet_tf.ps.v1 import ps_pb2

__all__ = ["KerasRPCs"]


class KerasRPCs:
    """``Gather``, ``ReadOptimizerState`` and ``WriteOptimizerState`` of the servicer."""

    def Gather(self, request, context):
        """One all-gather round among the workers."""
        return self._answer(lambda r: ps_pb2.GatherResponse(
            payloads=self._gatherer.gather(r, context)), "Gather", request, context)

    def _round_failure(self, missing: list) -> tuple[str, bool] | None:
        """Why a round (``gather.py``) missing ``missing`` can never complete:
        ``(the job's failure, True)`` or ``(a missing worker's departure,
        False)``; None while it still may."""
        with self._lock:
            if self._failure:
                return self._failure, True
            for wid in missing:
                steps = self._liveness.left_after_locked(wid)
                if steps is not None:
                    return f"worker {wid} left the job after pushing {steps} steps", False
        return None

    def ReadOptimizerState(self, request, context):
        """Yields the optimizer's slots once every partition has ``min_version``."""
        try:
            with self._lock:
                if self._model is None:
                    raise precondition("No model is registered on this PS. Received: "
                                       f"min_version={request.min_version}")
                left = list(self._parts.values())
            while left:  # the version of the step the worker saves after
                if self._next_applied(left, request.min_version, context) is None:
                    return
            with self._applier.lock:
                slots = optimizer_state.read(self._parts, self._model.optimizer,
                                             request.min_version)
        except RpcError as e:
            self._rejections.log("ReadOptimizerState", request, e)
            context.abort(e.code, e.message)
        yield from slots

    def WriteOptimizerState(self, request_iterator, context):
        """Sets the slots of this task's rows of each whole-variable slot received."""
        def write(messages):
            if self._model is None:
                raise precondition("Register before writing the optimizer's state")
            with self._applier.lock:
                count = optimizer_state.write(self._parts, self._model.optimizer, messages)
            return ps_pb2.OptimizerStateWritten(slots=count)
        return self._answer(write, "WriteOptimizerState", request_iterator, context)
