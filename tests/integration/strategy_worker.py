"""Worker for test_strategy: trains a small Keras model under prophet_tf.Strategy.

    python strategy_worker.py --scenario train --optimizer adam --model mlp \
        --steps 6 --batch 4 --data numpy --out DIR

Every worker writes DIR/worker<i>.npz (final trainable weights ``t<j>``,
get_weights ``w<j>``, predict and the BatchNorm moving statistics) and
DIR/worker<i>.json (history, per-epoch step counts, evaluate, the save/load
check, caught errors and warnings). Worker 0 also saves the model to
DIR/model.keras and reloads it with plain Keras.

Scenarios:
  train    build + compile in strategy.scope(), fit, evaluate, predict, save.
  misuse   (1 worker) in order: a model created outside scope() and compiled
           and fitted under it; one created outside, compiled inside and fitted
           outside; jit_compile=True, an optimizer with clipnorm, then run_eagerly=True
           (which must train). Each outcome is recorded in the JSON.

The data, models and optimizers are plain functions so the test can build the
single-process reference from the same code (``--single`` runs it here too).
"""
from __future__ import annotations

import argparse
import faulthandler
import json
import os
import sys
import traceback
import warnings

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")

import keras  # noqa: E402
import numpy as np  # noqa: E402
import tensorflow as tf  # noqa: E402

IN_DIM = 5
NUM_CLASSES = 3
CNN_SHAPE = (6, 6, 1)
SEED = 7
DATA_SEED = 1234
PROBE_SEED = 99


def limit_threads() -> None:
    try:
        tf.config.threading.set_intra_op_parallelism_threads(1)
        tf.config.threading.set_inter_op_parallelism_threads(2)
    except RuntimeError:  # The runtime is already initialised (in the test process).
        pass


# -- data -------------------------------------------------------------------------------------

def input_shape(model_kind: str) -> tuple:
    return CNN_SHAPE if model_kind == "cnn" else (IN_DIM,)


def make_data(model_kind: str, n: int, seed: int = DATA_SEED):
    """Deterministic (x, y): the same on every worker and in the reference."""
    rng = np.random.default_rng(seed)
    x = rng.normal(size=(n, *input_shape(model_kind))).astype("float32")
    if model_kind == "bn":  # Offsets and scales for BatchNorm to learn/normalise.
        x = x * np.arange(1, IN_DIM + 1, dtype="float32") + np.float32(3.0)
    y = rng.integers(0, NUM_CLASSES, size=n).astype("int64")
    return x, y


class ArrayPyDataset(keras.utils.PyDataset):
    """Global batches of (x, y) in order."""

    def __init__(self, x, y, batch_size):
        super().__init__()
        self.x, self.y, self.batch_size = x, y, batch_size

    def __len__(self):
        return len(self.x) // self.batch_size

    def __getitem__(self, i):
        s = slice(i * self.batch_size, (i + 1) * self.batch_size)
        return self.x[s], self.y[s]


def fit_inputs(kind: str, x, y, batch_size: int) -> tuple[tuple, dict]:
    """(args, kwargs) for model.fit with the data as `kind`, batches of `batch_size`."""
    if kind == "numpy":
        return (x, y), {"batch_size": batch_size, "shuffle": False}
    if kind == "dataset":
        return (tf.data.Dataset.from_tensor_slices((x, y)).batch(batch_size),), {}
    if kind == "pydataset":
        # fit's default shuffle=True would shuffle the order of a PyDataset's batches.
        return (ArrayPyDataset(x, y, batch_size),), {"shuffle": False}
    raise ValueError(f"unknown data kind {kind!r}")


# -- model and optimizer -------------------------------------------------------------------

