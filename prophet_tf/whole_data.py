"""What Keras reports under the strategy: whole-data metrics and predictions, on every worker.

Each worker trains, evaluates and predicts on its share of every global batch
(README "Data"). So that `fit`'s logs, `evaluate` and `predict` give what
single-process Keras gives, identically on every worker, the strategy wraps
each Keras 3 train, test and predict step:

- train and test steps: after the step, every metric's variables (the loss
  tracker's and the compiled metrics' totals and counts, confusion matrices,
  ...) hold this worker's own accumulation; the workers all-gather them
  through PS task 0 (the `Gather` RPC), sum them in float64 in worker order,
  and the metric variables are set to the sum before Keras reads the results.
  Metric states are sums over samples, so the sum of the workers' states is
  the state of the whole data. Each worker keeps its own accumulation in a
  shadow variable and puts it back before the next step's update; a metric
  that was reset (its value no longer the sum last written) starts again from
  that value.
- train steps, also: the non-trainable floating-point variables the step
  wrote (BatchNormalization's moving mean and variance) become their mean
  over the workers, in the same gather round; a custom loop's steps likewise
  (``Exchange.custom_step``).
- predict steps: the workers all-gather their rows of the batch and
  concatenate them in worker order, which is the batch's order (a worker's
  share is a contiguous block of rows).

One gather round per step, in the same order on every worker: every worker
must make the same `fit`, `evaluate` and `predict` calls, as with any
tf.distribute strategy.
"""
from __future__ import annotations

import io
import logging
import sys
import threading

import numpy as np
import tensorflow as tf

from prophet_tf import _keras_compat

logger = logging.getLogger(__name__)

__all__ = ["Exchange", "keras_step", "loss_divides_by_rows"]

_STEP_NAMES = ("train_step", "test_step", "predict_step")


def keras_step(fn):
    """``(model, kind)`` when ``fn`` (given to ``strategy.run``) is a Keras 3 or tf_keras
    model's train, test or predict step (``kind`` is the method's name), else
    ``(None, None)``.

    Keras 3 runs ``model.train_step``/``test_step`` themselves and, for
    predict, a closure over the model that calls ``predict_step``; tf_keras
    runs a closure over the model that calls one of the three. tf.distribute
    wraps the function, so wrappers and closures are searched a few levels deep.
    """
    models = tuple(module.Model for module in (sys.modules.get("keras"),
                                               sys.modules.get("tf_keras")) if module)
    if not models:  # No Keras model can exist.
        return None, None

    def step_of(f):
        owner = getattr(f, "__self__", None)
        if isinstance(owner, models) and getattr(f, "__name__", "") in _STEP_NAMES:
            return owner, f.__name__
        code = getattr(f, "__code__", None)
        called = [name for name in _STEP_NAMES if code is not None and name in code.co_names]
        if len(called) == 1:
            for content in _keras_compat.closure_contents(f):
                if isinstance(content, models):
                    return content, called[0]
        return None

    return _keras_compat.search_closures(fn, step_of, follow=callable) or (None, None)


# Loss reductions that divide by the rows of the batch (Keras 3; "auto" is tf_keras's
# name for it), and those that sum (compiled "none" losses are summed by Keras).
_MEAN_REDUCTIONS = ("sum_over_batch_size", "mean", "auto")
_SUM_REDUCTIONS = ("sum", "none", None)


