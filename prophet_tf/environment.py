"""Every ``PROPHET_TF_*`` environment variable: its name, who reads it, what it means.

The modules that read or set one take its name from here, and the user guide's
table (docs/guide.md, "Environment variables") is rendered from ``VARIABLES``
(``prophet-tf report docs/guide.md``; tests/unit/test_environment.py and
test_report.py check both). How each value is parsed stays with the module
that reads it, named in ``VARIABLES``.
"""
from __future__ import annotations

from typing import NamedTuple

__all__ = ["SCHEDULER", "TIMELINE", "DEVICE", "LOG_LEVEL", "STATUS_FILE", "ANSWERS_FIRST",
           "SHAPE_MBIT", "TOKEN", "TOKEN_FILE", "TLS_CA", "TLS_SERVER_NAME", "TLS_CERT",
           "TLS_KEY", "Variable", "VARIABLES", "OTHER_VARIABLES", "markdown_table"]

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

class Variable(NamedTuple):
    """One environment variable: who reads it, what it means (Markdown)."""
    module: str  #: the module that parses it ("" for another program's variable)
    read_by: str  #: the tasks or commands that read it
    meaning: str


#: Every PROPHET_TF_* variable, in the order of the guide's table.
VARIABLES = {
    SCHEDULER: Variable("prophet_tf.engine.engine", "workers",
                        "scheduler and options when `Strategy(scheduler=None)`"),
    TIMELINE: Variable("prophet_tf.engine.timeline", "workers",
                       "where to write timelines when `Strategy(timeline=None)`"),
    DEVICE: Variable("prophet_tf.devices", "workers, `doctor`",
                     "compute device when `Strategy(device=None)` (e.g. `/gpu:1`, "
                     "`/cpu:0`); unset: the first GPU, else the CPU"),
    LOG_LEVEL: Variable("prophet_tf.tools.launch", "`ps`, `launch`",
                        "log level (`INFO`); `launch --log-level` sets it for every task"),
    STATUS_FILE: Variable("prophet_tf.progress", "workers",
                          "set by `launch`: where a worker reports its progress"),
    TOKEN: Variable("prophet_tf.ps.security", "all",
                    "the shared token (see [Security](#security))"),
    TOKEN_FILE: Variable("prophet_tf.ps.security", "all",
                         "a file holding the shared token"),
    TLS_CERT: Variable("prophet_tf.ps.security", "`ps`", "a TLS PS's certificate"),
    TLS_KEY: Variable("prophet_tf.ps.security", "`ps`", "a TLS PS's private key"),
    TLS_CA: Variable("prophet_tf.ps.security", "workers, `doctor`",
                     "the CA certificate a client verifies a TLS PS with"),
    TLS_SERVER_NAME: Variable("prophet_tf.ps.security", "workers, `doctor`",
                              "the name a TLS PS's certificate was issued to, when the "
                              "workers dial another address"),
    ANSWERS_FIRST: Variable("prophet_tf.engine.engine", "workers",
                            "`0` turns off [answers first](design.md#how-it-works) (for "
                            "side-by-side runs); on by default"),
    SHAPE_MBIT: Variable("prophet_tf.ps.shaping", "workers",
                         "set by `prophet-tf bench` without network namespaces: shape each "
                         "PS connection inside the transport (see "
                         "[benchmarks](benchmarks.md#emulated-cluster))"),
}

#: Other programs' variables that prophet_tf reads or sets, listed in the same table.
OTHER_VARIABLES = {
    "TF_CONFIG": Variable("", "workers, `ps`, `doctor`", "the cluster and this task"),
    "TF_CPP_MIN_LOG_LEVEL": Variable("", "all (TensorFlow)",
                                     "`launch` sets 2 unless set; 0 keeps TensorFlow's "
                                     "start-up banners"),
    "CUDA_VISIBLE_DEVICES": Variable("", "all (TensorFlow, CUDA)",
                                     "the GPUs a task sees; `launch --gpus N` gives each "
                                     "worker one (split from the caller's list, else "
                                     "0..N-1) and every PS task `\"\"`"),
}


def markdown_table() -> str:
    """The user guide's table of environment variables (``prophet-tf report``
    renders it into docs/guide.md)."""
    lines = ["| variable | read by | meaning |", "|---|---|---|"]
    for name, v in {**OTHER_VARIABLES, **VARIABLES}.items():
        lines.append(f"| `{name}` | {v.read_by} | {v.meaning} |")
    return "\n".join(lines) + "\n"