def build_model(model_kind: str, hidden: int = 8, seed: int = SEED) -> keras.Model:
    keras.utils.set_random_seed(seed)
    layers = [keras.Input(input_shape(model_kind))]
    if model_kind == "mlp":
        layers += [keras.layers.Dense(hidden, activation="tanh", name="hidden"),
                   keras.layers.Dense(NUM_CLASSES, name="logits")]
    elif model_kind == "bn":
        layers += [keras.layers.BatchNormalization(momentum=0.9, name="bn_in"),
                   keras.layers.Dense(hidden, activation="relu", name="hidden"),
                   keras.layers.BatchNormalization(momentum=0.9, name="bn_hidden"),
                   keras.layers.Dense(NUM_CLASSES, name="logits")]
    elif model_kind == "cnn":
        layers += [keras.layers.Conv2D(4, 3, activation="relu", name="conv"),
                   keras.layers.Flatten(),
                   keras.layers.Dense(NUM_CLASSES, name="logits")]
    else:
        raise ValueError(f"unknown model {model_kind!r}")
    return keras.Sequential(layers, name="net")


def make_optimizer(name: str) -> keras.optimizers.Optimizer:
    if name == "sgd":
        return keras.optimizers.SGD(0.1)
    if name == "momentum":
        return keras.optimizers.SGD(0.1, momentum=0.9)
    if name == "adam":
        return keras.optimizers.Adam(0.01)
    if name == "schedule":
        return keras.optimizers.SGD(keras.optimizers.schedules.ExponentialDecay(
            0.2, decay_steps=1, decay_rate=0.7))
    if name == "clipnorm":
        return keras.optimizers.SGD(0.1, clipnorm=1.0)
    raise ValueError(f"unknown optimizer {name!r}")


def compile_model(model, optimizer: str, **kwargs) -> None:
    model.compile(optimizer=make_optimizer(optimizer),
                  loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True),
                  metrics=["accuracy"], **kwargs)


class StepCounter(keras.callbacks.Callback):
    """Training steps taken in each epoch."""

    def __init__(self):
        super().__init__()
        self.per_epoch = []

    def on_epoch_begin(self, epoch, logs=None):
        self.per_epoch.append(0)

    def on_train_batch_end(self, batch, logs=None):
        self.per_epoch[-1] += 1


def train(model, args, global_batch: int) -> dict:
    """Fits on the fixed data; returns what the JSON reports about it."""
    x, y = make_data(args.model, args.steps * global_batch)
    fit_args, fit_kwargs = fit_inputs(args.data, x, y, global_batch)
    counter = StepCounter()
    callbacks = [counter]
    if getattr(args, "lr_callback", False):
        # Halves the learning rate at every epoch after the first, on the worker.
        callbacks.append(keras.callbacks.LearningRateScheduler(
            lambda epoch, lr: lr * 0.5 if epoch else lr))
    history = model.fit(*fit_args, epochs=args.epochs, verbose=0, callbacks=callbacks,
                        **fit_kwargs)
    return {"history": {k: [float(v) for v in vs] for k, vs in history.history.items()},
            "steps_per_epoch": counter.per_epoch}


def probe_data(model_kind: str, global_batch: int):
    """Two global batches that fit never saw: for evaluate and predict."""
    return make_data(model_kind, 2 * global_batch, seed=PROBE_SEED)


def single_process(args) -> dict[str, np.ndarray]:
    """Plain Keras on the global batch: the reference for exactness."""
    global_batch = args.batch * args.workers
    model = build_model(args.model, args.hidden)
    compile_model(model, args.optimizer)
    for _ in range(getattr(args, "rounds", 1)):
        info = train(model, args, global_batch)
    return {"trainable": [v.numpy() for v in model.trainable_variables],
            "weights": model.get_weights(), "info": info}


# -- scenarios -------------------------------------------------------------------------------

def _error_record(e: BaseException) -> dict:
    return {"type": type(e).__name__, "message": str(e),
            "traceback": "".join(traceback.format_exception(e))[-4000:]}


