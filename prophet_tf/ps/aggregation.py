"""Push: checking a block of gradient chunks and summing it over the workers.

Iteration rules for a partition at ``version`` v (v optimizer updates applied):

* a chunk for iteration ``v`` is summed in, once per worker; a second copy from
  the same worker (a retry, or twice in one request) is a duplicate;
* a chunk for iteration ``v - 1`` is a duplicate (every worker had to push it
  for v to exist);
* iteration ``< v - 1`` is "from the past" and ``> v`` "too far ahead":
  FAILED_PRECONDITION;
* duplicates are ignored and counted in ``PushResponse.duplicates``.

A request is checked completely before anything changes (:func:`add`); any
error rejects all of it. The checks of its content (:func:`check_content`:
partitions, dtypes, sizes, NaN/Inf, learning rate) read nothing that changes
after the model is installed, so they run outside the servicer's state lock
and a large push's scan holds up no other RPC; only the iteration rules
(:func:`check_iterations`) need the lock. A gradient holding a NaN or an Inf
is such an error (INVALID_ARGUMENT naming the variable, partition and
iteration): summed in, it would poison the parameters for good, so training
fails at once instead; unless the workers scale the loss, whose overflowed
steps are skipped as all workers' verdicts say (``verdicts.py``).

Sums are accumulated in float32 for float16/bfloat16 gradients (so W low-
precision gradients do not lose bits; the optimizer casts the sum to the
variable dtype as Keras does), and in the gradient dtype for float32/float64
(integer-valued float32 sums are exact up to 2**24). Each worker's chunk is
kept until all W have arrived and they are summed in worker order 0..W-1,
whatever the arrival order: every run and every scheduler give the same bits.
A kept chunk is a view of its request (no copy): a partition holds at most one
chunk per worker, and none once its sum is handed over to the apply.

Weights: a chunk of a Keras train step carries the rows of its worker's share
of the batch (``GradientChunk.batch_rows``). Keras divides each worker's mean
loss by W, so when the shares differ (3 workers and a batch of 64, a last
partial batch) worker w's gradient is weighted by ``W * rows_w / sum(rows)``
and the sum is the global batch's mean gradient, as single-process training
computes it. Equal shares, or chunks without rows (custom loops, whose loss is
already scaled by the global batch), are summed as they are.
"""

from __future__ import annotations

import math

import grpc
import numpy as np

from prophet_tf import codec
from prophet_tf.ps import registration, zero_copy
from prophet_tf.ps.errors import RpcError, invalid, precondition
from prophet_tf.ps.v1 import ps_pb2

__all__ = ["SUM_DTYPES", "check_content", "check_iterations", "add"]

SUM_DTYPES = {"float16": np.float32, "bfloat16": np.float32,
              "float32": np.float32, "float64": np.float64}

# Exponent bits of NaN/Inf in the 2-byte float types: testing them on a uint16
# view is ~10x faster than np.isfinite, which has no vector loop for these.
_NON_FINITE_BITS = {codec.to_numpy_dtype("float16"): np.uint16(0x7C00),
                    codec.to_numpy_dtype("bfloat16"): np.uint16(0x7F80)}


def check_content(request, model: registration.Model, parts: dict, ps_index: int):
    """Checks what a push carries; reads no state that changes, so no lock.

    ``parts`` is the installed model's partitions (fixed once installed).

    Returns:
        ``(chunks, learning_rate)``: ``[(part, iteration, array, batch_rows)]``
        (arrays are views of the request; rows None when not sent) and the
        push's learning rate or None.

    Raises:
        RpcError: the push must be rejected as a whole.
    """
    wid = request.worker_id
    chunks = []
    for c in request.chunks:
        part = parts.get((c.key, c.partition))
        if part is None:
            raise registration.not_found(model, c.key, c.partition, ps_index)
        array = registration.check_chunk_bytes(part, c, "gradient")
        step = c.step
        # A loss-scaled model's overflow skips the step (verdicts.py) instead.
        if not model.loss_scaling and not _all_finite(array):
            # Summed in, one NaN would poison the parameters for good.
            raise invalid(f"Gradient of {part.name} at step {step} has "
                          f"{_non_finite_count(array)} NaN or "
                          f"Inf values (of {array.size}); the whole push is rejected "
                          f"and nothing of it was summed. Received: worker_id={wid}, "
                          f"step={step}")
        chunks.append((part, step, array, _batch_rows_of(c, part, wid)))
    learning_rate = _learning_rate_of(request)
    if learning_rate is not None:
        if not math.isfinite(learning_rate) or learning_rate < 0:
            raise invalid("learning_rate must be a finite number >= 0. "
                          f"Received: learning_rate={learning_rate}")
        if model.learning_rate_is_schedule:
            raise invalid("The optimizer's learning rate is a schedule; a worker "
                          f"cannot set it. Received: learning_rate={learning_rate}")
    return chunks, learning_rate


