"""The simulator's compiled max-min filling (native/max_min.c) under
AddressSanitizer and UBSan: native/tests/max_min_check.c's random cases.
test_simulate_events.py checks its rates against numpy's."""
import os
import pathlib
import subprocess

import pytest

ROOT = pathlib.Path(__file__).resolve().parents[2]


@pytest.mark.timeout(120)
def test_max_min_passes_its_checks_under_sanitizers(tmp_path):
    binary = tmp_path / "max_min_check"
    cc = os.environ.get("CC", "gcc")
    subprocess.run([cc, "-fsanitize=address,undefined", "-fno-sanitize-recover=all",
                    "-fno-omit-frame-pointer", "-g", "-O1", "-Wall", "-Wextra", "-Werror",
                    str(ROOT / "native" / "max_min.c"),
                    str(ROOT / "native" / "tests" / "max_min_check.c"), "-o", str(binary), "-lm"],
                   check=True, timeout=100)
    env = dict(os.environ, ASAN_OPTIONS="detect_leaks=1:abort_on_error=0",
               UBSAN_OPTIONS="print_stacktrace=1:halt_on_error=1")
    run = subprocess.run([str(binary)], capture_output=True, text=True, timeout=100, env=env)
    assert run.returncode == 0, run.stderr[-4000:]
    assert run.stdout.strip() == "2000 cases passed"