def loss_divides_by_rows(model) -> bool:
    """Whether the model's compiled losses are means over the batch's rows (the default):
    each worker's gradient then needs its rows' weight; False when they are sums.

    Raises:
      ValueError: a reduction the weights cannot make exact over workers
        ("mean_with_sample_weight", divided by each worker's own weights), or
        means and sums mixed.
    """
    kinds = set()
    for loss in tf.nest.flatten(getattr(model, "loss", None)):
        if loss is None:
            continue
        reduction = getattr(loss, "reduction", "sum_over_batch_size")  # names, functions
        if reduction in _MEAN_REDUCTIONS:
            kinds.add("mean")
        elif reduction in _SUM_REDUCTIONS:
            kinds.add("sum")
        else:
            raise ValueError(
                "prophet_tf.Strategy trains on each worker's rows of the global batch and "
                "weights each worker's gradient by its rows, which makes losses reduced by "
                "'sum_over_batch_size' (the default) or 'sum' exact; this reduction divides "
                "by each worker's own sample weights. Received: loss "
                f"{getattr(loss, 'name', loss)!r} with reduction={reduction!r}")
    if len(kinds) > 1:
        raise ValueError("prophet_tf.Strategy weights each worker's gradient by its rows for "
                         "losses that are means over the batch, not for sums: compile losses "
                         "of one kind. Received: reductions "
                         f"{[getattr(x, 'reduction', None) for x in tf.nest.flatten(model.loss)]}")
    return kinds != {"sum"}


