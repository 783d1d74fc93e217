"""Saved models hold the PS's optimizer state, and resume from it.

Under the strategy the optimizer's trained state (Adam's moments, momenta,
...) lives on the PS tasks; the worker's Keras optimizer keeps an untrained
copy and counts the iterations. So that `model.save`, `save_weights`,
`ModelCheckpoint` and `BackupAndRestore` write the real state:

- once training through the PS has started, the optimizer's
  ``save_own_variables`` (which every Keras 3 save goes through) and its
  ``_trackable_children`` (which `tf.train.Checkpoint` goes through) first read
  the state of the worker's current step from every PS task
  (`ReadOptimizerState`, which waits until the PS has applied that step) and
  sets the worker's slots to it;
- when training starts from a saved model (its optimizer has counted
  iterations: `load_model`, `load_weights` or `BackupAndRestore`), worker 0
  sends its slots to every PS task right after Register, before its first
  push, so the PS applies the next step from that state
  (`WriteOptimizerState`).

The iteration count needs nothing: the worker's own counts the steps and is
sent as the Register's ``resume_step``. Keras 3 optimizers only; a tf_keras
model's file keeps the untrained copy.
"""
from __future__ import annotations

import logging
import threading

import numpy as np

from prophet_tf import codec, keras_optimizer, per_iteration

logger = logging.getLogger(__name__)

__all__ = ["SavedState"]


class SavedState:
    """Reads and writes the PS tasks' optimizer state for this worker.

    Args:
        addresses: the PS tasks' ``host:port``, in order.
        worker_id, num_workers: this worker and W.
        rpc_timeout_s: how long a read may wait for the PS to apply the step.
    """

    def __init__(self, addresses, worker_id: int, num_workers: int, rpc_timeout_s: float):
        self.addresses, self.worker_id, self.num_workers = list(addresses), worker_id, num_workers
        self._timeout = rpc_timeout_s
        self._clients = None
        self._lock = threading.Lock()

    def _all_clients(self):
        from prophet_tf.ps.client import PSClient  # grpc stays out of module import
        with self._lock:
            if self._clients is None:
                self._clients = [PSClient(a, self.worker_id, self.num_workers)
                                 for a in self.addresses]
            return self._clients

    def close(self) -> None:
        for client in self._clients or ():
            client.close()

    @staticmethod
    def supports(optimizer) -> bool:
        """Keras 3 optimizers (tf_keras ones keep their own copy in saved files)."""
        from prophet_tf import _keras_compat
        return not _keras_compat.is_tf_keras_optimizer(optimizer) and hasattr(
            optimizer, "save_own_variables") and hasattr(optimizer, "_trainable_variables")

    def start(self, optimizer, trained: list, resume_step: int) -> None:
        """At Register: sends a resumed state (worker 0), then hooks the optimizer's saving."""
        if not self.supports(optimizer):
            _refuse_checkpoints_of_ps_state(optimizer)
            return
        keys = _keys(optimizer, trained)
        if resume_step and self.worker_id == 0:
            self.write(optimizer, keys, resume_step)
        original = optimizer.save_own_variables

        def save_own_variables(store):
            self.read(optimizer, keys)
            original(store)

        optimizer.save_own_variables = save_own_variables
        # tf.train.Checkpoint (custom training loops) lists the optimizer's
        # variables through _trackable_children before it reads them.
        children = optimizer._trackable_children

        def _trackable_children(save_type="checkpoint", **kwargs):
            if save_type == "checkpoint":
                self.read(optimizer, keys)
            return children(save_type, **kwargs)

        optimizer._trackable_children = _trackable_children

    def write(self, optimizer, keys: list, step: int) -> None:
        from prophet_tf.ps import optimizer_state
        messages = []
        for name, slots in optimizer_state.slot_lists(optimizer).items():
            for index, slot in enumerate(slots):
                if slot is None or keys[index] is None:
                    continue
                array = np.ascontiguousarray(slot.numpy())
                messages.append(optimizer_state.ps_pb2.OptimizerSlot(
                    worker_id=self.worker_id, key=keys[index], slot=name,
                    dtype=codec.dtype_name(array.dtype), shape=list(array.shape),
                    data=array.tobytes(), version=step))
        for client in self._all_clients():
            client.write_optimizer_state(messages, timeout=self._timeout)
        logger.info("Sent the optimizer's state of step %d (%d slots) to the PS tasks",
                    step, len(messages))

    def read(self, optimizer, keys: list) -> None:
        """Sets the worker's slots to the PS tasks' state of its current step."""
        from prophet_tf.ps import optimizer_state
        step = keras_optimizer.steps_taken(optimizer)
        slots = optimizer_state.slot_lists(optimizer)
        index_of = {key: i for i, key in enumerate(keys) if key is not None}
        values: dict[tuple[str, int], np.ndarray] = {}
        for client in self._all_clients():
            for message in client.read_optimizer_state(step, timeout=self._timeout):
                slot = slots[message.slot][index_of[message.key]]
                part = codec.from_bytes(message.data, message.dtype, tuple(message.shape))
                whole = values.get((message.slot, message.key))
                if whole is None:
                    whole = values[message.slot, message.key] = np.array(slot.numpy())
                if part.shape != whole.shape:  # elements [begin, begin + size) of it
                    whole.reshape(-1)[message.begin:message.begin + part.size] = part.reshape(-1)
                else:
                    whole[...] = part
        for (name, key), whole in values.items():
            slots[name][index_of[key]].assign(whole)
        # Not a slot: Nadam's u_product follows from the step count alone.
        per_iteration.set_after(optimizer, step)


def _keys(optimizer, trained: list) -> list:
    """The PS key (position in ``trained``) of each of the optimizer's variables; None for
    one that is not trained (its slots stay the worker's)."""
    keys = []
    for variable in optimizer._trainable_variables:
        inner = getattr(variable, "_value", variable)
        keys.append(next((k for k, t in enumerate(trained) if t is inner or t is variable),
                         None))
    return keys


def _refuse_checkpoints_of_ps_state(optimizer) -> None:
    """A tf_keras optimizer's trained slots live on the PS, which this worker cannot read
    into them: a tf.train.Checkpoint (save_weights in the TensorFlow format,
    BackupAndRestore) would save its untrained copy, so it is refused instead."""
    children = optimizer._trackable_children

    def _trackable_children(save_type="checkpoint", **kwargs):
        found = children(save_type, **kwargs)
        slots = [v for v in getattr(optimizer, "variables", [])
                 if v is not getattr(optimizer, "iterations", None)]
        if save_type == "checkpoint" and slots:
            raise ValueError(
                "A tf_keras optimizer's state is trained on the parameter server, and "
                "prophet_tf.Strategy can write it only into Keras 3 saves: this checkpoint "
                "would hold the worker's untrained copy. Use a Keras 3 model, or save the "
                "weights alone (model.save_weights('weights.h5')). Received: a "
                f"tf.train.Checkpoint of {type(optimizer).__module__}."
                f"{type(optimizer).__name__} with {len(slots)} state variables")
        return found

    optimizer._trackable_children = _trackable_children
