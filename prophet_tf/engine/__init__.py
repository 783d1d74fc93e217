"""The worker-side engine: scheduling and moving gradients and parameters."""
from prophet_tf.engine.engine import Engine, EngineStamp

__all__ = ["Engine", "EngineStamp"]
