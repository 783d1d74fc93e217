"""Worker for test_strategy and test_tf_keras: trains a small model under prophet_tf.Strategy.

    python keras_worker.py --keras keras3 --scenario train --optimizer adam --model mlp \
        --steps 6 --batch 4 --data numpy --out DIR

`--keras` picks the Keras the worker builds its model with:
  keras3    `import keras` (Keras 3)
  tf.keras  `tf.keras`, which is tf_keras (Keras 2) only under TF_USE_LEGACY_KERAS=1 (checked)
  tf_keras  `import tf_keras` directly
The PS tasks always run Keras 3.

Every worker writes DIR/worker<i>.npz (final trainable weights ``t<j>``,
get_weights ``w<j>``, predict and the BatchNorm moving statistics) and
DIR/worker<i>.json (history, per-epoch step counts, evaluate, the save/load
check, caught errors and warnings). Worker 0 also saves the model to
DIR/model.keras and reloads it with plain Keras of the same flavour.

Scenarios:
  train    build + compile in strategy.scope(), fit, evaluate, predict, save.
  misuse   (1 worker) the flavour's MISUSE_CASES in order, each recorded in the
           JSON, then TRAINS_AFTER_MISUSE, which must train; its weights go to
           DIR/worker0.<case>.npz.
             keras3:   a model created outside scope() and compiled and fitted
                       under it; one created outside, compiled inside and fitted
                       outside; jit_compile=True;
                       then run_eagerly=True.
             tf_keras: a model created outside scope(); optimizers the PS cannot
                       reproduce (use_ema,
                       a legacy optimizer, adaptive_epsilon, a custom schedule);
                       jit_compile=True; the mixed_float16 policy; then a valid
                       model (AdamW with weight decay, bias excluded).

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

from prophet_tf.lean_keras import skip_keras_integrations  # noqa: E402

skip_keras_integrations()  # Keras' scikit-learn and plotting integrations: unused here

import numpy as np  # noqa: E402
import tensorflow as tf  # noqa: E402

IN_DIM = 5
NUM_CLASSES = 3
CNN_SHAPE = (6, 6, 1)
SEED = 7
DATA_SEED = 1234
PROBE_SEED = 99
KERAS_CHOICES = ("keras3", "tf.keras", "tf_keras")
MISUSE_CASES = {
    "keras3": ("outside_scope", "outside_scope_compiled_inside", "jit_compile"),
    "tf_keras": ("outside_scope", "use_ema",
                 "legacy_optimizer", "adaptive_epsilon", "custom_schedule", "jit_compile",
                 "mixed_precision"),
}
# The case after the misuse that must still train (and is compared with plain Keras).
TRAINS_AFTER_MISUSE = {"keras3": "run_eagerly", "tf_keras": "valid"}

K = None  # The Keras module in use, set by select_keras().
FAMILY = None  # "keras3" or "tf_keras", set by select_keras().


def family(how: str) -> str:
    """"keras3" or "tf_keras": `tf.keras` and `tf_keras` are the same Keras 2."""
    return "keras3" if how == "keras3" else "tf_keras"


def select_keras(how: str):
    """Sets K to the Keras module `how` names (one of KERAS_CHOICES)."""
    global K, FAMILY
    if how == "keras3":
        import keras
        K = keras
    elif how == "tf_keras":
        import tf_keras
        K = tf_keras
    elif how == "tf.keras":
        K = tf.keras
        if not K.layers.Dense.__module__.startswith("tf_keras."):
            raise RuntimeError("tf.keras is not tf_keras: set TF_USE_LEGACY_KERAS=1. "
                               f"Received: tf.keras.layers.Dense from {K.layers.Dense.__module__}")
    else:
        raise ValueError(f"unknown keras import {how!r}")
    FAMILY = family(how)
    return K


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


def probe_data(model_kind: str, global_batch: int):
    """Two global batches that fit never saw: for evaluate and predict."""
    return make_data(model_kind, 2 * global_batch, seed=PROBE_SEED)


def fit_inputs(kind: str, x, y, batch_size: int) -> tuple[tuple, dict]:
    """(args, kwargs) for model.fit with the data as `kind`, batches of `batch_size`."""
    if kind == "numpy":
        return (x, y), {"batch_size": batch_size, "shuffle": False}
    if kind == "dataset":
        return (tf.data.Dataset.from_tensor_slices((x, y)).batch(batch_size),), {}
    if kind in ("pydataset", "sequence"):
        # keras.utils.PyDataset (Keras 3) or tf_keras.utils.Sequence (Keras 2).
        base = K.utils.PyDataset if kind == "pydataset" else K.utils.Sequence

        class ArrayBatches(base):
            """Global batches of (x, y) in order."""

            def __init__(self):
                super().__init__()  # Keras 3 warns when a PyDataset skips it.

            def __len__(self):
                return len(x) // batch_size

            def __getitem__(self, i):
                s = slice(i * batch_size, (i + 1) * batch_size)
                return x[s], y[s]

        # fit's default shuffle=True would shuffle the order of the batches.
        return (ArrayBatches(),), {"shuffle": False}
    raise ValueError(f"unknown data kind {kind!r}")


# -- model and optimizer -------------------------------------------------------------------

def build_model(model_kind: str, hidden: int = 8, seed: int = SEED):
    K.utils.set_random_seed(seed)
    layers = [K.Input(input_shape(model_kind))]
    if model_kind == "mlp":
        layers += [K.layers.Dense(hidden, activation="tanh", name="hidden"),
                   K.layers.Dense(NUM_CLASSES, name="logits")]
    elif model_kind == "bn":
        layers += [K.layers.BatchNormalization(momentum=0.9, name="bn_in"),
                   K.layers.Dense(hidden, activation="relu", name="hidden"),
                   K.layers.BatchNormalization(momentum=0.9, name="bn_hidden"),
                   K.layers.Dense(NUM_CLASSES, name="logits")]
    elif model_kind == "norm":  # per-sample normalizations: nothing crosses workers
        layers += [K.layers.Dense(hidden, name="hidden"),
                   K.layers.LayerNormalization(name="ln"),
                   K.layers.Activation("tanh"),
                   K.layers.Dense(hidden, use_bias=False, name="hidden2"),
                   K.layers.GroupNormalization(groups=2, name="gn"),
                   K.layers.Activation("tanh"),
                   K.layers.Dense(NUM_CLASSES, name="logits")]
    elif model_kind == "cnn":
        layers += [K.layers.Conv2D(4, 3, activation="relu", name="conv"),
                   K.layers.Flatten(),
                   K.layers.Dense(NUM_CLASSES, name="logits")]
    else:
        raise ValueError(f"unknown model {model_kind!r}")
    return K.Sequential(layers, name="net")


#: Options added to an optimizer by the suffix "+<name>" (e.g. "momentum+clipnorm"):
#: clipping small enough that every step of the test models clips.
SUFFIX_OPTIONS = {"clipnorm": {"clipnorm": 0.05}, "clipvalue": {"clipvalue": 0.02},
                  "global_clipnorm": {"global_clipnorm": 0.05},
                  # Keras 3: the average of every 2 steps' gradients, clipped.
                  "clipnorm_accumulate": {"clipnorm": 0.05, "gradient_accumulation_steps": 2},
                  # Keras 3: moving averages swapped in at the end of every fit.
                  "clipnorm_ema": {"clipnorm": 0.05, "use_ema": True, "ema_momentum": 0.5}}


def make_optimizer(name: str):
    if "+" in name:
        base, clip = name.split("+")
        optimizer = make_optimizer(base)
        config = dict(optimizer.get_config(), **SUFFIX_OPTIONS[clip])
        return type(optimizer).from_config(config)
    opt = K.optimizers
    if name == "sgd":
        return opt.SGD(0.1)
    if name == "momentum":
        return opt.SGD(0.1, momentum=0.9)
    if name == "adam":
        return opt.Adam(0.01)
    if name == "nadam_schedule":
        return opt.Nadam(opt.schedules.ExponentialDecay(0.02, decay_steps=1, decay_rate=0.7))
    if name == "schedule":
        return opt.SGD(opt.schedules.ExponentialDecay(0.2, decay_steps=1, decay_rate=0.7))
    if name == "adamw":
        optimizer = opt.AdamW(0.01, weight_decay=0.1)
        optimizer.exclude_from_weight_decay(var_names=["bias"])
        return optimizer
    # Options the PS cannot reproduce (misuse).
    if name == "clipnorm":
        return opt.SGD(0.1, clipnorm=1.0)
    if name == "clipvalue":
        return opt.SGD(0.1, clipvalue=1.0)
    if name == "global_clipnorm":
        return opt.SGD(0.1, global_clipnorm=1.0)
    if name == "use_ema":
        return opt.SGD(0.1, use_ema=True)
    if name == "legacy_optimizer":
        return opt.legacy.SGD(0.1)
    if name == "adaptive_epsilon":
        return opt.Adam(0.01, adaptive_epsilon=True)
    if name == "custom_schedule":
        class Halving(opt.schedules.LearningRateSchedule):
            def __call__(self, step):
                return 0.1 * tf.pow(0.5, tf.cast(step, tf.float32))

            def get_config(self):
                return {}

        return opt.SGD(Halving())
    raise ValueError(f"unknown optimizer {name!r}")


def compile_model(model, optimizer: str, **kwargs) -> None:
    model.compile(optimizer=make_optimizer(optimizer),
                  loss=K.losses.SparseCategoricalCrossentropy(from_logits=True),
                  metrics=["accuracy"], **kwargs)


def step_counter():
    """A callback counting training steps per epoch (in `.per_epoch`)."""
    class StepCounter(K.callbacks.Callback):
        def __init__(self):
            super().__init__()
            self.per_epoch = []

        def on_epoch_begin(self, epoch, logs=None):
            self.per_epoch.append(0)

        def on_train_batch_end(self, batch, logs=None):
            self.per_epoch[-1] += 1

    return StepCounter()


def train(model, args, global_batch: int) -> dict:
    """Fits on the fixed data; returns what the JSON reports about it."""
    x, y = make_data(args.model, args.steps * global_batch)
    fit_args, fit_kwargs = fit_inputs(args.data, x, y, global_batch)
    counter = step_counter()
    callbacks = [counter]
    if getattr(args, "lr_callback", False):
        # Halves the learning rate at every epoch after the first, on the worker.
        callbacks.append(K.callbacks.LearningRateScheduler(
            lambda epoch, lr: lr * 0.5 if epoch else lr))
    history = model.fit(*fit_args, epochs=args.epochs, verbose=0, callbacks=callbacks,
                        **fit_kwargs)
    return {"history": {k: [float(v) for v in vs] for k, vs in history.history.items()},
            "steps_per_epoch": counter.per_epoch}


def single_process(args) -> dict:
    """Plain Keras (the selected flavour) on the global batch: the reference for exactness."""
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


def _variable_name(variable) -> str:
    # Keras 3 keeps the layer path in `.path` (`.name` is the last part); tf_keras in `.name`.
    return variable.path if FAMILY == "keras3" else variable.name


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
        if isinstance(layer, K.layers.BatchNormalization):
            arrays[f"{layer.name}.moving_mean"] = layer.moving_mean.numpy()
            arrays[f"{layer.name}.moving_variance"] = layer.moving_variance.numpy()
    np.savez(os.path.join(out_dir, f"worker{index}{tag}.npz"), **arrays)
    info = {"evaluate": {k: float(v) for k, v in evaluation.items()},
            "trainable_names": [_variable_name(v) for v in model.trainable_variables],
            "num_weights": len(model.get_weights()),
            "iterations": int(model.optimizer.iterations.numpy())}
    if index == 0 and not tag:
        info["save"] = _save_and_load(model, out_dir)
    return info


def _save_and_load(model, out_dir) -> dict:
    path = os.path.join(out_dir, "model.keras")
    try:
        model.save(path)
        loaded = K.models.load_model(path)  # Plain Keras: outside the strategy.
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
    if args.rounds > 1:  # the first fit's weights too: exact after one fit, as with rounds=1
        np.savez(os.path.join(out_dir, f"worker{strategy.worker_index}.round1.npz"),
                 **{f"t{j}": v.numpy() for j, v in enumerate(model.trainable_variables)})
    for _ in range(1, args.rounds):
        # fit -> evaluate -> predict -> fit: Keras drops and makes input
        # iterators at each boundary (a worker once crashed there).
        x_probe, y_probe = probe_data(args.model, global_batch)
        model.evaluate(x_probe, y_probe, batch_size=global_batch, verbose=0)
        model.predict(x_probe, batch_size=global_batch, verbose=0)
        info = train(model, args, global_batch)
    if args.model == "bn":
        info["loop_steps"] = custom_loop(model, strategy, args, global_batch)
    info.update(_collect(model, strategy, args, global_batch, out_dir))
    return info


def custom_loop(model, strategy, args, global_batch) -> int:
    """One epoch of TensorFlow's custom training loop over the fit's data (its steps);
    returns the steps taken."""
    x, y = make_data(args.model, args.steps * global_batch)
    batches = tf.data.Dataset.from_tensor_slices((x, y)).batch(global_batch)
    loss_object = K.losses.SparseCategoricalCrossentropy(from_logits=True, reduction="none")

    @tf.function
    def step(inputs):
        def replica(inputs):
            features, labels = inputs
            with tf.GradientTape() as tape:
                loss = tf.nn.compute_average_loss(
                    loss_object(labels, model(features, training=True)),
                    global_batch_size=global_batch)
            grads = tape.gradient(loss, model.trainable_variables)
            model.optimizer.apply_gradients(zip(grads, model.trainable_variables))
        strategy.run(replica, args=(inputs,))

    steps = 0
    for inputs in strategy.experimental_distribute_dataset(batches):
        step(inputs)
        steps += 1
    return steps


def write_json(out_dir, index, info) -> None:
    path = os.path.join(out_dir, f"worker{index}.json")
    with open(path + ".tmp", "w") as f:
        json.dump(info, f, indent=1)
    os.replace(path + ".tmp", path)


def scenario_misuse(strategy, args, out_dir) -> dict:
    """Each kind of misuse in turn, then a model that must still train.

    The JSON is rewritten after each case, so a case that hangs (and is ended
    by the watchdog) leaves the earlier outcomes behind.
    """
    global_batch = args.batch * strategy.num_replicas_in_sync
    x, y = make_data(args.model, args.steps * global_batch)
    results = {}

    def fit(model):
        model.fit(x, y, batch_size=global_batch, epochs=1, shuffle=False, verbose=0)

    def attempt(name, fn):
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            try:
                results[name] = {"raised": False, "value": fn()}
            except Exception as e:  # noqa: BLE001 - reported to the test.
                results[name] = {"raised": True, **_error_record(e)}
        results[name]["warnings"] = [str(w.message) for w in caught]
        write_json(out_dir, strategy.worker_index, {"misuse": results})

    def outside_scope():
        model = build_model(args.model)  # Created outside scope().
        with strategy.scope():
            compile_model(model, "sgd")
            fit(model)

    def outside_scope_compiled_inside():
        model = build_model(args.model)  # Created outside scope(), compiled inside,
        with strategy.scope():
            compile_model(model, "sgd")
        fit(model)  # fitted outside.

    def rejected_optimizer(name):
        def run():
            with strategy.scope():
                model = build_model(args.model)
                compile_model(model, name)
            fit(model)
        return run

    def jit():
        with strategy.scope():
            model = build_model(args.model)
            compile_model(model, "sgd", jit_compile=True)
        fit(model)

    def mixed_precision():
        K.mixed_precision.set_global_policy("mixed_float16")
        try:
            with strategy.scope():
                model = build_model(args.model)
                compile_model(model, "sgd")
            fit(model)
        finally:
            K.mixed_precision.set_global_policy("float32")

    cases = {"outside_scope": outside_scope,
             "outside_scope_compiled_inside": outside_scope_compiled_inside,
             "jit_compile": jit, "mixed_precision": mixed_precision}
    for name in MISUSE_CASES[FAMILY]:
        print(f"worker {strategy.worker_index}: misuse case {name}", flush=True)
        attempt(name, cases.get(name) or rejected_optimizer(name))

    # After all of that (nothing registered), a model trains exactly: run_eagerly
    # (Keras 3, which must warn) or a plain valid model (tf_keras).
    last = TRAINS_AFTER_MISUSE[FAMILY]
    final = {}

    def trains():
        with strategy.scope():
            model = build_model(args.model)
            compile_model(model, args.optimizer, **({"run_eagerly": True}
                                                    if last == "run_eagerly" else {}))
        final["model"] = model
        return train(model, args, global_batch)

    print(f"worker {strategy.worker_index}: misuse case {last} ({args.optimizer})", flush=True)
    attempt(last, trains)
    if not results[last]["raised"]:
        results[last]["collect"] = _collect(final["model"], strategy, args, global_batch,
                                            out_dir, tag=f".{last}")
    return {"misuse": results}


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--keras", choices=KERAS_CHOICES, default="keras3",
                        help="which Keras the worker builds its model with")
    parser.add_argument("--scenario", choices=["train", "misuse"], default="train")
    parser.add_argument("--optimizer", choices=["sgd", "momentum", "adam", "schedule", "adamw",
                                                "momentum+clipnorm", "momentum+clipnorm_accumulate",
                                                "schedule+clipvalue",
                                                "nadam_schedule+clipvalue",
                                                "adam+clipnorm", "adam+clipnorm_ema",
                                                "sgd+global_clipnorm"],
                        default="sgd")
    parser.add_argument("--model", choices=["mlp", "bn", "norm", "cnn"], default="mlp")
    parser.add_argument("--data", choices=["numpy", "dataset", "pydataset", "sequence"],
                        default="numpy")
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
    select_keras(args.keras)
    os.makedirs(args.out, exist_ok=True)

    if args.single:
        result = single_process(args)
        np.savez(os.path.join(args.out, "single.npz"),
                 **{f"t{j}": v for j, v in enumerate(result["trainable"])})
        return 0

    import prophet_tf
    strategy = prophet_tf.Strategy(rpc_timeout_s=args.rpc_timeout)
    index = strategy.worker_index
    print(f"worker {index} of {strategy.num_replicas_in_sync}: scenario {args.scenario}, "
          f"{args.keras} from {K.__name__}", flush=True)
    if args.scenario == "train":
        info = scenario_train(strategy, args, args.out)
    else:
        info = scenario_misuse(strategy, args, args.out)
    info["keras"] = K.__name__
    write_json(args.out, index, info)
    print(f"worker {index}: done", flush=True)
    strategy.shutdown()
    faulthandler.cancel_dump_traceback_later()
    return 0


if __name__ == "__main__":
    sys.exit(main())
