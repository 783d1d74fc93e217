"""The worker's background engine: gradients out, parameters in.

The `Engine` registers the model with every PS task, runs the threads and
stops them. Threads (all daemons; any failure aborts the op runtime, so a
waiting AwaitParam fails with the message instead of hanging):

- pump: takes ready gradients from the op runtime and hands them to the
  dispatch; on the first gradient of iteration k it asks every PS for
  version k+1 (gradients_out.py).
- one sender per PS task: pushes each block the dispatch releases to its
  link as one asynchronous RPC, at once (gradients_out.py).
- one puller per PS task: streams the task's partitions of a version as the
  PS applies them and delivers each parameter once all its partitions are in
  (parameters_in.py).
- one heartbeat per PS task: notices a lost PS or a failed job (liveness.py).

The engine imports no TensorFlow: the op runtime is handed in (the worker
passes ``prophet_tf._native``), gradients' dtypes are names, and worker 0's
initial values arrive as numpy arrays.
"""
from __future__ import annotations

import atexit
import logging
import os
import threading
import time
from typing import Callable, Mapping, Sequence

import grpc
import numpy as np

from prophet_tf import cluster as cluster_lib
from prophet_tf import codec, environment, optimizer_policy
from prophet_tf.engine import liveness, schedulers
from prophet_tf.engine.answers_first import AnswersFirst
from prophet_tf.engine import timeline as timeline_lib
from prophet_tf.engine.dispatch import Dispatch
from prophet_tf.engine.gradients_out import GradientsOut
from prophet_tf.engine.parameters_in import ParametersIn
from prophet_tf.ps import client as client_lib
from prophet_tf.ps.client import PSClient, variable_specs

logger = logging.getLogger(__name__)

SCHEDULER_ENV = environment.SCHEDULER
#: "0" turns answers-first off (prophet_tf.engine.answers_first); for A/B runs.
ANSWERS_FIRST_ENV = environment.ANSWERS_FIRST


