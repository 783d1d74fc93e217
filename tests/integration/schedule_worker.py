"""Worker for test_scheduling: a few steps of an MLP, then its weights to an .npz.

Usage: python schedule_worker.py OUT_PREFIX STEPS  (writes OUT_PREFIX.<worker>.npz)
The scheduler and the timeline come from the environment (prophet-tf launch
--scheduler; PROPHET_TF_TIMELINE).
"""
import os
import sys

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")

import keras  # noqa: E402
import numpy as np  # noqa: E402
import tensorflow as tf  # noqa: E402

import prophet_tf  # noqa: E402

GLOBAL_BATCH = 64


def main():
    out_prefix, steps = sys.argv[1], int(sys.argv[2])
    tf.config.threading.set_intra_op_parallelism_threads(1)
    tf.config.threading.set_inter_op_parallelism_threads(2)
    keras.utils.set_random_seed(0)
    strategy = prophet_tf.Strategy()
    with strategy.scope():
        model = keras.Sequential([keras.Input((32,))] + [
            keras.layers.Dense(units, activation="relu") for units in (64, 128, 256, 128)
        ] + [keras.layers.Dense(10)])
        model.compile(optimizer=keras.optimizers.Adam(1e-3),
                      loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True))
    rng = np.random.default_rng(0)
    x = rng.normal(size=(steps * GLOBAL_BATCH, 32)).astype("float32")
    y = rng.integers(0, 10, size=steps * GLOBAL_BATCH)
    model.fit(x, y, batch_size=GLOBAL_BATCH, epochs=1, shuffle=False, verbose=0)
    weights = model.get_weights()
    np.savez(f"{out_prefix}.{strategy.worker_index}.npz", scheduler=strategy.scheduler, *weights)


if __name__ == "__main__":
    main()
