"""Worker for test_saved_models: saving under prophet_tf.Strategy, then resuming.

    python resume_worker.py --phase first|load|backup --out DIR

keras_worker's MLP (Keras 3) with Adam, 32 rows in global batches of 8: one
epoch is 4 steps.

  first   fit 1 epoch with ModelCheckpoint(DIR/w<i>/checkpoint.keras) and
          BackupAndRestore(DIR/w<i>/backup, kept), then model.save(DIR/w<i>/saved.keras).
  load    keras.models.load_model(DIR/w<i>/saved.keras) inside scope(), fit 1 more epoch.
  backup  a fresh model; fit(epochs=2) with BackupAndRestore on a copy of DIR/w<i>/backup:
          Keras restores the first epoch's backup and trains the second.

Each writes DIR/<phase>-worker<i>.npz (trainable weights t<j>) and, on an error,
DIR/<phase>-worker<i>.error.
"""
from __future__ import annotations

import argparse
import os
import shutil
import sys
import traceback

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")

import numpy as np  # noqa: E402

import keras_worker as kw  # noqa: E402

GLOBAL_BATCH = 8
ROWS = 32


def data():
    return kw.make_data("mlp", ROWS)


def build():
    K = kw.K
    model = kw.build_model("mlp")
    model.compile(optimizer=K.optimizers.Adam(0.02),
                  loss=K.losses.SparseCategoricalCrossentropy(from_logits=True),
                  metrics=["accuracy"])
    return model


def fit(model, epochs, callbacks=()):
    x, y = data()
    model.fit(x, y, batch_size=GLOBAL_BATCH, epochs=epochs, shuffle=False, verbose=0,
              callbacks=list(callbacks))


def phase(name: str, mine: str, strategy):
    K = kw.K
    if name == "first":
        with strategy.scope():
            model = build()
        fit(model, 1, [K.callbacks.ModelCheckpoint(os.path.join(mine, "checkpoint.keras")),
                       K.callbacks.BackupAndRestore(os.path.join(mine, "backup"),
                                                    delete_checkpoint=False)])
        model.save(os.path.join(mine, "saved.keras"))
    elif name == "load":
        with strategy.scope():
            model = K.models.load_model(os.path.join(mine, "saved.keras"))
        fit(model, 1)
    else:
        # A copy: the first epoch's backup stays for the test to read.
        shutil.copytree(os.path.join(mine, "backup"), os.path.join(mine, "backup-resume"))
        with strategy.scope():
            model = build()
        fit(model, 2, [K.callbacks.BackupAndRestore(os.path.join(mine, "backup-resume"))])
    return model


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--phase", choices=["first", "load", "backup"], required=True)
    parser.add_argument("--out", required=True)
    args = parser.parse_args(argv)
    kw.limit_threads()
    kw.select_keras("keras3")
    import prophet_tf
    strategy = prophet_tf.Strategy(rpc_timeout_s=60.0)
    index = strategy.worker_index
    mine = os.path.join(args.out, f"w{index}")
    os.makedirs(mine, exist_ok=True)
    name = os.path.join(args.out, f"{args.phase}-worker{index}")
    try:
        model = phase(args.phase, mine, strategy)
        np.savez(name + ".npz", **{f"t{j}": v.numpy()
                                   for j, v in enumerate(model.trainable_variables)})
    except Exception:  # noqa: BLE001 - reported to the test.
        with open(name + ".error", "w") as f:
            f.write(traceback.format_exc())
    strategy.shutdown()
    print(f"worker {index}: {args.phase} done", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
