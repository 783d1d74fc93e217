"""The parameter server: protocol, sharding, the gRPC service and the worker's client.

``protocol``, ``sharding`` and ``client`` are light; ``servicer`` (with
``registration``, ``aggregation``, ``apply``) and so ``server.main`` import
TensorFlow and Keras to apply the optimizer.

    python -m prophet_tf.ps.server --num-workers 2 --port 0
    prophet-tf ps            # with TF_CONFIG naming this "ps" task
"""

__all__ = ["protocol", "sharding", "client", "server", "servicer"]
