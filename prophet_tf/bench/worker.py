"""One bench worker: trains a bench model for some steps and writes its step times.

    python -m prophet_tf.bench.worker --framework prophet --model cnn --steps 30 \\
        --global-batch 64 --out worker0.json

The cluster comes from TF_CONFIG (set by ``prophet-tf bench``); with
``--framework prophet`` the scheduler comes from PROPHET_TF_SCHEDULER and the
model is Keras 3 under ``prophet_tf.Strategy``; with ``--framework tf-mwms``
it is the same model rebuilt in tf_keras under TensorFlow's
MultiWorkerMirroredStrategy (ring all-reduce over gRPC); ``--framework local``
profiles the model's compute on this worker's share of each batch with no
communication (``models.profile_model``; the report's ``step_times_s`` is
its forward + backward time). Both read the same
synthetic data in the same order, ``--global-batch`` rows per step split
evenly over the workers, with the same optimizer.

Step times: a Keras callback takes ``time.monotonic()`` at the start of
the first batch and at the end of every batch; step i's time is the time
between the ends of batches i-1 and i (step 0: since its start). The output
JSON has ``step_times_s`` (every step, warm-up included; the bench drops the
warm-up) and the framework, scheduler and worker index.

``--compute emulated --scale S`` trains instead the emulated model of the
model's saved profile (``prophet_tf.bench.emulated``): the real variables,
compute times of the profile times S that use no CPU.
"""
from __future__ import annotations

import argparse
import json
import os
import sys
import time

from prophet_tf import lean_keras

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")

FRAMEWORKS = ("prophet", "tf-mwms", "local")


def _parse(argv):
    parser = argparse.ArgumentParser(prog="python -m prophet_tf.bench.worker",
                                     description=__doc__.split("\n\n")[0])
    parser.add_argument("--framework", choices=FRAMEWORKS, required=True)
    parser.add_argument("--model", default="cnn")
    parser.add_argument("--steps", type=int, required=True, help="training steps (all counted)")
    parser.add_argument("--global-batch", type=int, default=64)
    parser.add_argument("--out", required=True, help="where to write the step times (JSON)")
    parser.add_argument("--compute", choices=("real", "emulated"), default="real")
    parser.add_argument("--scale", type=float, default=1.0,
                        help="emulated compute: the profile's times are multiplied by this")
    parser.add_argument("--global-clipnorm", type=float, default=None,
                        help="the SGD's global_clipnorm (default: none)")
    parser.add_argument("--bytes-per-pack", type=int, default=0,
                        help="tf-mwms: CommunicationOptions(bytes_per_pack) (default 0, "
                             "TensorFlow's: one pack)")
    args = parser.parse_args(argv)
    if args.bytes_per_pack < 0 or (args.bytes_per_pack and args.framework != "tf-mwms"):
        parser.error(f"--bytes-per-pack is a byte count >= 0, for --framework tf-mwms. "
                     f"Received: --bytes-per-pack={args.bytes_per_pack}, "
                     f"--framework {args.framework}")
    if args.compute == "emulated" and args.framework == "local":
        parser.error("--framework local profiles real compute; emulated compute is the "
                     "profile itself. Received: --compute emulated")
    if args.steps < 1 or args.global_batch < 1:
        parser.error(f"--steps and --global-batch must be >= 1. Received: --steps={args.steps}, "
                     f"--global-batch={args.global_batch}")
    return args


def _timer_callback(base):
    class StepTimer(base):
        """Wall-clock time at the start of the first batch and at every batch's end."""

        def __init__(self):
            super().__init__()
            self.begin = None
            self.ends = []

        # time.monotonic: one clock for every process (the bench compares them).
        def on_train_batch_begin(self, batch, logs=None):
            if self.begin is None:
                self.begin, self.cpu_begin = time.monotonic(), cpu_seconds()

        def on_train_batch_end(self, batch, logs=None):
            self.ends.append(time.monotonic())
            self.cpu_end = cpu_seconds()

        def cpu_busy(self):
            """This process' CPU time over the wall time of training."""
            return (self.cpu_end - self.cpu_begin) / (self.ends[-1] - self.begin)

        def step_times(self):
            marks = [self.begin] + self.ends
            return [b - a for a, b in zip(marks, marks[1:])]

    return StepTimer()


