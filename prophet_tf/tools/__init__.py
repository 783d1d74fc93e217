"""Command-line tools around a training job: launch, doctor, plot.

Tools may import anything in prophet_tf; nothing under prophet_tf.ps or
prophet_tf.engine imports a tool (tests/unit/test_layering.py checks it).
"""
