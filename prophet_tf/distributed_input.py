"""Distributed input: each worker's share of the data, as MultiWorkerMirroredStrategy defines it.

Every worker runs one replica, so what a worker iterates is a plain
`tf.data.Dataset` of its own batches, wrapped in :class:`DistributedDataset`.
The wrapper is a `tf.distribute.DistributedDataset` so that Keras (`fit`,
`evaluate`, `predict`, Keras 3 and tf_keras) takes it as already distributed
and does not split it a second time. Its iterator is the plain dataset's:
OneDeviceStrategy's MultiDeviceIterator would leave a prefetch thread on a
freed iterator when Keras drops one (fit -> evaluate), a SIGSEGV in
TensorFlow 2.21, and a plain iterator runs GetNext in the step itself, as
single-process Keras does.

`experimental_distribute_dataset(dataset)` takes a dataset batched by the
global batch and honours ``options().experimental_distribute.auto_shard_policy``:

- DATA: every worker reads every global batch and keeps rows
  ``[i*n//W, (i+1)*n//W)`` of each batch of n rows (:func:`split_batches`):
  every worker takes the same number of steps and the union of one step's
  shares is exactly the global batch, so training equals single-process.
- FILE: each worker reads only its files (TensorFlow's own file sharding,
  which fails when there are fewer files than workers) and splits each batch
  it reads into W pieces, one step each: no row is read twice or lost, but a
  step's rows come from different places than in single-process training.
- OFF: no sharding: every worker reads the whole dataset, each batch split
  into W pieces as with FILE (every row is trained on once per worker).
- AUTO (the default): FILE when the dataset reads files, else DATA.

`distribute_datasets_from_function(fn)` calls ``fn`` with this worker's
`tf.distribute.InputContext` and takes its batches as they are (per-worker
batches, as with MWMS).
"""
from __future__ import annotations

import tensorflow as tf
from tensorflow.core.framework import graph_pb2
from tensorflow.python.data.experimental.ops import distribute as distribute_ops
from tensorflow.python.distribute import input_lib

__all__ = ["DistributedDataset", "distribute_dataset", "reads_files", "split_batches"]

Policy = tf.data.experimental.AutoShardPolicy

# Source datasets that read files: under AUTO, a dataset built on one is sharded by file.
_FILE_READERS = ("TFRecordDataset", "TextLineDataset", "FixedLengthRecordDataset")


class DistributedDataset(input_lib.DistributedDataset):
    """This worker's batches, marked as distributed (see the module docstring).

    Iterating it in Python, in a `tf.function` (a `for` loop, `iter`/`next`)
    or through Keras gives this worker's batches; nothing splits them again.
    """

    def __init__(self, dataset: tf.data.Dataset, policy: str):
        # input_lib.DistributedDataset's own state is for multi-device
        # iterators, which this class never makes: its __init__ is not called.
        self._dataset = dataset
        self._policy = policy  # "DATA", "FILE", "OFF" or "from_function": for messages.

    def __iter__(self):
        return iter(self._dataset)

    def __repr__(self):
        return f"<prophet_tf.DistributedDataset ({self._policy}) of {self._dataset!r}>"

    @property
    def element_spec(self):
        return self._dataset.element_spec

    def cardinality(self):
        return self._dataset.cardinality()

    def options(self):
        return self._dataset.options()

    def reduce(self, initial_state, reduce_func):
        # What autograph calls for `for x in dataset` inside a tf.function.
        return self._dataset.reduce(initial_state, reduce_func)

    @property
    def dataset(self) -> tf.data.Dataset:
        """The plain per-worker `tf.data.Dataset`."""
        return self._dataset

    # Passed into a tf.function, it becomes the plain per-worker dataset.
    @property
    def _type_spec(self):
        return self._dataset._type_spec  # pylint: disable=protected-access

    @property
    def _variant_tensor(self):
        return self._dataset._variant_tensor  # pylint: disable=protected-access

    def auto_shard(self, num_shards, shard_ix):
        raise ValueError("This dataset is already one worker's share of the data and cannot be "
                         f"sharded again. Received: {self!r}")


def reads_files(dataset: tf.data.Dataset) -> bool:
    """Whether ``dataset`` is built on a file reader (TFRecord, text lines, fixed-length)."""
    graph = graph_pb2.GraphDef.FromString(
        dataset._as_serialized_graph().numpy())  # pylint: disable=protected-access
    nodes = list(graph.node) + [n for f in graph.library.function for n in f.node_def]
    return any(node.op.startswith(_FILE_READERS) for node in nodes)


