"""Models whose compute is emulated: real variables, GPU-like compute time, no CPU burnt.

A GPU worker computes without its host's CPU, which then serves the network.
On a 2-core machine, real compute competes with the PS and the transport for
the same cores, so the bench can instead emulate it (``--compute emulated``):

- every trainable variable of a profiled model (``models.profile_model``)
  exists with its real name, shape and dtype, in the model's forward order,
  one emulated layer per layer of the original model;
- a layer reads its variables (so under prophet_tf its forward waits for their
  parameters, exactly as the real model's would), then takes the profile's
  forward time for that layer in an ``EmulatedDelay`` op: a timer completes
  the op, no thread sleeps and no core spins (``prophet_tf.bench.emulation``);
- in backprop, a layer's gradients become ready its profiled backward time
  after the next layer's, again in an ``EmulatedDelay``; every gradient is a
  real tensor of its variable's size (zeros: the weights do not move, the
  bytes still do);
- within a step, a layer's delay counts from when its inputs were ready to
  the emulated device (the previous delay's end, its parameters' arrival),
  not from when an executor thread got to it: a GPU's launch queue hides
  that host latency too, and over a hundred layers it would add up (about
  0.1 ms a layer on an idle 2-core VM, more when the cores are busy).

Profile times are scaled by ``scale`` (``--compute-ms`` and ``--time-scale``
set it, see ``prophet-tf bench``). Built for Keras 3 or tf_keras alike, so
the tf-mwms baseline trains the same emulated model.

A layer's backward gap is the readiness of its gradients less that of the
next layer's (the profile's ``backward_ready_s`` measured from the loss);
where the original model's backprop was not in reverse layer order (branches
of an Inception module), a negative gap is taken as 0.
"""
from __future__ import annotations

import numpy as np

from prophet_tf.bench import models

__all__ = ["emulated_layers", "build_emulated_model", "emulated_data", "compute_note",
           "INPUT_WIDTH"]

#: The emulated model's input and every layer's activation: (batch, INPUT_WIDTH).
INPUT_WIDTH = 1


#: A step computing longer than this as run gets a warning in :func:`compute_note`.
LONG_STEP_S = 60.0


def compute_note(model: str, profiled_s: float, compute_ms: float | None,
                 time_scale: float) -> str:
    """What a bench run's emulated step computes, for its first lines: at the
    cluster's scale (``compute_ms``, or the profile's ``profiled_s`` as measured
    when None) and as run (times ``time_scale``). A saved profile may be a CPU's
    (ResNet-50's: about 26 s a step): without ``--compute-ms`` a run at a time
    scale can take many minutes a step, which would look like a hang."""
    step_s = compute_ms / 1e3 if compute_ms else profiled_s
    source = (f"--compute-ms {compute_ms:g}" if compute_ms else
              f"{model}'s profile as measured; --compute-ms sets it")
    note = (f"emulated compute {step_s * 1e3:.1f} ms per step ({source}), "
            f"{step_s * time_scale * 1e3:.1f} ms as run at time scale {time_scale:g}")
    if step_s * time_scale > LONG_STEP_S:
        note += (f"; WARNING: every step computes for {step_s * time_scale / 60:.1f} min "
                 f"as run")
    return note


