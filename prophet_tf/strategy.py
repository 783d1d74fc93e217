"""prophet_tf.Strategy: Keras `fit` on many workers through the parameter server.

The strategy is a `OneDeviceStrategy` on each worker's CPU whose hooks route
the model through the parameter server (see docs in README "How it works"):

- `_create_variable`: every trainable float variable becomes a `PSVariable`
  whose reads wait (per key) for the version of the current step.
- `_batch_reduce_to`: Keras hands over all gradients at once (Keras 3 before
  its IdentityN; tf_keras through the replica context's all_reduce); they are
  kept, unreduced, so that each push can start as soon as its own gradient
  exists.
  Any other all_reduce (a step's own, `BatchNormalization(synchronized=True)`'s
  in the forward pass, and its gradient) is the whole cluster's, through PS task 0.
- `_update`: for each (variable, gradient) Keras would apply, a `PushGrad` op
  hands the gradient to the engine; the PS sums the workers' gradients and
  applies the optimizer, so nothing is applied locally.
- `_num_replicas_in_sync` is the number of workers, so Keras divides each
  worker's loss by it and the PS's sum is the global-batch mean gradient.

Keras 3 and tf_keras (Keras 2: `import tf_keras`, or `tf.keras` under
TF_USE_LEGACY_KERAS=1) go through the same hooks; a tf_keras optimizer is
described to the PS as its Keras 3 equivalent (`prophet_tf._keras_compat`).

TF-private imports stay in this module.
"""
from __future__ import annotations

import logging
import warnings
from typing import Any

# No TensorFlow distribution is required by the package (CPU and GPU users each keep
# their own): without one, this import says how to install it.
from prophet_tf._build_info import require_tensorflow

require_tensorflow()

import tensorflow as tf  # noqa: E402
from tensorflow.python.distribute import distribute_lib
from tensorflow.python.distribute import one_device_strategy
from tensorflow.python.distribute import reduce_util

from prophet_tf import _keras_compat
from prophet_tf import _native
from prophet_tf import cluster as cluster_lib
from prophet_tf import devices
from prophet_tf import distributed_input
from prophet_tf import keras_optimizer
from prophet_tf import loss_scaling
from prophet_tf import per_iteration
from prophet_tf import saved_state
from prophet_tf import strategy_checks as checks
from prophet_tf import whole_data
from prophet_tf.step_records import StepRecords
from prophet_tf.distributed_input import split_batches  # noqa: F401 (public)
from prophet_tf.variables import PSVariable

logger = logging.getLogger(__name__)



class Strategy(one_device_strategy.OneDeviceStrategy):
    """Synchronous data-parallel training through a gRPC parameter server.

    Every worker runs the same Keras script:

        strategy = prophet_tf.Strategy()       # cluster from TF_CONFIG
        with strategy.scope():
            model = build_model()
            model.compile(optimizer="adam", loss=...)
        model.fit(dataset, epochs=...)

    Args:
      cluster: None to read TF_CONFIG; a TF_CONFIG-shaped dict (or JSON
        string); or a `tf.distribute.cluster_resolver.ClusterResolver`.
      scheduler: how gradient traffic is scheduled: "fifo", "p3",
        "bytescheduler" or "prophet", optionally with options
        ("bytescheduler:credit_bytes=8000000"). None reads
        PROPHET_TF_SCHEDULER, else "fifo".
      scheduler_options: the scheduler's options as a dict (see README).
      rpc_timeout_s: deadline for each RPC and for waiting on a parameter.
      timeline: path of the Chrome-trace timeline each worker writes at exit
        (see prophet_tf.engine.timeline); None reads PROPHET_TF_TIMELINE.
      device: where the model's forward and backward run: any TensorFlow
        device string of this process ("/gpu:1", "/cpu:0") or a
        `tf.config.LogicalDevice`. None reads PROPHET_TF_DEVICE, else the
        first visible GPU, else the CPU (`prophet_tf.devices.resolve`). The
        parameters are staged and the gradients pushed from host memory: the
        op library's ops run on the device's host CPU.

    Raises:
      ValueError: the cluster description is malformed, this task is not a
        worker, the device does not exist or is malformed, or an option is
        invalid; the message names what was received.
    """

    def __init__(self, cluster: Any = None, scheduler: str | None = None, *,
                 scheduler_options: dict | None = None, rpc_timeout_s: float = 120.0,
                 timeline: str | None = None, device: Any = None):
        config = cluster_lib.resolve(cluster)
        if not config.is_worker:
            raise ValueError(
                "prophet_tf.Strategy runs on worker (and chief) tasks; a ps task runs "
                "`prophet-tf ps`, and an evaluator task does not join training: it evaluates "
                "the checkpoints the chief saves, with prophet_tf.evaluate_checkpoints("
                f"directory, evaluate_fn). Received: task type={config.task_type!r}")
        device = devices.resolve(device)  # Before anything starts.
        from prophet_tf.ps import shaping  # PROPHET_TF_SHAPE_MBIT: the bench's fallback
        from prophet_tf.engine import Engine  # Imports grpc; keep it out of module import.
        engine = Engine(config, scheduler=scheduler, scheduler_options=scheduler_options,
                        rpc_timeout_s=rpc_timeout_s, timeline=timeline,
                        make_shapers=shaping.from_env, runtime=_native)
        _native.load()  # Fail here, with the rebuild hint, if the op library is broken.
        per_iteration.advance_on_the_ps_only(Strategy)  # Nadam's u_product: the PS advances it
        distribute_lib.Strategy.__init__(self, PSExtended(self, config, engine, rpc_timeout_s,
                                                          device=device))

    @property
    def cluster(self) -> cluster_lib.ClusterConfig:
        return self.extended.cluster

    @property
    def worker_index(self) -> int:
        return self.extended.cluster.task_index

    @property
    def scheduler(self) -> str:
        return self.extended.engine.scheduler_name

    def write_timeline(self) -> str | None:
        """Writes this worker's timeline now (it is also written at exit)."""
        return self.extended.engine.write_timeline()

    def shutdown(self) -> None:
        """Pushes what is pending and stops the engine; the strategy cannot train afterwards."""
        self.extended.engine.shutdown()
        self.extended.exchange.close()
        self.extended.saved_state.close()


