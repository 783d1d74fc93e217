"""Worker for test_keras_answers: what Keras reports under prophet_tf.Strategy.

    python answers_worker.py --out DIR [--single --workers W] [--steps-per-execution N]

Trains keras_worker's MLP (Keras 3, Adam) for up to EPOCHS epochs with
validation data, `EarlyStopping(monitor="val_loss")` and
`ReduceLROnPlateau(monitor="val_loss")`, then evaluates and predicts. The
sizes are not multiples of the global batch (8) nor, for the validation and
probe data, of the number of workers: 28 training rows (a last batch of 4),
27 validation and probe rows (a last batch of 3, split 1 + 2).

Writes DIR/worker<i>.json (or single.json with --single): the history, every
batch's logs, the epoch EarlyStopping stopped at, the evaluate results; and
DIR/worker<i>.npz: the predictions and final weights. With --single it is plain
single-process Keras at the global batch: the reference.
"""
from __future__ import annotations

import argparse
import json
import os
import sys
import traceback

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")

import numpy as np  # noqa: E402

import keras_worker as kw  # noqa: E402

GLOBAL_BATCH = 8
EPOCHS = 12
TRAIN_ROWS, VALIDATION_ROWS, PROBE_ROWS = 28, 27, 27


def data():
    train = kw.make_data("mlp", TRAIN_ROWS)
    validation = kw.make_data("mlp", VALIDATION_ROWS, seed=kw.DATA_SEED + 1)
    probe = kw.make_data("mlp", PROBE_ROWS, seed=kw.PROBE_SEED)
    return train, validation, probe


def run(args, strategy=None) -> tuple[dict, dict]:
    K = kw.select_keras("keras3")
    scope = strategy.scope() if strategy is not None else _null()
    with scope:
        model = kw.build_model("mlp")
        model.compile(optimizer=K.optimizers.Adam(0.02),
                      loss=K.losses.SparseCategoricalCrossentropy(from_logits=True),
                      metrics=["accuracy"], steps_per_execution=args.steps_per_execution)
    (x, y), (xv, yv), (xp, yp) = data()

    batches = []

    class BatchLogs(K.callbacks.Callback):
        def on_train_batch_end(self, batch, logs=None):
            batches.append({k: float(v) for k, v in (logs or {}).items()})

    stopper = K.callbacks.EarlyStopping(monitor="val_loss", patience=2, min_delta=0.005)
    plateau = K.callbacks.ReduceLROnPlateau(monitor="val_loss", factor=0.5, patience=0,
                                            min_delta=0.03)
    history = model.fit(x, y, batch_size=GLOBAL_BATCH, epochs=EPOCHS, shuffle=False, verbose=0,
                        validation_data=(xv, yv), callbacks=[BatchLogs(), stopper, plateau])
    evaluation = model.evaluate(xp, yp, batch_size=GLOBAL_BATCH, verbose=0, return_dict=True)
    prediction = model.predict(xp, batch_size=GLOBAL_BATCH, verbose=0)
    info = {"history": {k: [float(v) for v in vs] for k, vs in history.history.items()},
            "batches": batches, "stopped_epoch": int(stopper.stopped_epoch),
            "epochs_run": len(history.history["loss"]),
            "evaluate": {k: float(v) for k, v in evaluation.items()}}
    arrays = {"predict": np.asarray(prediction)}
    arrays.update({f"t{j}": v.numpy() for j, v in enumerate(model.trainable_variables)})
    return info, arrays


class _null:
    def __enter__(self):
        return self

    def __exit__(self, *exc):
        return False


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--out", required=True)
    parser.add_argument("--single", action="store_true")
    parser.add_argument("--steps-per-execution", type=int, default=1)
    args = parser.parse_args(argv)
    kw.limit_threads()
    os.makedirs(args.out, exist_ok=True)
    if args.single:
        info, arrays = run(args)
        name = "single"
    else:
        import prophet_tf
        strategy = prophet_tf.Strategy(rpc_timeout_s=60.0)
        name = f"worker{strategy.worker_index}"
        try:
            info, arrays = run(args, strategy)
        except Exception as e:  # noqa: BLE001 - reported to the test.
            info, arrays = {"error": {"type": type(e).__name__, "message": str(e),
                                      "traceback": traceback.format_exc()[-4000:]}}, {}
        strategy.shutdown()
    with open(os.path.join(args.out, f"{name}.json"), "w") as f:
        json.dump(info, f, indent=1)
    np.savez(os.path.join(args.out, f"{name}.npz"), **arrays)
    print(f"{name}: done", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
