"""Worker for test_distributed_input: the tf.distribute input and custom-loop idioms in order.

    python input_worker.py --out DIR          # under `prophet-tf launch`: prophet_tf.Strategy
    python input_worker.py --single --out DIR # the same program on the default strategy

One model and one Adam optimizer go through, in this order:
  1. fit on strategy.experimental_distribute_dataset(batches of GLOBAL_BATCH) over
     ROWS rows (a last partial batch; with 3 workers, shares of 2, 3, 3 and 1, 1, 2);
  2. fit on strategy.distribute_datasets_from_function (each worker shards the rows
     and batches PER_WORKER_BATCH of them: W * PER_WORKER_BATCH per step);
  3. a custom training loop in the shape of TensorFlow's tutorial: strategy.run of a
     step that calls optimizer.apply_gradients on tf.nn.compute_average_loss(...,
     global_batch_size=GLOBAL_BATCH), strategy.reduce(SUM) of the loss and
     strategy.gather of the labels; in the step, after the update, the replica
     context's all_reduce (sum, mean) of the loss and all_gather of the labels; its
     last step applies the gradients inside the tape's with block.
  4. evaluate and predict over distributed datasets, and a tf.train.Checkpoint of the
     model and the optimizer (DIR/<name>-checkpoint).
--keras tf_keras builds and trains the model with tf_keras (Keras 2) instead.
With --resume-from CHECKPOINT: a new model restored from it, then one loop epoch.
Single-process Keras on the global batches runs the same code on the default
strategy (and then resumes from its own checkpoint), so its results are the
reference. The model normalizes with BatchNormalization(synchronized=True).
Writes DIR/<name>.npz and .json (name: worker<i>, single, or with
-resumed): final weights ``t<j>`` and moving statistics ``n<j>``, the loop's reduced losses, the gathered labels
of the first and last steps, predictions, the fits' histories and evaluate.
"""
from __future__ import annotations

import argparse
import faulthandler
import json
import os
import sys

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")

from prophet_tf.lean_keras import skip_keras_integrations  # noqa: E402

skip_keras_integrations()  # Keras' scikit-learn and plotting integrations: unused here

import numpy as np  # noqa: E402
import tensorflow as tf  # noqa: E402

IN_DIM, NUM_CLASSES, SEED = 5, 3, 11
GLOBAL_BATCH = 8
ROWS = 3 * GLOBAL_BATCH + 4  # a last batch of 4 rows
STEPS = 4  # batches of GLOBAL_BATCH rows
K = None  # keras or tf_keras (--keras)
PER_WORKER_BATCH = 2  # distribute_datasets_from_function: 2 rows per worker and step


def make_data():
    rng = np.random.default_rng(2024)
    x = rng.normal(size=(ROWS, IN_DIM)).astype("float32")
    y = rng.integers(0, NUM_CLASSES, size=ROWS).astype("int64")
    return x, y


def build_model(keras):
    keras.utils.set_random_seed(SEED)
    # The synchronized BatchNormalization normalizes with the global batch's moments: an
    # all_reduce in the forward pass, and its gradient one in the backward pass. (A bias
    # before it would get gradients of rounding noise only, which Adam scales up.)
    return keras.Sequential([keras.Input((IN_DIM,)),
                             keras.layers.Dense(16, use_bias=False, name="hidden"),
                             keras.layers.BatchNormalization(synchronized=True, name="bn"),
                             keras.layers.Activation("tanh"),
                             keras.layers.Dense(NUM_CLASSES, name="logits")])


