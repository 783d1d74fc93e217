"""Worker for the mixed-precision tests: fits a small model under a Keras dtype policy.

Usage: python precision_worker.py OUT_PREFIX STEPS --policy P [--overflow-step K]
           [--growth-steps G] [--optimizer adam|sgd]
Writes OUT_PREFIX.<worker>.npz: the final weights (arr_0...) and, under loss
scaling, the loss scale and the optimizer's iteration count. `single_process`
returns the same for plain single-process Keras on the same model, data and
global batch, in the caller's process.

With --overflow-step K, the last row of global batch K carries a mark that
makes its backward pass non-finite: under prophet_tf.Strategy that row is in
the last worker's share only, so one worker overflows and the others do not.
"""
import argparse
import os

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")

from prophet_tf.lean_keras import skip_keras_integrations  # noqa: E402

skip_keras_integrations()  # Keras' scikit-learn and plotting integrations: unused here

import keras  # noqa: E402
import numpy as np  # noqa: E402
import tensorflow as tf  # noqa: E402

import prophet_tf  # noqa: E402

MARK = 777.0  # feature 0 of the row whose backward overflows
GLOBAL_BATCH = 32


class OverflowOnMark(keras.layers.Layer):
    """Identity forward; the backward of a marked row is infinite."""

    def call(self, inputs):
        hidden, x = inputs
        marked = tf.equal(x[:, :1], MARK)

        @tf.custom_gradient
        def identity(h):
            def grad(dy):
                return tf.where(marked, tf.cast(np.inf, dy.dtype), dy)
            return tf.identity(h), grad

        return identity(hidden)


def build(policy: str, optimizer: str, growth_steps: int):
    """The compiled model under `policy`, which the caller has set, and the seed too;
    mixed_float16 wraps the optimizer in a LossScaleOptimizer."""
    x_in = keras.Input((16,))
    hidden = keras.layers.Dense(32, activation="relu")(x_in)
    hidden = OverflowOnMark()([hidden, x_in])
    out = keras.layers.Dense(10, dtype="float32")(keras.layers.Dense(24)(hidden))
    model = keras.Model(x_in, out)
    optimizer = (keras.optimizers.Adam(1e-2) if optimizer == "adam"
                 else keras.optimizers.SGD(0.1))
    if policy == "mixed_float16":
        optimizer = keras.optimizers.LossScaleOptimizer(optimizer,
                                                        dynamic_growth_steps=growth_steps)
    model.compile(optimizer=optimizer,
                  loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True))
    return model


def fit(model, steps: int, overflow_step: int) -> dict:
    """Fits `steps` global batches; the final weights (arr_0...) and, under loss
    scaling, the loss scale and the iteration count, as the .npz holds them."""
    rng = np.random.default_rng(0)
    x = rng.normal(size=(steps * GLOBAL_BATCH, 16)).astype("float32")
    y = rng.integers(0, 10, size=steps * GLOBAL_BATCH)
    if overflow_step >= 0:
        x[(overflow_step + 1) * GLOBAL_BATCH - 1, 0] = MARK
    model.fit(x, y, batch_size=GLOBAL_BATCH, epochs=1, shuffle=False, verbose=0)
    weights = model.get_weights()  # Waits for the last step's parameters.
    result = {f"arr_{k}": w for k, w in enumerate(weights)}
    if isinstance(model.optimizer, keras.optimizers.LossScaleOptimizer):
        result.update(scale=float(model.optimizer.dynamic_scale.numpy()),
                      iterations=int(model.optimizer.iterations.numpy()))
    return result


def single_process(steps: int, policy: str, overflow_step: int = -1, growth_steps: int = 3,
                   optimizer: str = "adam") -> dict:
    """What a worker writes, from plain single-process Keras on the global batch, in
    this process (the caller's dtype policy is restored afterwards)."""
    previous = keras.mixed_precision.dtype_policy()
    keras.utils.set_random_seed(0)
    keras.mixed_precision.set_dtype_policy(policy)
    try:
        return fit(build(policy, optimizer, growth_steps), steps, overflow_step)
    finally:
        keras.mixed_precision.set_dtype_policy(previous)


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("out_prefix")
    parser.add_argument("steps", type=int)
    parser.add_argument("--policy", required=True)
    parser.add_argument("--overflow-step", type=int, default=-1)
    parser.add_argument("--growth-steps", type=int, default=3)
    parser.add_argument("--optimizer", choices=["adam", "sgd"], default="adam")
    parser.add_argument("--custom-loop", action="store_true",
                        help="apply the LossScaleOptimizer in a tf.function of its own")
    args = parser.parse_args()
    tf.config.threading.set_intra_op_parallelism_threads(1)
    keras.utils.set_random_seed(0)
    keras.mixed_precision.set_dtype_policy(args.policy)
    strategy = prophet_tf.Strategy()
    with strategy.scope():
        model = build(args.policy, args.optimizer, args.growth_steps)
    if args.custom_loop:
        return custom_loop(strategy, model, model.optimizer)
    result = fit(model, args.steps, args.overflow_step)
    np.savez(f"{args.out_prefix}.{strategy.worker_index}.npz", **result)


def custom_loop(strategy, model, optimizer):
    """One step of a loop that calls the optimizer's own apply (refused under the strategy)."""
    @tf.function
    def step(x):
        def replica_step(x):
            with tf.GradientTape() as tape:
                loss = optimizer.scale_loss(tf.reduce_mean(tf.cast(model(x), tf.float32) ** 2))
            optimizer.apply(tape.gradient(loss, model.trainable_variables),
                            model.trainable_variables)
        strategy.run(replica_step, args=(x,))
    step(tf.ones((2, 16)))


if __name__ == "__main__":
    main()
