"""Deterministic placement of variables (or element ranges of them) on PS tasks.

Every worker and every PS task calls :func:`plan` on the same variable specs
and gets the same answer, so nobody has to ship the placement around. (The PS
also returns its share in ``RegisterResponse.partitions``; a worker can check
the two agree.)

A partition is elements ``[begin, end)`` of a variable flattened in C order,
so it is one contiguous range of the variable's bytes whatever its shape: a
ResNet 1x1 kernel (one row), a bias or an embedding are cut alike. Two rules:

1. **Spread** (several PS tasks, an optimizer that updates each element from
   that element alone): the model's variables are laid end to end in key
   order and that byte stream is cut into ``n`` equal pieces, ``n`` a
   multiple of the PS count (at least :data:`PIECES_PER_PS` per task, more
   while a piece would exceed ``max_partition_bytes``); piece ``j`` goes to
   PS ``j % num_ps``. A cut falling inside an element moves back to that
   element's start, so every PS task carries the model's bytes over the PS
   count to within a few elements, for any model and PS count. Round robin
   in key order spreads every large layer over all PS tasks, so the most
   urgent layers (the first) travel over every link at once. A piece that
   holds parts of several variables is one partition per variable.
2. **Whole** (one PS task, or an optimizer that reads each variable whole:
   ``optimizer_policy.needs_whole_variables``): a variable of more than
   ``max_partition_bytes`` is cut into the fewest element ranges of at most
   that size, their lengths differing by at most one element; the others stay
   whole. Variables are placed largest first on the least-loaded PS task
   (ties: the lower PS index; equal sizes: the lower key), a cut one with all
   its partitions, so that its norms are one PS task's to take (Lamb's):
   LPT, so two PS loads differ by at most the largest variable.

Why ``DEFAULT_MAX_PARTITION_BYTES`` is 4 MiB: a partition is the unit the
scheduler orders and the PS applies, so it bounds how long urgent traffic
waits behind a bulk transfer (~4 ms at 1 GB/s) and how finely a large layer
spreads over PS tasks; above ~1 MiB the per-message cost of gRPC Python
(~0.1 ms) is under a few percent of the transfer, and buffers of a few MiB stay
below glibc's mmap threshold ceiling (32 MiB), so they are recycled instead of
page-faulted anew each step. BytePS settled on the same size
(``BYTEPS_PARTITION_BYTES=4096000``).
"""

from __future__ import annotations

import bisect
import dataclasses
import heapq
import math
from typing import Iterable, Sequence

from prophet_tf import codec

__all__ = ["DEFAULT_MAX_PARTITION_BYTES", "PIECES_PER_PS", "Partition", "plan", "owned_by",
           "elements", "max_partitions", "whole_shape", "model_bytes"]

DEFAULT_MAX_PARTITION_BYTES = 4 * 1024 * 1024
#: The spread rule cuts the model into at least this many pieces per PS task,
#: so that even a model of one large layer reaches every link in several
#: partitions that the scheduler can order and the PS apply one by one.
PIECES_PER_PS = 4


@dataclasses.dataclass(frozen=True)
class Partition:
    """Elements ``[begin, end)`` of variable ``key`` flattened, owned by ``ps_index``.

    ``partition`` numbers the ranges of one variable from 0 in element order.
    A scalar is elements ``[0, 1)``; a variable with no elements is ``[0, 0)``.
    """

    key: int
    partition: int
    ps_index: int
    begin: int
    end: int
    nbytes: int

    @property
    def num_elements(self) -> int:
        return self.end - self.begin

    def to_proto(self):
        from prophet_tf.ps.v1 import ps_pb2

        return ps_pb2.Partition(key=self.key, partition=self.partition,
                                ps_index=self.ps_index, begin=self.begin, end=self.end)


def whole_shape(partition: Partition, shape: Sequence[int]) -> tuple[int, ...]:
    """The shape a partition's values take: the variable's own when the
    partition is the whole variable, else a vector of its elements."""
    shape = tuple(int(d) for d in shape)
    if partition.begin == 0 and partition.end == math.prod(shape):
        return shape
    return (partition.num_elements,)


def elements(array, partition: Partition):
    """The elements of ``partition`` in the full ``array``, as a flat view (a
    copy only when ``array`` is not contiguous)."""
    return array.reshape(-1)[partition.begin:partition.end]


def _checked(specs: Iterable) -> list[tuple[int, int, int]]:
    """``(key, elements, itemsize)`` of each spec, in key order."""
    out, seen = [], set()
    for spec in specs:
        key, shape = int(spec.key), [int(d) for d in spec.shape]
        if key in seen:
            raise ValueError(f"Variable key {key} appears twice. Received: key={key}")
        seen.add(key)
        if any(d < 0 for d in shape):
            raise ValueError(f"Negative dimension in variable {key}. Received: shape={shape}")
        out.append((key, math.prod(shape), codec.to_numpy_dtype(spec.dtype).itemsize))
    return sorted(out)


def model_bytes(specs: Iterable) -> int:
    """The bytes of every variable of ``specs`` together (checked as :func:`plan` does)."""
    return sum(count * itemsize for _, count, itemsize in _checked(specs))