def main(argv=None) -> int:
    args = _parse(sys.argv[1:] if argv is None else argv)
    lean_keras.skip_keras_integrations()  # Before TensorFlow imports Keras: unused here.
    import tensorflow as tf

    from prophet_tf.bench import models

    tf.config.threading.set_intra_op_parallelism_threads(models.INTRA_OP_THREADS)
    tf.config.threading.set_inter_op_parallelism_threads(models.INTER_OP_THREADS)
    build, (x, y), loss = _model_builder(args)
    tf_config = json.loads(os.environ.get("TF_CONFIG", "{}"))
    index = int(tf_config.get("task", {}).get("index", 0))
    scheduler = None
    if args.framework == "prophet":
        import keras

        import prophet_tf
        keras.utils.set_random_seed(0)
        strategy = prophet_tf.Strategy()
        scheduler = strategy.scheduler
        with strategy.scope():
            model = build(keras)
            model.compile(optimizer=keras.optimizers.SGD(
                0.01, momentum=0.9, global_clipnorm=args.global_clipnorm), loss=loss(keras))
        timer = _timer_callback(keras.callbacks.Callback)
        model.fit(x, y, batch_size=args.global_batch, epochs=1, shuffle=False, verbose=0,
                  callbacks=[timer])
        strategy.shutdown()
    elif args.framework == "local":
        # Compute only: the per-variable profile (models.profile_model) of this
        # worker's share of the batch, no communication. Run on every worker
        # host at once, it measures compute under the same CPU sharing as the
        # distributed runs.
        workers = len(tf_config.get("cluster", {}).get("worker", [])) or 1
        profile = models.profile_model(args.model, args.global_batch // workers,
                                       iterations=max(1, args.steps - 2), warmup=2)
        result = {"framework": args.framework, "scheduler": None, "worker": index,
                  "model": args.model, "num_params": profile["num_params"],
                  "global_batch": args.global_batch, "profile": profile,
                  "step_times_s": [profile["compute_s"]]}
        _write(args.out, result)
        return 0
    else:
        import tf_keras
        tf_keras.utils.set_random_seed(0)
        options = tf.distribute.experimental.CommunicationOptions(
            implementation=tf.distribute.experimental.CommunicationImplementation.RING,
            bytes_per_pack=args.bytes_per_pack)
        strategy = tf.distribute.MultiWorkerMirroredStrategy(communication_options=options)
        with strategy.scope():
            model = build(tf_keras)
            model.compile(optimizer=tf_keras.optimizers.SGD(
                0.01, momentum=0.9, global_clipnorm=args.global_clipnorm), loss=loss(tf_keras))
        dataset = tf.data.Dataset.from_tensor_slices((x, y)).batch(args.global_batch)
        data_options = tf.data.Options()
        data_options.experimental_distribute.auto_shard_policy = \
            tf.data.experimental.AutoShardPolicy.DATA
        dataset = dataset.with_options(data_options)
        timer = _timer_callback(tf_keras.callbacks.Callback)
        model.fit(dataset, epochs=1, steps_per_epoch=args.steps, verbose=0, callbacks=[timer])
    result = {"framework": args.framework, "scheduler": scheduler, "worker": index,
              "model": args.model, "num_params": int(model.count_params()),
              "global_batch": args.global_batch, "step_times_s": timer.step_times(),
              "cpu_busy": timer.cpu_busy(),
              "train_window": [timer.begin, timer.ends[-1]]}
    _write(args.out, result)
    return 0


def _model_builder(args):
    """``(build(keras_module), (x, y), loss(keras_module))`` of the run's model."""
    from prophet_tf.bench import emulated, models, saved_profiles

    num_samples = args.steps * args.global_batch
    if args.compute == "emulated":
        profile = saved_profiles.load_profile(args.model)
        return (lambda k: emulated.build_emulated_model(profile, k, args.scale),
                emulated.emulated_data(num_samples), lambda k: k.losses.MeanSquaredError())
    return (lambda k: models.build_model(args.model, k),
            models.synthetic_data(args.model, num_samples),
            lambda k: k.losses.SparseCategoricalCrossentropy(from_logits=True))


def cpu_seconds(pid: int | str = "self") -> float | None:
    """A live process' CPU time so far, all threads (None: it is gone)."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            fields = f.read().rsplit(")", 1)[1].split()
    except OSError:
        return None
    # After the command: utime and stime are fields 11 and 12 (0-based), in ticks.
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def _write(path: str, result: dict) -> None:
    tmp = f"{path}.tmp"
    with open(tmp, "w") as f:
        json.dump(result, f)
    os.replace(tmp, path)


if __name__ == "__main__":
    sys.exit(main())
