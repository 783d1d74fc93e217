"""Worker for test_device: keras_worker's training on a chosen compute device.

    python device_worker.py --logical-cpus 2 --device /cpu:1 --model cnn --out DIR

Before TensorFlow starts, the host CPU is split into `--logical-cpus` logical
devices (CPU:0, CPU:1, ...) and TensorFlow is told to log where it places
every op (to stderr, through its own logging: run with TF_CPP_MIN_LOG_LEVEL=0).
Then it builds, fits, evaluates and predicts with keras_worker's model, data
and optimizer code under `prophet_tf.Strategy(device=--device)`, and writes
DIR/worker<i>.npz (as keras_worker) and DIR/worker<i>.json with the
strategy's compute device and the devices TensorFlow gives the variables.
"""
from __future__ import annotations

import argparse
import faulthandler
import os
import sys

from prophet_tf.lean_keras import skip_keras_integrations  # noqa: E402

skip_keras_integrations()  # Keras' scikit-learn and plotting integrations: unused here

import tensorflow as tf  # noqa: E402

import keras_worker as kw  # noqa: E402


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--logical-cpus", type=int, default=2)
    parser.add_argument("--device", default=None, help="Strategy(device=...); unset: None")
    parser.add_argument("--model", choices=["mlp", "cnn", "bn"], default="cnn")
    parser.add_argument("--optimizer", default="adam")
    parser.add_argument("--data", default="numpy")
    parser.add_argument("--steps", type=int, default=6)
    parser.add_argument("--batch", type=int, default=4, help="per-worker batch")
    parser.add_argument("--watchdog", type=float, default=0.0)
    parser.add_argument("--out", required=True)
    args = parser.parse_args(argv)
    if args.watchdog > 0:
        faulthandler.dump_traceback_later(args.watchdog, exit=True)
    (cpu,) = tf.config.list_physical_devices("CPU")
    tf.config.set_logical_device_configuration(
        cpu, [tf.config.LogicalDeviceConfiguration() for _ in range(args.logical_cpus)])
    tf.debugging.set_log_device_placement(True)
    kw.limit_threads()
    kw.select_keras("keras3")
    os.makedirs(args.out, exist_ok=True)

    import prophet_tf
    strategy = prophet_tf.Strategy(device=args.device)
    global_batch = args.batch * strategy.num_replicas_in_sync
    # What scenario_train needs of keras_worker's command line.
    train_args = argparse.Namespace(model=args.model, optimizer=args.optimizer, data=args.data,
                                    steps=args.steps, epochs=1, batch=args.batch,
                                    lr_callback=False)
    with strategy.scope():
        model = kw.build_model(args.model)
        kw.compile_model(model, args.optimizer)
    info = kw.train(model, train_args, global_batch)
    info.update(kw._collect(model, strategy, train_args, global_batch, args.out))
    info["compute_device"] = strategy.extended.worker_devices[0]
    # The variables' devices as TensorFlow reports their handles'.
    info["variable_devices"] = {
        "trainable": [v.value.device for v in model.trainable_variables],
        "non_trainable": [v.value.device for v in model.non_trainable_variables],
        "metrics": [v.value.device for m in model.metrics for v in m.variables],
        "optimizer": [v.value.device for v in model.optimizer.variables],
    }
    kw.write_json(args.out, strategy.worker_index, info)
    print(f"worker {strategy.worker_index}: done on {info['compute_device']}", flush=True)
    strategy.shutdown()
    faulthandler.cancel_dump_traceback_later()
    return 0


if __name__ == "__main__":
    sys.exit(main())
