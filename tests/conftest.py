"""Suite-wide options and fixtures.

``--runslow`` runs the long variants marked ``slow``.
"""

import pytest

# pytest-xdist (`--dist loadfile`) hands whole modules to its processes in collection
# order. The longest go first, so that the many short ones fill the end: otherwise one
# process runs a long module alone at the end while the others are done (about 30 s of
# make test's 10 minutes). A stale order costs time, never a result.
LONGEST_FIRST = ("test_strategy.py", "test_tf_keras.py", "test_distributed_input.py",
                 "test_resilience.py", "test_scheduling.py", "test_examples.py",
                 "test_keras_answers.py", "test_saved_models.py", "test_packaging.py",
                 "test_mixed_precision.py", "test_fuzz.py", "test_doctor.py",
                 "test_transport_security.py", "test_evaluator.py", "test_emulated_compute.py")


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
