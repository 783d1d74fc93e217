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

import keras  # noqa: E402
import numpy as np  # noqa: E402
import tensorflow as tf  # noqa: E402

import prophet_tf  # noqa: E402
from prophet_tf import _native  # noqa: E402


class BackwardDelay(keras.layers.Layer):
    """Identity forward; its backward waits `seconds` before passing the gradient on.

    Placed after the first layer, it makes the first layer's gradient ready a
    known time after all the others, whatever the machine's load.
    """

    def __init__(self, seconds: float, **kwargs):
        super().__init__(**kwargs)
        self.seconds = seconds

    def call(self, x):
        seconds = self.seconds

        @tf.custom_gradient
        def delayed(x):
            def grad(dy):
                slept = tf.py_function(lambda: time.sleep(seconds) or 0, [], tf.int32)
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
                        help="the first layer's gradient becomes ready this much later")
    parser.add_argument("--single", action="store_true",
                        help="plain single-process Keras: the reference weights")
    parser.add_argument("--stamps", action="store_true",
                        help="save (and so take) the stamps; the timeline then has none")
    args = parser.parse_args()
    tf.config.threading.set_intra_op_parallelism_threads(1)
    tf.config.threading.set_inter_op_parallelism_threads(2)
    keras.utils.set_random_seed(0)
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