def _collect(model, strategy, args, global_batch, out_dir, tag="") -> dict:
    """Writes weights/predictions; returns evaluate/save results for the JSON."""
    index = strategy.worker_index
    x_probe, y_probe = probe_data(args.model, global_batch)
    evaluation = model.evaluate(x_probe, y_probe, batch_size=global_batch, verbose=0,
                                return_dict=True)
    prediction = model.predict(x_probe, batch_size=global_batch, verbose=0)
    arrays = {f"t{j}": v.numpy() for j, v in enumerate(model.trainable_variables)}
    arrays.update({f"w{j}": w for j, w in enumerate(model.get_weights())})
    arrays["predict"] = np.asarray(prediction)
    for layer in model.layers:
        if isinstance(layer, keras.layers.BatchNormalization):
            arrays[f"{layer.name}.moving_mean"] = layer.moving_mean.numpy()
            arrays[f"{layer.name}.moving_variance"] = layer.moving_variance.numpy()
    np.savez(os.path.join(out_dir, f"worker{index}{tag}.npz"), **arrays)
    info = {"evaluate": {k: float(v) for k, v in evaluation.items()},
            "trainable_names": [v.path for v in model.trainable_variables],
            "num_weights": len(model.get_weights()),
            "iterations": int(model.optimizer.iterations.numpy())}
    if index == 0 and not tag:
        info["save"] = _save_and_load(model, out_dir)
    return info


def _save_and_load(model, out_dir) -> dict:
    path = os.path.join(out_dir, "model.keras")
    try:
        model.save(path)
        loaded = keras.models.load_model(path)  # Plain Keras: outside the strategy.
        ours, theirs = model.get_weights(), loaded.get_weights()
        equal = len(ours) == len(theirs) and all(
            a.shape == b.shape and np.array_equal(a, b) for a, b in zip(ours, theirs))
        return {"ok": True, "equal": bool(equal), "count": [len(ours), len(theirs)]}
    except Exception as e:  # noqa: BLE001 - reported to the test.
        return {"ok": False, "error": _error_record(e)}


def scenario_train(strategy, args, out_dir) -> dict:
    global_batch = args.batch * strategy.num_replicas_in_sync
    hidden = args.hidden + (strategy.worker_index if args.hidden_by_worker else 0)
    with strategy.scope():
        model = build_model(args.model, hidden)
        compile_model(model, args.optimizer)
    info = train(model, args, global_batch)
    for _ in range(1, getattr(args, "rounds", 1)):
        # fit -> evaluate -> predict -> fit: Keras drops and makes input
        # iterators at each boundary (a worker once crashed there).
        x_probe, y_probe = probe_data(args.model, global_batch)
        model.evaluate(x_probe, y_probe, batch_size=global_batch, verbose=0)
        model.predict(x_probe, batch_size=global_batch, verbose=0)
        info = train(model, args, global_batch)
    info.update(_collect(model, strategy, args, global_batch, out_dir))
    return info


def write_json(out_dir, index, info) -> None:
    path = os.path.join(out_dir, f"worker{index}.json")
    with open(path + ".tmp", "w") as f:
        json.dump(info, f, indent=1)
    os.replace(path + ".tmp", path)


