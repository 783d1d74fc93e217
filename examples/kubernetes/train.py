"""The TFJob's training script: chief, worker or evaluator, as its TF_CONFIG says.

    python examples/kubernetes/train.py --checkpoint-dir /checkpoints/digits

- chief and workers train train_digits.py's CNN under prophet_tf.Strategy;
  the chief (worker 0) also saves a checkpoint per epoch into
  --checkpoint-dir (ModelCheckpoint, `epoch-001.keras`, ...) and, once
  training is over, marks it done;
- the evaluator joins no training: it evaluates each checkpoint on the test
  set as it appears, writes the metrics next to it (`evaluations/epoch-001.json`,
  ...), and exits once the chief has marked training done;
- PS tasks do not run this script: their pods run `prophet-tf ps`.

A TFJob with a Chief succeeds when the chief exits, and `cleanPodPolicy:
Running` then deletes the pods still running: the PS tasks, and an evaluator
still at work. So when the cluster lists an evaluator, the chief waits (at most
--evaluator-wait-s) for its metrics of the last checkpoint before it exits.
"""
import argparse
import json
import os
import pathlib
import sys
import time

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parents[1]))  # examples/: train_digits

import prophet_tf  # noqa: E402
from prophet_tf import cluster  # noqa: E402

CHECKPOINTS = "epoch-{epoch:03d}.keras"  # one file per epoch: the evaluator sees every one
RESULTS = "evaluations"  # the evaluator's metrics, a JSON file per checkpoint


def result_path(checkpoint_dir: str, checkpoint: str) -> str:
    return os.path.join(checkpoint_dir, RESULTS, os.path.splitext(checkpoint)[0] + ".json")


def train(task, args) -> None:
    import keras
    import train_digits

    keras.utils.set_random_seed(0)  # the same initial weights and shuffles on every worker
    (x_train, y_train), _ = train_digits.load_data()
    strategy = prophet_tf.Strategy()
    with strategy.scope():
        model = train_digits.build_model()
    chief = strategy.worker_index == 0
    who = f"worker {strategy.worker_index} of {strategy.num_replicas_in_sync}"
    print(f"{who}: training {args.epochs} epochs", flush=True)
    # Only the chief writes into the shared directory; saving involves no other worker.
    callbacks = [keras.callbacks.ModelCheckpoint(
        os.path.join(args.checkpoint_dir, CHECKPOINTS))] if chief else []
    history = model.fit(x_train, y_train, batch_size=train_digits.GLOBAL_BATCH,
                        epochs=args.epochs, verbose=0, shuffle=True,
                        callbacks=callbacks)
    print(f"{who}: final loss {history.history['loss'][-1]:.4f}", flush=True)
    if chief:
        print(f"{who}: marked training done: "
              f"{prophet_tf.mark_training_done(args.checkpoint_dir)}", flush=True)
        if task.evaluators:  # the TFJob has an Evaluator (TF_CONFIG lists it)
            wait_for_evaluator(args, CHECKPOINTS.format(epoch=len(history.epoch)), who)


def wait_for_evaluator(args, checkpoint: str, who: str) -> None:
    path = result_path(args.checkpoint_dir, checkpoint)
    deadline = time.monotonic() + args.evaluator_wait_s
    while not os.path.exists(path):
        if time.monotonic() > deadline:
            print(f"{who}: no evaluation of {checkpoint} after {args.evaluator_wait_s} s; "
                  "exiting without it", flush=True)
            return
        time.sleep(1.0)
    with open(path) as f:
        print(f"{who}: the evaluator's metrics of {checkpoint}: {f.read().strip()}", flush=True)


def evaluate(task, args) -> None:
    import train_digits

    _, (x_test, y_test) = train_digits.load_data()

    def on_test_set(model, path):
        metrics = model.evaluate(x_test, y_test, batch_size=train_digits.GLOBAL_BATCH,
                                 verbose=0, return_dict=True)
        line = json.dumps({"checkpoint": os.path.basename(path),
                           **{k: float(v) for k, v in metrics.items()}})
        print("evaluator: " + line, flush=True)
        # Kept on the volume: the pod and its log may be deleted with the job.
        out = result_path(args.checkpoint_dir, os.path.basename(path))
        os.makedirs(os.path.dirname(out), exist_ok=True)
        with open(out + ".tmp", "w") as f:
            f.write(line + "\n")
        os.replace(out + ".tmp", out)
        return metrics

    print(f"evaluator {task.task_index}: watching {args.checkpoint_dir} "
          f"(training: {task.num_workers} workers, {task.num_ps} PS tasks)", flush=True)
    done = prophet_tf.evaluate_checkpoints(args.checkpoint_dir, on_test_set,
                                           poll_s=args.poll_s, timeout_s=args.timeout_s)
    print(f"evaluator {task.task_index}: training done, {len(done)} checkpoints evaluated",
          flush=True)


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--checkpoint-dir", required=True,
                        help="a directory the chief and the evaluator share; one per run")
    parser.add_argument("--epochs", type=int, default=8)
    parser.add_argument("--poll-s", type=float, default=5.0,
                        help="evaluator: seconds between two looks at the directory")
    parser.add_argument("--timeout-s", type=float, default=None,
                        help="evaluator: give up after this long without a new checkpoint")
    parser.add_argument("--evaluator-wait-s", type=float, default=600.0,
                        help="chief: how long to wait for the evaluator's last metrics")
    args = parser.parse_args(argv)
    task = cluster.resolve()  # TF_CONFIG, as the TFJob operator sets it
    if task.is_evaluator:
        evaluate(task, args)
    elif task.is_worker:
        train(task, args)
    else:
        print(f"train.py: a {task.task_type} task runs `prophet-tf ps`, not this script. "
              f"Received: TF_CONFIG task type={task.task_type!r}", file=sys.stderr)
        return 2
    return 0


if __name__ == "__main__":
    sys.exit(main())
