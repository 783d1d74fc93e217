"""Worker for the failure and checkpoint tests: fits a small MLP, maybe dies.

Usage: python resilience_worker.py OUT_PREFIX [--epochs E] [--steps-per-epoch S]
           [--backup DIR] [--die-worker I --die-at STEP [--die-once MARKER]]
           [--progress FILE] [--step-delay SECONDS]

Trains deterministically (fixed data order, seeded initial values, Adam), so
an interrupted and resumed run must end with the weights of an uninterrupted
one. Worker I SIGKILLs itself when it finishes step STEP (with --die-once only
while MARKER does not exist, which it creates first). --progress rewrites FILE
with the number of finished steps after each one. Writes the final weights to
OUT_PREFIX.<worker>.npz. `reference` computes that run's weights in one process.
"""
import argparse
import functools
import os
import signal
import time

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")

from prophet_tf.lean_keras import skip_keras_integrations  # noqa: E402

skip_keras_integrations()  # Keras' scikit-learn and plotting integrations: unused here

import keras  # noqa: E402
import numpy as np  # noqa: E402
import tensorflow as tf  # noqa: E402

BATCH = 16  # global
INPUTS = 12


def build():
    """The compiled model, with the seeded initial values of every run."""
    keras.utils.set_random_seed(0)
    model = keras.Sequential([keras.Input((INPUTS,)),
                              keras.layers.Dense(16, activation="relu"),
                              keras.layers.Dense(3)])
    model.compile(optimizer=keras.optimizers.Adam(0.01),
                  loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True))
    return model


def data(steps_per_epoch: int):
    rng = np.random.default_rng(0)
    n = steps_per_epoch * BATCH
    return rng.normal(size=(n, INPUTS)).astype("float32"), rng.integers(0, 3, size=n)


def reference(epochs: int, steps_per_epoch: int, workers: int) -> list[np.ndarray]:
    """The final weights of an uninterrupted run on `workers` workers, in this process,
    with the cluster's arithmetic, so to the bit: each step, every worker's equal share of
    the batch gives the gradient of its mean loss times 1/W (Keras under a strategy), the
    PS sums them in worker order and applies Adam. (A plain fit on the global batch
    rounds differently, by up to half this test's tolerance.)"""
    assert BATCH % workers == 0, "equal shares only"
    model, share = build(), BATCH // workers
    x, y = data(steps_per_epoch)

    @tf.function
    def gradients(x, y):
        with tf.GradientTape() as tape:
            loss = model.compute_loss(x=x, y=y, y_pred=model(x, training=True))
            loss = keras.ops.multiply(loss, keras.ops.cast(1.0 / workers, loss.dtype))
        return tape.gradient(loss, model.trainable_variables)

    model.optimizer.build(model.trainable_variables)
    for _ in range(epochs):
        for begin in range(0, len(x), BATCH):
            shares = [gradients(x[b:b + share], y[b:b + share])
                      for b in range(begin, begin + BATCH, share)]
            total = [functools.reduce(np.add, [g.numpy() for g in per_worker])
                     for per_worker in zip(*shares)]
            model.optimizer.apply(total, model.trainable_variables)
    return model.get_weights()


class _Steps(keras.callbacks.Callback):
    def __init__(self, args, worker):
        super().__init__()
        self.args, self.worker = args, worker

    def on_train_batch_end(self, batch, logs=None):
        step = int(self.model.optimizer.iterations.numpy())  # steps finished, all epochs
        if self.args.progress:
            tmp = f"{self.args.progress}.tmp{os.getpid()}"  # workers share the file
            with open(tmp, "w") as f:
                f.write(str(step))
            os.replace(tmp, self.args.progress)
        if self.worker == self.args.die_worker and step == self.args.die_at:
            if self.args.die_once:
                if os.path.exists(self.args.die_once):
                    return
                open(self.args.die_once, "w").close()
            print(f"worker {self.worker}: dying at step {step}", flush=True)
            os.kill(os.getpid(), signal.SIGKILL)
        if self.args.step_delay:
            time.sleep(self.args.step_delay)


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("out_prefix")
    parser.add_argument("--epochs", type=int, default=4)
    parser.add_argument("--steps-per-epoch", type=int, default=5)
    parser.add_argument("--backup", default=None, help="BackupAndRestore directory")
    parser.add_argument("--die-worker", type=int, default=-1)
    parser.add_argument("--die-at", type=int, default=-1)
    parser.add_argument("--die-once", default=None)
    parser.add_argument("--progress", default=None)
    parser.add_argument("--step-delay", type=float, default=0.0)
    args = parser.parse_args()
    tf.config.threading.set_intra_op_parallelism_threads(1)
    tf.config.threading.set_inter_op_parallelism_threads(1)
    import prophet_tf  # Only here: the test imports this module for `reference`.

    strategy = prophet_tf.Strategy()
    worker = strategy.worker_index
    with strategy.scope():
        model = build()
    x, y = data(args.steps_per_epoch)
    callbacks = [_Steps(args, worker)]
    if args.backup:
        callbacks.insert(0, keras.callbacks.BackupAndRestore(
            os.path.join(args.backup, f"worker-{worker}")))
    model.fit(x, y, batch_size=BATCH, epochs=args.epochs, shuffle=False, verbose=0,
              callbacks=callbacks)
    np.savez(f"{args.out_prefix}.{worker}.npz", *model.get_weights())
    print(f"worker {worker}: done after {int(model.optimizer.iterations.numpy())} steps",
          flush=True)


if __name__ == "__main__":
    main()
