"""State of one PS task: the RPC facade over its partitions, sums and optimizer.

The servicer is plain Python: call ``Register``/``Push``/``Pull``/``Heartbeat``
with a request message and anything that has ``abort(code, details)`` (and,
for ``Pull``, ``time_remaining()``/``is_active()``) and it works without a
network; ``server.py`` wires it into gRPC.

It owns the locking and wires the concerns together, each in its module:

* ``registration.py``: Register, the declaration checks, the same-model check;
* ``aggregation.py``: the iteration rules of a push, the NaN/Inf check, sums;
* ``verdicts.py``: a loss-scaled model's steps, applied or skipped by verdicts;
* ``apply.py``: the optimizer apply thread (``lamb.py``: Lamb over a cut variable,
  ``whole_apply.py``: Adafactor's); ``ema.py``: use_ema's averages, SwapAverages;
* ``clipping.py``: ``global_clipnorm`` and ``clipnorm``, a step's sums held
  until their norm is known; ``norm_sharing.py``: norms over partitions on
  several PS tasks, agreed through PS task 0 (ShareNorm);
* ``liveness.py``: heartbeats and the watchdog;
* ``keras_rpcs.py``: what Keras needs besides training (Gather for
  whole-data metrics and predictions, the optimizer state of saved models);
* ``checkpoint.py``: checkpoints, taken on the apply thread when the last
  partition reaches a version and restored at the first Register (the one of
  the workers' ``resume_step`` when they resume from their own backup, else
  the newest);
* ``pulls.py``: Pull (each partition the moment it reaches the version) and Owed.

Locks: ``_lock`` (the state: model definition, versions, sums, liveness) and
the applier's lock (the optimizer and the variables). Where both are held,
the apply lock is taken first.
"""

from __future__ import annotations

import collections
import logging
import threading
from typing import Callable

import grpc

from prophet_tf.ps import (aggregation, apply, gather, liveness, protocol, registration,
                           security, sharding, verdicts)
from prophet_tf.ps.ema import SwapRPCs
from prophet_tf.ps.keras_rpcs import KerasRPCs
from prophet_tf.ps.norm_sharing import NormRPCs
from prophet_tf.ps.pulls import PullRPCs
from prophet_tf.ps import checkpoint as checkpoint_lib
from prophet_tf.ps import trace as trace_lib
from prophet_tf.ps.errors import RejectionLog, RpcError, invalid, precondition
from prophet_tf.ps.v1 import ps_pb2

__all__ = ["ParameterServerServicer"]

logger = logging.getLogger(__name__)

