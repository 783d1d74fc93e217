"""Array helpers of the PS tests: cut full gradients into chunks, write pulled ones back."""

from typing import Iterable, Mapping

import numpy as np

from prophet_tf.ps import sharding
from prophet_tf.ps.client import Chunk


def gradient_chunks(arrays: Mapping[int, np.ndarray], partitions: Iterable[sharding.Partition],
                    step: int) -> list[Chunk]:
    """Cuts full gradients (key -> array) into partition chunks (views)."""
    return [Chunk(p.key, p.partition, step, sharding.elements(np.asarray(arrays[p.key]), p))
            for p in partitions]


def write_chunk(chunk, out: Mapping[int, np.ndarray],
                partitions: Mapping[tuple[int, int], sharding.Partition]) -> None:
    """Copies a pulled chunk into its elements of ``out[key]`` (one memcpy)."""
    p = partitions[chunk.key, chunk.partition]
    out[chunk.key].reshape(-1)[p.begin:p.end] = chunk.array.reshape(-1)


def push(client, chunks, timeout=None) -> int:
    """Pushes one block and waits: the number of duplicates the PS counted."""
    return client.push_future(chunks, timeout).result().duplicates


def rpc_error(call):
    """The grpc.RpcError that `call` raises (a stream is read to its end to get it)."""
    import grpc  # here: the load worker and the transport bench import this module too
    import pytest

    with pytest.raises(grpc.RpcError) as info:
        result = call()
        if hasattr(result, "__next__"):
            list(result)
    return info.value
