"""What every scheduler shares: the ready item, the in-flight window, the interface.

A scheduler sees sizes, priorities and times, never tensors, and never reads a
clock: every time is an argument (ns of the clock of ``ReadyItem.ready_ns``,
i.e. ``time.monotonic_ns()`` in the engine, or virtual time in the simulator).
So the same code runs in the engine, in tests and in the simulator, all of
which drive it through :class:`prophet_tf.engine.dispatch.Dispatch`.
Schedulers are not thread-safe.

Contract (what the dispatch does):

1. ``s = make_scheduler(name, **options)``; cut every variable into
   partitions of at most ``s.partition_bytes_for(model_bytes, num_ps)``
   bytes (element ranges: ``sharding.plan``). The PS tasks
   must be started with the same ``max_partition_bytes``.
2. When the gradient of variable ``key`` for training iteration ``iteration`` is
   ready, call :meth:`Scheduler.add` once per partition (partition order), all
   of them before the next ``next_block``; then drain: ``while block :=
   s.next_block(now_ns): start(block)``.
3. A block counts as in flight in its link's :class:`Window` from
   ``next_block`` until ``on_sent(block, start_ns, end_ns)`` (start just before
   the RPC, end just after it returned); drain again after ``on_sent``.
4. To flush (end of training, evaluation, checkpoint): ``s.flush()``, drain,
   then wait for the sends; Prophet may otherwise hold gradients back for a
   burst that a partial iteration will never complete.
5. ``s.plan()`` at any time: a JSON-serializable dict for the timeline.

A block is a non-empty list of items of ONE link (``ps_index``), sent as one
transfer, of at most :data:`MAX_BLOCK_BYTES` unless it is a single partition.

The window is the only in-flight limit of a link: the engine starts every
block ``next_block`` returns at once. Each scheduler sizes it with
:attr:`Scheduler.window_blocks` and :attr:`Scheduler.window_bytes`.
"""
from __future__ import annotations

import abc
import bisect
import heapq
import typing
from typing import ClassVar, Sequence

__all__ = ["ReadyItem", "urgency", "Window", "Windows", "ActiveLinks", "Scheduler",
           "PriorityScheduler", "DEFAULT_PARTITION_BYTES", "MAX_BLOCK_BYTES"]

#: Partition size when a scheduler has no preference: the PS side's default,
#: ``prophet_tf.ps.sharding.DEFAULT_MAX_PARTITION_BYTES`` (why 4 MiB: see there).
#: Not imported: schedulers stay free of numpy; tests/unit/test_dispatch.py
#: checks the two agree.
DEFAULT_PARTITION_BYTES = 4 * 1024 * 1024

#: Largest block of several items: half the PS message limit (64 MiB), which
#: leaves ample room for the per-chunk headers (< 64 bytes each).
MAX_BLOCK_BYTES = 32 * 1024 * 1024


class ReadyItem(typing.NamedTuple):
    """One partition of one gradient, ready to send (immutable).

    A named tuple, not a frozen dataclass: the dispatch makes one per
    partition per gradient (725 x 64 workers x 16 iterations in a 64-worker
    ResNet-50 Prophet simulation), and a frozen dataclass's ``__init__``
    costs three times a tuple's.

    Partitions of one gradient share ``key``, ``iteration``, ``priority`` and
    ``ready_ns``; ``(key, partition, iteration)`` identifies an item.

    Attributes:
      key: the variable's PS key.
      partition: index of the element range (``sharding.Partition.partition``).
      ps_index: the PS task, i.e. the link the item goes over.
      iteration: the training iteration the gradient belongs to (it fills
        the protobuf field ``GradientChunk.step``: Keras calls it a step).
      priority: forward position of the variable; 0 is the most urgent.
      nbytes: size of this partition.
      ready_ns: when the gradient became ready.
    """

    key: int
    partition: int
    ps_index: int
    iteration: int
    priority: int
    nbytes: int
    ready_ns: int


