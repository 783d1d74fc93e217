"""The end-of-fit SIGSEGV without prophet_tf: Keras 3 under TensorFlow's own OneDeviceStrategy.

    ulimit -c unlimited
    TF_NUM_INTRAOP_THREADS=1 TF_NUM_INTEROP_THREADS=1 python tests/reproductions/keras_one_device_strategy_segv.py 60

Each cycle is fit (one epoch of numpy data) -> evaluate -> predict, as at the end
of the quickstart. With TensorFlow 2.21 on the 2-core development machine, with
a busy-looping process beside it, each of 5 runs died with SIGSEGV, in
cycles 2, 12, 14, 19 and 39, in `evaluate` (EpochIterator.reset). The core
dump's crashing thread:

    #4  0x0000000000000001 in ?? ()
    #5  tensorflow::data::DatasetBaseIterator::GetNext(...)
    #6  tensorflow::data::MultiDeviceIterator::MultiDeviceBuffer::BackgroundThread(...)
    #8  tensorflow::data::WorkQueueFunc(...)
    #10 tsl::UnboundedWorkQueue::PooledThreadFunc()

the same backtrace as the prophet_tf workers that died there. prophet_tf.Strategy
therefore hands Keras plain tf.data datasets (README "How it works", "Input");
tests/integration/test_strategy.py and test_examples.py keep the regression
tests. Not collected by pytest: it is expected to crash.
"""
import faulthandler
import os
import sys
import time

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")

import keras  # noqa: E402
import numpy as np  # noqa: E402
import tensorflow as tf  # noqa: E402


def main(cycles: int) -> None:
    faulthandler.enable()
    rng = np.random.default_rng(0)
    x = rng.random((1437, 64), dtype=np.float32)
    y = rng.integers(0, 10, len(x))
    strategy = tf.distribute.OneDeviceStrategy("/cpu:0")
    with strategy.scope():
        model = keras.Sequential([keras.Input((64,)), keras.layers.Dense(128, activation="relu"),
                                  keras.layers.Dropout(0.2), keras.layers.Dense(10)])
        model.compile("adam", keras.losses.SparseCategoricalCrossentropy(from_logits=True),
                      metrics=["accuracy"])
    start = time.monotonic()
    for cycle in range(cycles):
        model.fit(x, y, batch_size=64, epochs=1, verbose=0)
        model.evaluate(x[:360], y[:360], batch_size=64, verbose=0)
        model.predict(x[:100], batch_size=64, verbose=0)
        print(f"cycle {cycle + 1}: {time.monotonic() - start:.1f} s", flush=True)
    print(f"survived {cycles} fit/evaluate/predict cycles")


if __name__ == "__main__":
    main(int(sys.argv[1]) if len(sys.argv) > 1 else 60)