class Engine:
    """Moves one worker's gradients to the PS and the new parameters back.

    Args:
      config: the resolved cluster; this task must be a worker.
      scheduler: scheduler name, optionally with options ("bytescheduler:
        credit_bytes=8000000"); None reads PROPHET_TF_SCHEDULER, else "fifo".
      scheduler_options: options of the scheduler (see its class).
      rpc_timeout_s: deadline of each RPC; a wait for a version is renewed
        after it while the heartbeats say every task is alive.
      timeline: where to write the Chrome-trace timeline (see
        prophet_tf.engine.timeline); None reads PROPHET_TF_TIMELINE; "" disables.
      make_shapers: called once per PS link for the link shaping its client
        applies (see prophet_tf.ps.shaping.from_env); None: no shaping.
      answers_first: hold pushes to other hosts while a PS on this host owes
        them answers (prophet_tf.engine.answers_first); None reads
        PROPHET_TF_ANSWERS_FIRST ("0": off), else on.
      runtime: the op runtime the engine drives: ``prophet_tf._native``, or
        an object with the same ``next_grad``, ``release_grad``,
        ``queued_grads``, ``deliver_begin/write/commit``, ``drain_stamps``,
        ``stamps_dropped`` and ``abort``.

    Raises:
      ValueError: an unknown scheduler or option, or a bad timeout.
    """

    #: Seconds between heartbeats to each PS (its --worker-timeout is 10 s).
    HEARTBEAT_INTERVAL_S = 1.0
    #: A PS that answers no heartbeat for this long is lost.
    PS_TIMEOUT_S = 10.0
    #: How long shutdown waits for each thread once the channels are closed.
    JOIN_TIMEOUT_S = 10.0

    def __init__(self, config: cluster_lib.ClusterConfig, scheduler: str | None = None, *,
                 scheduler_options: dict | None = None, rpc_timeout_s: float = 120.0,
                 timeline: str | None = None, make_shapers=None, runtime=None,
                 answers_first: bool | None = None):
        spec = scheduler if scheduler is not None else os.environ.get(SCHEDULER_ENV, "fifo")
        name, options = schedulers.parse_scheduler(spec)
        options.update(scheduler_options or {})
        schedulers.validate_scheduler(name, **options)
        if not isinstance(rpc_timeout_s, (int, float)) or rpc_timeout_s <= 0:
            raise ValueError(f"rpc_timeout_s must be a positive number of seconds. "
                             f"Received: rpc_timeout_s={rpc_timeout_s!r}")
        self.scheduler_name, self.scheduler_options = name, options
        self.config = config
        self.rpc_timeout_s = float(rpc_timeout_s)
        self.timeline = os.environ.get(timeline_lib.TIMELINE_ENV, "") if timeline is None \
            else timeline
        if runtime is None:
            raise ValueError("the engine needs the op runtime (prophet_tf._native). "
                             "Received: runtime=None")
        self._native = runtime
        self._make_shapers = make_shapers
        self.answers_first = os.environ.get(ANSWERS_FIRST_ENV, "1") != "0" \
            if answers_first is None else bool(answers_first)
        self._started = False
        self._swaps = 0  # use_ema's swap rounds so far (every worker counts the same)
        self._stop = threading.Event()
        self._error: BaseException | None = None
        self._threads: list[threading.Thread] = []

    @property
    def worker_id(self) -> int:
        return self.config.task_index

    # -- start ---------------------------------------------------------------------------

    def start(self, variables: Sequence, optimizer_config: str,
              learning_rate: Callable[[int], float] | None = None, resume_iteration: int = 0,
              initial_values: Mapping[int, np.ndarray] | None = None,
              batch_rows: Callable[[int], int | None] | None = None) -> int:
        """Registers the trained variables with every PS, stages the first version, starts threads.

        Args:
          variables: the trained variables in trainable_variables order: each
            with ``native_key`` (its op-library key), ``shape``, ``dtype`` and a
            ``path`` or ``name``.
          optimizer_config: JSON the PS rebuilds the Keras optimizer from.
          learning_rate: ``learning_rate(k)`` is the rate iteration k trained
            with (None when it is a schedule, which the PS computes itself);
            read when iteration k's first gradient arrives and sent with its
            pushes, so callbacks that change it reach the PS. It must be the
            rate recorded by iteration k itself, not the optimizer's rate at
            the time of the call: by then a callback may have set the next
            epoch's.
          resume_iteration: iterations this worker's own state already trained
            (its optimizer's restored iteration count); 0 for a fresh start.
          initial_values: worker 0 only: each variable's initial value by
            position in ``variables`` (version 0, the values every worker
            starts from); None on the other workers.

          batch_rows: ``batch_rows(k)`` is the number of rows of this worker's
            share of iteration k's batch when k is a Keras train step (the PS
            weights each worker's gradient by its rows), else None; read and
            sent like the learning rate.

        Returns:
          The iteration training starts from: 0, ``resume_iteration``, or the
          iteration of the checkpoint the PS tasks restored.

        Raises:
          ValueError: worker 0 without every initial value, or another worker
            with them.
        """
        if self._started:
            raise RuntimeError("the engine was already started")
        if (self.worker_id == 0) != (initial_values is not None):
            raise ValueError("worker 0, and only worker 0, sends the initial values. Received: "
                             f"initial_values={'None' if initial_values is None else 'given'} "
                             f"on worker {self.worker_id}")
        if initial_values is not None and sorted(initial_values) != list(range(len(variables))):
            raise ValueError(f"initial_values needs one array per variable (keys 0 to "
                             f"{len(variables) - 1}). Received: keys {sorted(initial_values)}")
        self._specs = specs = variable_specs(variables)
        scheduler = schedulers.make_scheduler(self.scheduler_name, **self.scheduler_options)
        # Optimizers that need whole variables keep them whole on one PS.
        whole = optimizer_policy.needs_whole_variables(
            optimizer_policy.parse_config(optimizer_config))
        self._dispatch = dispatch = Dispatch([v.native_key for v in variables], specs,
                                             self.config.num_ps, scheduler, balance=not whole,
                                             num_workers=self.config.num_workers,
                                             ps_on_host=bool(cluster_lib.local_ps(self.config)))
        self._recorder = timeline_lib.Recorder(
            self.worker_id, {k: v.name for k, v in zip(dispatch.native_keys, specs)}) \
            if self.timeline else None
        codec.tune_allocator()  # Recycle transfer buffers instead of page-faulting them in.
        self._clients = [PSClient(address, self.worker_id, self.config.num_workers,
                                  shapers=self._make_shapers() if self._make_shapers else None)
                         for address in self.config.ps]
        for client in self._clients:
            client.wait_ready(self.rpc_timeout_s)
        self._answers = AnswersFirst(self.config, self._clients, self._stop,
                                     max_wait_s=self.rpc_timeout_s) \
            if self.answers_first else None
        # Heartbeats start before Register: registering may wait for worker
        # 0's values, and a worker that dies meanwhile must be noticed too.
        for i in range(len(self._clients)):
            self._spawn(f"prophet-tf-heartbeat-{i}", self._heartbeat, i)
        try:
            self.start_iteration = start = self._register(
                optimizer_config, resume_iteration, initial_values)
        except BaseException:
            self._stop.set()  # No heartbeats for a worker that will not train.
            raise
        dispatch.last_iteration = start - 1
        self._parameters_in = parameters_in = ParametersIn(
            self.worker_id, self._native, dispatch, self._clients, self._stop,
            rpc_timeout_s=self.rpc_timeout_s, recorder=self._recorder)
        self._gradients_out = gradients_out = GradientsOut(
            self._native, dispatch, self._clients, self._stop, self._fail, parameters_in.ask,
            rpc_timeout_s=self.rpc_timeout_s, answers=self._answers, recorder=self._recorder,
            learning_rate=learning_rate, batch_rows=batch_rows)
        # The first version comes from the PS, so every worker starts from
        # the same values (worker 0's, or a checkpoint's).
        for ps_index in range(len(self._clients)):
            parameters_in.pull_version(ps_index, start)
        self._spawn("prophet-tf-pump", gradients_out.pump)
        for i in range(len(self._clients)):
            self._spawn(f"prophet-tf-send-{i}", gradients_out.sender, i)
            self._spawn(f"prophet-tf-pull-{i}", parameters_in.puller, i)
        self._started = True
        # Push the last iteration's gradients before the interpreter exits, or
        # the other workers would wait for them in vain.
        atexit.register(self.shutdown)
        logger.info("worker %d: training %d variables through %d PS task(s), scheduler %s%s%s",
                    self.worker_id, len(specs), len(self._clients), self.scheduler_name,
                    f", from step {start}" if start else "",
                    f", answers first (PS {self._answers.local_ps} on this host)"
                    if self._answers is not None and self._answers.active else "")
        return start

    @property
    def _last_iteration(self) -> int:
        dispatch = getattr(self, "_dispatch", None)
        return -1 if dispatch is None else dispatch.last_iteration

    def _register(self, optimizer_config: str, resume_iteration: int,
                  initial_values: Mapping[int, np.ndarray] | None) -> int:
        """Declares the model to every PS; returns the iteration training starts from."""
        versions = [response.version for response in client_lib.register_all(
            self._clients, self._specs, optimizer_config, initial_values,
            timeout=self.rpc_timeout_s, resume_step=resume_iteration,
            max_partition_bytes=self._dispatch.partition_bytes)]
        if len(set(versions)) != 1:
            raise RuntimeError(
                "The PS tasks start from different steps (restored different checkpoints: "
                "checkpoint by steps, not seconds, with several PS tasks). Received: "
                + ", ".join(f"PS {i} at step {v}" for i, v in enumerate(versions)))
        return versions[0]

    def _spawn(self, name, target, *args):
        thread = threading.Thread(target=self._guard, args=(target, *args), name=name, daemon=True)
        thread.start()
        self._threads.append(thread)

    def _guard(self, target, *args):
        try:
            target(*args)
        except BaseException as e:  # noqa: BLE001 - any failure must reach the training thread.
            if not self._stop.is_set():
                self._fail(e)

    def _fail(self, error: BaseException) -> None:
        if self._error is None:
            self._error = error
            message = f"prophet_tf engine on worker {self.worker_id} failed: {error}"
            logger.error(message)
            self._native.abort(message)
        self._stop.set()

    # -- rounds among the workers: loss scaling's verdicts, use_ema's swap --------------

    def step_verdict(self, step: int, finite: bool) -> bool:
        """Sends this worker's verdict of ``step`` to every PS task (a loss-scaled
        model, ``prophet_tf.loss_scaling``); True when every worker's
        gradients of the step were finite.

        Each PS task answers once all workers' verdicts are in, and applies or
        skips the step by them (``prophet_tf.ps.verdicts``). Like a parameter
        wait, a long wait is renewed with a warning; a failed job raises.
        """
        answers = self._on_every_ps(
            lambda client: client.verdict_future(step, finite, timeout=self.rpc_timeout_s),
            f"The verdict of step {step} (loss scaling)",
            f"the other workers' verdicts of step {step}")
        # Every PS task answers the same verdicts; any one decides.
        return all(client_lib.verdicts(answers[0]))

    def _on_every_ps(self, ask, what: str, waiting_for: str) -> list:
        """``ask(client)``'s future on every PS task at once; their answers by PS index.
        A round among the workers (a verdict, a swap) waits for the slowest: a call that
        reaches its deadline is asked again with a warning (the PS keeps a repeated
        call once); any other failure, or one after the engine stopped, raises
        ``RuntimeError`` naming ``what`` and the PS."""
        pending = {i: ask(c) for i, c in enumerate(self._clients)}
        answers = {}
        while pending:
            for i, future in list(pending.items()):
                try:
                    answers[i] = future.result()
                    del pending[i]
                except grpc.RpcError as e:
                    if e.code() != grpc.StatusCode.DEADLINE_EXCEEDED or self._stop.is_set():
                        raise RuntimeError(
                            f"{what} from the PS at {self._clients[i].address} failed: "
                            f"{liveness.rpc_message(e)}") from None
                    logger.warning("worker %d: still waiting after %.0f s for %s",
                                   self.worker_id, self.rpc_timeout_s, waiting_for)
                    pending[i] = ask(self._clients[i])
        return [answers[i] for i in range(len(self._clients))]

    # -- use_ema -------------------------------------------------------------------------

    def swap_averages(self, version: int) -> None:
        """use_ema's end of fit (``prophet_tf.ps.ema``): every PS task overwrites its
        partitions with their moving averages as version ``version`` (the last
        step's), once every worker has asked; then this worker pulls that version
        anew, so its reads see the averages.

        Raises:
          RuntimeError: the engine failed, a PS refused, or this worker's own
            parameters of ``version`` never came.
        """
        if not self._started:
            raise RuntimeError("the engine has not started: no training to finalize")
        # The pullers are done with `version` once all of it is staged; a chunk of
        # it still in flight would land after the averages.
        waited = time.monotonic()
        for native_key in self._dispatch.native_keys:
            while (self._native.param_version(native_key) or 0) < version:  # None: never
                if self._stop.is_set() or time.monotonic() - waited > self.rpc_timeout_s:
                    raise RuntimeError(
                        f"worker {self.worker_id}: version {version} of parameter "
                        f"{native_key} never came before the swap of the moving averages"
                        + (f": {self._error}" if self._error else ""))
                time.sleep(0.001)
        swap, self._swaps = self._swaps, self._swaps + 1
        self._on_every_ps(
            lambda client: client.swap_averages_future(swap, version,
                                                       timeout=self.rpc_timeout_s),
            f"The swap of the moving averages at version {version}",
            "the other workers to end fit")
        for ps_index in range(len(self._clients)):
            self._parameters_in.pull_version(ps_index, version)
        logger.info("worker %d: the moving averages replace the weights of step %d",
                    self.worker_id, version)

    # -- liveness ------------------------------------------------------------------------

    def _heartbeat(self, ps_index: int) -> None:
        liveness.heartbeat(self._clients[ps_index], ps_index, lambda: self._last_iteration + 1,
                           self._stop, self.HEARTBEAT_INTERVAL_S, self.PS_TIMEOUT_S)

    def _leave(self) -> None:
        """Tells every PS this worker stops after the iterations it pushed."""
        for client in self._clients:
            try:
                client.heartbeat(self._last_iteration + 1, leaving=True, timeout=2.0)
            except Exception as e:  # noqa: BLE001 - the PS may be gone already
                logger.debug("leaving PS at %s: %s", client.address, liveness.rpc_message(e))

    # -- stop ----------------------------------------------------------------------------

    def flush(self, timeout_s: float | None = None) -> bool:
        """Sends every gradient handed to the engine; True once all are pushed."""
        if not self._started:
            return True
        deadline = time.monotonic() + (self.rpc_timeout_s if timeout_s is None else timeout_s)
        while time.monotonic() < deadline and self._error is None:
            if self._gradients_out.flush(wait_s=0.05):
                return True
        return False

    def shutdown(self, flush_timeout_s: float = 30.0) -> None:
        """Pushes what is pending, writes the timeline, stops and joins the threads."""
        if self._started and not self._stop.is_set():
            flushed = self.flush(flush_timeout_s)
            self.write_timeline()
            self._stop.set()
            if flushed:  # Otherwise the PS must not count the unsent iterations as pushed.
                self._leave()
        self._stop.set()
        # Closing the channels first cancels any RPC a thread still waits on
        # (a pull of a version that will never come), so every thread ends
        # here, before the interpreter tears down what they use.
        for client in getattr(self, "_clients", []):
            client.close()
        for thread in self._threads:
            thread.join(timeout=self.JOIN_TIMEOUT_S)
        alive = [t.name for t in self._threads if t.is_alive()]
        if alive:
            logger.warning("worker %d: engine threads still running after %.0f s: %s",
                           self.worker_id, self.JOIN_TIMEOUT_S, ", ".join(alive))

    def write_timeline(self) -> str | None:
        """Writes this worker's timeline (if enabled); returns its path."""
        if not self._started or self._recorder is None:
            return None
        path = self._recorder.write(self.timeline, self._native.drain_stamps(),
                                    self._native.stamps_dropped())
        logger.info("worker %d: timeline written to %s", self.worker_id, path)
        return path
