"""The parameter server: sharding, the gRPC service and the worker's client.

``sharding`` and ``client`` are light; ``servicer`` (and so ``server.main``)
imports TensorFlow and Keras to apply the optimizer.

    python -m prophet_tf.ps.server --num-workers 2 --port 0
    prophet-tf ps            # with TF_CONFIG naming this "ps" task
"""

__all__ = ["sharding", "client", "server", "servicer"]
