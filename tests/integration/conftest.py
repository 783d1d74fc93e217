"""Fixtures for real PS tasks in subprocesses on free ports, always reaped (see cluster.py)."""

import contextlib

import pytest

# Re-exported: other test modules import these from conftest.
from cluster import ROOT, reap as _reap, run_ps  # noqa: F401


@pytest.fixture(scope="module")
def ps2(tmp_path_factory):
    """One PS task for W=2 with 32-byte partitions, shared by a module."""
    with run_ps(tmp_path_factory.mktemp("ps2"), "--num-workers", "2",
                "--max-partition-bytes", "32") as ps:
        yield ps


@pytest.fixture
def start_ps(tmp_path):
    """Factory for PS tasks owned by one test."""
    stack = contextlib.ExitStack()
    count = 0

    def start(*args, tf_config=None):
        nonlocal count
        count += 1
        directory = tmp_path / f"ps{count}"
        directory.mkdir()
        return stack.enter_context(run_ps(directory, *args, tf_config=tf_config))

    with stack:
        yield start
