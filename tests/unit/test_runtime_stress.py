"""The native stress test of the op runtime (ops/tests/runtime_stress.cc).

It drives ops/runtime.cc from many threads at once and checks its invariants;
the `slow` variants run it under AddressSanitizer + UBSan (with leak checking)
and under ThreadSanitizer.
"""

import importlib.util
import pathlib
import re

import pytest

ROOT = pathlib.Path(__file__).resolve().parents[2]
_spec = importlib.util.spec_from_file_location("build_stress", ROOT / "ops" / "tests" / "build_stress.py")
build_stress = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(build_stress)

THREADS = 8
OK_LINE = re.compile(
    r"^runtime_stress: (\d+) operations in [\d.]+ s on (\d+) threads, seed \d+: OK$", re.MULTILINE)
SANITIZER_REPORTS = ("ERROR: AddressSanitizer", "ERROR: LeakSanitizer", "WARNING: ThreadSanitizer",
                     "runtime error:")


def _run(mode, seconds):
    # A missing sanitizer runtime fails here with the package to install
    # (build_stress.SanitizerMissing): the check must not pass unseen.
    proc = build_stress.run(mode, seconds, THREADS, capture=True)
    output = proc.stdout + proc.stderr
    tail = "\n".join(output.splitlines()[-80:])
    for report in SANITIZER_REPORTS:
        assert report not in output, f"{mode}: sanitizer report {report!r}:\n{tail}"
    assert "VIOLATION" not in output, f"{mode}: invariant violated:\n{tail}"
    assert proc.returncode == 0, f"{mode}: exit code {proc.returncode}:\n{tail}"
    match = OK_LINE.search(proc.stdout)
    assert match, f"{mode}: no OK line:\n{tail}"
    assert int(match.group(1)) > 0
    assert int(match.group(2)) == THREADS
    return proc.stdout


@pytest.mark.timeout(300)
def test_runtime_stress_plain():
    _run("plain", 3)


@pytest.mark.slow
@pytest.mark.timeout(600)
@pytest.mark.parametrize("mode", ["asan", "tsan"])
def test_runtime_stress_sanitized(mode):
    stdout = _run(mode, 20)
    # The sanitizers only see tensor buffers that are mallocs of their own.
    assert "allocator cpu" in stdout
