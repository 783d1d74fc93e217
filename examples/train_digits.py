"""Trains a small CNN on scikit-learn's digits (shipped offline) with prophet_tf.

Under a cluster (TF_CONFIG set, e.g. by `prophet-tf launch`):

    prophet-tf launch --workers 2 --ps 1 -- python examples/train_digits.py

Alone, for comparison, as plain single-process Keras at the same global batch:

    python examples/train_digits.py --single
"""
import argparse
import os

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")

import keras  # noqa: E402
import numpy as np  # noqa: E402
import tensorflow as tf  # noqa: E402
from sklearn.datasets import load_digits  # noqa: E402

GLOBAL_BATCH = 64


def load_data():
    digits = load_digits()
    x = (digits.images[..., None] / 16.0).astype("float32")
    y = digits.target.astype("int64")
    order = np.random.default_rng(0).permutation(len(x))  # Fixed split on every worker.
    x, y = x[order], y[order]
    cut = int(0.8 * len(x))
    return (x[:cut], y[:cut]), (x[cut:], y[cut:])


def build_model():
    model = keras.Sequential([
        keras.Input((8, 8, 1)),
        keras.layers.Conv2D(32, 3, padding="same", activation="relu"),
        keras.layers.Conv2D(64, 3, padding="same", activation="relu"),
        keras.layers.MaxPooling2D(),
        keras.layers.Flatten(),
        keras.layers.Dense(128, activation="relu"),
        keras.layers.Dense(10, activation="softmax"),
    ])
    model.compile(optimizer=keras.optimizers.Adam(2e-3),
                  loss="sparse_categorical_crossentropy", metrics=["accuracy"])
    return model


def main():
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--single", action="store_true", help="plain Keras, no cluster")
    parser.add_argument("--epochs", type=int, default=8)
    args = parser.parse_args()
    # The same seed on every worker: the same initial weights and shuffles,
    # so each global batch is split between the workers.
    keras.utils.set_random_seed(0)
    tf.config.threading.set_intra_op_parallelism_threads(1)
    tf.config.threading.set_inter_op_parallelism_threads(2)
    (x_train, y_train), (x_test, y_test) = load_data()

    if args.single:
        model = build_model()
        who = "single process"
    else:
        import prophet_tf
        strategy = prophet_tf.Strategy()
        with strategy.scope():
            model = build_model()
        who = f"worker {strategy.worker_index} of {strategy.num_replicas_in_sync}"
    print(f"{who}: {model.count_params()} parameters, global batch {GLOBAL_BATCH}", flush=True)
    history = model.fit(x_train, y_train, batch_size=GLOBAL_BATCH, epochs=args.epochs,
                        verbose=0, shuffle=True)
    for epoch, (loss, acc) in enumerate(zip(history.history["loss"],
                                            history.history["accuracy"]), 1):
        print(f"{who}: epoch {epoch}: loss {loss:.4f} accuracy {acc:.4f}", flush=True)
    # evaluate() and predict() give Keras' answers on every worker: the
    # whole test set, every row in order.
    _, test_acc = model.evaluate(x_test, y_test, batch_size=GLOBAL_BATCH, verbose=0)
    predicted = np.argmax(model.predict(x_test, batch_size=GLOBAL_BATCH, verbose=0), axis=-1)
    print(f"{who}: whole test set ({len(x_test)} images): accuracy {test_acc:.4f} "
          f"(predict: {np.mean(predicted == y_test):.4f})", flush=True)


if __name__ == "__main__":
    main()