def effective_policy(dataset: tf.data.Dataset) -> str:
    """The sharding a dataset's options ask for, AUTO resolved: "DATA", "FILE" or "OFF"."""
    policy = dataset.options().experimental_distribute.auto_shard_policy
    if policy == Policy.AUTO:
        return "FILE" if reads_files(dataset) else "DATA"
    if policy == Policy.HINT:
        raise ValueError("prophet_tf.Strategy shards a dataset by DATA, FILE or not at all (OFF); "
                         "AutoShardPolicy.HINT is for tf.data service. Received: "
                         "auto_shard_policy=HINT")
    return {Policy.DATA: "DATA", Policy.FILE: "FILE", Policy.OFF: "OFF"}[policy]


def distribute_dataset(dataset: tf.data.Dataset, num_workers: int,
                       index: int) -> DistributedDataset:
    """Worker ``index``'s share of ``dataset``, batched by the global batch (module docstring)."""
    if isinstance(dataset, DistributedDataset):
        raise ValueError("This dataset is already distributed (one worker's share); pass it to "
                         "fit or iterate it as it is. Received: "
                         f"experimental_distribute_dataset({dataset!r})")
    if not isinstance(dataset, tf.data.Dataset):
        raise ValueError("experimental_distribute_dataset takes a tf.data.Dataset batched by "
                         f"the global batch. Received: {type(dataset).__name__}")
    requested = dataset.options().experimental_distribute.auto_shard_policy
    policy = effective_policy(dataset)
    if num_workers == 1:
        return DistributedDataset(dataset, policy)
    if policy == "DATA":
        return DistributedDataset(split_batches(dataset, num_workers, index), policy)
    if policy == "FILE":
        # TensorFlow's rewrite keeps this worker's files (and raises when
        # there are fewer files than workers).
        dataset = distribute_ops._AutoShardDataset(  # pylint: disable=protected-access
            dataset, num_workers, index, num_workers)
        if not any(True for _ in dataset.take(1)):  # Reads one record, at most.
            raise ValueError(
                f"Sharding the dataset by FILE leaves worker {index} of {num_workers} no data: "
                f"it reads fewer files than there are workers. Give it at least {num_workers} "
                "files, or shard by DATA (options.experimental_distribute.auto_shard_policy = "
                f"AutoShardPolicy.DATA). Received: auto_shard_policy={requested.name} on a "
                "dataset that reads files")
    return DistributedDataset(split_into_pieces(dataset, num_workers), policy)


def split_batches(dataset: tf.data.Dataset, num_workers: int, index: int) -> tf.data.Dataset:
    """Gives worker `index` its share of each global batch.

    Every worker reads the same batches (like TF's AutoShardPolicy.DATA) and
    keeps rows [index*n//W, (index+1)*n//W) of each batch of n rows, so every
    worker takes the same number of steps and the union of one step's shares
    is exactly the global batch. A batch of fewer rows than workers gives some
    workers an empty share; the parameter server weights each worker's
    gradient by its rows, so the step is still the global batch's.
    """
    if num_workers == 1:
        return dataset

    def share(*batch):
        def take(t):
            n = tf.shape(t, out_type=tf.int64)[0]
            begin = n * index // num_workers
            end = n * (index + 1) // num_workers
            return t[begin:end]
        result = tf.nest.map_structure(take, batch)
        return result if len(batch) > 1 else result[0]

    return dataset.map(share, num_parallel_calls=tf.data.AUTOTUNE, deterministic=True)


def split_into_pieces(dataset: tf.data.Dataset, num_workers: int) -> tf.data.Dataset:
    """Each batch as ``num_workers`` consecutive batches (rows [i*n//W, (i+1)*n//W)), in order;
    empty pieces (a batch of fewer rows than workers) are left out."""
    def pieces(*batch):
        def piece(i):
            return tf.nest.map_structure(
                lambda t: t[tf.shape(t, out_type=tf.int64)[0] * i // num_workers:
                            tf.shape(t, out_type=tf.int64)[0] * (i + 1) // num_workers], batch)
        parts = [piece(i) for i in range(num_workers)]
        stacked = tf.data.Dataset.from_tensors(parts[0])
        for part in parts[1:]:
            stacked = stacked.concatenate(tf.data.Dataset.from_tensors(part))
        return stacked

    split = dataset.flat_map(pieces).filter(
        lambda *b: tf.shape(tf.nest.flatten(b)[0])[0] > 0)
    return split.map(lambda *b: b if len(b) > 1 else b[0])
