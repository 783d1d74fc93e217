"""The worker-side engine: scheduling and moving gradients and parameters.

`prophet_tf.engine.schedulers` needs no TensorFlow; the engine itself is
imported on first use so that the schedulers stay light to import.
"""

__all__ = ["Engine", "EngineStamp"]


def __getattr__(name):
    if name in __all__:
        from prophet_tf.engine import engine
        return getattr(engine, name)
    raise AttributeError(f"module 'prophet_tf.engine' has no attribute {name!r}")
