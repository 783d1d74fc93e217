"""Generated gRPC code for prophet_tf.ps.v1 (built from protos/ by setup.py)."""
