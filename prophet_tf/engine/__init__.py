"""The worker-side engine: scheduling and moving gradients and parameters.

Nothing under ``prophet_tf.engine`` imports TensorFlow: the worker hands the
engine its op runtime. ``Engine`` (which needs grpc) is imported on first use,
so ``prophet_tf.engine.schedulers`` and ``prophet_tf.engine.dispatch`` stay
light to import.
"""

__all__ = ["Engine"]


def __getattr__(name):
    if name in __all__:
        from prophet_tf.engine import engine
        return getattr(engine, name)
    raise AttributeError(f"module 'prophet_tf.engine' has no attribute {name!r}")