def emulated_layers(profile: dict, scale: float = 1.0) -> list[dict]:
    """The layers of ``profile``: ``name``, ``variables`` (name, shape, dtype),
    ``forward_s`` and ``backward_s`` (its gap in backprop), times ``scale``.
    Their forward times add up to the profile's ``forward_s``, their backward
    gaps to its latest gradient readiness.

    Variables ``a/b/kernel`` and ``a/b/bias`` belong to layer ``a/b``; the
    profile lists them in forward order, a layer's variables together.

    Raises:
        ValueError: ``scale`` is not a positive finite number, or the profile
            has no variables; names what was received.
    """
    if not (isinstance(scale, (int, float)) and np.isfinite(scale) and scale > 0):
        raise ValueError(f"scale must be a positive number. Received: scale={scale!r}")
    variables = profile.get("variables") or []
    if not variables:
        raise ValueError(f"The profile of {profile.get('model')!r} lists no variables")
    layers: list[dict] = []
    for v, forward_s in zip(variables, models.variable_forward_s(profile)):
        layer_name = v["name"].rsplit("/", 1)[0] if "/" in v["name"] else v["name"]
        if not layers or layers[-1]["name"] != layer_name:
            layers.append({"name": layer_name, "variables": [], "forward_s": 0.0,
                           "ready_s": 0.0})
        layer = layers[-1]
        layer["variables"].append({"name": v["name"].rsplit("/", 1)[-1],
                                   "shape": tuple(int(d) for d in v["shape"]),
                                   "dtype": v.get("dtype", "float32")})
        layer["forward_s"] += forward_s
        layer["ready_s"] = max(layer["ready_s"], float(v["backward_ready_s"]))
    later = 0.0  # readiness of the next layer's gradients (the last layer's: the loss)
    for layer in reversed(layers):
        layer["backward_s"] = max(0.0, layer["ready_s"] - later)
        later = max(later, layer["ready_s"])
    return [{"name": layer["name"], "variables": layer["variables"],
             "forward_s": layer["forward_s"] * scale,
             "backward_s": layer["backward_s"] * scale}
            for layer in layers]


def build_emulated_model(profile: dict, keras_module=None, scale: float = 1.0):
    """The emulated model of ``profile`` (uncompiled), in ``keras_module``
    (``keras`` or ``tf_keras``; default Keras 3). Train it on
    :func:`emulated_data` with a mean squared error loss."""
    import tensorflow as tf

    from prophet_tf.bench import emulation

    if keras_module is None:
        import keras as keras_module

    class EmulatedLayer(keras_module.layers.Layer):
        """Reads its variables, then takes its forward time; its gradients are
        ready its backward time after the output's gradient arrives."""

        def __init__(self, spec: dict, first: bool, **kwargs):
            super().__init__(name=spec["name"].replace("/", "_"), **kwargs)
            self.spec = spec
            # Within a step the host's latency between layers stays hidden, as
            # behind a GPU's launch queue; the step's start is the host's.
            self.hide_launch_gap = not first
            self.weights_ = [self.add_weight(name=v["name"], shape=v["shape"],
                                             dtype=v["dtype"], initializer="zeros",
                                             trainable=True)
                             for v in spec["variables"]]

        def call(self, x):
            backward_s = self.spec["backward_s"]
            # One element of each variable, times 0: the read is real (it waits
            # for the parameter), the arithmetic is not, and the gradient is a
            # real zero tensor of the variable's shape.
            touched = x
            for w in self.weights_:
                first = tf.reshape(tf.cast(tf.convert_to_tensor(w), x.dtype), [-1])[:1]
                touched = touched + 0.0 * first

            @tf.custom_gradient
            def backward_time(t):
                def grad(dy):
                    return emulation.delay(dy, backward_s, hide_launch_gap=True)
                return tf.identity(t), grad

            return emulation.delay(backward_time(touched), self.spec["forward_s"],
                                   hide_launch_gap=self.hide_launch_gap)

    inputs = keras_module.Input((INPUT_WIDTH,))
    out = inputs
    for i, spec in enumerate(emulated_layers(profile, scale)):
        out = EmulatedLayer(spec, first=i == 0)(out)
    return keras_module.Model(inputs, out, name=f"emulated_{profile.get('model', 'model')}")


def emulated_data(num_samples: int) -> tuple[np.ndarray, np.ndarray]:
    """Inputs and targets of the emulated models (their values do not matter)."""
    return (np.ones((num_samples, INPUT_WIDTH), np.float32),
            np.zeros((num_samples, INPUT_WIDTH), np.float32))
