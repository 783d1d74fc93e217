"""Worker for the overlap and scheduling tests: fits an MLP for a few steps.

Usage: python mlp_worker.py OUT_PREFIX STEPS [--inputs N] [--units A,B,...]
           [--batch GLOBAL] [--optimizer sgd|adam] [--backward-delay-ms MS] [--single]
Writes OUT_PREFIX.<worker>.npz: the final weights (arr_0...), the scheduler's
name, the variables' op-library keys in forward order, and with --stamps the
op-library stamps. With --single it trains the same model on the same data in
one process with plain Keras (the reference) and writes OUT_PREFIX.single.npz. The scheduler and the timeline come from the environment (prophet-tf
launch --scheduler; PROPHET_TF_TIMELINE).
"""
import argparse
import contextlib
import os
import time

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")

from prophet_tf.lean_keras import skip_keras_integrations  # noqa: E402

skip_keras_integrations()  # Keras' scikit-learn and plotting integrations: unused here

import keras  # noqa: E402
import numpy as np  # noqa: E402
import tensorflow as tf  # noqa: E402

import prophet_tf  # noqa: E402
from prophet_tf import _native  # noqa: E402
from prophet_tf.ps import client as client_lib  # noqa: E402

#: Iterations of which this worker's engine has begun a push (the timeline's
#: push starts just before the call); None: not noted (plain Keras).
PUSHES_BEGUN: set | None = None
#: Backward passes begun (the k-th is iteration k's).
BACKWARDS = [0]
#: How long a backward waits at most for its iteration's first push.
PUSH_WAIT_S = 20.0


def _note_pushes() -> None:
    global PUSHES_BEGUN
    PUSHES_BEGUN = set()
    push_future = client_lib.PSClient.push_future

    def noted(self, chunks, *args, **kwargs):
        PUSHES_BEGUN.update(c.step for c in chunks)
        return push_future(self, chunks, *args, **kwargs)

    client_lib.PSClient.push_future = noted


def _wait_backward(seconds: float) -> int:
    """Waits `seconds`, then until this iteration's first push has begun
    (at most PUSH_WAIT_S: a worker that pushes only after backprop then
    goes on, and the overlap test fails instead of hanging)."""
    iteration = BACKWARDS[0]
    BACKWARDS[0] += 1
    time.sleep(seconds)
    deadline = time.monotonic() + PUSH_WAIT_S
    while PUSHES_BEGUN is not None and iteration not in PUSHES_BEGUN and \
            time.monotonic() < deadline:
        time.sleep(0.001)
    return 0


class BackwardDelay(keras.layers.Layer):
    """Identity forward; its backward waits `seconds`, and then until the
    iteration's first push has begun, before passing the gradient on.

    Placed after the first layer, it makes the first layer's gradient ready
    at least `seconds` after all the others and after the first push began,
    whatever the machine's load.
    """

    def __init__(self, seconds: float, **kwargs):
        super().__init__(**kwargs)
        self.seconds = seconds

    def call(self, x):
        seconds = self.seconds

        @tf.custom_gradient
        def delayed(x):
            def grad(dy):
                slept = tf.py_function(lambda: _wait_backward(seconds), [], tf.int32)
                with tf.control_dependencies([slept]):
                    return tf.identity(dy)
            return tf.identity(x), grad

        return delayed(x)


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("out_prefix")
    parser.add_argument("steps", type=int)
    parser.add_argument("--inputs", type=int, default=32)
    parser.add_argument("--units", default="64,128,256,128", help="hidden layer widths")
    parser.add_argument("--batch", type=int, default=64, help="global batch")
    parser.add_argument("--optimizer", choices=["sgd", "adam"], default="adam")
    parser.add_argument("--backward-delay-ms", type=float, default=0.0,
                        help="the first layer's gradient becomes ready this much later, "
                             "and once the iteration's first push has begun")
    parser.add_argument("--single", action="store_true",
                        help="plain single-process Keras: the reference weights")
    parser.add_argument("--stamps", action="store_true",
                        help="save (and so take) the stamps; the timeline then has none")
    args = parser.parse_args()
    tf.config.threading.set_intra_op_parallelism_threads(1)
    tf.config.threading.set_inter_op_parallelism_threads(2)
    keras.utils.set_random_seed(0)
    if args.backward_delay_ms and not args.single:
        _note_pushes()
    strategy = None if args.single else prophet_tf.Strategy()
    with strategy.scope() if strategy else contextlib.nullcontext():
        layers = [keras.layers.Dense(int(units), activation="relu")
                  for units in args.units.split(",")] + [keras.layers.Dense(10)]
        if args.backward_delay_ms:
            layers.insert(1, BackwardDelay(args.backward_delay_ms / 1000))
        model = keras.Sequential([keras.Input((args.inputs,))] + layers)
        optimizer = (keras.optimizers.SGD(0.01) if args.optimizer == "sgd"
                     else keras.optimizers.Adam(1e-3))
        model.compile(optimizer=optimizer,
                      loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True))
    rng = np.random.default_rng(0)
    x = rng.normal(size=(args.steps * args.batch, args.inputs)).astype("float32")
    y = rng.integers(0, 10, size=args.steps * args.batch)
    model.fit(x, y, batch_size=args.batch, epochs=1, shuffle=False, verbose=0)
    weights = model.get_weights()  # Waits for the last step's parameters.
    if strategy is None:
        np.savez(f"{args.out_prefix}.single.npz", *weights)
        return
    keys = [v.value.native_key for v in model.trainable_variables]  # Forward order.
    extra = {"stamps": _native.drain_stamps()} if args.stamps else {}
    np.savez(f"{args.out_prefix}.{strategy.worker_index}.npz", *weights,
             scheduler=strategy.scheduler, keys=np.array(keys), **extra)


if __name__ == "__main__":
    main()