def _even_split(count: int, parts: int) -> list[tuple[int, int]]:
    base, extra = divmod(count, parts)
    bounds, begin = [], 0
    for i in range(parts):
        end = begin + base + (1 if i < extra else 0)
        bounds.append((begin, end))
        begin = end
    return bounds


def _parts_whole(elements_: int, itemsize: int, max_partition_bytes: int) -> int:
    """How many element ranges rule 2 cuts a variable into."""
    if elements_ == 0:
        return 1
    return math.ceil(elements_ / max(1, max_partition_bytes // itemsize))


def _num_pieces(total_bytes: int, num_ps: int, max_partition_bytes: int) -> int:
    per_ps = max(PIECES_PER_PS, math.ceil(total_bytes / (num_ps * max_partition_bytes)))
    return num_ps * per_ps


def max_partitions(specs: Iterable, num_ps: int, max_partition_bytes: int) -> int:
    """An upper bound on the partitions :func:`plan` makes under either rule,
    from sizes alone (a declaration is sized with it before it is accepted)."""
    sizes = _checked(specs)
    whole = sum(_parts_whole(n, z, max_partition_bytes) for _, n, z in sizes)
    if num_ps <= 1:
        return whole
    total = sum(n * z for _, n, z in sizes)
    return max(whole, len(sizes) + _num_pieces(total, num_ps, max_partition_bytes))


def plan(specs: Iterable, num_ps: int,
         max_partition_bytes: int = DEFAULT_MAX_PARTITION_BYTES, *,
         spread: bool) -> list[Partition]:
    """Splits and places variables on ``num_ps`` PS tasks.

    Args:
        specs: objects with ``key`` (int), ``shape`` (sequence of int) and
            ``dtype`` (wire dtype name), e.g. ``ps_pb2.VariableSpec``.
        num_ps: number of PS tasks (>= 1).
        max_partition_bytes: the largest partition wanted.
        spread: rule 1 (with several PS tasks); False: rule 2, every variable
            no larger than ``max_partition_bytes`` whole.

    Returns:
        All partitions, sorted by ``(key, partition)``.

    Raises:
        ValueError: on a non-positive ``num_ps``/``max_partition_bytes``, a
            negative dimension, an unsupported dtype or a repeated key.
    """
    if num_ps < 1:
        raise ValueError(f"num_ps must be >= 1. Received: num_ps={num_ps}")
    if max_partition_bytes < 1:
        raise ValueError("max_partition_bytes must be >= 1. "
                         f"Received: max_partition_bytes={max_partition_bytes}")
    sizes = _checked(specs)
    if spread and num_ps > 1:
        return _spread(sizes, num_ps, max_partition_bytes)
    return _whole(sizes, num_ps, max_partition_bytes)


def _whole(sizes, num_ps: int, max_partition_bytes: int) -> list[Partition]:
    pieces = []  # (key, partition, begin, end, nbytes)
    for key, count, itemsize in sizes:
        parts = _parts_whole(count, itemsize, max_partition_bytes)
        for index, (begin, end) in enumerate(_even_split(count, parts)):
            pieces.append((key, index, begin, end, (end - begin) * itemsize))
    # LPT over variables: largest first onto the least-loaded PS; heap entries
    # (load, ps_index).
    loads = [(0, ps) for ps in range(num_ps)]
    owner = {}
    for key, count, itemsize in sorted(sizes, key=lambda v: (-v[1] * v[2], v[0])):
        load, ps = heapq.heappop(loads)
        owner[key] = ps
        heapq.heappush(loads, (load + count * itemsize, ps))
    return [Partition(key, index, owner[key], begin, end, nbytes)
            for key, index, begin, end, nbytes in pieces]


def _spread(sizes, num_ps: int, max_partition_bytes: int) -> list[Partition]:
    starts, offset = [], 0
    for _, count, itemsize in sizes:
        starts.append(offset)
        offset += count * itemsize
    total = offset
    n = _num_pieces(total, num_ps, max_partition_bytes)
    # Piece j is bytes [cuts[j], cuts[j + 1]); each cut moved back to the start
    # of the element it falls in.
    cuts = [0]
    for j in range(1, n if total else 0):
        at = j * total // n
        v = bisect.bisect_right(starts, at) - 1
        while sizes[v][1] == 0:  # an empty variable starts where the next one does
            v += 1
        itemsize = sizes[v][2]
        cuts.append(starts[v] + (at - starts[v]) // itemsize * itemsize)
    cuts += [total] * (n + 1 - len(cuts))
    out = []
    for (key, count, itemsize), start in zip(sizes, starts):
        end_byte = start + count * itemsize
        first = bisect.bisect_right(cuts, start) - 1  # the piece holding byte `start`
        if count == 0:
            out.append(Partition(key, 0, min(first, n - 1) % num_ps, 0, 0, 0))
            continue
        index, j = 0, first
        while j < n and cuts[j] < end_byte:
            lo, hi = max(cuts[j], start), min(cuts[j + 1], end_byte)
            if hi > lo:
                out.append(Partition(key, index, j % num_ps, (lo - start) // itemsize,
                                     (hi - start) // itemsize, hi - lo))
                index += 1
            j += 1
    return out


def owned_by(partitions: Sequence[Partition], ps_index: int) -> list[Partition]:
    """The partitions of ``ps_index``, in plan order."""
    return [p for p in partitions if p.ps_index == ps_index]
