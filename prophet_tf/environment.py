"""Every ``PROPHET_TF_*`` environment variable: its name, who reads it, what it means.

The modules that read or set one take its name from here, and the user guide's
table (docs/guide.md, "Environment variables") lists exactly these
(tests/unit/test_environment.py checks both). How each value is parsed stays
with the module that reads it, named in ``VARIABLES``.
"""
from __future__ import annotations

__all__ = ["SCHEDULER", "TIMELINE", "DEVICE", "LOG_LEVEL", "STATUS_FILE", "ANSWERS_FIRST",
           "SHAPE_MBIT", "TOKEN", "TOKEN_FILE", "TLS_CA", "TLS_SERVER_NAME", "TLS_CERT",
           "TLS_KEY", "VARIABLES"]

SCHEDULER = "PROPHET_TF_SCHEDULER"
TIMELINE = "PROPHET_TF_TIMELINE"
DEVICE = "PROPHET_TF_DEVICE"
LOG_LEVEL = "PROPHET_TF_LOG_LEVEL"
STATUS_FILE = "PROPHET_TF_STATUS_FILE"
ANSWERS_FIRST = "PROPHET_TF_ANSWERS_FIRST"
SHAPE_MBIT = "PROPHET_TF_SHAPE_MBIT"
TOKEN = "PROPHET_TF_TOKEN"
TOKEN_FILE = "PROPHET_TF_TOKEN_FILE"
TLS_CA = "PROPHET_TF_TLS_CA"
TLS_SERVER_NAME = "PROPHET_TF_TLS_SERVER_NAME"
TLS_CERT = "PROPHET_TF_TLS_CERT"
TLS_KEY = "PROPHET_TF_TLS_KEY"

#: name -> (the module that parses it, what it sets)
VARIABLES = {
    SCHEDULER: ("prophet_tf.engine.engine", "scheduler and options of Strategy(scheduler=None)"),
    TIMELINE: ("prophet_tf.engine.timeline", "where Strategy(timeline=None) writes timelines"),
    DEVICE: ("prophet_tf.devices", "the compute device of Strategy(device=None)"),
    LOG_LEVEL: ("prophet_tf.tools.launch", "log level of the launcher and the PS tasks"),
    STATUS_FILE: ("prophet_tf.progress", "where a launched worker reports its progress"),
    ANSWERS_FIRST: ("prophet_tf.engine.engine", "0 turns answers first off"),
    SHAPE_MBIT: ("prophet_tf.ps.shaping", "the bench's shaping inside the transport"),
    TOKEN: ("prophet_tf.ps.security", "the shared token"),
    TOKEN_FILE: ("prophet_tf.ps.security", "a file holding the shared token"),
    TLS_CA: ("prophet_tf.ps.security", "CA certificate a client verifies a TLS PS with"),
    TLS_SERVER_NAME: ("prophet_tf.ps.security", "the name a TLS PS's certificate was issued to"),
    TLS_CERT: ("prophet_tf.ps.security", "a PS's TLS certificate"),
    TLS_KEY: ("prophet_tf.ps.security", "a PS's TLS key"),
}
