"""Benchmark models, their synthetic data, and per-variable compute profiles.

Models:

- ``cnn``: the benchmark CNN (32x32x3 input, four 3x3 convolutions in two
  blocks, a 256-unit dense layer, 10 classes; 1,116,970 parameters, 4.47 MB of
  float32 gradients). Its compute sits in the convolutions (the first layers)
  and its bytes in the dense layer (the last but one): the shape for which the
  order of gradient traffic matters. Built for Keras 3 or for tf_keras (same
  layers, same initialisers), so the tf-mwms baseline trains the same model.
- ``resnet50``, ``vgg16``, ``inceptionv3``: ``keras.applications`` with
  ``weights=None`` (random weights; nothing is downloaded), profiled for the
  simulator only.

Profiles (:func:`profile_model`) measure, on this machine, each trainable
variable's forward and backward compute time at a given per-worker batch, with
the op library's ``ReadyStamp`` op (a timestamp when a tensor is ready; see
``prophet_tf._native.ready_stamp``) inside one ``tf.function`` training step:

- forward: a stamp on the output of every layer that owns trainable
  variables; a layer's forward time is the time since the previous stamp, and
  is charged to its first variable (its other variables get 0), so the
  forward times of the variables add up to the whole forward pass, layers
  without variables (activations, pooling) included in the next stamped one;
- backward: a stamp on every gradient; ``ready_s`` is its time since the loss
  was ready (the start of backprop), as the engine sees it.

Forward ops run one after another (each layer needs the previous one's
output), so the forward stamps partition the forward pass. Medians over the
measured iterations.
"""
from __future__ import annotations

import logging
import os
import platform
import statistics
import time

import numpy as np

__all__ = ["MODELS", "APPLICATIONS", "INPUT_SHAPES", "NUM_CLASSES", "build_model",
           "synthetic_data", "profile_model", "variable_forward_s",
           "INTRA_OP_THREADS", "INTER_OP_THREADS"]

logger = logging.getLogger(__name__)

#: Models the bench trains (and the simulator can use when profiled).
MODELS = ("cnn",)
#: keras.applications models the simulator has profiles for.
APPLICATIONS = ("resnet50", "vgg16", "inceptionv3")
INPUT_SHAPES = {"cnn": (32, 32, 3), "resnet50": (224, 224, 3), "vgg16": (224, 224, 3),
                "inceptionv3": (299, 299, 3)}
NUM_CLASSES = {"cnn": 10, "resnet50": 1000, "vgg16": 1000, "inceptionv3": 1000}


def build_model(name: str, keras_module=None):
    """Builds model ``name`` (uncompiled) with ``keras_module`` (default: keras 3).

    Args:
      name: one of :data:`MODELS` or :data:`APPLICATIONS`.
      keras_module: ``keras`` or ``tf_keras``.

    Raises:
      ValueError: unknown name.
    """
    if keras_module is None:
        import keras as keras_module
    if name == "cnn":
        layers = keras_module.layers
        return keras_module.Sequential([
            keras_module.Input(INPUT_SHAPES["cnn"]),
            layers.Conv2D(32, 3, padding="same", activation="relu"),
            layers.Conv2D(32, 3, padding="same", activation="relu"),
            layers.MaxPooling2D(),
            layers.Conv2D(64, 3, padding="same", activation="relu"),
            layers.Conv2D(64, 3, padding="same", activation="relu"),
            layers.MaxPooling2D(),
            layers.Flatten(),
            layers.Dense(256, activation="relu"),
            layers.Dense(NUM_CLASSES["cnn"]),
        ], name="cnn")
    builders = {"resnet50": "ResNet50", "vgg16": "VGG16", "inceptionv3": "InceptionV3"}
    if name in builders:
        build = getattr(keras_module.applications, builders[name])
        return build(weights=None, input_shape=INPUT_SHAPES[name], classes=NUM_CLASSES[name])
    raise ValueError(f"Unknown model; valid models: {', '.join(MODELS + APPLICATIONS)}. "
                     f"Received: model={name!r}")


def synthetic_data(name: str, num_samples: int, seed: int = 0) -> tuple[np.ndarray, np.ndarray]:
    """Fixed random images and labels for model ``name`` (the same on every worker)."""
    rng = np.random.default_rng(seed)
    x = rng.random((num_samples, *INPUT_SHAPES[name]), dtype=np.float32)
    y = rng.integers(0, NUM_CLASSES[name], size=num_samples).astype("int64")
    return x, y


# --------------------------------------------------------------------------- profiles

_INPUT_KEY, _LOSS_KEY, _LAYER_BASE = 1 << 20, (1 << 20) + 1, 1 << 21


#: TF threads of a bench worker (and of a profile): one thread per op, two
#: ops at once. With one inter-op thread, TF's executor runs a layer's weight
#: gradient after the rest of backprop (the dense kernel's became ready last
#: in the CNN), which hides the readiness order every scheduler works with.
INTRA_OP_THREADS, INTER_OP_THREADS = 1, 2