class Exchange:
    """Gather rounds with the other workers through PS task 0, and the steps that use them.

    Args:
        address: PS task 0's ``host:port``.
        worker_id, num_workers: this worker and W.
        rpc_timeout_s: deadline of one wait; a longer wait is renewed with a
            warning (another worker may be slower), like a parameter wait.
    """

    def __init__(self, address: str, worker_id: int, num_workers: int, rpc_timeout_s: float):
        self.address, self.worker_id, self.num_workers = address, worker_id, num_workers
        self._timeout = rpc_timeout_s
        self._client = None
        self._round = 0
        self._lock = threading.Lock()
        # id(metric variable) -> (variable, this worker's accumulation, the sum last written).
        self._shadows: dict[int, tuple] = {}
        self._summed: list = []  # track_summed_variable
        self._averaged: list = []  # track_averaged_variable

    # -- the RPC --------------------------------------------------------------------------

    def gather(self, payload: bytes) -> list[bytes]:
        """Every worker's payload of the next round, in worker order."""
        import grpc  # grpc stays out of module import, like the engine's

        from prophet_tf.ps.client import PSClient
        with self._lock:
            if self._client is None:
                self._client = PSClient(self.address, self.worker_id, self.num_workers)
            round_id, self._round = self._round, self._round + 1
            client = self._client
        while True:
            try:
                return client.gather(round_id, payload, timeout=self._timeout)
            except grpc.RpcError as e:
                if e.code() != grpc.StatusCode.DEADLINE_EXCEEDED:
                    raise RuntimeError(f"Gathering the workers' metrics or predictions "
                                       f"(round {round_id}) through the PS at "
                                       f"{self.address} failed: {e.details()}") from None
                logger.warning("Still waiting after %.0f s for the other workers to reach "
                               "gather round %d (every worker must make the same fit, "
                               "evaluate and predict calls)", self._timeout, round_id)

    def close(self) -> None:
        if self._client is not None:
            self._client.close()

    # -- metrics --------------------------------------------------------------------------

    def sum_over_workers(self, tensors: list, averaged: list = ()) -> list:
        """Each of ``tensors`` summed over the workers (in float64, in worker order), then
        each of ``averaged`` divided by W (in float64: equal values stay what they were)."""
        tensors = list(tensors) + list(averaged)
        flat = tf.concat([tf.reshape(tf.cast(t, tf.float64), [-1]) for t in tensors], 0)
        summed_size = sum(int(np.prod(t.shape)) for t in tensors[:len(tensors) - len(averaged)])

        def run(x):
            mine = x.numpy()
            total = np.zeros_like(mine)
            for worker, payload in enumerate(self.gather(mine.tobytes())):
                theirs = np.frombuffer(payload, np.float64)
                if theirs.shape != mine.shape:
                    raise ValueError(
                        f"Worker {worker} has {theirs.size} metric values, this worker "
                        f"{mine.size}: every worker must build the same model and metrics. "
                        f"Received: {theirs.size} values from worker {worker}")
                total += theirs
            total[summed_size:] /= self.num_workers
            return total

        summed = tf.py_function(run, [flat], tf.float64)
        summed.set_shape(flat.shape)
        out, begin = [], 0
        for t in tensors:
            size = int(np.prod(t.shape))
            out.append(tf.cast(tf.reshape(summed[begin:begin + size], t.shape), t.dtype))
            begin += size
        return out

    def _shadow(self, variable):
        entry = self._shadows.get(id(variable))
        if entry is None or entry[0] is not variable:
            dtype = tf.as_dtype(variable.dtype)  # Keras 3 names dtypes with strings.
            with tf.init_scope():
                local = tf.Variable(tf.zeros(variable.shape, dtype), trainable=False,
                                    name="prophet_tf_metric_local")
                # NaN: never equal, so a fresh metric starts from its own value.
                never = np.nan if dtype.is_floating else dtype.min
                last = tf.Variable(tf.fill(variable.shape, tf.cast(never, dtype)),
                                   trainable=False, name="prophet_tf_metric_sum")
            entry = self._shadows[id(variable)] = (variable, local, last)
        return entry

    def track_summed_variable(self, variable) -> None:
        """A SUM-aggregated on-read variable made in the strategy's scope (a Keras metric's
        total or count): custom loop steps that update it make it the cluster's sum."""
        self._summed.append(variable)

    def track_averaged_variable(self, variable) -> None:
        """A non-trainable floating-point variable made in the strategy's scope that is not
        a metric's nor an optimizer's (BatchNormalization's moving statistics): custom loop
        steps that write
        it leave its mean over the workers, as MultiWorkerMirroredStrategy's on-read
        MEAN variables read (and as ``fit`` leaves a model's moving statistics)."""
        self._averaged.append(variable)

    def custom_step(self, run):
        """Runs a custom loop's replica function (``run()``); the tracked variables it
        updates then hold the sums over all workers, as MultiWorkerMirroredStrategy's
        on-read variables read: a metric's ``result()`` is the whole cluster's; the
        averaged ones it writes hold their mean over the workers.

        In a tf.function, the variables it updates are read off the ops it made (the
        same program on every worker, so every worker makes the same gather round);
        eagerly, every tracked variable is summed (or averaged).
        """
        variables, averaged = list(self._summed), list(self._averaged)
        if not variables and not averaged:
            return run()
        before = [tf.identity(tf.convert_to_tensor(v)) for v in variables]
        for variable, value in zip(variables, before):
            _, local, last = self._shadow(variable)
            variable.assign(tf.where(tf.equal(value, last), local, value))
        outputs, written = _run_recording_writes(run)
        updated = [v for v in variables if written(v)]
        for variable, value in zip(variables, before):
            if all(variable is not u for u in updated):
                variable.assign(value)  # Untouched: as it was.
        moved = [v for v in averaged if written(v)]
        if updated or moved:
            self._write_sums(updated, moved)
        return outputs

    def _write_sums(self, variables, averaged=()) -> None:
        """Each of ``variables`` becomes its sum over the workers (this worker's own value
        is kept), each of ``averaged`` its mean; one gather round for both."""
        mine = [tf.identity(tf.convert_to_tensor(v)) for v in variables]
        own_stats = [tf.identity(tf.convert_to_tensor(v)) for v in averaged]
        summed = self.sum_over_workers(mine, own_stats)
        for variable, own, total in zip(variables, mine, summed):
            _, local, last = self._shadow(variable)
            local.assign(own)
            last.assign(total)
            variable.assign(total)
        for variable, mean in zip(averaged, summed[len(mine):]):
            variable.assign(mean)

    def metrics_step(self, model, run, *, training: bool):
        """Runs a train or test step (``run()``) with whole-data metric results; a train
        step's moving statistics then hold their mean over the workers."""
        for variable in _metric_variables(model):
            _, local, last = self._shadow(variable)
            value = tf.convert_to_tensor(variable)
            # Still the sum last written: continue from this worker's own accumulation.
            variable.assign(tf.where(tf.equal(value, last), local, value))
        outputs, written = _run_recording_writes(run)
        variables = _metric_variables(model)
        averaged = _moving_statistics(model, variables, written) if training else []
        if not variables and not averaged:
            return outputs
        self._write_sums(variables, averaged)
        if isinstance(outputs, dict):
            results = model.get_metrics_result()
            outputs = {k: results.get(k, value) for k, value in outputs.items()}
        return outputs

    def reduce(self, value, mean: bool):
        """``value`` (a tensor or a nest of them) summed over the workers, or averaged."""
        flat = [tf.convert_to_tensor(t) for t in tf.nest.flatten(value)]
        summed = self.sum_over_workers(flat)
        if mean:
            summed = [s / tf.cast(self.num_workers, s.dtype) for s in summed]
        return tf.nest.pack_sequence_as(value, summed)

    def concat(self, value, axis: int):
        """Every worker's ``value`` concatenated along ``axis``, in worker order."""
        flat = [tf.convert_to_tensor(t) for t in tf.nest.flatten(value)]
        for t in flat:
            if t.shape.rank is not None and not -t.shape.rank <= axis < max(t.shape.rank, 1):
                raise ValueError(f"gather along axis {axis} of a tensor of shape {t.shape}. "
                                 f"Received: axis={axis}")

        def run(*arrays):
            buffer = io.BytesIO()
            np.savez(buffer, *[a.numpy() for a in arrays])
            parts = [np.load(io.BytesIO(p), allow_pickle=False)
                     for p in self.gather(buffer.getvalue())]
            return [np.concatenate([p[f"arr_{i}"] for p in parts], axis=axis)
                    for i in range(len(arrays))]

        joined = tf.py_function(run, flat, [t.dtype for t in flat])
        return tf.nest.pack_sequence_as(value, joined)

    # -- predictions ------------------------------------------------------------------------

    def gather_rows(self, outputs):
        """The whole batch's predictions: every worker's rows, in worker order."""
        rows = self.concat(outputs, axis=0)
        for row, t in zip(tf.nest.flatten(rows), tf.nest.flatten(outputs)):
            row.set_shape(tf.TensorShape([None]).concatenate(t.shape[1:]))
        return rows


