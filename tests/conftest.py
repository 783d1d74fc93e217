"""Suite-wide options and fixtures.

``--runslow`` runs the long variants marked ``slow``.
"""

import pytest

# pytest-xdist (`--dist loadfile`) hands whole modules to its processes in collection
# order (make test passes --no-loadscope-reorder: xdist's own reorder puts the modules
# with the most tests first, which are the short unit modules). The longest go first, so
# that the many short ones fill the end: otherwise one process runs a long module alone
# at the end while the others are done. Ordered by the modules' total time in one
# `make test` run (pytest --junitxml, 2026-12-06). A stale order costs time, never a result.
LONGEST_FIRST = ("test_strategy.py", "test_tf_keras.py", "test_resilience.py",
                 "test_distributed_input.py", "test_mixed_precision.py", "test_scheduling.py",
                 "test_fuzz.py", "test_examples.py", "test_doctor.py",
                 "test_transport_security.py", "test_saved_models.py", "test_keras_answers.py",
                 "test_evaluator.py", "test_bench_smoke.py", "test_ps_server.py",
                 "test_launch_output.py", "test_simulate.py", "test_device.py",
                 "test_servicer.py", "test_emulated_delay.py", "test_launch.py",
                 "test_emulated_compute.py", "test_sharding.py", "test_load.py",
                 "test_overlap.py")


def pytest_addoption(parser):
    parser.addoption("--runslow", action="store_true", default=False,
                     help="also run the tests marked slow (long variants)")


def pytest_collection_modifyitems(config, items):
    rank = {name: i for i, name in enumerate(LONGEST_FIRST)}
    items.sort(key=lambda item: rank.get(item.path.name, len(rank)))  # stable: the rest as found
    if config.getoption("--runslow"):
        return
    skip = pytest.mark.skip(reason="long variant: run with --runslow")
    for item in items:
        if "slow" in item.keywords:
            item.add_marker(skip)


@pytest.fixture(scope="session", autouse=True)
def children_tmpdir(tmp_path_factory):
    """Every child process's temporary files go under pytest's own temporary
    directory (which pytest prunes), not /tmp: a worker that a test kills
    cannot remove its own, such as TensorFlow's generated autograph sources."""
    path = tmp_path_factory.mktemp("children-tmp")
    with pytest.MonkeyPatch.context() as patch:
        patch.setenv("TMPDIR", str(path))
        yield path