class PSExtended(one_device_strategy.OneDeviceExtended):
    """The hooks behind `Strategy`."""

    def __init__(self, container_strategy, config: cluster_lib.ClusterConfig, engine,
                 rpc_timeout_s: float = 120.0, device: Any = None):
        # The compute device: Keras creates the model's other variables there and
        # the replica function runs there (OneDeviceStrategy).
        super().__init__(container_strategy, devices.resolve(device))
        # The op library's ops, the parameters' variables and the step counter
        # they read live in host memory (prophet_tf/devices.py).
        self._host_device = devices.host_of(self._device)
        self.cluster = config
        self.engine = engine
        # Whole-data metrics and predictions (prophet_tf/whole_data.py).
        self.exchange = whole_data.Exchange(config.ps[0], engine.worker_id, config.num_workers,
                                            rpc_timeout_s)
        self.saved_state = saved_state.SavedState(config.ps, engine.worker_id,
                                                  config.num_workers, rpc_timeout_s)
        # Training steps started by this worker; reads in step k want version k.
        # On the host, where AwaitParam and PushGrad read it.
        with tf.init_scope(), tf.device(self._host_device):
            self._step = tf.Variable(0, dtype=tf.int64, trainable=False, name="prophet_tf_step")
        self._ps_variables: list[PSVariable] = []
        self._raw_grads: list[tf.Tensor] = []
        self._step_value: tf.Tensor | None = None
        self._trained_this_trace: list[PSVariable] = []  # trainable_variables order.
        self._registered: list[PSVariable] | None = None
        # Each step's learning rate and share rows, for the engine; this trace's
        # share rows (None: not a Keras train step) and the ops that record them.
        self._records = StepRecords(self._host_device)
        self._share_rows = None
        self._recorded: list = []
        self._eager_warned = False
        # The model's LossScaleOptimizer (mixed_float16), once its steps are
        # decided with all workers (loss_scaling.py); None without loss scaling.
        self._loss_scale_optimizer = None

    # -- variables -------------------------------------------------------------------------

    def _create_variable(self, next_creator, **kwargs):
        if checks.may_become_ps_variable(kwargs) and kwargs.get("colocate_with") is None:
            # A parameter's value lives in the op library's host staging area, and
            # TensorFlow runs PushGrad wherever its variable's handle is: so the
            # variable itself (read once, at adoption) lives on the host too.
            kwargs.pop("colocate_with", None)
            with tf.device(self._host_device):
                variable = next_creator(**kwargs)
        else:
            variable = super()._create_variable(next_creator, **kwargs)
        if (kwargs.get("synchronization") == tf.VariableSynchronization.ON_READ
                and kwargs.get("aggregation") == tf.VariableAggregation.SUM):
            self.exchange.track_summed_variable(variable)  # A metric's total or count.
        elif (not variable.trainable and variable.dtype in checks.FLOAT_DTYPES
              and not checks.is_internal(kwargs) and not checks.made_by_an_optimizer()):
            # Moving statistics, say. Not an optimizer's slots: the worker's optimizer
            # leaves them to the PS (a custom step may still seem to write them).
            self.exchange.track_averaged_variable(variable)
        if (checks.is_plain_resource_variable(variable) and variable.trainable
                and variable.dtype in checks.FLOAT_DTYPES):
            variable = PSVariable.adopt(variable, key=len(self._ps_variables), step_variable=self._step)
            self._ps_variables.append(variable)
        return variable

    @property
    def _num_replicas_in_sync(self):
        return self.cluster.num_workers

    # -- input -----------------------------------------------------------------------------

    # What these return is marked as distributed, so Keras does not split it
    # again, and iterates as a plain tf.data dataset (distributed_input.py).

    def _experimental_distribute_dataset(self, dataset, options):
        checks.check_replication_mode(options)
        return distributed_input.distribute_dataset(dataset, self.cluster.num_workers,
                                                    self.cluster.task_index)

    def _distribute_datasets_from_function(self, dataset_fn, options):
        checks.check_replication_mode(options)
        context = distribute_lib.InputContext(
            num_input_pipelines=self.cluster.num_workers,
            input_pipeline_id=self.cluster.task_index,
            num_replicas_in_sync=self.cluster.num_workers)
        dataset = dataset_fn(context)
        if not isinstance(dataset, tf.data.Dataset):
            raise ValueError("The function given to distribute_datasets_from_function must "
                             f"return a tf.data.Dataset. Received: {type(dataset).__name__}")
        return distributed_input.DistributedDataset(dataset, "from_function")

    # -- cross-worker results ---------------------------------------------------------------

    # Strategy.reduce and Strategy.gather give the whole cluster's answer on
    # every worker, through PS task 0 as the metrics are; every worker must
    # make the same calls in the same order, as with TensorFlow's collectives.

    def _reduce(self, reduce_op, value):
        return self._cluster_reduce(reduce_op, self._local_results(value)[0])

    def _cluster_reduce(self, reduce_op, value):
        """``value`` (a nest) summed or averaged over the workers (one: as it is)."""
        if self.cluster.num_workers == 1:
            return value
        return self.exchange.reduce(
            value, mean=reduce_util.ReduceOp(reduce_op) == reduce_util.ReduceOp.MEAN)

    def _gather_to_implementation(self, value, destinations, axis, options):
        value = self._local_results(value)[0]
        if self.cluster.num_workers == 1:
            return value
        return self.exchange.concat(value, axis)

    # -- gradients -------------------------------------------------------------------------

    def _call_for_each_replica(self, fn, args, kwargs):
        checks.reject_xla()  # Keras 3 compiles the whole step function.
        if tf.executing_eagerly() and not self._eager_warned:
            self._eager_warned = True
            warnings.warn("run_eagerly=True under prophet_tf.Strategy runs every op in order: "
                          "gradient pushes cannot overlap backprop and each layer's forward "
                          "waits for all parameters. Use run_eagerly=False for speed.",
                          stacklevel=2)
        model, kind = whole_data.keras_step(fn)
        # A Keras train step's loss is this worker's mean over its rows divided
        # by W: the PS weights its gradient by its rows (GradientChunk.batch_rows).
        self._share_rows = checks.rows_of(args) if (
            kind == "train_step" and self.cluster.num_workers > 1
            and whole_data.loss_divides_by_rows(model)) else None
        if kind == "train_step" and loss_scaling.is_loss_scale_optimizer(model.optimizer):
            self._install_loss_scaling(model.optimizer)
        if kind == "train_step" and not _keras_compat.is_tf_keras_optimizer(model.optimizer):
            keras_optimizer.leave_to_the_ps(model.optimizer)  # The PS clips, accumulates.
        run = lambda: super(PSExtended, self)._call_for_each_replica(fn, args, kwargs)  # noqa: E731
        if self.cluster.num_workers == 1:
            return run()
        if model is None:
            # A custom loop's step: the metrics it updates sum over the workers.
            return self.exchange.custom_step(run)
        if kind == "predict_step":
            return self.exchange.gather_rows(run())
        return self.exchange.metrics_step(model, run, training=kind == "train_step")

    def _install_loss_scaling(self, optimizer) -> None:
        """A LossScaleOptimizer decides each step with all workers (loss_scaling.py)."""
        if self._registered is not None and self._loss_scale_optimizer is not optimizer:
            raise ValueError("The model's optimizer changed after training through the PS "
                             f"started. Received: {type(optimizer).__name__} "
                             f"{optimizer.name!r}")
        self._loss_scale_optimizer = optimizer
        loss_scaling.install(optimizer, lambda local_finite: loss_scaling.verdict_op(
            self._step_value, local_finite, self.engine.step_verdict))

    def _batch_reduce_to(self, reduce_op, value_destination_pairs, options):
        checks.reject_xla()  # tf_keras compiles only the replica function: fail now.
        values = [value for value, _ in value_destination_pairs]
        if not checks.reduces_gradients():
            # Not the optimizer's gradients: one the step function or a layer asked for,
            # inside the forward pass (BatchNormalization(synchronized=True)'s moments)
            # or outside the tape, or the gradient of a forward one.
            if checks.differentiates_all_reduce():
                return self._all_reduce_gradient(reduce_op, values)
            return self._cluster_reduce(reduce_op, values)
        # The gradients, before Keras joins them in one IdentityN: each push
        # below depends on its own gradient only, so pushes overlap backprop.
        self._raw_grads = list(values)
        self._trained_this_trace = []
        # Version this step's forward read; the next step reads version + 1.
        self._step_value = self._step.read_value()
        self._step.assign_add(1)
        return values

    def _all_reduce_gradient(self, reduce_op, values):
        """The gradient of a forward all_reduce: TensorFlow's is the all_reduce of the
        upstream gradients ``values``, which holds when the PS sums the workers' gradients
        as they are. A Keras train step's are weighted, worker w's by ``W * rows_w / R``
        (ps/aggregation.py): what flows back from worker v's loss into worker w's share
        of the reduced value must carry v's weight, not w's, so worker w gets
        ``sum_v rows_v * dy_v / rows_w`` (nothing when it has no rows)."""
        rows = self._share_rows
        if rows is None or self.cluster.num_workers == 1:
            return self._cluster_reduce(reduce_op, values)
        rows = tf.cast(rows, tf.float64)
        summed = self.exchange.sum_over_workers([tf.cast(v, tf.float64) * rows
                                                 for v in values])
        if reduce_util.ReduceOp(reduce_op) == reduce_util.ReduceOp.MEAN:
            rows = rows * self.cluster.num_workers
        return [tf.cast(tf.math.divide_no_nan(s, rows), v.dtype)
                for v, s in zip(values, summed)]

    def _update(self, var, fn, args, kwargs, group):
        if not args:  # Weight decay and friends: the PS applies the whole optimizer.
            return ()
        if _keras_compat.is_autocast_variable(var):
            raise ValueError(
                "prophet_tf.Strategy does not support tf_keras mixed precision: its "
                "LossScaleOptimizer skips steps on each worker on its own, which the PS "
                "cannot follow. Use the float32 dtype policy. Received: variable "
                f"{var.name!r} of type {type(var).__name__}")
        if not isinstance(var, PSVariable):
            raise ValueError(
                f"The variable {var.name!r} was created outside prophet_tf.Strategy.scope(). "
                "Create the model and the optimizer inside `with strategy.scope():`.")
        outer = checks.unhandled_loss_scale_optimizer()
        if outer is not None:
            # Its own apply updates only when this worker's gradients are
            # finite: on an overflow this worker would not push, and every
            # other worker would wait for the step.
            raise ValueError(
                "A LossScaleOptimizer (mixed_float16) trains under prophet_tf.Strategy "
                "through model.fit/train_on_batch, which decide each step with all workers; "
                f"its own apply cannot. Received: {type(outer).__name__} {outer.name!r} "
                f"applied directly, updating {var.name!r}")
        if not self._trained_this_trace:
            keras_optimizer.check_worker_optimizer(checks.optimizer_of(fn))
        position = len(self._trained_this_trace)
        if position >= len(self._raw_grads):
            raise ValueError(  # outside a step, e.g. Keras' SwapEMAWeights
                f"An update of {var.name!r} without a gradient of this step: under "
                "prophet_tf.Strategy the PS applies the optimizer and keeps use_ema's "
                "averages, swapped in at the end of fit; a trainable variable cannot be "
                "assigned through strategy.extended.update (Keras' SwapEMAWeights callback "
                f"does). Received: {len(self._raw_grads)} gradients for "
                f"{position + 1} updates")
        grad = self._raw_grads[position]
        if isinstance(grad, tf.IndexedSlices):
            grad = tf.convert_to_tensor(grad)
        if not grad.shape.is_compatible_with(var.shape):
            raise RuntimeError(f"Gradient {position} has shape {grad.shape}, but the variable "
                               f"{var.name!r} it updates has shape {var.shape}.")
        if not grad.shape.is_fully_defined():
            # Inputs of unknown shape (a tf_keras Sequence) leave some dimensions
            # of the gradient unknown while tracing; the value has the variable's.
            grad = tf.ensure_shape(grad, var.shape)
        if position == 0:
            self._recorded = self._records.record(checks.optimizer_of(fn), self._share_rows,
                                                  self._step_value)
        self._trained_this_trace.append(var)
        if len(self._trained_this_trace) == len(self._raw_grads):
            self._register(list(self._trained_this_trace), fn)
        if self._recorded:
            # The engine reads the step's rate and rows when its first gradient arrives.
            with tf.control_dependencies(self._recorded):
                grad = tf.identity(grad)
        with tf.device(self._host_device):  # The gradient is copied from the compute device.
            _native.push_grad(var.handle, tf.cast(grad, var.dtype), key=var.native_key, step=self._step_value)
        return ()

    def _register(self, trained: list[PSVariable], update_fn) -> None:
        """Starts training through the PS once the trained variables are known."""
        if self._registered is not None:
            if [v.native_key for v in trained] != [v.native_key for v in self._registered]:
                raise ValueError(
                    "The set of trained variables changed after training through the PS "
                    "started; freezing or unfreezing layers after the first fit() is not "
                    "supported under prophet_tf.Strategy. Registered variable keys: "
                    f"{[v.native_key for v in self._registered]}. Received: "
                    f"{[v.native_key for v in trained]}")
            return
        untrained = [v for v in self._ps_variables if all(v is not t for t in trained)]
        optimizer = checks.optimizer_of(update_fn)
        traced = tf.inside_function()
        with tf.init_scope():
            scaled = (self._loss_scale_optimizer is not None
                      and self._loss_scale_optimizer.inner_optimizer is optimizer)
            config = optimizer_config(optimizer, trained, scaled=scaled)
            # Steps the optimizer already counts: restored by BackupAndRestore
            # (or load_weights), the PS continues from the same step.
            resume_step = keras_optimizer.steps_taken(optimizer)
            # Worker 0's values are every worker's version 0.
            initial = ({i: v.initial_numpy() for i, v in enumerate(trained)}
                       if self.engine.worker_id == 0 else None)
            rates = self._records.rate_of_step if self._records.has_rates else None
            start = self.engine.start(trained, config, rates,
                                      resume_iteration=resume_step, initial_values=initial,
                                      batch_rows=self._records.rows_of_step)
            if start:
                if not traced:
                    raise NotImplementedError(
                        f"Resuming training at step {start} needs a compiled train step; "
                        "compile the model with run_eagerly=False. Received: run_eagerly=True")
                # Traced: nothing has run yet, so the first step reads version `start`.
                self._step.assign(start)
            # Saved models hold the PS's optimizer state; a resumed one seeds it.
            self.saved_state.start(optimizer, trained, resume_step)
            keras_optimizer.swap_at_finalize(optimizer, self._swap_averages)  # use_ema
            for variable in untrained:
                # Frozen: its reads return the staged local value at any step.
                _native.freeze_param(variable.native_key)
            for variable in trained:
                variable._ps_managed = True
        self._registered = trained


    def _swap_averages(self) -> None:
        """use_ema's end of fit: the PS tasks overwrite the weights with their moving
        averages as the last step's version, which this worker then reads."""
        if not tf.executing_eagerly():
            raise NotImplementedError(
                "Under prophet_tf.Strategy the PS swaps in the moving averages (use_ema): "
                "call optimizer.finalize_variable_values eagerly, outside tf.function.")
        self.engine.swap_averages(int(self._step.numpy()))


def optimizer_config(optimizer, trained: list, scaled: bool = False) -> str:
    """The JSON config the PS rebuilds the optimizer from (`keras_optimizer.config_json`);
    ``scaled``: it is the inner optimizer of a LossScaleOptimizer.

    Raises:
      ValueError: an optimizer or option the PS cannot apply exactly.
    """
    return keras_optimizer.config_json(optimizer, trained, loss_scaling=scaled)
