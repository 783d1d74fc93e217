"""Gradient schedulers: which ready partitions to send next, grouped how.

- :mod:`.base`: :class:`ReadyItem`, the in-flight :class:`Window` of a link,
  the :class:`Scheduler` interface and the contract the dispatch follows.
- :mod:`.fifo`, :mod:`.p3`, :mod:`.bytescheduler`, :mod:`.prophet`: the
  schedulers, each with how it sizes its window.
- :mod:`.profiler`: what Prophet learns from a run (bursts, bandwidth, drift).

Nothing here imports TensorFlow or reads a clock.
"""
from __future__ import annotations

import numbers

from prophet_tf.engine.schedulers.base import (DEFAULT_PARTITION_BYTES, MAX_BLOCK_BYTES,
                                               ReadyItem, Scheduler, Window, Windows, urgency)
from prophet_tf.engine.schedulers.bytescheduler import ByteScheduler
from prophet_tf.engine.schedulers.fifo import FifoScheduler
from prophet_tf.engine.schedulers.p3 import P3Scheduler
from prophet_tf.engine.schedulers.prophet import ProphetScheduler

__all__ = ["ReadyItem", "urgency", "Window", "Windows", "Scheduler", "FifoScheduler",
           "P3Scheduler", "ByteScheduler", "ProphetScheduler", "SCHEDULERS",
           "DEFAULT_PARTITION_BYTES", "MAX_BLOCK_BYTES", "make_scheduler", "validate_scheduler",
           "parse_scheduler", "split_specs"]

SCHEDULERS: dict[str, type[Scheduler]] = {
    cls.name: cls for cls in (FifoScheduler, P3Scheduler, ByteScheduler, ProphetScheduler)}


def validate_scheduler(name: str, **options) -> str:
    """Checks a scheduler name and its options.

    Args:
      name: one of :data:`SCHEDULERS`.
      **options: the scheduler's options (see each class); positive ints, or
        None for the default.

    Returns:
      ``name``.

    Raises:
      ValueError: unknown name or option, or a value that is not a positive
        int; the message lists the valid names or options.
    """
    if not isinstance(name, str) or name not in SCHEDULERS:
        raise ValueError(f"Unknown scheduler; valid schedulers: {', '.join(SCHEDULERS)}. "
                         f"Received: scheduler={name!r}")
    valid = SCHEDULERS[name].OPTIONS
    for option, value in options.items():
        if option not in valid:
            listed = ", ".join(valid) if valid else "none"
            raise ValueError(f"Unknown option for scheduler {name!r}; valid options: {listed}. "
                             f"Received: {option}={value!r}")
        if value is None:
            continue
        if isinstance(value, bool) or not isinstance(value, numbers.Integral):
            raise ValueError(f"Option {option} of scheduler {name!r} must be an int. "
                             f"Received: {option}={value!r}")
        if value <= 0:
            raise ValueError(f"Option {option} of scheduler {name!r} must be positive. "
                             f"Received: {option}={value!r}")
    return name


def make_scheduler(name: str, **options) -> Scheduler:
    """A new scheduler ``name`` with ``options`` (validated as in
    :func:`validate_scheduler`; None means the default)."""
    validate_scheduler(name, **options)
    return SCHEDULERS[name](**{k: int(v) for k, v in options.items() if v is not None})


def parse_scheduler(spec: str) -> tuple[str, dict[str, int]]:
    """Parses ``"name"`` or ``"name:option=value,option=value"`` (e.g. the
    value of PROPHET_TF_SCHEDULER) and validates it.

    Raises:
      ValueError: malformed, or as :func:`validate_scheduler`.
    """
    name, _, rest = spec.strip().partition(":")
    options = {}
    for field in filter(None, (f.strip() for f in rest.split(","))):
        option, sep, value = field.partition("=")
        try:
            if not sep:
                raise ValueError
            options[option.strip()] = int(value.strip().replace("_", ""), 0)
        except ValueError:
            raise ValueError(f"Scheduler options must read option=int, e.g. "
                             f"'bytescheduler:credit_bytes=8000000'. Received: {spec!r}") from None
    validate_scheduler(name.strip(), **options)
    return name.strip(), options


def split_specs(text: str) -> list[str]:
    """The entries of a comma-separated scheduler list (``--schedulers``):
    names, or a name with options (``fifo,prophet:partition_bytes=200000,
    blocks_in_flight=4``: a field with ``=`` and no ``:`` belongs to the
    entry before it). Not validated: see :func:`parse_scheduler`."""
    specs: list[str] = []
    for field in (f.strip() for f in text.split(",")):
        if "=" in field and ":" not in field and specs:
            specs[-1] += "," + field
        elif field:
            specs.append(field)
    return specs