def _updated_by(variable, ops, graph) -> bool:
    """Whether one of ``ops`` (made in ``graph``) may write ``variable``: any op but a read
    that takes its handle (an assign, or a cond, loop or call that may assign)."""
    handle = variable.handle
    internal = next((inner for outer, inner in graph.captures if outer is handle), None)
    if internal is None:
        return False
    return any(op.type != "ReadVariableOp" and any(t is internal for t in op.inputs)
               for op in ops)


def _metric_variables(model) -> list:
    return [v for metric in model.metrics for v in metric.variables]


def _run_recording_writes(run):
    """``(run(), written)``: ``written(variable)`` tells whether the ops ``run`` made
    may write the variable (in a tf.function); eagerly, every variable counts."""
    if tf.executing_eagerly():
        return run(), lambda variable: True
    graph = tf.compat.v1.get_default_graph()
    start = len(graph.get_operations())
    outputs = run()
    made = graph.get_operations()[start:]
    return outputs, lambda variable: _updated_by(variable, made, graph)


def _moving_statistics(model, metric_variables, written) -> list:
    """The model's non-trainable floating-point variables that this train step wrote
    (BatchNormalization's moving mean and variance): not a frozen layer's weights, not
    a metric's. Eagerly every such variable counts (equal values average to themselves).

    Their updates are linear in each batch's statistics, which do not depend on them
    (training normalizes with the batch's own; renorm aside), so the mean after every
    step is what MultiWorkerMirroredStrategy's on-read mean of per-worker values reads."""
    metric_ids = {id(v) for v in metric_variables}
    return [v for v in model.non_trainable_variables
            if id(v) not in metric_ids and tf.as_dtype(v.dtype).is_floating and written(v)]