def check_iterations(chunks: list, worker_id: int) -> list:
    """Applies the iteration rules to checked chunks; changes nothing. Under
    the state lock (versions and arrivals change under it).

    Returns:
        ``[(part, iteration, array, batch_rows)]`` with ``array`` None for a
        duplicate.

    Raises:
        RpcError: the push must be rejected as a whole.
    """
    accepted, seen = [], set()
    for part, step, array, rows in chunks:
        if part.failed:
            raise RpcError(grpc.StatusCode.INTERNAL, part.failed)
        v = part.version
        if v < 0:
            raise precondition(f"{part.name} has no initial value yet (worker 0 "
                               f"sends it at Register). Received: step={step}")
        key = (part.plan.key, part.plan.partition)
        if step == v:
            duplicate = worker_id in part.arrived or key in seen
        elif step == v - 1:
            duplicate = True
        elif step < v:
            raise precondition(f"Gradient of {part.name} is from the past: the "
                               f"partition is at version {v}, accepting step {v}. "
                               f"Received: step={step}")
        else:
            raise precondition(f"Gradient of {part.name} is too far ahead: the "
                               f"partition is at version {v}, accepting step {v}. "
                               f"Received: step={step}")
        seen.add(key)
        accepted.append((part, step, None if duplicate else array, rows))
    return accepted


def add(accepted: list, worker_id: int, num_workers: int) -> tuple[list, int]:
    """Keeps the checked chunks until their sums are complete; nothing can fail
    here. Under the state lock.

    Returns:
        ``(completed, duplicates)``: ``[(part, iteration, total)]`` of the
        partitions that now hold all ``num_workers`` workers' chunks, summed
        in worker order (:func:`worker_order_sum`), and the number of
        duplicates.
    """
    completed, duplicates = [], 0
    for part, step, array, rows in accepted:
        if array is None:
            duplicates += 1
            continue
        part.arrived[worker_id] = (array, rows)
        if len(part.arrived) == num_workers:
            arrivals = [part.arrived[w] for w in range(num_workers)]
            completed.append((part, step, worker_order_sum(part.spec.dtype, arrivals)))
            # The workers stay marked (a retry is a duplicate) until the apply.
            part.arrived = dict.fromkeys(part.arrived)
    return completed, duplicates


def share_weights(rows: list) -> list | None:
    """Each worker's weight ``W * rows_w / sum(rows)``; None when every worker counts
    the same (equal shares, or rows not sent by every worker: summed as they are)."""
    if any(r is None for r in rows) or len(set(rows)) == 1 or sum(rows) == 0:
        return None
    total = sum(rows)
    return [len(rows) * r / total for r in rows]


def worker_order_sum(dtype: str, arrivals: list) -> np.ndarray:
    """``[(array, rows)]`` of workers 0..W-1 summed in that order, weighted by
    :func:`share_weights`, in the sum dtype (:data:`SUM_DTYPES`)."""
    sum_dtype = SUM_DTYPES[dtype]

    def in_sum_dtype(array):
        return array if array.dtype == sum_dtype else array.astype(sum_dtype)

    weights = share_weights([rows for _, rows in arrivals])
    first = arrivals[0][0]
    # Aligned, so that the update takes it without a copy (zero_copy.py).
    total = zero_copy.aligned_empty(first.shape, sum_dtype)
    if weights is None:
        np.copyto(total, first, casting="unsafe")  # as astype; a copy: the request is not ours
        for array, _ in arrivals[1:]:
            total += in_sum_dtype(array)
        return total
    np.multiply(in_sum_dtype(first), sum_dtype(weights[0]), out=total)
    for (array, _), weight in zip(arrivals[1:], weights[1:]):
        total += in_sum_dtype(array) * sum_dtype(weight)
    return total


def _batch_rows_of(chunk, part, worker_id: int) -> int | None:
    """A chunk's ``batch_rows``: None when not sent; raises when out of range."""
    if isinstance(chunk, ps_pb2.GradientChunk):  # Parsed by protobuf (tests, other clients).
        rows = chunk.batch_rows if chunk.HasField("batch_rows") else None
    else:
        rows = chunk.batch_rows
    if rows is not None and not 0 <= rows < 1 << 40:
        raise invalid(f"batch_rows of {part.name} must be a row count >= 0. Received: "
                      f"batch_rows={rows} from worker_id={worker_id}")
    return rows


def _learning_rate_of(request) -> float | None:
    """A push's learning rate: None when the worker sent none."""
    if isinstance(request, ps_pb2.PushRequest):  # Parsed by protobuf (tests, other clients).
        return request.learning_rate if request.HasField("learning_rate") else None
    return request.learning_rate


def _all_finite(array: np.ndarray) -> bool:
    """Whether ``array`` holds no NaN or Inf.

    ``np.isfinite(a).all()`` for float32/float64: ~30 us per MB here, faster
    than ``np.isfinite(a.sum())`` (~50 us per MB), which would also need a
    fallback when finite values overflow the sum.
    """
    mask = _NON_FINITE_BITS.get(array.dtype)
    if mask is None:
        return bool(np.isfinite(array).all())
    return not np.any((array.view(np.uint16) & mask) == mask)


def _non_finite_count(array: np.ndarray) -> int:
    mask = _NON_FINITE_BITS.get(array.dtype)
    if mask is None:
        return array.size - int(np.count_nonzero(np.isfinite(array)))
    return int(np.count_nonzero((array.view(np.uint16) & mask) == mask))
