"""A functional model with BatchNormalization, trained with Keras callbacks.

    prophet-tf launch --workers 2 --ps 1 -- python examples/functional_callbacks.py --out runs/

Callbacks, each writing under OUT/worker-<i>/ (workers share no file):

- ModelCheckpoint: the best model so far (by validation loss), `best.keras`;
- TensorBoard: logs in `tensorboard/` (`tensorboard --logdir OUT`); it needs
  the `tensorboard` package, which tensorflow-cpu does not bring and
  `pip install prophet_tf[examples]` (or `make`) installs;
- EarlyStopping: stops when the validation loss stops improving. Keep the
  default `restore_best_weights=False`: restoring assigns the weights after
  training started, which prophet_tf rejects (NotImplementedError); load
  `best.keras` instead. Every worker sees the same whole-data validation
  loss, so all stop at the same epoch;
- BackupAndRestore: a backup in `backup/` at every epoch end, deleted when
  fit ends; after a crash, `prophet-tf launch --restart K` starts the
  cluster again and every worker resumes from its last backed-up epoch.
  `--crash-in-epoch N` makes worker 0 crash once in epoch N to show it:

      prophet-tf launch --workers 2 --ps 1 --restart 1 -- \
          python examples/functional_callbacks.py --out runs/ --crash-in-epoch 3

  The PS tasks restart empty: the weights and the optimizer's state (Adam's
  moments, read from the PS when the backup was written) come back from the
  backups, and every worker restores the same epoch.

Metrics, and so the callbacks' decisions, are over the whole data and the
same on every worker, as in single-process Keras.
"""
import argparse
import importlib.util
import os
import sys
import tempfile

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")

import keras  # noqa: E402
import numpy as np  # noqa: E402
from sklearn.datasets import load_digits  # noqa: E402

import prophet_tf  # noqa: E402
from prophet_tf import progress  # noqa: E402


def build_model():
    inputs = keras.Input((64,), name="pixels")
    x = keras.layers.Dense(64, use_bias=False)(inputs)
    x = keras.layers.BatchNormalization()(x)
    x = keras.layers.Activation("relu")(x)
    x = keras.layers.Dropout(0.1)(x)
    outputs = keras.layers.Dense(10, activation="softmax", name="digit")(x)
    return keras.Model(inputs, outputs, name="digits_functional")


class CrashOnce(keras.callbacks.Callback):
    """Exits the process in epoch `epoch` (1-based), once (a marker file remembers).

    It crashes after the epoch's second step: that step's forward needed every
    worker's first step of the epoch, so every worker has finished the
    previous epoch and its backup, and all resume from the same epoch.
    """

    def __init__(self, epoch: int, marker: str):
        super().__init__()
        self.epoch, self.marker = epoch, marker
        self._current = 0

    def on_epoch_begin(self, epoch, logs=None):
        self._current = epoch + 1

    def on_train_batch_end(self, batch, logs=None):
        if self._current == self.epoch and batch == 1 and not os.path.exists(self.marker):
            open(self.marker, "w").close()
            print(f"crashing on purpose in epoch {self.epoch}", flush=True)
            os._exit(3)  # Like a killed process: no clean shutdown.


def main():
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--out", default=None,
                        help="directory for checkpoints, logs and backups (default: a new "
                             "temporary directory)")
    parser.add_argument("--epochs", type=int, default=10)
    parser.add_argument("--batch", type=int, default=64, help="global batch size")
    parser.add_argument("--patience", type=int, default=3, help="EarlyStopping patience")
    parser.add_argument("--crash-in-epoch", type=int, default=0, metavar="N",
                        help="worker 0 exits with code 3 in epoch N, once (to try --restart)")
    args = parser.parse_args()
    out = args.out or tempfile.mkdtemp(prefix="prophet-tf-callbacks-")

    digits = load_digits()
    x = (digits.data / 16.0).astype("float32")
    y = digits.target.astype("int64")
    order = np.random.default_rng(0).permutation(len(x))
    x, y = x[order], y[order]
    n = len(x)
    x_train, y_train = x[:int(0.7 * n)], y[:int(0.7 * n)]
    x_val, y_val = x[int(0.7 * n):int(0.85 * n)], y[int(0.7 * n):int(0.85 * n)]
    x_test, y_test = x[int(0.85 * n):], y[int(0.85 * n):]

    keras.utils.set_random_seed(0)
    strategy = prophet_tf.Strategy()
    with strategy.scope():
        model = build_model()
        model.compile(optimizer=keras.optimizers.Adam(3e-3),
                      loss="sparse_categorical_crossentropy", metrics=["accuracy"])
    who = f"worker {strategy.worker_index}"
    mine = os.path.join(out, f"worker-{strategy.worker_index}")
    os.makedirs(mine, exist_ok=True)
    checkpoint = os.path.join(mine, "best.keras")
    early = keras.callbacks.EarlyStopping(monitor="val_loss", patience=args.patience)
    callbacks = [
        keras.callbacks.ModelCheckpoint(checkpoint, monitor="val_loss", save_best_only=True),
        early,
        keras.callbacks.BackupAndRestore(backup_dir=os.path.join(mine, "backup")),
        progress.keras_callback(),
    ]
    # Keras' TensorBoard callback writes through the `tensorboard` package,
    # which tensorflow-cpu does not install (pip install tensorboard).
    if importlib.util.find_spec("tensorboard") is not None:
        callbacks.append(keras.callbacks.TensorBoard(log_dir=os.path.join(mine, "tensorboard")))
    else:
        print(f"{who}: the tensorboard package is not installed: no TensorBoard callback",
              flush=True)
    if args.crash_in_epoch and strategy.worker_index == 0:
        callbacks.append(CrashOnce(args.crash_in_epoch, os.path.join(out, "crashed-once")))
    history = model.fit(x_train, y_train, batch_size=args.batch, epochs=args.epochs,
                        validation_data=(x_val, y_val), callbacks=callbacks, verbose=0)
    epochs = history.epoch
    print(f"{who}: trained epochs {epochs[0] + 1}..{epochs[-1] + 1}; val_loss "
          + " ".join(f"{v:.4f}" for v in history.history["val_loss"]), flush=True)
    if early.stopped_epoch:
        print(f"{who}: EarlyStopping stopped after epoch {early.stopped_epoch + 1}", flush=True)
    # Whole test set, the same on every worker (the BatchNormalization moving
    # statistics are the workers' mean; evaluate sums what the workers count).
    _, accuracy = model.evaluate(x_test, y_test, batch_size=args.batch, verbose=0)
    best = keras.models.load_model(checkpoint)  # A plain Keras model, no strategy needed.
    best_accuracy = float(np.mean(np.argmax(best(x_test), axis=-1) == y_test))
    logs = sum(len(files) for _, _, files in os.walk(os.path.join(mine, "tensorboard")))
    print(f"{who}: test accuracy {accuracy:.4f}; best checkpoint {checkpoint}: "
          f"{best_accuracy:.4f}; TensorBoard files {logs}; backup left: "
          f"{os.path.exists(os.path.join(mine, 'backup'))}", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