def scenario_misuse(strategy, args, out_dir) -> dict:
    """Each kind of misuse in turn; the last (run_eagerly) must still train.

    The JSON is rewritten after each case, so a case that hangs (and is ended
    by the watchdog) leaves the earlier outcomes behind.
    """
    global_batch = args.batch * strategy.num_replicas_in_sync
    x, y = make_data(args.model, args.steps * global_batch)
    results = {}

    def attempt(name, fn):
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            try:
                value = fn()
                results[name] = {"raised": False, "value": value}
            except Exception as e:  # noqa: BLE001 - reported to the test.
                results[name] = {"raised": True, **_error_record(e)}
        results[name]["warnings"] = [str(w.message) for w in caught]
        write_json(out_dir, strategy.worker_index, {"misuse": results})

    def outside_scope():
        model = build_model(args.model)  # Created outside scope().
        with strategy.scope():
            compile_model(model, "sgd")
            model.fit(x, y, batch_size=global_batch, epochs=1, shuffle=False, verbose=0)

    def outside_scope_compiled_inside():
        model = build_model(args.model)  # Created outside scope(), compiled inside,
        with strategy.scope():
            compile_model(model, "sgd")
        model.fit(x, y, batch_size=global_batch, epochs=1, shuffle=False, verbose=0)  # fit outside.

    def jit():
        with strategy.scope():
            model = build_model(args.model)
            compile_model(model, "sgd", jit_compile=True)
        model.fit(x, y, batch_size=global_batch, epochs=1, shuffle=False, verbose=0)

    def clipnorm():
        with strategy.scope():
            model = build_model(args.model)
            compile_model(model, "clipnorm")
        model.fit(x, y, batch_size=global_batch, epochs=1, shuffle=False, verbose=0)

    eager_model = []

    def eager():
        with strategy.scope():
            model = build_model(args.model)
            compile_model(model, args.optimizer, run_eagerly=True)
        eager_model.append(model)
        return train(model, args, global_batch)

    for name, fn in [("outside_scope", outside_scope),
                     ("outside_scope_compiled_inside", outside_scope_compiled_inside),
                     ("jit_compile", jit),
                     ("clipnorm", clipnorm), ("run_eagerly", eager)]:
        if name in args.skip:
            continue
        print(f"worker {strategy.worker_index}: misuse case {name}", flush=True)
        attempt(name, fn)
    if eager_model and not results["run_eagerly"]["raised"]:
        results["run_eagerly"]["collect"] = _collect(eager_model[0], strategy, args,
                                                     global_batch, out_dir, tag=".eager")
    return {"misuse": results}


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--scenario", choices=["train", "misuse"], default="train")
    parser.add_argument("--optimizer", choices=["sgd", "momentum", "adam", "schedule"],
                        default="sgd")
    parser.add_argument("--model", choices=["mlp", "bn", "cnn"], default="mlp")
    parser.add_argument("--data", choices=["numpy", "dataset", "pydataset"], default="numpy")
    parser.add_argument("--steps", type=int, default=6, help="steps per epoch")
    parser.add_argument("--epochs", type=int, default=1)
    parser.add_argument("--rounds", type=int, default=1,
                        help="fit this many times, with evaluate and predict in between")
    parser.add_argument("--lr-callback", action="store_true",
                        help="change the learning rate with LearningRateScheduler")
    parser.add_argument("--batch", type=int, default=4, help="per-worker batch")
    parser.add_argument("--hidden", type=int, default=8)
    parser.add_argument("--hidden-by-worker", action="store_true",
                        help="worker i uses hidden + i units (a model mismatch)")
    parser.add_argument("--skip", nargs="*", default=[], help="misuse cases to leave out")
    parser.add_argument("--rpc-timeout", type=float, default=60.0)
    parser.add_argument("--single", action="store_true",
                        help="plain single-process Keras at batch * --workers")
    parser.add_argument("--workers", type=int, default=2, help="with --single")
    parser.add_argument("--watchdog", type=float, default=0.0,
                        help="after this many seconds, print every thread's stack and exit 1")
    parser.add_argument("--out", required=True, help="output directory")
    args = parser.parse_args(argv)
    if args.watchdog > 0:
        # A hang becomes a failure with the stacks in the log.
        faulthandler.dump_traceback_later(args.watchdog, exit=True)
    limit_threads()
    os.makedirs(args.out, exist_ok=True)

    if args.single:
        result = single_process(args)
        np.savez(os.path.join(args.out, "single.npz"),
                 **{f"t{j}": v for j, v in enumerate(result["trainable"])})
        return 0

    import prophet_tf
    strategy = prophet_tf.Strategy(rpc_timeout_s=args.rpc_timeout)
    index = strategy.worker_index
    print(f"worker {index} of {strategy.num_replicas_in_sync}: scenario {args.scenario}",
          flush=True)
    if args.scenario == "train":
        info = scenario_train(strategy, args, args.out)
    else:
        info = scenario_misuse(strategy, args, args.out)
    write_json(args.out, index, info)
    print(f"worker {index}: done", flush=True)
    strategy.shutdown()
    faulthandler.cancel_dump_traceback_later()
    return 0


if __name__ == "__main__":
    sys.exit(main())
