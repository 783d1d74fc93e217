"""Gradient schedulers: which ready gradients to send next, grouped how.

The engine tells a scheduler about every gradient that becomes ready and asks
it for the next block to send; a block is a list of ready items sent as one
transfer per PS link. Schedulers never see tensors, only sizes and priorities,
so they can be tested (and simulated) without TensorFlow.
"""
from __future__ import annotations

import abc
import collections
import dataclasses


@dataclasses.dataclass(frozen=True)
class ReadyItem:
    """One gradient of one step, ready to send."""

    key: int
    step: int
    priority: int  # forward position; 0 is the most urgent
    nbytes: int
    ready_ns: int


class Scheduler(abc.ABC):
    """Decides the order and grouping of gradient transfers."""

    name: str = ""

    @abc.abstractmethod
    def add(self, item: ReadyItem) -> None:
        """A gradient became ready."""

    @abc.abstractmethod
    def next_block(self) -> list[ReadyItem]:
        """The items to send next as one block, or [] when nothing should go now."""


class FifoScheduler(Scheduler):
    """Sends each gradient on its own, in the order it became ready."""

    name = "fifo"

    def __init__(self):
        self._queue: collections.deque[ReadyItem] = collections.deque()

    def add(self, item: ReadyItem) -> None:
        self._queue.append(item)

    def next_block(self) -> list[ReadyItem]:
        return [self._queue.popleft()] if self._queue else []


SCHEDULERS: dict[str, type[Scheduler]] = {"fifo": FifoScheduler}


def validate_scheduler(name: str) -> str:
    """Returns `name` if it names a scheduler.

    Raises:
      ValueError: unknown name; the message lists the valid ones.
    """
    if name not in SCHEDULERS:
        raise ValueError(f"unknown scheduler; valid schedulers: {', '.join(sorted(SCHEDULERS))}. "
                         f"Received: scheduler={name!r}")
    return name


def make_scheduler(name: str) -> Scheduler:
    return SCHEDULERS[validate_scheduler(name)]()
