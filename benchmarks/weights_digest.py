"""The sha256 of a fixed prophet_tf run's final weights: for checking that a
change leaves training bit-identical (run it before and after, back to back).

    prophet-tf launch --workers 2 --ps 2 -- python benchmarks/weights_digest.py OUT

The digits CNN of examples/train_digits.py, Adam, 2 epochs at its global batch;
worker 0 writes the digest of ``model.get_weights()`` to OUT.
"""
import hashlib
import json
import os
import pathlib
import sys

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")
sys.path.insert(0, str(pathlib.Path(__file__).resolve().parents[1] / "examples"))

import keras  # noqa: E402
import numpy as np  # noqa: E402
import tensorflow as tf  # noqa: E402

import prophet_tf  # noqa: E402
import train_digits  # noqa: E402


def main() -> None:
    keras.utils.set_random_seed(0)
    tf.config.threading.set_intra_op_parallelism_threads(1)
    (x, y), _ = train_digits.load_data()
    with prophet_tf.Strategy().scope():
        model = train_digits.build_model()
    model.fit(x, y, batch_size=train_digits.GLOBAL_BATCH, epochs=2, verbose=0, shuffle=True)
    digest = hashlib.sha256()
    for w in model.get_weights():
        digest.update(np.ascontiguousarray(w).tobytes())
    if json.loads(os.environ["TF_CONFIG"])["task"]["index"] == 0:
        pathlib.Path(sys.argv[1]).write_text(digest.hexdigest() + "\n")


if __name__ == "__main__":
    main()
