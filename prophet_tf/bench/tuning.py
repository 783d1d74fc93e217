"""ByteScheduler's knobs chosen for the configuration at hand, as its paper does.

ByteScheduler (Peng et al., SOSP 2019) has two knobs, the partition size and
the credit (bytes in flight), and tunes them per job: by Bayesian
optimisation over measured training speed. Its defaults (4 MB partitions, a
credit of 4 partitions) are starting points, not its setting; run with them
on a model smaller than the credit it sends in readiness order, like FIFO.

Here the search is exhaustive over a small grid and scored by the simulator
(:func:`prophet_tf.bench.simulate.simulate`, the engine's own dispatch and
scheduler) on the configuration's measured profile, network and layout:
deterministic, and cheap enough that the bench runs it every time and
records every candidate's predicted step time next to the choice.

The peer is given its best too: tf-mwms's pack size (``bytes_per_pack``, the
one ``CommunicationOptions`` knob that shapes its traffic) is chosen by
measuring a run with each of :data:`TF_MWMS_PACK_BYTES` (:func:`choose_pack`).
"""
from __future__ import annotations

from prophet_tf.bench import simulate

__all__ = ["PARTITION_BYTES", "CREDIT_PARTITIONS", "TOLERANCE", "tune_bytescheduler",
           "TF_MWMS_PACK_BYTES", "choose_pack"]

#: Partition sizes tried: 256 KB to BytePS's 4,096,000.
PARTITION_BYTES = (256_000, 512_000, 1_024_000, 2_048_000, 4_096_000)
#: Credits tried, in partitions.
CREDIT_PARTITIONS = (1, 2, 4, 8)
#: Predictions closer than this to the best are ties.
TOLERANCE = 0.01
#: tf-mwms's ``CommunicationOptions(bytes_per_pack)`` tried by measuring each
#: (the simulator's ring model cannot rank them: with no latency every packing
#: moves the same bytes): TensorFlow's default, 0 (one pack), and 1, 4, 16 MiB.
TF_MWMS_PACK_BYTES = (0, 1 << 20, 4 << 20, 16 << 20)
#: Measured runs closer than this to the fastest are ties, which go to the
#: earliest in TF_MWMS_PACK_BYTES (TensorFlow's default first).
PACK_TOLERANCE = 0.02


def tune_bytescheduler(profile: dict, workers: int, num_ps: int, bandwidth_mbit: float | None,
                       **simulate_kwargs) -> tuple[dict, list[dict]]:
    """The grid point with the lowest simulated step time.

    Args:
      profile, workers, num_ps, bandwidth_mbit, simulate_kwargs: as for
        :func:`simulate.simulate` (``layout``, ``latency_ms``, ``compute_s``,
        ``framing``...).

    Returns:
      ``(options, rows)``: the chosen ``{"partition_bytes", "credit_bytes"}``
      and every candidate with its ``predicted_step_time_s``. Candidates
      within :data:`TOLERANCE` of the best count as ties, and ties go to the
      larger partitions and credit (fewer messages, each of which costs more
      on a real network than the simulator charges), the order of the grid.
    """
    rows = []
    for partition_bytes in reversed(PARTITION_BYTES):
        for partitions in reversed(CREDIT_PARTITIONS):
            options = {"partition_bytes": partition_bytes,
                       "credit_bytes": partitions * partition_bytes}
            r = simulate.simulate(profile, "bytescheduler", workers, num_ps, bandwidth_mbit,
                                  scheduler_options=options, **simulate_kwargs)
            rows.append({**options, "predicted_step_time_s": r["step_time_s"]})
    fastest = min(row["predicted_step_time_s"] for row in rows)
    best = next(row for row in rows if row["predicted_step_time_s"] <= fastest * (1 + TOLERANCE))
    return {"partition_bytes": best["partition_bytes"],
            "credit_bytes": best["credit_bytes"]}, rows


def choose_pack(rows: list[dict]) -> int:
    """The ``bytes_per_pack`` of the fastest measured row (``{"bytes_per_pack",
    "step_time_s"}``, in the order tried); rows within :data:`PACK_TOLERANCE` of
    it are ties, won by the first.

    Raises:
      ValueError: no rows.
    """
    if not rows:
        raise ValueError("no tf-mwms runs to choose a pack size from. Received: rows=[]")
    fastest = min(row["step_time_s"] for row in rows)
    return next(row["bytes_per_pack"] for row in rows
                if row["step_time_s"] <= fastest * (1 + PACK_TOLERANCE))