class ParameterServerServicer(KerasRPCs, PullRPCs, NormRPCs, SwapRPCs):
    """Implements the ``prophet_tf.ps.v1.ParameterServer`` methods.

    Args:
        num_workers: W, the number of workers whose gradients make an iteration.
        ps_index: this task's index among the PS tasks.
        num_ps: number of PS tasks.
        max_partition_bytes: the sharding limit; must equal the workers'.
        max_chunk_bytes: largest partition this PS accepts (bounded by the
            message size limit); a variable with a bigger single row is
            rejected at Register.
        worker_timeout_s: a worker silent for this long after a Heartbeat is
            lost: the job fails (see ``failure``). Watching starts with a
            worker's first Heartbeat, so a client that never sends one (a
            tool, a test) is not watched.
        startup_timeout_s: once any worker has sent a Heartbeat, every other
            one must send its first within this long, or the job fails.
        checkpoint: save checkpoints by this policy, and restore the newest
            (or the one the workers resume from) at the first Register.
        on_failure: called once, on another thread, with the message when the
            job fails (a lost worker, a model conflict).
        trace: where to record when each partition's sum completed, was
            applied and answered (``trace.py``); None: not recorded.
        peer_security: how this task reaches PS task 0 (clipping norms over
            several tasks, ``norm_sharing.py``); None: the environment's.
    """

    def __init__(self, num_workers: int, ps_index: int = 0, num_ps: int = 1,
                 max_partition_bytes: int = sharding.DEFAULT_MAX_PARTITION_BYTES,
                 max_chunk_bytes: int | None = None, worker_timeout_s: float = 10.0,
                 startup_timeout_s: float = 300.0,
                 checkpoint: checkpoint_lib.CheckpointPolicy | None = None,
                 on_failure: Callable[[str], None] | None = None,
                 trace: trace_lib.PSTrace | None = None,
                 peer_security: security.ClientSecurity | None = None):
        if num_workers < 1:
            raise ValueError(f"num_workers must be >= 1. Received: num_workers={num_workers}")
        if not 0 <= ps_index < num_ps:
            raise ValueError("ps_index must be in [0, num_ps). "
                             f"Received: ps_index={ps_index}, num_ps={num_ps}")
        if max_partition_bytes < 1:
            raise ValueError("max_partition_bytes must be >= 1. "
                             f"Received: max_partition_bytes={max_partition_bytes}")
        if not worker_timeout_s > 0:
            raise ValueError(f"worker_timeout_s must be > 0. Received: {worker_timeout_s!r}")
        if not startup_timeout_s > 0:
            raise ValueError(f"startup_timeout_s must be > 0. Received: {startup_timeout_s!r}")
        self.num_workers, self.ps_index, self.num_ps = num_workers, ps_index, num_ps
        self.max_partition_bytes = max_partition_bytes
        self.max_chunk_bytes = max_chunk_bytes
        self.worker_timeout_s = float(worker_timeout_s)
        self.startup_timeout_s = float(startup_timeout_s)
        self._on_failure = on_failure
        self._trace = trace
        self._checkpointer = checkpoint_lib.Checkpointer(checkpoint) if checkpoint else None
        self._lock = threading.Lock()  # model definition, versions, sums, liveness
        # Notified when a partition gets a version, fails, or the job fails:
        # what waiting pulls wake on.
        self._published = threading.Condition(self._lock)
        self._model: registration.Model | None = None
        self._parts: dict[tuple[int, int], registration.Part] = {}
        # Set when the job can never make progress (a worker declared another
        # model, a worker was lost): every waiting and later Pull/Push and
        # every Heartbeat answer carries it.
        self._failure: str | None = None
        # The first Register's resume_step (all must send the same) and the
        # version the job starts from (a restored checkpoint's, or that iteration).
        self._requested_resume: int | None = None
        self._start_version = 0
        # version -> how many partitions reached it (a version is complete,
        # and may be checkpointed, when all have).
        self._at_version: dict[int, int] = {}
        self._pulls = collections.Counter()  # worker -> pulls in progress
        # pull -> [worker, min_version, partitions not yet sent]: what Owed reports.
        self._unsent: dict[object, list[int]] = {}
        self._rejections = RejectionLog()
        self._closed = False
        self._liveness = liveness.Liveness(
            num_workers, self.worker_timeout_s, self.startup_timeout_s, self._lock,
            self._fail_job_locked, lambda: self._failure is not None,
            name=f"prophet-tf-ps{ps_index}-watchdog")
        self._applier = apply.Applier(self._lock, f"prophet-tf-ps{ps_index}-apply",
                                      self._applied, self._apply_failed)
        self._gatherer = gather.Gatherer(num_workers, self._round_failure)
        # A loss-scaled model's step verdicts (verdicts.py): a round per step.
        self._verdict_rounds = gather.Gatherer(
            num_workers, self._round_failure, what="verdict of step",
            same_calls="a worker sends one verdict per step")
        self._verdicts = verdicts.Verdicts()
        self._init_norms(peer_security)  # clipping's (norm_sharing.py)
        self._init_swaps()  # use_ema's (ema.py)

    # ------------------------------------------------------------------ RPCs

    def Register(self, request, context):
        return self._answer(self._register, "Register", request, context)

    def Push(self, request, context):
        return self._answer(self._push, "Push", request, context)

    def Heartbeat(self, request, context):
        return self._answer(self._heartbeat, "Heartbeat", request, context)

    def Verdict(self, request, context):
        return self._answer(lambda r: self._verdict(r, context), "Verdict", request, context)

    def _answer(self, handler, rpc: str, request, context):
        """Runs a unary handler; its RpcError becomes the call's status."""
        try:
            return handler(request)
        except RpcError as e:
            self._rejections.log(rpc, request, e)
            context.abort(e.code, e.message)

    # -------------------------------------------------------------- Register

    def _register(self, request):
        registration.check_request(request, self.num_workers, self.num_ps,
                                   self.max_partition_bytes)
        registration.load_keras()  # outside the state lock: seconds the first time
        with self._lock:
            model = self._model
            if model is None:  # validates; installs nothing yet
                model = registration.define_model(request, self.ps_index, self.num_ps,
                                                  self.max_partition_bytes,
                                                  self.max_chunk_bytes)
                snapshot = self._choose_checkpoint(model, request.resume_step)
            else:
                try:
                    registration.check_same_model(model, request, self.max_partition_bytes)
                except RpcError as e:
                    self._failure = (f"worker {request.worker_id} declared another model: "
                                     f"{e.message}")
                    self._notify_all_locked()
                    raise
                if request.resume_step != self._requested_resume:
                    raise invalid(f"The first worker resumed from step {self._requested_resume}; "
                                  "every worker must resume from the same step (restore the "
                                  f"same backup). Received: resume_step={request.resume_step} "
                                  f"from worker {request.worker_id}")
            initial = registration.check_initial_values(model, request.initial_values,
                                                        self.ps_index)
            if self._model is None:
                self._install_model(model)
                self._requested_resume = self._start_version = request.resume_step
                if snapshot is not None:
                    self._restore(snapshot)
                elif request.resume_step:
                    logger.warning("The workers resume at step %d and this PS has no "
                                   "checkpoint of it: worker 0's values become version %d; "
                                   "the optimizer's state starts afresh unless worker 0 sends it "
                                   "(WriteOptimizerState, from a saved Keras 3 model).",
                                   request.resume_step, request.resume_step)
            self._liveness.registered_locked(request.worker_id)
        # Values are assigned outside the state lock (pulls and pushes of other
        # partitions go on); a partition that already has one keeps it, so a
        # retried Register is harmless.
        for part, array in initial:
            with self._applier.lock:
                if part.version >= 0:  # only changes under the apply lock before 0
                    continue
                part.variable.assign(array.reshape(part.shape))
                # A fresh PS takes the workers' iteration: they may resume
                # from their own backup (BackupAndRestore) without a PS checkpoint.
                version = self._start_version
                encoded = protocol.encode_pull_entry(
                    part.plan.key, part.plan.partition, version, part.spec.dtype,
                    apply.read(part))
                with self._lock:
                    part.encoded, part.version = encoded, version
                    self._count_version_locked(version)
                    self._published.notify_all()
        with self._lock:
            parts = list(self._parts.values())
            version = self._start_version
        return ps_pb2.RegisterResponse(ps_index=self.ps_index, num_ps=self.num_ps,
                                       partitions=[p.plan.to_proto() for p in parts],
                                       version=version)

    def _install_model(self, model):
        self._model, self._parts = model, model.parts
        self._applier.install(model.optimizer, bool(model.global_clipnorm or model.clipnorm))
        if model.global_clipnorm or model.clipnorm:
            self._install_norm_hold(model)
        logger.info("Model defined: %d variables, %d partitions on PS %d (%d bytes), "
                    "optimizer %s", len(model.specs), len(self._parts), self.ps_index,
                    sum(p.plan.nbytes for p in self._parts.values()),
                    type(model.optimizer).__name__)

    # ------------------------------------------------------------------ Push

    def _push(self, request):
        if getattr(request, "malformed", None):
            raise invalid(f"The request is not a PushRequest. Received: {request.malformed}")
        if self._failure:
            raise RpcError(grpc.StatusCode.FAILED_PRECONDITION, self._failure)
        W, wid = self.num_workers, request.worker_id
        if not 0 <= wid < W:
            raise invalid(f"worker_id must be in [0, {W}). Received: worker_id={wid}")
        if not request.chunks:
            raise invalid("A push carries at least one gradient chunk. "
                          f"Received: 0 chunks from worker_id={wid}")
        with self._lock:
            model, parts = self._model, self._parts
        if model is None:
            raise precondition("No model is registered on this PS yet; call Register "
                               f"first. Received: Push from worker_id={wid}")
        # The content checks (sizes, NaN/Inf scan) need no lock: the model's
        # partitions never change once installed.
        chunks, learning_rate = aggregation.check_content(request, model, parts,
                                                          self.ps_index)
        with self._lock:
            accepted = aggregation.check_iterations(chunks, wid)
            if learning_rate is not None:
                for _, iteration, _, _ in accepted:
                    self._applier.set_learning_rate_locked(iteration, learning_rate)
            completed, duplicates = aggregation.add(accepted, wid, W)
            if self._trace:
                for part, step, _ in completed:
                    self._trace.record("complete", part, step, wid)
            # A loss-scaled step waits for all workers' verdicts.
            updates = [self._update_locked(part, step, total, self._verdicts.wait_locked(
                part, step, total) if model.loss_scaling else True)
                for part, step, total in completed]
        self._queue(updates)
        return ps_pb2.PushResponse(duplicates=duplicates)

    def _update_locked(self, part, step: int, total, finite: bool | None) -> tuple | None:
        """What to queue for a complete sum: ``(part, step, total, optimizer
        iteration)``, the iteration None for a step that overflowed (skipped);
        None while the step's verdict is unknown."""
        if finite is None:
            return None
        return part, step, total, self._verdicts.optimizer_iteration(step) if finite else None

    def _queue(self, updates: list) -> None:
        for update in filter(None, updates):
            part, step, total, iteration = update
            if iteration is None:
                self._applier.skip(part, step)
            elif self._norm_hold is not None:  # Held until its clipping norm is known.
                for ready in self._norm_hold.add(part, step, total, iteration):
                    self._applier.submit(*ready)
            else:
                self._applier.submit(part, step, total, iteration)

    # --------------------------------------------------------------- verdicts

    def _verdict(self, request, context):
        if getattr(request, "malformed", None):  # bytes that did not parse (protocol.py)
            raise invalid(f"The request is not a GatherRequest. Received: {request.malformed}")
        with self._lock:
            model = self._model
        if model is None or not model.loss_scaling:
            raise precondition("Verdicts are for a model whose workers scale the loss "
                               "(LossScaleOptimizer); this PS has "
                               f"{'no model' if model is None else 'another model'}. "
                               f"Received: a verdict of step {request.round} from "
                               f"worker_id={request.worker_id}")
        if request.payload not in (b"\x00", b"\x01"):
            raise invalid("A verdict's payload is one byte, 0 or 1. Received: "
                          f"payload={request.payload[:16]!r}")
        payloads = self._verdict_rounds.gather(request, context)
        finite = all(p == b"\x01" for p in payloads)
        with self._lock:
            released = self._verdicts.decide_locked(request.round, finite)
            updates = [self._update_locked(part, request.round, total, finite)
                       for part, total in released or ()]
        if not finite and released is not None:
            logger.info("Step %d skipped: a worker's gradients were not finite (loss scaling)",
                        request.round)
        self._queue(updates)
        return ps_pb2.GatherResponse(payloads=payloads)

    # ----------------------------------------------------------------- apply

    def _applied(self, part, version: int, encoded: bytes) -> None:
        """Publishes an applied update (on the apply thread)."""
        if self._trace:
            self._trace.record("applied", part, version)
        with self._lock:
            part.encoded, part.version = encoded, version
            part.arrived = {}
            complete = self._count_version_locked(version)
            self._published.notify_all()
        if complete and self._checkpointer and self._checkpointer.due(version):
            # Still on the apply thread: no partition moves past this version
            # until the snapshot is read.
            self._save_checkpoint(version)

    def _apply_failed(self, part, iteration: int, message: str) -> None:
        with self._lock:
            part.failed = message
            self._published.notify_all()

    def _count_version_locked(self, version: int) -> bool:
        """Counts a partition reaching ``version``; True when all have."""
        count = self._at_version.get(version, 0) + 1
        self._at_version[version] = count
        self._at_version.pop(version - 1, None)
        return count == len(self._parts)

    # ------------------------------------------------------------- liveness

    def _heartbeat(self, request):
        liveness.check_heartbeat(request, self.num_workers)
        with self._lock:
            if self._failure:
                return ps_pb2.HeartbeatResponse(failure=self._failure)
            if self._liveness.heartbeat_locked(request.worker_id, request.steps_pushed,
                                               request.leaving):
                self._notify_all_locked()  # pulls that now can never complete fail
        return ps_pb2.HeartbeatResponse()

    def _fail_job_locked(self, message: str) -> None:
        self._failure = message
        logger.error("%s", message)
        self._notify_all_locked()
        if self._on_failure is not None:
            threading.Thread(target=self._on_failure, args=(message,), daemon=True,
                             name="prophet-tf-ps-on-failure").start()

    def _fail_job(self, message: str) -> None:
        with self._lock:
            if not self._failure:
                self._fail_job_locked(message)

    def _notify_all_locked(self) -> None:
        self._published.notify_all()
        self._gatherer.wake()
        self._verdict_rounds.wake()
        self._swap_rounds.wake()
        if self._norm_rounds is not None:
            self._norm_rounds.wake()

    # ----------------------------------------------------------- checkpoints

    def _signature(self, model) -> dict:
        return checkpoint_lib.signature_of(model, self.ps_index, self.num_ps)

    def _choose_checkpoint(self, model, resume_step: int):
        try:
            return checkpoint_lib.choose(self._checkpointer, self._signature(model),
                                         list(model.optimizer.variables), len(model.parts),
                                         resume_step)
        except ValueError as e:
            raise precondition(str(e)) from None

    def _restore(self, snapshot) -> None:
        """Installs ``snapshot``; called under the state lock right after the
        model is installed, when no push can have arrived and nothing applies
        (so the apply lock is not needed, and would invert the lock order)."""
        checkpoint_lib.install(snapshot, self._parts, self._model.optimizer)
        for part in self._parts.values():
            part.encoded = protocol.encode_pull_entry(
                part.plan.key, part.plan.partition, snapshot.step, part.spec.dtype,
                apply.read(part))
            part.version = snapshot.step
        self._start_version = snapshot.step
        self._at_version = {snapshot.step: len(self._parts)}
        self._verdicts = verdicts.Verdicts(snapshot.skipped_steps)
        logger.info("Restored the checkpoint of step %d from %s", snapshot.step,
                    self._checkpointer.policy.directory)

    def _save_checkpoint(self, version: int) -> None:
        with self._applier.lock:
            params = {k: apply.read(part).copy() for k, part in self._parts.items()}
            with self._lock:
                skipped = self._verdicts.skipped_before(version)
            snapshot = checkpoint_lib.take(version, self._signature(self._model), params,
                                           list(self._model.optimizer.variables), skipped)
        try:
            self._checkpointer.save(snapshot)
        except RuntimeError as e:
            with self._lock:
                self._fail_job_locked(str(e))

    # ------------------------------------------------------------- lifecycle

    def close(self):
        """Stops the apply thread after the queued updates, then writes checkpoints."""
        if not self._closed:
            self._closed = True
            self._liveness.stop()
            if self._norm_sharing is not None:
                self._norm_sharing.close()
            self._applier.close()
            if self._checkpointer:
                self._checkpointer.close()

    @property
    def failure(self) -> str | None:
        """Why the job can no longer make progress, or None."""
        with self._lock:
            return self._failure
