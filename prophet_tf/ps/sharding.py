"""Deterministic placement of variables (or row ranges of them) on PS tasks.

Every worker and every PS task calls :func:`plan` on the same variable specs
and gets the same answer, so nobody has to ship the placement around. (The PS
also returns its share in ``RegisterResponse.partitions``; a worker can check
the two agree.)

Rules:

1. A variable of more than ``max_partition_bytes`` is cut along dimension 0
   into the fewest row ranges of at most ``max_partition_bytes`` each, their
   sizes differing by at most one row. Scalars count as one row, so a scalar
   or a small variable is one partition; a single row larger than the limit
   is a partition of its own (oversized).
2. Partitions are placed largest first on the least-loaded PS task (ties: the
   lower PS index; equal sizes: lower key, then lower partition index). This is
   LPT scheduling: the byte load of two PS tasks differs by at most the largest
   partition.

With several PS tasks, workers declare a limit no larger than
:func:`balanced_limit`: a share of the model small enough that LPT spreads
every large variable over all PS tasks, so each PS (and, with PS tasks on
the worker hosts, each host's link) carries about the same bytes. Without it
a model whose bytes sit in one kernel (the bench CNN: 4.2 of 4.5 MB) would
put nearly everything on one PS.

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

import dataclasses
import heapq
import math
from typing import Iterable, Sequence

from prophet_tf import codec

__all__ = ["DEFAULT_MAX_PARTITION_BYTES", "PIECES_PER_PS", "Partition", "plan", "owned_by",
           "row_layout", "rows", "balanced_limit"]

DEFAULT_MAX_PARTITION_BYTES = 4 * 1024 * 1024
#: The model is cut into at least this many pieces per PS task: LPT then
#: leaves PS loads within a quarter of the mean, usually much closer.
PIECES_PER_PS = 4


@dataclasses.dataclass(frozen=True)
class Partition:
    """Rows ``[row_begin, row_end)`` of variable ``key``, owned by ``ps_index``.

    ``partition`` numbers the row ranges of one variable from 0 in row order.
    Scalars are rows ``[0, 1)``.
    """

    key: int
    partition: int
    ps_index: int
    row_begin: int
    row_end: int
    nbytes: int

    @property
    def num_rows(self) -> int:
        return self.row_end - self.row_begin

    def to_proto(self):
        from prophet_tf.ps.v1 import ps_pb2

        return ps_pb2.Partition(key=self.key, partition=self.partition,
                                ps_index=self.ps_index, row_begin=self.row_begin,
                                row_end=self.row_end)


def row_layout(shape: Sequence[int], dtype: str,
               max_partition_bytes: int) -> tuple[int, int, int]:
    """``(rows, row_bytes, partitions)`` of a variable cut by rule 1.

    ``shape`` must have no negative dimension and ``dtype`` be a wire dtype
    name; nothing is allocated, so this also sizes a declaration before it
    is accepted.
    """
    shape = [int(d) for d in shape]
    rows = shape[0] if shape else 1
    row_bytes = codec.to_numpy_dtype(dtype).itemsize * math.prod(shape[1:])
    if not rows:
        return rows, row_bytes, 1
    rows_per_part = max(1, max_partition_bytes // row_bytes) if row_bytes else rows
    return rows, row_bytes, math.ceil(rows / rows_per_part)


def rows(array, partition: Partition):
    """The rows of ``partition`` in the full ``array``, as a view (scalars: shape (1,))."""
    if array.ndim == 0:
        return array.reshape(1)
    return array[partition.row_begin:partition.row_end]


def _row_split(rows: int, parts: int) -> list[tuple[int, int]]:
    base, extra = divmod(rows, parts)
    bounds, begin = [], 0
    for i in range(parts):
        end = begin + base + (1 if i < extra else 0)
        bounds.append((begin, end))
        begin = end
    return bounds


def plan(specs: Iterable, num_ps: int,
         max_partition_bytes: int = DEFAULT_MAX_PARTITION_BYTES) -> list[Partition]:
    """Splits and places variables on ``num_ps`` PS tasks.

    Args:
        specs: objects with ``key`` (int), ``shape`` (sequence of int) and
            ``dtype`` (wire dtype name), e.g. ``ps_pb2.VariableSpec``.
        num_ps: number of PS tasks (>= 1).
        max_partition_bytes: variables larger than this are split by rows.

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
    pieces = []  # (key, partition, row_begin, row_end, nbytes)
    seen = set()
    for spec in specs:
        key, shape = int(spec.key), [int(d) for d in spec.shape]
        if key in seen:
            raise ValueError(f"Variable key {key} appears twice. Received: key={key}")
        seen.add(key)
        if any(d < 0 for d in shape):
            raise ValueError(f"Negative dimension in variable {key}. Received: shape={shape}")
        num_rows, row_bytes, parts = row_layout(shape, spec.dtype, max_partition_bytes)
        for index, (begin, end) in enumerate(_row_split(num_rows, parts)):
            pieces.append((key, index, begin, end, (end - begin) * row_bytes))
    # LPT: largest first onto the least-loaded PS; heap entries (load, ps_index).
    loads = [(0, ps) for ps in range(num_ps)]
    owner = {}
    for key, index, _, _, nbytes in sorted(pieces, key=lambda p: (-p[4], p[0], p[1])):
        load, ps = heapq.heappop(loads)
        owner[key, index] = ps
        heapq.heappush(loads, (load + nbytes, ps))
    return sorted(
        (Partition(key, index, owner[key, index], begin, end, nbytes)
         for key, index, begin, end, nbytes in pieces),
        key=lambda p: (p.key, p.partition))


def balanced_limit(specs: Iterable, num_ps: int, max_partition_bytes: int) -> int:
    """The partition limit that spreads the model evenly over ``num_ps`` tasks:
    ``max_partition_bytes``, lowered to the model's bytes over
    ``PIECES_PER_PS * num_ps`` (never below 1). One PS: unchanged."""
    if num_ps <= 1:
        return max_partition_bytes
    total = 0
    for spec in specs:
        num_rows, row_bytes, _ = row_layout(spec.shape, spec.dtype, max_partition_bytes)
        total += num_rows * row_bytes
    return max(1, min(max_partition_bytes, math.ceil(total / (PIECES_PER_PS * num_ps))))


def owned_by(partitions: Sequence[Partition], ps_index: int) -> list[Partition]:
    """The partitions of ``ps_index``, in plan order."""
    return [p for p in partitions if p.ps_index == ps_index]