def run(strategy, distributed: bool, workers: int, checkpoint: str) -> dict:
    keras = K
    x, y = make_data()
    with strategy.scope():
        model = build_model(keras)
        model.compile(optimizer=keras.optimizers.Adam(0.01),
                      loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True),
                      metrics=["accuracy"])
    global_batches = tf.data.Dataset.from_tensor_slices((x, y)).batch(GLOBAL_BATCH)

    # 1. A dataset of global batches, distributed by the strategy.
    # tf_keras needs the steps of a distributed dataset (as under MWMS).
    first = model.fit(strategy.experimental_distribute_dataset(global_batches),
                      epochs=1, verbose=0, steps_per_epoch=STEPS)

    # 2. Per-worker batches from a function of the input context.
    step_rows = PER_WORKER_BATCH * workers
    rows = ROWS - ROWS % step_rows

    def dataset_fn(context):
        per_worker = context.get_per_replica_batch_size(step_rows)
        return (tf.data.Dataset.from_tensor_slices((x[:rows], y[:rows]))
                .shard(context.num_input_pipelines, context.input_pipeline_id)
                .batch(per_worker))

    if distributed:
        second_data = strategy.distribute_datasets_from_function(dataset_fn)
    else:  # The same rows per step: the union of the workers' batches.
        second_data = tf.data.Dataset.from_tensor_slices(
            (x[:rows], y[:rows])).batch(step_rows)
    second = model.fit(second_data, epochs=1, verbose=0, steps_per_epoch=rows // step_rows)

    # 3. A custom training loop, as in TensorFlow's multi-worker tutorial.
    loop = custom_loop(strategy, model, keras, global_batches)
    # Evaluate and predict over distributed datasets answer for the whole data.
    evaluation = model.evaluate(strategy.experimental_distribute_dataset(global_batches),
                                verbose=0, return_dict=True, steps=STEPS)
    prediction = model.predict(strategy.experimental_distribute_dataset(global_batches),
                               verbose=0, steps=STEPS)
    # A tf.train.Checkpoint of the model and the optimizer (the PS's state).
    try:
        tf.train.Checkpoint(model=model, optimizer=model.optimizer).write(checkpoint)
        checkpoint_error = None
    except ValueError as e:  # tf_keras: refused, its optimizer state is the PS's
        checkpoint_error = str(e)
    arrays = weights(model)
    arrays.update(loop)
    arrays["predict"] = np.asarray(prediction)
    info = {"history": [first.history, second.history], "evaluate": evaluation,
            "checkpoint_error": checkpoint_error,
            "iterations": int(model.optimizer.iterations.numpy())}
    return {"arrays": arrays, "info": info}


def weights(model) -> dict:
    """The trainable variables ``t<j>`` and the BatchNormalization's moving statistics
    ``n<j>`` (non-trainable)."""
    arrays = {f"t{j}": v.numpy() for j, v in enumerate(model.trainable_variables)}
    arrays.update({f"n{j}": v.numpy() for j, v in enumerate(model.non_trainable_variables)})
    return arrays


def custom_loop(strategy, model, keras, global_batches) -> dict:
    """One epoch of TensorFlow's tutorial loop; the reduced losses and gathered labels."""
    loss_object = keras.losses.SparseCategoricalCrossentropy(from_logits=True,
                                                             reduction="none")
    optimizer = model.optimizer
    with strategy.scope():  # As in the tutorial: the metric is made in the scope.
        accuracy = keras.metrics.SparseCategoricalAccuracy()

    @tf.function
    def train_step(inputs, in_tape=False):
        def step_fn(inputs):
            features, labels = inputs
            with tf.GradientTape() as tape:
                logits = model(features, training=True)
                loss = tf.nn.compute_average_loss(loss_object(labels, logits),
                                                  global_batch_size=GLOBAL_BATCH)
                if in_tape:  # Applied while the tape still records: the same update.
                    grads = tape.gradient(loss, model.trainable_variables)
                    optimizer.apply_gradients(zip(grads, model.trainable_variables))
            if not in_tape:
                grads = tape.gradient(loss, model.trainable_variables)
                optimizer.apply_gradients(zip(grads, model.trainable_variables))
            accuracy.update_state(labels, logits)
            # Not the optimizer's: every replica gets the cluster's sum, mean, rows.
            context = tf.distribute.get_replica_context()
            replica = (context.all_reduce("sum", loss),
                       context.all_reduce("mean", loss) * context.num_replicas_in_sync,
                       context.all_gather(labels, axis=0))
            return loss, labels, replica

        loss, labels, replica = strategy.run(step_fn, args=(inputs,))
        return (strategy.reduce(tf.distribute.ReduceOp.SUM, loss, axis=None),
                strategy.gather(labels, axis=0),
                [strategy.experimental_local_results(t)[0] for t in replica])

    losses, gathered, accuracies, in_replica = [], [], [], []
    for inputs in strategy.experimental_distribute_dataset(global_batches):
        loss, labels, replica = train_step(inputs)
        losses.append(float(loss))
        gathered.append(labels.numpy())
        in_replica.append([t.numpy() for t in replica])
        accuracies.append(float(accuracy.result()))  # Over the cluster's rows so far.
    accuracy.reset_state()
    train_step(next(iter(strategy.experimental_distribute_dataset(global_batches))),
               in_tape=True)
    accuracies.append(float(accuracy.result()))  # After a reset: one step's rows.
    return {"losses": np.asarray(losses), "gathered_first": gathered[0],
            "gathered_last": gathered[-1], "loop_accuracy": np.asarray(accuracies),
            "all_reduce_sum": np.asarray([r[0] for r in in_replica]),
            "all_reduce_mean": np.asarray([r[1] for r in in_replica]),
            "all_gather_first": in_replica[0][2], "all_gather_last": in_replica[-1][2]}


def resume(strategy, checkpoint: str) -> dict:
    """A new model and optimizer restored from ``checkpoint``, then one more loop epoch."""
    keras = K
    x, y = make_data()
    with strategy.scope():
        model = build_model(keras)
        model.compile(optimizer=keras.optimizers.Adam(0.01),
                      loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True))
    # Adam's slots are made at the first step, and restored then.
    tf.train.Checkpoint(model=model, optimizer=model.optimizer).read(checkpoint).expect_partial()
    global_batches = tf.data.Dataset.from_tensor_slices((x, y)).batch(GLOBAL_BATCH)
    loop = custom_loop(strategy, model, keras, global_batches)
    arrays = weights(model)
    arrays.update(loop)
    return {"arrays": arrays, "info": {"iterations": int(model.optimizer.iterations.numpy())}}


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--single", action="store_true")
    parser.add_argument("--keras", choices=["keras3", "tf_keras"], default="keras3")
    parser.add_argument("--workers", type=int, default=1,
                        help="with --single: the cluster's W (rows per step of the second fit)")
    parser.add_argument("--resume-from", help="restore this checkpoint, then one loop epoch")
    parser.add_argument("--watchdog", type=float, default=150.0)
    parser.add_argument("--out", required=True)
    args = parser.parse_args(argv)
    faulthandler.dump_traceback_later(args.watchdog, exit=True)  # A hang fails, with stacks.
    tf.config.threading.set_intra_op_parallelism_threads(1)
    global K
    if args.keras == "tf_keras":
        import tf_keras as K
    else:
        import keras as K
    os.makedirs(args.out, exist_ok=True)
    if args.single:
        strategy, name = tf.distribute.get_strategy(), "single"
        workers = args.workers
    else:
        import prophet_tf
        strategy = prophet_tf.Strategy(rpc_timeout_s=60.0)
        name, workers = f"worker{strategy.worker_index}", strategy.num_replicas_in_sync
    if args.resume_from:
        results = {f"{name}-resumed": resume(strategy, args.resume_from)}
    else:
        checkpoint = os.path.join(args.out, f"{name}-checkpoint")
        results = {name: run(strategy, distributed=not args.single, workers=workers,
                             checkpoint=checkpoint)}
        if args.single:  # The reference of a resumed cluster: the same, on this strategy.
            results["single-resumed"] = resume(strategy, checkpoint)
    if not args.single:
        strategy.shutdown()
    for tag, result in results.items():
        np.savez(os.path.join(args.out, f"{tag}.npz"), **result["arrays"])
        with open(os.path.join(args.out, f"{tag}.json"), "w") as f:
            json.dump(result["info"], f, default=float)
    faulthandler.cancel_dump_traceback_later()
    return 0


if __name__ == "__main__":
    sys.exit(main())