def profile_model(name: str, batch: int, iterations: int = 7, warmup: int = 2, *,
                  model=None, data=None, loss_fn=None) -> dict:
    """Measures per-variable forward and backward compute time of model ``name``.

    Runs ``warmup + iterations`` training steps (forward, loss, gradients; no
    optimizer) of the Keras 3 model at ``batch`` with the bench workers' TF
    threads (:data:`INTRA_OP_THREADS`, :data:`INTER_OP_THREADS`), stamping
    layer outputs and gradients (see the module docstring).

    ``model``, ``data`` (``(x, y)`` of ``batch`` rows) and ``loss_fn``
    replace the named model's own (Keras 3), e.g. to measure what an emulated
    model computes (``prophet_tf.bench.emulated``).

    Returns:
      A JSON-serializable dict: ``model``, ``batch``, ``forward_s``,
      ``backward_s``, ``compute_s`` (their sum), ``step_s`` (median wall time of
      a whole step), ``variables`` (forward order: ``name``, ``shape``,
      ``nbytes``, ``forward_s``, ``backward_ready_s``), ``machine``.
    """
    import keras
    import tensorflow as tf

    from prophet_tf import _native

    try:
        tf.config.threading.set_intra_op_parallelism_threads(INTRA_OP_THREADS)
        tf.config.threading.set_inter_op_parallelism_threads(INTER_OP_THREADS)
    except RuntimeError:  # TensorFlow already started (a model was given): as it is
        pass
    keras.utils.set_random_seed(0)
    model = build_model(name) if model is None else model
    variables = list(model.trainable_variables)
    var_index = {id(v): i for i, v in enumerate(variables)}
    owners = []  # (layer, index of its first trainable variable)
    for layer in _leaf_layers(model):
        own = [var_index[id(v)] for v in layer.trainable_variables if id(v) in var_index]
        if own:
            owners.append((layer, min(own)))
    def stamp_forward(t, key):
        @tf.custom_gradient
        def identity(t):  # ReadyStamp has no registered gradient; it is an identity.
            return _native.ready_stamp(t, key, 0), lambda dy: dy
        return identity(t)

    layer_keys = {}
    for n, (layer, first) in enumerate(owners):
        layer_keys[n] = first
        original = layer.call

        def stamped(*args, _call=original, _key=_LAYER_BASE + n, **kwargs):
            out = _call(*args, **kwargs)
            return tf.nest.map_structure(lambda t: stamp_forward(t, _key), out)

        layer.call = stamped
    if loss_fn is None:
        loss_fn = keras.losses.SparseCategoricalCrossentropy(from_logits=False)

    @tf.function
    def step(x, y):
        x = _native.ready_stamp(x, _INPUT_KEY, 0)
        with tf.GradientTape() as tape:
            out = model(x, training=True)
            loss = stamp_forward(loss_fn(y, out), _LOSS_KEY)
        grads = tape.gradient(loss, variables)
        # Returning the loss keeps its stamp (nothing else consumes it).
        return [loss] + [_native.ready_stamp(g, i, 0) for i, g in enumerate(grads)]

    x, y = synthetic_data(name, batch) if data is None else data
    x, y = tf.constant(x), tf.constant(y)
    forward = {i: [] for i in range(len(variables))}
    ready = {i: [] for i in range(len(variables))}
    totals_f, totals_b, walls = [], [], []
    _native.drain_stamps()
    for it in range(warmup + iterations):
        t0 = time.perf_counter()
        for g in step(x, y):
            g.numpy()
        wall = time.perf_counter() - t0
        stamps = _native.drain_stamps()
        if it < warmup:
            continue
        walls.append(wall)
        at = {int(s["key"]): int(s["t_ns"]) for s in stamps}
        start, loss_t = at[_INPUT_KEY], at[_LOSS_KEY]
        per_var_f = {i: 0 for i in range(len(variables))}
        marks = sorted((at[_LAYER_BASE + n], layer_keys[n]) for n in range(len(owners)))
        previous = start
        for t, first in marks:
            per_var_f[first] += t - previous
            previous = t
        per_var_f[marks[-1][1]] += loss_t - previous  # the head's activation and the loss
        for i in range(len(variables)):
            forward[i].append(per_var_f[i] / 1e9)
            ready[i].append((at[i] - loss_t) / 1e9)
        totals_f.append((loss_t - start) / 1e9)
        totals_b.append((max(at[i] for i in range(len(variables))) - loss_t) / 1e9)
    result_vars = []
    for i, v in enumerate(variables):
        result_vars.append({
            "name": getattr(v, "path", v.name), "shape": [int(d) for d in v.shape],
            "nbytes": int(np.prod(v.shape, dtype=np.int64)) * np.dtype(v.dtype).itemsize,
            "forward_s": statistics.median(forward[i]),
            "backward_ready_s": statistics.median(ready[i])})
    f, b = statistics.median(totals_f), statistics.median(totals_b)
    return {"model": name, "batch": batch, "iterations": iterations,
            "threads": {"intra_op": INTRA_OP_THREADS, "inter_op": INTER_OP_THREADS},
            "num_params": int(model.count_params()),
            "trainable_bytes": sum(v["nbytes"] for v in result_vars),
            "forward_s": f, "backward_s": b, "compute_s": f + b,
            "step_s": statistics.median(walls), "step_s_all": walls,
            "forward_s_all": totals_f, "backward_s_all": totals_b, "variables": result_vars,
            "machine": {"cpus": os.cpu_count(), "platform": platform.platform(),
                        "processor": platform.processor() or platform.machine()}}


def variable_forward_s(profile: dict) -> list[float]:
    """Each variable's forward time, adding up to the profile's ``forward_s``.

    The per-variable ``forward_s`` are medians over the iterations and the
    total is the median of the sums, so the two differ by a few percent: the
    total is shared out in the per-variable medians' proportions. The bench's
    emulated models, the simulator and the ideal bound all place the forward
    this way.
    """
    medians = [float(v["forward_s"]) for v in profile["variables"]]
    listed = sum(medians)
    if listed <= 0:
        return medians
    share = float(profile.get("forward_s", listed)) / listed
    return [f * share for f in medians]


def _leaf_layers(model):
    """Layers that do work (nested models and Sequential wrappers flattened)."""
    out = []
    for layer in model.layers:
        if hasattr(layer, "layers") and layer.layers:
            out.extend(_leaf_layers(layer))
        else:
            out.append(layer)
    return out
