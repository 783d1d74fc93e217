"""The Keras quickstart under prophet_tf: a small Sequential classifier on digits.

The classifier of the Keras/TensorFlow beginner quickstart (Dense 128, Dropout,
Dense 10) on scikit-learn's 8x8 digits (shipped offline), trained on every
worker of the cluster:

    prophet-tf launch --workers 2 --ps 1 -- python examples/quickstart.py

Every worker runs this same script; `prophet-tf launch` gives each its
TF_CONFIG. Only three lines differ from single-process Keras: making the
strategy, building and compiling under its scope, and giving `fit` the global
batch.
"""
import argparse
import os

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")

import keras  # noqa: E402
import numpy as np  # noqa: E402
from sklearn.datasets import load_digits  # noqa: E402

import prophet_tf  # noqa: E402
from prophet_tf import progress  # noqa: E402


def main():
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--epochs", type=int, default=10)
    parser.add_argument("--batch", type=int, default=64, help="global batch size")
    args = parser.parse_args()

    digits = load_digits()
    x = (digits.data / 16.0).astype("float32")  # 64 pixels in [0, 1]
    y = digits.target.astype("int64")
    order = np.random.default_rng(0).permutation(len(x))  # The same split on every worker.
    x, y = x[order], y[order]
    cut = int(0.8 * len(x))
    (x_train, y_train), (x_test, y_test) = (x[:cut], y[:cut]), (x[cut:], y[cut:])

    keras.utils.set_random_seed(0)  # Same initial weights and shuffles on every worker.
    strategy = prophet_tf.Strategy()  # The cluster comes from TF_CONFIG.
    with strategy.scope():
        model = keras.Sequential([
            keras.Input((64,)),
            keras.layers.Dense(128, activation="relu"),
            keras.layers.Dropout(0.2),
            keras.layers.Dense(10),
        ])
        model.compile(optimizer="adam",
                      loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True),
                      metrics=["accuracy"])
    who = f"worker {strategy.worker_index} of {strategy.num_replicas_in_sync}"
    # keras_callback() shows the epoch in `prophet-tf launch`'s progress lines.
    model.fit(x_train, y_train, batch_size=args.batch, epochs=args.epochs, verbose=0,
              callbacks=[progress.keras_callback()])
    # evaluate() and predict() cover the whole test set on every worker.
    _, accuracy = model.evaluate(x_test, y_test, batch_size=args.batch, verbose=0)
    predicted = np.argmax(model.predict(x_test, batch_size=args.batch, verbose=0), axis=-1)
    print(f"{who}: test accuracy {accuracy:.4f} ({len(x_test)} images; "
          f"predict: {np.mean(predicted == y_test):.4f})", flush=True)


if __name__ == "__main__":
    main()
