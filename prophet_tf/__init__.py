"""prophet_tf: multi-worker Keras 3 training through a gRPC parameter server,
with gradient traffic scheduled by Prophet."""

__version__ = "0.1.0"

__all__ = ["__version__"]
