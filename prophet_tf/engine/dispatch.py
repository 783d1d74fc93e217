"""The send decisions of one worker: what goes to which PS link, when.

`Dispatch` holds the key map, the partitions, the scheduler and the one
in-flight window per PS link; it has no threads, no clock, no TensorFlow and
no network. The engine's threads call it under one lock with
``time.monotonic_ns()``; the simulator (``prophet-tf simulate``) calls the same
object with virtual time. So what the simulator predicts is what the engine
does.

Keys: the op library knows a variable by its creation index (the native key);
the PS knows the trained variables by their position in
``trainable_variables`` (the PS key, which is also their priority).

The window: a block counts against its link's window from the moment
`next_blocks` hands it out until `on_sent`. Each scheduler sizes it
(``window_blocks``, ``window_bytes``): every scheduler two blocks per link
(one on the wire, one queued behind it); bytescheduler also its credit in
bytes, prophet two ``BLOCK_BYTES`` (one from 16 workers with the PS tasks on
hosts of their own: ``size_window``).
Nothing else limits what is in flight:
the engine sends every block it is handed at once.
"""
from __future__ import annotations

from typing import Any, Sequence

from prophet_tf.engine import schedulers
from prophet_tf.ps import sharding

__all__ = ["Dispatch"]


class Dispatch:
    """Ready gradients in, blocks out, for one worker.

    Args:
      native_keys: the op-library key of each trained variable, by PS key.
      specs: the trained variables' specs (``key``, ``shape``, ``dtype`` name,
        ``priority``), by PS key, as registered with the PS.
      num_ps: PS tasks, i.e. links.
      scheduler: a new scheduler (``schedulers.make_scheduler``); its
        partition size cuts the variables, as on the PS.
      balance: with several PS tasks, spread the model's bytes evenly over
        them (``sharding.plan``'s spread rule); off for optimizers that need
        whole variables.
      num_workers, ps_on_host: the workers of the cluster, each pushing to
        every PS link, and whether a PS task runs on this worker's host: the
        scheduler sizes its window by them (``size_window``).

    Raises:
      ValueError: keys and specs differ in number, or a key repeats.
    """

    def __init__(self, native_keys: Sequence[int], specs: Sequence, num_ps: int,
                 scheduler: schedulers.Scheduler, balance: bool = True, num_workers: int = 1,
                 ps_on_host: bool = True):
        if len(native_keys) != len(specs):
            raise ValueError(f"every trained variable needs one native key. Received: "
                             f"{len(native_keys)} keys for {len(specs)} specs")
        self.native_keys = [int(k) for k in native_keys]
        self._ps_key_of = {k: i for i, k in enumerate(self.native_keys)}
        if len(self._ps_key_of) != len(self.native_keys):
            raise ValueError(f"native keys must be distinct. Received: {self.native_keys}")
        self.specs = list(specs)
        self.scheduler = scheduler
        self.partition_bytes = scheduler.partition_bytes_for(sharding.model_bytes(self.specs),
                                                             num_ps)
        self.partitions = sharding.plan(self.specs, num_ps, self.partition_bytes,
                                        spread=balance)
        self.partitions_of: dict[int, list[sharding.Partition]] = {}
        for p in self.partitions:
            self.partitions_of.setdefault(p.key, []).append(p)
        # Fixed for the run: sorted once, not at every iteration's pull.
        self._pull_orders = [sorted((p for p in self.partitions if p.ps_index == i),
                                    key=lambda p: (self.specs[p.key].priority, p.partition))
                             for i in range(num_ps)]
        #: The one in-flight window of each link, sized by the scheduler.
        scheduler.size_window(num_workers, ps_on_host)
        self.windows = schedulers.Windows(scheduler.window_blocks, scheduler.window_bytes)
        scheduler.bind_windows(self.windows)
        #: The latest training iteration a gradient arrived for.
        self.last_iteration = -1
        self._grads: dict[tuple[int, int], list] = {}  # (PS key, iteration) -> [payload, unsent]
        self._arrived: dict[int, int] = {}  # iteration -> gradients arrived so far

    # -- keys and partitions ------------------------------------------------------------

    def ps_key(self, native_key: int) -> int:
        """The PS key of an op-library key.

        Raises:
          RuntimeError: the key belongs to no trained variable.
        """
        key = self._ps_key_of.get(native_key)
        if key is None:
            raise RuntimeError(f"a gradient arrived for unregistered variable key {native_key}")
        return key

    def pull_order(self, ps_index: int) -> list[sharding.Partition]:
        """The partitions PS ``ps_index`` owns, in the order to pull them: by
        priority. A new list each call: the caller may consume it."""
        return list(self._pull_orders[ps_index])

    def byte_offset(self, p: sharding.Partition) -> int:
        """Where partition ``p`` starts in its variable's buffer."""
        return p.begin * (p.nbytes // p.num_elements) if p.num_elements else 0

    # -- gradients out ------------------------------------------------------------------

    def starts_iteration(self, iteration: int) -> bool:
        """Whether a gradient of ``iteration`` would be the first of a new iteration."""
        return iteration > self.last_iteration

    def add(self, native_key: int, iteration: int, ready_ns: int, payload: Any = None) -> None:
        """A gradient became ready: hands its partitions to the scheduler.

        ``payload`` (the engine's gradient buffer) is kept until every partition
        is sent (`release`). Once every trained variable's gradient of an
        iteration arrived, the scheduler is flushed: backprop is over, so
        nothing is held back for gradients that will not come.

        Raises:
          RuntimeError: an unregistered key, or a second gradient for the same
            variable and iteration; nothing is changed then.
        """
        key = self.ps_key(native_key)
        if (key, iteration) in self._grads:
            raise RuntimeError(f"a second gradient arrived for variable key {native_key} "
                               f"at iteration {iteration}")
        self.last_iteration = max(self.last_iteration, iteration)
        partitions = self.partitions_of[key]
        self._grads[key, iteration] = [payload, len(partitions)]
        priority = self.specs[key].priority
        add, item = self.scheduler.add, schedulers.ReadyItem
        for p in partitions:  # (key, partition, ps_index, iteration, priority, nbytes, ready_ns)
            add(item(key, p.partition, p.ps_index, iteration, priority, p.nbytes, ready_ns))
        arrived = self._arrived.pop(iteration, 0) + 1
        if arrived == len(self.specs):
            self.scheduler.flush()
        else:
            self._arrived[iteration] = arrived

    def next_blocks(self, now_ns: int) -> list[list[schedulers.ReadyItem]]:
        """Every block to start at ``now_ns`` (each fits its link's window)."""
        blocks = []
        while block := self.scheduler.next_block(now_ns):
            blocks.append(block)
        return blocks

    def payload(self, item: schedulers.ReadyItem) -> Any:
        return self._grads[item.key, item.iteration][0]

    def partition(self, item: schedulers.ReadyItem) -> sharding.Partition:
        return self.partitions_of[item.key][item.partition]

    def release(self, block: Sequence[schedulers.ReadyItem]) -> list:
        """The block was serialized; returns the payloads none of whose
        partitions is left to send (the caller frees them)."""
        done = []
        for item in block:
            entry = self._grads[item.key, item.iteration]
            entry[1] -= 1
            if entry[1] == 0:
                del self._grads[item.key, item.iteration]
                done.append(entry[0])
        return done

    def on_sent(self, block: Sequence[schedulers.ReadyItem], start_ns: int, end_ns: int) -> None:
        """A block's push finished: frees its window and tells the scheduler."""
        self.scheduler.on_sent(block, start_ns, end_ns)

    def flush(self) -> None:
        """Releases what the scheduler holds back (end of training, evaluation)."""
        self.scheduler.flush()

    @property
    def idle(self) -> bool:
        """No gradient held and no block in flight."""
        return not self._grads and not any(w.blocks for w in self.windows.values())

    def plan(self) -> dict:
        return self.scheduler.plan()
