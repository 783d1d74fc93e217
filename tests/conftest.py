"""Suite-wide options and fixtures.

``--runslow`` runs the long variants marked ``slow``.
"""

import pytest


def pytest_addoption(parser):
    parser.addoption("--runslow", action="store_true", default=False,
                     help="also run the tests marked slow (long variants)")


def pytest_collection_modifyitems(config, items):
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
