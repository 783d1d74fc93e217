"""prophet_tf.strategy without a cluster: split_batches and the constructor's errors."""
import json

import numpy as np
import pytest
import tensorflow as tf

from prophet_tf import keras_optimizer, optimizer_policy
from prophet_tf import strategy as strategy_lib
from prophet_tf.strategy import Strategy, split_batches

SPEC = {"worker": ["127.0.0.1:1001", "127.0.0.1:1002"], "ps": ["127.0.0.1:2001"]}


def worker_config(index=0, spec=SPEC, task_type="worker"):
    return {"cluster": spec, "task": {"type": task_type, "index": index}}


def steps_of(dataset):
    """Every element of `dataset` as a list of numpy structures."""
    return [tf.nest.map_structure(lambda t: t.numpy(), e) for e in dataset]


# -- split_batches ---------------------------------------------------------------------------

@pytest.mark.parametrize("rows,batch,workers", [
    (12, 4, 2),   # even
    (13, 4, 2),   # last batch of 1 row: worker 0 gets an empty share
    (10, 5, 2),   # odd batches: 2 + 3 rows
    (17, 6, 3),   # three workers, last batch of 5
    (7, 7, 4),    # one batch, more uneven than not
    (3, 8, 4),    # fewer rows than workers
])
def test_shares_cover_each_batch_exactly_once(rows, batch, workers):
    base = tf.data.Dataset.range(rows).batch(batch)
    expected = steps_of(base)
    per_worker = [steps_of(split_batches(base, workers, i)) for i in range(workers)]
    # The same number of steps on every worker: the number of global batches.
    assert [len(s) for s in per_worker] == [len(expected)] * workers
    for step, full in enumerate(expected):
        parts = [per_worker[i][step] for i in range(workers)]
        np.testing.assert_array_equal(np.concatenate(parts), full)  # In order, once each.
        n = len(full)
        assert [len(p) for p in parts] == [
            n * (i + 1) // workers - n * i // workers for i in range(workers)]


def test_uneven_batch_share_sizes():
    base = tf.data.Dataset.from_tensor_slices(np.arange(5)).batch(5)
    sizes = [[len(b) for b in steps_of(split_batches(base, 2, i))] for i in range(2)]
    assert sizes == [[2], [3]]  # rows [0, 2) and [2, 5)
    single = tf.data.Dataset.from_tensor_slices(np.arange(1)).batch(1)
    assert [steps_of(split_batches(single, 2, i))[0].tolist() for i in range(2)] == [[], [0]]


def test_tuple_elements_are_split_together():
    x = np.arange(24, dtype=np.float32).reshape(12, 2)
    y = np.arange(12) * 10
    w = np.linspace(0, 1, 12)
    base = tf.data.Dataset.from_tensor_slices((x, y, w)).batch(6)
    for index in range(3):
        for step, (xs, ys, ws) in enumerate(steps_of(split_batches(base, 3, index))):
            rows = slice(6 * step + 2 * index, 6 * step + 2 * (index + 1))
            np.testing.assert_array_equal(xs, x[rows])
            np.testing.assert_array_equal(ys, y[rows])
            np.testing.assert_array_equal(ws, w[rows])


def test_dict_and_nested_elements_keep_their_structure():
    features = {"a": np.arange(8), "b": np.arange(8) * 2}
    labels = np.arange(8) + 100
    base = tf.data.Dataset.from_tensor_slices((features, labels)).batch(4)
    (f0, l0), (f1, l1) = steps_of(split_batches(base, 2, 1))
    assert set(f0) == {"a", "b"}
    np.testing.assert_array_equal(f0["a"], [2, 3])
    np.testing.assert_array_equal(f1["b"], [12, 14])
    np.testing.assert_array_equal(l1, [106, 107])
    only_dict = tf.data.Dataset.from_tensor_slices(features).batch(4)
    first = steps_of(split_batches(only_dict, 2, 0))[0]
    assert isinstance(first, dict)
    np.testing.assert_array_equal(first["a"], [0, 1])


def test_one_worker_gets_the_whole_batch():
    base = tf.data.Dataset.range(10).batch(3)
    assert [s.tolist() for s in steps_of(split_batches(base, 1, 0))] == \
        [s.tolist() for s in steps_of(base)]


# -- Strategy constructor --------------------------------------------------------------------

def test_valid_cluster_has_one_replica_per_worker():
    strategy = Strategy(cluster=worker_config(1))
    try:
        assert strategy.num_replicas_in_sync == 2
        assert strategy.worker_index == 1
        assert strategy.cluster.ps == ("127.0.0.1:2001",)
    finally:
        strategy.shutdown()


def test_chief_counts_as_worker_zero():
    spec = {"chief": ["127.0.0.1:1000"], "worker": ["127.0.0.1:1001"], "ps": ["127.0.0.1:2001"]}
    chief = Strategy(cluster=worker_config(0, spec, "chief"))
    worker = Strategy(cluster=worker_config(0, spec, "worker"))
    try:
        assert (chief.worker_index, worker.worker_index) == (0, 1)
        assert chief.num_replicas_in_sync == worker.num_replicas_in_sync == 2
    finally:
        chief.shutdown()
        worker.shutdown()


def test_ps_task_is_rejected():
    with pytest.raises(ValueError, match=r"(?s)prophet-tf ps.*'ps'"):
        Strategy(cluster=worker_config(0, task_type="ps"))


@pytest.mark.parametrize("cluster,named", [
    ({"cluster": {"worker": "127.0.0.1:1001", "ps": ["127.0.0.1:2001"]},
      "task": {"type": "worker", "index": 0}}, "'127.0.0.1:1001'"),
    ({"cluster": {"worker": ["127.0.0.1:1001"]}, "task": {"type": "worker", "index": 0}},
     '"ps"'),
    ({"cluster": {"worker": ["no-port"], "ps": ["127.0.0.1:2001"]},
      "task": {"type": "worker", "index": 0}}, "'no-port'"),
    ({"cluster": SPEC, "task": {"type": "worker", "index": 5}}, "index=5"),
    ({"cluster": SPEC}, "task=None"),
    ({"workers": ["127.0.0.1:1001"]}, "'workers'"),
    ("{not json", "'{not json'"),
    (42, "cluster=42"),
])
def test_malformed_cluster_raises_value_error_naming_it(cluster, named):
    with pytest.raises(ValueError) as error:
        Strategy(cluster=cluster)
    assert named in str(error.value)
    assert "Received" in str(error.value)


def test_missing_tf_config_is_named(monkeypatch):
    monkeypatch.delenv("TF_CONFIG", raising=False)
    with pytest.raises(ValueError, match="TF_CONFIG"):
        Strategy()


def test_unknown_scheduler_lists_the_valid_ones():
    from prophet_tf.engine import schedulers
    with pytest.raises(ValueError) as error:
        Strategy(cluster=worker_config(0), scheduler="lifo")
    message = str(error.value)
    assert "'lifo'" in message
    for name in schedulers.SCHEDULERS:
        assert name in message


def test_scheduler_defaults_to_the_environment(monkeypatch):
    """README: `scheduler=None` (the default) reads PROPHET_TF_SCHEDULER."""
    monkeypatch.setenv("PROPHET_TF_SCHEDULER", "no-such-scheduler")
    with pytest.raises(ValueError, match="no-such-scheduler"):
        Strategy(cluster=worker_config(0))
    monkeypatch.setenv("PROPHET_TF_SCHEDULER", "fifo")
    strategy = Strategy(cluster=worker_config(0))
    strategy.shutdown()


def test_non_positive_rpc_timeout_is_rejected():
    with pytest.raises(ValueError, match="rpc_timeout_s"):
        Strategy(cluster=worker_config(0), rpc_timeout_s=0)


def test_use_ema_reaches_the_ps_and_a_custom_loop_must_leave_it_there():
    """The PS keeps Keras 3's moving averages (prophet_tf.ps.ema); a worker optimizer's
    own apply would average the weights mid-step, so a custom loop is refused until
    the averaging is left to the PS, as fit does."""
    import keras

    optimizer = keras.optimizers.SGD(0.1, use_ema=True, ema_momentum=0.5)
    options = json.loads(strategy_lib.optimizer_config(optimizer, []))["config"]
    assert (options["use_ema"], options["ema_momentum"]) == (True, 0.5)
    with pytest.raises(ValueError, match=r"averages \(use_ema\).*'use_ema': True"):
        keras_optimizer.check_worker_optimizer(optimizer)
    keras_optimizer.leave_to_the_ps(optimizer)
    keras_optimizer.check_worker_optimizer(optimizer)


# -- what Keras iterates -----------------------------------------------------------------------

def test_distributed_datasets_iterate_as_plain_tf_data_with_this_workers_share():
    """Marked distributed, so Keras does not split them again; iterated by a plain tf.data
    iterator (no MultiDeviceIterator: its prefetch thread crashed workers)."""
    strategy = Strategy(worker_config(index=1))  # Connects to nothing until training starts.
    base = tf.data.Dataset.range(8).batch(4)
    distributed = strategy.experimental_distribute_dataset(base)
    assert isinstance(distributed, tf.distribute.DistributedDataset)
    iterator = iter(distributed)
    assert isinstance(iterator, tf.data.Iterator)
    assert type(iterator).__name__ == "OwnedIterator", type(iterator)
    assert [e.tolist() for e in steps_of(distributed)] == [[2, 3], [6, 7]]
    assert int(distributed.cardinality()) == 2

    contexts = []

    def dataset_fn(context):
        contexts.append(context)
        return tf.data.Dataset.range(3)

    from_function = strategy.distribute_datasets_from_function(dataset_fn)
    assert isinstance(from_function, tf.distribute.DistributedDataset)
    assert steps_of(from_function) == [0, 1, 2]
    (context,) = contexts
    assert (context.num_input_pipelines, context.input_pipeline_id,
            context.num_replicas_in_sync) == (2, 1, 2)
    assert context.get_per_replica_batch_size(8) == 4


def test_keras_takes_a_distributed_dataset_as_it_is():
    """Keras 3's epoch iterator distributes only what is not yet distributed: a dataset
    distributed by the strategy is iterated once, not split a second time."""
    from keras.src.backend.tensorflow.trainer import TFEpochIterator

    strategy = Strategy(worker_config(index=1))
    distributed = strategy.experimental_distribute_dataset(tf.data.Dataset.range(16).batch(8))
    epoch = TFEpochIterator(x=distributed, distribute_strategy=strategy, shuffle=False)
    assert epoch.num_batches == 2
    (_, *iterators), = list(epoch.enumerate_epoch())[:1]
    iterator = iterators[-1]
    assert [next(iterator).numpy().tolist() for _ in range(2)] == [[4, 5, 6, 7],
                                                                   [12, 13, 14, 15]]


def test_a_distributed_dataset_iterates_inside_a_tf_function():
    strategy = Strategy(worker_config(index=1))
    distributed = strategy.experimental_distribute_dataset(tf.data.Dataset.range(16).batch(8))

    @tf.function
    def total(dataset):
        result = tf.constant(0, tf.int64)
        for batch in dataset:
            result += tf.reduce_sum(batch)
        return result

    @tf.function
    def total_of_captured():
        result = tf.constant(0, tf.int64)
        for batch in distributed:
            result += tf.reduce_sum(batch)
        return result

    assert int(total(distributed)) == int(total_of_captured()) == 4 + 5 + 6 + 7 + 12 + 13 + 14 + 15


def test_a_distributed_dataset_is_not_distributed_twice():
    strategy = Strategy(worker_config(index=1))
    distributed = strategy.experimental_distribute_dataset(tf.data.Dataset.range(8).batch(4))
    with pytest.raises(ValueError, match="already distributed"):
        strategy.experimental_distribute_dataset(distributed)
    with pytest.raises(ValueError, match="Received: list"):
        strategy.experimental_distribute_dataset([1, 2])


def _with_policy(dataset, policy):
    options = tf.data.Options()
    options.experimental_distribute.auto_shard_policy = policy
    return dataset.with_options(options)


def _write_shards(directory, files, rows_per_file):
    paths = []
    for k in range(files):
        path = str(directory / f"shard-{k}.tfrecord")
        with tf.io.TFRecordWriter(path) as writer:
            for r in range(rows_per_file):
                writer.write(str(k * rows_per_file + r).encode())
        paths.append(path)
    return paths


def _records(paths, batch):
    return (tf.data.Dataset.from_tensor_slices(paths)
            .interleave(tf.data.TFRecordDataset, cycle_length=1)
            .map(lambda s: tf.strings.to_number(s, tf.int64)).batch(batch))


@pytest.mark.parametrize("policy", [tf.data.experimental.AutoShardPolicy.AUTO,
                                    tf.data.experimental.AutoShardPolicy.FILE])
def test_file_sharding_reads_each_row_once_over_the_workers(tmp_path, policy):
    paths = _write_shards(tmp_path, files=4, rows_per_file=6)
    dataset = _with_policy(_records(paths, batch=4), policy)
    rows = []
    for index in range(2):
        strategy = Strategy(worker_config(index=index))
        steps = steps_of(strategy.experimental_distribute_dataset(dataset))
        assert all(len(s) <= 2 for s in steps), steps  # Each batch in W pieces.
        rows += [r for s in steps for r in s.tolist()]
    assert sorted(rows) == list(range(24))


def test_file_sharding_with_fewer_files_than_workers_is_refused(tmp_path):
    paths = _write_shards(tmp_path, files=1, rows_per_file=4)
    strategy = Strategy(worker_config(index=1))
    with pytest.raises(ValueError, match="fewer files than there are workers.*"
                                         "Received: auto_shard_policy=AUTO"):
        strategy.experimental_distribute_dataset(_records(paths, batch=2))


def test_data_sharding_of_files_splits_each_global_batch(tmp_path):
    paths = _write_shards(tmp_path, files=1, rows_per_file=8)
    dataset = _with_policy(_records(paths, batch=4), tf.data.experimental.AutoShardPolicy.DATA)
    strategy = Strategy(worker_config(index=1))
    assert [s.tolist() for s in steps_of(strategy.experimental_distribute_dataset(dataset))] \
        == [[2, 3], [6, 7]]


def test_the_tf_data_service_hint_policy_is_refused():
    dataset = _with_policy(tf.data.Dataset.range(8).batch(4),
                           tf.data.experimental.AutoShardPolicy.HINT)
    with pytest.raises(ValueError, match="Received: auto_shard_policy=HINT"):
        Strategy(worker_config(index=0)).experimental_distribute_dataset(dataset)


def test_no_sharding_gives_every_worker_every_row_in_pieces():
    dataset = _with_policy(tf.data.Dataset.range(8).batch(4),
                           tf.data.experimental.AutoShardPolicy.OFF)
    strategy = Strategy(worker_config(index=0))
    assert [s.tolist() for s in steps_of(strategy.experimental_distribute_dataset(dataset))] \
        == [[0, 1], [2, 3], [4, 5], [6, 7]]


def test_distribute_datasets_from_function_names_a_wrong_return_and_replication_mode():
    strategy = Strategy(worker_config())
    with pytest.raises(ValueError, match="must return a tf.data.Dataset. Received: list"):
        strategy.distribute_datasets_from_function(lambda context: [1, 2])
    options = tf.distribute.InputOptions(
        experimental_replication_mode=tf.distribute.InputReplicationMode.PER_REPLICA)
    with pytest.raises(NotImplementedError, match="PER_REPLICA"):
        strategy.experimental_distribute_dataset(tf.data.Dataset.range(2), options)


# -- which train steps the PS weights by rows ---------------------------------------------------

def _compiled(keras_module, loss):
    model = keras_module.Sequential([keras_module.Input((2,)), keras_module.layers.Dense(1)])
    model.compile("sgd", loss=loss)
    return model


@pytest.mark.parametrize("flavour", ["keras", "tf_keras"])
def test_mean_losses_are_weighted_by_rows_and_sums_are_not(flavour):
    import importlib

    from prophet_tf import whole_data
    K = importlib.import_module(flavour)
    assert whole_data.loss_divides_by_rows(_compiled(K, "mse"))
    assert whole_data.loss_divides_by_rows(_compiled(K, K.losses.MeanSquaredError()))
    assert not whole_data.loss_divides_by_rows(
        _compiled(K, K.losses.MeanSquaredError(reduction="sum")))
    with pytest.raises(ValueError, match="one kind. Received: reductions"):
        whole_data.loss_divides_by_rows(_compiled(K, [K.losses.MeanSquaredError(),
                                                      K.losses.MeanSquaredError(reduction="sum")]))


def test_a_loss_divided_by_its_own_sample_weights_is_refused():
    import keras

    from prophet_tf import whole_data
    with pytest.raises(ValueError, match="reduction='mean_with_sample_weight'"):
        whole_data.loss_divides_by_rows(
            _compiled(keras, keras.losses.MeanSquaredError(reduction="mean_with_sample_weight")))


def test_a_worker_optimizer_leaves_clipping_to_the_ps():
    """model.fit makes the worker push unclipped gradients; a custom loop's is refused."""
    import keras
    optimizer = keras.optimizers.SGD(0.1, clipvalue=0.5)
    with pytest.raises(ValueError, match=r"clip or accumulate.*'clipvalue': 0\.5"):
        keras_optimizer.check_worker_optimizer(optimizer)
    keras_optimizer.leave_to_the_ps(optimizer)
    keras_optimizer.check_worker_optimizer(optimizer)
    grads = [tf.constant([3.0, -4.0])]
    assert optimizer._clip_gradients(grads) is grads
    keras_optimizer.check_worker_optimizer(keras.optimizers.SGD(0.1))  # Nothing to clip.


def test_a_worker_optimizer_leaves_accumulation_to_the_ps():
    """With gradient_accumulation_steps Keras hands the strategy a gradient every
    N-th step only; the worker's optimizer hands over every step's instead, and
    keeps its accumulators (saved models hold the PS's) and raw step count."""
    import keras
    variable = keras.Variable(np.zeros(2, np.float32))
    optimizer = keras.optimizers.SGD(1.0, gradient_accumulation_steps=3)
    with pytest.raises(ValueError, match="'gradient_accumulation_steps': 3"):
        keras_optimizer.check_worker_optimizer(optimizer)
    keras_optimizer.leave_to_the_ps(optimizer)
    keras_optimizer.check_worker_optimizer(optimizer)
    for step in range(2):  # single-process Keras would apply nothing yet
        optimizer.apply([np.ones(2, np.float32)], [variable])
    np.testing.assert_array_equal(variable.numpy(), [-2.0, -2.0])
    assert keras_optimizer.steps_taken(optimizer) == 2 and optimizer.gradient_accumulation_steps == 3
    assert len(optimizer._accumulated_gradients) == 1


@pytest.mark.parametrize("flavour", ["keras3", "tf_keras"])
def test_custom_loops_average_moving_statistics_but_not_optimizer_variables(flavour):
    """A custom step may seem to write the worker optimizer's slots (a cond that captures
    them): averaging them over the workers would send the model's size for nothing."""
    import importlib
    keras = importlib.import_module("keras" if flavour == "keras3" else "tf_keras")
    strategy = Strategy(worker_config(index=0))
    with strategy.scope():
        layer = keras.layers.BatchNormalization(name="bn")
        layer.build((None, 3))
        optimizer = keras.optimizers.Adam(0.1)
        optimizer.build(layer.trainable_variables)
    tracked = strategy.extended.exchange._averaged
    names = sorted(v.name.split("/")[-1].split(":")[0] for v in tracked)
    assert names == ["moving_mean", "moving_variance"], [v.name for v in tracked]


def test_one_worker_s_forward_all_reduce_is_its_own_sum():
    strategy = Strategy(worker_config(spec={"worker": ["127.0.0.1:1001"],
                                            "ps": ["127.0.0.1:2001"]}))

    @tf.function
    def step(x):
        def replica(x):
            with tf.GradientTape():
                return tf.distribute.get_replica_context().all_reduce("sum", x)
        return strategy.run(replica, args=(x,))

    np.testing.assert_array_equal(step(tf.constant([1.0, 2.0])), [1.0, 2.0])


def test_only_whole_variable_optimizers_keep_variables_whole():
    """The workers then split only variables over max_partition_bytes (engine.start);
    clipping by norms, with or without accumulation, spreads them: the PS tasks agree
    on the norms."""
    import json

    import keras
    parse = lambda o: optimizer_policy.parse_config(keras_optimizer.config_json(o))  # noqa: E731
    for options in [{"clipnorm": 1.0}, {"global_clipnorm": 1.0}]:
        for accumulation in [{}, {"gradient_accumulation_steps": 2}]:
            config = parse(keras.optimizers.SGD(0.1, **options, **accumulation))
            assert not optimizer_policy.needs_whole_variables(config)
            assert optimizer_policy.clipnorm(config) == options.get("clipnorm")
            assert optimizer_policy.global_clipnorm(config) == options.get("global_clipnorm")
    with pytest.raises(ValueError, match="Received: clipnorm=-1.0"):
        optimizer_policy.clipnorm(parse(keras.optimizers.SGD(0.1, clipnorm=-1.0)))
    assert optimizer_policy.needs_whole_variables(parse(keras.optimizers.Lamb()))
    assert not optimizer_policy.needs_whole_variables(
        parse(keras.optimizers.SGD(0.1, clipvalue=1.0)))
    assert json.dumps(parse(keras.optimizers.Adam()))  # Plain: spread over the PS tasks.
    assert not optimizer_policy.needs_whole_variables(parse(keras.optimizers.Adam()))


def test_a_loss_scale_optimizer_s_inner_optimizer_leaves_clipping_to_the_ps():
    """Its inner apply gets the unscaled gradients: the PS clips those, as Keras does."""
    import keras
    optimizer = keras.optimizers.LossScaleOptimizer(keras.optimizers.SGD(0.1, clipnorm=1.0))
    keras_optimizer.clip_on_the_ps(optimizer)  # the earlier name of leave_to_the_ps
    assert keras_optimizer.left_to_the_ps(optimizer.inner_optimizer)
    keras_optimizer.check_worker_optimizer(optimizer.inner_optimizer)
