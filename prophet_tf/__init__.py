"""prophet_tf: multi-worker Keras 3 training through a gRPC parameter server,
with gradient traffic scheduled by Prophet.

    strategy = prophet_tf.Strategy()          # cluster from TF_CONFIG
    with strategy.scope():
        model = ...; model.compile(...)
    model.fit(data, epochs=...)
"""

__version__ = "0.1.0"

__all__ = ["Strategy", "ops_available", "evaluate_checkpoints", "mark_training_done",
           "__version__"]

# The evaluator task's API imports neither TensorFlow nor grpc at import.
from prophet_tf.evaluator import evaluate_checkpoints, mark_training_done  # noqa: E402


def __getattr__(name):
    # Imported on first use: `prophet-tf launch` and the CLI stay light.
    if name == "Strategy":
        from prophet_tf.strategy import Strategy  # says how to install TensorFlow if absent
        return Strategy
    if name == "ops_available":
        from prophet_tf._native import ops_available
        return ops_available
    raise AttributeError(f"module 'prophet_tf' has no attribute {name!r}")