def urgency(item: ReadyItem) -> tuple[int, int, int, int]:
    """The order priority schedulers send in: older iteration, then lower
    priority (forward position), then key and partition (a total order)."""
    return item.iteration, item.priority, item.key, item.partition


class Window:
    """One link's in-flight window: blocks handed out and not yet sent.

    Args:
      max_blocks: blocks in flight at most; None: no count limit.
      max_bytes: bytes in flight at most, except that an idle link always
        takes one block (so an item larger than the window still goes);
        None: no byte limit.
    """

    __slots__ = ("max_blocks", "max_bytes", "blocks", "nbytes")

    def __init__(self, max_blocks: int | None, max_bytes: int | None):
        self.max_blocks, self.max_bytes = max_blocks, max_bytes
        self.blocks = 0
        self.nbytes = 0

    @property
    def open(self) -> bool:
        """Whether another block may start (bytes permitting)."""
        return self.max_blocks is None or self.blocks < self.max_blocks

    def fits(self, nbytes: int) -> bool:
        """Whether a block of ``nbytes`` may start now."""
        return self.open and (self.blocks == 0 or self.max_bytes is None
                              or self.nbytes + nbytes <= self.max_bytes)

    @property
    def room_bytes(self) -> float:
        """Bytes a block may still carry (inf without a byte limit)."""
        return float("inf") if self.max_bytes is None else self.max_bytes - self.nbytes


class Windows(dict):
    """The windows of all links, made on first use with one size."""

    def __init__(self, max_blocks: int | None, max_bytes: int | None):
        super().__init__()
        self.max_blocks, self.max_bytes = max_blocks, max_bytes

    def __missing__(self, link: int) -> Window:
        window = self[link] = Window(self.max_blocks, self.max_bytes)
        return window

    def book(self, block: Sequence[ReadyItem]) -> None:
        window = self[block[0].ps_index]
        nbytes = block[0].nbytes if len(block) == 1 else sum(item.nbytes for item in block)
        if not window.fits(nbytes):
            raise RuntimeError(
                f"a scheduler released a block that does not fit link {block[0].ps_index}'s "
                f"window ({window.blocks} blocks, {window.nbytes} bytes in flight; limits "
                f"{window.max_blocks} blocks, {window.max_bytes} bytes). Received: "
                f"{len(block)} items, {sum(item.nbytes for item in block)} bytes")
        window.blocks += 1
        window.nbytes += nbytes

    def release(self, block: Sequence[ReadyItem]) -> None:
        first = block[0]
        window = self[first.ps_index]
        window.blocks -= 1
        window.nbytes -= first.nbytes if len(block) == 1 else sum(i.nbytes for i in block)


class ActiveLinks:
    """The links a scan for the next block must look at, in the order the
    scheduler first had items for them (the order every scheduler scans in).

    A scan puts a link to sleep when it has nothing queued or its window takes
    no block; only an item queued for it (``wake``) or a block of it sent
    (``wake_known``, from ``on_sent``) can change that. So a scan touches the
    links that might start a block, not every link, and picks the same one.
    """

    __slots__ = ("_rank", "_awake", "_is_awake")

    def __init__(self):
        self._rank: dict[int, int] = {}  # link -> when it first had an item
        self._awake: list[int] = []  # by rank
        self._is_awake: set[int] = set()  # the same links: a test per add, not a scan

    def wake(self, link: int) -> None:
        if link in self._is_awake:
            return
        self._is_awake.add(link)
        if link not in self._rank:
            self._rank[link] = len(self._rank)
            self._awake.append(link)  # the last rank
        else:
            bisect.insort(self._awake, link, key=self._rank.__getitem__)

    def wake_known(self, link: int) -> None:
        if link in self._rank:
            self.wake(link)

    def wake_all(self) -> None:
        self._awake = list(self._rank)
        self._is_awake = set(self._rank)

    def sleep(self, link: int) -> None:
        self._awake.remove(link)
        self._is_awake.remove(link)

    def __iter__(self):
        return iter(self._awake.copy())  # a scan may put links to sleep


