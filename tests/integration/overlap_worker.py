"""Worker for test_overlap: trains a 7-layer MLP and saves the op-library stamps.

Usage: python overlap_worker.py OUT_PREFIX STEPS  (writes OUT_PREFIX.<worker>.npz)
"""
import os
import sys

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")

import keras  # noqa: E402
import numpy as np  # noqa: E402
import tensorflow as tf  # noqa: E402

import prophet_tf  # noqa: E402
from prophet_tf import _native  # noqa: E402

GLOBAL_BATCH = 1024  # Enough backprop per step for the engine to act within it.


def main():
    out_prefix, steps = sys.argv[1], int(sys.argv[2])
    tf.config.threading.set_intra_op_parallelism_threads(1)
    tf.config.threading.set_inter_op_parallelism_threads(2)
    keras.utils.set_random_seed(0)
    strategy = prophet_tf.Strategy()
    with strategy.scope():
        # Small first layer, large later layers: layer 0's parameters arrive
        # long before the last ones when they are pulled in priority order.
        model = keras.Sequential([keras.Input((64,))] + [
            keras.layers.Dense(units, activation="relu") for units in (64, 256, 512, 512, 512, 512)
        ] + [keras.layers.Dense(10)])
        model.compile(optimizer=keras.optimizers.SGD(0.01),
                      loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True))
    rng = np.random.default_rng(0)
    x = rng.normal(size=(steps * GLOBAL_BATCH, 64)).astype("float32")
    y = rng.integers(0, 10, size=steps * GLOBAL_BATCH)
    model.fit(x, y, batch_size=GLOBAL_BATCH, epochs=1, shuffle=False, verbose=0)
    model.get_weights()  # Waits for the last step's parameters.
    keys = [v.value.ps_key for v in model.trainable_variables]  # Forward order.
    np.savez(f"{out_prefix}.{strategy.worker_index}.npz", stamps=_native.drain_stamps(),
             keys=np.array(keys))


if __name__ == "__main__":
    main()