class Scheduler(abc.ABC):
    """Decides the order and grouping of gradient transfers (see the module
    docstring for when the dispatch calls what)."""

    name: ClassVar[str] = ""
    #: Valid options and their defaults.
    OPTIONS: ClassVar[dict[str, int]] = {}
    #: Blocks in flight per link: two, one on the wire and one queued behind
    #: it, hide the gap between transfers.
    window_blocks: int | None = 2
    #: Bytes in flight per link (None: no byte limit).
    window_bytes: int | None = None

    _windows: Windows | None = None
    #: The links worth scanning, for schedulers that keep them (None: none kept).
    _active: ActiveLinks | None = None

    @property
    def partition_bytes(self) -> int | None:
        """Partition size this scheduler wants; None means the default."""
        return None

    def partition_bytes_for(self, model_bytes: int, num_ps: int) -> int:
        """The partition size for a model of ``model_bytes`` over ``num_ps``
        PS tasks: :attr:`partition_bytes`, else :data:`DEFAULT_PARTITION_BYTES`."""
        return self.partition_bytes or DEFAULT_PARTITION_BYTES

    def size_window(self, num_workers: int, ps_on_host: bool = True) -> None:
        """Sets :attr:`window_blocks` and :attr:`window_bytes` for a cluster
        of ``num_workers`` workers, each pushing to every PS link, on a worker
        whose host runs a PS task (``ps_on_host``) or none (the dispatch calls
        it before it makes its windows); the base keeps them."""

    @property
    def windows(self) -> Windows:
        """The in-flight window of each link (the dispatch's, once bound)."""
        if self._windows is None:
            self._windows = Windows(self.window_blocks, self.window_bytes)
        return self._windows

    def bind_windows(self, windows: Windows) -> None:
        """Makes ``windows`` (the dispatch's) the ones this scheduler fills."""
        if self._windows is not None and any(w.blocks for w in self._windows.values()):
            raise RuntimeError(f"scheduler {self.name!r} already has blocks in flight")
        self._windows = windows
        if self._active is not None:  # other windows: any link may take a block
            self._active.wake_all()

    @abc.abstractmethod
    def add(self, item: ReadyItem) -> None:
        """A partition became ready."""

    def next_block(self, now_ns: int) -> list[ReadyItem]:
        """The next transfer to start at ``now_ns``, or [] when none should.

        The block counts against its link's window until :meth:`on_sent`.
        """
        block = self._select(now_ns)
        if block:
            self.windows.book(block)
        return block

    @abc.abstractmethod
    def _select(self, now_ns: int) -> list[ReadyItem]:
        """Takes the next block out of the ready items; it must fit its
        link's window (``self.windows[link].fits``)."""

    def on_sent(self, block: Sequence[ReadyItem], start_ns: int, end_ns: int) -> None:
        """A block returned by :meth:`next_block` was sent, from start to end."""
        if block:
            self.windows.release(block)
            if self._active is not None:  # its window took a block less
                self._active.wake_known(block[0].ps_index)

    def flush(self) -> None:
        """Send everything that is ready, without waiting for a plan's moment."""

    @property
    @abc.abstractmethod
    def pending(self) -> int:
        """Items added and not yet returned by :meth:`next_block`."""

    def plan(self) -> dict:
        """The current plan, JSON-serializable (for the timeline)."""
        return {"scheduler": self.name}


class PriorityScheduler(Scheduler):
    """Per-link heaps of ready items in :func:`urgency` order."""

    def __init__(self):
        self._ready: dict[int, list] = {}
        self._active = ActiveLinks()  # links in the order of _ready
        self._pending = 0

    def add(self, item: ReadyItem) -> None:
        link = item.ps_index
        heap = self._ready.get(link)
        if heap is None:
            heap = self._ready[link] = []
        heapq.heappush(heap, (item.iteration, item.priority, item.key, item.partition, item))
        self._active.wake(link)
        self._pending += 1

    def _start(self, block: list[ReadyItem]) -> list[ReadyItem]:
        self._pending -= len(block)
        return block

    @property
    def pending(self) -> int:
        return self._pending
